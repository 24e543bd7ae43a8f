"""``python -m dlgs.selfcheck`` in its quick mode on the CPU, with Horovod
unimportable: the check a session with a GPU runs (``--device cuda``) cannot rot
before a GPU comes."""

from __future__ import annotations

import csv
import subprocess
import sys

from conftest import ROOT, triton_env, triton_installed

CHECKS = {
    "fused_equal",
    "identical",
    "conserved",
    "exact",
    "nonfinite",
    "cpu_equal",
    "adversarial",
    "host_reads",
    "launches",
    "memory",
    "primitives",
    "deterministic",
    "timing",
}


def test_quick_selfcheck_passes_on_the_cpu_without_horovod(tmp_path):
    code = (
        "import sys; sys.modules['horovod'] = None\n"
        "from dlgs.selfcheck import main\n"
        f"sys.exit(main(['--device', 'cpu', '--quick', '--out', {str(tmp_path)!r}]))\n"
    )
    # With Triton's interpreter: the fused kernels against the torch path too.
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=triton_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "selfcheck.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["check"] for r in rows} == CHECKS
    assert all(r["ok"] == "True" for r in rows), [r for r in rows if r["ok"] != "True"]
    assert "0 failed" in (tmp_path / "selfcheck.md").read_text()
    fused = [r for r in rows if r["check"] == "fused_equal"]
    if triton_installed():
        assert len(fused) == 2 and not any("n/a" in r["detail"] for r in fused), fused
    # Every coding and value dtype ran on 2 and 3 ranks.
    identical = {(r["case"], r["ranks"]) for r in rows if r["check"] == "identical"}
    assert ("bitmap/bfloat16/topk", "3") in identical and ("block16/float16/topk", "2") in identical
