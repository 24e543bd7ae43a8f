"""The test suite as ``make test`` (and so ``.ci/run``) runs it: every test, the
slow (convergence) ones included, on two pytest workers.

Most of the suite's time is real ranks under ``horovodrun`` and ``torchrun``,
and much of a launch's time is waiting (process start-up, rendezvous, Horovod
Elastic's host discovery, a fault test's bounded waits), so two pytest workers
(pytest-xdist, ``--dist loadgroup``) overlap one launch's waits with other
work. ``tests/conftest.py`` keeps the tests of one shared launch on one worker
and hands out the longest work first (from the last measured durations).

At the end it prints the ten slowest tests, the real-rank launches (count,
seconds, CPU seconds, the ranks' start-up) and the whole run's time against
the 15-minute goal.

    python tools/run_tests.py [--workers 2] [pytest args...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Where ``tests/conftest.py`` writes the last pytest run's per-test seconds
#: and its real-rank launches.
LAST_RUN = os.path.join(ROOT, ".pytest_cache", "dlgs-last-run.json")
#: The suite's goal on this project's 2-core machine, in seconds.
GOAL_S = 900.0


def pytest(workers: int, args) -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "tests"]
    if workers > 1:
        cmd += ["-n", str(workers), "--dist", "loadgroup", "--no-loadscope-reorder"]
    cmd += list(args)
    print("+ " + " ".join(cmd), flush=True)
    try:
        os.remove(LAST_RUN)
    except OSError:
        pass
    return subprocess.call(cmd, cwd=ROOT)


def where_the_time_went(run: Dict[str, Any], slowest: int = 10) -> str:
    """The slowest tests and the real-rank launches of ``run`` (conftest's record), as text."""
    tests = {k: v["seconds"] for k, v in run.get("tests", {}).items()}
    launches: List[Dict[str, Any]] = run.get("launches", [])
    if not tests:
        return "run_tests: no per-test durations were recorded"
    lines = [f"run_tests: the {slowest} slowest tests (setup, call and teardown), of {len(tests)}:"]
    for name, sec in sorted(tests.items(), key=lambda kv: -kv[1])[:slowest]:
        lines.append(f"  {sec:7.1f} s  {name}")
    total = sum(tests.values())
    lines.append(f"run_tests: {total:.0f} s in tests (summed over the workers); launches:")
    by_kind: Dict[str, List[Dict[str, Any]]] = {}
    for launch in launches:
        by_kind.setdefault(launch["launcher"], []).append(launch)
    for kind, runs in sorted(by_kind.items()):
        start = [r["startup"] for r in runs if r.get("startup") is not None]
        known = (
            f"; start-up (processes, imports, hvd.init) {sum(start):.0f} s over the "
            f"{len(start)} scenario launches that record it"
            if start
            else ""
        )
        cpu = sum(r.get("cpu", 0.0) for r in runs)
        wall = sum(r["seconds"] for r in runs)
        lines.append(f"  {kind}: {len(runs)} launches, {wall:.0f} s, {cpu:.0f} CPU s{known}")
    by_worker: Dict[str, List[float]] = {}
    for launch in launches:
        by_worker.setdefault(launch["worker"], []).append(launch.get("cpu", 0.0))
    heavy = sorted(by_worker.items(), key=lambda kv: -sum(kv[1]))[:slowest]
    lines.append("run_tests: the launched scripts that took the most CPU:")
    for worker, cpus in heavy:
        lines.append(f"  {sum(cpus):7.0f} CPU s  {len(cpus)} x {worker}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--workers",
        type=int,
        default=int(os.environ.get("DLGS_TEST_WORKERS", 2)),
        help="pytest workers (default 2, or $DLGS_TEST_WORKERS; 1 runs in this one process)",
    )
    args, rest = parser.parse_known_args(argv)
    start = time.monotonic()
    status = pytest(args.workers, rest)
    used = time.monotonic() - start
    try:
        with open(LAST_RUN) as f:
            print(where_the_time_went(json.load(f)), flush=True)
    except (OSError, ValueError):
        print("run_tests: no record of the run was written", flush=True)
    verdict = "within" if used <= GOAL_S else "over"
    print(f"run_tests: the suite took {used:.0f} s, {verdict} the {GOAL_S:.0f} s goal", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
