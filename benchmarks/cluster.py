"""A bandwidth-limited Horovod cluster on one machine.

Each worker runs in its own network namespace with a veth into a bridge; both
ends of every veth are capped with ``tc ... tbf`` so each worker's link has the
given rate in both directions (netem is not available on this kernel; tbf is).
Workers are launched by a direct Gloo launcher: Horovod's own rendezvous server
in the root namespace, and every rank's ``HOROVOD_*`` variables set as
``horovodrun --gloo`` would set them. Addresses come from 198.18.0.0/15, the
range reserved for benchmarking.

With ``--ranks-per-node L`` each namespace is a node holding ``L`` ranks
(uncapped among themselves: they talk over the namespace's own address), the
nodes joined by the capped links; Horovod's local and cross ranks and
hostnames are set as a real multi-node launch sets them (and torch.distributed's
``MASTER_ADDR``, ``RANK``, ``WORLD_SIZE``, ... as ``torchrun`` sets them, so a
script may start DDP too), and each rank sees
its node's link as ``dlgs0`` (``/sys/class/net/dlgs0/statistics``: the bytes
that crossed it; :func:`link_bytes`).

Everything is torn down on exit, on Ctrl-C, on SIGTERM and when a worker dies
(which also stops the others). Without root, it says so and falls back to
plain local ``horovodrun --gloo`` on loopback.

Example::

    python -m benchmarks.cluster --workers 2 --bandwidth 1gbit -- \\
        python -m benchmarks.train --model resnet20 --methods dense,dlgs
    python -m benchmarks.cluster --nodes 2 --ranks-per-node 2 --bandwidth 100mbit -- \\
        python -m benchmarks.link_bytes
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Cluster", "link_bytes", "parse_rate", "main"]

logger = logging.getLogger("benchmarks.cluster")

SUBNET = "198.18.77"  # within 198.18.0.0/15 (RFC 2544 benchmarking range)
BRIDGE = "dlgsbr0"
IFACE = "dlgs0"  # the worker's interface inside its namespace
TORCH_PORT = 29500  # torch.distributed's store, on rank 0's node (a fresh namespace)

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(bit|bps)?\s*$", re.IGNORECASE)


def parse_rate(text: str) -> int:
    """``"1gbit"``, ``"100mbit"``, ``"25mbit"`` or a plain number of bit/s -> bit/s."""
    m = _RATE.match(str(text))
    if not m:
        raise ValueError(f"--bandwidth must look like 1gbit, 100mbit or 25mbit, got {text!r}")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2).lower()]
    rate = int(float(m.group(1)) * scale)
    if rate <= 0:
        raise ValueError(f"--bandwidth must be positive, got {text!r}")
    return rate


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    logger.debug("+ %s", " ".join(cmd))
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class Cluster:
    """Network namespaces on a bridge, rate-capped, with a Gloo launcher.

    Args:
        workers: number of namespaces (nodes; ``ranks_per_node`` Horovod ranks each).
        bandwidth: link rate in bit/s in each direction, or None for no cap.
        prefix: namespace name prefix (``<prefix>0`` ...).
        ranks_per_node: Horovod ranks in each namespace.
    """

    def __init__(
        self,
        workers: int,
        bandwidth: Optional[int],
        prefix: str = "dlgsns",
        ranks_per_node: int = 1,
    ):
        if workers < 1 or workers > 200:
            raise ValueError(f"--workers must be in [1, 200], got {workers}")
        if ranks_per_node < 1 or workers * ranks_per_node > 256:
            raise ValueError(
                f"--ranks-per-node must be >= 1 with at most 256 ranks, got {ranks_per_node}"
            )
        self.ranks_per_node = ranks_per_node
        self.workers = workers
        self.bandwidth = bandwidth
        self.prefix = prefix
        self.namespaces = [f"{prefix}{i}" for i in range(workers)]
        self.addresses = [f"{SUBNET}.{10 + i}" for i in range(workers)]
        self.gateway = f"{SUBNET}.1"
        self._procs: List[subprocess.Popen] = []
        self._up = False

    # -- set-up and tear-down ------------------------------------------------------
    def __enter__(self) -> "Cluster":
        try:
            self._setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _setup(self) -> None:
        self.teardown(quiet=True)  # leftovers of a killed run
        self._up = True
        host = socket.gethostname()
        _sh("ip", "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "addr", "add", f"{self.gateway}/24", "dev", BRIDGE)
        _sh("ip", "link", "set", BRIDGE, "up")
        for i, (ns, addr) in enumerate(zip(self.namespaces, self.addresses)):
            outer = f"dlgsv{i}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", outer, "type", "veth", "peer", "name", IFACE, "netns", ns)
            _sh("ip", "link", "set", outer, "master", BRIDGE)
            _sh("ip", "link", "set", outer, "up")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", IFACE)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", IFACE, "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            # Horovod's process-set Gloo contexts resolve gethostname(), which in a
            # namespace would be loopback (Gloo init then fails with "connection refused"):
            # map it to the worker's address.
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{addr} {host}\n")
            if self.bandwidth:
                for cmd in (["tc"], ["ip", "netns", "exec", ns, "tc"]):
                    dev = outer if cmd == ["tc"] else IFACE
                    _sh(
                        *cmd,
                        "qdisc",
                        "add",
                        "dev",
                        dev,
                        "root",
                        "tbf",
                        "rate",
                        str(self.bandwidth),
                        "burst",
                        str(max(32_000, self.bandwidth // 8 // 250)),
                        "latency",
                        "100ms",
                    )
        logger.info(
            "cluster up: %d workers %s on %s, link %s each way",
            self.workers,
            ", ".join(self.addresses),
            BRIDGE,
            f"{self.bandwidth / 1e6:g} Mbit/s" if self.bandwidth else "uncapped",
        )

    def teardown(self, quiet: bool = False) -> None:
        """Stop workers, delete namespaces, the bridge and /etc/netns entries."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        self._procs = []
        existing = _sh("ip", "netns", "list", check=False).stdout
        for ns in self.namespaces:
            if re.search(rf"^{ns}\b", existing, re.MULTILINE):
                _sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        for i in range(self.workers):
            _sh("ip", "link", "del", f"dlgsv{i}", check=False)
        _sh("ip", "link", "del", BRIDGE, check=False)
        if self._up and not quiet:
            logger.info("cluster torn down")
        self._up = False

    # -- measuring ---------------------------------------------------------------
    def measure_bandwidth(self, seconds: float = 1.0) -> float:
        """Achieved TCP throughput from worker 1 to worker 0, in bit/s."""
        if self.workers < 2:
            return float("nan")
        return self._measure([(1, 0)], seconds)[0]

    def measure_aggregate(self, seconds: float = 2.0) -> List[float]:
        """Achieved TCP throughput of every link of a ring at once (worker ``i``
        sends to worker ``i + 1``, as a ring collective's steps do), in bit/s per
        link. Their sum is what the bridge carries with every worker busy: the
        bridge and the veths are software, so it is bounded by this machine's
        cores, not by the links' caps, once the workers are many."""
        if self.workers < 2:
            return []
        n = self.workers
        return self._measure([(i, (i + 1) % n) for i in range(n)], seconds)

    def _measure(self, pairs: Sequence[Tuple[int, int]], seconds: float) -> List[float]:
        """Bit/s received on each ``(sender, receiver)`` pair, all sending at once."""
        sinks = []
        try:
            for k, (_, dst) in enumerate(pairs):
                sinks.append(
                    subprocess.Popen(
                        [
                            "ip",
                            "netns",
                            "exec",
                            self.namespaces[dst],
                            sys.executable,
                            "-c",
                            _SINK,
                            self.addresses[dst],
                            str(47011 + k),
                        ],
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            time.sleep(0.5 + 0.05 * len(pairs))  # every sink listening
            sources = [
                subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        self.namespaces[src],
                        sys.executable,
                        "-c",
                        _SOURCE,
                        self.addresses[dst],
                        str(47011 + k),
                        str(seconds),
                    ]
                )
                for k, (src, dst) in enumerate(pairs)
            ]
            for p in sources:
                p.wait(timeout=seconds + 60)
            return [float(s.communicate(timeout=seconds + 60)[0].strip()) for s in sinks]
        finally:
            for s in sinks:
                if s.poll() is None:
                    s.kill()

    # -- running ------------------------------------------------------------------
    def run(
        self,
        argv: Sequence[str],
        env: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> int:
        """Run ``argv`` as ``ranks_per_node`` Horovod ranks per namespace;
        returns the first non-zero exit code (then the other ranks are
        stopped) or 0."""
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.http.http_server import RendezvousServer

        self._procs = []
        server = RendezvousServer(verbose=0)
        port = server.start()
        per = self.ranks_per_node
        hosts = parse_hosts(",".join(f"{a}:{per}" for a in self.addresses))
        plan = get_host_assignments(hosts, self.workers * per)
        where = dict(zip(self.addresses, self.namespaces))
        server.init(plan)
        base = dict(os.environ, **(env or {}))
        base.setdefault("OMP_NUM_THREADS", "1")
        master = next(slot.hostname for slot in plan if slot.rank == 0)
        threads = []
        try:
            for slot in plan:
                ns = where[slot.hostname]
                worker_env = dict(
                    base,
                    HOROVOD_HOSTNAME=slot.hostname,
                    HOROVOD_RANK=str(slot.rank),
                    HOROVOD_SIZE=str(slot.size),
                    HOROVOD_LOCAL_RANK=str(slot.local_rank),
                    HOROVOD_LOCAL_SIZE=str(slot.local_size),
                    HOROVOD_CROSS_RANK=str(slot.cross_rank),
                    HOROVOD_CROSS_SIZE=str(slot.cross_size),
                    HOROVOD_GLOO_RENDEZVOUS_ADDR=self.gateway,
                    HOROVOD_GLOO_RENDEZVOUS_PORT=str(port),
                    HOROVOD_CONTROLLER="gloo",
                    HOROVOD_CPU_OPERATIONS="gloo",
                    HOROVOD_GLOO_IFACE=IFACE,
                    # torch.distributed's env:// rendezvous, for a script that
                    # (also) starts torch.distributed ranks (DDP): rank 0's
                    # node serves the store; Gloo binds the node's link.
                    MASTER_ADDR=master,
                    MASTER_PORT=str(TORCH_PORT),
                    RANK=str(slot.rank),
                    WORLD_SIZE=str(slot.size),
                    LOCAL_RANK=str(slot.local_rank),
                    LOCAL_WORLD_SIZE=str(slot.local_size),
                    GLOO_SOCKET_IFNAME=IFACE,
                )
                p = subprocess.Popen(
                    ["ip", "netns", "exec", ns, *argv],
                    env=worker_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
                self._procs.append(p)
                t = threading.Thread(target=_forward, args=(p, slot.rank), daemon=True)
                t.start()
                threads.append(t)
            return self._wait(timeout)
        finally:
            for t in threads:
                t.join(timeout=5)
            server.stop()

    def _wait(self, timeout: Optional[float]) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in self._procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                logger.error("a worker exited with %d: stopping the others", failed[0])
                self.teardown_workers()
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                logger.error("timed out after %.0f s: stopping the workers", timeout)
                self.teardown_workers()
                return 124
            time.sleep(0.2)

    def teardown_workers(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)


def link_bytes() -> Optional[int]:
    """Bytes that crossed this rank's node link so far, both ways (read inside
    a cluster namespace; None elsewhere)."""
    base = Path("/sys/class/net") / IFACE / "statistics"
    try:
        return int((base / "tx_bytes").read_text()) + int((base / "rx_bytes").read_text())
    except OSError:
        return None


def _forward(p: subprocess.Popen, rank: int) -> None:
    assert p.stdout is not None
    for line in p.stdout:
        sys.stdout.write(f"[{rank}] {line}" if rank else line)
        sys.stdout.flush()


_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.perf_counter()
    n += len(b)
print(8 * n / max(time.perf_counter() - t0, 1e-9))
"""

_SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
buf = b"x" * (1 << 20); end = time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < end: c.sendall(buf)
c.close()
"""


def _is_root() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run a command as Horovod ranks on a bandwidth-limited local cluster.",
        usage="%(prog)s [options] -- COMMAND ...",
    )
    parser.add_argument("--workers", type=int, default=2, help="nodes (namespaces)")
    parser.add_argument("--nodes", type=int, default=None, help="same as --workers")
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=1,
        help="Horovod ranks in each node, uncapped among themselves (default 1)",
    )
    parser.add_argument(
        "--bandwidth",
        default="1gbit",
        help="per-worker link rate each way: 1gbit, 100mbit, 25mbit, or 'none'",
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds before giving up")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="measure the achieved TCP bandwidth first (default on)",
    )
    parser.add_argument("--no-measure", dest="measure", action="store_false")
    parser.set_defaults(measure=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.nodes is not None:
        args.workers = args.nodes
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a COMMAND to run is required after --")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    bandwidth = None if args.bandwidth == "none" else parse_rate(args.bandwidth)
    env = {"DLGS_BANDWIDTH": args.bandwidth, "DLGS_CLUSTER": "netns"}
    if not _is_root():
        logger.warning(
            "not root (or no ip/tc): cannot create network namespaces; falling back to plain "
            "local horovodrun --gloo on loopback, without a bandwidth limit"
        )
        env["DLGS_CLUSTER"] = "loopback"
        env["DLGS_BANDWIDTH"] = "none"
        horovodrun = str(Path(sys.executable).parent / "horovodrun")
        return subprocess.call(
            [horovodrun, "-np", str(args.workers * args.ranks_per_node), "--gloo", *command],
            env=dict(os.environ, **env),
            timeout=args.timeout,
        )

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGINT too: a shell starts background jobs with SIGINT ignored, and Python
    # then installs no handler of its own, so `kill -INT` would do nothing.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        with Cluster(args.workers, bandwidth, ranks_per_node=args.ranks_per_node) as cluster:
            if args.measure and args.workers > 1:
                measured = cluster.measure_bandwidth()
                logger.info("achieved TCP bandwidth worker 1 -> 0: %.1f Mbit/s", measured / 1e6)
                env["DLGS_MEASURED_BPS"] = f"{measured:.0f}"
                if args.workers > 2:
                    links = cluster.measure_aggregate()
                    logger.info(
                        "achieved TCP bandwidth, all %d links of a ring at once: %.1f Mbit/s in "
                        "all, %.1f-%.1f Mbit/s per link",
                        len(links),
                        sum(links) / 1e6,
                        min(links) / 1e6,
                        max(links) / 1e6,
                    )
                    env["DLGS_AGGREGATE_BPS"] = f"{sum(links):.0f}"
                    env["DLGS_RING_LINK_MIN_BPS"] = f"{min(links):.0f}"
            return cluster.run(command, env=env, timeout=args.timeout)
    except KeyboardInterrupt as err:
        logger.warning("stopped (%s); the cluster was torn down", err or "Ctrl-C")
        return 130


if __name__ == "__main__":
    sys.exit(main())
