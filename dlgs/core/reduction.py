"""A sparse allreduce by regions: what each rank sends does not grow with the
number of ranks (issue 32; the scheme of Ok-Topk, Li and Hoefler, PPoPP'22).

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

Region bounds balance the entries kept per owner: :func:`balanced_bounds`
from a histogram every rank holds alike (the assembled indices), so every
rank computes the same bounds.
"""

from __future__ import annotations

import math
from typing import Any, List, Sequence, Tuple

from .backend import ArrayOps
from .wire import DevicePart, UnpackPlan, unpack

__all__ = ["ReducingTransport", "SparseReduction", "balanced_bounds", "even_bounds"]

#: The smallest positive float32 (a subnormal): ``theta`` is raised to it, so
#: that a zero sum is never kept.
_TINY = math.ldexp(1.0, -149)


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

    Per step: :meth:`pack` this rank's selection into the alltoall's send
    buffer; :meth:`reduce` what it received into this rank's block for the
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
    ):
        if not 0 <= rank < parts:
            raise ValueError(f"rank must be in [0, {parts}), got {rank}")
        if send_width < 1 or keep_width < 1:
            raise ValueError(f"widths must be >= 1, got {send_width}, {keep_width}")
        self.ops, self.size, self.parts, self.rank = ops, size, parts, rank
        self.send_width, self.keep_width = send_width, keep_width
        self.like = like
        #: Words per block sent to one owner: offsets, value bits, flag.
        self.send_words = 2 * send_width + 1
        #: Words of an owner's block in the allgather: indices, value bits, count.
        self.keep_words = 2 * keep_width + 1
        self.send = ops.zeros(parts * self.send_words, "int32", like)
        self.block = ops.zeros(self.keep_words, "int32", like)
        self.out = ops.zeros(size + 1, "float32", like)  # the last slot: padding
        self.kept = ops.zeros(size + 1, "bool", like)
        self._none_kept = ops.zeros(size + 1, "bool", like)
        # Reused every step: phase 1's staging (one more slot: where unsent
        # entries land), the received offsets / values / flags, the gathered
        # indices / values / counts.
        cells, kcells = parts * send_width, parts * keep_width
        self._stage_idx = ops.zeros(cells + 1, "int32", like)
        self._stage_val = ops.zeros(cells + 1, "float32", like)
        self._offsets = ops.zeros(cells, "int32", like)
        self._values = ops.zeros(cells, "int32", like)
        self._flags = ops.zeros(parts, "int32", like)
        self._idx32 = ops.zeros(kcells, "int32", like)
        self._bits = ops.zeros(kcells, "int32", like)
        self._counts = ops.zeros(parts, "int32", like)
        self._pad = ops.index_vector([size], like)
        self.bounds: List[int] = []
        self.set_bounds(even_bounds(size, parts))
        self._slots: Any = None  # this step's pack(): each entry's slot
        self._idx: Any = None
        self._vals: Any = None

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
        ops, like = self.ops, self.like
        self.bounds = bounds
        self._bounds = ops.index_vector(bounds, like)
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        self.region = hi - lo
        self._region = ops.zeros(self.region + 1, "float32", like)  # + padding slot
        self._mask = ops.zeros(self.region + 1, "bool", like)
        self._region_pad = ops.index_vector([self.region], like)
        self._abs = ops.zeros(self.region + 1, "float32", like)
        # Unused send slots point at each owner's padding slot (its region's size).
        self._send_pad = ops.index_vector(
            [bounds[r + 1] - bounds[r] for r in range(self.parts) for _ in range(self.send_width)],
            like,
        )
        # Kept-index padding: the message's padding slot, ``size``, once offset.
        self._keep_pad = ops.index_vector([self.size - lo] * self.keep_width, like)

    # -- one step ---------------------------------------------------------------
    def pack(self, idx: Any, vals: Any, flag: Any) -> Any:
        """Phase 1's send buffer (``parts`` blocks): this rank's selected
        entries (``idx`` ascending message indices, padded with ``size``;
        ``vals`` float32) by region, and the flag word in each block (the
        selection's count, -1 where something was non-finite)."""
        ops, w, parts = self.ops, self.send_width, self.parts
        slots, local = ops.region_slots(idx, self._bounds, w)
        rows = ops.reshape(self.send, (parts, self.send_words))
        offsets = ops.narrow(rows, 1, 0, w)
        values = ops.narrow(rows, 1, w, w)
        stage_idx, stage_val = self._stage_idx, ops.mul_(self._stage_val, 0.0)
        ops.copy_(ops.narrow(stage_idx, 0, 0, parts * w), self._send_pad)
        ops.scatter_(stage_idx, slots, local)
        ops.scatter_(stage_val, slots, vals)
        ops.copy_(offsets, ops.reshape(ops.narrow(stage_idx, 0, 0, parts * w), (parts, w)))
        bits = ops.view_as(ops.narrow(stage_val, 0, 0, parts * w), "int32")
        ops.copy_(values, ops.reshape(bits, (parts, w)))
        ops.copy_(ops.narrow(rows, 1, 2 * w, 1), flag)
        self._slots, self._idx, self._vals = slots, idx, vals
        return self.send

    def reduce(self, received: Any, theta: Any) -> Any:
        """Phase 2 at the owner: the ``parts`` blocks ``received`` (from rank
        0 up) summed into this rank's region in rank order; its ``keep_width``
        largest ``|sum|`` kept (none below ``theta``, none zero; ties at the
        smallest kept magnitude in index order). Returns this rank's block for
        the allgather (its count word: the sums at or above the magnitude
        kept)."""
        ops, w, parts, kw = self.ops, self.send_width, self.parts, self.keep_width
        rows = ops.reshape(received, (parts, self.send_words))
        offsets, values, flags = self._offsets, self._values, self._flags
        ops.copy_(ops.reshape(offsets, (parts, w)), ops.narrow(rows, 1, 0, w))
        ops.copy_(ops.reshape(values, (parts, w)), ops.narrow(rows, 1, w, w))
        ops.copy_(ops.reshape(flags, (parts, 1)), ops.narrow(rows, 1, 2 * w, 1))
        region = ops.mul_(self._region, 0.0)
        idx = ops.cast(offsets, "int64")
        ops.index_add_rows_(region, idx, ops.view_as(values, "float32"), 1.0, parts)
        ops.abs_(region, self._abs)
        # The owner's share of a top-k: its keep_width largest sums (and none
        # below theta, none zero).
        kth = ops.kth_largest(ops.narrow(self._abs, 0, 0, self.region), min(kw, self.region))
        theta = ops.clamp(ops.kth_largest(ops.stack([theta, kth]), 1), _TINY, math.inf)
        ops.ge_(self._abs, theta, self._mask)
        ops.fill_at_(self._mask, self._region_pad, 0.0)
        count = ops.count_nonzero(self._mask)
        kept = ops.nonzero_static(self._mask, kw, self.region)
        sums = ops.take(region, kept)
        bad = ops.any_negative_rows(flags, parts)
        global_idx = ops.where_below(kept, self.region, self._keep_pad)
        ops.add_offset_(ops.narrow(self.block, 0, 0, kw), global_idx, self.bounds[self.rank])
        ops.copy_(ops.narrow(self.block, 0, kw, kw), ops.view_as(sums, "int32"))
        word = ops.count_or_flag(count, _none(ops, bad))
        ops.copy_(ops.narrow(self.block, 0, 2 * kw, 1), word)
        return self.block

    def unpack(self, gathered: Any, scale: float) -> Tuple[Any, Any, Any]:
        """The reduced message from every owner's block (``gathered``, rank
        order): ``(out, counts, bad)``: ``out`` the message's ``size`` sums
        times ``scale`` (a view; its padding slot excluded), ``counts`` each
        owner's count word (its entries at or above ``theta``, -1 where some
        rank was non-finite), ``bad`` a 0-d bool. Marks the kept indices for
        :meth:`return_unkept`."""
        ops, kw, parts = self.ops, self.keep_width, self.parts
        rows = ops.reshape(gathered, (parts, self.keep_words))
        idx32, bits, counts = self._idx32, self._bits, self._counts
        ops.copy_(ops.reshape(idx32, (parts, kw)), ops.narrow(rows, 1, 0, kw))
        ops.copy_(ops.reshape(bits, (parts, kw)), ops.narrow(rows, 1, kw, kw))
        ops.copy_(ops.reshape(counts, (parts, 1)), ops.narrow(rows, 1, 2 * kw, 1))
        idx = ops.cast(idx32, "int64")
        out = ops.mul_(self.out, 0.0)
        ops.index_add_rows_(out, idx, ops.view_as(bits, "float32"), scale, parts)
        kept = ops.copy_(self.kept, self._none_kept)
        ops.fill_at_(kept, idx, 1.0)
        ops.fill_at_(kept, self._pad, 0.0)
        bad = ops.any_negative_rows(counts, parts)
        return ops.narrow(out, 0, 0, self.size), counts, ops.any_true([bad])

    def return_unkept(self, residual: Any) -> Any:
        """Add back into ``residual`` (the message's ``size + 1`` residual
        slots, the last the padding) what this rank selected in the last
        :meth:`pack` but did not send or the owners did not keep."""
        return self.ops.add_unkept_(
            residual, self._idx, self._vals, self.kept, self._slots, self.parts * self.send_width
        )


def _none(ops: ArrayOps, flags: Any) -> Any:
    """0-d bool: no element of the bool vector ``flags`` is true (``1 / (1 -
    any)`` is finite exactly then)."""
    some = ops.cast(ops.any_true([flags]), "float32")
    return ops.below_inf(ops.reciprocal(ops.affine(some, -1.0, 1.0)))


class ReducingTransport:
    """A :class:`~dlgs.core.transport.Transport` that reduces each sparse
    message by regions (:class:`SparseReduction`) instead of allgathering it.

    :meth:`start` decodes this rank's own chunk (the exchange packed it as for
    the allgather: values in the wire dtype, indices in their coding), sends
    its entries to the regions' owners (an alltoall of fixed blocks) and
    returns; :meth:`finish` reduces at the owners, allgathers the kept
    entries and assembles every message, times ``scale``. What this rank
    selected but did not send or the owners did not keep is in
    :meth:`returned` afterwards, by member, for the exchange to add back into
    its residuals.

    ``width``: each block's entries as a multiple of a message's capacity
    divided by the ranks (at least one): a rank sends ``P`` blocks and
    receives ``P`` blocks of about ``width * capacity / P`` entries, so its
    bytes do not grow with ``P``. Each owner keeps its largest sums, up to its
    block (its share of a top-k; no threshold agreed across owners yet).

    The collectives need ``alltoall_async(tensor, name)`` (equal splits) and
    ``allgather_async``.
    """

    name = "reduce"

    def __init__(self, ops: ArrayOps, comm: Any, value_dtype: Any, width: float = 2.0):
        self.ops, self.comm, self.value_dtype, self.width = ops, comm, value_dtype, width
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
        self._tiny: Any = None

    def layout(self, layouts: Sequence[Any], like: Any) -> List[List[Any]]:
        ops, size, rank = self.ops, self.comm.size, self.comm.rank
        self.layouts = list(layouts)
        self.counts = self.bad = None
        self.reductions, self._decoders, self._returns = [], [], []
        self._firsts, self._returned = [], []
        self._own = [None] * len(layouts)
        self._names = [""] * len(layouts)
        outputs = []
        for layout in self.layouts:
            dense = layout.dense_size
            cap = layout.total_capacity
            width = max(1, math.ceil(self.width * cap / size))
            red = SparseReduction(ops, dense, size, rank, width, width, like)
            plan = UnpackPlan.of([layout], 1)
            wide = "int64" if dense > 2**31 - 1 else "int32"
            self._decoders.append(
                (
                    ops.zeros(dense + 1, "float32", like),  # this rank's selection, dense
                    ops.zeros(dense + 1, "float32", like),  # its magnitudes
                    ops.zeros(dense + 1, "bool", like),
                    [DevicePart(ops, part, self.value_dtype, wide, like) for part in plan.parts],
                    ops.index_vector(plan.counts, like),
                    cap,
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
        self._zero = ops.scalar(0.0, like)
        self._tiny = ops.scalar(_TINY, like)
        return outputs

    def start(self, message: int, chunk: Any, name: str) -> Any:
        """Decode this rank's chunk of sparse message ``message`` and send its
        entries to their owners; returns the alltoall's handle."""
        ops = self.ops
        mine, mags, mask, parts, counts_at, cap = self._decoders[message]
        ops.mul_(mine, 0.0)
        counts, bad = unpack(ops, chunk, 1, self.value_dtype, mine, 1.0, parts, counts_at)
        ops.abs_(mine, mags)
        ops.ge_(mags, self._tiny, mask)
        idx = ops.nonzero_static(mask, cap, ops.numel(mine) - 1)
        vals = ops.take(mine, idx)
        flag = ops.count_or_flag(ops.count_nonzero(mask), _none(ops, bad))
        self._own[message] = counts
        self._names[message] = name
        send = self.reductions[message].pack(idx, vals, flag)
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
        return self.bad

    def own_counts(self, words: Any, rank: int, size: int) -> Any:
        """This rank's count words from the host copy of :attr:`counts`."""
        return words

    def returned(self) -> List[List[Any]]:
        """Per message, per member: what goes back into its residual this step
        (views, ``n`` elements each, valid until the next step's finish)."""
        return self._returned


def _repeat(ops: ArrayOps, flag: Any, n: int) -> Any:
    """A 0-d (or 1-element) bool as a vector of ``n``."""
    return ops.concat([ops.reshape(flag, (1,))] * n)
