"""The project's own habits, checked like any other test: ruff on every Python
file and mypy on the framework-free core."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.skipif(not (BIN / "ruff").exists() and not shutil.which("ruff"), reason="no ruff")
def test_ruff_is_clean():
    ruff = str(BIN / "ruff") if (BIN / "ruff").exists() else "ruff"
    out = subprocess.run(
        [ruff, "check", "dlgs", "tests", "benchmarks", "examples"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_on_core_is_clean():
    pytest.importorskip("mypy")
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "dlgs/core"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
