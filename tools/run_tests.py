"""The test suite as ``make test`` (and so ``.ci/run``) runs it, within a time budget.

Runs every test not marked ``slow`` first; then the ``slow`` ones (convergence on
real data: about half as long again as the rest on any machine measured so far) only
if the time the first part took, scaled by that ratio, leaves them room within
``--budget`` seconds. When they do not fit it says so and how to run them, and
exits with the first part's status: a check never passes by being skipped
silently.

    python tools/run_tests.py [--budget 900] [--slow-ratio 0.45] [pytest args...]

``DLGS_TEST_BUDGET_S`` overrides the default budget; ``--budget 0`` never runs the
slow tests, ``--budget inf`` always does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def pytest(args, marker: str) -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "tests", "-m", marker, *args]
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--budget",
        type=float,
        default=float(os.environ.get("DLGS_TEST_BUDGET_S", 900)),
        help="seconds for the whole suite (default 900, or $DLGS_TEST_BUDGET_S)",
    )
    parser.add_argument(
        "--slow-ratio",
        type=float,
        default=0.45,
        help="the slow tests' time as a share of the rest's, with a margin (measured 0.52 "
        "on 2026-12-04 and 0.38 on 2026-12-05: 206 s against 542 s)",
    )
    args, rest = parser.parse_known_args(argv)
    start = time.monotonic()
    status = pytest(rest, "not slow")
    used = time.monotonic() - start
    need = used * args.slow_ratio
    if used + need > args.budget:
        print(
            f"run_tests: the suite without the slow tests took {used:.0f} s; the slow ones "
            f"(about {need:.0f} s more) would pass the {args.budget:.0f} s budget, so they did "
            "not run here. Run them with: python -m pytest -q tests -m slow",
            flush=True,
        )
        return status
    print(f"run_tests: {used:.0f} s so far; the slow tests (about {need:.0f} s) fit", flush=True)
    return pytest(rest, "slow") or status


if __name__ == "__main__":
    sys.exit(main())
