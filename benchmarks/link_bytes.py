"""Bytes that cross each node's link per step: dense Horovod, flat dlgs,
``topology="hierarchical"`` dlgs and ``transport="reduce"`` dlgs, interleaved
in rounds in one job.

Run inside the two-level local cluster, whose nodes see their link as
``dlgs0``::

    python -m benchmarks.cluster --nodes 2 --ranks-per-node 2 --bandwidth none -- \\
        python -m benchmarks.link_bytes --model resnet50 --out bench-results/link-bytes

The model is a catalog model's parameter tensors (``dlgs.catalog``) and
a synthetic backward (each step's gradients random, per rank): bytes do not
depend on compute. Each method runs ``--steps`` steps per round after its own
warm-up step; local rank 0 of every node reads the link's counters (both
ways) around them, between two barriers. The bytes are a count, the same at
any bandwidth (the cluster may run uncapped); the step times (rank 0's, between
the barriers) depend on the cap and, on a small machine, on its cores (the
ranks of a "node" share them, and its dense traffic is memory copies).

With ``--ranks-per-node 1`` every rank is a node: the bytes are per rank, as
the reduction's goal counts them (at 2, 4 and 8 ranks)::

    python -m benchmarks.cluster --nodes 8 --bandwidth none --no-measure -- \
        python -m benchmarks.link_bytes --methods dlgs-flat,dlgs-reduce --out OUT
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import horovod.torch as hvd
import torch

import dlgs.torch
from benchmarks.cluster import link_bytes
from dlgs.catalog import MODELS, catalog_model

logger = logging.getLogger("benchmarks.link_bytes")

METHODS = ("dense", "dlgs-flat", "dlgs-hier", "dlgs-hier-reduce", "dlgs-reduce", "dlgs-route")
#: Each dlgs method's transport (``dlgs-route``: ``transport="auto"``;
#: ``dlgs-hier-reduce``: the two-level exchange with the sparse reduction between
#: nodes).
TRANSPORTS = {"dlgs-reduce": "reduce", "dlgs-route": "auto", "dlgs-hier-reduce": "reduce"}
#: The methods that run the two-level exchange.
TWO_LEVEL = ("dlgs-hier", "dlgs-hier-reduce")


def _barrier() -> None:
    hvd.allreduce(torch.zeros(1), name="link_bytes.barrier", op=hvd.Sum)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="resnet50")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--value-dtype", default="float16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma list of {', '.join(METHODS)} (dense is slow on a slow link)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/link-bytes"))
    args = parser.parse_args(argv)
    methods = tuple(m for m in METHODS if m in args.methods.split(","))
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown or not methods:
        parser.error(f"argument --methods: unknown {sorted(unknown)} (choose from {METHODS})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    hvd.init(process_sets="dynamic")
    torch.set_num_threads(1)
    rank, local = hvd.rank(), hvd.local_rank()
    spec = catalog_model(args.model)
    gen = torch.Generator().manual_seed(rank)
    weights = [torch.randn(layer.numel, generator=gen) for layer in reversed(spec.layers)]

    def optimizer(method: str):
        # Each method its own parameters: an optimizer hooks its parameters' gradients.
        params = [
            (layer.name.replace(".", "_"), torch.nn.Parameter(torch.zeros(layer.numel)))
            for layer in reversed(spec.layers)  # registration order
        ]
        sgd = torch.optim.SGD([p for _, p in params], lr=0.0)
        if method == "dense":
            return params, hvd.DistributedOptimizer(sgd, named_parameters=params)
        return params, dlgs.torch.DistributedOptimizer(
            sgd,
            named_parameters=params,
            density=args.density,
            value_dtype=args.value_dtype,
            merge="none",
            topology="hierarchical" if method in TWO_LEVEL else "flat",
            transport=TRANSPORTS.get(method, "allgather"),
        )

    opts = {m: optimizer(m) for m in methods}

    def step(method: str) -> None:
        params, opt = opts[method]
        opt.zero_grad()
        loss = sum((p * w).sum() for (_, p), w in zip(params, weights))
        loss.backward()
        opt.step()

    per_step: Dict[str, List[float]] = {m: [] for m in methods}
    seconds: Dict[str, List[float]] = {m: [] for m in methods}
    for r in range(args.rounds):
        order = methods[r % len(methods) :] + methods[: r % len(methods)]
        for method in order:
            step(method)  # warm-up (layout, the first exchange)
            _barrier()
            before, t0 = link_bytes(), time.perf_counter()
            for _ in range(args.steps):
                step(method)
            _barrier()
            after = link_bytes()
            seconds[method].append((time.perf_counter() - t0) / args.steps)
            if local == 0 and before is not None and after is not None:
                per_step[method].append((after - before) / args.steps)
    rows = hvd.allgather_object((rank, local, per_step), name="link_bytes.rows")
    # Step times (between barriers: every rank ends a round together): rank 0's.
    if rank == 0:
        nodes = [ps for _, lr, ps in rows if lr == 0]
        if not all(ps[m] for ps in nodes for m in methods):
            logger.error("no link counters (not inside benchmarks.cluster's namespaces?)")
            return 1
        summary = {m: statistics.mean(statistics.mean(ps[m]) for ps in nodes) for m in methods}
        spread = {
            m: (min(min(ps[m]) for ps in nodes), max(max(ps[m]) for ps in nodes)) for m in methods
        }
        ell = hvd.local_size()
        other = "dlgs-hier" if "dlgs-hier" in methods else methods[-1]
        # (One method alone, e.g. the largest clusters' memory: no ratio.)
        base = "dlgs-flat" if "dlgs-flat" in methods else other
        ratio = summary[other] / summary[base]
        speedup = statistics.median(seconds[base]) / statistics.median(seconds[other])
        lines = [
            f"# Bytes across each node's link per step: {args.model}, "
            f"{hvd.size() // ell} nodes x {ell} ranks",
            "",
            f"`{' '.join(sys.argv)}` - density {args.density:g}, values {args.value_dtype}, "
            f"{args.steps} steps x {args.rounds} rounds per method, interleaved; both "
            "directions of each node's link (interface counters); the barriers' few bytes "
            "included.",
            "",
            "| method | MB per step per node link (mean) | min - max over nodes and rounds "
            "| s per step (median of rounds; min - max) |",
            "|---|---:|---:|---:|",
        ]
        for m in methods:
            lo, hi = spread[m]
            t = seconds[m]
            lines.append(
                f"| {m} | {summary[m] / 1e6:.3f} | {lo / 1e6:.3f} - {hi / 1e6:.3f} | "
                f"{statistics.median(t):.3f} ({min(t):.3f} - {max(t):.3f}) |"
            )
        lines += [
            "",
            f"Bytes each rank sends and receives between nodes per step (a node link's over its "
            f"{ell} ranks): "
            + ", ".join(f"{m} {summary[m] / ell / 1e6:.3f} MB" for m in methods)
            + ".",
        ]
        if base == other:
            lines += ["(One method: no ratio to dlgs-flat.)"]
        lines += [
            "",
            f"{other} / dlgs-flat = {ratio:.3f}"
            + (f" (goal: at most 1.1/L = {1.1 / ell:.3f})" if other == "dlgs-hier" else "")
            + (
                f"; dlgs-flat / dense = {summary['dlgs-flat'] / summary['dense']:.3f}."
                if "dense" in summary
                else "."
            ),
            f"Step time dlgs-flat / {other} = {speedup:.2f}x (medians of rounds).",
        ]
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "link_bytes.md").write_text("\n".join(lines) + "\n")
        (args.out / "link_bytes.json").write_text(
            json.dumps(
                {
                    "per_step": summary,
                    "spread": spread,
                    "ratio": ratio,
                    "seconds": seconds,
                    "ranks": hvd.size(),
                    "ranks_per_node": ell,
                },
                indent=2,
            )
        )
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
