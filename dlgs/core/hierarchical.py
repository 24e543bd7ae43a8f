"""The two-level exchange: dense inside a node, sparse between nodes.

A cluster is ``N`` nodes of ``L`` ranks: fast links inside a node, a slow
network between nodes. The flat exchange makes every rank allgather every
other rank's selection, so each node's link carries all ``L`` of its ranks'
selections and each rank receives ``(P - 1) k`` values. Here, per step and
per layer of ``n`` elements:

1. **inside the node**, a dense reduce-scatter (average) of the gradient over
   the node's ``L`` ranks: local rank ``l`` gets shard ``l`` (``m = ceil(n /
   L)`` elements, zero-padded) of the node's mean gradient;
2. **between nodes**, the flat exchange of the shards
   (:class:`~dlgs.core.exchange.SparseExchange` over the cross set: the ranks
   of local rank ``l`` on every node): each rank keeps the error-feedback
   residual of its shard, selects the shard's share of ``k`` (``density``
   applies per shard), and allgathers it sparse with its ``N - 1`` peers, so
   each node's link carries ``L`` selections of ``k / L``: one layer's worth,
   not ``L``; merge groups, dense layers, loss scaling, momentum correction
   and non-finite handling are the flat exchange's own;
3. **inside the node**, a dense allgather of the shards' results gives every
   rank the whole layer's mean.

Everything the flat exchange guarantees holds per shard: what a rank sent
plus its shard's residual is what it accumulated; a k-sparse node mean (at
most ``k / L`` non-zeros per shard) comes back exactly; every rank holds the
same bits (each shard's result is computed alike by the ``N`` ranks that own
it, then copied). A non-finite gradient anywhere makes the step non-finite on
every rank: a shard's result reads NaN on the ranks that own it, and the
gathered layer then on every rank of the node; each rank checks the gathered
layers before it keeps any state.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from .backend import ArrayOps
from .config import SparsityConfig
from .exchange import Collectives, SparseExchange

__all__ = ["HierarchicalExchange", "NodeCollectives", "shard_size"]


class NodeCollectives(Protocol):
    """Collectives among the ranks of this rank's node (its local ranks)."""

    size: int
    rank: int

    def reducescatter_async(self, tensor: Any, name: str) -> Any:
        """Start an average over the node of a 1-D tensor of ``size`` equal
        blocks; this rank receives block ``rank``. Return a handle."""

    def allgather_async(self, tensor: Any, name: str) -> Any:
        """Start an allgather of equal 1-D tensors, in local rank order."""

    def synchronize(self, handle: Any) -> Any:
        """Wait for a handle and return the collective's output tensor."""


def shard_size(n: int, local_size: int) -> int:
    """Elements of each local rank's shard of a layer of ``n`` (the last
    shards padded with zeros)."""
    return max(1, math.ceil(n / local_size))


class HierarchicalExchange:
    """:class:`SparseExchange`'s protocol (``submit``, ``wait``, ``finish``,
    ``state_dict``) over two levels.

    Args:
        ops: the framework's array operations.
        node: collectives among this node's ranks (:class:`NodeCollectives`).
        cross: collectives among the ranks of this local rank on every node
            (the flat exchange's, :class:`~dlgs.core.exchange.Collectives`).
        world: collectives on every rank of the job, where the step, plan and
            density are agreed after a checkpoint load (one small gather at
            the first gradient after construction or a load); None: ``cross``.
        config, layers, prefix, clock, loss_scale: as for
            :class:`SparseExchange` (``layers`` the whole model's; each rank
            exchanges its shard of every layer).
    """

    def __init__(
        self,
        ops: ArrayOps,
        node: NodeCollectives,
        cross: Collectives,
        config: SparsityConfig,
        layers: Sequence[Tuple[str, int]],
        *,
        world: Optional[Collectives] = None,
        prefix: str = "dlgs",
        loss_scale: Optional[Callable[[], Any]] = None,
        **kwargs: Any,
    ):
        self.ops = ops
        self.node = node
        self.prefix = prefix
        self.names = [name for name, _ in layers]
        self.sizes = [int(n) for _, n in layers]
        local = node.size
        self.shards = [shard_size(n, local) for n in self.sizes]
        # The flat exchange of this rank's shards across the nodes.
        self.inner = SparseExchange(
            ops,
            cross,
            config,
            [(name, m) for name, m in zip(self.names, self.shards)],
            prefix=f"{prefix}.x",
            loss_scale=loss_scale,
            agree=world,
            **kwargs,
        )
        self._send: List[Any] = [None] * len(layers)  # L * m per layer, zero-padded
        self._scatter: Dict[int, Any] = {}
        self._outputs: Dict[int, Any] = {}

    def __getattr__(self, name: str) -> Any:
        # What is not two-level reads the exchange between nodes: its layers
        # (this rank's shards, named as the layers), layout, statistics, step,
        # verdicts and step hooks (a merge planner plans the shards' messages).
        if name == "inner":  # not set yet: construction failed
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def loss_scale(self) -> Optional[Callable[[], Any]]:
        return self.inner.loss_scale

    @loss_scale.setter
    def loss_scale(self, reader: Optional[Callable[[], Any]]) -> None:
        self.inner.loss_scale = reader

    def pending(self) -> List[int]:
        """Layers not yet submitted this step."""
        return [i for i in range(len(self.sizes)) if i not in self._scatter]

    def submit(self, i: int, grad: Any) -> None:
        """Hand in layer ``i``'s gradient: starts its reduce-scatter in the node."""
        ops = self.ops
        n = self.sizes[i]
        if ops.numel(grad) != n:
            raise ValueError(
                f"gradient of {self.names[i]!r} has {ops.numel(grad)} elements, expected {n}"
            )
        if i in self._scatter:
            raise RuntimeError(f"gradient of {self.names[i]!r} submitted twice in one step")
        buf = self._send[i]
        if buf is None:
            buf = self._send[i] = ops.zeros(self.node.size * self.shards[i], "float32", grad)
        ops.copy_(ops.narrow(buf, 0, 0, n), grad)
        self._scatter[i] = self.node.reducescatter_async(buf, f"{self.prefix}.rs.{self.names[i]}")

    def wait(self) -> Dict[int, Any]:
        """Complete the step: each layer's shard through the exchange between
        nodes, then the node's allgather. Returns each layer's mean gradient
        (flat, ``n`` elements)."""
        missing = [self.names[i] for i in range(len(self.sizes)) if i not in self._scatter]
        if missing:
            raise RuntimeError(f"wait() before every layer was submitted; missing {missing[:5]}")
        ops = self.ops
        for i in range(len(self.sizes)):
            shard = self.node.synchronize(self._scatter.pop(i))
            self.inner.submit(i, shard)
        results = self.inner.wait(finish=False)
        handles = {
            i: self.node.allgather_async(results[i], f"{self.prefix}.ag.{self.names[i]}")
            for i in range(len(self.sizes))
        }
        out = {}
        for i, handle in handles.items():
            full = self.node.synchronize(handle)
            out[i] = ops.narrow(ops.reshape(full, (-1,)), 0, 0, self.sizes[i])
        # The other shards' verdicts arrive with their results (NaN where some
        # rank was non-finite): checked with this rank's own before any state
        # is kept, so every rank of the node decides the same.
        self.inner.finish(external=list(out.items()))
        self._outputs = out
        return out

    def state_dict(self) -> Dict[str, Any]:
        """This rank's shard residuals and controller states (the flat
        exchange's, tagged with the topology)."""
        return {
            "topology": [self.node.size, self.inner.comm.size],
            "node_rank": self.node.rank,
            "exchange": self.inner.state_dict(),
        }

    def check_state_dict(self, state: Any) -> Tuple[bool, List[str]]:
        """Validate a :meth:`state_dict` without changing anything: saved on
        this topology (elsewhere its shards are other slices of the layers: a
        ``ValueError`` says so) and valid for the exchange between nodes.
        Returns whether it is this rank's own and the options that restart
        the thresholds."""
        if not isinstance(state, dict) or "exchange" not in state:
            raise ValueError(
                "dlgs state is not a hierarchical exchange's (saved with topology='flat'?): "
                "load the optimizer state without its 'dlgs' entry to start the residuals afresh"
            )
        topology = [self.node.size, self.inner.comm.size]
        if state.get("topology") != topology:
            raise ValueError(
                f"dlgs state was saved with {state.get('topology')} (ranks per node, nodes); "
                f"this job runs {topology}: a hierarchical exchange's residuals are per shard "
                "and do not carry over; load the optimizer state without its 'dlgs' entry"
            )
        own, restart = self.inner.check_state_dict(self._as_inner(state))
        return own, restart

    def load_state_dict(self, state: Dict[str, Any], like: Any) -> None:
        """Restore a :meth:`state_dict` (checked first: :meth:`check_state_dict`).
        A state saved by another local rank holds other shards: as with the
        flat exchange's state of another rank, its residuals are reset (with
        a warning) and the rest is kept."""
        self.check_state_dict(state)
        self.inner.load_state_dict(self._as_inner(state), like)

    def _as_inner(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """The exchange between nodes' part of ``state``, not its own where
        another local rank saved it (its shards are other slices)."""
        inner = state["exchange"]
        if state.get("node_rank") != self.node.rank and isinstance(inner, dict):
            inner = dict(inner, rank=f"{inner.get('rank')} (local rank {state.get('node_rank')})")
        return inner
