"""Mixed precision and non-finite gradients on real ranks (TensorFlow / Keras 3).

Scenarios run on every rank under ``horovodrun -np 2``; ``tests/test_tf_amp.py``
asserts on the numbers each rank records.

Usage: ``horovodrun -np 2 --gloo python tests/parallel/tf_amp_worker.py OUT_DIR SCENARIO...``
"""

from __future__ import annotations

import math
import sys
import time

import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
# TensorFlow 2.18 on the CPU: grappler's remapper fuses a float16 MatMul with
# its bias add into a kernel about 400x slower than the two ops (0.3-0.5 s for
# a 64x784x256 Dense layer, measured here), which would make mixed_float16
# training on this CPU take minutes; GPUs are not affected.
tf.config.optimizer.set_experimental_options({"remapping": False})

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from scenarios import main, scenario  # noqa: E402  (tests/parallel is the script's folder)
from tf_worker import digest, flat, linear_target, own_sent  # noqa: E402

import dlgs.tensorflow  # noqa: E402
import dlgs.tensorflow.keras  # noqa: E402
from benchmarks.datasets import fashion_mnist  # noqa: E402

# -- Keras fit under mixed_float16 ----------------------------------------------

BATCH = 64
STEPS = 400
DECAY_AT = 280  # a low final rate: the end point is not one noisy step
# Far too high on purpose: fp16 back-propagation overflows until the loss
# scaler has halved it a dozen times or more (the calibration of every AMP run).
INIT_SCALE = 2.0**30


class HorovodSequential(keras.Sequential):
    """``model.fit`` on Horovod's own dense allreduce: its tape in ``train_step``
    (``horovod.tensorflow.keras.DistributedOptimizer`` never synchronises under
    Keras 3, docs/design.md, Horovod facts)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
            scaled = self.optimizer.scale_loss(loss)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(scaled, [v.value for v in self.trainable_variables])
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def fashion_mlp(cls=keras.Sequential) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = cls(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(256, activation="relu", name="fc1"),
            keras.layers.Dense(10, name="fc2"),
            # Keras' mixed-precision recipe: the logits in float32.
            keras.layers.Activation("linear", dtype="float32", name="logits"),
        ],
        name="amp_mlp",
    )
    hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
    return model


class _Record(keras.callbacks.Callback):
    """Weight digest after every batch; a step was skipped when the loss scale fell."""

    def __init__(self, scaler):
        super().__init__()
        self.scaler, self.digests, self.skipped, self._before = scaler, [], 0, None

    def scale(self) -> float:
        # A custom train_step builds the optimizer at its first apply().
        opt = self.scaler
        return float(opt.dynamic_scale.numpy()) if opt.built else opt.initial_scale

    def on_train_batch_begin(self, batch, logs=None):
        self._before = self.scale()

    def on_train_batch_end(self, batch, logs=None):
        self.skipped += self.scale() < self._before
        self.digests.append(digest(self.model))


def _scaler():
    lr = keras.optimizers.schedules.PiecewiseConstantDecay([DECAY_AT], [0.05, 0.005])
    return keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(lr, momentum=0.9), initial_scale=INIT_SCALE
    )


def amp_fit_run(form: str, data):
    xtr, ytr, xte, yte = data
    if form == "horovod":
        model = fashion_mlp(HorovodSequential)
        opt = _scaler()
    else:
        model = fashion_mlp()
        # Every large layer sparse (layer-wise: a merge plan might send some dense).
        opts = dict(density=1.0) if form == "dlgs_dense" else dict(density=0.05, merge="none")
        opt = dlgs.tensorflow.keras.DistributedOptimizer(
            _scaler(), min_sparse_size=1024, name=f"amp.{form}", **opts
        )
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    assert model.optimizer is opt  # compile did not wrap it again
    perm = np.random.default_rng(0).permutation(len(xtr))[hvd.rank() :: hvd.size()]
    perm = perm[: STEPS * BATCH]
    rec = _Record(opt)
    start = time.perf_counter()
    model.fit(
        xtr[perm], ytr[perm], batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[rec]
    )
    pred = np.argmax(model.predict(xte, batch_size=1000, verbose=0), axis=1)
    out = {
        "accuracy": 100.0 * float(np.mean(pred == yte)),
        "skipped": int(rec.skipped),
        "digests": rec.digests,
        "finite": bool(np.isfinite(flat(model)).all()),
        "final_scale": float(opt.dynamic_scale.numpy()),
        "seconds": time.perf_counter() - start,
    }
    if form != "horovod":
        ex = opt.dlgs.exchange
        out["sparse_layers"] = sorted(lay.name for lay in ex.layers if lay.sparse)
        out["nonfinite_steps"] = ex.nonfinite_steps
    return out


@scenario
def amp_fit():
    """mixed_float16 + an overflowing LossScaleOptimizer under model.fit: Horovod's
    dense allreduce against dlgs at density 1.0 and with every large layer sparse."""
    xtr, ytr = fashion_mnist("train")
    xte, yte = fashion_mnist("test")
    to_nhwc = lambda x: np.ascontiguousarray(x.transpose(0, 2, 3, 1))  # noqa: E731
    data = (to_nhwc(xtr), ytr, to_nhwc(xte), yte)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return {form: amp_fit_run(form, data) for form in ("horovod", "dlgs_dense", "dlgs")}
    finally:
        keras.mixed_precision.set_global_policy("float32")


# -- non-finite gradients and loss-scale changes with the tape -----------------------


def mlp(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(128, activation="relu", name="d0"),
            keras.layers.Dense(128, activation="relu", name="d1"),
            keras.layers.Dense(10, name="d2"),
        ],
        name="mlp",
    )
    hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
    return model


def _host(x):
    return np.atleast_1d(np.array(x.numpy() if hasattr(x, "numpy") else x, dtype=np.float64))


def _snapshot(ex):
    return {
        i: (
            {k: _host(b) for k in ("residual", "velocity") if (b := getattr(lay, k)) is not None},
            {k: _host(v) for k, v in lay.controller_state.items()},
        )
        for i, lay in enumerate(ex.layers)
    }


def _changed(ex, snap) -> float:
    """Largest change of any residual, velocity or controller value since
    ``snap`` (inf if one appeared or disappeared)."""
    now = _snapshot(ex)
    worst = 0.0
    for i, (bufs, ctrl) in snap.items():
        bufs2, ctrl2 = now[i]
        if set(bufs) != set(bufs2) or set(ctrl) != set(ctrl2):
            return math.inf
        for old, new in [(bufs[k], bufs2[k]) for k in bufs] + [(ctrl[k], ctrl2[k]) for k in ctrl]:
            diff = np.abs(new - old)
            if np.isnan(diff).any():
                return math.inf
            worst = max(worst, float(diff.max(initial=0.0)))
    return worst


def _state_finite(ex) -> bool:
    return all(
        np.isfinite(a).all()
        for bufs, ctrl in _snapshot(ex).values()
        for a in [*bufs.values(), *ctrl.values()]
    )


FAULT_LAYERS = ("mlp/d1/kernel", "mlp/d2/bias")  # sparse, dense


@scenario
def fault_injection():
    """A NaN and an Inf on one rank only, in one sparse layer, then a NaN in a
    dense layer: every controller, momentum correction, a merged group,
    Horovod's tape with dlgs.tensorflow.Compression, and the tape and the
    Compression with a loss scaler whose skipped steps are checked end to end."""
    sparse_layer, dense_layer = FAULT_LAYERS
    # step -> (rank, layer, value)
    faults = {
        5: (1, sparse_layer, math.nan),
        9: (0, sparse_layer, math.inf),
        13: (1, dense_layer, math.nan),
    }
    cases = {
        "dynamic": dict(density=0.05),
        "topk": dict(density=0.05, controller="topk"),
        "dgc": dict(density=0.05, controller="dgc", sample_ratio=0.1),
        "fixed": dict(density=0.05, controller="fixed", threshold=1.5),
        "dynamic_momentum": dict(density=0.05, momentum=0.9),
        "merged": dict(density=0.05),
        "compression": dict(density=0.05),
        "scaler": dict(density=0.05),
        "compression_scaler": dict(density=0.05),
    }
    steps = 20
    out = {}
    for case, opts in cases.items():
        model = mlp(1)
        variables = model.trainable_variables
        names = [v.path for v in variables]
        scaler = None
        if case.endswith("scaler"):
            scaler = keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.0), initial_scale=2.0**12
            )
            scaler.build(variables)
        comp = None
        if case.startswith("compression"):
            comp = dlgs.tensorflow.Compression(
                [v.value for v in variables],
                min_sparse_size=1024,
                merge="none",
                name=f"fi.{case}",
                scaler=scaler,
                **opts,
            )
        g = np.random.default_rng(11 + hvd.rank())
        rec = {"finite": [], "nan_layers": [], "unchanged_by_bad_step": [], "ratio": []}
        if scaler is not None:
            rec["scaler_skipped"] = []
        ex = comp.dlgs.exchange if comp is not None else None
        for s in range(steps):
            gs = [g.standard_normal(v.shape).astype(np.float32) for v in variables]
            scale = float(scaler.dynamic_scale.numpy()) if scaler is not None else 1.0
            gs = [x * np.float32(scale) for x in gs]
            if s in faults and faults[s][0] == hvd.rank():
                _, layer, bad = faults[s]
                flat_grad = gs[names.index(layer)].reshape(-1)
                flat_grad[123 % flat_grad.size] = bad
            snap = _snapshot(ex) if s in faults else None  # built by step 0
            with tf.GradientTape() as t:
                target = linear_target(variables, gs)
            if comp is not None:
                tape = hvd.DistributedGradientTape(t, compression=comp, num_groups=1)
                got = tape.gradient(target, [v.value for v in variables])
            else:
                tape = dlgs.tensorflow.DistributedGradientTape(
                    t, min_sparse_size=1024, merge="none", name=f"fi.{case}", scaler=scaler, **opts
                )
                got = tape.gradient(target, variables)
                if ex is None:
                    ex = tape.dlgs.exchange
                    if case == "merged":
                        ex.set_plan(
                            [([i for i, p in enumerate(ex.layer_plans()) if p.sparse], None)]
                        )
            if snap is not None:
                rec["unchanged_by_bad_step"].append(_changed(ex, snap))
            finite = comp.dlgs.last_step_finite if comp is not None else tape.dlgs.last_step_finite
            rec["finite"].append(bool(finite))
            rec["nan_layers"].append(
                sorted(n for n, r in zip(names, got) if not np.isfinite(r.numpy()).all())
            )
            if scaler is not None:
                scaler.apply(got, variables)  # skips when non-finite, halving the scale
                rec["scaler_skipped"].append(float(scaler.dynamic_scale.numpy()) < scale)
            # Horovod's tape takes the tf.Variables, named "mlp/d1/kernel:0".
            target_layer = ex.layers[ex.index(sparse_layer + (":0" if comp else ""))]
            if target_layer.count is not None and target_layer.sparse:
                rec["ratio"].append(int(target_layer.count) / target_layer.plan.k)
        rec["state_finite"] = bool(_state_finite(ex))
        rec["messages"] = len(ex.groups)
        rec["sparse_layers"] = sorted(lay.name for lay in ex.layers if lay.sparse)
        out[case] = rec
    return out


@scenario
def scaled_conservation():
    """sent + residual = accumulated unscaled input, with the loss scale changing
    between steps and one step made non-finite on one rank (skipped)."""
    out = {}
    for case, opts in {
        "float32": dict(density=0.05),
        "float16_wire": dict(density=0.05, value_dtype="float16"),
        "momentum": dict(density=0.05, momentum=0.9, momentum_masking=True),
    }.items():
        model = mlp(3)
        variables = model.trainable_variables
        names = [v.path for v in variables]
        scaler = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.0), initial_scale=2.0**10
        )
        scaler.build(variables)
        g = np.random.default_rng(21 + hvd.rank())
        scales = [2.0**10, 2.0**13, 2.0**7, 2.0**7, 2.0**15, 2.0**4, 2.0**9, 2.0**12]
        bad_step, skipped = 3, []
        m = opts.get("momentum", 0.0)
        total_in = total_sent = vel = None
        ex = None
        for s, scale in enumerate(scales):
            scaler.dynamic_scale.assign(scale)
            unscaled = [g.standard_normal(v.shape).astype(np.float32) for v in variables]
            gs = [u * np.float32(scale) for u in unscaled]
            if s == bad_step and hvd.rank() == 1:
                gs[names.index(FAULT_LAYERS[0])].reshape(-1)[7] = math.inf
            with tf.GradientTape() as t:
                target = linear_target(variables, gs)
            tape = dlgs.tensorflow.DistributedGradientTape(
                t, min_sparse_size=1024, merge="none", name=f"sc.{case}", scaler=scaler, **opts
            )
            tape.gradient(target, variables)
            ex = tape.dlgs.exchange
            if total_in is None:
                total_in = {i: np.zeros(lay.numel) for i, lay in enumerate(ex.layers)}
                total_sent = {i: np.zeros(lay.numel) for i, lay in enumerate(ex.layers)}
                vel = {i: np.zeros(lay.numel) for i, lay in enumerate(ex.layers)}
            if not ex.last_step_finite:
                skipped.append(s)
                continue
            for i, lay in enumerate(ex.layers):
                u = unscaled[names.index(lay.name)].reshape(-1).astype(np.float64)
                vel[i] = m * vel[i] + u if m else u
                total_in[i] += vel[i]
            for i, sent in own_sent(ex).items():
                total_sent[i] += sent
                if m:  # factor masking: sent positions restart their velocity
                    vel[i][sent != 0] = 0.0
        worst, size, sparse_layers = 0.0, 0.0, 0
        for i, lay in enumerate(ex.layers):
            if lay.residual is None or not lay.sparse:
                continue
            sparse_layers += 1
            resid = lay.residual.numpy()[: lay.numel].astype(np.float64)
            worst = max(worst, float(np.abs(total_sent[i] + resid - total_in[i]).max()))
            size = max(size, float(np.abs(total_in[i]).max()))
        out[case] = {
            "max_error": worst,
            "scale": size,
            "sparse_layers": sparse_layers,
            "skipped": skipped,
        }
    return out


if __name__ == "__main__":
    main(sys.argv, hvd)
