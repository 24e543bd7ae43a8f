"""The test suite as ``make test`` (and so ``.ci/run``) runs it: every test, the
slow (convergence) ones included, in one pytest process.

Nearly all of the suite's time is real ranks under ``horovodrun`` and
``torchrun``, and on this project's 2-core machine nearly all of that is CPU.
Running launches at once was tried and measured (docs/testing.md): they only
share the cores, ranks that wait on a descheduled peer spin, and launches and
rendezvous passed their timeouts. One test at a time it is.

At the end it prints the ten slowest tests, the real-rank launches (count,
seconds, CPU seconds, the ranks' start-up), the launched scripts that took the
most CPU, and the whole run's time against the 15-minute goal.

    python tools/run_tests.py [pytest options, e.g. -x or -k EXPR]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Where ``tests/conftest.py`` writes a pytest run's per-test seconds and its
#: real-rank launches.
LAST_RUN = os.path.join(ROOT, ".pytest_cache", "dlgs-last-run.json")
#: The suite's goal on this project's 2-core machine, in seconds.
GOAL_S = 900.0


def pytest(args) -> int:
    """``pytest -q tests ARGS`` in a child process (it writes ``LAST_RUN``)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "tests", *args]
    print("+ " + " ".join(cmd), flush=True)
    try:
        os.remove(LAST_RUN)
    except OSError:
        pass
    return subprocess.call(cmd, cwd=ROOT)


def last_run() -> Dict[str, Any]:
    try:
        with open(LAST_RUN) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


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
    lines.append(f"run_tests: {total:.0f} s in tests; real-rank launches:")
    by_kind: Dict[str, List[Dict[str, Any]]] = {}
    for launch in launches:
        by_kind.setdefault(launch["launcher"], []).append(launch)
    for kind, runs_of_kind in sorted(by_kind.items()):
        start_up = [r["startup"] for r in runs_of_kind if r.get("startup") is not None]
        known = (
            f"; start-up (processes, imports, hvd.init) {sum(start_up):.0f} s over the "
            f"{len(start_up)} scenario launches that record it"
            if start_up
            else ""
        )
        cpu = sum(r.get("cpu", 0.0) for r in runs_of_kind)
        wall = sum(r["seconds"] for r in runs_of_kind)
        lines.append(
            f"  {kind}: {len(runs_of_kind)} launches, {wall:.0f} s, {cpu:.0f} CPU s{known}"
        )
    by_worker: Dict[str, List[float]] = {}
    for launch in launches:
        by_worker.setdefault(launch["worker"], []).append(launch.get("cpu", 0.0))
    heavy = sorted(by_worker.items(), key=lambda kv: -sum(kv[1]))[:slowest]
    lines.append("run_tests: the launched scripts that took the most CPU (ranks and launcher):")
    for worker, cpus in heavy:
        lines.append(f"  {sum(cpus):7.0f} CPU s  {len(cpus)} x {worker}")
    return "\n".join(lines)


def main(argv=None) -> int:
    began = time.monotonic()
    status = pytest(sys.argv[1:] if argv is None else argv)
    used = time.monotonic() - began
    print(where_the_time_went(last_run()), flush=True)
    verdict = "within" if used <= GOAL_S else "over"
    print(f"run_tests: the suite took {used:.0f} s, {verdict} the {GOAL_S:.0f} s goal", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
