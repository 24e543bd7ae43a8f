"""A sparse allreduce by regions: what each rank sends does not grow with the
number of ranks (the scheme of Ok-Topk, Li and Hoefler, PPoPP'22).

The flat exchange allgathers every rank's selection: each rank receives
``(P - 1) k`` values. Here one sparse message of ``D`` elements is split into
``P`` contiguous *regions*, region ``r`` owned by rank ``r``, and a step is
two collectives of fixed-size blocks (no sizes to agree on, no host read):

1. **to the owners** (an alltoall): each rank sends the owner of each region
   the entries it selected there, at most ``send_width`` of them in index
   order, as ``(offset in the region, float32 value)``;
2. **at the owner**: the ``P`` blocks are summed into the region in rank
   order (the same bits on every rank that computes them), and its
   ``keep_width`` largest sums are kept (none below a threshold ``theta``,
   none zero; ties at the smallest kept magnitude in index order);
3. **to everyone** (an allgather): the owners' kept ``(index, sum)`` pairs;
   every rank assembles the same reduced message from them.

What a rank selected but did not send (past ``send_width`` in a region) or
sent but the owner did not keep goes back into that rank's residual
(:meth:`SparseReduction.return_unkept`), so per rank what it contributed to
the kept sums plus what it put back is exactly what it selected. Each rank
sends ``P`` blocks of ``send_width`` and receives ``P`` blocks of
``keep_width``: with ``send_width`` and ``keep_width`` about ``c k / P``,
about ``2 c k`` values per rank whatever ``P`` is.

A non-finite value anywhere makes the message non-finite on every rank: a
rank's blocks carry a flag word (-1), the owners pass it on in their count
word, and :meth:`SparseReduction.unpack` reports it.

Region bounds balance the entries selected per owner: every
``rebalance_every`` steps the ranks allgather how their selections fall into
bins of each message, and every rank cuts the same :func:`balanced_bounds`
from the sum (:class:`ReducingTransport`). The bounds are part of the state
every rank shares, so a resumed run goes on with them.

Values travel in the message's value dtype in both phases and offsets as 16
bits with block counts where smaller (:mod:`dlgs.core.transport.blocks`); what rounding
takes stays in a residual (a sender's values in its own, an owner's sums in
the owner's), so error feedback still loses nothing.
"""

from __future__ import annotations

import logging
import math
from typing import Any, List, Sequence, Tuple

import numpy as np

from ..backend import ArrayOps
from ..config import IndexCoding, ValueDType
from ..wire import FLOAT16_MAX, DevicePart, UnpackPlan
from .blocks import BlockFormat, block_words, compact_offsets, even_width

__all__ = [
    "ReducingTransport",
    "SparseReduction",
    "balanced_bounds",
    "block_width",
    "even_bounds",
    "reduction_bytes",
]

logger = logging.getLogger(__name__)

#: The smallest normal positive float32: ``theta`` is raised to it, so that a
#: zero sum is never kept. Not the smallest subnormal: frameworks that flush
#: subnormals to zero (TensorFlow on the CPU) would compare with 0 and keep
#: zeros. A subnormal sum is then not kept: it goes back into the residuals.
_TINY = math.ldexp(1.0, -126)


def block_width(width: float, capacity: int, parts: int) -> int:
    """Entries per block: ``width`` times a message's capacity over the ranks,
    at least one."""
    return max(1, math.ceil(width * capacity / parts))


def reduction_bytes(
    size: int,
    capacity: int,
    parts: int,
    width: float,
    value_dtype: ValueDType,
    coding: IndexCoding,
) -> Tuple[int, int]:
    """Bytes one rank puts into a message's two collectives per step: its
    ``parts`` blocks of the alltoall (``parts - 1`` of them cross its link)
    and its block of the allgather (each other rank receives it). Pure
    arithmetic, as :class:`ReducingTransport` lays the blocks out."""
    w = block_width(width, capacity, parts)
    return 4 * parts * block_words(w, size, value_dtype, coding), 4 * block_words(
        w, size, value_dtype, coding
    )


def even_bounds(size: int, parts: int) -> List[int]:
    """``parts + 1`` bounds cutting ``size`` elements into regions of equal
    size (the first ``size % parts`` one larger); every region non-empty."""
    if parts < 1 or size < parts:
        raise ValueError(f"cannot cut {size} elements into {parts} non-empty regions")
    q, r = divmod(size, parts)
    bounds = [0]
    for j in range(parts):
        bounds.append(bounds[-1] + q + (1 if j < r else 0))
    return bounds


def balanced_bounds(counts: Sequence[int], edges: Sequence[int], parts: int) -> List[int]:
    """Bounds of ``parts`` regions holding about equal shares of the entries
    counted in the bins ``[edges[i], edges[i + 1])`` (``counts[i]`` each), cut
    at bin edges; every region keeps at least one element. Pure and
    deterministic: ranks that hold the same counts compute the same bounds.
    With no entries counted, :func:`even_bounds`."""
    size = int(edges[-1])
    total = sum(int(c) for c in counts)
    if total == 0:
        return even_bounds(size, parts)
    bounds = [0]
    seen = 0
    for i, c in enumerate(counts):
        seen += int(c)
        # Cut after bin i for every share this bin completes.
        while len(bounds) < parts and seen * parts >= len(bounds) * total:
            cut = int(edges[i + 1])
            room = size - (parts - len(bounds))  # the regions still to come need an element each
            cut = min(max(cut, bounds[-1] + 1), room)
            bounds.append(cut)
            if cut >= int(edges[i + 1]):
                break
    while len(bounds) < parts:  # too few cuts (all entries in the last bins)
        bounds.append(min(bounds[-1] + 1, size - (parts - len(bounds))))
    bounds.append(size)
    return bounds


class SparseReduction:
    """One sparse message's reduction by regions, on one rank.

    Args:
        ops: the framework's array operations.
        size: the message's elements ``D``.
        parts: ranks ``P`` (one region each).
        rank: this rank (the owner of region ``rank``).
        send_width: entries a rank sends each owner per step at most.
        keep_width: entries an owner keeps per step at most.
        like: a tensor on the message's device.
        value_dtype: the values' dtype in both phases. With a 16-bit dtype
            what rounding takes goes back into a residual: a sender's into
            its own (:meth:`return_unkept`), an owner's rounding of its sums
            into the owner's.
        coding: the offsets' coding (:func:`~dlgs.core.transport.blocks.compact_offsets`):
            ``int32``, or 16-bit with block counts where smaller.

    Widths are rounded up to even where a part is 16-bit. Per step:
    :meth:`pack` this rank's selection into the alltoall's send buffer;
    :meth:`reduce` what it received into this rank's block for the
    allgather; :meth:`unpack` the gathered blocks into the reduced message;
    :meth:`return_unkept` into this rank's residual.
    """

    def __init__(
        self,
        ops: ArrayOps,
        size: int,
        parts: int,
        rank: int,
        send_width: int,
        keep_width: int,
        like: Any,
        value_dtype: ValueDType = ValueDType.FLOAT32,
        coding: IndexCoding = IndexCoding.INT32,
    ):
        if not 0 <= rank < parts:
            raise ValueError(f"rank must be in [0, {parts}), got {rank}")
        if send_width < 1 or keep_width < 1:
            raise ValueError(f"widths must be >= 1, got {send_width}, {keep_width}")
        value_dtype = ValueDType(value_dtype)
        self.ops, self.size, self.parts, self.rank = ops, size, parts, rank
        self.like, self.value_dtype = like, value_dtype
        # Offsets reach ``size`` (the kept entries' padding) at most.
        compact = compact_offsets(send_width, size, coding)
        send_width = even_width(send_width, value_dtype, compact)
        self.sending = BlockFormat(ops, parts, send_width, size, value_dtype, compact, like)
        compact = compact_offsets(keep_width, size, coding)
        keep_width = even_width(keep_width, value_dtype, compact)
        self.keeping = BlockFormat(ops, 1, keep_width, size, value_dtype, compact, like)
        self.gathered = BlockFormat(ops, parts, keep_width, size, value_dtype, compact, like)
        self.send_width, self.keep_width = send_width, keep_width
        #: int32 words per block sent to one owner, and of an owner's block.
        self.send_words, self.keep_words = self.sending.words, self.keeping.words
        self.send = ops.zeros(parts * self.send_words, "int32", like)
        self.block = ops.zeros(self.keep_words, "int32", like)
        self.out = ops.zeros(size + 1, "float32", like)  # the last slot: padding
        self.kept = ops.zeros(size + 1, "bool", like)
        self._none_kept = ops.zeros(size + 1, "bool", like)
        # Reused every step: phase 1's staging (one more slot: where unsent
        # entries land), the owner's region (at most the message, one more
        # slot: the padding), the gathered indices.
        cells = parts * send_width
        self._stage_idx = ops.zeros(cells + 1, "int32", like)
        self._stage_val = ops.zeros(cells + 1, "float32", like)
        self._wired = ops.zeros(cells + 1, "float32", like) if self.sending.narrow_values else None
        self._region_all = ops.zeros(size + 1, "float32", like)
        self._abs_all = ops.zeros(size + 1, "float32", like)
        self._mask_all = ops.zeros(size + 1, "bool", like)
        self._idx = ops.zeros(parts * keep_width, "int64", like)
        self._owner_err = ops.zeros(keep_width, "float32", like)
        self._owner_idx = ops.zeros(keep_width, "int32", like)
        self._pad = ops.index_vector([size], like)
        self.bounds: List[int] = []
        self.set_bounds(even_bounds(size, parts))
        self._slots: Any = None  # this step's pack(): each entry's slot
        self._sel_idx: Any = None
        self._sel_vals: Any = None
        self._sel_sent: Any = None
        self._owner_kept: Any = None

    # -- regions ----------------------------------------------------------------
    def set_bounds(self, bounds: Sequence[int]) -> None:
        """Put region bounds in force (``parts + 1`` ascending ints from 0 to
        ``size``, every region non-empty; the same on every rank)."""
        bounds = [int(b) for b in bounds]
        ok = len(bounds) == self.parts + 1 and bounds[0] == 0 and bounds[-1] == self.size
        if not ok or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(
                f"bounds must be {self.parts + 1} strictly ascending ints from 0 to "
                f"{self.size}, got {bounds[:8]}"
            )
        ops, like, kw = self.ops, self.like, self.keep_width
        self.bounds = bounds
        self._bounds = ops.index_vector(bounds, like)
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        self.region = hi - lo
        self._region = ops.narrow(self._region_all, 0, 0, self.region + 1)  # + padding slot
        self._mask = ops.narrow(self._mask_all, 0, 0, self.region + 1)
        self._abs = ops.narrow(self._abs_all, 0, 0, self.region + 1)
        self._region_pad = ops.index_vector([self.region], like)
        # Unused send slots point at each owner's padding slot (its region's size).
        self._send_pad = ops.index_vector(
            [bounds[r + 1] - bounds[r] for r in range(self.parts) for _ in range(self.send_width)],
            like,
        )
        # Kept-index padding: the message's padding slot, ``size``, once offset.
        self._keep_pad = ops.index_vector([self.size - lo] * kw, like)
        # Each owner's offsets back to message indices.
        self._starts = ops.index_vector(
            [bounds[r] for r in range(self.parts) for _ in range(kw)], like
        )

    # -- one step ---------------------------------------------------------------
    def pack(self, idx: Any, vals: Any, flag: Any) -> Any:
        """Phase 1's send buffer (``parts`` blocks): this rank's selected
        entries (``idx`` ascending message indices, padded with ``size``;
        ``vals`` float32) by region, and the flag word in each block (the
        selection's count, -1 where something was non-finite)."""
        ops, cells = self.ops, self.parts * self.send_width
        slots, local = ops.region_slots(idx, self._bounds, self.send_width)
        stage_idx, stage_val = self._stage_idx, ops.mul_(self._stage_val, 0.0)
        ops.copy_(ops.narrow(stage_idx, 0, 0, cells), self._send_pad)
        ops.scatter_(stage_idx, slots, local)
        ops.scatter_(stage_val, slots, vals)
        values = ops.narrow(stage_val, 0, 0, cells)
        if self.value_dtype is ValueDType.FLOAT16:
            values = ops.clamp(values, -FLOAT16_MAX, FLOAT16_MAX)
        written = self.sending.write(self.send, ops.narrow(stage_idx, 0, 0, cells), values, flag)
        sent = vals
        if self._wired is not None:  # each entry's value as sent (0 where not sent)
            ops.copy_(ops.narrow(self._wired, 0, 0, cells), written)
            sent = ops.take(self._wired, slots)
        self._slots, self._sel_idx, self._sel_vals, self._sel_sent = slots, idx, vals, sent
        return self.send

    def reduce(self, received: Any, theta: Any) -> Any:
        """Phase 2 at the owner: the ``parts`` blocks ``received`` (from rank
        0 up) summed into this rank's region in rank order; its ``keep_width``
        largest ``|sum|`` kept (none below ``theta``, none zero; ties at the
        smallest kept magnitude in index order). Returns this rank's block for
        the allgather (its count word: the sums at or above the magnitude
        kept)."""
        ops, parts, kw = self.ops, self.parts, self.keep_width
        offsets, values, flags = self.sending.read(received)
        region = ops.mul_(self._region, 0.0)
        ops.index_add_rows_(region, ops.cast(offsets, "int64"), values, 1.0, parts)
        # Results as returned: a framework may return a new tensor rather
        # than write the scratch buffer.
        absx = ops.abs_(region, self._abs)
        # The owner's share of a top-k: its keep_width largest sums (and none
        # below theta, none zero).
        kth = ops.kth_largest(ops.narrow(absx, 0, 0, self.region), min(kw, self.region))
        theta = ops.clamp(ops.kth_largest(ops.stack([theta, kth]), 1), _TINY, math.inf)
        mask = ops.fill_at_(ops.ge_(absx, theta, self._mask), self._region_pad, 0.0)
        count = ops.count_nonzero(mask)
        kept = ops.nonzero_static(mask, kw, self.region)
        exact = sums = ops.take(region, kept)
        if self.value_dtype is ValueDType.FLOAT16:
            sums = ops.clamp(sums, -FLOAT16_MAX, FLOAT16_MAX)
        bad = ops.any_negative_rows(flags, parts)
        local = ops.where_below(kept, self.region, self._keep_pad)
        word = ops.count_or_flag(count, _none(ops, bad))
        written = self.keeping.write(self.block, local, sums, word)
        self._owner_kept = None
        if written is not exact:
            # What clipping and rounding took from the sums stays with the
            # owner (its residual less written - sum).
            ops.scale_add_(ops.copy_(self._owner_err, exact), -1.0, written)
            self._owner_kept = ops.add_offset_(self._owner_idx, local, self.bounds[self.rank])
        return self.block

    def unpack(self, gathered: Any, scale: float) -> Tuple[Any, Any, Any]:
        """The reduced message from every owner's block (``gathered``, rank
        order): ``(out, counts, bad)``: ``out`` the message's ``size`` sums
        times ``scale`` (a view; its padding slot excluded), ``counts`` each
        owner's count word (its entries at or above ``theta``, -1 where some
        rank was non-finite), ``bad`` a 0-d bool. Marks the kept indices for
        :meth:`return_unkept`."""
        ops, parts = self.ops, self.parts
        offsets, values, counts = self.gathered.read(gathered)
        idx = ops.add_indices(offsets, self._starts, self._idx)
        out = ops.mul_(self.out, 0.0)
        ops.index_add_rows_(out, idx, values, scale, parts)
        kept = ops.copy_(self.kept, self._none_kept)
        ops.fill_at_(kept, idx, 1.0)
        ops.fill_at_(kept, self._pad, 0.0)
        bad = ops.any_negative_rows(counts, parts)
        return ops.narrow(out, 0, 0, self.size), counts, ops.any_true([bad])

    def return_unkept(self, residual: Any) -> Any:
        """Add back into ``residual`` (the message's ``size + 1`` residual
        slots, the last the padding) what this rank selected in the last
        :meth:`pack` but did not send or the owners did not keep, what
        rounding to the wire dtype took from what it sent, and (as an owner)
        what rounding took from the sums it kept."""
        ops = self.ops
        ops.add_unkept_(
            residual,
            self._sel_idx,
            self._sel_vals,
            self._sel_sent,
            self.kept,
            self._slots,
            self.parts * self.send_width,
        )
        if self._owner_kept is not None:
            ops.sub_at_(residual, ops.cast(self._owner_kept, "int64"), self._owner_err)
        return residual

    def selected_below(self, edges: Any, out: Any) -> Any:
        """How many entries of the last :meth:`pack`'s selection lie below each
        of ``edges`` (ascending), into the int32 ``out``."""
        return self.ops.count_below_(out, self._sel_idx, edges)


def _none(ops: ArrayOps, flags: Any) -> Any:
    """0-d bool: no element of the bool vector ``flags`` is true (``1 / (1 -
    any)`` is finite exactly then)."""
    some = ops.cast(ops.any_true([flags]), "float32")
    return ops.below_inf(ops.reciprocal(ops.affine(some, -1.0, 1.0)))


class ReducingTransport:
    """A :class:`~dlgs.core.transport.flat.Transport` that reduces each sparse
    message by regions (:class:`SparseReduction`) instead of allgathering it.

    :meth:`start` decodes this rank's own chunk (the exchange packed it as for
    the allgather: values in the wire dtype, indices in their coding), sends
    its entries to the regions' owners (an alltoall of fixed blocks) and
    returns; :meth:`finish` reduces at the owners, allgathers the kept
    entries and assembles every message, times ``scale``. What this rank
    selected but did not send or the owners did not keep is in
    :meth:`returned` afterwards, by member, for the exchange to add back into
    its residuals.

    Args:
        ops: the framework's array operations.
        comm: the collectives; they need ``alltoall_async(tensor, name)``
            (equal splits) and ``allgather_async``.
        value_dtype: the values' dtype on the wire, in both phases.
        width: each block's entries as a multiple of a message's capacity
            divided by the ranks: a rank sends ``P`` blocks and receives
            ``P`` blocks of about ``width * capacity / P`` entries, so its
            bytes do not grow with ``P``. Each owner keeps its largest sums,
            up to its block: its share of a top-k of ``width * capacity``.
        coding: the offsets' coding (int32, or 16-bit where smaller).
        rebalance_every: every this many steps of a layout (the first
            included) the ranks allgather how their selections fall into
            ``bins`` equal bins of each message, and every rank moves the
            region bounds so that each owner gets an equal share
            (:func:`balanced_bounds`; one host read then, none otherwise).
        bins: bins per region for the balance (at most the message's size).
    """

    name = "reduce"

    def __init__(
        self,
        ops: ArrayOps,
        comm: Any,
        value_dtype: Any,
        width: float = 1.25,
        coding: IndexCoding = IndexCoding.AUTO,
        rebalance_every: int = 100,
        bins: int = 64,
    ):
        if not width > 0:
            raise ValueError(f"width must be > 0, got {width}")
        if rebalance_every < 1 or bins < 1:
            raise ValueError(
                f"rebalance_every and bins must be >= 1, got {rebalance_every}, {bins}"
            )
        self.ops, self.comm, self.value_dtype, self.width = ops, comm, value_dtype, width
        self.coding, self.rebalance_every, self.bins = coding, rebalance_every, bins
        self.steps = 0  # steps of the current layout
        #: Region bounds moved so far, over the transport's life.
        self.rebalances = 0
        self._edges: List[Any] = []
        self._edges_host: List[List[int]] = []
        self._selected: Any = None
        self._selected_views: List[Any] = []
        self._pending: Any = None  # a loaded state(), for the next layout()
        self.layouts: List[Any] = []
        self.reductions: List[SparseReduction] = []
        self.counts: Any = None
        self.bad: Any = None
        self._own: List[Any] = []
        self._names: List[str] = []
        self._decoders: List[Tuple[Any, ...]] = []
        self._returns: List[Any] = []
        self._firsts: List[Any] = []
        self._returned: List[List[Any]] = []
        self._zero: Any = None

    def layout(self, layouts: Sequence[Any], like: Any) -> List[List[Any]]:
        ops, size, rank = self.ops, self.comm.size, self.comm.rank
        self.layouts = list(layouts)
        self.counts = self.bad = None
        self.reductions, self._decoders, self._returns = [], [], []
        self._firsts, self._returned = [], []
        self._edges, self._edges_host, self._selected_views = [], [], []
        self.steps = 0
        self._own = [None] * len(layouts)
        self._names = [""] * len(layouts)
        outputs = []
        for layout in self.layouts:
            dense = layout.dense_size
            cap = layout.total_capacity
            width = block_width(self.width, cap, size)
            red = SparseReduction(
                ops, dense, size, rank, width, width, like, self.value_dtype, self.coding
            )
            edges = even_bounds(dense, min(dense, self.bins * size))[1:]
            self._edges_host.append(edges)
            self._edges.append(ops.index_vector(edges, like))
            # This rank's chunk decoded slot by slot (world 1): its indices
            # in the message, and where its values sit.
            plan = UnpackPlan.of([layout], 1)
            wide = "int64" if dense > 2**31 - 1 else "int32"
            self._decoders.append(
                (
                    [DevicePart(ops, part, self.value_dtype, wide, like) for part in plan.parts],
                    ops.index_vector(plan.counts, like),
                )
            )
            returns = ops.zeros(dense + 1, "float32", like)
            self._returns.append(returns)
            self.reductions.append(red)
            offsets = [layout.dense_offset(m) for m in range(layout.members)]
            self._firsts.append(ops.index_vector(offsets, like))
            members = list(zip(offsets, layout.sizes))
            outputs.append([ops.narrow(red.out, 0, o, n) for o, n in members])
            self._returned.append([ops.narrow(returns, 0, o, n) for o, n in members])
        total = sum(len(e) for e in self._edges_host)
        self._selected = ops.zeros(total, "int32", like) if total else None
        at = 0
        for edges in self._edges_host:
            self._selected_views.append(ops.narrow(self._selected, 0, at, len(edges)))
            at += len(edges)
        self._zero = ops.scalar(0.0, like)
        pending, self._pending = self._pending, None
        if pending is not None:
            self._restore(pending)
        return outputs

    def state(self) -> Any:
        """The region bounds in force (every rank holds the same) and the
        layout's step count (when the next balance falls due)."""
        if not self.reductions:
            return None
        return {"bounds": [list(r.bounds) for r in self.reductions], "steps": self.steps}

    def load_state(self, state: Any) -> None:
        """Check a saved :meth:`state` (ValueError naming ``regions``) and put
        it in force at the next :meth:`layout` of the same messages."""
        if state is not None:
            bounds = state.get("bounds") if isinstance(state, dict) else None
            steps = state.get("steps") if isinstance(state, dict) else None
            ok = (
                isinstance(bounds, list)
                and all(
                    isinstance(b, list)
                    and len(b) >= 2
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in b)
                    and b[0] == 0
                    and all(x < y for x, y in zip(b, b[1:]))
                    for b in bounds
                )
                and isinstance(steps, int)
                and not isinstance(steps, bool)
                and steps >= 0
            )
            if not ok:
                raise ValueError(
                    "regions must be None or {'bounds': [[0, ..., size] ascending ints per "
                    f"message], 'steps': int >= 0}}, got {state!r:.120}"
                )
        self._pending = state

    def _restore(self, state: Any) -> None:
        bounds = state.get("bounds") if isinstance(state, dict) else None
        fits = (
            isinstance(bounds, list)
            and len(bounds) == len(self.reductions)
            and all(
                len(b) == r.parts + 1 and b[-1] == r.size for r, b in zip(self.reductions, bounds)
            )
        )
        if not fits:
            logger.info("dlgs: the saved region bounds are for other messages; balancing afresh")
            return
        for red, b in zip(self.reductions, bounds or []):
            red.set_bounds(b)
        self.steps = int(state.get("steps", 0))

    def start(self, message: int, chunk: Any, name: str) -> Any:
        """Decode this rank's chunk of sparse message ``message`` and send its
        entries to their owners; returns the alltoall's handle."""
        ops = self.ops
        parts, counts_at = self._decoders[message]
        values = ops.view_as(chunk, ValueDType(self.value_dtype).value)
        idx = [part.decode(ops, chunk) for part in parts]
        vals = [ops.take(values, part.values, part.scratch[0]) for part in parts]
        red = self.reductions[message]
        idx, vals, count = ops.selected_entries(
            idx[0] if len(idx) == 1 else ops.concat(idx),
            vals[0] if len(vals) == 1 else ops.concat(vals),
            red.size,
        )
        counts = ops.take(chunk, counts_at)
        flag = ops.count_or_flag(count, _none(ops, ops.any_negative_rows(counts, 1)))
        self._own[message] = counts
        self._names[message] = name
        send = red.pack(idx, vals, flag)
        return self.comm.alltoall_async(send, f"{name}.a2a")

    def finish(self, handles: Sequence[Any], verify: Sequence[bool], scale: Any) -> Any:
        ops = self.ops
        gathers = []
        for m, handle in enumerate(handles):
            received = self.comm.synchronize(handle)
            block = self.reductions[m].reduce(received, self._zero)
            gathers.append(self.comm.allgather_async(block, f"{self._names[m]}.kept"))
        flags, words = [], []
        for m, handle in enumerate(gathers):
            red = self.reductions[m]
            _, owners, bad = red.unpack(self.comm.synchronize(handle), scale)
            ret = ops.mul_(self._returns[m], 0.0)
            red.return_unkept(ret)
            members = self.layouts[m].members
            flags.append(_repeat(ops, bad, members))
            # This rank's count words, -1 where the message was non-finite anywhere.
            own = self._own[m]
            words.append(ops.count_or_flag(own, _none(ops, ops.reshape(bad, (1,)))))
        self.bad = flags[0] if len(flags) == 1 else ops.concat(flags)
        self.counts = words[0] if len(words) == 1 else ops.concat(words)
        # A message non-finite on some rank reads NaN in every member, everywhere.
        for red, firsts, flag in zip(self.reductions, self._firsts, flags):
            ops.nan_at_(red.out, firsts, flag)
        if self.steps % self.rebalance_every == 0 and self.comm.size > 1 and self.reductions:
            self._rebalance()
        self.steps += 1
        return self.bad

    def _rebalance(self) -> None:
        """Every rank's selection by bin (one allgather of counts, one host
        read), summed; every rank sets the same balanced bounds from it."""
        ops = self.ops
        for red, edges, out in zip(self.reductions, self._edges, self._selected_views):
            red.selected_below(edges, out)
        # Named after the first message (the exchange's prefix: unique per job).
        handle = self.comm.allgather_async(self._selected, f"{self._names[0]}.balance")
        cumulative = ops.to_host(self.comm.synchronize(handle))
        cumulative = np.asarray(cumulative, np.int64).reshape(self.comm.size, -1).sum(axis=0)
        at = 0
        for red, edges in zip(self.reductions, self._edges_host):
            cum = cumulative[at : at + len(edges)]
            at += len(edges)
            counts = np.diff(cum, prepend=0)
            bounds = balanced_bounds(counts.tolist(), [0] + edges, red.parts)
            if bounds != red.bounds:
                red.set_bounds(bounds)
                self.rebalances += 1

    def own_counts(self, words: Any, rank: int, size: int) -> Any:
        """This rank's count words from the host copy of :attr:`counts`."""
        return words

    def message_bytes(self, layout: Any) -> int:
        """Bytes this rank puts into a message's alltoall and allgather."""
        sent, kept = reduction_bytes(
            layout.dense_size,
            layout.total_capacity,
            self.comm.size,
            self.width,
            self.value_dtype,
            self.coding,
        )
        return sent + kept

    def returned(self) -> List[List[Any]]:
        """Per message, per member: what goes back into its residual this step
        (views, ``n`` elements each, valid until the next step's finish)."""
        return self._returned


def _repeat(ops: ArrayOps, flag: Any, n: int) -> Any:
    """A 0-d (or 1-element) bool as a vector of ``n``."""
    return ops.concat([ops.reshape(flag, (1,))] * n)
