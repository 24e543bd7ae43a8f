"""``topology="auto"``: flat or two levels, chosen by timing both on the job's
own process sets.

Which exchange is faster depends on what no option can say: how fast the
links inside a node really are against those between nodes, and what a node's
reduce-scatter costs its processors. So at construction, on every rank, the
collectives each exchange would issue in one step for this model are timed
once, merged into one message per kind (so that both sides pay one latency):

* flat: an allgather over every rank of the sparse layers' chunks at the
  steady density, and an allreduce over every rank of the dense layers;
* two levels (:mod:`dlgs.core.transport.hierarchical`): the node's reduce-scatter of
  every layer's padded shards, the allgather between nodes of the shards'
  chunks (an allreduce of the dense shards), and the node's allgather of the
  shards.

Each is run once untimed and then :data:`REPEATS` times; the fastest counts
(a probe is noisy upwards only). The times are averaged over every rank of the
job, so every rank makes the same choice. Selection and packing are not
timed: with two levels each rank selects ``1 / L`` of the elements, so the
choice leans, if anything, towards flat.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence, Tuple

from ..backend import ArrayOps
from ..config import SparsityConfig
from ..wire import plan_layers

__all__ = ["REPEATS", "TopologyProbe", "node_ranks", "probe_topology", "several_nodes", "strays"]

logger = logging.getLogger(__name__)

#: Timed runs of each exchange's collectives (after one untimed run).
REPEATS = 2
#: A step far past any warm-up: the density the exchange settles at.
_STEADY = 10**9


@dataclass(frozen=True)
class TopologyProbe:
    """What :func:`probe_topology` measured: seconds per step of each
    exchange's collectives (averaged over every rank), and the choice."""

    flat: float
    hierarchical: float
    elements: int

    @property
    def choice(self) -> str:
        """``"hierarchical"`` where it measured faster, else ``"flat"``."""
        return "hierarchical" if self.hierarchical < self.flat else "flat"

    def describe(self) -> str:
        return (
            f"topology='auto' chose {self.choice}: the collectives of one step measured "
            f"{1e3 * self.flat:.1f} ms flat, {1e3 * self.hierarchical:.1f} ms on two levels "
            f"({self.elements} elements, fastest of {REPEATS}, mean over ranks)"
        )


def _message_words(sizes: Sequence[int], config: SparsityConfig) -> tuple:
    """(int32 words of the sparse layers' chunks, float32 elements of the
    dense layers) for layers of ``sizes`` at the steady density."""
    plans = plan_layers(sizes, config.density_at(_STEADY), config)
    sparse = sum(p.sparse_bytes for p in plans if p.sparse) // 4
    dense = sum(p.numel for p in plans if not p.sparse)
    return max(1, sparse), dense


def probe_topology(
    ops: ArrayOps,
    world: Any,
    node: Any,
    cross: Any,
    sizes: Sequence[int],
    config: SparsityConfig,
    like: Any,
    prefix: str = "dlgs",
) -> TopologyProbe:
    """Time one step's collectives of the flat and the two-level exchange of
    layers of ``sizes`` (see the module). ``world``, ``cross``: collectives
    with ``allgather_async``, ``allreduce_async``, ``synchronize`` (and
    ``world.allgather_object``); ``node``: a
    :class:`~dlgs.core.transport.hierarchical.NodeCollectives`. Collectives on every
    rank of the job, in the same order."""
    local = node.size
    shards = [max(1, -(-int(n) // local)) for n in sizes]
    flat_words, flat_dense = _message_words(sizes, config)
    cross_words, cross_dense = _message_words(shards, config)
    width = sum(shards)
    flat_chunk = ops.zeros(flat_words, "int32", like)
    flat_full = ops.zeros(max(1, flat_dense), "float32", like)
    node_send = ops.zeros(local * width, "float32", like)
    node_shard = ops.zeros(width, "float32", like)
    cross_chunk = ops.zeros(cross_words, "int32", like)
    cross_full = ops.zeros(max(1, cross_dense), "float32", like)

    def flat(tag: str) -> None:
        handles = [world.allgather_async(flat_chunk, f"{prefix}.probe.flat.{tag}")]
        if flat_dense:
            handles.append(world.allreduce_async(flat_full, f"{prefix}.probe.flatd.{tag}"))
        for h in handles:
            world.synchronize(h)

    def two_levels(tag: str) -> None:
        node.synchronize(node.reducescatter_async(node_send, f"{prefix}.probe.rs.{tag}"))
        handles = [cross.allgather_async(cross_chunk, f"{prefix}.probe.x.{tag}")]
        if cross_dense:
            handles.append(cross.allreduce_async(cross_full, f"{prefix}.probe.xd.{tag}"))
        for h in handles:
            cross.synchronize(h)
        node.synchronize(node.allgather_async(node_shard, f"{prefix}.probe.ag.{tag}"))

    times: Dict[str, float] = {}
    runs: List[tuple] = [("flat", flat), ("hierarchical", two_levels)]
    for name, run in runs:
        times[name] = _fastest(run, name)
    gathered = world.allgather_object((times["flat"], times["hierarchical"]), f"{prefix}.probe")
    probe = TopologyProbe(
        flat=sum(f for f, _ in gathered) / len(gathered),
        hierarchical=sum(h for _, h in gathered) / len(gathered),
        elements=sum(int(n) for n in sizes),
    )
    logger.info("dlgs: %s", probe.describe())
    return probe


def _fastest(run: Callable[[str], None], name: str) -> float:
    run(f"{name}.warm")
    best = float("inf")
    for r in range(REPEATS):
        t0 = time.perf_counter()
        run(f"{name}.{r}")
        best = min(best, time.perf_counter() - t0)
    return best


# -- which ranks form the two levels (every framework's doors) -------------------


def several_nodes(size: int, local: int) -> bool:
    """Whether ``size`` ranks at ``local`` per node make at least 2 nodes of
    at least 2 ranks each, the same number on every node (what the two-level
    exchange needs; ``topology="auto"`` stays flat otherwise)."""
    return local >= 2 and size % local == 0 and size // local >= 2


def node_ranks(size: int, local: int) -> Tuple[List[List[int]], List[List[int]]]:
    """The ranks of each node (``local`` consecutive ranks) and of each
    cross-node set (the ranks with the same local rank, one per node);
    ``ValueError`` where :func:`several_nodes` does not hold."""
    if not several_nodes(size, local):
        raise ValueError(
            f"topology='hierarchical' needs at least 2 nodes of at least 2 ranks each, "
            f"the same number on every node: {size} ranks with {local} per node "
            "(give ranks_per_node, or use topology='flat')"
        )
    nodes = [list(range(n * local, (n + 1) * local)) for n in range(size // local)]
    return nodes, [list(range(j, size, local)) for j in range(local)]


def strays(laid: Sequence[Tuple[int, Tuple[int, int, int]]], local: int) -> List[int]:
    """The ranks not laid out node by node: ``laid`` holds every rank's
    ``(rank, (local rank, local size, node index))`` as its launcher says."""
    return [r for r, (lr, ls, node) in laid if ls != local or r != node * local + lr]
