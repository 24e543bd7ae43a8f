"""Read-only views of a :class:`~dlgs.core.exchange.exchange.SparseExchange`'s layers
and messages, for the planner, ``describe()``, statistics, checks and tests.

The exchange's own per-layer and per-message records are mutable and
private; what others may read about them is here, live (a view reads its
record's current state) and without setters. A tensor a view returns (a
residual, a send buffer) is the exchange's own buffer: read it, never write
it.
"""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional

from ..wire import GroupLayout, LayerPlan, dense_itemsize

__all__ = ["LayerInfo", "MessageInfo", "layer_stats", "log_stats"]


class LayerInfo:
    """One layer of an exchange, as the exchange holds it now.

    Attributes (read-only):
        name: the layer's name, as handed to the exchange.
        numel: its element count.
        index: its position in the exchange's layers.
        plan: its :class:`~dlgs.core.wire.LayerPlan` in the layout in force
            (None before the first step).
        message: the index of the message (:class:`MessageInfo`) that carries
            it (-1 before the first step).
        sparse: whether it travels sparse in the layout in force.
        residual: its error-feedback residual (``numel + 1`` float32, the last
            element the padding slot), or None where it has none.
        velocity: its momentum-correction velocity, or None.
        controller_state: its threshold controller's state (a read-only
            mapping of the controller's keys).
        count: a sparse layer's count of ``|a| >= theta`` in the last step (a
            0-d device tensor), or None.
        threshold: the threshold ``theta`` of its last step (0-d), or None.
    """

    __slots__ = ("_record", "_messages", "index")

    def __init__(self, record: Any, messages: Any, index: int):
        self._record = record
        self._messages = messages  # the exchange's message list, read live
        self.index = index

    @property
    def name(self) -> str:
        return self._record.name

    @property
    def numel(self) -> int:
        return self._record.numel

    @property
    def plan(self) -> Optional[LayerPlan]:
        return self._record.plan

    @property
    def message(self) -> int:
        return self._record.group

    @property
    def sparse(self) -> bool:
        group = self._record.group
        return group >= 0 and self._messages()[group].sparse

    @property
    def residual(self) -> Any:
        return self._record.residual

    @property
    def velocity(self) -> Any:
        return self._record.velocity

    @property
    def controller_state(self) -> Mapping[str, Any]:
        return MappingProxyType(self._record.ctrl)

    @property
    def count(self) -> Any:
        return self._record.count

    @property
    def threshold(self) -> Any:
        return self._record.theta

    def __repr__(self) -> str:
        mode = "sparse" if self.sparse else "dense"
        return f"LayerInfo({self.name!r}, numel={self.numel}, {mode}, message={self.message})"


class MessageInfo:
    """One message of an exchange's layout in force.

    Attributes (read-only):
        index: its position in the exchange's messages.
        name: the collective's tensor name.
        members: the indices of the layers it carries, in order (a new list).
        sparse: an allgather of a packed chunk (True) or an allreduce (False).
        layout: a sparse message's :class:`~dlgs.core.wire.GroupLayout`.
        chunk: a sparse message's send buffer (int32 words) after the last
            step's packing.
    """

    __slots__ = ("_record", "index")

    def __init__(self, record: Any, index: int):
        self._record = record
        self.index = index

    @property
    def name(self) -> str:
        return self._record.name

    @property
    def members(self) -> List[int]:
        return list(self._record.members)  # a copy: the view stays read-only

    @property
    def sparse(self) -> bool:
        return self._record.sparse

    @property
    def layout(self) -> Optional[GroupLayout]:
        return self._record.layout

    @property
    def chunk(self) -> Any:
        return self._record.chunk

    def __repr__(self) -> str:
        mode = "sparse" if self.sparse else "dense"
        return f"MessageInfo({self.name!r}, {mode}, members={list(self.members)})"


def layer_stats(exchange: Any) -> List[Dict[str, Any]]:
    """:meth:`SparseExchange.stats <dlgs.core.exchange.exchange.SparseExchange.stats>`
    from the exchange's views (reads the counts and thresholds on the host)."""
    ops = exchange.ops
    rows = []
    itemsize = dense_itemsize(exchange.config)
    for layer in exchange.layers:
        plan = layer.plan
        if plan is None:
            continue
        sparse = layer.sparse
        row: Dict[str, Any] = {
            "name": layer.name,
            "numel": layer.numel,
            "sparse": sparse,
            "k": plan.k,
            "capacity": plan.capacity,
            # This rank's contribution: count word, values and indices, or the
            # gradient in the dense dtype (before any Horovod compression).
            "wire_bytes": plan.wire_bytes if sparse else itemsize * layer.numel,
            "message": layer.message,
            "message_bytes": exchange.message_bytes(exchange.groups[layer.message]),
        }
        if sparse and layer.count is not None:
            selected = int(ops.to_host(layer.count))
            row.update(
                selected=selected,
                sent=min(selected, plan.capacity),
                density=selected / layer.numel,
                threshold=float(ops.to_host(layer.threshold)),
            )
        rows.append(row)
    return rows


def log_stats(exchange: Any, log: logging.Logger, level: int = logging.INFO):
    """Per-layer statistics of ``exchange``'s last step (``exchange.stats()``,
    which synchronises), also written to ``log`` for every sparse layer."""
    rows = exchange.stats()
    if log.isEnabledFor(level):
        for row in rows:
            if row["sparse"] and "selected" in row:
                log.log(
                    level,
                    "step %d %s: selected %d of %d (density %.4g, target %d), threshold %.3g, "
                    "%d bytes",
                    exchange.step,
                    row["name"],
                    row["selected"],
                    row["numel"],
                    row["density"],
                    row["k"],
                    row["threshold"],
                    row["wire_bytes"],
                )
    return rows
