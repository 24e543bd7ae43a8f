"""Time the merge planner (:func:`dlgs.core.planning.dp.plan_dp`) on synthetic models.

The issue's goal: planning 1,000 layers takes at most 100 ms. This times the
real planner (numpy-vectorised Pareto DP) and, since a capped Pareto front makes
the plan approximate, reports each plan's predicted end against the best plan
any configuration found for the same model (``vs best``).

Each synthetic model has ``L`` layers with lognormal element counts (median
``1e4``, sigma 2: from a few elements to millions, like a network's mix of
biases, norms and weights). Costs are those of ``python -m dlgs.plan``'s
catalog models: backward ``2 * (2 * REUSE * n) / compute_flops`` with
``REUSE`` = 3,200 multiply-accumulates per parameter and step (100 uses per
sample, batch 32; the catalog's models range from 35 for the PTB LSTM to 160
for ResNet-50), sparsify and pack from 800 GB/s memory
(:func:`dlgs.catalog.sparsify_cost`, :func:`~dlgs.catalog.pack_cost`),
ring collectives from :mod:`dlgs.core.planning.netmodel`; density 0.01.

For every ``L``, ``max_group`` and ``max_front`` the planner runs ``--repeats`` times (median
reported) after one small warm-up call. A configuration whose first run takes
longer than ``--skip-after`` seconds is not repeated (its one time is
reported and marked), so that the whole run stays within a few minutes.

Writes ``planner.csv`` and ``planner.md`` (table, goal, exact command)::

    python -m benchmarks.planner --out benchmarks/results/planner-speed
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dlgs.catalog import DEFAULT_COMPUTE_FLOPS, pack_cost, sparsify_cost
from dlgs.core.planning.dp import LayerCost, PlanSpec, plan_dp
from dlgs.core.planning.netmodel import allgather_cost, allreduce_cost

__all__ = ["Result", "main", "parse_args", "run", "synthetic_spec", "write_csv", "format_markdown"]

logger = logging.getLogger("benchmarks.planner")

GOAL_LAYERS = 1000
GOAL_SECONDS = 0.100
REUSE = 3200  # forward multiply-accumulates per parameter and step (100 per sample x batch 32)
MEDIAN_SIZE = 1e4
CSV_FIELDS = (
    "layers", "max_group", "max_front", "median_s", "min_s", "max_s", "runs", "status",
    "messages", "sparse_messages", "predicted_end_s", "exact", "workers", "bandwidth_bps",
    "latency_s", "density",
)  # fmt: skip


@dataclass
class Result:
    """Timing of one ``(layers, max_group)`` configuration."""

    layers: int
    max_group: int | None
    max_front: int
    times: list[float] = field(default_factory=list)
    status: str = "ok"
    messages: int = 0
    sparse_messages: int = 0
    predicted_end: float = 0.0
    exact: bool = True

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def synthetic_spec(
    layers: int,
    *,
    seed: int = 0,
    workers: int = 16,
    bandwidth_bps: float = 10e9,
    latency_s: float = 50e-6,
    density: float = 0.01,
) -> PlanSpec:
    """A planner input of ``layers`` layers with lognormal sizes (see the module docstring)."""
    rng = random.Random(seed)
    sparsify, pack = sparsify_cost(), pack_cost()
    out = []
    for i in range(layers):
        n = max(1, round(rng.lognormvariate(math.log(MEDIAN_SIZE), 2.0)))
        k = max(1, math.ceil(density * n))
        out.append(
            LayerCost(
                name=f"layer{i}",
                backward=2 * (2 * REUSE * n) / DEFAULT_COMPUTE_FLOPS,
                sparse_bytes=4 + 8 * k,  # header word, float32 values, int32 indices
                dense_bytes=4 * n,
                sparsify=sparsify(n),
                pack=pack(n),
            )
        )
    return PlanSpec(
        tuple(out),
        allgather=allgather_cost(workers, bandwidth_bps, latency_s),
        allreduce=allreduce_cost(workers, bandwidth_bps, latency_s),
    )


def _max_groups(text: str) -> list[int | None]:
    out: list[int | None] = []
    for t in (t.strip() for t in text.split(",") if t.strip()):
        if t.lower() == "none":
            out.append(None)
            continue
        try:
            v = int(t)
        except ValueError:
            v = 0
        if v < 1:
            raise argparse.ArgumentTypeError(f"must be ints >= 1 or 'none', got {text!r}")
        out.append(v)
    if not out:
        raise argparse.ArgumentTypeError(f"must be ints >= 1 or 'none', got {text!r}")
    return out


def _layers(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        out = []
    if not out or any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(f"must be comma-separated ints >= 1, got {text!r}")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.planner", description="Time dlgs.core.planning.dp.plan_dp."
    )
    p.add_argument(
        "--layers",
        type=_layers,
        default=[100, 300, 1000],
        help="layer counts, comma-separated (default: 100,300,1000)",
    )
    p.add_argument(
        "--max-groups",
        type=_max_groups,
        default=[None, 64],
        help="max_group values, comma-separated, 'none' = any (default: none,64)",
    )
    p.add_argument(
        "--max-fronts",
        type=_layers,
        default=[8, 256],
        help="plan_dp's max_front values, comma-separated ints >= 2 (default: 8,256)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (default: 3)")
    p.add_argument(
        "--skip-after",
        type=float,
        default=60.0,
        help="do not repeat a point whose first run exceeds this many s (default: 60)",
    )
    p.add_argument("--workers", type=int, default=16, help="ranks of the ring model (default: 16)")
    p.add_argument(
        "--bandwidth", type=float, default=10e9, help="link bit/s of the ring model (default: 1e10)"
    )
    p.add_argument(
        "--latency", type=float, default=50e-6, help="ring-step latency in s (default: 5e-5)"
    )
    p.add_argument("--density", type=float, default=0.01, help="density (default: 0.01)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic sizes (default: 0)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/results/planner-speed"),
        help="output folder (default: benchmarks/results/planner-speed)",
    )
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be an int >= 1, got {args.repeats}")
    if min(args.max_fronts) < 2:
        p.error(f"--max-fronts must be ints >= 2, got {args.max_fronts}")
    if not 0 < args.density <= 1:
        p.error(f"--density must be in (0, 1], got {args.density}")
    return args


def run(args: argparse.Namespace) -> list[Result]:
    """Time every configuration."""
    plan_dp(synthetic_spec(20, seed=args.seed))  # warm-up
    results = []
    for layers in args.layers:
        spec = synthetic_spec(
            layers,
            seed=args.seed,
            workers=args.workers,
            bandwidth_bps=args.bandwidth,
            latency_s=args.latency,
            density=args.density,
        )
        for mg, mf in ((mg, mf) for mg in args.max_groups for mf in args.max_fronts):
            r = Result(layers, mg, mf)
            for i in range(args.repeats):
                t0 = time.perf_counter()
                plan = plan_dp(spec, max_group=mg, max_front=mf)
                r.times.append(time.perf_counter() - t0)
                if i == 0 and r.times[0] > args.skip_after and args.repeats > 1:
                    r.status = f"first run over {args.skip_after:g} s: not repeated"
                    break
            r.messages = len(plan.groups)
            r.sparse_messages = sum(g.sparse for g in plan.groups)
            r.predicted_end, r.exact = plan.end, plan.exact
            logger.info(
                "%d layers, max_group=%s, max_front=%d: median %.3f s over %d runs (%s)",
                layers,
                mg,
                mf,
                r.median,
                len(r.times),
                r.status,
            )
            results.append(r)
    return results


def write_csv(results: Sequence[Result], args: argparse.Namespace, path: Path) -> None:
    """``planner.csv``: one row per configuration (seconds)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in results:
            w.writerow(
                {
                    "layers": r.layers,
                    "max_group": "none" if r.max_group is None else r.max_group,
                    "max_front": r.max_front,
                    "median_s": f"{r.median:.6g}",
                    "min_s": f"{min(r.times):.6g}",
                    "max_s": f"{max(r.times):.6g}",
                    "runs": len(r.times),
                    "status": r.status,
                    "messages": r.messages,
                    "sparse_messages": r.sparse_messages,
                    "predicted_end_s": f"{r.predicted_end:.6g}",
                    "exact": r.exact,
                    "workers": args.workers,
                    "bandwidth_bps": f"{args.bandwidth:g}",
                    "latency_s": f"{args.latency:g}",
                    "density": f"{args.density:g}",
                }
            )


def _gap(r: Result, results: Sequence[Result]) -> float:
    best = min(o.predicted_end for o in results if o.layers == r.layers)
    return 100.0 * (r.predicted_end / best - 1.0)


def _goal(results: Sequence[Result]) -> list[str]:
    at_goal = [r for r in results if r.layers == GOAL_LAYERS]
    if not at_goal:
        return [
            f"- goal ({GOAL_LAYERS} layers in <= {GOAL_SECONDS * 1e3:.0f} ms): not measured "
            f"(no {GOAL_LAYERS}-layer run in this grid)"
        ]
    out = []
    for r in at_goal:
        met = r.median <= GOAL_SECONDS
        mg = "None" if r.max_group is None else r.max_group
        out.append(
            f"- goal: planning {GOAL_LAYERS} layers takes <= {GOAL_SECONDS * 1e3:.0f} ms, "
            f"`max_group={mg}, max_front={r.max_front}`: **{'MET' if met else 'NOT MET'}**: "
            f"median {r.median * 1e3:.0f} ms ({r.median / GOAL_SECONDS:.2g}x the goal), plan "
            f"{_gap(r, results):+.2f}% against the best plan found for {GOAL_LAYERS} layers"
        )
    return out


def format_markdown(
    results: Sequence[Result],
    args: argparse.Namespace,
    command: str,
    elapsed: float,
    load: tuple[float, float],
) -> str:
    """``planner.md``: goal, table, command and environment."""
    lines = [
        "# Merge planner speed (`dlgs.core.planning.dp.plan_dp`)",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')} by `benchmarks/planner.py` in "
        f"{elapsed:.0f} s. Command:",
        "",
        "```",
        command,
        "```",
        "",
        f"- Python {platform.python_version()}, numpy {np.__version__}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs visible; load average (1 min) at start / "
        f"end: {load[0]:.2f} / {load[1]:.2f} (other work shared this machine)",
        f"- synthetic layers: lognormal sizes (median {MEDIAN_SIZE:g} elements, sigma 2, seed "
        f"{args.seed}); backward from {REUSE} MACs per parameter and step at "
        f"{DEFAULT_COMPUTE_FLOPS / 1e12:g} TFLOP/s; "
        f"sparsify/pack from 800 GB/s memory; ring collectives at {args.workers} workers, "
        f"{args.bandwidth:g} bit/s, {args.latency * 1e6:g} us per step; density {args.density:g}",
        f"- `max_front` in {args.max_fronts}; median of {args.repeats} runs after a warm-up; "
        f"a point whose first run exceeds {args.skip_after:g} s is not repeated",
        "",
        "## Goal",
        "",
        *_goal(results),
        "",
        "## Results",
        "",
        "| layers | max_group | max_front | median ms | min ms | max ms | runs "
        "| messages (sparse) | predicted end ms | vs best | exact | status |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|:---|",
    ]
    for r in results:
        lines.append(
            f"| {r.layers} | {'none' if r.max_group is None else r.max_group} | {r.max_front} | "
            f"{r.median * 1e3:.1f} | {min(r.times) * 1e3:.1f} | {max(r.times) * 1e3:.1f} | "
            f"{len(r.times)} | {r.messages} ({r.sparse_messages}) | {r.predicted_end * 1e3:.2f} | "
            f"{_gap(r, results):+.2f}% | {r.exact} | {r.status} |"
        )
    lines += [
        "",
        "`exact` True: no Pareto front exceeded `max_front`, so the plan is optimal under the "
        "model. False: fronts were cut to the `max_front` states with the smallest lower bound "
        "on the iteration's end, so the plan may be worse than the optimum; `vs best` compares "
        "its predicted end with the best plan any configuration found for the same layers. "
        "Time grows about as L x min(L, max_group) x max_front candidate states, less what "
        "the bound prunes.",
        "",
    ]
    return "\n".join(lines)


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def main(argv: Sequence[str] | None = None) -> list[Result]:
    """Run the benchmark and write planner.csv and planner.md."""
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    command = "python -m benchmarks.planner" + ("" if not raw else " " + shlex.join(raw))
    load0, t0 = _load(), time.perf_counter()
    results = run(args)
    elapsed = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(results, args, args.out / "planner.csv")
    md = format_markdown(results, args, command, elapsed, (load0, _load()))
    (args.out / "planner.md").write_text(md)
    logger.info("wrote %s/planner.{csv,md} in %.0f s", args.out, elapsed)
    for line in _goal(results):
        logger.info("%s", line)
    return results


if __name__ == "__main__":
    main()
