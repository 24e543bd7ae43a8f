"""The bandwidth-limited local cluster (network namespaces + tc tbf), as root."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from benchmarks.cluster import Cluster, parse_rate

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("tc"), reason="needs root, ip and tc"
)


def test_parse_rate():
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("100mbit") == 10**8
    assert parse_rate("25Mbit") == 25 * 10**6
    assert parse_rate("2500") == 2500
    with pytest.raises(ValueError, match="--bandwidth"):
        parse_rate("fast")


def _netns():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@needs_root
@pytest.mark.parallel
def test_cluster_caps_bandwidth_runs_horovod_and_cleans_up(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import sys, horovod.torch as hvd, torch
        hvd.init()
        out = hvd.allreduce(torch.full((4,), float(hvd.rank() + 1)), op=hvd.Sum)
        assert hvd.size() == 2 and out.tolist() == [3.0] * 4, out
        if len(sys.argv) > 1 and hvd.rank() == 1:
            sys.exit(3)  # one worker dies
        print("ok", hvd.rank())
    """)
    )
    with Cluster(2, parse_rate("100mbit"), prefix="dlgstest") as cluster:
        assert "dlgstest0" in _netns()
        measured = cluster.measure_bandwidth(seconds=1.0)
        assert 0.8e8 <= measured <= 1.05e8, measured
        assert cluster.run([sys.executable, str(script)], timeout=120) == 0
        # A worker that dies stops the job with its exit code instead of hanging.
        assert cluster.run([sys.executable, str(script), "die"], timeout=120) == 3
    assert "dlgstest" not in _netns()
    assert not os.path.exists("/etc/netns/dlgstest0")
