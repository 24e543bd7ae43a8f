"""What the merge planner costs over a whole run: bytes and time of profiling.

The DP merge plan (``merge="dp"``, the default) is made from a profile: a few
traced steps, probe collectives of several sizes, broadcasts, a guard that
times the plan against layer-wise sending, drift checks and re-profiles. Those
cost bytes and time that dense Horovod does not spend; on a fast link, where
the plan sends every layer dense, nothing pays them back unless the profiling
itself is cheap. This benchmark trains a small MLP (304,170 parameters,
Fashion-MNIST, SGD with momentum) for ``--steps`` steps on 2 ranks with:

* ``dense``: ``hvd.DistributedOptimizer``;
* ``dlgs``: ``dlgs.torch.DistributedOptimizer`` with its defaults (dynamic
  controller, density 0.01, ``merge="dp"``);
* ``dlgs-none``: the same, layer by layer (``merge="none"``: no profiling);

interleaved in ``--rounds`` rounds, and reports per method and rank:

* ``kernel_bytes``: bytes the rank's network interface sent during the run
  (``/sys/class/net/IFACE/statistics/tx_bytes``): payload, TCP/IP headers,
  Horovod's negotiation and every probe. On the netns cluster (root; the
  default, links not rate-limited) IFACE is the rank's own veth; on plain
  loopback (no root) it is ``lo``, shared by both ranks, and the figure is
  half of its count;
* ``exchange_bytes``: what the exchange's messages carry, summed step by step
  (``exchange.wire_bytes()`` of the layout in force; dense: 4 bytes per
  parameter per step);
* ``planner_bytes`` / ``planner_s``: the planner's own probes and broadcasts,
  and its host time (``opt.dlgs.planner.cost``), with their shares of the
  run's bytes and time;
* the run's wall time, profiles measured, plans made and the guard's verdict.

Writes ``profiling.csv``, ``profiling.md`` and ``profiling.png`` (cumulative
bytes per rank over the steps, one line per method, first round)::

    python -m benchmarks.profiling --steps 1000 --rounds 3 --out benchmarks/results/profiling
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .report import positive_int, progress_bar, setup_rank_logging

logger = logging.getLogger("benchmarks.profiling")

METHODS = ("dense", "dlgs", "dlgs-none")
#: MLP widths: 784 -> 320 -> 160 -> 10 (304,170 parameters).
WIDTHS = (784, 320, 160, 10)
BATCH = 32  # per rank
LR, MOMENTUM = 0.05, 0.9
FIELDS = (
    "round",
    "method",
    "steps",
    "seconds",
    "kernel_bytes",
    "exchange_bytes",
    "planner_bytes",
    "planner_s",
    "probes",
    "profiles",
    "plans",
    "broadcasts",
    "probe_s",
    "broadcast_s",
    "saved_bytes",
    "guard",
    "messages",
    "sparse_messages",
    "final_loss",
)


def _methods(text: str) -> List[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METHODS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"methods must be a comma list of {METHODS}, got {text!r}")
    return names


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.profiling",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=positive_int, default=1000, help="steps per run")
    parser.add_argument("--rounds", type=positive_int, default=3, help="runs of each method")
    parser.add_argument(
        "--methods", type=_methods, default=list(METHODS), help=f"comma list of {METHODS}"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/profiling"))
    parser.add_argument("--verbose", action="store_true", help="dlgs' plan and profile lines")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- on every rank ---------------------------------------------------------------
def _iface() -> str:
    return "dlgs0" if os.environ.get("DLGS_CLUSTER") == "netns" else "lo"


def _tx_bytes(iface: str) -> int:
    return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())


def _mlp():
    import torch.nn as nn

    layers: List[Any] = []
    for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(WIDTHS) - 2 else [])
    return nn.Sequential(nn.Flatten(), *layers)


def run_method(method: str, steps: int, images, labels, bar) -> Dict[str, Any]:
    """Train ``method`` for ``steps`` steps on this rank; its row and its
    cumulative bytes per step (exchange plus planner)."""
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    import dlgs.torch

    torch.manual_seed(0)
    model = _mlp()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    params = sum(p.numel() for p in model.parameters())
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    if method == "dense":
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    else:
        opt = dlgs.torch.DistributedOptimizer(
            sgd,
            named_parameters=model.named_parameters(),
            merge="dp" if method == "dlgs" else "none",
        )
    iface = _iface()
    n = images.shape[0]
    cumulative: List[int] = []
    exchange = 0
    hvd.allreduce(torch.zeros(1), name=f"benchmarks.profiling.start.{method}")
    tx0, t0 = _tx_bytes(iface), time.perf_counter()
    loss = torch.zeros(())
    for step in range(steps):
        i = (step * BATCH) % (n - BATCH)
        opt.zero_grad()
        loss = F.cross_entropy(model(images[i : i + BATCH]), labels[i : i + BATCH])
        loss.backward()
        opt.step()
        if method == "dense":
            exchange += 4 * params
            cumulative.append(exchange)
        else:
            exchange += opt.dlgs.exchange.wire_bytes()
            cumulative.append(exchange + opt.dlgs.planner.cost["bytes"])
        bar.update(1)
    hvd.allreduce(torch.zeros(1), name=f"benchmarks.profiling.end.{method}")
    seconds, tx = time.perf_counter() - t0, _tx_bytes(iface) - tx0
    row: Dict[str, Any] = {
        "method": method,
        "steps": steps,
        "seconds": seconds,
        "kernel_bytes": tx / (hvd.size() if iface == "lo" else 1),
        "exchange_bytes": exchange,
        "final_loss": float(loss.detach()),
    }
    if method != "dense":
        planner = opt.dlgs.planner
        cost = planner.cost
        row.update(
            planner_bytes=cost["bytes"],
            planner_s=cost["seconds"],
            probes=cost["probes"],
            profiles=cost["profiles"],
            plans=planner.plans_made,
            broadcasts=cost["broadcasts"],
            probe_s=cost["probe_seconds"],
            broadcast_s=cost["broadcast_seconds"],
            saved_bytes=cost["saved_bytes"],
            guard="" if planner.guard_result is None else planner.guard_result["kept"],
            messages=len(opt.dlgs.exchange.groups),
            sparse_messages=sum(g.sparse for g in opt.dlgs.exchange.groups),
        )
    return {"row": row, "cumulative": cumulative}


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch
    from tqdm.contrib.logging import logging_redirect_tqdm

    from .datasets import fashion_mnist

    hvd.init()
    rank = hvd.rank()
    setup_rank_logging(rank, args.verbose)
    torch.set_num_threads(1)
    x, y = fashion_mnist("train")
    images = torch.from_numpy(x[rank :: hvd.size()].copy())
    labels = torch.from_numpy(y[rank :: hvd.size()].copy())
    results = []
    total = args.rounds * len(args.methods) * args.steps
    bar = progress_bar(total, rank)
    with bar, logging_redirect_tqdm():
        for round_ in range(args.rounds):
            for method in args.methods:
                bar.set_description(f"round {round_ + 1} {method}")
                got = run_method(method, args.steps, images, labels, bar)
                got["row"]["round"] = round_ + 1
                results.append(got)
    every = hvd.allgather_object(results, name="benchmarks.profiling.rows")
    if rank == 0:
        write_outputs(every, args, hvd.size())


# -- rank 0: outputs ---------------------------------------------------------------
def summarise(every: Sequence[Sequence[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """One row per round and method: the mean over ranks (bytes and times) with
    each share against that round's dense run."""
    rows = []
    for j, first in enumerate(every[0]):
        row = dict(first["row"])
        for key in ("seconds", "kernel_bytes", "exchange_bytes", "planner_bytes", "planner_s"):
            if key in row:
                row[key] = statistics.mean(r[j]["row"][key] for r in every)
        rows.append(row)
    dense = {r["round"]: r for r in rows if r["method"] == "dense"}
    for r in rows:
        d = dense.get(r["round"])
        if d is not None:
            r["kernel_vs_dense"] = r["kernel_bytes"] / d["kernel_bytes"]
            r["exchange_vs_dense"] = r["exchange_bytes"] / d["exchange_bytes"]
            r["time_vs_dense"] = r["seconds"] / d["seconds"]
        if "planner_bytes" in r:
            r["planner_byte_share"] = r["planner_bytes"] / (
                r["exchange_bytes"] + r["planner_bytes"]
            )
            r["planner_time_share"] = r["planner_s"] / r["seconds"]
    return rows


def _spread(values: Sequence[float], fmt: str) -> str:
    values = sorted(values)
    if len(values) == 1:
        return format(values[0], fmt)
    low, mid, high = (format(v, fmt) for v in (values[0], statistics.median(values), values[-1]))
    return f"{mid} [{low}–{high}]"


def write_outputs(every, args: argparse.Namespace, workers: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summarise(every)
    args.out.mkdir(parents=True, exist_ok=True)
    columns = list(FIELDS) + [
        "kernel_vs_dense",
        "exchange_vs_dense",
        "time_vs_dense",
        "planner_byte_share",
        "planner_time_share",
    ]
    with open(args.out / "profiling.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    where = (
        "netns cluster, links not rate-limited (each rank's veth counted)"
        if _iface() == "dlgs0"
        else "plain loopback (half of lo's count per rank)"
    )
    lines = [
        "# What the merge planner costs over a run",
        "",
        f"`{' '.join(['python -m benchmarks.profiling', *sys.argv[1:]])}`".replace(" --worker", ""),
        "",
        f"{workers} ranks, {where}; MLP of 304,170 parameters on Fashion-MNIST, batch {BATCH} "
        f"per rank, SGD lr {LR} momentum {MOMENTUM}; {args.steps} steps per run, "
        f"{args.rounds} round(s), methods interleaved. Real compute. Medians over rounds "
        "[min–max]. Bytes are per rank; ratios are against the same round's dense run.",
        "",
        "| method | kernel bytes vs dense | exchange + planner bytes vs dense | time vs dense "
        "| planner bytes share | planner time share | probes | profiles | plans | guard "
        "| messages (sparse) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method in args.methods:
        mine = [r for r in rows if r["method"] == method]
        exch = [
            (r["exchange_bytes"] + r.get("planner_bytes", 0))
            / next(d for d in rows if d["method"] == "dense" and d["round"] == r["round"])[
                "exchange_bytes"
            ]
            for r in mine
            if "exchange_vs_dense" in r
        ]
        cells = [
            method,
            _spread([r["kernel_vs_dense"] for r in mine if "kernel_vs_dense" in r], ".3f"),
            _spread(exch, ".3f") if exch else "",
            _spread([r["time_vs_dense"] for r in mine if "time_vs_dense" in r], ".2f"),
        ]
        if method == "dense":
            cells += [""] * 7
        else:
            cells += [
                _spread([100 * r["planner_byte_share"] for r in mine], ".2f") + " %",
                _spread([100 * r["planner_time_share"] for r in mine], ".2f") + " %",
                _spread([r["probes"] for r in mine], ".0f"),
                _spread([r["profiles"] for r in mine], ".0f"),
                _spread([r["plans"] for r in mine], ".0f"),
                ", ".join(str(r["guard"]) for r in mine),
                ", ".join(f"{r['messages']} ({r['sparse_messages']})" for r in mine),
            ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines.append("")
    (args.out / "profiling.md").write_text("\n".join(lines))
    fig, ax = plt.subplots(figsize=(7, 4))
    for got in every[0]:
        if got["row"]["round"] != 1:
            continue
        ax.plot(
            range(1, len(got["cumulative"]) + 1),
            [b / 1e6 for b in got["cumulative"]],
            label=got["row"]["method"],
        )
    ax.set_xlabel("step")
    ax.set_ylabel("MB sent by rank 0 (exchange + planner)")
    ax.set_title("Cumulative bytes, 304k-parameter MLP, 2 ranks (real compute)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "profiling.png", dpi=120)
    print("\n".join(lines))


# -- the driver ------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from .cluster import main as cluster_main

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    forwarded = list(sys.argv[1:] if argv is None else argv)
    return cluster_main(
        [
            "--workers",
            "2",
            "--bandwidth",
            "none",
            "--no-measure",
            "--",
            sys.executable,
            "-m",
            "benchmarks.profiling",
            "--worker",
            *forwarded,
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
