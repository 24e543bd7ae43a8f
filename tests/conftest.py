"""Shared helpers: launching real ranks under horovodrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")


def horovodrun(
    backend: str, np: int, args, *, timeout: float, cwd=ROOT, extra_path=None
) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` on ``np`` real ranks with ``--gloo`` or ``--mpi``."""
    env = dict(os.environ)
    # Open MPI refuses to run as root without these (DESIGN.md §2).
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    paths = [str(ROOT)] + ([str(extra_path)] if extra_path else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    cmd = [HOROVODRUN, "-np", str(np), f"--{backend}", sys.executable, *map(str, args)]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}"
            f"\n--- stderr ---\n{proc.stderr[-4000:]}"
        )
    return proc


def load_ranks(out_dir: Path, np: int):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(np)]


def run_scenarios(backend: str, worker: str, out_dir: Path, names) -> list:
    """Run ``tests/parallel/WORKER``'s scenarios ``names`` on 2 ranks; each rank's results."""
    horovodrun(backend, 2, [ROOT / "tests/parallel" / worker, out_dir, *names], timeout=600)
    return load_ranks(out_dir, 2)


def value(ranks, name):
    """Scenario ``name``'s return value on every rank (failing the test with a
    rank's traceback if it raised there)."""
    vals = []
    for r, rec in enumerate(ranks):
        res = rec[name]
        if not res["ok"]:
            pytest.fail(f"scenario {name} failed on rank {r}:\n{res['error']}")
        vals.append(res["value"])
    return vals
