"""The test suite as ``make test`` (and so ``.ci/run``) runs it, within a time budget.

Runs every test not marked ``slow`` first; then the ``slow`` ones (convergence on
real data) only if the time the first part took, plus the slow tests' own time,
fits in ``--budget`` seconds. The slow tests' time is the sum of their last
measured durations on this machine (``tests/conftest.py`` keeps every test's
in ``.pytest_cache/dlgs-durations.json``); in a fresh clone, the last
measurement committed in ``tests/slow-durations.json`` (written by every run
of the slow tests); without either, ``--slow-seconds``. When they do not fit it says
so and how to run them, and exits with the first part's status: a check never
passes by being skipped silently.

    python tools/run_tests.py [--budget 900] [--slow-seconds 200] [pytest args...]

``DLGS_TEST_BUDGET_S`` overrides the default budget; ``--budget 0`` never runs the
slow tests, ``--budget inf`` always does.
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
#: What every run of this script has measured so far (both parts).
_RUNS: List[Dict[str, Any]] = []


def pytest(args, marker: str) -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "tests", "-m", marker, *args]
    print("+ " + " ".join(cmd), flush=True)
    try:
        os.remove(LAST_RUN)
    except OSError:
        pass
    status = subprocess.call(cmd)
    try:
        with open(LAST_RUN) as f:
            _RUNS.append(json.load(f))
    except (OSError, ValueError):
        pass
    return status


def where_the_time_went(slowest: int = 10) -> str:
    """The slowest tests and the real-rank launches of this run, as text."""
    tests: Dict[str, float] = {}
    launches: List[Dict[str, Any]] = []
    for run in _RUNS:
        tests.update({k: v["seconds"] for k, v in run.get("tests", {}).items()})
        launches += run.get("launches", [])
    if not tests:
        return "run_tests: no per-test durations were recorded"
    lines = [f"run_tests: the {slowest} slowest tests (setup, call and teardown), of {len(tests)}:"]
    for name, sec in sorted(tests.items(), key=lambda kv: -kv[1])[:slowest]:
        lines.append(f"  {sec:7.1f} s  {name}")
    by_kind: Dict[str, List[float]] = {}
    starts: Dict[str, List[float]] = {}
    for launch in launches:
        kind = launch["launcher"]
        by_kind.setdefault(kind, []).append(launch["seconds"])
        if launch.get("startup") is not None:
            starts.setdefault(kind, []).append(launch["startup"])
    total = sum(tests.values())
    lines.append(f"run_tests: {total:.0f} s in tests; real-rank launches:")
    for kind, secs in sorted(by_kind.items()):
        start = starts.get(kind, [])
        known = (
            f"; start-up (processes, imports, hvd.init) {sum(start):.0f} s over the "
            f"{len(start)} scenario launches that record it"
            if start
            else ""
        )
        lines.append(f"  {kind}: {len(secs)} launches, {sum(secs):.0f} s{known}")
    return "\n".join(lines)


def slow_seconds(default: float):
    """The slow tests' last measured seconds in all, and where the figure comes from."""
    path = os.path.join(ROOT, ".pytest_cache", "dlgs-durations.json")
    try:
        with open(path) as f:
            known = json.load(f)
    except (OSError, ValueError):
        known = {}
    slow = [entry["seconds"] for entry in known.values() if entry.get("slow")]
    if slow:
        return sum(slow), f"measured: {len(slow)} tests"
    try:  # a fresh clone: the last measurement committed with the tests
        with open(os.path.join(ROOT, "tests", "slow-durations.json")) as f:
            committed = json.load(f)
        return sum(
            committed.values()
        ), f"measured on this project's machine: {len(committed)} tests"
    except (OSError, ValueError):
        return default, "not measured here yet"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--budget",
        type=float,
        default=float(os.environ.get("DLGS_TEST_BUDGET_S", 900)),
        help="seconds for the whole suite (default 900, or $DLGS_TEST_BUDGET_S)",
    )
    parser.add_argument(
        "--slow-seconds",
        type=float,
        default=200.0,
        help="the slow tests' seconds where none were measured yet (measured here: 173 s "
        "and 178 s, 2026-12-05)",
    )
    args, rest = parser.parse_known_args(argv)
    start = time.monotonic()
    status = pytest(rest, "not slow")
    used = time.monotonic() - start
    need, source = slow_seconds(args.slow_seconds)
    if used + need > args.budget:
        print(
            f"run_tests: the suite without the slow tests took {used:.0f} s; the slow ones "
            f"(about {need:.0f} s more, {source}) would pass the {args.budget:.0f} s budget, "
            "so they did not run here. Run them with: python -m pytest -q tests -m slow",
            flush=True,
        )
        print(where_the_time_went(), flush=True)
        return status
    print(
        f"run_tests: {used:.0f} s so far; the slow tests (about {need:.0f} s, {source}) fit",
        flush=True,
    )
    status = pytest(rest, "slow") or status
    print(where_the_time_went(), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
