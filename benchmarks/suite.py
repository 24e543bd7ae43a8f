"""The benchmark grid: link rates x models x workers, every method, one CSV.

Each cell is one ``benchmarks.train`` job on the local cluster
(``benchmarks.cluster``: one network namespace per worker, tbf both ways),
appended to ``OUT/results.csv``; at the end the suite writes ``OUT/results.md``
(a table per cell with efficiency against the no-comm bound and speed-up over
dense) and PNG plots: throughput by method, speed-up over dense, and efficiency
against the no-comm bound.

``--frameworks torch,tensorflow`` runs every cell once per framework
(``benchmarks.train --framework``); the rows carry a ``framework`` column and
each cell's table lists both frameworks' methods side by side. Models a
framework lacks (TensorFlow has no ``bert-small``) are skipped for it.

Example (the full grid takes hours on 2 cores; ``--quick`` is a smoke run)::

    python -m benchmarks.suite --bandwidths 1gbit,100mbit,25mbit \\
        --models resnet20,vgg16,lstm,bert-small --workers 2,4 \\
        --frameworks torch,tensorflow --out benchmarks/results/$(date +%F)

**Emulated compute.** A model given as ``catalog:NAME`` (dlgs's built-in
``resnet50``, ``vgg16``, ``bert-base``, ``ptb-lstm``) or as a saved Profile
JSON runs with ``benchmarks.train --emulate`` (``benchmarks/emulate.py``):
every layer's compute is a wait, so 4 to 16 workers on this machine measure
the network rather than the cores. Cells whose ranks would not fit in this
machine's memory are skipped (and listed). On 3 or more workers the cluster
also measures what the bridge carries with every link of a ring busy; the
report lists it per cell, and judges dlgs (dp) against the merge goals::

    python -m benchmarks.suite --models catalog:resnet50,catalog:bert-base \\
        --workers 2,4,8,16 --bandwidths 100mbit --emulate-speed 0.02 \\
        --out benchmarks/results/emulated
"""

from __future__ import annotations

import argparse
import csv
import logging
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from dlgs.catalog import MODELS as CATALOG
from dlgs.catalog import catalog_model

from .report import (
    FRAMEWORKS,
    MODELS,
    TORCH_METHODS,
    add_wire_options,
    base_method,
    density,
    framework_of,
    is_emulated,
    method_cell,
    positive_float,
    positive_int,
)

__all__ = ["main"]

logger = logging.getLogger("benchmarks.suite")

METHODS = "no-comm,dense,fp16,topk,topk-buckets,dgc,dlgs-none,dlgs"


def run_cell(
    args, bandwidth: str, model: str, workers: int, framework: str = "torch", per_node: int = 1
) -> int:
    """One cell: ``workers`` nodes of ``per_node`` ranks each."""
    layout = f"{workers}x{per_node}" if per_node > 1 else f"{workers}w"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.cluster",
        "--workers",
        str(workers),
        "--ranks-per-node",
        str(per_node),
        "--bandwidth",
        bandwidth,
        "--timeout",
        str(args.cell_timeout),
        "--",
        sys.executable,
        "-m",
        "benchmarks.train",
        "--framework",
        framework,
        *(["--emulate", model] if is_emulated_model(model) else ["--model", model]),
        *(["--emulate-speed", str(args.emulate_speed)] if is_emulated_model(model) else []),
        "--rounds",
        str(args.rounds),
        "--methods",
        _methods_for(framework, args.methods),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--density",
        str(args.density),
        "--value-dtype",
        args.value_dtype,
        "--index-coding",
        args.index_coding,
        "--link-bandwidth",
        args.link_bandwidth,
        "--out",
        str(args.out),
        "--append",
        "--label",
        f"{bandwidth}/{layout}",
    ]
    logger.info("cell %s, %s, %s, %s: %s", bandwidth, framework, model, layout, shlex.join(cmd))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    try:
        rc = proc.wait()
    finally:
        if proc.poll() is None:  # the suite was stopped: tear the cluster down too
            proc.terminate()
            proc.wait()
    logger.info("cell done in %.0f s (exit %d)", time.perf_counter() - t0, rc)
    return rc


def _layouts(args) -> List[tuple]:
    """``(nodes, ranks per node)`` of every cell: ``--layouts`` or ``--workers``."""
    if args.layouts is None:
        return [(int(w), 1) for w in args.workers.split(",")]
    out = []
    for text in args.layouts.split(","):
        nodes, _, per_node = text.strip().partition("x")
        if not (nodes.isdigit() and per_node.isdigit() and int(nodes) >= 1 and int(per_node) >= 1):
            raise ValueError(f"argument --layouts: expected NODESxRANKS like 2x4, got {text!r}")
        out.append((int(nodes), int(per_node)))
    return out


def is_emulated_model(model: str) -> bool:
    """``catalog:NAME`` or a Profile JSON: a cell with emulated compute."""
    return model.startswith("catalog:") or model.endswith(".json")


#: Bytes one emulated rank holds per parameter (the parameter, its gradient,
#: two gradient draws, dlgs's residual buffers and scratch, Horovod's copies)
#: and per process (torch, Horovod, the interpreter): measured peak RSS 1.26 GB
#: per rank for ResNet-50 (25.6 M parameters) on 2 workers, with some room.
BYTES_PER_PARAMETER = 28
RANK_BASE_BYTES = 550e6


def fits_in_memory(model: str, workers: int) -> Optional[str]:
    """None, or why ``workers`` ranks of ``model`` would not fit in this
    machine's available memory (only emulated catalog models are checked)."""
    if not model.startswith("catalog:") or model[8:] not in CATALOG:
        return None
    need = workers * (BYTES_PER_PARAMETER * catalog_model(model[8:]).numel + RANK_BASE_BYTES)
    available = _available_memory()
    if available is not None and need > 0.9 * available:
        return f"needs about {need / 1e9:.1f} GB, {available / 1e9:.1f} GB available"
    return None


def _available_memory() -> Optional[float]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


#: The benchmark issue's regimes by dense Horovod's efficiency against no-comm
#: (low, high), each with its goal for dlgs as text and as a test of
#: (dlgs efficiency, dlgs speed-up over dense).
REGIMES = (
    ("communication-bound", 0.0, 0.20, ">= 85% of the bound", lambda e, s: e >= 0.85),
    ("balanced", 0.35, 0.65, ">= 1.8x dense", lambda e, s: s >= 1.8),
    ("cheap communication", 0.90, float("inf"), ">= 0.97x dense", lambda e, s: s >= 0.97),
)
#: The baselines dlgs must beat by 1.2x where they are below 85% of the bound.
BASELINES = ("topk", "topk-buckets", "dgc")


def _verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def goals(rows: Sequence[dict], method: str = "dlgs") -> List[str]:
    """A Markdown table judging ``method`` in every (cell, framework) against the
    benchmark issue's goals: its regime's goal (from dense's efficiency) and
    ``>= 1.2x`` the best of :data:`BASELINES` where that best is below 85% of
    the bound. Cells lacking no-comm, dense or ``method`` are skipped."""
    by_cell: Dict[tuple, Dict[str, float]] = {}
    for r in rows:
        if is_emulated(r):
            continue  # judged by merge_goals()
        key = (r.get("label", ""), r["model"], framework_of(r))
        by_cell.setdefault(key, {})[r["method"]] = float(r["median_step_s"])
    lines = [
        f"| cell | dense eff. | regime | {method} eff. | {method} vs dense | regime goal "
        f"| best baseline (eff.) | {method} vs it |",
        "|---|---:|---|---:|---:|---|---|---:|",
    ]
    for (label, model, framework), step in by_cell.items():
        if not {"no-comm", "dense", method} <= set(step):
            continue
        eff = {m: step["no-comm"] / t for m, t in step.items()}
        ours, speedup = eff[method], eff[method] / eff["dense"]
        reg = next((r for r in REGIMES if r[1] <= eff["dense"] <= r[2]), None)
        goal = "—" if reg is None else f"{reg[3]}: {_verdict(reg[4](ours, speedup))}"
        base_cell = ratio_cell = "—"
        present = [b for b in BASELINES if b in eff]
        if present:
            best = max(present, key=eff.__getitem__)
            base_cell = f"{best} ({100 * eff[best]:.0f}%)"
            ratio_cell = f"{ours / eff[best]:.2f}x"
            if eff[best] < 0.85:
                ratio_cell += f" (>= 1.2x: {_verdict(ours / eff[best] >= 1.2)})"
        name = f"{model}, {label}" + (f", {framework}" if framework != "torch" else "")
        lines.append(
            f"| {name} | {100 * eff['dense']:.0f}% | {reg[0] if reg else 'between regimes'} "
            f"| {100 * ours:.0f}% | {speedup:.2f}x | {goal} | {base_cell} | {ratio_cell} |"
        )
    return lines


def _methods_for(framework: str, methods: str) -> str:
    """``methods`` less the torch-only ones (two levels, alltoall, DDP) for a
    TensorFlow cell, so that one suite can hold both frameworks."""
    if framework == "torch":
        return methods
    return ",".join(m for m in methods.split(",") if base_method(m) not in TORCH_METHODS)


#: The methods dlgs (dp) must beat where merging is meant to pay.
MERGE_BASELINES = ("topk", "topk-buckets", "dgc", "dlgs-none")


def merge_goals(rows: Sequence[dict]) -> List[str]:
    """A Markdown table judging dlgs (dp) in every emulated cell against the
    merge issue's goals: at least 1.3x the best of :data:`MERGE_BASELINES` in
    cells with 8 or more workers where dense is at most 65% efficient, and never
    below 0.97x of that best. Also lists the bridge's measured capacity."""
    by_cell: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:
        if is_emulated(r):
            by_cell.setdefault((r.get("label", ""), r["model"]), {})[r["method"]] = r
    lines = [
        "| cell | workers | ring capacity (sum, Mbit/s) | dense eff. | best baseline (eff.) "
        "| dlgs (dp) eff. | dlgs vs best | goal |",
        "|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for (label, model), cell in by_cell.items():
        present = [b for b in MERGE_BASELINES if b in cell]
        if "dlgs" not in cell or not present:
            continue
        step = {m: float(r["median_step_s"]) for m, r in cell.items()}
        workers = int(cell["dlgs"]["workers"])
        best = min(present, key=step.__getitem__)
        ratio = step[best] / step["dlgs"]
        bound = step.get("no-comm")
        dense_eff = bound / step["dense"] if bound and "dense" in step else None
        if workers >= 8 and dense_eff is not None and dense_eff <= 0.65:
            goal = f">= 1.3x: {_verdict(ratio >= 1.3)}"
        else:
            goal = f">= 0.97x: {_verdict(ratio >= 0.97)}"
        agg = cell["dlgs"].get("DLGS_AGGREGATE_BPS") or ""
        lines.append(
            f"| {model}, {label} | {workers} | {f'{float(agg) / 1e6:.0f}' if agg else '—'} "
            f"| {_eff(step, 'dense')} | {best} ({_eff(step, best)}) | {_eff(step, 'dlgs')} "
            f"| {ratio:.2f}x | {goal} |"
        )
    return lines


def topology_goals(rows: Sequence[dict]) -> List[str]:
    """A Markdown table judging ``dlgs-hier`` (and ``dlgs-auto``, the
    measured choice) in every two-level cell (label ``BW/NxL``) against its
    goals: at least 1.3x flat dlgs where flat is at most 80% efficient,
    never below 0.97x flat; at least 1.2x the better of dense and fp16 where
    that is at most 60% efficient."""
    by_cell: Dict[tuple, Dict[str, float]] = {}
    for r in rows:
        if "x" in str(r.get("label", "")).rpartition("/")[2]:
            key = (r.get("label", ""), r["model"])
            by_cell.setdefault(key, {})[r["method"]] = float(r["median_step_s"])
    lines = [
        "| cell | flat dlgs eff. | hier eff. | hier / flat | goal | best of dense, fp16 (eff.) "
        "| hier / it | goal | auto / flat |",
        "|---|---:|---:|---:|---|---|---:|---|---:|",
    ]
    for (label, model), step in by_cell.items():
        if not {"no-comm", "dlgs", "dlgs-hier"} <= set(step):
            continue
        eff = {m: step["no-comm"] / t for m, t in step.items()}
        ratio = step["dlgs"] / step["dlgs-hier"]
        goal = (
            f">= 1.3x: {_verdict(ratio >= 1.3)}"
            if eff["dlgs"] <= 0.80
            else f">= 0.97x: {_verdict(ratio >= 0.97)}"
        )
        dense = [m for m in ("dense", "fp16") if m in step]
        base = base_ratio = base_goal = "—"
        if dense:
            best = min(dense, key=step.__getitem__)
            base = f"{best} ({100 * eff[best]:.0f}%)"
            base_ratio = f"{step[best] / step['dlgs-hier']:.2f}x"
            if eff[best] <= 0.60:
                base_goal = f">= 1.2x: {_verdict(step[best] / step['dlgs-hier'] >= 1.2)}"
        auto = f"{step['dlgs'] / step['dlgs-auto']:.2f}x" if "dlgs-auto" in step else "—"
        lines.append(
            f"| {model}, {label} | {100 * eff['dlgs']:.0f}% | {100 * eff['dlgs-hier']:.0f}% "
            f"| {ratio:.2f}x | {goal} | {base} | {base_ratio} | {base_goal} | {auto} |"
        )
    return lines


def _eff(step: Dict[str, float], method: str) -> str:
    """``method``'s efficiency against no-comm, as a percentage, or a dash."""
    if "no-comm" not in step or method not in step:
        return "—"
    return f"{100 * step['no-comm'] / step[method]:.0f}%"


def report(out: Path, command: str) -> None:
    """Tables and plots from every row of ``results.csv``."""
    with open(out / "train.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    cells: Dict[tuple, List[dict]] = {}
    for r in rows:
        cells.setdefault((r.get("label", ""), r["model"]), []).append(r)
    lines = ["# Benchmark suite", "", f"Command: `{command}`", ""]
    judged = merge_goals(rows)
    if len(judged) > 2:
        lines += [
            "## Goals: merging, emulated compute",
            "",
            "**Emulated compute**: every layer's computation is a wait (benchmarks/emulate.py); "
            "dlgs, Horovod and the network run for real. dlgs (dp) against the best of top-k, "
            "top-k buckets, DGC and layer-wise dlgs: at least 1.3x with 8 or more workers where "
            "dense is at most 65% efficient, at least 0.97x everywhere. Ring capacity: what "
            "the bridge carried with every link of a ring sending at once (measured before the "
            "cell; 2-worker cells measure one link only).",
            "",
            *judged,
            "",
        ]
    judged = topology_goals(rows)
    if len(judged) > 2:
        lines += [
            "## Goals: topology (two-level cells)",
            "",
            'dlgs-hier: `topology="hierarchical"`; dlgs-auto: `topology="auto"` (timed '
            "choice); both with the dp merge plan, as flat dlgs. Efficiency against no-comm "
            "(medians of the timed steps).",
            "",
            *judged,
            "",
        ]
    # Every dlgs method of the run, with its own density (dlgs@0.001, dlgs@auto) too.
    methods = dict.fromkeys(r["method"] for r in rows)
    for method in (m for m in methods if base_method(m) in ("dlgs", "dlgs-none")):
        judged = goals(rows, method)
        if len(judged) > 2:
            lines += [
                f"## Goals: {method}",
                "",
                "Efficiency is against the same framework's no-comm bound (medians of the timed "
                "steps). Regimes by dense's efficiency: communication-bound <= 20%, balanced "
                "35-65%, cheap communication >= 90%. Baselines: top-k, top-k buckets, DGC.",
                "",
                *judged,
                "",
            ]
    for (label, model), rs in cells.items():
        lines += [
            f"## {model}, {label}" + (" (emulated compute)" if is_emulated(rs[0]) else ""),
            "",
            "Efficiency and speed-up are against the same framework's no-comm and dense.",
            "",
            "| framework | method | samples/s | step ms | efficiency vs no-comm "
            "| speed-up vs dense |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in rs:
            eff, spd = r.get("efficiency_vs_nocomm") or "", r.get("speedup_vs_dense") or ""
            name = FRAMEWORKS.get(framework_of(r), framework_of(r))
            lines.append(
                f"| {name} | {method_cell(r)} | {float(r['samples_per_s']):.1f} | "
                f"{float(r['median_step_s']) * 1e3:.1f} | "
                f"{f'{100 * float(eff):.0f}%' if eff else ''} | "
                f"{f'{float(spd):.2f}x' if spd else ''} |"
            )
        lines.append("")
    (out / "results.md").write_text("\n".join(lines))
    _plot(cells, out)


def _plot(cells: Dict[tuple, List[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for key, title, fname in (
        ("samples_per_s", "throughput (samples/s)", "throughput.png"),
        ("speedup_vs_dense", "speed-up over dense Horovod", "speedup.png"),
        ("efficiency_vs_nocomm", "efficiency against the no-comm bound", "efficiency.png"),
    ):
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cells)), 4))
        # One bar series per (framework, method); named by method alone for torch-only runs.
        series = list(
            dict.fromkeys((framework_of(r), r["method"]) for rs in cells.values() for r in rs)
        )
        several = len({f for f, _ in series}) > 1
        width = 0.8 / max(1, len(series))
        for m_i, (framework, method) in enumerate(series):
            xs, ys = [], []
            for c_i, rs in enumerate(cells.values()):
                for r in rs:
                    if (framework_of(r), r["method"]) == (framework, method) and r.get(key) not in (
                        None,
                        "",
                    ):
                        xs.append(c_i + m_i * width)
                        ys.append(float(r[key]))
            name = f"{method} ({FRAMEWORKS.get(framework, framework)})" if several else method
            ax.bar(xs, ys, width, label=name)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))])
        ax.set_xticklabels([f"{m}\n{lab}" for lab, m in cells], fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=7, ncol=4)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the grid (or, with ``--report-only``, redo the tables and plots)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidths", default="1gbit,100mbit,25mbit")
    parser.add_argument(
        "--models",
        default="resnet20,vgg16,lstm,bert-small",
        help="benchmark models, and catalog:NAME or Profile JSON paths for emulated compute",
    )
    parser.add_argument(
        "--emulate-speed",
        type=positive_float,
        default=1.0,
        help="emulated models: divide every layer's duration by this",
    )
    parser.add_argument("--rounds", type=positive_int, default=1, help="benchmarks.train --rounds")
    parser.add_argument("--workers", default="2,4", help="comma list of worker counts")
    parser.add_argument(
        "--layouts",
        default=None,
        help="comma list of NODESxRANKS (e.g. 2x2,2x4,4x2): two-level cells, each node a "
        "namespace of RANKS uncapped ranks (benchmarks.cluster --ranks-per-node); "
        "replaces --workers",
    )
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument(
        "--frameworks",
        default="torch",
        help=f"comma list of {', '.join(FRAMEWORKS)}; each cell runs once per framework",
    )
    parser.add_argument("--density", type=density, default=0.01, help="sparse methods, in (0, 1]")
    add_wire_options(parser)  # passed on to benchmarks.train
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--cell-timeout", type=float, default=1800)
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1gbit, resnet20, 2 workers, 3 steps"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/suite"))
    parser.add_argument(
        "--report-only",
        metavar="COMMAND",
        default=None,
        help="only rebuild results.md and the plots; COMMAND is the recorded one",
    )
    args = parser.parse_args(argv)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    bad = [f for f in frameworks if f not in FRAMEWORKS]
    if bad or not frameworks:
        parser.error(
            f"argument --frameworks: unknown {bad or [args.frameworks]}; "
            f"choose from {', '.join(FRAMEWORKS)}"
        )
    if args.report_only is not None:
        report(args.out, args.report_only)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # kill -TERM: unwind through run_cell, which stops the running cell's cluster.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.bandwidths, args.models, args.workers, args.steps = "1gbit", "resnet20", "2", 3
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        layouts = _layouts(args)
    except ValueError as e:
        parser.error(str(e))
    failed = 0
    for bandwidth in args.bandwidths.split(","):
        for model in args.models.split(","):
            for nodes, per_node in layouts:
                ranks = nodes * per_node
                # Both frameworks of a cell back to back: the same machine conditions.
                for framework in frameworks:
                    if is_emulated_model(model):
                        why = fits_in_memory(model, ranks) if framework == "torch" else "torch only"
                        if why:
                            logger.warning("skipping %s, %d ranks: %s", model, ranks, why)
                            continue
                    elif model not in MODELS[framework]:
                        logger.warning("%s has no %s model; skipping its cells", framework, model)
                        continue
                    failed += run_cell(args, bandwidth, model, nodes, framework, per_node) != 0
    command = "python -m benchmarks.suite " + shlex.join(argv if argv is not None else sys.argv[1:])
    report(args.out, command)
    logger.info("wrote %s (%d failed cells)", args.out / "results.md", failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
