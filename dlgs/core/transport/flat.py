"""How a step's sparse messages travel between ranks and come back summed.

The exchange selects and packs each sparse message into a chunk
(:class:`dlgs.core.wire.GroupLayout`); a transport moves the chunks and
unpacks what arrives into each member layer's reduced gradient. A new way of
moving bytes (across the levels of a cluster, a sparse reduction) is another
class with this interface, not a branch in the exchange.

:class:`FlatTransport` is the seed's: one allgather of every rank's chunk per
message over the whole process set, every message of the step unpacked
together into one receive buffer.
"""

from __future__ import annotations

from typing import Any, List, Protocol, Sequence

from ..backend import ArrayOps
from ..config import SparsityConfig, ValueDType
from ..wire import DevicePart, GroupLayout, UnpackPlan, unpack

__all__ = ["FlatTransport", "Transport", "MAX_MESSAGE_ELEMENTS"]

#: Most elements (with padding slots) one message may index: indices are int32.
MAX_MESSAGE_ELEMENTS = 2**31 - 1


class Transport(Protocol):
    """Moves the step's sparse messages and unpacks them.

    Every rank of the process set calls the same methods in the same order
    with the same layouts (the exchange's layout is agreed across ranks), so
    the collectives a transport issues match on every rank."""

    #: Short name, for logs and reports.
    name: str

    def layout(self, layouts: Sequence[GroupLayout], like: Any) -> List[List[Any]]:
        """Make the receive buffers for the sparse messages ``layouts`` (in
        message order); return each message's member outputs (views that the
        step's unpack fills; valid until the next step's)."""

    def start(self, message: int, chunk: Any, name: str) -> Any:
        """Start moving sparse message ``message``'s packed chunk (its
        position in :meth:`layout`'s list); return a handle."""

    def finish(self, handles: Sequence[Any], verify: Sequence[bool], scale: Any) -> Any:
        """Complete the step's messages (handles in message order), check them
        (fully where ``verify``), and unpack every member's sum over the ranks
        times ``scale`` into its output; a member non-finite on some rank reads
        NaN. Returns the members' non-finite flags (device bools, message
        order), also :attr:`bad`."""

    def own_counts(self, words: Any, rank: int, size: int) -> Any:
        """This rank's count words (one per sparse member, message order) from
        the host copy of :attr:`counts`."""

    def message_bytes(self, layout: GroupLayout) -> int:
        """Bytes this rank puts into the collectives of a sparse message of
        ``layout`` per step (at capacity; pure arithmetic)."""

    def state(self) -> Any:
        """What every rank holds alike and a resumed run needs to go on as the
        uninterrupted one would (plain data, None where nothing): saved with
        the exchange's shared state."""

    def load_state(self, state: Any) -> None:
        """Put a :meth:`state` in force from the next :meth:`layout` of the
        same messages on (ignored where they differ)."""

    def returned(self) -> List[List[Any]]:
        """After :meth:`finish`: per message, per member, what goes back into
        the member's residual this step (``n`` elements; empty where nothing
        ever does, as with the allgather)."""

    #: The last step's count words (device int32, -1 where a member was
    #: non-finite; the step was finite everywhere exactly when none is
    #: negative): :class:`FlatTransport`'s are every rank's, rank-major; None
    #: before the first step.
    counts: Any
    #: The last step's per-member non-finite flags (see :meth:`finish`).
    bad: Any


class FlatTransport:
    """One allgather per message over the process set; the step's messages
    unpacked together (:func:`dlgs.core.wire.unpack`): one concatenation of
    the gathered chunks, two gathers, one scatter-add per rank row that also
    scales, whatever the number of messages."""

    name = "flat"

    def __init__(self, ops: ArrayOps, comm: Any, value_dtype: ValueDType):
        self.ops = ops
        self.comm = comm
        self.value_dtype = value_dtype
        self.layouts: List[GroupLayout] = []
        self.dense: Any = None  # the receive buffer of every sparse member
        self.parts: List[DevicePart] = []
        self.counts_at: Any = None
        self.counts_out: Any = None
        self.firsts: Any = None
        self.counts: Any = None
        self.bad: Any = None

    def layout(self, layouts: Sequence[GroupLayout], like: Any) -> List[List[Any]]:
        ops = self.ops
        self.layouts = list(layouts)
        self.counts = self.bad = None
        if not layouts:
            self.dense = None
            return []
        plan = UnpackPlan.of(self.layouts, self.comm.size)
        self.dense = ops.zeros(plan.dense_size, "float32", like)
        wide = "int64" if plan.dense_size > MAX_MESSAGE_ELEMENTS else "int32"
        self.parts = [DevicePart(ops, part, self.value_dtype, wide, like) for part in plan.parts]
        self.counts_at = ops.index_vector(plan.counts, like)
        self.counts_out = ops.zeros(len(plan.counts), "int32", like) if ops.reuses_outputs else None
        self.firsts = ops.index_vector(plan.firsts, like)
        return [
            [
                ops.narrow(self.dense, 0, base + layout.dense_offset(m), n)
                for m, n in enumerate(layout.sizes)
            ]
            for layout, base in zip(self.layouts, plan.bases)
        ]

    def start(self, message: int, chunk: Any, name: str) -> Any:
        return self.comm.allgather_async(chunk, name)

    def own_counts(self, words: Any, rank: int, size: int) -> Any:
        return words.reshape(size, -1)[rank]

    def returned(self) -> List[List[Any]]:
        return []  # an allgather sends every selected value

    def message_bytes(self, layout: GroupLayout) -> int:
        return 4 * layout.chunk_words

    def state(self) -> Any:
        return None

    def load_state(self, state: Any) -> None:
        pass

    def finish(self, handles: Sequence[Any], verify: Sequence[bool], scale: Any) -> Any:
        ops = self.ops
        gathered = []
        for handle, layout, full in zip(handles, self.layouts, verify):
            words = self.comm.synchronize(handle)
            layout.check_gathered(ops, words, self.comm.size, verify=full)
            gathered.append(words)
        words = gathered[0] if len(gathered) == 1 else ops.concat(gathered)
        ops.mul_(self.dense, 0.0)
        self.counts, self.bad = unpack(
            ops,
            words,
            self.comm.size,
            self.value_dtype,
            self.dense,
            scale,
            self.parts,
            self.counts_at,
            self.counts_out,
        )
        # Members non-finite on some rank read NaN on every rank.
        ops.nan_at_(self.dense, self.firsts, self.bad)
        return self.bad


def make_transport(config: SparsityConfig, ops: ArrayOps, comm: Any) -> Transport:
    """The transport of ``config.transport``: ``"allgather"``
    (:class:`FlatTransport`), ``"reduce"``
    (:class:`~dlgs.core.transport.reduction.ReducingTransport`, which needs the
    collectives' ``alltoall_async``) or ``"auto"``
    (:class:`~dlgs.core.transport.routing.RoutingTransport`: each message by either;
    the allgather alone where the collectives have no alltoall), in
    ``config``'s wire formats."""
    kind = config.transport
    if kind not in ("allgather", "reduce", "auto"):
        raise ValueError(f"transport must be 'allgather', 'reduce' or 'auto', got {kind!r}")
    flat = FlatTransport(ops, comm, config.value_dtype)
    can_reduce = callable(getattr(comm, "alltoall_async", None))
    if kind == "allgather" or (kind == "auto" and not can_reduce):
        return flat
    if not can_reduce:
        raise ValueError(
            "transport='reduce' needs an alltoall, which this framework's collectives "
            "lack so far (PyTorch only); use transport='allgather' or 'auto'"
        )
    # Both build on this module's protocol.
    from .reduction import ReducingTransport
    from .routing import RoutingTransport

    width = config.reduce_width
    reducing = ReducingTransport(ops, comm, config.value_dtype, width, config.index_coding)
    if kind == "reduce":
        return reducing
    return RoutingTransport(ops, comm, flat, reducing, width)
