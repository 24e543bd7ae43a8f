"""Training throughput: dense Horovod, fp16, top-k, DGC and dlgs on real ranks.

Run under horovodrun; every rank trains the same model on synthetic data with
each method in turn (same process, same initial weights) and rank 0 writes::

    OUT/train.csv   one row per method: median step time with p10/p90, global
                    samples/s, bytes this rank puts on the wire per step, the
                    backward / step-wait breakdown, efficiency against the
                    compute-only bound and speed-up over dense Horovod, and
                    the framework
    OUT/train.md    the table, the exact command, framework/Horovod versions, world size
    OUT/train.png   samples/s by method, annotated with the speed-up over dense

Example::

    horovodrun -np 2 --gloo python -m benchmarks.train --model resnet20 \\
        --methods no-comm,dense,fp16,topk,dgc,dlgs-none,dlgs --steps 20 --warmup 8 \\
        --out benchmarks/results/train-loopback-resnet20

``--framework torch`` (the default, ``benchmarks/train_torch.py``; models
``resnet20``, ``vgg16``, ``lstm``, ``bert-small``) or ``--framework
tensorflow`` (``benchmarks/train_tf.py``, Keras 3; ``resnet20``, ``vgg16``,
``lstm``; torch is never imported). This module only parses the command line
(``benchmarks/report.py``) and dispatches.

Methods (plain SGD, lr 0.01, no momentum, for all of them, so each step does
the same work; this measures speed, not convergence):

* ``no-comm``: the wrapped optimizer alone, no exchange: the compute bound;
* ``dense`` / ``fp16``: Horovod's dense allreduce (torch:
  ``hvd.DistributedOptimizer``; TensorFlow: ``hvd.DistributedGradientTape``
  over the Keras variables' ``v.value``), fp16 with ``hvd.Compression.fp16``;
* ``topk`` / ``topk-buckets`` / ``dgc``: dlgs with the ``topk`` controller
  layer-wise / in ``bucket_elements`` buckets, and the ``dgc`` (sampled top-k)
  controller layer-wise;
* ``dlgs-none`` / ``dlgs``: the dynamic controller layer-wise / with the DP merge
  plan (the product default).

A sparse method may name its own density: ``dlgs@0.001`` runs ``dlgs`` at
0.001 whatever ``--density`` says, and ``dlgs@auto`` runs it with
``density="auto"`` (the density in force is then recorded in the ``density``
column). One run can so compare several densities, interleaved in rounds.

torch uses ``dlgs.torch.DistributedOptimizer``, TensorFlow
``dlgs.tensorflow.DistributedGradientTape``.

A step is a full iteration (torch: zero_grad, forward, backward, step;
TensorFlow: forward under a tape, ``tape.gradient``, ``optimizer.apply``); the
median over ``--steps`` steps (times ``--rounds``) of the slowest rank is
reported, since synchronous training runs at the pace of its slowest worker.

``--append`` adds the rows to an existing CSV (for suites over several
networks, e.g. with ``--label 100mbit``, or both frameworks), appends a section
to the Markdown and redraws the plot from every row.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from .report import parse_args

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Run the benchmark on this rank (call under horovodrun on every rank)."""
    argv = list(argv) if argv is not None else sys.argv[1:]
    args = parse_args(argv, description=(__doc__ or "").splitlines()[0])
    if args.framework == "tensorflow":
        from .train_tf import run
    else:
        from .train_torch import run
    run(args, argv)


if __name__ == "__main__":
    main()
