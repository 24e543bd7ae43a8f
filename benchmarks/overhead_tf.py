"""TensorFlow: what the exchange adds to a traced training step.

Under ``horovodrun`` (every rank), ResNet-20 or the PTB LSTM (Keras 3,
``--model``) on one synthetic batch,
each method with its step traced by ``dlgs.tensorflow.function`` (``graph``:
dlgs' exchange in the graph where it can be) or a plain ``tf.function``
(``py-function``: traced once before the first step, the exchange in a
``tf.py_function`` every step, as the adapter ran it before the exchange went
into the graph). Per method, rank 0 writes one row:

* ``step_ms``: median time of a timed step (the whole call), the slower rank's;
* ``graph_ops``: operations in the traced step, its graph and every function
  it calls (``tf.cond`` branches), at the last trace; ``added_ops``: minus
  those of ``no-comm``;
* ``host_steps``: timed steps whose exchange ran as Python (the
  ``py_function`` branch, a host step: anchors, a new layout, logging);
* ``traces``: how many times the step was traced, warm-up included.

Writes ``overhead_tf.csv`` and ``overhead_tf.md``::

    horovodrun -np 2 --gloo python -m benchmarks.overhead_tf \\
        --out benchmarks/results/2026-12-05-tf-graph/overhead
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dlgs.tensorflow  # noqa: E402

from . import models_tf  # noqa: E402

__all__ = ["main"]

#: (label, dlgs options or None for a baseline, how the step is traced)
METHODS = [
    ("no-comm", None, "graph"),
    ("dense", None, "graph"),
    ("dlgs-none graph", {"merge": "none"}, "graph"),
    ("dlgs-none py-function", {"merge": "none"}, "py-function"),
    ("dlgs graph", {"merge": "dp"}, "graph"),
    ("dlgs py-function", {"merge": "dp"}, "py-function"),
]


#: model -> (builder, batch maker, default per-rank batch), as benchmarks.train
MODELS = {
    "resnet20": (models_tf.resnet20, models_tf.images, 32),
    "lstm": (models_tf.lstm_lm, models_tf.ptb_tokens, 20),
}


def count_ops(concrete: Any) -> int:
    """Operations in a concrete function's graph and in every function it calls."""
    graph = concrete.graph.as_graph_def()
    return len(graph.node) + sum(len(f.node_def) for f in graph.library.function)


def run_one(
    label: str, options: Optional[Dict[str, Any]], how: str, args: argparse.Namespace
) -> Dict[str, Any]:
    """Warm up, then time ``args.steps`` steps of one method on this rank."""
    spec = MODELS[args.model]
    model = spec[0](seed=0)
    hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
    variables = list(model.trainable_variables)
    opt = keras.optimizers.SGD(0.01)
    opt.build(variables)
    rng = np.random.default_rng(hvd.rank())
    x, y = (tf.constant(a) for a in spec[1](args.batch or spec[2], rng))
    name = f"overhead_tf.{label}"

    def step(x: tf.Tensor, y: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            )
        if label == "dense":
            grads = hvd.DistributedGradientTape(tape, sparse_as_dense=True).gradient(
                loss, [v.value for v in variables]
            )
        elif options is not None:
            dtape = dlgs.tensorflow.DistributedGradientTape(
                tape, density=args.density, profile_steps=3, name=name, **options
            )
            grads = dtape.gradient(loss, variables)
        else:
            grads = tape.gradient(loss, variables)
        opt.apply(grads, variables)

    fn = dlgs.tensorflow.function(step) if how == "graph" else tf.function(step)
    times: List[float] = []
    host_before = 0
    for i in range(args.warmup + args.steps):
        if i == args.warmup and options is not None:
            host_before = dlgs.tensorflow.exchange(name).graph.host_steps
        t0 = time.perf_counter()
        fn(x, y)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    traced = fn.traced if how == "graph" else fn  # the tf.function in force
    row: Dict[str, Any] = {
        "method": label,
        "step_ms": 1e3 * statistics.median(times),
        "graph_ops": count_ops(traced.get_concrete_function(x, y)),
        "traces": traced.experimental_get_tracing_count()
        + (getattr(fn, "retraces", 0) if how == "graph" else 0),
        "host_steps": None,
    }
    if options is not None:
        engine = dlgs.tensorflow.exchange(name)
        row["host_steps"] = engine.graph.host_steps - host_before
    return row


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet20")
    parser.add_argument("--batch", type=int, default=0, help="per rank; 0: the model's own")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    rows = [run_one(label, options, how, args) for label, options, how in METHODS]
    slowest = hvd.allgather_object([r["step_ms"] for r in rows], name="overhead_tf.times")
    if hvd.rank() != 0:
        return
    base = rows[0]["graph_ops"]
    for j, row in enumerate(rows):
        row["step_ms"] = round(max(times[j] for times in slowest), 1)
        row["added_ops"] = row["graph_ops"] - base
    args.out.mkdir(parents=True, exist_ok=True)
    fields = ["method", "step_ms", "graph_ops", "added_ops", "host_steps", "traces"]
    with open(args.out / "overhead_tf.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    command = "python -m benchmarks.overhead_tf " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [
        "# TensorFlow: what the exchange adds to a traced step",
        "",
        f"`{command}`: {args.model}, batch {args.batch or MODELS[args.model][2]}, "
        f"density {args.density}, "
        f"{hvd.size()} ranks, {args.warmup} warm-up and {args.steps} timed steps; "
        f"TensorFlow {tf.__version__}. host steps: timed steps whose exchange ran as Python.",
        "",
        "| " + " | ".join(fields) + " |",
        "|---|" + "---:|" * (len(fields) - 1),
    ]
    for row in rows:
        cells = ["—" if row[k] is None else str(row[k]) for k in fields]
        lines.append("| " + " | ".join(cells) + " |")
    (args.out / "overhead_tf.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
