"""The messages of the layout in force, with their buffers.

:func:`dlgs.core.planning.layout.plan_messages` says (purely) which layers travel
together, dense or sparse; :func:`lay_out` makes that answer real for an
exchange: every sparse layer's residual (and velocity) buffers, each message's
send buffer and member views, the transport's receive buffers and the
controllers' bank. Buffers a layer already has are kept, so a new layout
carries every residual over.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..backend import ArrayOps
from ..config import SparsityConfig
from ..planning.layout import MessageSpec, plan_messages
from ..selection.bank import ControllerBank
from ..selection.select import FusedSelection
from ..transport.flat import Transport
from ..wire import LayerPlan, dense_itemsize, plan_layers
from .records import LayerRecord, MessageRecord
from .sending import LayerSender
from .views import MessageInfo

__all__ = ["Messages", "bank_of", "lay_out", "lay_out_plan"]


class Messages:
    """One layout's messages (written by :func:`lay_out` only)."""

    __slots__ = (
        "records",
        "views",
        "sparse_members",
        "offsets",
        "modes",
        "bank",
        "version",
        "wire_bytes",
    )

    def __init__(
        self,
        records: Sequence[MessageRecord],
        sparse_members: Sequence[int],
        offsets: Dict[int, int],
        modes: Tuple[bool, ...],
        bank: Optional[ControllerBank],
        version: int,
        wire_bytes: Sequence[int],
    ):
        #: The messages, in the order their first layer is ready.
        self.records: Tuple[MessageRecord, ...] = tuple(records)
        #: Read-only live views of them, for users.
        self.views = tuple(MessageInfo(m, n) for n, m in enumerate(self.records))
        #: Sparse layers in the transport's member order (its flags and count words).
        self.sparse_members: Tuple[int, ...] = tuple(sparse_members)
        #: A merged dense message's member: its offset in the message (elements).
        self.offsets = offsets
        #: Per layer: sent sparse.
        self.modes = modes
        #: The sparse layers' controller state (transport member order), or None.
        self.bank = bank
        #: Increases with every layout (a step traced on the device is for one).
        self.version = version
        #: Per message: the bytes this rank puts into its collectives per step
        #: (sparse at capacity, with the fingerprint word; dense as float32).
        self.wire_bytes: Tuple[int, ...] = tuple(wire_bytes)

    def sparse(self, layer: LayerRecord) -> bool:
        """Whether ``layer`` travels in a sparse message in this layout."""
        return layer.group >= 0 and self.records[layer.group].sparse

    def tracks(self, layers: Sequence[LayerRecord], momentum: float) -> bool:
        """Whether a step under this layout changes state that a non-finite
        step must leave untouched (residuals, velocities, controllers): then
        its verdict is read at its end."""
        return bool(momentum) or any(
            m.sparse or any(layers[i].flush for i in m.members) for m in self.records
        )

    def learn(self, ops: ArrayOps, transport: Transport, words: Any, comm: Any) -> None:
        """The controllers learn from this rank's count words (read with the
        step's verdict; an anchor step adds one read), on the host."""
        if self.bank is not None:
            own = transport.own_counts(np.asarray(words, np.float64), comm.rank, comm.size)
            self.bank.update(ops, own)

    @staticmethod
    def arrived(message: MessageRecord) -> bool:
        """One more member of ``message`` is in; whether it was the last."""
        message.ready += 1
        return message.ready == len(message.members)

    def add_dense(
        self, ops: ArrayOps, comm: Any, message: MessageRecord, i: int, grad: Any
    ) -> None:
        """Layer ``i``'s dense gradient into ``message`` (cast to its 16-bit
        send buffer where it has one): its allreduce starts once every member
        is in (at once for a layer alone)."""
        send = message.dense if message.wire is None else message.wire
        if send is None:  # float32, alone: the gradient itself
            message.handle = comm.allreduce_async(grad, message.name)
            return
        ops.copy_(ops.narrow(send, 0, self.offsets[i], ops.numel(grad)), grad)
        if self.arrived(message):
            message.handle = comm.allreduce_async(send, message.name)

    @staticmethod
    def reduced_dense(ops: ArrayOps, comm: Any, message: MessageRecord, scale: Any) -> Any:
        """A dense message's allreduced tensor, in float32 (times ``scale``,
        unless None)."""
        reduced = comm.synchronize(message.handle)
        if message.wire is not None:
            ops.copy_(message.dense, reduced)
            reduced = message.dense
        return reduced if scale is None else ops.mul(reduced, scale)

    def members_of(
        self, ops: ArrayOps, message: MessageRecord, reduced: Any, layers: Sequence[LayerRecord]
    ) -> List[Tuple[int, Any]]:
        """``(layer index, its part of reduced)`` for a dense message's members."""
        if len(message.members) == 1:
            return [(message.members[0], reduced)]
        flat = ops.reshape(reduced, (-1,))
        return [(i, ops.narrow(flat, 0, self.offsets[i], layers[i].numel)) for i in message.members]


def bank_of(
    ops: ArrayOps, controller: Any, layers: Sequence[LayerRecord], members: Sequence[int]
) -> Optional[ControllerBank]:
    """The sparse layers' controller state in one bank, in the transport's
    member order (the step's count words arrive in it)."""
    chosen = [layers[i] for i in members]
    return ControllerBank.of(
        ops, controller, [la.ctrl for la in chosen], [_k(la.plan) for la in chosen]
    )


def _k(plan: Optional[LayerPlan]) -> int:
    assert plan is not None  # set by the layout
    return plan.k


def lay_out(
    ops: ArrayOps,
    config: SparsityConfig,
    controller: Any,
    layers: List[LayerRecord],
    plans: Sequence[LayerPlan],
    densities: Sequence[float],
    specs: Sequence[MessageSpec],
    transport: Transport,
    kernels: Optional[FusedSelection],
    like: Any,
    version: int,
    dense_dtype: str = "float32",
) -> Messages:
    """Allocate what ``specs`` need (buffers a layer has are kept) and lay
    the transport's receive buffers out for their sparse messages; dense
    messages get a send buffer of ``dense_dtype`` where it is 16-bit."""
    for layer in layers:
        layer.views.clear()
    sparse_layers = {i for m in specs if m.sparse for i in m.members}
    for i, (layer, plan) in enumerate(zip(layers, plans)):
        old = layer.plan
        layer.plan = plan
        layer.group = layer.member = -1
        if i in sparse_layers:
            if layer.residual is None:
                layer.residual = ops.zeros(layer.numel + 1, "float32", like)
            if layer.residual_next is None:
                layer.residual_next = ops.zeros(layer.numel + 1, "float32", like)
            if config.momentum and layer.velocity is None:
                layer.velocity = ops.zeros(layer.numel + 1, "float32", like)
            if old is None or old.k != plan.k or not layer.ctrl:
                layer.ctrl = controller.init_state(ops, like, densities[i])
            if kernels is not None and layer.work is None:
                layer.work = kernels.workspace(layer.numel, like)
        else:
            layer.residual_next = None  # a dense layer flushes its residual
        if config.momentum and layer.velocity is not None and layer.velocity_next is None:
            layer.velocity_next = ops.zeros(layer.numel + 1, "float32", like)
    records: List[MessageRecord] = []
    offsets: Dict[int, int] = {}
    for gi, spec in enumerate(specs):
        members = list(spec.members)
        message = MessageRecord(members, spec.sparse, spec.name)
        if spec.sparse:
            layout = spec.layout
            assert layout is not None
            message.layout = layout
            message.chunk = layout.new_chunk(ops, like)
            message.member_views = [
                layout.member_views(ops, message.chunk, m) for m in range(len(members))
            ]
        elif len(members) > 1 or dense_dtype != "float32":
            message.dense = ops.zeros(spec.size, "float32", like)
            if dense_dtype != "float32":
                message.wire = ops.zeros(spec.size, dense_dtype, like)
        for m, i in enumerate(members):
            layers[i].group, layers[i].member = gi, m
            if not spec.sparse:
                layers[i].ctrl = {}
                offsets[i] = spec.offsets[m]
        records.append(message)
    # The transport's receive buffers; each sparse member's output a view.
    sparse = [m for m in records if m.sparse]
    outputs = transport.layout([m.layout for m in sparse], like)  # type: ignore[misc]
    for position, (message, views) in enumerate(zip(sparse, outputs)):
        message.outputs, message.position = views, position
    members = [i for m in sparse for i in m.members]
    modes = tuple(i in sparse_layers for i in range(len(layers)))
    bank = bank_of(ops, controller, layers, members)
    itemsize = dense_itemsize(config)
    sizes = [
        transport.message_bytes(m.layout)
        if m.layout is not None
        else itemsize * sum(layers[i].numel for i in m.members)
        for m in records
    ]
    return Messages(records, members, offsets, modes, bank, version, sizes)


def lay_out_plan(
    ops: ArrayOps,
    config: SparsityConfig,
    controller: Any,
    layers: List[LayerRecord],
    densities: Sequence[float],
    plan: Any,
    transport: Transport,
    sender: LayerSender,
    like: Any,
    version: int,
    *,
    prefix: str,
    dense_alone: bool,
) -> Messages:
    """The messages of a merge ``plan`` (None: layer-wise) at ``densities``:
    :func:`~dlgs.core.planning.layout.plan_messages` says which layers travel
    together, :func:`lay_out` allocates them; ``sender`` sizes its scratch for
    the largest sparse layer. ``dense_alone``: dense layers are never merged
    (the caller reduces them)."""
    plans = plan_layers([layer.numel for layer in layers], densities, config)
    specs = plan_messages(
        plans,
        [layer.name for layer in layers],
        plan,
        prefix,
        config.value_dtype,
        config.index_coding,
        dense_alone=dense_alone,
        budgeted=config.budget is not None,
    )
    sparse = {i for m in specs if m.sparse for i in m.members}
    sender.prepare(max((plans[i].numel for i in sparse), default=0), like)
    return lay_out(
        ops,
        config,
        controller,
        layers,
        plans,
        densities,
        specs,
        transport,
        sender.kernels,
        like,
        version,
        # The caller reduces dense layers itself (and casts them): no buffer.
        "float32" if dense_alone else config.dense_dtype.value,
    )
