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
   order (the same bits on every rank that computes them), and the entries
   whose ``|sum|`` is at or above the global threshold ``theta`` are kept, at
   most ``keep_width`` in index order;
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

__all__ = ["SparseReduction", "balanced_bounds", "even_bounds"]

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
        0 up) summed into this rank's region in rank order; the entries with
        ``|sum| >= theta`` (and not zero) kept, at most ``keep_width`` in index
        order. Returns this rank's block for the allgather."""
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
        theta = ops.clamp(theta, _TINY, math.inf)
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
