"""Horovod's own optimizer tests, with stock Horovod and with dlgs in its place.

Runs every test of Horovod's ``test/parallel/test_torch.py`` that builds a
``hvd.DistributedOptimizer`` on 2 real ranks under ``horovodrun``, once per
form (``stock``: Horovod's own optimizer; ``b``: ``dlgs.torch.DistributedOptimizer``;
``a``: ``compression=dlgs.torch.Compression``, attached), one launch per test so
that a hang is killed after ``--timeout`` seconds and reported as such. Horovod's
tests are read from a Horovod source tree (``--src``); nothing of them is copied
here. The substitution is ``tools/horovod_substitute.py``.

Horovod's test utilities import ``mock`` (``pip install mock``). Example (a checkout
of the tag the installed Horovod was built from)::

    git clone --depth 1 -b v0.28.1 https://github.com/horovod/horovod /tmp/horovod
    python tools/horovod_tests.py --src /tmp/horovod --backend gloo --out /tmp/hvd-tests

Writes ``OUT/horovod_tests.json`` (per test and form: outcome and the first
error line on each rank) and ``OUT/horovod_tests.md`` (the table, the command).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

logger = logging.getLogger("horovod_tests")

ROOT = Path(__file__).resolve().parents[1]
FORMS = ("stock", "b", "a")


def optimizer_tests(test_file: Path) -> List[str]:
    """The test methods whose body calls ``hvd.DistributedOptimizer(``."""
    names, current = [], None
    for line in test_file.read_text().splitlines():
        m = re.match(r"    def (test_\w+)\(", line)
        if m:
            current = m.group(1)
        elif current and "hvd.DistributedOptimizer(" in line and current not in names:
            names.append(current)
    return names


def run_one(src: Path, test: str, form: str, args, out: Path) -> Dict[str, dict]:
    """One test on 2 ranks with one form; each rank's outcome, or a hang."""
    stem = out / f"{form}.{test}"
    for r in range(2):
        Path(f"{stem}.rank{r}.json").unlink(missing_ok=True)
    env = dict(os.environ)
    env.update(
        DLGS_SUBSTITUTE=form,
        DLGS_SUBSTITUTE_OUT=str(stem),
        DLGS_SUBSTITUTE_DENSITY=str(args.density),
        DLGS_SUBSTITUTE_HIDE_MUON="1" if args.hide_muon else "0",
        PYTHONPATH=os.pathsep.join([str(ROOT / "tools"), str(ROOT), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    horovodrun = str(Path(sys.executable).parent / "horovodrun")
    test_file = src / "test" / "parallel" / "test_torch.py"
    cmd = [horovodrun, "-np", "2", f"--{args.backend}", sys.executable, "-m", "pytest"]
    cmd += ["-q", "-p", "horovod_substitute", "-p", "no:cacheprovider"]
    cmd += [f"{test_file}::TorchTests::{test}"]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=src / "test" / "parallel",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        (out / f"{form}.{test}.log").write_text(log)
        return {"rank0": {"outcome": "hang", "message": f"killed after {args.timeout} s"}}
    (out / f"{form}.{test}.log").write_text(log)
    ranks = {}
    for r in range(2):
        path = Path(f"{stem}.rank{r}.json")
        if path.exists():
            got = json.loads(path.read_text())
            ranks[f"rank{r}"] = got.get(
                test, got.get("<collection>", {"outcome": "not run", "message": ""})
            )
        else:
            ranks[f"rank{r}"] = {"outcome": "crashed", "message": f"rc {proc.returncode}"}
    logger.info("%s %s: %s in %.0f s", form, test, _summary(ranks), time.monotonic() - start)
    return ranks


def _summary(ranks: Dict[str, dict]) -> str:
    outcomes = sorted({r["outcome"] for r in ranks.values()})
    return "/".join(outcomes)


def markdown(results: Dict[str, Dict[str, dict]], forms, command: str) -> str:
    lines = [
        "# Horovod's optimizer tests with dlgs in place of hvd.DistributedOptimizer",
        "",
        f"`{command}`",
        "",
        "| test | " + " | ".join(forms) + " |",
        "|---" * (len(forms) + 1) + "|",
    ]
    for test, by_form in results.items():
        cells = []
        for form in forms:
            ranks = by_form.get(form, {})
            text = _summary(ranks) if ranks else "—"
            msg = next((r["message"] for r in ranks.values() if r.get("message")), "")
            cells.append(text + (f": {msg[:120]}" if msg and text != "passed" else ""))
        lines.append(f"| {test} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--src", type=Path, required=True, help="a Horovod source tree")
    parser.add_argument("--forms", default=",".join(FORMS), help="comma list of " + str(FORMS))
    parser.add_argument("--backend", choices=("gloo", "mpi"), default="gloo")
    parser.add_argument("--tests", default="", help="comma list (default: every optimizer test)")
    parser.add_argument("--density", type=float, default=0.01, help="dlgs' density")
    parser.add_argument("--timeout", type=float, default=240, help="seconds before a hang")
    parser.add_argument(
        "--hide-muon",
        action="store_true",
        help="leave torch's Muon out of the tests that loop over every torch optimizer "
        "(it fails them with stock Horovod too, before the optimizers after it run)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    forms = [f for f in args.forms.split(",") if f]
    bad = [f for f in forms if f not in FORMS]
    if bad:
        parser.error(f"--forms: unknown {bad}, accepted {FORMS}")
    test_file = args.src / "test" / "parallel" / "test_torch.py"
    if not test_file.exists():
        parser.error(f"--src: {test_file} does not exist (a Horovod source tree is needed)")
    tests = [t for t in args.tests.split(",") if t] or optimizer_tests(test_file)
    args.out.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Dict[str, dict]] = {}
    total = len(tests) * len(forms)
    for n, (test, form) in enumerate(((t, f) for t in tests for f in forms), 1):
        logger.info("[%d/%d] %s with %s", n, total, test, form)
        results.setdefault(test, {})[form] = run_one(args.src, test, form, args, args.out)
    command = " ".join(shlex.quote(a) for a in ["python", "tools/horovod_tests.py", *sys.argv[1:]])
    (args.out / "horovod_tests.json").write_text(json.dumps(results, indent=1))
    (args.out / "horovod_tests.md").write_text(markdown(results, forms, command))
    print(markdown(results, forms, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
