"""TensorFlow: what the traced exchange costs on one rank, op by op.

One process (Horovod of size 1, so the collectives cost nothing), the layer
shapes of a benchmark model as ``tf.Variable`` s and a loss whose gradient is a
fixed random tensor per layer, so that a step is back-propagation of a product
plus dlgs' exchange. Each method's step is traced with
``dlgs.tensorflow.function`` and timed (median of the last steps); ``plain``
is the tape alone. With ``--ops``, TensorFlow's profiler records a few steps
of ``dlgs-none`` and the slowest operations of the traced exchange are listed
(milliseconds per step, from the profiler's trace).

Example::

    python -m benchmarks.tf_exchange_ops --model lstm --ops 15
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dlgs.tensorflow  # noqa: E402

from . import models_tf  # noqa: E402

__all__ = ["main"]

#: model -> builder (its trainable variables' shapes are used)
MODELS: Dict[str, Callable[..., Any]] = {
    "resnet20": models_tf.resnet20,
    "vgg16": models_tf.vgg16,
    "lstm": models_tf.lstm_lm,
}


def shapes_of(model: str) -> List[Sequence[int]]:
    return [tuple(v.shape) for v in MODELS[model](seed=0).trainable_variables]


def time_step(fn: Callable[[], Any], steps: int) -> float:
    """Median ms of the last ``steps`` calls (after as many untimed)."""
    times = []
    for i in range(2 * steps):
        t0 = time.perf_counter()
        out = fn()
        _ = out[0].numpy().reshape(-1)[:1]  # the step has run
        if i >= steps:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def slowest_ops(fn: Callable[[], Any], steps: int, top: int) -> List[tuple]:
    """(ms per step, op) of the traced exchange's slowest operations."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    logdir = tempfile.mkdtemp(prefix="dlgs-xprof-")
    tf.profiler.experimental.start(logdir)
    for _ in range(steps):
        fn()[0].numpy()
    tf.profiler.experimental.stop()
    space = xplane_pb2.XSpace()
    path = sorted(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True))[-1]
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    total: Dict[str, float] = collections.Counter()
    for plane in space.planes:
        for line in plane.lines:
            for ev in line.events:
                name = plane.event_metadata[ev.metadata_id].name
                if "cond/then" in name:  # the traced exchange's branch
                    total[name.split("/")[-1]] += ev.duration_ps / 1e9 / steps
    return [(ms, op) for op, ms in collections.Counter(total).most_common(top)]


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="lstm")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (as many untimed)")
    parser.add_argument("--ops", type=int, default=0, help="list this many slowest operations")
    args = parser.parse_args(argv)
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    rng = np.random.default_rng(0)
    shapes = shapes_of(args.model)
    variables = [
        tf.Variable(rng.standard_normal(s).astype(np.float32), name=f"v{i}")
        for i, s in enumerate(shapes)
    ]
    grads = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in shapes]

    def make(options: Optional[Dict[str, Any]]) -> Callable[[], Any]:
        def step():
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])
            if options is None:
                return tape.gradient(loss, variables)
            name = "tf_exchange_ops." + ".".join(f"{k}={v}" for k, v in options.items())
            dtape = dlgs.tensorflow.DistributedGradientTape(
                tape, density=args.density, profile_steps=2, name=name, **options
            )
            return dtape.gradient(loss, variables)

        return tf.function(step) if options is None else dlgs.tensorflow.function(step)

    params = sum(int(np.prod(s)) for s in shapes)
    print(f"{args.model}: {len(shapes)} tensors, {params / 1e6:.2f} M parameters, one rank")
    none = make({"merge": "none"})
    for label, fn in (("plain", make(None)), ("dlgs-none", none), ("dlgs", make({"merge": "dp"}))):
        print(f"{label:10s} {time_step(fn, args.steps):8.2f} ms per step")
    if args.ops:
        print("slowest operations of dlgs-none's traced exchange (ms per step):")
        for ms, op in slowest_ops(none, 10, args.ops):
            print(f"{ms:8.3f}  {op}")


if __name__ == "__main__":
    main()
