"""The two-level exchange: dense inside a node, sparse between nodes.

A cluster is ``N`` nodes of ``L`` ranks: fast links inside a node, a slow
network between nodes. The flat exchange makes every rank allgather every
other rank's selection, so each node's link carries all ``L`` of its ranks'
selections and each rank receives ``(P - 1) k`` values. Here, per step and
per layer of ``n`` elements:

1. **inside the node**, a dense reduce-scatter (average) of the gradient over
   the node's ``L`` ranks: local rank ``l`` gets shard ``l`` (``m = ceil(n /
   L)`` elements, zero-padded) of the node's mean gradient. Layers travel in
   *node buckets* of consecutive layers (in gradient-ready order, up to
   ``node_bucket_elements`` elements, :data:`NODE_BUCKET_ELEMENTS` by
   default): one reduce-scatter per bucket, started as soon as its last layer
   is in, as Horovod's tensor fusion would for an allreduce;
2. **between nodes**, the flat exchange of the shards
   (:class:`~dlgs.core.exchange.exchange.SparseExchange` over the cross set: the ranks
   of local rank ``l`` on every node): each rank keeps the error-feedback
   residual of its shard, selects the shard's share of ``k`` (``density``
   applies per shard), and allgathers it sparse with its ``N - 1`` peers, so
   each node's link carries ``L`` selections of ``k / L``: one layer's worth,
   not ``L``; merge groups, dense layers, loss scaling, momentum correction
   and non-finite handling are the flat exchange's own. A bucket's shards go
   in as soon as its reduce-scatter is seen complete (polled at each later
   gradient, never waited for during back-propagation), the rest at
   :meth:`~HierarchicalExchange.wait`;
3. **inside the node**, a dense allgather per bucket of the shards' results
   gives every rank each whole layer's mean.

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

import logging
import math
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from ..backend import ArrayOps
from ..config import SparsityConfig
from ..exchange.exchange import Collectives, SparseExchange

__all__ = [
    "NODE_BUCKET_ELEMENTS",
    "NODE_REDUCES",
    "HierarchicalExchange",
    "NodeCollectives",
    "shard_size",
]

logger = logging.getLogger(__name__)

#: How a node reduces its buckets: ``"reducescatter"`` (each rank receives
#: its shard: ``(L-1)/L`` of a bucket per rank on the node's links),
#: ``"allreduce"`` (each rank receives the whole node mean and keeps its
#: shard: twice the bytes, but some libraries' allreduce is faster than their
#: reduce-scatter), or ``"auto"``: timed once, on the first step, on the
#: node's ranks (see :meth:`HierarchicalExchange.probe_node_reduce`).
NODE_REDUCES = ("auto", "reducescatter", "allreduce")
#: Timed repetitions of each node reduction for ``node_reduce="auto"``.
PROBE_REPEATS = 3

#: Default size of a node bucket, in float32 elements of the padded layers
#: (16 MiB: a quarter of Horovod's default fusion buffer, so that the first
#: buckets start while back-propagation goes on).
NODE_BUCKET_ELEMENTS = 1 << 22


class NodeCollectives(Protocol):
    """Collectives among the ranks of this rank's node (its local ranks)."""

    size: int
    rank: int

    def reducescatter_async(self, tensor: Any, name: str) -> Any:
        """Start an average over the node of a 1-D tensor of ``size`` equal
        blocks; this rank receives block ``rank``. Return a handle."""

    def allgather_async(self, tensor: Any, name: str) -> Any:
        """Start an allgather of equal 1-D tensors, in local rank order."""

    def allreduce_async(self, tensor: Any, name: str) -> Any:
        """Start an average over the node of a 1-D tensor; every rank receives
        the whole result."""

    def synchronize(self, handle: Any) -> Any:
        """Wait for a handle and return the collective's output tensor."""

    def poll(self, handle: Any) -> bool:
        """Whether the handle's collective has completed (never blocks)."""


def shard_size(n: int, local_size: int) -> int:
    """Elements of each local rank's shard of a layer of ``n`` (the last
    shards padded with zeros)."""
    return max(1, math.ceil(n / local_size))


def _inner(name: str) -> Any:
    """A read-only member of the two-level exchange that is its inner
    exchange's ``name`` (a method comes bound to the inner exchange)."""
    return property(lambda self: getattr(self.inner, name), doc=f"The inner exchange's ``{name}``.")


class HierarchicalExchange:
    """:class:`SparseExchange`'s protocol (``submit``, ``wait``, ``finish``,
    ``state_dict``) over two levels.

    Args:
        ops: the framework's array operations.
        node: collectives among this node's ranks (:class:`NodeCollectives`).
        cross: collectives among the ranks of this local rank on every node
            (the flat exchange's, :class:`~dlgs.core.exchange.exchange.Collectives`).
        world: collectives on every rank of the job, where the step, plan and
            density are agreed after a checkpoint load (one small gather at
            the first gradient after construction or a load); None: ``cross``.
        config, layers, prefix, clock, loss_scale: as for
            :class:`SparseExchange` (``layers`` the whole model's, in
            gradient-ready order; each rank exchanges its shard of every layer).
        node_bucket_elements: the most elements (of ``L`` padded shards) one
            node bucket holds before the next begins; a larger layer is a
            bucket alone. Fewer, larger buckets start fewer collectives in the
            node; smaller ones start the first sooner in back-propagation.
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
        node_bucket_elements: int = NODE_BUCKET_ELEMENTS,
        node_reduce: str = "auto",
        **kwargs: Any,
    ):
        if node_reduce not in NODE_REDUCES:
            raise ValueError(
                f"node_reduce must be one of {', '.join(map(repr, NODE_REDUCES))}, "
                f"got {node_reduce!r}"
            )
        if isinstance(node_bucket_elements, bool) or not isinstance(node_bucket_elements, int):
            raise TypeError(
                f"node_bucket_elements must be an int >= 1, got {node_bucket_elements!r}"
            )
        if node_bucket_elements < 1:
            raise ValueError(f"node_bucket_elements must be >= 1, got {node_bucket_elements}")
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
            agree_group=node.rank,  # the cross-node set this rank is in
            **kwargs,
        )
        # Node buckets: consecutive layers; a layer's shard sits at offset
        # ``_offset[i]`` of its bucket's shard (``width[b]`` elements).
        self.buckets: List[List[int]] = []
        self._bucket_of: List[int] = []
        self._offset: List[int] = []
        width = 0
        for i, m in enumerate(self.shards):
            if not self.buckets or (width + m) * local > node_bucket_elements:
                self.buckets.append([])
                width = 0
            self.buckets[-1].append(i)
            self._bucket_of.append(len(self.buckets) - 1)
            self._offset.append(width)
            width += m
        self._width = [sum(self.shards[i] for i in members) for members in self.buckets]
        # Reused buffers, made at the first step (on the gradients' device).
        self._send: List[Any] = [None] * len(self.buckets)  # L x width, padding zero
        self._gather_send: List[Any] = [None] * len(self.buckets)  # width
        # Per layer, views made once (each new view is an operation): where
        # its gradient goes in the bucket (full rows, the partial last row),
        # where its result goes in the gather's send buffer, its L x m and
        # n-element views of its full buffer.
        self._into: List[Any] = [None] * len(layers)
        self._gather_into: List[Any] = [None] * len(layers)
        self._full_views: List[Any] = [None] * len(layers)
        # This step: layers in, per-bucket arrivals, reduce-scatters started
        # and not yet handed to the exchange between nodes.
        self._submitted: set = set()
        self._arrived = [0] * len(self.buckets)
        self._scatter: Dict[int, Any] = {}
        #: The node reduction in use (``"auto"`` until the first step's probe)
        #: and the probe's node-mean seconds per operation.
        self.node_reduce = node_reduce
        self.node_probe: Optional[Dict[str, float]] = None

    #: No step of the two-level exchange runs on the device alone.
    device = None
    #: It reduces every layer itself (dense ones between nodes too), so a door
    #: whose framework reduces dense layers (Horovod form (a)) hands them in.
    dense_external = False

    # What is not two-level reads the exchange between nodes: its layers
    # (this rank's shards, named as the layers), layout, statistics, step,
    # verdicts and step hooks (a merge planner plans the shards' messages).
    # Each is named here (the Exchange protocol's members), none forwarded
    # by a catch-all.
    comm = _inner("comm")
    config = _inner("config")
    step_hooks = _inner("step_hooks")
    last_step_finite = _inner("last_step_finite")
    nonfinite_steps = _inner("nonfinite_steps")
    step = _inner("step")
    layers = _inner("layers")
    groups = _inner("groups")
    density = _inner("density")
    densities = _inner("densities")
    auto_layers = _inner("auto_layers")
    last_step = _inner("last_step")
    stats = _inner("stats")
    message_bytes = _inner("message_bytes")
    wire_bytes = _inner("wire_bytes")
    dense_bytes = _inner("dense_bytes")
    resync = _inner("resync")
    request_host_step = _inner("request_host_step")

    @property
    def in_step(self) -> bool:
        return bool(self._submitted) or self.inner.in_step

    def abort_step(self) -> None:
        """Drop the step under way: the node buckets' arrivals (reduce-scatters
        started are left to complete unread) and the exchange between nodes'."""
        self._submitted.clear()
        self._arrived = [0] * len(self.buckets)
        self._scatter.clear()
        self.inner.abort_step()

    @property
    def loss_scale(self) -> Optional[Callable[[], Any]]:
        return self.inner.loss_scale

    @loss_scale.setter
    def loss_scale(self, reader: Optional[Callable[[], Any]]) -> None:
        self.inner.loss_scale = reader

    def probe_node_reduce(self, like: Any) -> str:
        """Choose the node reduction for ``node_reduce="auto"``: time
        :data:`PROBE_REPEATS` reduce-scatters and allreduces of the largest
        bucket (after one of each untimed) on this node's ranks, average the
        times over the node (so every rank of it chooses alike; nodes may
        choose differently) and keep the faster. Collectives on every rank of
        the node, in the same order: called at the first gradient of the
        first step on each. Returns the choice."""
        ops, node = self.ops, self.node
        buf = ops.zeros(node.size * max(self._width), "float32", like)
        seconds = {}
        for op in ("reducescatter", "allreduce"):
            start = node.reducescatter_async if op == "reducescatter" else node.allreduce_async
            node.synchronize(start(buf, f"{self.prefix}.probe.{op}.warm"))
            t0 = time.perf_counter()
            for r in range(PROBE_REPEATS):
                node.synchronize(start(buf, f"{self.prefix}.probe.{op}.{r}"))
            seconds[op] = (time.perf_counter() - t0) / PROBE_REPEATS
        zero = ops.zeros(1, "float32", like)
        times = ops.concat([ops.affine(zero, 1.0, seconds[op]) for op in seconds])
        agreed = ops.to_host(node.synchronize(node.allreduce_async(times, f"{self.prefix}.probe")))
        self.node_probe = {"reducescatter": float(agreed[0]), "allreduce": float(agreed[1])}
        self.node_reduce = min(self.node_probe, key=self.node_probe.__getitem__)
        logger.info(
            "dlgs: node reduction %s (%s elements: reduce-scatter %.1f ms, allreduce %.1f ms, "
            "node mean)",
            self.node_reduce,
            ops.numel(buf),
            1e3 * self.node_probe["reducescatter"],
            1e3 * self.node_probe["allreduce"],
        )
        return self.node_reduce

    def pending(self) -> List[int]:
        """Layers not yet submitted this step."""
        return [i for i in range(len(self.sizes)) if i not in self._submitted]

    def submit(self, i: int, grad: Any) -> None:
        """Hand in layer ``i``'s gradient: copied into its node bucket, whose
        reduce-scatter starts once every member is in; buckets whose
        reduce-scatter has completed go on to the exchange between nodes."""
        ops = self.ops
        n = self.sizes[i]
        if ops.numel(grad) != n:
            raise ValueError(
                f"gradient of {self.names[i]!r} has {ops.numel(grad)} elements, expected {n}"
            )
        if i in self._submitted:
            raise RuntimeError(f"gradient of {self.names[i]!r} submitted twice in one step")
        b = self._bucket_of[i]
        if self.node_reduce == "auto":
            self.probe_node_reduce(grad)
        if self._into[i] is None:
            self._into[i] = self._bucket_views(i, grad)
        # Shard l of the layer is row l of its column block: full rows, then
        # the last partial one (the padding stays zero from the start).
        rows, full, tail = self._into[i]
        m, whole = self.shards[i], 0
        flat = ops.reshape(grad, (-1,))
        if full is not None:
            whole = rows * m
            ops.write_columns_(full, rows, self._offset[i], m, ops.narrow(flat, 0, 0, whole))
        if tail is not None:
            ops.copy_(tail, ops.narrow(flat, 0, whole, n - whole))
        self._submitted.add(i)
        self._arrived[b] += 1
        if self._arrived[b] == len(self.buckets[b]):
            if self.node_reduce == "allreduce":
                start = self.node.allreduce_async
            else:
                start = self.node.reducescatter_async
            self._scatter[b] = start(self._send[b], f"{self.prefix}.rs.{b}")
        # Not while the next step's agreement is due: its blocking collective
        # would wait here, in back-propagation, for ranks still in theirs.
        if not self.inner.agreement.pending:
            for done in [c for c, h in self._scatter.items() if self.node.poll(h)]:
                self._forward(done)

    def _bucket_views(self, i: int, like: Any) -> Tuple[int, Any, Any]:
        """Layer ``i``'s places in its bucket's ``L x width`` send buffer
        (made at the first use): how many full rows it has, the buffer's
        first that many rows (None where there are none; its columns are
        written with ``write_columns_``) and the start of its partial last row
        (None where there is none). One-dimensional views only: where tensors
        are immutable a write into a reshaped view would be lost."""
        ops, local, b = self.ops, self.node.size, self._bucket_of[i]
        if self._send[b] is None:
            self._send[b] = ops.zeros(local * self._width[b], "float32", like)
        width, m, off = self._width[b], self.shards[i], self._offset[i]
        whole, rest = divmod(self.sizes[i], m)
        full = ops.narrow(self._send[b], 0, 0, whole * width) if whole else None
        tail = ops.narrow(self._send[b], 0, whole * width + off, rest) if rest else None
        return whole, full, tail

    def _forward(self, b: int) -> None:
        """Bucket ``b``'s reduced shard into the exchange between nodes."""
        shard = self.ops.reshape(self.node.synchronize(self._scatter.pop(b)), (-1,))
        if self.node_reduce == "allreduce":  # the whole node mean: this rank's row
            shard = self.ops.narrow(shard, 0, self.node.rank * self._width[b], self._width[b])
        for i in self.buckets[b]:
            self.inner.submit(i, self.ops.narrow(shard, 0, self._offset[i], self.shards[i]))

    def wait(self, finish: bool = True) -> Dict[int, Any]:
        """Complete the step: the remaining buckets through the exchange
        between nodes, then each bucket's allgather in the node. Returns each
        layer's mean gradient (flat, ``n`` elements; views into reused
        buffers, valid until the next step's :meth:`wait`). The step always
        ends here (``finish=False`` is refused)."""
        if not finish:
            raise ValueError("finish=False: the two-level exchange ends its own steps")
        missing = [self.names[i] for i in self.pending()]
        if missing:
            raise RuntimeError(f"wait() before every layer was submitted; missing {missing[:5]}")
        ops, local = self.ops, self.node.size
        for b in sorted(self._scatter):
            self._forward(b)
        results = self.inner.wait(finish=False)
        handles = []
        for b, members in enumerate(self.buckets):
            width = self._width[b]
            send = self._gather_send[b]
            if send is None:
                send = self._gather_send[b] = ops.zeros(width + 1, "float32", results[0])
            body = ops.narrow(send, 0, 0, width)
            for i in members:
                if self._gather_into[i] is None:
                    self._gather_into[i] = ops.narrow(body, 0, self._offset[i], self.shards[i])
                ops.copy_(self._gather_into[i], results[i])
            # One more element: inf where this rank's shards are non-finite
            # (they read NaN on every owner then), 1 otherwise; the node learns
            # every rank's verdict from it without a pass over the whole layers.
            bad = ops.cast(ops.any_nonfinite([body]), "float32")
            ops.copy_(ops.narrow(send, 0, width, 1), ops.reciprocal(ops.affine(bad, -1.0, 1.0)))
            handles.append(self.node.allgather_async(send, f"{self.prefix}.ag.{b}"))
        out = {}
        verdicts = []
        for b, handle in enumerate(handles):
            rows = ops.reshape(self.node.synchronize(handle), (local, self._width[b] + 1))
            verdicts.append(ops.narrow(rows, 1, self._width[b], 1))
            for i in self.buckets[b]:
                m = self.shards[i]
                if self._full_views[i] is None:
                    full = ops.zeros(local * m, "float32", results[0])
                    self._full_views[i] = (full, ops.narrow(full, 0, 0, self.sizes[i]))
                full, whole_layer = self._full_views[i]
                ops.copy_(full, ops.narrow(rows, 1, self._offset[i], m))  # local x m, row-major
                out[i] = whole_layer
        self._submitted.clear()
        self._arrived = [0] * len(self.buckets)
        # The other shards' verdicts arrive with their results: checked with
        # this rank's own before any state is kept, so every rank of the node
        # decides the same (the layers are read only to name them in a warning).
        self.inner.finish(external=list(out.items()), verdicts=verdicts)
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
