"""Collective costs as the libraries choose them: NCCL's tuning model, MPI's
algorithm choice, Gloo's ring, on nodes of several ranks.

:mod:`~dlgs.core.planning.netmodel`'s flat ring prices a collective over
``P`` ranks at ``(P - 1)`` latencies, which no library does at scale. Here a
collective is priced the way the library picks its algorithm: every
(algorithm, protocol) the library has is one ``alpha + beta * bytes`` line,
and the collective takes the fastest at each size, which is the lower
envelope of the lines (:class:`~dlgs.core.planning.dp.CostModel` with
``others``). The planner and its DP take that as they take a fitted model.

**NCCL** (``library="nccl"``) follows NCCL's own tuning model,
``src/graph/tuning.cc`` at tag v2.27.7-1 (``ncclTopoTuneModel``), which NCCL
evaluates for every (algorithm, protocol) to choose one:

* latency, in microseconds: ``baseLat[algo][proto]`` plus, for a ring,
  ``(nsteps - nInterSteps) * intraLat + nInterSteps * interLat`` with
  ``nsteps = 2(P-1)`` for allreduce and ``P-1`` for allgather and
  reduce-scatter, ``nInterSteps = 2(N-1)`` or ``N-1`` across ``N`` nodes, and
  ``intraLat`` at least the network post overhead (1 us on Intel, 2 us on
  AMD, three times that for the Simple protocol) when there are several
  nodes; for the tree (allreduce only) ``2 ((P/N - 1) intraLat +
  floor(log2 N) interLat)``; NVLS (one node) and NVLS-tree (several) where
  the preset has NVLink SHARP;
* bandwidth: a bus bandwidth ``busBw`` (here the preset's measured one: the
  node's ring bus bandwidth, and on several nodes the least of it and the
  node's network links), scaled per protocol as NCCL does (ring LL ``0.5``
  capped at ``llMaxBw``, LL128 ``0.92``; tree ``0.92``, then LL ``1/3.8``
  and LL128 ``120/128`` or ``7/9`` on one node) and turned into the
  algorithm bandwidth by ``P/nsteps`` (ring) or ``1/2`` (tree);
* time ``lat + bytes / algBw``.

What it leaves out of NCCL's model: the per-channel bandwidth caps (which
need the channel count that NCCL's topology search finds at run time), the
tree's correction factors below 8 MB, the ring's "plateau" factor, CollNet
and PAT. NCCL has no tuning model for the alltoall (grouped point-to-point):
here it is one round of the Simple protocol's latency with every rank's
blocks crossing the node's links at once (an assumption, see the docs).

**MPI** (``library="mpi"``) takes the best of the algorithms Open MPI's
``coll/tuned`` and MPICH choose between (Thakur, Rabenseifner and Gropp,
2005): recursive doubling, Rabenseifner's reduce-scatter + allgather and the
ring for the allreduce; recursive doubling (Bruck's where ``P`` is not a power
of two) and the ring for the allgather. Stages that cross nodes share the
node's link among its ``L`` ranks; a ring crosses each node's link once.
**Gloo** (``library="gloo"``) runs the ring (``gloo/allreduce.cc``).

Every number is a model; on a real job the fit of the job's own probes is
what the planner uses (``describe()`` says which).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Tuple

from .dp import CostModel, add_costs, envelope, scale_cost
from .netmodel import reduction_cost

__all__ = ["COLLECTIVES", "LIBRARIES", "Cluster", "two_level_costs"]

#: What :meth:`Cluster.cost` prices.
COLLECTIVES = ("allreduce", "allgather", "reducescatter", "alltoall")
#: The libraries whose choice of algorithm is modelled.
LIBRARIES = ("nccl", "mpi", "gloo")

_PROTOCOLS = ("ll", "ll128", "simple")
# NCCL v2.27.7-1, src/graph/tuning.cc: baseLat (L134-137) and hwLat (L143-156), in us.
_BASE_LAT = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4)}
_HW_LAT: Dict[str, Dict[str, Any]] = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": 25.0},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "nvls": 0.0},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "nvls": 18.0, "nvls_tree": 14.0},
}
# llMaxBws (L163-168), GB/s: one node by GPU; several nodes by CPU (Intel, AMD) for 2 / 3+ nodes.
_LL_MAX_ONE_NODE = {"volta": 39.0, "ampere": 87.7, "hopper": 141.0}
_LL_MAX_NODES = {"intel": (39.0, 20.4), "amd": (22.5, 19.0)}
# getNetOverhead (L199-204), us.
_NET_OVERHEAD = {"intel": 1.0, "amd": 2.0}


def _check_positive(name: str, value: Any, *, zero: bool = False) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"{name} must be a finite float {bound}, got {value!r}")


def _log2i(n: int) -> int:
    return n.bit_length() - 1


@dataclass(frozen=True)
class Cluster:
    """Nodes of ``local`` ranks, as the collective cost model sees them.

    Args:
        name: what the docs and ``describe()`` call it.
        local: ranks (GPUs) per node (int >= 1).
        intra_busbw: the bus bandwidth of one node's ring allreduce in bytes/s
            (what ``all_reduce_perf`` reports as ``busbw`` at large sizes).
        inter_bps: bit/s each node sends to the network, all its NICs together.
        library: ``"nccl"``, ``"mpi"`` or ``"gloo"`` (see the module).
        intra_link: ``"nvlink"`` or ``"pci"``: NCCL's latency table inside a node.
        gpu: ``"hopper"``, ``"ampere"`` or ``"volta"`` (NCCL's LL bandwidth cap).
        cpu: ``"intel"`` or ``"amd"`` (NCCL's network post overhead and cap).
        nic_efficiency: the share of the NICs' line rate a collective reaches
            (in (0, 1]).
        nvls_busbw: bus bandwidth of NVLink SHARP's allreduce in bytes/s, or 0
            where the nodes have none.
        overhead_s: seconds every collective pays on top of the library's
            model (the kernel launch and the host's part, which NCCL's tables
            leave out), >= 0.
        ramp_efficiency: the share of an algorithm's bandwidth a collective
            reaches before its pipeline fills (fewer channels, fewer chunks in
            flight), in (0, 1]; 1 (the default) models no ramp.
        ramp_s: seconds of latency an algorithm pays to run at its full
            bandwidth, >= 0. Each algorithm becomes two lines, ``(alpha,
            beta / ramp_efficiency)`` and ``(alpha + ramp_s, beta)``, and the
            envelope takes the ramped one for small messages and the full one
            for large: a bandwidth that ramps up with the message's size, as
            the published sweeps show from 64 KB to a few hundred MB.
        latency_s: for MPI and Gloo: latency of one message between nodes.
        intra_latency_s: for MPI and Gloo: latency of one message inside a node.
        source: where the numbers come from (the docs' table cites it).
    """

    name: str
    local: int
    intra_busbw: float
    inter_bps: float
    library: str = "nccl"
    intra_link: str = "nvlink"
    gpu: str = "hopper"
    cpu: str = "intel"
    nic_efficiency: float = 0.96
    nvls_busbw: float = 0.0
    overhead_s: float = 0.0
    ramp_efficiency: float = 1.0
    ramp_s: float = 0.0
    latency_s: float = 50e-6
    intra_latency_s: float = 5e-6
    source: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.local, bool) or not isinstance(self.local, int) or self.local < 1:
            raise ValueError(f"local must be an int >= 1 (ranks per node), got {self.local!r}")
        _check_positive("intra_busbw", self.intra_busbw)
        _check_positive("inter_bps", self.inter_bps)
        _check_positive("nvls_busbw", self.nvls_busbw, zero=True)
        for name in ("overhead_s", "ramp_s", "latency_s", "intra_latency_s"):
            _check_positive(name, getattr(self, name), zero=True)
        for name in ("nic_efficiency", "ramp_efficiency"):
            share = getattr(self, name)
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {share!r}")
        choices = {
            "library": LIBRARIES,
            "intra_link": ("nvlink", "pci"),
            "gpu": tuple(_LL_MAX_ONE_NODE),
            "cpu": tuple(_NET_OVERHEAD),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

    def with_bandwidth(self, inter_bps: float) -> "Cluster":
        """The same nodes on another network (bit/s per node)."""
        return replace(self, inter_bps=inter_bps)

    def nodes(self, world_size: int) -> Tuple[int, float]:
        """``(N, P/N)``: how many nodes ``world_size`` ranks fill, and ranks per node."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        n = -(-world_size // self.local)
        return n, world_size / n

    def busbw(self, world_size: int) -> float:
        """The ring's bus bandwidth in bytes/s over ``world_size`` ranks: the
        node's, and across nodes the least of it and the node's links."""
        n, _ = self.nodes(world_size)
        if n == 1:
            return self.intra_busbw
        return min(self.intra_busbw, self.inter_bps / 8 * self.nic_efficiency)

    # -- the collectives ---------------------------------------------------------------
    def cost(self, collective: str, world_size: int) -> CostModel:
        """``collective``'s cost over ``world_size`` ranks, the fastest line at
        each size. Bytes: the buffer for ``allreduce`` and ``reducescatter``,
        one rank's chunk for ``allgather``, everything one rank sends for
        ``alltoall``."""
        if collective not in COLLECTIVES:
            raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
        self.nodes(world_size)  # (checks world_size)
        if world_size == 1:
            return CostModel(0.0, 0.0)
        return envelope(list(self.lines(collective, world_size).values()))

    def lines(self, collective: str, world_size: int) -> Dict[str, Tuple[float, float]]:
        """Every algorithm's ``(alpha, beta)`` in seconds and seconds per byte,
        by name (e.g. ``"ring/ll128"``), before the envelope is taken."""
        if self.library == "nccl":
            found = _nccl(self, collective, world_size)
        else:
            found = _mpi(self, collective, world_size)
        out = {}
        for k, (a, b) in found.items():
            if self.ramp_efficiency < 1.0:
                out[f"{k}/ramp"] = (a + self.overhead_s, b / self.ramp_efficiency)
                a += self.ramp_s
            out[k] = (a + self.overhead_s, b)
        return out

    def lines_of(
        self, collective: str, world_size: int, algorithm: str
    ) -> Dict[str, Tuple[float, float]]:
        """The :meth:`lines` of ``algorithm``: one key (``"ring/simple"``) or
        every protocol of an algorithm (``"ring"``), at full bandwidth and
        ramping up. Raises ``ValueError`` naming ``algorithm`` if none."""
        found = {
            k: ab
            for k, ab in self.lines(collective, world_size).items()
            if k == algorithm or k.startswith(algorithm + "/")
        }
        if not found:
            raise ValueError(f"algorithm {algorithm!r} has no line for {collective} here")
        return found

    def time(self, collective: str, world_size: int, nbytes: float, algorithm: str = "") -> float:
        """Seconds for one ``collective`` of ``nbytes`` (see :meth:`cost`); with
        ``algorithm`` (see :meth:`lines_of`), the fastest of its lines."""
        if not algorithm:
            return float(self.cost(collective, world_size)(nbytes))
        lines = self.lines_of(collective, world_size, algorithm)
        return min(a + b * nbytes for a, b in lines.values())


def _nccl(c: Cluster, collective: str, p: int) -> Dict[str, Tuple[float, float]]:
    n, ppn = c.nodes(p)
    intra = c.intra_link
    bus = c.busbw(p) / 1e9  # GB/s, as tuning.cc
    if n == 1:
        ll_max = _LL_MAX_ONE_NODE[c.gpu]
    else:
        ll_max = _LL_MAX_NODES[c.cpu][0 if n == 2 else 1]
    out: Dict[str, Tuple[float, float]] = {}
    if collective == "alltoall":
        # One round of point-to-point sends (no NCCL model: an assumption).
        lat = _BASE_LAT["ring"][2] + (
            _HW_LAT["net"]["ring"][2] if n > 1 else _HW_LAT[intra]["ring"][2]
        )
        local, crossing = ppn - 1, p - ppn  # peers inside and outside the node
        inside = local / (p - 1) / (c.intra_busbw / 1e9)
        across = ppn * crossing / (p - 1) / (c.inter_bps / 8e9 * c.nic_efficiency) if n > 1 else 0.0
        out["p2p/simple"] = (lat * 1e-6, max(inside, across) * 1e-9)
        return out
    allreduce = collective == "allreduce"
    nsteps = 2 * (p - 1) if allreduce else p - 1
    inter_steps = 0 if n == 1 else (2 * (n - 1) if allreduce else n - 1)
    for i, proto in enumerate(_PROTOCOLS):
        # Ring.
        intra_lat = _HW_LAT[intra]["ring"][i]
        inter_lat = _HW_LAT["net"]["tree" if ppn == 1 else "ring"][i]
        if n > 1:
            intra_lat = max(intra_lat, _NET_OVERHEAD[c.cpu] * (3 if proto == "simple" else 1))
        lat = _BASE_LAT["ring"][i] + (nsteps - inter_steps) * intra_lat + inter_steps * inter_lat
        bw = {"ll": min(ll_max, bus * 0.5), "ll128": bus * 0.92, "simple": bus}[proto]
        alg = bw * p / nsteps
        # Bytes: allgather's are one rank's chunk (NCCL's nBytes is P chunks).
        per_byte = (p if collective == "allgather" else 1) / alg
        out[f"ring/{proto}"] = (lat * 1e-6, per_byte * 1e-9)
        if not allreduce:
            continue
        # Tree (allreduce only).
        intra_lat = _HW_LAT[intra]["tree"][i]
        inter_lat = _HW_LAT["net"]["tree"][i]
        lat = _BASE_LAT["tree"][i] + 2 * ((ppn - 1) * intra_lat + _log2i(n) * inter_lat)
        bw = bus * 0.92
        if proto == "ll":
            bw = min(bw / 3.8, ll_max)
        elif proto == "ll128":
            bw *= 7.0 / 9.0 if n == 1 else 120.0 / 128.0
        out[f"tree/{proto}"] = (lat * 1e-6, 1 / (bw * 0.5) * 1e-9)
    if allreduce and c.nvls_busbw > 0 and intra == "nvlink":
        if n == 1:
            lat, bw = _HW_LAT["nvlink"]["nvls"], c.nvls_busbw / 1e9
        else:
            # NVLS-tree: NVLink SHARP inside the node, a tree between nodes.
            lat = _HW_LAT["nvlink"]["nvls"] + 2 * _log2i(n) * _HW_LAT["net"]["nvls_tree"]
            net = c.inter_bps / 8e9 * c.nic_efficiency
            bw = min(c.nvls_busbw / 1e9, net if n <= 2 else net / 2)
        # nccl-tests' busbw of an allreduce: algbw * 2(P-1)/P.
        out["nvls/simple"] = (lat * 1e-6, 2 * (p - 1) / p / bw * 1e-9)
    return out


def _mpi(c: Cluster, collective: str, p: int) -> Dict[str, Tuple[float, float]]:
    n, ppn = c.nodes(p)
    if n == 1:
        a, ring_bw, shared_bw = c.intra_latency_s, c.intra_busbw, c.intra_busbw
    else:
        a = c.latency_s
        link = c.inter_bps / 8 * c.nic_efficiency
        ring_bw = min(c.intra_busbw, link)  # a ring crosses each node's link once
        shared_bw = min(c.intra_busbw, link / ppn)  # every rank of the node at once
    stages = math.ceil(math.log2(p))
    out: Dict[str, Tuple[float, float]] = {}
    if collective == "allreduce":
        out["ring"] = (2 * (p - 1) * a, 2 * (p - 1) / p / ring_bw)
        if c.library == "mpi":
            out["recursive_doubling"] = (stages * a, stages / shared_bw)
            out["rabenseifner"] = (2 * stages * a, 2 * (p - 1) / p / shared_bw)
    elif collective == "allgather":
        out["ring"] = ((p - 1) * a, (p - 1) / ring_bw)
        if c.library == "mpi":
            out["recursive_doubling"] = (stages * a, (p - 1) / shared_bw)
    elif collective == "reducescatter":
        out["ring"] = ((p - 1) * a, (p - 1) / p / ring_bw)
        if c.library == "mpi":
            out["recursive_halving"] = (stages * a, (p - 1) / p / shared_bw)
    else:  # alltoall: pairwise exchange, P - 1 rounds
        out["pairwise"] = ((p - 1) * a, (p - 1) / p / shared_bw)
    return out


def two_level_costs(
    cluster: Cluster,
    world_size: int,
    dense_per_chunk_byte: float,
    reduce_width: Optional[float] = None,
) -> Tuple[CostModel, CostModel]:
    """``(sparse, dense)``: the two-level exchange's messages
    (:mod:`dlgs.core.transport.hierarchical`) on ``cluster``, as
    :class:`~dlgs.core.planning.netmodel.TwoLevels` prices them on flat rings:

    * a sparse message, by the bytes ``c`` of one rank's flat chunk: the
      node's reduce-scatter and allgather of the dense bytes ``r c``
      (``r = dense_per_chunk_byte``), then an allgather of each rank's shard
      chunk ``c / L`` between nodes, ``L`` of them sharing the node's links;
    * a dense message of ``b`` bytes: the node's reduce-scatter, an
      allreduce of the ``b / L`` shard between nodes (``L`` sharing the
      links), the node's allgather of ``b / L`` per rank.

    With ``reduce_width``, sparse shards travel between nodes by the sparse
    reduction (:func:`~dlgs.core.planning.netmodel.reduction_cost` of that
    allgather over the nodes) instead of the allgather.
    """
    nodes, ppn = cluster.nodes(world_size)
    local = int(ppn)
    if nodes < 2 or local * nodes != world_size:
        raise ValueError(
            f"world_size must fill at least 2 nodes of {cluster.local} ranks, got {world_size}"
        )
    if not (math.isfinite(dense_per_chunk_byte) and dense_per_chunk_byte > 0):
        raise ValueError(
            f"dense_per_chunk_byte must be a finite float > 0, got {dense_per_chunk_byte!r}"
        )
    node = replace(cluster, local=local)
    scatter, gather = node.cost("reducescatter", local), node.cost("allgather", local)
    cross = replace(cluster, local=1, inter_bps=cluster.inter_bps / local)
    in_node = add_costs(scatter, gather, 1.0 / local)  # of the dense bytes
    between = cross.cost("allgather", nodes)
    if reduce_width is not None:
        between = reduction_cost(between, nodes, reduce_width)
    sparse = add_costs(scale_cost(in_node, 1.0, dense_per_chunk_byte), between, 1.0 / local)
    dense = add_costs(in_node, cross.cost("allreduce", nodes), 1.0 / local)
    return sparse, dense
