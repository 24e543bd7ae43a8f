"""Mixed precision and non-finite gradients in TensorFlow / Keras 3.

Single process: the ArrayOps behind loss scaling and the non-finite verdict, and
how dlgs composes with ``keras.optimizers.LossScaleOptimizer`` (the nesting
that would hang is refused with an error saying what to write). Two real ranks
(Gloo and MPI): one horovodrun launch per backend, with a time limit, runs every
scenario of ``tests/parallel/tf_amp_worker.py``; each test asserts on one
scenario's numbers from both ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import (
    bind_horovod,
    check_fault_injection,
    check_scaled_conservation,
    tf_ranks,
    tf_single_thread,
    value,
)

tf = pytest.importorskip("tensorflow")
hvd = pytest.importorskip("horovod.tensorflow")
keras = pytest.importorskip("keras")

import dlgs.tensorflow  # noqa: E402
import dlgs.tensorflow.keras  # noqa: E402
from dlgs.tensorflow._amp import scale_reader  # noqa: E402
from dlgs.tensorflow._ops import OPS  # noqa: E402

FAULT_STEPS = {5: "mlp/d1/kernel", 9: "mlp/d1/kernel", 13: "mlp/d2/bias"}


@pytest.fixture(scope="module", autouse=True)
def horovod():
    tf_single_thread(tf)
    bind_horovod(hvd)
    hvd.init()
    yield


def _model(name="m"):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(64, name="a"), keras.layers.Dense(4, name="b")],
        name=name,
    )


def _lso(**kw):
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), **kw)


# -- one process ----------------------------------------------------------------


def test_loss_scaling_array_ops():
    like = tf.zeros([3])
    nan, inf = np.float32(np.nan), np.float32(np.inf)
    out, a = OPS.zeros(5, "float32", like), OPS.zeros(5, "float32", like)
    OPS.copy_(a, tf.constant([1.0, 2, 3, 4, 5]))
    # add_into_: out = a + b * scale into a view, b of another shape and dtype.
    OPS.add_into_(OPS.narrow(out, 0, 1, 3), OPS.narrow(a, 0, 0, 3), tf.constant([[1.0, 1, 1]]), 0.5)
    assert out.numpy().tolist() == [0, 1.5, 2.5, 3.5, 0]
    OPS.add_into_(OPS.narrow(out, 0, 0, 2), OPS.narrow(a, 0, 3, 2), tf.constant([2.0, 2]), None)
    assert out.numpy()[:2].tolist() == [6, 7]
    got = OPS.add_into_(
        tf.zeros([2]), tf.ones([2]), tf.constant([1, 2], tf.float16), tf.constant(2.0)
    )
    assert got.numpy().tolist() == [3, 5]
    # momentum_into_: out = m v + g * scale.
    v, vn = OPS.zeros(4, "float32", like), OPS.zeros(4, "float32", like)
    OPS.copy_(v, tf.constant([1.0, 2, 3, 4]))
    OPS.momentum_into_(vn, v, 0.5, tf.ones([4]), tf.constant(0.25))
    assert vn.numpy().tolist() == [0.75, 1.25, 1.75, 2.25]
    OPS.momentum_into_(OPS.narrow(vn, 0, 0, 2), OPS.narrow(v, 0, 2, 2), 0.5, tf.ones([2]), None)
    assert vn.numpy().tolist() == [2.5, 3, 1.75, 2.25]
    assert OPS.mul(a, tf.constant(2.0)).numpy().tolist() == [2, 4, 6, 8, 10]
    assert float(OPS.reciprocal(tf.constant(4.0, tf.float16))) == 0.25
    assert OPS.reciprocal(np.float32(8)) == 0.125
    # The sum of magnitudes propagates NaN and inf: the finite check relies on it.
    for x, finite in [
        ([1, -3, 2], True),
        ([1, nan, 2], False),
        ([inf, 1], False),
        ([-inf, 1], False),
        ([2, nan], False),
    ]:
        assert bool(OPS.below_inf(OPS.total(tf.abs(tf.constant(x, tf.float32))))) == finite, x
    big = np.ones(100_001, np.float32)
    big[77_777] = nan
    assert not bool(OPS.below_inf(OPS.total(tf.constant(big))))
    for ok in (np.bool_(False), tf.constant(False)):
        flagged = OPS.count_or_flag(tf.constant(7, tf.int32), ok)
        assert OPS.to_host(flagged) == -1 and flagged.dtype == tf.int32
    assert OPS.to_host(OPS.count_or_flag(tf.constant(7), np.bool_(True))) == 7
    counts = tf.constant([1, -1, 3, 2, 0, -1], tf.int32)
    assert OPS.to_host(OPS.any_negative_rows(counts, 2)) == [False, True, True]
    assert OPS.to_host(OPS.any_nonfinite([tf.ones([2]), OPS.narrow(a, 0, 1, 2)])) is False
    assert OPS.to_host(OPS.any_nonfinite([tf.ones([2]), tf.constant([[1.0, inf]])])) is True
    assert OPS.to_host(OPS.any_nonfinite([tf.constant(nan)])) is True
    assert OPS.to_host(OPS.any_true([tf.constant([False, False]), tf.constant(False)])) is False
    assert OPS.to_host(OPS.any_true([tf.constant([False, True]), np.bool_(False)])) is True
    # nan_at_: NaN at the flagged members' first slots, other slots untouched.
    dense = OPS.zeros(5, "float32", like)
    OPS.copy_(dense, tf.constant([1.0, 2, 3, 4, 5]))
    first = OPS.index_vector([0, 3], like)
    OPS.nan_at_(dense, first, tf.constant([False, False]))
    assert dense.numpy().tolist() == [1, 2, 3, 4, 5]
    OPS.nan_at_(dense, first, tf.constant([False, True]))
    got = dense.numpy()
    assert np.isnan(got[3]) and got[[0, 1, 2, 4]].tolist() == [1, 2, 3, 5]


def test_keras_optimizer_wrapping_a_loss_scale_optimizer_is_one():
    inner = _lso(initial_scale=2.0**12)
    opt = dlgs.tensorflow.keras.DistributedOptimizer(inner, density=0.1, name="amp.wrap")
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer)
    assert opt.get_config() == inner.get_config()
    assert opt.dlgs.extra_options["loss_scaler"] is True
    plain = dlgs.tensorflow.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), name="amp.p")
    assert plain.dlgs.extra_options["loss_scaler"] is False
    # Reads initial_scale until built (what scale_loss() uses), then the live variable.
    read = opt.dlgs.loss_scale
    assert float(read()) == 2.0**12
    model = _model()
    opt.build(model.trainable_variables)
    opt.dynamic_scale.assign(64.0)
    assert float(read()) == 64.0
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _model("m16")
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        assert model.optimizer is opt  # compile does not wrap it a second time
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_loss_scale_optimizer_around_dlgs_is_refused_saying_what_to_write():
    x = np.ones((8, 8), np.float32)
    y = np.ones((8, 4), np.float32)
    # compile() under mixed_float16 wraps a plain optimizer in a LossScaleOptimizer.
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _model("auto")
        opt = dlgs.tensorflow.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), name="amp.a")
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        with pytest.raises(ValueError, match=r"must wrap the LossScaleOptimizer") as err:
            model.fit(x, y, verbose=0)
        assert "DistributedOptimizer(\n        keras.optimizers.LossScaleOptimizer(" in str(
            err.value
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # The same nesting written by hand, in a custom loop.
    model = _model("hand")
    outer = keras.optimizers.LossScaleOptimizer(
        dlgs.tensorflow.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), name="amp.h")
    )
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x))
    grads = tape.gradient(outer.scale_loss(loss), model.trainable_variables)
    with pytest.raises(ValueError, match="must wrap the LossScaleOptimizer"):
        outer.apply(grads, model.trainable_variables)
    with pytest.raises(ValueError, match="must wrap the LossScaleOptimizer"):
        dlgs.tensorflow.keras.DistributedOptimizer(outer)


def test_scaler_must_be_a_loss_scale_optimizer():
    model = _model()
    with tf.GradientTape() as tape:
        pass
    for bad in (keras.optimizers.SGD(0.1), 1024.0):
        with pytest.raises(TypeError, match="LossScaleOptimizer"):
            dlgs.tensorflow.DistributedGradientTape(tape, name="amp.bad", scaler=bad)
        with pytest.raises(TypeError, match="LossScaleOptimizer"):
            dlgs.tensorflow.Compression(model.trainable_variables, name="amp.badc", scaler=bad)
    assert scale_reader(None) is None


# -- two real ranks -----------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    # The Gloo launch test_tensorflow.py shares (under MPI it runs the diagonal).
    return tf_ranks("gloo", tmp_path_factory)


@pytest.mark.parallel
def test_keras_fit_mixed_float16_matches_dense_horovod(ranks):
    r0, r1 = value(ranks, "amp_fit")
    for form, run in r0.items():
        d0, d1 = run["digests"], r1[form]["digests"]
        first = next((i for i in range(len(d0)) if d0[i] != d1[i]), None)
        assert first is None, f"{form}: weights differ across ranks from batch {first}"
        assert run["finite"] and r1[form]["finite"], f"{form}: non-finite weights"
    dense, sparse = r0["horovod"], r0["dlgs"]
    # The loss scale starts at 2**30: the first steps overflow by design.
    assert dense["skipped"] >= 5, dense["skipped"]
    assert dense["accuracy"] > 75.0, f"Horovod baseline did not train: {dense['accuracy']}"
    # Density 1.0 is Horovod's allreduce, bit for bit, skipped steps included.
    assert r0["dlgs_dense"]["digests"] == dense["digests"]
    assert abs(sparse["skipped"] - dense["skipped"]) <= 2, (sparse["skipped"], dense["skipped"])
    assert sparse["nonfinite_steps"] == sparse["skipped"]  # dlgs' verdict is the scaler's
    assert sparse["accuracy"] >= dense["accuracy"] - 1.0, (sparse["accuracy"], dense["accuracy"])
    assert sparse["sparse_layers"] == ["amp_mlp/fc1/kernel", "amp_mlp/fc2/kernel"]


@pytest.mark.parallel
def test_tf_nonfinite_gradient_on_one_rank_is_seen_and_undone_everywhere(ranks):
    r0, r1 = value(ranks, "fault_injection")
    check_fault_injection(r0, r1, FAULT_STEPS)
    for case, rec in r0.items():
        assert len(rec["sparse_layers"]) == 3, (case, rec["sparse_layers"])
    # The loss scaler, fed the tape's output, skips exactly those steps on every rank.
    for rec in (r0["scaler"], r1["scaler"], r0["compression_scaler"], r1["compression_scaler"]):
        assert [s for s, x in enumerate(rec["scaler_skipped"]) if x] == sorted(FAULT_STEPS)


@pytest.mark.parallel
def test_tf_residual_holds_unscaled_gradient_across_scale_changes_and_skips(ranks):
    check_scaled_conservation(value(ranks, "scaled_conservation"))
