"""Analytic cost models of ring collectives, for planning without measurements.

The planner needs one :class:`~dlgs.core.planning.dp.CostModel` (``alpha + beta *
nbytes`` seconds) per collective. On a real job those are fitted by least
squares on measured collectives at the job's world size
(:func:`~dlgs.core.planning.dp.fit_cost_model`); this module gives the textbook
ring-algorithm costs instead, so that a plan can be predicted for a cluster
one does not have (``python -m dlgs.plan``).

With ``P`` ranks, links of ``B`` bit/s and a per-step latency of ``a`` seconds
(Thakur, Rabenseifner and Gropp, "Optimization of collective communication
operations in MPICH", 2005):

* ring allreduce of a ``b``-byte buffer (reduce-scatter then allgather,
  ``2(P-1)`` steps of ``b/P`` bytes)::

      2(P-1) a + 2(P-1)/P * 8 b / B

* ring allgather in which every rank contributes a chunk of ``c`` bytes
  (``P-1`` steps of ``c`` bytes)::

      (P-1) a + (P-1) * 8 c / B

Both are linear in the bytes that the planner counts (the whole dense buffer
for allreduce, one rank's chunk for allgather), so they are exact
:class:`CostModel` instances. They ignore contention, hierarchy (NVLink inside
a node, network between nodes), Horovod's negotiation and its cycle time, so
they are a lower bound on what a framework achieves; prefer a fitted model as
soon as the job can measure one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from .dp import CostModel, scale_cost

__all__ = [
    "DEFAULT_LATENCY_S",
    "TwoLevels",
    "allgather_cost",
    "allreduce_cost",
    "check_network",
    "reduction_cost",
]

#: Latency of one ring step in seconds (TCP over Ethernet, with software overhead).
DEFAULT_LATENCY_S = 50e-6


def check_network(world_size: Any, bandwidth_bps: Any, latency_s: Any) -> None:
    """Raise ``ValueError`` (naming the parameter and its range) unless
    ``world_size`` is an int >= 1, ``bandwidth_bps`` a finite float > 0 and
    ``latency_s`` a finite float >= 0."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if (
        isinstance(bandwidth_bps, bool)
        or not isinstance(bandwidth_bps, (int, float))
        or not math.isfinite(bandwidth_bps)
        or bandwidth_bps <= 0
    ):
        raise ValueError(f"bandwidth_bps must be a finite float > 0 (bit/s), got {bandwidth_bps!r}")
    if (
        isinstance(latency_s, bool)
        or not isinstance(latency_s, (int, float))
        or not math.isfinite(latency_s)
        or latency_s < 0
    ):
        raise ValueError(f"latency_s must be a finite float >= 0 (seconds), got {latency_s!r}")


def allreduce_cost(world_size: int, bandwidth_bps: float, latency_s: float) -> CostModel:
    """Ring allreduce: ``2(P-1) a + 2(P-1)/P * 8 b / B`` for a ``b``-byte buffer.

    Args:
        world_size: ranks ``P`` (int >= 1; one rank costs nothing).
        bandwidth_bps: link bandwidth ``B`` in bit/s (> 0).
        latency_s: latency ``a`` of one ring step in seconds (>= 0).

    Returns:
        The cost model, called with the buffer's bytes.
    """
    check_network(world_size, bandwidth_bps, latency_s)
    p = world_size
    return CostModel(2 * (p - 1) * latency_s, 2 * (p - 1) / p * 8 / bandwidth_bps)


def allgather_cost(world_size: int, bandwidth_bps: float, latency_s: float) -> CostModel:
    """Ring allgather: ``(P-1) a + (P-1) * 8 c / B`` for chunks of ``c`` bytes.

    Args:
        world_size: ranks ``P`` (int >= 1; one rank costs nothing).
        bandwidth_bps: link bandwidth ``B`` in bit/s (> 0).
        latency_s: latency ``a`` of one ring step in seconds (>= 0).

    Returns:
        The cost model, called with the bytes of *one rank's* chunk.
    """
    check_network(world_size, bandwidth_bps, latency_s)
    p = world_size
    return CostModel((p - 1) * latency_s, (p - 1) * 8 / bandwidth_bps)


def reduction_cost(allgather: CostModel, world_size: int, width: float = 1.25) -> CostModel:
    """The sparse reduction by regions (:mod:`dlgs.core.transport.reduction`) as a
    function of the bytes ``c`` of the message's flat chunk from one rank
    (what ``allgather`` takes), derived from the allgather's own model:

    * an alltoall in which each rank sends each other rank one block of about
      ``width * c / P`` bytes: ``P - 1`` exchanges of one block, priced as a
      ring allgather of that block (``alpha + beta * width * c / P``);
    * an allgather of each owner's block of kept sums, the same size.

    So ``2 alpha + 2 beta * width * c / P``: twice the latency, and
    ``2 width / P`` of the allgather's bandwidth term (less from three
    ranks on at the default width). Blocks use the message's value dtype and
    16-bit offsets as the flat chunk does, so the bytes per entry are taken
    equal. The same formula serves the simulator (from
    :func:`allgather_cost`) and a measured profile (from the fitted
    allgather)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not (isinstance(width, (int, float)) and math.isfinite(width) and width > 0):
        raise ValueError(f"width must be a finite float > 0, got {width!r}")
    # (Each of the allgather's algorithms, where it has several.)
    return scale_cost(allgather, 2.0, 2 * width / world_size)


@dataclass(frozen=True)
class TwoLevels:
    """A cluster of ``nodes`` nodes of ``local`` ranks: links of
    ``bandwidth_bps`` and ring-step latency ``latency_s`` between nodes,
    ``intra_bps`` and ``intra_latency_s`` inside one (checked as
    :func:`check_network` checks)."""

    nodes: int
    local: int
    bandwidth_bps: float
    intra_bps: float
    latency_s: float
    intra_latency_s: float

    def __post_init__(self) -> None:
        check_network(self.nodes * self.local, self.bandwidth_bps, self.latency_s)
        check_network(self.local, self.intra_bps, self.intra_latency_s)

    def _in_node(self) -> CostModel:
        """The node's ring reduce-scatter plus allgather of ``b`` dense bytes:
        ``2 (L-1) a' + 2 (L-1)/L * 8 b / B'``."""
        return allreduce_cost(self.local, self.intra_bps, self.intra_latency_s)

    def sparse_cost(
        self, dense_per_chunk_byte: float, reduce_width: Optional[float] = None
    ) -> CostModel:
        """The two-level exchange of a sparse message (:mod:`dlgs.core.transport.hierarchical`)
        as a function of the bytes ``c`` of the *flat* chunk of one rank (what
        the planner counts for the whole layers):

        * inside the node, a ring reduce-scatter and a ring allgather of the
          message's dense bytes ``b = r c`` (``r``: ``dense_per_chunk_byte``,
          4 bytes per element over the chunk's bytes per element):
          ``2 (L-1) a' + 2 (L-1)/L * 8 r c / B'``;
        * between nodes, a ring allgather of each rank's shard chunk of
          ``c / L`` bytes, ``L`` rings (one per local rank) sharing the node's
          link: ``(N-1) a + (N-1) * 8 c / B`` (the flat exchange's is
          ``(P-1) a + (P-1) * 8 c / B``: about ``L`` times more across it).

        Linear in ``c``, so a :class:`CostModel` the planner can use as a
        profile's ``allgather``. With ``reduce_width``, the shards travel
        between nodes by the sparse reduction instead
        (:func:`reduction_cost` of that allgather over the ``N`` nodes): the
        bytes across a node's link stop growing with ``N``."""
        if not (math.isfinite(dense_per_chunk_byte) and dense_per_chunk_byte > 0):
            raise ValueError(
                f"dense_per_chunk_byte must be a finite float > 0, got {dense_per_chunk_byte!r}"
            )
        node = self._in_node()
        cross = allgather_cost(self.nodes, self.bandwidth_bps, self.latency_s)
        if reduce_width is not None:
            cross = reduction_cost(cross, self.nodes, reduce_width)
        return CostModel(node.alpha + cross.alpha, node.beta * dense_per_chunk_byte + cross.beta)

    def dense_cost(self) -> CostModel:
        """A dense message through the two-level exchange, for a ``b``-byte
        buffer: the node's reduce-scatter and allgather around a ring allreduce
        of each rank's ``b / L`` shard between nodes, ``L`` rings sharing the
        node's link (``2 (N-1) a + 2 (N-1)/N * 8 b / B``): the flat ring's
        bandwidth term with ``N`` in place of ``P`` in its latency term."""
        node = self._in_node()
        cross = allreduce_cost(self.nodes, self.bandwidth_bps, self.latency_s)
        return CostModel(node.alpha + cross.alpha, node.beta + cross.beta)
