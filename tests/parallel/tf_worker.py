"""TensorFlow / Keras 3 scenarios run on every rank under ``horovodrun -np 2``.

Like ``tests/parallel/worker.py``: each scenario computes numbers on real ranks
and records them; ``tests/test_tensorflow.py`` loads every rank's record and
asserts.

Usage: ``horovodrun -np 2 --gloo python tests/parallel/tf_worker.py OUT_DIR SCENARIO...``
(the suite launches ``tf_amp_worker.py``, which imports these scenarios too, once per
backend: ``tests/conftest.py``'s ``tf_ranks``)
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile

import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from scenarios import main, scenario  # noqa: E402  (tests/parallel is the script's folder)

import dlgs.tensorflow  # noqa: E402
import dlgs.tensorflow.keras  # noqa: E402
from dlgs.core import RankMismatchError, SparsityConfig, plan_layers  # noqa: E402
from dlgs.tensorflow._ops import _read  # noqa: E402

# -- helpers ------------------------------------------------------------------


def mlp(seed: int, hidden: int = 64, broadcast: bool = True) -> keras.Model:
    keras.utils.set_random_seed(seed)
    # Explicit names: Keras uniquifies automatic ones (dense, dense_1, ...) per
    # process, and dlgs keys its state by the variables' paths.
    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(hidden, activation="relu", name="d0"),
            keras.layers.Dense(hidden, activation="relu", name="d1"),
            keras.layers.Dense(10, name="d2"),
        ],
        name="mlp",
    )
    if broadcast:
        # Same start on every rank (Keras 3 variables: broadcast the tf.Variable).
        hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
    return model


def batch(step: int, n: int = 16):
    rng = np.random.default_rng(1000 * step + hvd.rank())
    return rng.standard_normal((n, 32)).astype("float32"), rng.integers(0, 10, n)


def loss_fn(model, x, y):
    logits = model(x, training=True)
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))


def flat(model) -> np.ndarray:
    return np.concatenate([np.asarray(v.numpy(), np.float32).ravel() for v in model.weights])


def digest(model) -> str:
    h = hashlib.sha256()
    for v in model.weights:
        h.update(np.ascontiguousarray(v.numpy()).tobytes())
    return h.hexdigest()


def tape_step(model, opt, x, y, wrap):
    """One custom-loop step; ``wrap`` turns the tape into a distributed one."""
    with tf.GradientTape() as tape:
        loss = loss_fn(model, x, y)
    tape, sources = wrap(tape, model)
    grads = tape.gradient(loss, sources)
    opt.apply(grads, model.trainable_variables)
    return loss


def run_loop(model, opt, wrap, steps, *, function=False, start=0):
    step = tf.function(lambda x, y: tape_step(model, opt, x, y, wrap)) if function else None
    digests = []
    for s in range(start, start + steps):
        x, y = batch(s)
        if step is not None:
            step(tf.constant(x), tf.constant(y))
        else:
            tape_step(model, opt, x, y, wrap)
        digests.append(digest(model))
    return digests


def hvd_tape(tape, model):
    # Horovod's tape needs tf.Variable sources under Keras 3 (docs/design.md, Horovod facts).
    return hvd.DistributedGradientTape(tape), [v.value for v in model.trainable_variables]


def dlgs_tape(**opts):
    def wrap(tape, model):
        return dlgs.tensorflow.DistributedGradientTape(tape, **opts), model.trainable_variables

    return wrap


def own_sent(exchange) -> dict:
    """This rank's last sent values, decoded from its own send buffers."""
    sent = {}
    for group in exchange.groups:
        if not group.sparse:
            continue
        lay = group.layout
        dense = np.zeros(lay.dense_size, np.float64)
        vals, idx, _ = lay.decode(_read(group.chunk).numpy())
        np.add.at(dense, idx, vals)
        for m, i in enumerate(group.members):
            sent[i] = dense[lay.dense_offset(m) : lay.dense_offset(m) + lay.sizes[m]].copy()
    return sent


def linear_target(variables, grads):
    """A loss whose gradient with respect to each variable is exactly ``grads``."""
    return tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])


def sparse_grads(variables, k_of, seed, shared_seed):
    """At most k non-zeros per variable on this rank: half at positions every
    rank shares (``shared_seed`` is the same on every rank), half its own."""
    rng = np.random.default_rng(seed)
    shared_rng = np.random.default_rng(shared_seed)
    out = []
    for v in variables:
        n = int(np.prod(v.shape))
        k = k_of(v.path, n)
        shared = shared_rng.permutation(n)[: k // 2]
        own = rng.permutation(n)[: k - k // 2]
        idx = np.unique(np.concatenate([shared, own]))[:k]
        g = np.zeros(n, np.float32)
        g[idx] = rng.standard_normal(idx.size).astype(np.float32)
        out.append(g.reshape(v.shape))
    return out


# -- scenarios ----------------------------------------------------------------


@scenario
def dense_equivalence():
    """density=1.0 against Horovod's dense allreduce (its tape on v.value)."""
    out = {}
    steps = 4
    ref_model = mlp(1)
    ref = run_loop(ref_model, keras.optimizers.SGD(0.1), hvd_tape, steps)
    ref_w = flat(ref_model)
    forms = {
        "tape_eager": dict(wrap=dlgs_tape(density=1.0, name="de.eager")),
        "tape_function": dict(wrap=dlgs_tape(density=1.0, name="de.fn"), function=True),
        "tape_reduce": dict(wrap=dlgs_tape(density=1.0, transport="reduce", name="de.reduce")),
        "compression": dict(
            wrap=None,
            function=False,
        ),
    }
    for form, kw in forms.items():
        model = mlp(1)
        if form == "compression":
            comp = dlgs.tensorflow.Compression(
                [v.value for v in model.trainable_variables], density=1.0, name="de.c"
            )

            def wrap(tape, m, comp=comp):
                return (
                    hvd.DistributedGradientTape(tape, compression=comp, num_groups=1),
                    [v.value for v in m.trainable_variables],
                )

            kw = dict(wrap=wrap)
        digests = run_loop(
            model, keras.optimizers.SGD(0.1), kw["wrap"], steps, function=kw.get("function", False)
        )
        out[form] = {
            "max_diff": float(np.abs(flat(model) - ref_w).max()),
            "digests": digests,
        }
    # The Keras optimizer (custom loop, apply()) with Adam, against Adam on
    # Horovod's averaged gradients.
    for kind in ("sgd", "adam"):
        make = (
            (lambda: keras.optimizers.SGD(0.1))
            if kind == "sgd"
            else (lambda: keras.optimizers.Adam(1e-3))
        )
        ref_model = mlp(1)
        run_loop(ref_model, make(), hvd_tape, steps)
        model = mlp(1)
        opt = dlgs.tensorflow.keras.DistributedOptimizer(make(), density=1.0, name=f"de.k{kind}")
        digests = run_loop(model, opt, lambda t, m: (t, m.trainable_variables), steps)
        out[f"keras_{kind}"] = {
            "max_diff": float(np.abs(flat(model) - flat(ref_model)).max()),
            "digests": digests,
        }
    out["reference"] = {"digests": ref}
    # dense_dtype="float16": Horovod's tape with Compression.fp16, bit for bit.
    ref_model = mlp(1)

    def hvd_fp16(tape, model):
        return (
            hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16),
            [v.value for v in model.trainable_variables],
        )

    run_loop(ref_model, keras.optimizers.SGD(0.1), hvd_fp16, steps)
    for form, function in (("fp16_eager", False), ("fp16_function", True)):
        model = mlp(1)
        wrap = dlgs_tape(density=1.0, dense_dtype="float16", name=f"de.{form}")
        digests = run_loop(model, keras.optimizers.SGD(0.1), wrap, steps, function=function)
        out[form] = {
            "max_diff": float(np.abs(flat(model) - flat(ref_model)).max()),
            "digests": digests,
        }
    return out


_REDUCE = dict(density=0.05, controller="topk", transport="reduce", reduce_width=4.0)


@scenario
def exact_reconstruction():
    """<= k non-zeros per rank: the reduced gradient equals Horovod's allreduce."""
    out = {}
    cases = {
        "dynamic_first_step": (dict(density=0.05), 1),
        "dynamic_anchor_every_step": (dict(density=0.05, anchor_every=1), 3),
        "topk": (dict(density=0.05, controller="topk"), 3),
        "fixed": (dict(density=0.05, controller="fixed", threshold=1e-12), 3),
        "fp16_exact_values": (dict(density=0.05, value_dtype="float16", controller="topk"), 3),
        "sum_op": (dict(density=0.05, controller="topk"), 3),
        "merged_groups": (dict(density=0.05, controller="topk"), 3),
        "in_function": (dict(density=0.05, controller="topk"), 3),
        "in_graph": (dict(density=0.05, controller="topk"), 4),
        # The sparse reduction (an alltoall to the regions' owners, then an
        # allgather of what they kept), eagerly and inside a tf.function; wide
        # enough that the ranks' union of positions (1.5 k) fits every region.
        "reduce": (_REDUCE, 3),
        "reduce_in_function": (_REDUCE, 3),
    }
    for case, (opts, steps) in cases.items():
        model = mlp(2, hidden=128)
        variables = model.trainable_variables
        op = hvd.Sum if case == "sum_op" else hvd.Average
        cfg = SparsityConfig(min_sparse_size=64, **opts)
        plans = {
            v.path: p
            for v, p in zip(
                variables, plan_layers([int(np.prod(v.shape)) for v in variables], cfg.density, cfg)
            )
        }

        def grads_of(tape, target, case=case, op=op, cfg=cfg, variables=variables):
            tape = dlgs.tensorflow.DistributedGradientTape(
                tape, op=op, config=cfg, merge="none", name=f"ex.{case}"
            )
            return tape, tape.gradient(target, variables)

        def step(gs, grads_of=grads_of, variables=variables):
            with tf.GradientTape() as tape:
                target = linear_target(variables, gs)
            return grads_of(tape, target)

        fn = step
        if case in ("in_function", "reduce_in_function"):
            fn = tf.function(lambda gs, step=step: step(gs)[1])
        elif case == "in_graph":  # traced again once laid out: the exchange in the graph
            fn = dlgs.tensorflow.function(lambda gs, step=step: step(gs)[1])
        worst, tape = 0.0, None
        for s in range(steps):
            gs = sparse_grads(
                variables,
                lambda nm, n, plans=plans: plans[nm].k if plans[nm].sparse else n,
                seed=100 * s + 7 + hvd.rank() * 1000,
                shared_seed=s,
            )
            if "fp16" in case:
                gs = [g.astype(np.float16).astype(np.float32) for g in gs]
            if case in ("in_function", "in_graph", "reduce_in_function"):
                got = fn([tf.constant(g) for g in gs])
            else:
                tape, got = fn(gs)
            if case == "merged_groups" and s == 0:
                ex = tape.dlgs.exchange
                ex.set_plan([([i for i, p in enumerate(ex.layer_plans()) if p.sparse], None)])
            for j, (g, r) in enumerate(zip(gs, got)):
                expect = hvd.allreduce(tf.constant(g), op=op, name=f"ref.{case}.{s}.{j}")
                worst = max(worst, float(np.abs(r.numpy() - expect.numpy()).max()))
        rec = {"max_diff": worst}
        if case == "in_graph":
            engine = dlgs.tensorflow.exchange(f"ex.{case}")
            rec["steps"] = engine.exchange.step  # counts the device steps in first
            rec["device_steps"] = engine.graph.device_steps
        if case.startswith("reduce"):
            rec["transport"] = dlgs.tensorflow.exchange(f"ex.{case}").exchange.transport.name
        if tape is not None and tape.dlgs.exchange is not None:
            ex = tape.dlgs.exchange
            rec["sparse_messages"] = sum(1 for g in ex.groups if g.sparse)
            rec["sparse_layers"] = sum(1 for lay in ex.layers if lay.sparse)
        out[case] = rec
    return out


def compression_wrap(comp):
    """Horovod's tape with ``dlgs.tensorflow.Compression`` as its compressor."""

    def wrap(tape, m):
        tape = hvd.DistributedGradientTape(tape, compression=comp, num_groups=1)
        return tape, [v.value for v in m.trainable_variables]

    return wrap


_AUTO_DENSITY = dict(density="auto", merge="dp", profile_steps=2, profile_budget=1.0)
#: The door x feature cells of the TensorFlow doors (docs/options.md).
TF_DOOR_CELLS = {
    "tape.transport_auto": ("tape", dict(density=0.05, transport="auto", merge="none")),
    "tape.density_auto": ("tape", _AUTO_DENSITY),
    "keras.reduce": ("keras", dict(density=0.05, transport="reduce", merge="none")),
    "keras.density_auto": ("keras", _AUTO_DENSITY),
    "compression.reduce": ("compression", dict(density=0.05, transport="reduce", merge="none")),
    "compression.momentum": ("compression", dict(density=0.05, momentum=0.9, merge="none")),
    "compression.dp": ("compression", dict(density=0.05, merge="dp", profile_steps=2)),
    "compression.density_auto": ("compression", _AUTO_DENSITY),
    "keras.dense_fp16": ("keras", dict(density=0.05, dense_dtype="float16", merge="none")),
    "tape.budget": (
        "tape",
        dict(budget=0.1, budget_split="uniform", merge="dp", profile_steps=2, profile_budget=1.0),
    ),
    "keras.budget": (
        "keras",
        dict(budget=0.1, budget_split="uniform", merge="dp", profile_steps=2, profile_budget=1.0),
    ),
    "compression.budget": (
        "compression",
        dict(budget=0.1, budget_split="uniform", merge="dp", profile_steps=2, profile_budget=1.0),
    ),
    "compression.dense_fp16": (
        "compression",
        dict(density=0.05, dense_dtype="float16", merge="none"),
    ),
    **{
        f"{door}.budget_split": (
            door,
            dict(budget=0.1, merge="dp", profile_steps=2, profile_budget=1.0),
        )
        for door in ("tape", "keras", "compression")
    },
}


@scenario
def door_cells():
    """Each of :data:`TF_DOOR_CELLS` trains 14 steps: the parameters after
    every step, and what the feature shows (transport, density choice, plan,
    velocities)."""
    out = {}
    for cell, (door, opts) in TF_DOOR_CELLS.items():
        model, opt = mlp(3, hidden=128), keras.optimizers.SGD(0.05)
        opts = dict(min_sparse_size=64, name=f"cells.{cell}", **opts)
        if door == "tape":
            wrap = dlgs_tape(**opts)
        elif door == "keras":
            opt = dlgs.tensorflow.keras.DistributedOptimizer(opt, **opts)

            def wrap(tape, m):
                return tape, m.trainable_variables
        else:
            variables = [v.value for v in model.trainable_variables]
            wrap = compression_wrap(dlgs.tensorflow.Compression(variables, **opts))
        digests = run_loop(model, opt, wrap, 14)
        engine = opt.dlgs if door == "keras" else dlgs.tensorflow.exchange(opts["name"])
        choice = engine.planner.density_choice
        out[cell] = {
            "digests": digests,
            "transport": engine.exchange.transport.name,
            "choice": None if choice is None else choice.density,
            "planned": engine.planner.plan is not None,
            "velocities": sum(1 for la in engine.exchange.layers if la.velocity is not None),
            "bytes": [engine.exchange.wire_bytes(), engine.exchange.dense_bytes()],
            "split": engine.exchange.auto_layers is not None,
            # What dense messages hand the allreduce: their send buffers' dtype.
            "dense_wire": sorted(
                {
                    "float32" if m.wire is None else m.wire.dtype.name
                    for m in engine.exchange.messages.records
                    if not m.sparse
                }
            ),
        }
    return out


@scenario
def conservation():
    """Per rank: sum of sent + residual == sum of accumulated input."""
    out = {}
    for case, opts in {
        "float32": dict(density=0.05),
        "float16": dict(density=0.05, value_dtype="float16"),
        "dgc": dict(density=0.02, controller="dgc"),
        "momentum_free_dynamic": dict(density=0.02, anchor_every=4),
    }.items():
        model = mlp(3, hidden=128)
        variables = model.trainable_variables
        rng = np.random.default_rng(5 + hvd.rank())
        total_in = [np.zeros(int(np.prod(v.shape))) for v in variables]
        total_sent = None
        tape = None
        for _ in range(6):
            gs = [rng.standard_normal(v.shape).astype(np.float32) for v in variables]
            with tf.GradientTape() as t:
                target = linear_target(variables, gs)
            tape = dlgs.tensorflow.DistributedGradientTape(
                t, min_sparse_size=64, merge="none", name=f"cons.{case}", **opts
            )
            tape.gradient(target, variables)
            ex = tape.dlgs.exchange
            if total_sent is None:
                total_sent = {i: np.zeros(lay.numel) for i, lay in enumerate(ex.layers)}
            for j, g in enumerate(gs):
                total_in[j] += g.ravel()
            for i, sent in own_sent(ex).items():
                total_sent[i] += sent
        ex = tape.dlgs.exchange
        index = {v.path: j for j, v in enumerate(variables)}
        worst, scale, sparse_layers = 0.0, 0.0, 0
        for i, lay in enumerate(ex.layers):
            if lay.residual is None:
                continue
            sparse_layers += 1
            resid = lay.residual.numpy()[: lay.numel].astype(np.float64)
            acc = total_in[index[lay.name]]
            worst = max(worst, float(np.abs(total_sent[i] + resid - acc).max()))
            scale = max(scale, float(np.abs(acc).max()))
        out[case] = {"max_error": worst, "scale": scale, "sparse_layers": sparse_layers}
    return out


# -- against the independent reference (tests/reference.py) ---------------------------

# The default (dynamic) controller runs in every case.
TF_REFERENCE_CASES = {
    # Masked (DGC's recipe): a velocity that is never cleared carries the
    # framework's fused m*u + g rounding (a few ulps from the reference's) into
    # later steps, where an element at the recorded threshold may flip; the
    # default (unmasked at this density) is checked in process, where the
    # arithmetic is the reference's (tests/test_exchange_local.py).
    "momentum": dict(momentum=0.9, momentum_masking=True),
    "warmup": dict(warmup=(0.5, 0.2), warmup_steps=2),
    "fp16_values": dict(value_dtype="float16"),
    "sum": dict(op="sum"),
}
TF_REFERENCE_STEPS = 9


def _tf_reference_plans(ex):
    """As the torch worker's: layer-wise, the sparse layers merged (step 2), the
    largest sent dense, flushing its residual (step 5), layer-wise (step 7)."""
    rule = plan_layers([lay.numel for lay in ex.layers], ex.config.density, ex.config)
    sparse = [i for i, p in enumerate(rule) if p.sparse]
    biggest = max(sparse, key=lambda i: ex.layers[i].numel)
    merged, dense = [(sparse, None)], [([biggest], False)]
    return [None, None, merged, merged, merged, dense, dense, None, None]


def _tf_reference_grads(variables, step, rank):
    rng = np.random.default_rng(7919 * step + 104729 * rank)
    return [rng.standard_normal(v.shape).astype(np.float32) for v in variables]


@scenario
def against_reference():
    """The tape and the Compression form (Horovod's tape, num_groups=1), sparse,
    with a merge plan in force and a residual flush: every rank's reduced
    gradients and residuals after each step against the NumPy reference."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
    from reference import replay

    size, rank = hvd.size(), hvd.rank()
    out = {}
    for form in ("tape", "compression"):
        for case, options in TF_REFERENCE_CASES.items():
            options = dict(options)
            op = hvd.Sum if options.pop("op", None) == "sum" else hvd.Average
            model = mlp(11, hidden=96)
            variables = model.trainable_variables
            opts = dict(density=0.05, min_sparse_size=64, merge="none", **options)
            name = f"ref.{form}.{case}"
            comp = (
                dlgs.tensorflow.Compression([v.value for v in variables], name=name, **opts)
                if form == "compression"
                else None
            )
            eng = ex = plans = None
            grads, thetas, outs, residuals = [], [], [], []
            for s in range(TF_REFERENCE_STEPS):
                if ex is not None:
                    ex.set_plan(plans[s])
                gs = _tf_reference_grads(variables, s, rank)
                with tf.GradientTape() as t:
                    target = linear_target(variables, gs)
                if comp is None:
                    tape = dlgs.tensorflow.DistributedGradientTape(t, op=op, name=name, **opts)
                    got = tape.gradient(target, variables)
                    eng = tape.dlgs
                else:
                    tape = hvd.DistributedGradientTape(t, compression=comp, num_groups=1, op=op)
                    got = tape.gradient(target, [v.value for v in variables])
                    eng = comp.dlgs
                if ex is None:
                    ex, plans = eng.exchange, _tf_reference_plans(eng.exchange)
                order = eng.order  # exchange index -> variable position
                lays = list(enumerate(ex.layers))
                outs.append([np.asarray(got[order[i]]).ravel() for i, _ in lays])
                thetas.append(
                    {i: float(np.asarray(_read(lay.threshold))) for i, lay in lays if lay.sparse}
                )
                residuals.append(
                    {i: _read(lay.residual).numpy()[:-1] for i, lay in lays if lay.sparse}
                )
                grads.append(
                    [
                        [_tf_reference_grads(variables, s, r)[order[i]].ravel() for i, _ in lays]
                        for r in range(size)
                    ]
                )
            all_thetas = hvd.allgather_object(thetas, name=f"{name}.thetas")
            out[f"{form}/{case}"] = replay(
                [lay.numel for lay in ex.layers],
                size,
                rank,
                grads,
                all_thetas,
                outs,
                residuals,
                plans,
                density=0.05,
                min_sparse_size=64,
                average=op == hvd.Average,
                **options,
            )
    return out


class _Digests(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.digests = []

    def on_train_batch_end(self, batch, logs=None):
        self.digests.append(digest(self.model))


def _fit(opt, *, run_eagerly, seed=4, batches=12, model_fn=None):
    model = (model_fn or mlp)(seed)
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        run_eagerly=run_eagerly,
        jit_compile=False,
    )
    rng = np.random.default_rng(77 + hvd.rank())
    x = rng.standard_normal((16 * batches, 32)).astype("float32")
    y = rng.integers(0, 10, 16 * batches)
    cb = _Digests()
    hist = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    return model, cb.digests, hist.history["loss"][-1]


@scenario
def fit_identical():
    """model.fit keeps every rank's weights bit-identical after every batch."""
    out = {}
    cases = {
        "compiled_dp": dict(density=0.05, min_sparse_size=64, profile_steps=2),
        "eager_none": dict(density=0.05, min_sparse_size=64, merge="none", run_eagerly=True),
        "momentum_correction": dict(density=0.05, min_sparse_size=64, momentum=0.9, merge="all"),
        "fp16_values_dgc": dict(
            density=0.05,
            min_sparse_size=64,
            value_dtype="float16",
            controller="dgc",
            merge="buckets",
            bucket_elements=4096,
            profile_steps=2,  # planned within the 12 batches
        ),
    }
    for case, opts in cases.items():
        run_eagerly = opts.pop("run_eagerly", False)
        opt = dlgs.tensorflow.keras.DistributedOptimizer(
            keras.optimizers.SGD(0.05), name=f"fit.{case}", **opts
        )
        model, digests, loss = _fit(opt, run_eagerly=run_eagerly)
        ex = opt.dlgs.exchange
        out[case] = {
            "digests": digests,
            "finite": bool(np.isfinite(flat(model)).all()),
            "sparse_layers": sum(1 for lay in ex.layers if lay.sparse),
            "planned": opt.dlgs.planner.plan is not None,
        }
    # The custom loop inside tf.function, sparse.
    model = mlp(4)
    out["tape_function"] = {
        "digests": run_loop(
            model,
            keras.optimizers.Adam(1e-3),
            dlgs_tape(density=0.05, min_sparse_size=64, name="fit.tapefn", profile_steps=2),
            8,
            function=True,
        ),
        "finite": bool(np.isfinite(flat(model)).all()),
    }
    return out


def _resume_run(total, at, *, keep_dlgs=True):
    """Train ``total`` steps, or ``at`` steps, checkpoint (per rank), and
    continue from a fresh model + optimizer restored from that checkpoint."""

    def make():
        model = mlp(8, hidden=128)
        opt = dlgs.tensorflow.keras.DistributedOptimizer(
            keras.optimizers.SGD(0.05),
            density=0.02,
            min_sparse_size=64,
            merge="none",
            name="resume",
        )
        return model, opt

    def wrap(t, m):
        return t, m.trainable_variables

    model, opt = make()
    first = run_loop(model, opt, wrap, at)
    if at == total:
        return first
    ckpt_dir = tempfile.mkdtemp(prefix=f"dlgs-tf-rank{hvd.rank()}-")
    objs = dict(model=model, optimizer=opt)
    if keep_dlgs:
        objs["dlgs"] = opt.dlgs.trackable
    path = tf.train.Checkpoint(**objs).save(os.path.join(ckpt_dir, "ckpt"))
    model2, opt2 = make()
    opt2.build(model2.trainable_variables)
    objs2 = dict(model=model2, optimizer=opt2)
    if keep_dlgs:
        objs2["dlgs"] = opt2.dlgs.trackable
    tf.train.Checkpoint(**objs2).restore(path).assert_existing_objects_matched()
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return first + run_loop(model2, opt2, wrap, total - at, start=at)


@scenario
def resume():
    """A per-rank tf.train.Checkpoint with dlgs_state resumes bit-identically."""
    straight = _resume_run(8, 8)
    resumed = _resume_run(8, 4)
    without = _resume_run(8, 4, keep_dlgs=False)
    return {"straight": straight, "resumed": resumed, "without_dlgs_state": without}


def _restore_on_rank0(path, model, opt, trackable):
    """Horovod's recipe: rank 0 restores model, optimizer and dlgs' state;
    hvd.broadcast_variables hands weights and optimizer slots to the others."""
    if hvd.rank() == 0:
        ckpt = tf.train.Checkpoint(model=model, optimizer=opt, dlgs=trackable)
        ckpt.restore(path).assert_existing_objects_matched()
    hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
    hvd.broadcast_variables([v.value for v in opt.variables], root_rank=0)
    return digest(model)


@scenario
def resume_recipe():
    """Rank 0 saves; a fresh job starts with other weights on every rank, only
    rank 0 restores, then hvd.broadcast_variables; training goes on. The
    custom-loop tape and Keras model.fit; digests after the broadcast and after
    every step / batch."""
    tmp = tempfile.mkdtemp(prefix=f"dlgs-tf-recipe-{hvd.rank()}-")
    out = {}
    opts = dict(density=0.05, min_sparse_size=64, merge="dp", profile_steps=2)

    # Custom loop: tapes re-created every step continue the engine of their name.
    def tape(name):
        def wrap(t, m):
            return dlgs.tensorflow.DistributedGradientTape(t, name=name, **opts), (
                m.trainable_variables
            )

        return wrap

    model, opt = mlp(5), keras.optimizers.SGD(0.05, momentum=0.9)
    run_loop(model, opt, tape("recipe.tape0"), 6)
    path = None
    if hvd.rank() == 0:
        trackable = dlgs.tensorflow.exchange("recipe.tape0").trackable
        path = tf.train.Checkpoint(model=model, optimizer=opt, dlgs=trackable).save(
            os.path.join(tmp, "tape")
        )
    model, opt = mlp(100 + hvd.rank(), broadcast=False), keras.optimizers.SGD(0.05, momentum=0.9)
    opt.build(model.trainable_variables)
    # The engine exists before the restore: one tape created eagerly (docs/tensorflow.md).
    dlgs.tensorflow.DistributedGradientTape(tf.GradientTape(), name="recipe.tape1", **opts)
    engine = dlgs.tensorflow.exchange("recipe.tape1")
    broadcast = _restore_on_rank0(path, model, opt, engine.trackable)
    digests = run_loop(model, opt, tape("recipe.tape1"), 4, start=6)
    out["tape"] = {"broadcast": broadcast, "digests": digests, "step": engine.exchange.step}

    # Keras model.fit.
    def fit_opt(name):
        return dlgs.tensorflow.keras.DistributedOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9), name=name, **opts
        )

    model, digests, _ = _fit(fit_opt("recipe.fit0"), run_eagerly=False, batches=6)
    if hvd.rank() == 0:
        opt = model.optimizer
        path = tf.train.Checkpoint(model=model, optimizer=opt, dlgs=opt.dlgs.trackable).save(
            os.path.join(tmp, "fit")
        )
    opt = fit_opt("recipe.fit1")
    model = mlp(100 + hvd.rank(), broadcast=False)
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    opt.build(model.trainable_variables)
    broadcast = _restore_on_rank0(path, model, opt, opt.dlgs.trackable)
    rng = np.random.default_rng(91 + hvd.rank())
    x = rng.standard_normal((16 * 4, 32)).astype("float32")
    y = rng.integers(0, 10, 16 * 4)
    cb = _Digests()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    out["fit"] = {"broadcast": broadcast, "digests": cb.digests, "step": opt.dlgs.exchange.step}
    shutil.rmtree(tmp, ignore_errors=True)
    return out


class _LoadOnRank1(keras.callbacks.Callback):
    """Saves dlgs' state after batch ``save`` and loads it on rank 1 alone after
    batch ``load``: a one-rank load after training began. ``opt``:
    a door with ``.dlgs`` or the engine itself."""

    def __init__(self, opt, save=2, load=5):
        super().__init__()
        self.opt, self.save, self.load, self.saved = opt, save, load, None

    def on_train_batch_end(self, batch, logs=None):
        engine = getattr(self.opt, "dlgs", self.opt)
        if batch == self.save:  # a copy: the state holds the live variables
            state = engine.state_dict()
            self.saved = tf.nest.map_structure(
                lambda v: np.array(v) if isinstance(v, (tf.Variable, tf.Tensor)) else v, state
            )
        if batch == self.load and hvd.rank() == 1:
            engine.load_state_dict(self.saved)


@scenario
def one_rank_load():
    """Rank 1 alone loads its earlier dlgs state in the middle of model.fit
    (compiled: the exchange in the graph), and between steps of the tape's and
    the Compression form's custom loops; every rank goes on, identical."""
    opt = dlgs.tensorflow.keras.DistributedOptimizer(
        keras.optimizers.SGD(0.05),
        name="one_rank_load",
        density=0.05,
        min_sparse_size=64,
        merge="none",
    )
    model = mlp(4)
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    rng = np.random.default_rng(77 + hvd.rank())
    x = rng.standard_normal((16 * 9, 32)).astype("float32")
    y = rng.integers(0, 10, 16 * 9)
    digests = _Digests()
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[_LoadOnRank1(opt), digests],
    )
    out = {"digests": digests.digests, "step": opt.dlgs.exchange.step}
    # The tape and Horovod's tape with dlgs.tensorflow.Compression: the same
    # load between steps of a custom loop.
    for door in ("tape", "compression"):
        model, name = mlp(4), f"one_rank_load.{door}"
        opts = dict(density=0.05, min_sparse_size=64, merge="none", name=name)
        if door == "tape":
            wrap = dlgs_tape(**opts)
        else:
            variables = [v.value for v in model.trainable_variables]
            wrap = compression_wrap(dlgs.tensorflow.Compression(variables, **opts))
        opt, loads, found = keras.optimizers.SGD(0.05), _LoadOnRank1(None), []
        for s in range(9):
            found += run_loop(model, opt, wrap, 1, start=s)
            loads.opt = dlgs.tensorflow.exchange(name)  # its .dlgs: the engine itself
            loads.on_train_batch_end(s)
        out[door] = {"digests": found, "step": loads.opt.exchange.step}
    return out


@scenario
def mismatch():
    """Different models, or different options, on the ranks: an error on every rank."""
    out = {}
    model = mlp(6, hidden=64 if hvd.rank() == 0 else 65, broadcast=False)
    x, y = batch(0)
    try:
        with tf.GradientTape() as t:
            loss = loss_fn(model, x, y)
        dlgs.tensorflow.DistributedGradientTape(t, name="mm.model").gradient(
            loss, model.trainable_variables
        )
        out["model"] = None
    except RankMismatchError as err:
        out["model"] = str(err)
    # The same inside tf.function: raised as RankMismatchError, not TF's StagingError.
    model = mlp(6, hidden=64 if hvd.rank() == 0 else 65, broadcast=False)

    @tf.function
    def traced(x, y):
        with tf.GradientTape() as t:
            loss = loss_fn(model, x, y)
        return dlgs.tensorflow.DistributedGradientTape(t, name="mm.fn").gradient(
            loss, model.trainable_variables
        )

    try:
        traced(tf.constant(x), tf.constant(y))
        out["function"] = None
    except RankMismatchError as err:
        out["function"] = str(err)
    model = mlp(6)
    try:
        dlgs.tensorflow.Compression(
            model.trainable_variables, density=0.01 if hvd.rank() == 0 else 0.02, name="mm.c"
        )
        out["options"] = None
    except RankMismatchError as err:
        out["options"] = str(err)
    # Horovod's tape without num_groups: dlgs' compressor explains instead of hanging.
    model = mlp(6)
    comp = dlgs.tensorflow.Compression([v.value for v in model.trainable_variables], name="mm.g")
    try:
        with tf.GradientTape() as t:
            loss = loss_fn(model, x, y)
        hvd.DistributedGradientTape(t, compression=comp).gradient(
            loss, [v.value for v in model.trainable_variables]
        )
        out["ungrouped"] = None
    except ValueError as err:
        out["ungrouped"] = str(err)
    return out


def _graph_case(label, mode, opts, steps):
    """``steps`` custom-loop steps, eagerly or under dlgs.tensorflow.function."""
    model = mlp(21)
    opt = keras.optimizers.SGD(0.05)
    name = f"graph_exchange.{label}"

    def step(x, y, model=model, opt=opt, name=name):
        with tf.GradientTape() as tape:
            loss = loss_fn(model, x, y)
        tape = dlgs.tensorflow.DistributedGradientTape(tape, name=name, **opts)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        return loss

    fn = dlgs.tensorflow.function(step) if mode == "graph" else step
    digests = []
    engine = None
    for s in range(steps):
        x, y = batch(s)
        fn(tf.constant(x), tf.constant(y))
        digests.append(digest(model))
        engine = dlgs.tensorflow.exchange(name)
        if s == 5:  # a new plan between steps: one host step, one trace
            engine.exchange.set_plan([([0, 1, 2, 3], None)])
    ex = engine.exchange
    graph = engine.graph
    return {
        "params": flat(model).tolist(),
        "digests": digests,
        "traces": graph.traces,
        "host_steps": graph.host_steps,
        "step": ex.step,
        "residuals": {
            la.name: digest_array(la.residual) for la in ex.layers if la.residual is not None
        },
        "retraces": getattr(fn, "retraces", None),
    }


@scenario
def graph_exchange():
    """The exchange traced into the graph: a custom loop under
    dlgs.tensorflow.function and model.fit, against the same steps run
    eagerly; how often the step was traced and how many steps ran on the host."""
    out = {}
    opts = dict(density=0.05, controller="topk", merge="none", min_sparse_size=256)
    steps = 10
    # topk learns nothing; the default (dynamic) controller learns on the
    # device and anchors every 4 steps on the host.
    cases = {
        "": opts,
        "dynamic.": dict(opts, controller="dynamic", anchor_every=4),
        # Ranks whose own limits differ (log_every on rank 0 only) still take
        # the same branch every step: the budget is agreed.
        "logging.": dict(opts, log_every=3 if hvd.rank() == 0 else 0),
        # Momentum correction on the device: every layer's velocity kept where finite.
        "momentum.": dict(opts, momentum=0.9),
    }
    for prefix, case_opts in cases.items():
        for mode in ("eager", "graph"):
            out[prefix + mode] = _graph_case(prefix + mode, mode, case_opts, steps)
    # Density 1.0 on the device path: Horovod's allreduce.
    model = mlp(22)
    variables = model.trainable_variables

    @dlgs.tensorflow.function
    def dense(gs):
        with tf.GradientTape() as tape:
            target = linear_target(variables, gs)
        tape = dlgs.tensorflow.DistributedGradientTape(
            tape, density=1.0, merge="none", name="graph_exchange.dense"
        )
        return tape.gradient(target, variables)

    worst = 0.0
    for s in range(4):
        rng = np.random.default_rng(50 + s + 100 * hvd.rank())
        gs = [tf.constant(rng.standard_normal(v.shape).astype(np.float32)) for v in variables]
        got = dense(gs)
        for j, (g, r) in enumerate(zip(gs, got)):
            expect = hvd.allreduce(g, name=f"graph_exchange.ref.{s}.{j}")
            worst = max(worst, float(np.abs(r.numpy() - expect.numpy()).max()))
    engine = dlgs.tensorflow.exchange("graph_exchange.dense")
    out["dense"] = {
        "max_diff": worst,
        "host_steps": engine.graph.host_steps,
        "step": engine.exchange.step,
    }
    # model.fit: the train function is traced again once the layout is settled;
    # with steps_per_execution=4 several steps share one call (a while loop),
    # and a budget of 1 (the dynamic controller's anchors) ends inside it.
    xs, ys = zip(*[batch(s) for s in range(steps)])
    fits = {"fit": (opts, 1), "fit4": (dict(opts, controller="dynamic", anchor_every=2), 4)}
    fits["fit1"] = (fits["fit4"][0], 1)
    for label, (fit_opts, per_call) in fits.items():
        model = mlp(23)
        opt = dlgs.tensorflow.keras.DistributedOptimizer(
            keras.optimizers.SGD(0.05), name=f"graph_exchange.{label}", **fit_opts
        )
        model.compile(
            optimizer=opt,
            loss="sparse_categorical_crossentropy",
            jit_compile=False,
            steps_per_execution=per_call,
        )
        model.fit(
            np.concatenate(xs),
            np.concatenate(ys),
            batch_size=16,
            epochs=2,
            shuffle=False,
            verbose=0,
        )
        out[label] = {
            "digest": digest(model),
            "traces": opt.dlgs.graph.traces,
            "host_steps": opt.dlgs.graph.host_steps,
            "step": opt.dlgs.exchange.step,
        }
    return out


def digest_array(v) -> str:
    return hashlib.sha256(np.asarray(v.numpy() if hasattr(v, "numpy") else v).tobytes()).hexdigest()


if __name__ == "__main__":
    main(sys.argv, hvd)
