"""How long a job takes to end when one rank leaves on its own.

Runs ``tests/parallel/leave_worker.py`` (rank 1 leaves at step 3 while the
others train: ``sys.exit(1)``, a normal return, ``os._exit``, a signal, or
``resync()`` called alone) under ``horovodrun --gloo``, ``--repeats`` times
per cell, one job at a time, and records per run the seconds from the fault
to each rank's last exit handler, to the launcher's return, and whether the
job hung (killed at ``--timeout``)::

    python -m benchmarks.leave --repeats 5 --out benchmarks/results/2026-12-07-leave

Cells are ``HOW:TOPOLOGY:DOOR:RANKS`` (``--cells``); the defaults are the
probes that hung before the exit barrier was bounded. Writes
``OUT/leave.json`` (every run) and ``OUT/summary.md`` (per cell: hangs, and
the median and range of the last rank's end).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "parallel" / "leave_worker.py"

DEFAULT_CELLS = [
    "exit1:hierarchical:b:4",
    "exit1:hierarchical:a:4",
    "exit1:hierarchical:tf:4",
    "return:hierarchical:b:4",
    "return:flat:b:4",
    "resync:flat:b:2",
]

logger = logging.getLogger("benchmarks.leave")


def run_once(cell: str, timeout: float) -> Dict[str, Any]:
    """One job of ``cell``: the fault-to-end seconds per rank and the launcher's."""
    how, topology, door, np = cell.split(":")
    horovodrun = Path(sys.executable).with_name("horovodrun")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cmd = [str(horovodrun), "-np", np, "--gloo", sys.executable, str(WORKER), tmp]
        cmd += [how, topology, door]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(WORKER.parent)])
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        hung = False
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc, hung = proc.wait(), True
        done = time.time()
        fault = out / "fault.json"
        at = json.loads(fault.read_text())["time"] if fault.exists() else None
        ends = []
        for r in range(int(np)):
            path = out / f"exit{r}.json"
            t = json.loads(path.read_text())["time"] if path.exists() else done
            ends.append(None if at is None else round(t - at, 3))
        notes = [p.read_text().count("rank 1 left") > 0 for p in out.glob("error*.txt")]
    return {
        "cell": cell,
        "rc": rc,
        "hung": hung,
        "ends": ends,
        "launcher": None if at is None else round(done - at, 3),
        "survivors_named_rank": sum(notes),
        "survivors_raised": len(notes),
        "command": shlex.join(cmd),
    }


def summarise(runs: List[Dict[str, Any]]) -> str:
    lines = [
        "| cell (how:topology:door:ranks) | runs | hangs | last rank's end, s (median, range) "
        "| launcher's return, s (median) |",
        "|---|---|---|---|---|",
    ]
    for cell in dict.fromkeys(r["cell"] for r in runs):
        rs = [r for r in runs if r["cell"] == cell]
        last = [max(e for e in r["ends"] if e is not None) for r in rs if r["ends"][0] is not None]
        launch = [r["launcher"] for r in rs if r["launcher"] is not None]
        span = f"{statistics.median(last):.2f} ({min(last):.2f}-{max(last):.2f})" if last else "-"
        med = f"{statistics.median(launch):.2f}" if launch else "-"
        lines.append(f"| {cell} | {len(rs)} | {sum(r['hung'] for r in rs)} | {span} | {med} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", default=",".join(DEFAULT_CELLS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    cells = [c for c in args.cells.split(",") if c]
    runs: List[Dict[str, Any]] = []
    for rep in range(args.repeats):  # interleaved: each round runs every cell once
        for cell in cells:
            run = run_once(cell, args.timeout)
            runs.append(run)
            logger.info(
                "round %d/%d %s: hung=%s ends=%s launcher=%s",
                rep + 1,
                args.repeats,
                cell,
                run["hung"],
                run["ends"],
                run["launcher"],
            )
            (args.out / "leave.json").write_text(json.dumps(runs, indent=1))
    summary = summarise(runs)
    command = "python -m benchmarks.leave " + shlex.join(sys.argv[1:])
    (args.out / "summary.md").write_text(f"`{command}`\n\n{summary}")
    print(summary)


if __name__ == "__main__":
    main()
