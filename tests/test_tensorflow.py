"""The TensorFlow / Keras 3 adapter.

Single process (real Horovod, size 1): API surface, errors for bad input, the
ArrayOps views. Two real ranks under ``horovodrun`` (Gloo and MPI): one launch
per backend runs every scenario of ``tests/parallel/tf_worker.py`` and each
test asserts on one scenario's numbers from both ranks.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import (
    ROOT,
    bind_horovod,
    check_resume_recipe,
    gloo_value,
    horovodrun,
    load_ranks,
    tf_ranks,
    tf_single_thread,
    value,
)

tf = pytest.importorskip("tensorflow")
hvd = pytest.importorskip("horovod.tensorflow")
keras = pytest.importorskip("keras")

import dlgs  # noqa: E402
import dlgs.tensorflow  # noqa: E402
import dlgs.tensorflow.keras  # noqa: E402
from dlgs.tensorflow._ops import OPS, _read  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def horovod():
    tf_single_thread(tf)
    bind_horovod(hvd)
    hvd.init()
    yield


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(64, name="a"), keras.layers.Dense(4, name="b")],
        name="m",
    )


# -- one process ----------------------------------------------------------------


def test_importing_dlgs_and_dlgs_torch_does_not_import_tensorflow():
    code = textwrap.dedent(
        """
        import sys
        import dlgs, dlgs.core, dlgs._options
        import dlgs.torch
        assert "tensorflow" not in sys.modules and "keras" not in sys.modules, sorted(
            m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras"))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


BAD = [
    (dict(density=0.0), ValueError, ["density", "(0, 1]"]),
    (dict(density=1.01), ValueError, ["density", "(0, 1]"]),
    (dict(density="0.01"), TypeError, ["density"]),
    (dict(controller="bogus"), ValueError, ["controller", "'dynamic'"]),
    (dict(max_ratio=20), ValueError, ["max_ratio", "[1.0, 16.0]"]),
    (dict(no_such_option=1), TypeError, ["no_such_option"]),
    (dict(op=hvd.Adasum), ValueError, ["op"]),
    (dict(num_groups=2), ValueError, ["groups"]),
    (dict(log_every=-1), ValueError, ["log_every", ">= 0"]),
    (dict(merge="fastest"), ValueError, ["merge", "'dp'"]),
    (dict(merge=3), TypeError, ["merge"]),
    (dict(max_group=0), ValueError, ["max_group", ">= 1"]),
    (dict(profile_steps=0), ValueError, ["profile_steps", ">= 1"]),
    (dict(drift_window=-1), ValueError, ["drift_window", ">= 0"]),
    (dict(gradient_predivide_factor=2.0, op=hvd.Sum), ValueError, ["gradient_predivide_factor"]),
    (dict(config="x"), TypeError, ["config"]),
    (dict(config=dlgs.SparsityConfig(), density=0.5, momentum=0.9), ValueError, ["config="]),
]


@pytest.mark.parametrize("kwargs, exc, words", BAD)
def test_tape_rejects_bad_options_naming_them(kwargs, exc, words):
    with tf.GradientTape() as tape:
        pass
    with pytest.raises(exc) as err:
        dlgs.tensorflow.DistributedGradientTape(tape, name="bad", **kwargs)
    for w in words:
        assert w in str(err.value), str(err.value)


@pytest.mark.parametrize("kwargs, exc, words", BAD)
def test_keras_optimizer_rejects_bad_options_naming_them(kwargs, exc, words):
    with pytest.raises(exc) as err:
        dlgs.tensorflow.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), **kwargs)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_every_door_refuses_horovod_elastic_saying_why(monkeypatch):
    """Under Horovod Elastic (horovodrun sets HOROVOD_ELASTIC=1) a reset would
    restore TensorFlowKerasState, which does not hold dlgs' residuals: every
    TensorFlow door refuses at construction, naming Elastic and the reason."""
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    with tf.GradientTape() as tape:
        pass
    variables = [tf.Variable(tf.zeros([4]))]
    for build in (
        lambda: dlgs.tensorflow.DistributedGradientTape(tape, name="elastic.tape"),
        lambda: dlgs.tensorflow.keras.DistributedOptimizer(keras.optimizers.SGD(0.1)),
        lambda: dlgs.tensorflow.Compression(variables, name="elastic.c"),
    ):
        with pytest.raises(ValueError) as err:
            build()
        assert "Horovod Elastic" in str(err.value) and "residuals" in str(err.value)


def test_wrong_types_and_unsupported_arguments():
    with pytest.raises(TypeError, match="tf.GradientTape"):
        dlgs.tensorflow.DistributedGradientTape(object())
    with pytest.raises(TypeError, match="keras.optimizers.Optimizer"):
        dlgs.tensorflow.keras.DistributedOptimizer(object())
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        dlgs.tensorflow.keras.DistributedOptimizer(
            keras.optimizers.SGD(0.1), backward_passes_per_step=2
        )
    m = _model()
    comp = dlgs.tensorflow.Compression(m.trainable_variables, name="types.c")
    with tf.GradientTape() as tape:
        pass
    with pytest.raises(TypeError, match="Horovod's own tape"):
        dlgs.tensorflow.DistributedGradientTape(tape, compression=comp)
    with pytest.raises(ValueError, match="density"):
        dlgs.tensorflow.Compression(m.trainable_variables, density=2.0)


def test_same_name_other_options_is_an_error_and_same_options_continue():
    m = _model()
    x = tf.ones([2, 8])
    tapes = []
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(m(x))
        tape = dlgs.tensorflow.DistributedGradientTape(tape, density=0.1, name="cont", merge="none")
        tape.gradient(loss, m.trainable_variables)
        tapes.append(tape)
    assert tapes[0].dlgs.exchange is tapes[1].dlgs.exchange
    assert tapes[1].dlgs.exchange.step == 2
    assert not hasattr(tapes[1], "dlgs_exchange")  # the dlgs 0.1 names are gone
    with tf.GradientTape() as tape:
        pass
    with pytest.raises(ValueError, match="name="):
        dlgs.tensorflow.DistributedGradientTape(tape, density=0.2, name="cont", merge="none")


def test_an_exchange_is_reachable_by_name_and_takes_a_state_before_its_first_step():
    """The recipe for tapes created inside tf.function: one eager tape creates
    the engine; state restored into it applies when the first step builds."""
    with pytest.raises(KeyError, match="no dlgs exchange named"):
        dlgs.tensorflow.exchange("by.name")
    m = _model()
    x = tf.ones([2, 8])
    kw = dict(density=0.1, name="by.name", merge="none")
    eng = dlgs.tensorflow.DistributedGradientTape(tf.GradientTape(), **kw).dlgs
    assert dlgs.tensorflow.exchange("by.name") is eng and eng.exchange is None
    saved = None
    for step in range(2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(m(x))
        dlgs.tensorflow.DistributedGradientTape(tape, **kw).gradient(loss, m.trainable_variables)
        if step == 0:
            saved = eng.state_dict()
    assert eng.exchange.step == 2
    # A fresh engine (another name) loads the state before any step...
    kw2 = dict(kw, name="by.name.2")
    eng2 = dlgs.tensorflow.DistributedGradientTape(tf.GradientTape(), **kw2).dlgs
    eng2.load_state_dict(saved)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(m(x))
    dlgs.tensorflow.DistributedGradientTape(tape, **kw2).gradient(loss, m.trainable_variables)
    assert eng2.exchange.step == 2  # ... and resumed at step 1


def test_compression_created_anew_with_one_name_continues_one_exchange():
    """The README's per-step pattern: a Compression built inside the step keeps
    its residuals, thresholds and plan under its name, as the tape does."""
    m = _model()
    variables = [v.value for v in m.trainable_variables]
    a = dlgs.tensorflow.Compression(variables, density=0.1, name="comp.cont", merge="none")
    b = dlgs.tensorflow.Compression(variables, density=0.1, name="comp.cont", merge="none")
    assert a.dlgs is b.dlgs and a.dlgs.exchange is b.dlgs.exchange
    with pytest.raises(ValueError, match="name="):
        dlgs.tensorflow.Compression(variables, density=0.2, name="comp.cont", merge="none")
    with pytest.raises(ValueError, match="name="):
        dlgs.tensorflow.Compression(variables[:1], density=0.1, name="comp.cont", merge="none")


def test_duplicate_variable_names_and_other_variables_are_errors():
    a = tf.Variable(tf.ones([4]), name="w")
    b = tf.Variable(tf.ones([4]), name="w")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(a * b)
    tape = dlgs.tensorflow.DistributedGradientTape(tape, name="dups")
    with pytest.raises(ValueError, match="unique"):
        tape.gradient(loss, [a, b])
    c = tf.Variable(tf.ones([4]), name="c")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(c)
    dlgs.tensorflow.DistributedGradientTape(tape, name="other").gradient(loss, [c])
    d = tf.Variable(tf.ones([4]), name="d")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(d)
    with pytest.raises(ValueError, match="other variables"):
        dlgs.tensorflow.DistributedGradientTape(tape, name="other").gradient(loss, [d])


def test_keras_variables_keyed_by_path_none_and_indexed_slices():
    keras.utils.set_random_seed(1)
    emb = keras.layers.Embedding(50, 8, name="emb")
    dense = keras.layers.Dense(3, name="out")
    unused = keras.Variable(tf.zeros([5]), name="unused")
    x = tf.constant([[1, 2, 3]])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(dense(emb(x)))
    variables = emb.trainable_variables + dense.trainable_variables + [unused]
    tape = dlgs.tensorflow.DistributedGradientTape(
        tape, density=0.1, min_sparse_size=8, name="kv", merge="none"
    )
    grads = tape.gradient(loss, variables)
    assert grads[-1] is None  # no gradient here: none back (it took part as zeros)
    assert isinstance(grads[0], tf.Tensor) and grads[0].shape == (50, 8)  # densified
    names = [layer.name for layer in tape.dlgs.exchange.layers]
    assert "emb/embeddings" in names and "out/kernel" in names
    stats = tape.dlgs.stats()
    assert any(row["sparse"] for row in stats)


def test_views_write_through_and_read_back():
    buf = OPS.zeros(9, "int32", None)
    fview = OPS.narrow(OPS.view_as(OPS.narrow(buf, 0, 1, 6), "float16"), 0, 3, 5)
    OPS.copy_(fview, tf.constant([1.5, -2.0, 3.25, 0.5, 7.0]))
    assert _read(fview).numpy().tolist() == [1.5, -2.0, 3.25, 0.5, 7.0]
    assert _read(buf).numpy()[0] == 0 and _read(buf).numpy()[-1] == 0  # untouched words
    res = OPS.zeros(6, "float32", None)
    OPS.add_(OPS.narrow(res, 0, 0, 5), tf.constant([1.0, 2.0, 3.0, 4.0, 5.0]))
    idx = tf.constant([1, 3, 5])
    out = OPS.zeros(3, "float32", None)
    OPS.gather_(res, idx, out)
    OPS.fill_at_(res, idx, 0.0)
    assert _read(out).numpy().tolist() == [2.0, 4.0, 0.0]
    assert _read(res).numpy().tolist() == [1.0, 0.0, 3.0, 0.0, 5.0, 0.0]
    mask = OPS.ge_(tf.constant([0.1, 0.9, 0.5, 0.95]), tf.constant(0.5), None)
    assert OPS.nonzero_static(mask, 2, 4).numpy().tolist() == [1, 2]
    assert OPS.nonzero_static(mask, 5, 4).numpy().tolist() == [1, 2, 3, 4, 4]


def test_unpack_adds_rows_in_rank_order():
    rng = np.random.default_rng(0)
    n, width, rows = 3000, 1500, 4
    idx = np.stack([rng.permutation(n)[:width] for _ in range(rows)]).astype(np.int32)
    scales = 10.0 ** rng.integers(-3, 4, (rows, width))
    vals = (rng.standard_normal((rows, width)) * scales).astype(np.float32)
    expect = np.zeros(n, np.float32)
    for r in range(rows):  # float32, row after row: what every rank must get
        expect[idx[r]] += vals[r] * np.float32(0.25)
    dst = OPS.zeros(n, "float32", None)
    OPS.index_add_rows_(
        dst, tf.constant(idx.reshape(-1)), tf.constant(vals.reshape(-1)), 0.25, rows
    )
    assert np.array_equal(_read(dst).numpy(), expect)


def test_checkpoint_round_trip_single_process(tmp_path):
    m = _model()
    opt = dlgs.tensorflow.keras.DistributedOptimizer(
        keras.optimizers.SGD(0.1), density=0.05, merge="none", min_sparse_size=64, name="ck"
    )
    x = tf.random.stateless_normal([4, 8], seed=[1, 2])
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(m(x) ** 2)
        opt.apply(tape.gradient(loss, m.trainable_variables), m.trainable_variables)
    ex = opt.dlgs.exchange
    before = {
        lay.name: lay.residual.numpy().copy() for lay in ex.layers if lay.residual is not None
    }
    assert before and any(abs(r).sum() > 0 for r in before.values())
    path = tf.train.Checkpoint(dlgs=opt.dlgs.trackable).save(str(tmp_path / "ck"))
    opt2 = dlgs.tensorflow.keras.DistributedOptimizer(
        keras.optimizers.SGD(0.1), density=0.05, merge="none", min_sparse_size=64, name="ck"
    )
    tf.train.Checkpoint(dlgs=opt2.dlgs.trackable).restore(path)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(m(x) * 0.0)
    opt2.apply(tape.gradient(loss, m.trainable_variables), m.trainable_variables)
    assert opt2.dlgs.exchange.step == 4
    # Zero gradient this step: residual now = restored residual minus what was sent.
    ex2 = opt2.dlgs.exchange
    for lay in ex2.layers:
        if lay.name in before:
            assert abs(lay.residual.numpy()).sum() <= abs(before[lay.name]).sum() + 1e-6
            assert abs(lay.residual.numpy()).sum() > 0


# -- two real ranks -----------------------------------------------------------------


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def ranks(request, tmp_path_factory):
    # conftest's TF_SCENARIOS: MPI runs the diagonal.
    return tf_ranks(request.param, tmp_path_factory)


@pytest.mark.parallel
def test_tf_both_forms_match_the_reference_with_plans_and_flushes(ranks, request):
    """Every rank's reduced gradients and residuals against tests/reference.py,
    step by step, through a merged plan, a dense plan (flush) and back, in the
    tape form and the sparse Compression form (Horovod's tape, num_groups=1)."""
    if request.node.callspec.params["ranks"] != "gloo":
        pytest.skip("run under Gloo only (the arithmetic does not depend on the transport)")
    for r, v in enumerate(value(ranks, "against_reference")):
        assert len(v) == 8
        for case, rec in v.items():
            assert rec["modes"] == 0, f"rank {r} {case}: sparse layers differ from the rule"
            assert rec["out"] <= 1e-5, f"rank {r} {case}: reduced gradient off: {rec}"
            assert rec["residual"] <= 1e-5, f"rank {r} {case}: residual off: {rec}"


@pytest.mark.parallel
def test_tf_density_one_equals_horovod_allreduce(ranks):
    r0, r1 = value(ranks, "dense_equivalence")
    forms = ("tape_eager", "tape_function", "tape_reduce", "compression", "keras_sgd", "keras_adam")
    forms += ("fp16_eager", "fp16_function")  # dense_dtype="float16" against Compression.fp16
    for form in forms:
        for r, v in enumerate((r0, r1)):
            assert v[form]["max_diff"] <= 1e-6, f"rank {r} {form}: {v[form]['max_diff']}"
        assert r0[form]["digests"] == r1[form]["digests"], f"{form}: ranks differ"
        assert len(set(r0[form]["digests"])) == len(r0[form]["digests"]), f"{form}: no training"


@pytest.mark.parallel
def test_tf_at_most_k_nonzeros_reconstructed_exactly(ranks):
    for r, v in enumerate(value(ranks, "exact_reconstruction")):
        for case, rec in v.items():
            assert rec["max_diff"] == 0.0, f"rank {r} {case}: max |diff| {rec['max_diff']}"
        assert v["topk"]["sparse_layers"] >= 3
        assert v["merged_groups"]["sparse_messages"] == 1
        # TensorFlow's collectives have the alltoall: the reduction runs, eagerly
        # and in a tf.function (on its host path).
        assert v["reduce"]["transport"] == v["reduce_in_function"]["transport"] == "reduce"
        # Traced again once laid out (after step 0); the new trace's first step
        # on the host (the ranks agree it is traced everywhere), then the device.
        assert v["in_graph"]["steps"] == 4 and v["in_graph"]["device_steps"] == 2, v["in_graph"]


@pytest.mark.parallel
def test_the_exchange_traced_into_the_graph_equals_the_eager_one(ranks):
    """A custom loop under dlgs.tensorflow.function runs the exchange
    in the graph once it is laid out (traced once per layout, one host step per
    layout, none per step after), bit for bit as the same steps run eagerly;
    density 1.0 there is Horovod's allreduce; model.fit is traced again by itself."""
    r0, r1 = gloo_value(ranks, "graph_exchange")
    for case in ("eager", "graph", "dynamic.eager", "dynamic.graph", "logging.graph"):
        assert r0[case]["digests"] == r1[case]["digests"], f"{case}: ranks differ"
    # Momentum correction runs on the device too: bit for bit as eagerly.
    for v in (r0, r1):
        assert v["momentum.graph"]["digests"] == v["momentum.eager"]["digests"]
    assert r0["momentum.graph"]["digests"] == r1["momentum.graph"]["digests"]
    assert r0["momentum.graph"]["host_steps"] == 4, r0["momentum.graph"]
    assert r0["fit"] == r1["fit"] and r0["dense"] == r1["dense"]
    for v in (r0, r1):  # each rank's residuals, as eagerly
        assert v["graph"]["residuals"] == v["eager"]["residuals"]
    eager, graph = r0["eager"], r0["graph"]
    assert graph["digests"] == eager["digests"]
    assert graph["step"] == eager["step"] == 10
    # Step 0 builds and lays out (host), step 1 is the new trace's first (on
    # the host: the ranks agree that it is traced everywhere); the new plan
    # after step 5: step 6 lays it out, step 7 is the next trace's first; the
    # other six steps on the device.
    assert graph["retraces"] == 2 and graph["traces"] == 2, graph
    assert graph["host_steps"] == 4, graph
    assert eager["traces"] == 0 and eager["host_steps"] == 10
    assert r0["dense"]["max_diff"] <= 1e-6 and r0["dense"]["step"] == 4
    assert r0["dense"]["host_steps"] == 2
    fit = r0["fit"]
    assert fit["step"] == 20 and fit["traces"] == 1 and fit["host_steps"] == 2, fit
    # Four steps per call (a while loop in the graph), anchors every 2 steps:
    # host and graph steps alternate inside one call, and the result is the
    # same as one step per call (the new trace is used from the next call on).
    fit4, fit1 = r0["fit4"], r0["fit1"]
    assert fit4["digest"] == fit1["digest"] and fit4["step"] == fit1["step"] == 20
    assert fit4["traces"] == fit1["traces"] == 1, (fit4, fit1)
    assert fit1["host_steps"] == 11 and fit4["host_steps"] < 20, (fit4, fit1)
    # The default controller learns on the device (its float64 update in
    # TensorFlow ops; NumPy's on the host); its anchors (every 4 steps here)
    # and the new layout's first step run on the host.
    dyn_eager, dyn_graph = r0["dynamic.eager"], r0["dynamic.graph"]
    diff = np.abs(np.array(dyn_eager["params"]) - np.array(dyn_graph["params"])).max()
    assert diff <= 1e-6, diff
    assert dyn_graph["step"] == 10 and dyn_graph["traces"] == 2
    assert dyn_graph["host_steps"] <= 6, dyn_graph
    # log_every=3 on rank 0 alone: the ranks agreed on rank 0's limit (host
    # steps where it logs), and trained as the plain graph run did.
    logging_run = r0["logging.graph"]
    assert logging_run["digests"] == graph["digests"]
    assert r0["logging.graph"]["host_steps"] == r1["logging.graph"]["host_steps"] > 2


@pytest.mark.parallel
def test_tf_error_feedback_conserves_gradient(ranks):
    for r, v in enumerate(value(ranks, "conservation")):
        for case, rec in v.items():
            assert rec["sparse_layers"] >= 3, f"rank {r} {case}: {rec}"
            assert rec["max_error"] <= 1e-5 * rec["scale"], f"rank {r} {case}: {rec}"


@pytest.mark.parallel
def test_keras_fit_keeps_ranks_identical_every_batch(ranks):
    r0, r1 = gloo_value(ranks, "fit_identical")
    assert set(r0) == set(r1)
    for case in r0:
        d0, d1 = r0[case]["digests"], r1[case]["digests"]
        first = next((i for i in range(len(d0)) if d0[i] != d1[i]), None)
        assert first is None, f"{case}: weights differ across ranks from batch {first}"
        assert len(set(d0)) == len(d0) >= 8, f"{case}: weights did not change every batch"
        assert r0[case]["finite"], case
    for case in ("eager_none", "momentum_correction", "fp16_values_dgc"):
        assert r0[case]["sparse_layers"] >= 3, f"{case}: {r0[case]}"
    for case in ("compiled_dp", "momentum_correction", "fp16_values_dgc"):
        assert r0[case]["planned"], f"{case}: no merge plan was made"


@pytest.mark.parallel
def test_tf_checkpoint_resumes_bit_identically(ranks):
    for r, v in enumerate(gloo_value(ranks, "resume")):
        assert v["resumed"] == v["straight"], f"rank {r}: resumed run differs"
        assert v["without_dlgs_state"][-1] != v["straight"][-1], "control: state had no effect"


@pytest.mark.parallel
def test_tf_a_load_on_one_rank_in_the_middle_of_fit_goes_on_with_ranks_identical(ranks):
    r0, r1 = gloo_value(ranks, "one_rank_load")
    assert r0 == r1 and r0["step"] == 9, (r0, r1)
    for door in ("tape", "compression"):
        assert r0[door]["step"] == 9 and len(set(r0[door]["digests"])) == 9, door


@pytest.mark.parallel
def test_tf_rank_disagreement_and_ungrouped_compression_are_errors(ranks):
    for r, v in enumerate(gloo_value(ranks, "mismatch")):
        assert v["model"] and "shape" in v["model"], f"rank {r}: {v['model']!r}"
        assert v["function"] and "shape" in v["function"], f"rank {r}: {v['function']!r}"
        assert v["options"] and "density" in v["options"], f"rank {r}: {v['options']!r}"
        assert v["ungrouped"] and "num_groups=1" in v["ungrouped"], f"rank {r}: {v['ungrouped']!r}"


# -- convergence on real data (slow) --------------------------------------------------

# One epoch over all 60,000 training images (30,000 per rank), FashionCNN in Keras.
CONVERGENCE_ARGS = (1, 0, "cnn")


@pytest.fixture(scope="module")
def fashion_runs(tmp_path_factory):
    from benchmarks.datasets import FASHION_MNIST_DIR

    if not (FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        pytest.skip(f"Fashion-MNIST not found in {FASHION_MNIST_DIR}")
    out = tmp_path_factory.mktemp("tf-convergence")
    horovodrun(
        "gloo",
        2,
        [ROOT / "tests/parallel/tf_convergence.py", out, *CONVERGENCE_ARGS],
        timeout=900,
    )
    return load_ranks(out, 2)


@pytest.mark.slow
@pytest.mark.parallel
def test_keras_fit_density_001_within_2_points_of_dense(fashion_runs):
    # One epoch, learning rate annealed to zero (tests/parallel/tf_convergence.py):
    # measured 86.92% dense, 85.36% dlgs, 85.31% with a controller gain changed by
    # 0.05% (stable); with a constant rate the same perturbation moved dlgs from
    # 85.33% to 82.17%, which a 1.5-point margin could not tell from a regression.
    for r, run in enumerate(fashion_runs):
        dense, sparse = run["1.0"]["accuracy"][-1], run["0.01"]["accuracy"][-1]
        assert dense > 85.0, f"rank {r}: dense baseline did not train ({dense}%)"
        assert sparse >= dense - 2.0, f"rank {r}: dlgs {sparse}% vs dense {dense}%"
        ratios = run["0.01"]["selected_over_target"]
        assert len(ratios) >= 3, f"rank {r}: sparse layers {sorted(ratios)}"
        for name, ratio in ratios.items():
            assert 0.8 <= ratio <= 1.2, f"rank {r} {name}: selected / target {ratio:.3f}"
    # Every rank evaluates the same (identical) weights.
    assert fashion_runs[0]["0.01"]["accuracy"] == fashion_runs[1]["0.01"]["accuracy"]


@pytest.mark.parallel
def test_tf_resume_recipe_rank0_restores_and_ranks_stay_identical(ranks):
    """Rank 0 alone restores (tape and model.fit), hvd.broadcast_variables hands
    the weights on; no hang (the harness kills one) and identical ranks."""
    check_resume_recipe(*gloo_value(ranks, "resume_recipe"), ("tape", "fit"), steps=10)


@pytest.mark.parallel
def test_tf_door_cells_train_with_ranks_identical(ranks):
    """The door x feature cells of docs/options.md that only these runs cover:
    the tape with transport="auto" and density="auto"; Keras with the
    reduction, density="auto" and float16 dense messages; Compression with the
    reduction, momentum correction, a dp plan, density="auto" and float16 dense
    messages; each door with a byte budget under a dp plan, one density or split between the
    layers. Each trains 14 steps with every
    rank's parameters the same after every step, and shows its feature."""
    r0, r1 = gloo_value(ranks, "door_cells")
    for cell, rec in r0.items():
        assert rec["digests"] == r1[cell]["digests"], f"{cell}: ranks differ"
        assert len(set(rec["digests"])) == 14, f"{cell}: it trains"
    assert r0["tape.transport_auto"]["transport"] == "auto"
    for cell in ("keras.reduce", "compression.reduce"):
        assert r0[cell]["transport"] == "reduce", cell
    assert r0["compression.momentum"]["velocities"] >= 2
    assert r0["compression.dp"]["planned"]
    for cell in ("tape.density_auto", "keras.density_auto", "compression.density_auto"):
        assert r0[cell]["choice"] is not None and r0[cell]["planned"], cell
    for cell in ("keras.dense_fp16", "compression.dense_fp16"):
        assert r0[cell]["dense_wire"] == ["float16"], cell
    for door, split in itertools.product(("tape", "keras", "compression"), ("", "_split")):
        cell = f"{door}.budget{split}"
        (sent, dense), planned = r0[cell]["bytes"], r0[cell]["planned"]
        assert planned and 0.95 * 0.1 * dense <= sent <= 0.1 * dense, (cell, r0[cell])
        # budget_split="gradient": each layer its own density after step 10.
        assert r0[cell]["split"] == bool(split), (cell, r0[cell])
    assert r0["keras.reduce"]["dense_wire"] == ["float32"]
