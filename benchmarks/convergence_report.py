"""The convergence benchmark's report: per method over its seeds, the final
metric, the bytes counted against any budget, the time to PowerSGD rank 1's
final metric, each dlgs method against its goals (within 3% or 0.5 points of
dense's final metric, at least PowerSGD's at the same rank, any budget met
within 5%), and the curves against cumulative bytes and wall-clock time
(``benchmarks/convergence.py`` writes the rows).

Run as a module it merges the CSVs of several runs (more seeds, more methods)
into one report::

    python -m benchmarks.convergence_report --task fashion --out DIR RUN1.csv RUN2.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

__all__ = ["merge", "report", "summarize", "time_to"]

#: The reference whose final metric the time-to column targets.
REFERENCE = "ddp-powersgd-1"
DENSE = ("dense", "ddp")
#: Each task's metric (``benchmarks.convergence``'s tasks).
METRICS = {
    "fashion": "test accuracy (%)",
    "ptb": "validation perplexity",
    "transformer": "validation perplexity",
}


def _num(value) -> Optional[float]:
    return None if value in ("", None) else float(value)


def _better(a: float, b: float, lower: bool) -> bool:
    """``a`` at least as good as ``b``."""
    return a <= b if lower else a >= b


def summarize(rows: List[Dict]) -> Dict[str, Dict]:
    """Per method, over its seeds: the final evaluation's metric (mean, min,
    max), mean seconds, bytes per step counted (mean; and the link's transmit
    bytes per step where the cluster counted them) and the budget."""
    finals: Dict[str, Dict[int, Dict]] = {}
    for r in rows:
        finals.setdefault(r["method"], {})[int(r.get("seed", 0))] = r  # the last row wins
    out = {}
    for m, by_seed in finals.items():
        last = list(by_seed.values())
        vals = np.array([float(r["metric"]) for r in last])
        per_step = [float(r["sent"]) / max(1, int(r["step"])) for r in last]
        links = [_num(r.get("link_tx")) for r in last]
        out[m] = dict(
            epoch=max(float(r["epoch"]) for r in last),
            seconds=float(np.mean([float(r["seconds"]) for r in last])),
            mean=float(vals.mean()),
            low=float(vals.min()),
            high=float(vals.max()),
            seeds=len(vals),
            per_step=float(np.mean(per_step)),
            per_step_max=max(per_step),
            link=None
            if None in links
            else float(np.mean([x / max(1, int(r["step"])) for x, r in zip(links, last)])),
            budget=_num(last[0].get("budget")),
        )
    return out


def time_to(rows: List[Dict], method: str, target: float, lower: bool) -> List[Optional[float]]:
    """Per seed of ``method``: the training seconds at its first evaluation
    that reaches ``target`` (None: never)."""
    seeds = sorted({int(r.get("seed", 0)) for r in rows if r["method"] == method})
    out = []
    for seed in seeds:
        hit = [
            float(r["seconds"])
            for r in rows
            if r["method"] == method
            and int(r.get("seed", 0)) == seed
            and _better(float(r["metric"]), target, lower)
        ]
        out.append(min(hit) if hit else None)
    return out


def _time_cell(times: List[Optional[float]]) -> str:
    got = [t for t in times if t is not None]
    if not got:
        return "not reached"
    cell = f"{np.mean(got):.0f}"
    return cell if len(got) == len(times) else f"{cell} ({len(got)}/{len(times)} seeds)"


def report(
    rows: List[Dict],
    task: str,
    metric: str,
    command: str,
    size: int,
    out: Path,
    environment: Optional[str] = None,
) -> str:
    """``convergence.md``'s text (and ``convergence.png`` in ``out``);
    ``environment`` defaults to what the cluster's variables say."""
    lower = "perplexity" in metric
    if environment is None:
        environment = (
            f"{os.environ.get('DLGS_BANDWIDTH', 'plain horovodrun')} links "
            f"({os.environ.get('DLGS_CLUSTER', 'loopback')})"
        )
    final = summarize(rows)
    dense = next((final[m] for m in DENSE if m in final), None)
    ref = final.get(REFERENCE)
    lines = [
        f"# Convergence: {task}, {size} ranks",
        "",
        f"Command: `{command}`",
        "",
        f'Environment: {environment}. dlgs methods use `merge="none"` '
        "(every eligible layer sparse). KB/step: bytes one rank handed to its collectives, "
        "counted every step and averaged (dense: 4 per parameter; fp16: 2; PowerSGD: its P "
        "and Q factors and the layers it leaves dense; dlgs: its messages at capacity). "
        "Link KB/step: rank 0's link transmit counter (headers included), where the cluster "
        "has one. Seconds: training only, evaluations left out.",
        "",
        f"| method | KB/step | budget KB/step | counted / budget | link KB/step | epochs "
        f"| seeds | seconds | {metric}: mean | min-max | gap to dense "
        f"| seconds to {REFERENCE}'s final |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m, r in final.items():
        gap = ""
        if dense is not None and m not in DENSE:
            gap = (
                f"{100 * (r['mean'] / dense['mean'] - 1):+.1f}%"
                if lower
                else f"{r['mean'] - dense['mean']:+.2f} points"
            )
        budget = r["budget"]
        ratio = f"{r['per_step_max'] / budget:.3f}" if budget else ""
        link = "" if r["link"] is None else f"{r['link'] / 1e3:.1f}"
        reach = _time_cell(time_to(rows, m, ref["mean"], lower)) if ref else ""
        lines.append(
            f"| {m} | {r['per_step'] / 1e3:.1f} | {'' if not budget else f'{budget / 1e3:.1f}'} "
            f"| {ratio} | {link} | {r['epoch']:g} | {r['seeds']} | {r['seconds']:.0f} "
            f"| {r['mean']:.2f} | {r['low']:.2f}-{r['high']:.2f} | {gap} | {reach} |"
        )
    lines += ["", *_goals(final, lower)]
    _plot(rows, metric, lower, out / "convergence.png")
    lines += ["", "![curves](convergence.png)"]
    return "\n".join(lines) + "\n"


def _goals(final: Dict[str, Dict], lower: bool) -> List[str]:
    """Each dlgs method against the goals its name matches: within 3% (or 0.5
    points) of dense's final metric, at least PowerSGD's final at the same rank,
    any budget met within 5%."""
    dense = next((final[m] for m in DENSE if m in final), None)
    out = ["Goals (means over seeds):"]
    for m, r in final.items():
        if "dlgs" not in m:
            continue
        said = []
        if dense is not None:
            ok = r["mean"] <= dense["mean"] * 1.03 if lower else r["mean"] >= dense["mean"] - 0.5
            said.append(
                f"{'within' if ok else 'NOT within'} {'3%' if lower else '0.5 points'} of dense"
            )
        rank = m.split("@powersgd-")[1].split("+")[0] if "@powersgd-" in m else None
        psgd = final.get(f"ddp-powersgd-{rank}") if rank else None
        if psgd is not None:
            if _better(r["mean"], psgd["mean"], lower):
                said.append(f"at least PowerSGD rank {rank}'s final")
            elif _better(r["high"], psgd["low"], lower):
                said.append(f"below PowerSGD rank {rank}'s final, within the seeds' spread")
            else:
                said.append(f"BELOW PowerSGD rank {rank}'s final")
        if r["budget"]:
            ok = abs(r["per_step_max"] / r["budget"] - 1) <= 0.05
            said.append(f"budget {'met' if ok else 'NOT met'} within 5%")
        out.append(f"- {m}: " + ("; ".join(said) if said else "no reference in this run"))
    return out


def _plot(rows: List[Dict], metric: str, lower: bool, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5), sharey=True)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    # More methods than the default cycle's 10 colours: tab20's, one each.
    colors = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20").colors
    for i, m in enumerate(methods):
        rs = [r for r in rows if r["method"] == m]
        steps = sorted({int(r["step"]) for r in rs})
        at = [[r for r in rs if int(r["step"]) == s] for s in steps]
        mean = [np.mean([float(r["metric"]) for r in a]) for a in at]
        sent = [np.mean([float(r["sent"]) for r in a]) / 1e6 for a in at]
        secs = [np.mean([float(r["seconds"]) for r in a]) for a in at]
        style = "--" if m.startswith("ddp-powersgd") else ":" if m in DENSE else "-"
        color = colors[i % len(colors)]
        axes[0].plot(sent, mean, style, marker=".", label=m, color=color)
        axes[1].plot(secs, mean, style, marker=".", label=m, color=color)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("MB sent per rank, cumulative (log)")
    axes[1].set_xlabel("training seconds")
    axes[0].set_ylabel(metric + " (mean over seeds)")
    if lower:
        axes[0].set_yscale("log")
        values = [float(r["metric"]) for r in rows]
        axes[0].set_ylim(min(values) * 0.97, min(values) * 2.0)
    else:
        values = [float(r["metric"]) for r in rows]
        axes[0].set_ylim(max(values) - 8, max(values) + 0.5)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge(tables: Sequence[List[Dict]], methods: Optional[Sequence[str]] = None) -> List[Dict]:
    """The rows of several runs as one: a (method, seed) a later table also
    holds is taken from the later one; ``methods`` keeps those, in that order."""
    by_run: Dict[tuple, List[Dict]] = {}
    for rows in tables:
        keys = {(r["method"], int(r["seed"])) for r in rows}
        for key in keys:
            by_run[key] = [r for r in rows if (r["method"], int(r["seed"])) == key]
    order = list(methods) if methods else list(dict.fromkeys(k[0] for k in by_run))
    missing = [m for m in order if not any(k[0] == m for k in by_run)]
    if missing:
        raise ValueError(f"--methods names methods no CSV holds: {', '.join(missing)}")
    return [r for m in order for key in sorted(k for k in by_run if k[0] == m) for r in by_run[key]]


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Merge convergence runs into one report")
    parser.add_argument("csvs", nargs="+", type=Path, help="convergence.csv files, oldest first")
    parser.add_argument("--task", choices=list(METRICS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the runs (default: 2)")
    parser.add_argument(
        "--methods", default=None, help="comma list to keep, in order (default: all)"
    )
    parser.add_argument("--environment", default=None, help="the runs' links, for the report")
    args = parser.parse_args(argv)
    tables = []
    for path in args.csvs:
        with open(path, newline="") as f:
            tables.append(list(csv.DictReader(f)))
    rows = merge(tables, args.methods.split(",") if args.methods else None)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "convergence.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    sources = []
    for path in args.csvs:
        md = path.with_suffix(".md")
        said = (
            [ln for ln in md.read_text().splitlines() if ln.startswith("Command:")]
            if md.exists()
            else []
        )
        sources.append(said[0].removeprefix("Command: ") if said else str(path))
    command = "python -m benchmarks.convergence_report " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    text = report(
        rows, args.task, METRICS[args.task], command, args.ranks, args.out, args.environment
    )
    merged = "Runs merged (a later run's method and seed replace an earlier's): " + "; ".join(
        sources
    )
    text = text.replace("\n\nEnvironment:", f"\n\n{merged}\n\nEnvironment:", 1)
    (args.out / "convergence.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
