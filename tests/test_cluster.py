"""The bandwidth-limited local cluster (network namespaces + tc tbf), as root."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks.cluster import Cluster, parse_rate

ROOT = Path(__file__).resolve().parents[1]

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
        # Both links of the 2-worker ring at once: each direction has its own cap,
        # never exceeded, and together they carry more than one cap would allow.
        # How two senders on 2 busy cores share the CPU is not fair: one link was
        # seen at 76 Mbit/s, and once at 53 beside 96 (2026-12-04), so each link's
        # floor only says it was not starved.
        links = cluster.measure_aggregate(seconds=1.0)
        assert len(links) == 2 and all(0.3e8 <= b <= 1.05e8 for b in links), links
        assert sum(links) >= 1.2e8, links
        assert cluster.run([sys.executable, str(script)], timeout=120) == 0
        # A worker that dies stops the job with its exit code instead of hanging.
        assert cluster.run([sys.executable, str(script), "die"], timeout=120) == 3
    assert "dlgstest" not in _netns()
    assert not os.path.exists("/etc/netns/dlgstest0")


@needs_root
@pytest.mark.parallel
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cluster_tears_down_on_ctrl_c_and_sigterm(sig):
    # Started the way a shell starts a background job (SIGINT ignored), which
    # is where `kill -INT` used to do nothing.
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.cluster", "--workers", "2", "--bandwidth", "1gbit",
         "--no-measure", "--", sys.executable, "-c", "import time; time.sleep(600)"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if "cluster up" in line:
            break
    time.sleep(2)  # the workers are running
    assert "dlgsns0" in _netns()
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "dlgsns" not in _netns(), out
    assert "torn down" in out


@needs_root
@pytest.mark.parallel
def test_nodes_of_two_ranks_get_horovods_node_layout_and_see_their_link(tmp_path):
    """2 nodes of 2 ranks: local and cross ranks as a multi-node launch sets
    them, and each rank reads its node link's counters (a ring allreduce
    crosses it)."""
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import json, sys, horovod.torch as hvd, torch
        from benchmarks.cluster import link_bytes
        hvd.init()
        before = link_bytes()
        hvd.allreduce(torch.zeros(250_000), op=hvd.Sum, name="t")
        hvd.allreduce(torch.zeros(1), op=hvd.Sum, name="barrier")
        crossed = link_bytes() - before
        rec = [hvd.rank(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
               hvd.cross_size(), crossed]
        with open(sys.argv[1] + f"/rank{hvd.rank()}.json", "w") as f:
            json.dump(rec, f)
    """)
    )
    with Cluster(2, None, prefix="dlgstest", ranks_per_node=2) as cluster:
        env = {"PYTHONPATH": str(ROOT)}
        assert cluster.run([sys.executable, str(script), str(tmp_path)], env=env, timeout=180) == 0
    recs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r[:5] for r in recs] == [
        [0, 0, 2, 0, 2],
        [1, 1, 2, 0, 2],
        [2, 0, 2, 1, 2],
        [3, 1, 2, 1, 2],
    ]
    # A 1 MB allreduce's ring crosses each node's link: megabytes, not the
    # few kilobytes of Horovod's own coordination.
    assert all(r[5] > 1_000_000 for r in recs), recs
