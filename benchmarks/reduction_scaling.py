"""Bytes each rank sends between nodes per step under ``topology="hierarchical"``
with the sparse reduction between nodes, counted from the layouts
the exchange builds, for 2 to 64 nodes of ``L`` ranks. Pure arithmetic: the
blocks of :func:`dlgs.core.transport.reduction.reduction_bytes` per sparse
layer (layer-wise, ``merge="none"``, as ``benchmarks/link_bytes.py`` runs
it), the ring allreduce of the dense layers' shards, and, for comparison,
the allgather between nodes. What the interface counters add on top
(Horovod's negotiation, TCP) is in ``benchmarks/link_bytes.py``'s runs::

    python -m benchmarks.reduction_scaling --model resnet50 --out OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List

from dlgs.catalog import MODELS, catalog_model
from dlgs.core.config import SparsityConfig
from dlgs.core.transport.hierarchical import shard_size
from dlgs.core.transport.reduction import reduction_bytes
from dlgs.core.wire import plan_layers


def per_rank(model: str, nodes: int, local: int, config: SparsityConfig) -> Dict[str, float]:
    """Bytes one rank sends between nodes per step (one direction)."""
    shards = [shard_size(layer.numel, local) for layer in catalog_model(model).layers]
    plans = plan_layers(shards, config.density, config)
    reduce = gather = dense = 0.0
    for m, plan in zip(shards, plans):
        if not plan.sparse:
            dense += 2 * (nodes - 1) / nodes * 4 * m  # ring allreduce of the shard
            continue
        sent, kept = reduction_bytes(
            m, plan.capacity, nodes, config.reduce_width, config.value_dtype, config.index_coding
        )
        # The alltoall's blocks to the other nodes, the ring allgather's kept blocks.
        reduce += (nodes - 1) / nodes * sent + (nodes - 1) * kept
        gather += (nodes - 1) * plan.sparse_bytes  # the ring allgather of the chunk
    return {"reduce": reduce + dense, "allgather": gather + dense, "dense": dense}


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="resnet50")
    parser.add_argument("--nodes", default="2,4,8,16,32,64")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--value-dtype", default="float16")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    config = SparsityConfig(density=args.density, value_dtype=args.value_dtype)
    counts = [int(n) for n in args.nodes.split(",")]
    rows = {n: per_rank(args.model, n, args.ranks_per_node, config) for n in counts}
    first = rows[counts[0]]
    lines = [
        f"# Bytes each rank sends between nodes per step: {args.model}, nodes of "
        f"{args.ranks_per_node}, density {args.density:g}, {args.value_dtype} values",
        "",
        f"`python -m benchmarks.reduction_scaling {' '.join(argv or sys.argv[1:])}`: counted "
        "from the layouts (one direction; the same is received).",
        "",
        "| nodes | reduction between nodes (MB) | vs the first | allgather between nodes (MB) "
        "| of which dense layers (MB) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n, r in rows.items():
        lines.append(
            f"| {n} | {r['reduce'] / 1e6:.3f} | {r['reduce'] / first['reduce']:.2f}x | "
            f"{r['allgather'] / 1e6:.3f} | {r['dense'] / 1e6:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "reduction_scaling.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
