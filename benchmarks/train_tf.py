"""The TensorFlow / Keras 3 half of the training benchmark.

``python -m benchmarks.train --framework tensorflow`` dispatches here (torch is
never imported). Every rank builds the Keras model of ``benchmarks/models_tf.py``
from seed 0, broadcasts rank 0's weights, and trains it on one synthetic batch
with each method in turn, as ``benchmarks/train_torch.py`` does; the outputs are
the same (``benchmarks/report.py``), with ``framework=tensorflow`` in the CSV.

One step::

    with tf.GradientTape() as tape:
        loss = cross_entropy(y, model(x, training=True))
    tape, sources = <method>(tape)
    grads = tape.gradient(loss, sources)     # local gradient, then the exchange
    optimizer.apply(grads, model.trainable_variables)   # keras SGD(0.01), no momentum

Methods:

* ``no-comm``: the plain tape;
* ``dense`` / ``fp16``: ``hvd.DistributedGradientTape(tape, sparse_as_dense=True)``
  (fp16: ``compression=hvd.Compression.fp16``) with the sources
  ``[v.value for v in model.trainable_variables]``: Horovod 0.28.1's tape calls
  ``v.ref()``, which Keras 3 variables lack (``'Variable' object has no attribute
  'ref'``), so it is given the underlying ``tf.Variable`` s; the gradients are
  the same and are applied to the Keras variables. ``sparse_as_dense`` makes the
  LSTM's embedding gradient (a ``tf.IndexedSlices``) one dense allreduce, as the
  dense ``nn.Embedding`` gradient is in torch; Horovod's default would
  allgather the touched rows instead;
* ``topk`` / ``topk-buckets`` / ``dgc`` / ``dlgs-none`` / ``dlgs``:
  ``dlgs.tensorflow.DistributedGradientTape(tape, density=..., controller=...,
  merge=..., profile_steps=...)``, one exchange (``name=``) per method and round.

Every method densifies ``tf.IndexedSlices`` gradients before ``apply`` (no-comm
included), so every method updates every parameter, as in torch.

``--tf-mode function`` (default) compiles the whole step with
``dlgs.tensorflow.function``: dlgs' exchange runs as graph ops on the steps
that need no host work, and the step is traced again when the layout settles
(Horovod's allreduces are graph ops that start as their gradient is ready).
``--tf-mode py-function`` uses a plain ``tf.function`` traced once before the
first step: dlgs' exchange then runs eagerly inside one ``tf.py_function`` on
every step (as the adapter ran it before the exchange went into the graph).
Only the full iteration is timed in both. ``--tf-mode eager``
runs the step eagerly (about twice as slow on a CPU) and also measures backward
(the local ``tape.gradient``) and step wait (exchange plus ``apply``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

import horovod  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dlgs.tensorflow  # noqa: E402

from . import models_tf  # noqa: E402
from .report import (
    LR,
    SPARSE_METHODS,
    MethodTimes,
    base_method,
    guard_verdict,
    is_auto,
    is_merging,
    run_rounds,
    settle_steps,
    setup_rank_logging,
    sparse_options,
    wire_options,
    write_outputs,
)  # noqa: E402

__all__ = ["MODELS", "ModelSpec", "run", "run_method", "timing_text"]

logger = logging.getLogger("benchmarks.train")

Batch = Tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class ModelSpec:
    """How to build and feed one benchmark model (the loss is always the mean
    sparse cross-entropy of the logits).

    Attributes:
        build: a fresh model, seeded inside (same weights on every rank).
        batch: default per-rank batch size (as in torch).
        make_batch: ``(batch, rng) -> (inputs, targets)``, synthetic.
        sample: what one sample is, for the report.
    """

    build: Callable[[], keras.Model]
    batch: int
    make_batch: Callable[[int, np.random.Generator], Batch]
    sample: str


MODELS: Dict[str, ModelSpec] = {
    "resnet20": ModelSpec(models_tf.resnet20, 32, models_tf.images, "32x32 image"),
    "vgg16": ModelSpec(models_tf.vgg16, 32, models_tf.images, "32x32 image"),
    "lstm": ModelSpec(models_tf.lstm_lm, 20, models_tf.ptb_tokens, "35-token sequence"),
}


def timing_text(mode: str) -> str:
    """What the Markdown says the columns measure, for ``--tf-mode``."""
    if mode == "eager":
        breakdown = (
            "Backward (the local `tape.gradient`, up to where Horovod's or dlgs' tape "
            "takes the gradients) and step wait (the exchange: Horovod's allreduces or "
            "dlgs' selection and messages, then `optimizer.apply`) are that rank's medians."
        )
    else:
        breakdown = (
            "The step is one `tf.function` (dlgs' exchange in the graph with `function`, "
            "inside one `tf.py_function` with `py-function`), so the backward / step-wait "
            "breakdown is not measured (—; `--tf-mode eager` measures it, on slower steps)."
        )
    return (
        "Step times in ms: a full iteration (forward under a `tf.GradientTape`, "
        "`tape.gradient` with the exchange, `optimizer.apply`), median [p10–p90] over "
        "the timed steps, of the slowest rank (largest median). "
        + breakdown
        + " Sparsify: for the methods built on dlgs, that rank's median host time in its "
        "exchange's submits (selection, packing, starting collectives), which run after "
        "the local gradient, inside step wait. Wire: bytes one rank contributes per step "
        "(dense/fp16: 4/2 bytes per parameter; dlgs: `.dlgs.exchange.wire_bytes()`, "
        "every message at capacity with its header, dense layers at 4 bytes; with "
        "`--rounds`, the mean over rounds, as each round plans anew). Efficiency: "
        "no-comm median / method median."
    )


class _TimedTape(tf.GradientTape):
    """A tape that notes when its own (local) ``gradient`` returns.

    Horovod's and dlgs' tapes derive a class from the user's tape class and
    call its ``gradient`` before exchanging, so ``local_done`` separates the
    backward pass from the exchange (eager mode only: under ``tf.function``
    this runs at trace time).
    """

    local_done = 0.0

    def gradient(
        self,
        target,
        sources,
        output_gradients=None,
        unconnected_gradients=tf.UnconnectedGradients.NONE,
    ):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        self.local_done = time.perf_counter()
        return grads


def _dense(g: Any) -> Any:
    return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def _wrapper(
    method: str,
    variables: List[Any],
    *,
    density: float,
    profile_steps: int,
    name: str,
    wire: Optional[Dict[str, str]] = None,
) -> Callable[[tf.GradientTape], Tuple[tf.GradientTape, List[Any]]]:
    """``tape -> (distributed tape, sources)`` for ``method``."""
    if method == "no-comm":
        return lambda tape: (tape, variables)
    if method in ("dense", "fp16"):
        compression = hvd.Compression.fp16 if method == "fp16" else hvd.Compression.none
        # Horovod's tape needs tf.Variable sources under Keras 3 (module docstring).
        sources = [v.value for v in variables]
        return lambda tape: (
            hvd.DistributedGradientTape(tape, compression=compression, sparse_as_dense=True),
            sources,
        )
    options = sparse_options(method, density)
    return lambda tape: (
        dlgs.tensorflow.DistributedGradientTape(
            tape,
            **options,
            profile_steps=profile_steps,
            name=name,
            **(wire or {}),
        ),
        variables,
    )


def run_method(
    spec: ModelSpec,
    method: str,
    data: Tuple[tf.Tensor, tf.Tensor],
    *,
    density: float,
    warmup: int,
    steps: int,
    profile_steps: int,
    mode: str,
    name: str,
    progress: Optional[Any] = None,
    wire: Optional[Dict[str, str]] = None,
) -> MethodTimes:
    """Warm up, then time ``steps`` full iterations of ``method`` on this rank.

    The model is built from seed 0 and rank 0's weights are broadcast, so every
    method starts from the same weights. ``name`` names the dlgs exchange (one
    per call: residuals and plans must not carry over). For merging dlgs
    methods the warm-up covers the profile and the first planned step; a plan
    not in force by then is an error (the timed steps would measure the
    profiler).
    """
    model = spec.build()
    # Keras 3 variables: broadcast the underlying tf.Variables (BN statistics too).
    hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
    variables = list(model.trainable_variables)
    opt = keras.optimizers.SGD(LR, momentum=0.0)
    opt.build(variables)
    wrap = _wrapper(
        method, variables, density=density, profile_steps=profile_steps, name=name, wire=wire
    )
    last: Dict[str, Any] = {}

    def step(x: tf.Tensor, y: tf.Tensor) -> Tuple[float, float]:
        """One step; returns (forward done, local gradient done) in eager mode."""
        with _TimedTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            )
        forward_done = time.perf_counter()
        dtape, sources = wrap(tape)
        last["tape"] = dtape
        grads = dtape.gradient(loss, sources)
        opt.apply([_dense(g) for g in grads], variables)
        return forward_done, dtape.local_done

    compiled = None
    if mode != "eager":

        def whole(x: tf.Tensor, y: tf.Tensor) -> None:
            step(x, y)

        # function: traced again when dlgs' layout settles (its exchange in the
        # graph); py-function: traced once, before the first step (the
        # exchange in a py_function on every step).
        compiled = dlgs.tensorflow.function(whole) if mode == "function" else tf.function(whole)

    merging = is_merging(method)
    sparse = base_method(method) in SPARSE_METHODS
    x, y = data
    out = MethodTimes(method)
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        if compiled is not None:
            compiled(x, y)
            t1 = t2 = float("nan")
        else:
            t1, t2 = step(x, y)
        t3 = time.perf_counter()
        if i >= warmup:
            out.iteration.append(t3 - t0)
            if compiled is None:
                out.backward.append(t2 - t1)
                out.step_wait.append(t3 - t2)
            if sparse and compiled is None:  # a traced step's submit is not timed
                out.sparsify.append(last["tape"].dlgs.exchange.last_step.submit_seconds)
        elif i == warmup - 1 and merging and not last["tape"].dlgs.planner.settled:
            raise RuntimeError(
                f"{method}: no final merge plan after {warmup} warm-up steps "
                f"(expected one after {settle_steps(profile_steps, is_auto(method))})"
            )
        if progress is not None:
            progress.update(1)
    params = sum(int(np.prod(v.shape)) for v in variables)
    if method == "dense":
        out.wire_bytes = 4 * params
    elif method == "fp16":
        out.wire_bytes = 2 * params
    elif sparse:
        tape = last["tape"]
        out.wire_bytes = tape.dlgs.exchange.wire_bytes()
        out.density = tape.dlgs.exchange.density
        out.messages = len(tape.dlgs.exchange.groups)
        out.guard = guard_verdict(tape.dlgs.planner)
        if merging:
            logger.debug("%s: plan in force\n%s", method, tape.dlgs.planner.plan.describe())
    return out


def _set_threads(threads: int) -> None:
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError as err:  # TensorFlow's runtime already started in this process
        logger.warning("could not set TensorFlow's threads to %d: %s", threads, err)


def run(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """Run the benchmark on this rank (under horovodrun on every rank);
    ``args`` from :func:`benchmarks.report.parse_args`, ``argv`` for the record."""
    threads = int(os.environ.get("DLGS_THREADS", "1"))
    _set_threads(threads)  # before anything starts TensorFlow's runtime
    hvd.init()
    rank = hvd.rank()
    setup_rank_logging(rank, args.verbose)
    spec = MODELS[args.model]
    batch = args.batch or spec.batch
    x, y = spec.make_batch(batch, np.random.default_rng(1000 + rank))
    data = (tf.constant(x), tf.constant(y))
    load_start = os.getloadavg()[0]

    def barrier() -> None:  # horovod.tensorflow has none
        hvd.allreduce(tf.zeros([]), name="benchmarks.train.barrier")

    def one(method: str, round_: int, warmup: int, bar: Any) -> MethodTimes:
        return run_method(
            spec,
            method,
            data,
            density=args.density,
            warmup=warmup,
            steps=args.steps,
            profile_steps=args.profile_steps,
            mode=args.tf_mode,
            name=f"benchmarks.train.{method}.{round_}",
            progress=bar,
            wire=wire_options(args),
        )

    mine = run_rounds(args, rank, barrier, one)
    gathered = hvd.allgather_object([vars(t) for t in mine.values()], name="benchmarks.train.times")
    if rank != 0:
        return
    how = {
        "function": "each step one tf.function (dlgs' exchange in the graph where it can be)",
        "py-function": "each step one tf.function (dlgs' exchange in a tf.py_function)",
    }.get(args.tf_mode, "eager steps")
    section = write_outputs(
        gathered,
        args,
        argv,
        batch=batch,
        workers=hvd.size(),
        versions=f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
        f"Horovod {horovod.__version__}, {how}",
        threads=f"{threads} TensorFlow intra-op and inter-op thread(s) per rank",
        sample=spec.sample,
        timing=timing_text(args.tf_mode),
        load_start=load_start,
    )
    print(section)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m benchmarks.train_tf ARGS`` = ``python -m benchmarks.train --framework
    tensorflow ARGS``."""
    from .train import main as train_main

    train_main(["--framework", "tensorflow", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
