"""Does the running planner see the link? The bandwidth its probes fit
against the link's ``tc`` rate, over repeated jobs.

Each run is one ``benchmarks.cluster`` job of the PTB LSTM under dlgs
(``benchmarks.train``, dlgs only, ``--link-bandwidth none`` so that only the
probes price bytes), with ``--profile-budget`` large enough for probes of a
few MiB. The planner logs its fitted profile (``dlgs profile (rank 0's, P
ranks): allgather A ms + B ns/B, allreduce ...``); the bandwidth a fit
implies is what a ring over one link costs per byte:

* allgather, by one rank's chunk: ``(P - 1) / bandwidth`` seconds per byte;
* allreduce, by the buffer: ``2 (P - 1) / P / bandwidth``.

With ``R`` ranks per node only the nodes' links are capped; a ring over the
``P`` ranks crosses each node's link once each way, so the same costs hold with
``P`` the ranks. Run::

    python -m benchmarks.probe_fit --bandwidth 1gbit --runs 5 --out DIR
    python -m benchmarks.probe_fit --bandwidth 100mbit --runs 5 --out DIR
    python -m benchmarks.probe_fit --bandwidth 1gbit --ranks-per-node 2 --runs 5 --out DIR

Writes ``probe_fit.csv`` and ``probe_fit.md`` (appending rows to an existing
CSV with ``--append``).
"""

from __future__ import annotations

import argparse
import csv
import logging
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from benchmarks.cluster import parse_rate

logger = logging.getLogger("benchmarks.probe_fit")

_PROFILE = re.compile(
    r"dlgs profile \(rank 0's, (?P<p>\d+) ranks\): allgather [\d.e+-]+ ms .*?\+ "
    r"(?P<ag>[\d.e+-]+) ns/B, allreduce [\d.e+-]+ ms .*?\+ (?P<ar>[\d.e+-]+) ns/B"
)
_FIELDS = ["bandwidth", "nodes", "ranks_per_node", "run", "allgather_ns_per_B",
           "allreduce_ns_per_B", "allgather_gbps", "allreduce_gbps", "allgather_error",
           "allreduce_error", "seconds"]  # fmt: skip


def implied_bps(ns_per_byte: float, ranks: int, collective: str) -> float:
    """The link rate in bit/s a ring over ``ranks`` needs to cost
    ``ns_per_byte`` per byte of ``collective`` (see the module)."""
    if ns_per_byte <= 0:
        return float("inf")
    per_byte = (ranks - 1) if collective == "allgather" else 2 * (ranks - 1) / ranks
    return 8 * per_byte / (ns_per_byte * 1e-9)


def fitted(log: str) -> Optional[Dict[str, float]]:
    """The last fitted profile's slopes in ``log``, or None."""
    found = list(_PROFILE.finditer(log))
    if not found:
        return None
    m = found[-1]
    return {"ranks": int(m["p"]), "allgather": float(m["ag"]), "allreduce": float(m["ar"])}


def run_once(args: argparse.Namespace, out: Path) -> str:
    cmd = [
        sys.executable, "-m", "benchmarks.cluster", "--workers", str(args.nodes),
        "--ranks-per-node", str(args.ranks_per_node), "--bandwidth", args.bandwidth,
        "--no-measure", "--",
        sys.executable, "-m", "benchmarks.train", "--model", "lstm", "--batch", "20",
        "--methods", "dlgs", "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--rounds", "1", "--profile-steps", "8", "--profile-budget", str(args.profile_budget),
        "--link-bandwidth", "none", "--out", str(out), "--verbose",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    return done.stdout + done.stderr


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bandwidth", default="1gbit", help="each node's link (default: 1gbit)")
    p.add_argument("--nodes", type=int, default=2, help="nodes (default: 2)")
    p.add_argument("--ranks-per-node", type=int, default=1, help="(default: 1)")
    p.add_argument("--runs", type=int, default=5, help="jobs (default: 5)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per job (default: 5)")
    p.add_argument("--warmup", type=int, default=10, help="(default: 10)")
    p.add_argument(
        "--profile-budget", type=float, default=0.2, help="dlgs's profile_budget (default: 0.2)"
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds per job (default: 600)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--append", action="store_true", help="add rows to an existing CSV")
    args = p.parse_args(argv)
    if args.nodes < 2 or args.ranks_per_node < 1 or args.runs < 1:
        p.error("--nodes must be >= 2, --ranks-per-node and --runs >= 1")
    parse_rate(args.bandwidth)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rate = float(parse_rate(args.bandwidth))
    path = args.out / "probe_fit.csv"
    rows: List[Dict[str, object]] = []
    if args.append and path.exists():
        rows = list(csv.DictReader(open(path)))
    for run in range(args.runs):
        t0 = time.perf_counter()
        log = run_once(args, args.out / f"run{run}")
        seconds = time.perf_counter() - t0
        fit = fitted(log)
        if fit is None:
            (args.out / f"run{run}.log").write_text(log)
            logger.warning("run %d: no fitted profile in the log (run%d.log)", run, run)
            continue
        row: Dict[str, object] = {
            "bandwidth": args.bandwidth, "nodes": args.nodes,
            "ranks_per_node": args.ranks_per_node, "run": run, "seconds": f"{seconds:.0f}",
        }  # fmt: skip
        for kind in ("allgather", "allreduce"):
            bps = implied_bps(fit[kind], args.nodes * args.ranks_per_node, kind)
            row[f"{kind}_ns_per_B"] = fit[kind]
            row[f"{kind}_gbps"] = f"{bps / 1e9:.4g}"
            row[f"{kind}_error"] = f"{bps / rate - 1:+.3f}"
        logger.info(
            "run %d (%.0f s): allgather %s Gbit/s (%s), allreduce %s Gbit/s (%s)",
            run, seconds, row["allgather_gbps"], row["allgather_error"],
            row["allreduce_gbps"], row["allreduce_error"],
        )  # fmt: skip
        rows.append(row)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    (args.out / "probe_fit.md").write_text(markdown(rows))
    return 0


def markdown(rows: Sequence[Dict[str, object]]) -> str:
    """Per setting: the implied bandwidths and how many runs are within 25%."""
    lines = [
        "# The probes' fitted bandwidth against the link's tc rate",
        "",
        "| link | nodes x ranks | runs | allgather Gbit/s (error) | within 25% | "
        "allreduce Gbit/s (error) | within 25% |",
        "|---|---|---:|---|---:|---|---:|",
    ]
    settings = sorted(
        {(str(r["bandwidth"]), str(r["nodes"]), str(r["ranks_per_node"])) for r in rows}
    )
    for bw, n, r in settings:
        mine = [
            x
            for x in rows
            if (str(x["bandwidth"]), str(x["nodes"]), str(x["ranks_per_node"])) == (bw, n, r)
        ]
        cells = []
        for kind in ("allgather", "allreduce"):
            each = ", ".join(
                f"{x[f'{kind}_gbps']} ({float(str(x[f'{kind}_error'])):+.0%})" for x in mine
            )
            ok = sum(abs(float(str(x[f"{kind}_error"]))) <= 0.25 for x in mine)
            cells += [each, f"{ok} of {len(mine)}"]
        lines.append(f"| {bw} | {n} x {r} | {len(mine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
