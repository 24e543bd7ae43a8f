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
"""

from __future__ import annotations

import argparse
import csv
import logging
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .report import FRAMEWORKS, MODELS, framework_of

__all__ = ["main"]

logger = logging.getLogger("benchmarks.suite")

METHODS = "no-comm,dense,fp16,topk,topk-buckets,dgc,dlgs-none,dlgs"


def run_cell(args, bandwidth: str, model: str, workers: int, framework: str = "torch") -> int:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.cluster",
        "--workers",
        str(workers),
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
        "--model",
        model,
        "--methods",
        args.methods,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--density",
        str(args.density),
        "--out",
        str(args.out),
        "--append",
        "--label",
        f"{bandwidth}/{workers}w",
    ]
    logger.info(
        "cell %s, %s, %s, %d workers: %s", bandwidth, framework, model, workers, shlex.join(cmd)
    )
    t0 = time.perf_counter()
    rc = subprocess.call(cmd)
    logger.info("cell done in %.0f s (exit %d)", time.perf_counter() - t0, rc)
    return rc


def report(out: Path, command: str) -> None:
    """Tables and plots from every row of ``results.csv``."""
    with open(out / "train.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    cells: Dict[tuple, List[dict]] = {}
    for r in rows:
        cells.setdefault((r.get("label", ""), r["model"]), []).append(r)
    lines = ["# Benchmark suite", "", f"Command: `{command}`", ""]
    for (label, model), rs in cells.items():
        lines += [
            f"## {model}, {label}",
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
                f"| {name} | {r['method']} | {float(r['samples_per_s']):.1f} | "
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
    parser.add_argument("--models", default="resnet20,vgg16,lstm,bert-small")
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument(
        "--frameworks",
        default="torch",
        help=f"comma list of {', '.join(FRAMEWORKS)}; each cell runs once per framework",
    )
    parser.add_argument("--density", type=float, default=0.01)
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
    if args.quick:
        args.bandwidths, args.models, args.workers, args.steps = "1gbit", "resnet20", "2", 3
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for bandwidth in args.bandwidths.split(","):
        for model in args.models.split(","):
            for workers in (int(w) for w in args.workers.split(",")):
                # Both frameworks of a cell back to back: the same machine conditions.
                for framework in frameworks:
                    if model not in MODELS[framework]:
                        logger.warning("%s has no %s model; skipping its cells", framework, model)
                        continue
                    failed += run_cell(args, bandwidth, model, workers, framework) != 0
    command = "python -m benchmarks.suite " + shlex.join(argv if argv is not None else sys.argv[1:])
    report(args.out, command)
    logger.info("wrote %s (%d failed cells)", args.out / "results.md", failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
