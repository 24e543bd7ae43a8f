"""Merge strategies on a real model and real ranks: predicted vs measured.

Run under horovodrun; every rank trains the same model with each strategy in
turn (``dp``, ``none``, ``all``, ``buckets``, ``greedy``), and rank 0 writes::

    OUT/merge.csv   one row per measured step: strategy, iteration seconds,
                    predicted and measured end of communication (from the
                    first gradient), end of the compute stream
    OUT/merge.md    medians per strategy, prediction error, the goals, the command
    OUT/merge.png   predicted against measured communication end per strategy

Example::

    horovodrun -np 2 --gloo python -m benchmarks.merge --model resnet20 --steps 25 \\
        --out benchmarks/results/merge-loopback

The goals of the planner's issue: ``dp``'s prediction within 15% of what is
measured, and ``dp``'s measured iteration no slower than any other strategy's
(median over the measured steps of the same run).
"""

from __future__ import annotations

import argparse
import csv
import logging
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import dlgs.torch

from .models import FashionCNN, ResNet20

__all__ = ["main", "run_strategy"]

logger = logging.getLogger("benchmarks.merge")

STRATEGIES = ("dp", "none", "all", "buckets", "greedy")


def make_model(name: str) -> torch.nn.Module:
    if name == "resnet20":
        return ResNet20()
    if name == "fashion-cnn":
        return FashionCNN()
    raise ValueError(f"--model must be resnet20 or fashion-cnn, got {name!r}")


def run_strategy(args, strategy: str) -> List[Dict[str, float]]:
    """Train ``args.steps`` measured steps after the plan is in force."""
    torch.manual_seed(0)
    model = make_model(args.model)
    shape = (args.batch, 3, 32, 32) if args.model == "resnet20" else (args.batch, 1, 28, 28)
    opt = dlgs.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.0),
        named_parameters=model.named_parameters(),
        density=args.density,
        momentum=0.9,
        merge=strategy,
        profile_steps=args.profile_steps,
    )
    planner = opt.dlgs.planner
    planner.record = True
    g = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(shape, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    rows: List[Dict[str, float]] = []
    step = 0
    while len(planner.timings) < args.steps:
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        elapsed = time.perf_counter() - t0
        step += 1
        if planner.timings and planner.timings[-1]["step"] == step - 1:
            rows.append(dict(planner.timings[-1], strategy=strategy, iteration=elapsed))
        if step > args.steps + 50:
            raise RuntimeError("the planner did not start recording")
    logger.info("%s: plan\n%s", strategy, planner.plan.describe())
    if args.save_profile and strategy == "dp" and hvd.rank() == 0:
        planner.profile.save(args.save_profile)
        logger.info("saved the measured profile to %s", args.save_profile)
    return rows[-args.steps :]


def summarise(rows: List[Dict], command: str, args) -> str:
    by: Dict[str, List[Dict]] = {}
    for r in rows:
        by.setdefault(r["strategy"], []).append(r)
    lines = [
        f"# Merge strategies, {args.model}, {hvd.size()} ranks, density {args.density}",
        "",
        f"Command: `{command}`",
        "",
        "Times in ms, medians over the measured steps; `end` is the end of communication "
        "counted from the first gradient (predicted by the plan, measured as the end of the "
        "exchange's wait).",
        "",
        "| strategy | iteration | predicted end | measured end | compute end | prediction error |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    med = {}
    for s, rs in by.items():
        it = statistics.median(r["iteration"] for r in rs)
        pe = statistics.median(r["predicted_end"] for r in rs)
        me = statistics.median(r["measured_end"] for r in rs)
        ce = statistics.median(r["compute_end"] for r in rs)
        err = statistics.median(
            abs(r["predicted_end"] - r["measured_end"]) / r["measured_end"] for r in rs
        )
        med[s] = (it, err)
        lines.append(
            f"| {s} | {it * 1e3:.2f} | {pe * 1e3:.2f} | {me * 1e3:.2f} | "
            f"{ce * 1e3:.2f} | {err * 100:.1f}% |"
        )
    if "dp" in med:
        err = med["dp"][1]
        slower = [s for s, (it, _) in med.items() if s != "dp" and it < med["dp"][0]]
        lines += [
            "",
            "## Goals",
            "",
            f"- dp prediction within 15% of measured: **{'MET' if err <= 0.15 else 'NOT MET'}** "
            f"(median error {err * 100:.1f}%)",
            f"- dp iteration no slower than every other strategy: "
            f"**{'MET' if not slower else 'NOT MET'}**"
            + (f" (faster: {', '.join(slower)})" if slower else ""),
        ]
    return "\n".join(lines) + "\n"


def plot(rows: List[Dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, s in enumerate(dict.fromkeys(r["strategy"] for r in rows)):
        rs = [r for r in rows if r["strategy"] == s]
        ax.scatter(
            [r["predicted_end"] * 1e3 for r in rs],
            [r["measured_end"] * 1e3 for r in rs],
            label=s,
            s=12,
            color=f"C{i}",
        )
    lim = max(max(r["predicted_end"], r["measured_end"]) for r in rows) * 1e3 * 1.05
    ax.plot([0, lim], [0, lim], "k--", lw=0.8, label="measured = predicted")
    ax.set_xlabel("predicted end of communication (ms)")
    ax.set_ylabel("measured (ms)")
    ax.set_title("Merge plans: prediction against measurement")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet20", choices=["resnet20", "fashion-cnn"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=25, help="measured steps per strategy")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/merge"))
    parser.add_argument(
        "--save-profile",
        type=Path,
        default=None,
        help="write the dp run's measured profile (JSON) for python -m dlgs.plan",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if hvd.rank() == 0 else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
    )
    torch.set_num_threads(1)
    rows: List[Dict] = []
    for s in args.strategies.split(","):
        rows += run_strategy(args, s)
    if hvd.rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "merge.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        command = f"horovodrun -np {hvd.size()} python -m benchmarks.merge " + " ".join(
            shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
        )
        text = summarise(rows, command, args)
        (args.out / "merge.md").write_text(text)
        plot(rows, args.out / "merge.png")
        print(text)


if __name__ == "__main__":
    hvd.init()
    main()
