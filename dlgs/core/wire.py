"""Wire format: a merge group's sparse layers in one fixed-size int32 buffer.

Layout of one rank's chunk (all words int32; value bits are reinterpreted)::

    [ fingerprint | count_1 .. count_m | block counts | values (C) | indices (C) ]

with ``C = sum(cap_i)``; values are float32, float16 or bfloat16. Member ``i``
owns values and indices ``[o_i, o_i + cap_i)`` with ``o_i = sum(cap_j, j < i)``.
Indices (:class:`~dlgs.core.config.IndexCoding`) are int32 words that already
include the member's offset in the group's *dense* buffer, or with ``block16``
half-words holding each index's low 16 bits, the member's index space cut into
blocks of 65,536 elements and, per block boundary, one int32 "block count" in
the header: how many of the member's (ascending) indices lie below it; or with
``bitmap`` one bit per element and per capacity slot of each member (byte
aligned, least significant bit first): the selected elements' bits, and one
bit past the element range for each unused slot, so every member has exactly
``cap_i`` bits set and the j-th set bit is the j-th slot. The
dense buffer has one extra "padding slot" per member (``dense_offset_i +
n_i``): unused capacity points there with value 0, so unpacking never needs the
number of selected values on the host. A step's sparse messages are unpacked
together (:class:`UnpackPlan`): their outputs concatenated, a few gathers, one
search over every block count (block16), one unpacking of every bitmap and
one scatter-add per index coding into one dense buffer where each message's
part starts at its base, whatever the number of messages. A count of -1 says
the member's gradient was non-finite on that rank (every receiver then marks
the layer non-finite).

The chunk size is fixed by the layout, so every step sends the same shape
(Horovod's response cache hits and nothing renegotiates) and every rank's chunk
has the same size: a size mismatch after the allgather proves the ranks
disagree on the layout and is reported as an error. The fingerprint lets the
receiver check the same thing word-for-word once per layout.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field, replace
from numbers import Real
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from .backend import ArrayOps
from .config import IndexCoding, SparsityConfig, ValueDType

__all__ = [
    "BLOCK",
    "dense_itemsize",
    "density_for_budget",
    "fit_budget",
    "budget_bytes",
    "layout_bytes",
    "DevicePart",
    "GroupLayout",
    "LayoutMismatchError",
    "MemberViews",
    "UnpackPart",
    "UnpackPlan",
    "member_bytes",
    "resolve_coding",
    "unpack",
    "value_bytes",
]


class LayoutMismatchError(RuntimeError):
    """Ranks disagree on a merge group's layout (different models or options)."""


_VALUE_BYTES = {ValueDType.FLOAT32: 4, ValueDType.FLOAT16: 2, ValueDType.BFLOAT16: 2}

#: The largest finite float16: larger magnitudes are sent clipped to it.
FLOAT16_MAX = 65504.0

#: Elements per block of the 16-bit index coding: an index is its block's
#: first element plus 16 bits.
BLOCK = 1 << 16


def value_bytes(value_dtype: ValueDType) -> int:
    """Bytes of one value on the wire."""
    return _VALUE_BYTES[ValueDType(value_dtype)]


def _blocks(n: int) -> int:
    """Blocks of a member's index range ``[0, n]`` (``n``: its padding slot)."""
    return n // BLOCK + 1


def _bitmap_bytes(n: int, cap: int) -> int:
    """Bytes of a member's bitmap: a bit per element and per capacity slot."""
    return -(-(n + cap) // 8)


def resolve_coding(sizes: Sequence[int], caps: Sequence[int], coding: IndexCoding) -> IndexCoding:
    """The index coding a message uses: ``coding`` itself, or for ``auto`` the
    smallest of int32, block16 and bitmap for these members (sizes only, so
    every rank decides the same). Ties go to the simpler decode, in that
    order."""
    coding = IndexCoding(coding)
    if coding is not IndexCoding.AUTO:
        return coding
    total = sum(caps)
    words = {
        IndexCoding.INT32: total,
        IndexCoding.BLOCK16: math.ceil(total / 2) + sum(_blocks(n) - 1 for n in sizes),
        IndexCoding.BITMAP: math.ceil(sum(map(_bitmap_bytes, sizes, caps)) / 4),
    }
    return min(words, key=words.__getitem__)  # the first of equals: dict order


class MemberViews(NamedTuple):
    """One member's views of its chunk (:meth:`GroupLayout.member_views`) and
    what its coding needs to pack into them."""

    values: Any
    #: int32 or int16 index slots, or the member's bitmap bytes (uint8).
    indices: Any
    #: The count word.
    word: Any
    #: block16 with more than one block: the block-count words and boundaries.
    counts: Any = None
    bounds: Any = None
    #: bitmap: a bool buffer of one bit per byte (None for a framework that
    #: returns new tensors) and each slot's padding bit ``n + slot``.
    scratch: Any = None
    pads: Any = None


def member_bytes(
    numel: int,
    capacity: int,
    value_dtype: ValueDType,
    index_coding: IndexCoding = IndexCoding.INT32,
) -> int:
    """Bytes one layer sent alone adds to its message: the count word, its
    values and indices padded to whole words (the message adds one fingerprint
    word). Every size formula in dlgs calls this or GroupLayout."""
    return GroupLayout((numel,), (capacity,), value_dtype, index_coding).chunk_bytes - 4


@dataclass(frozen=True)
class GroupLayout:
    """Offsets of one merge group's chunk; pure metadata, no tensors.

    Args:
        sizes: element count ``n_i`` of each member, in order.
        caps: capacity ``cap_i`` (values sent) of each member.
        value_dtype: dtype of values on the wire.
        index_coding: :class:`~dlgs.core.config.IndexCoding`; ``auto`` is
            resolved here (:func:`resolve_coding`), so ``index_coding`` is
            never ``auto`` once made.
    """

    sizes: Tuple[int, ...]
    caps: Tuple[int, ...]
    value_dtype: ValueDType = ValueDType.FLOAT32
    index_coding: IndexCoding = IndexCoding.INT32
    #: How the message travels where a plan chose (``transport="auto"``):
    #: ``"allgather"`` or ``"reduce"``; empty: the transport's own rule.
    transport: str = ""
    fingerprint: int = field(init=False)

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.caps) or not self.sizes:
            raise ValueError("sizes and caps must be non-empty and of equal length")
        for n, c in zip(self.sizes, self.caps):
            if not (0 < c <= n):
                raise ValueError(f"capacity must be in [1, n], got cap={c} for n={n}")
        object.__setattr__(self, "value_dtype", ValueDType(self.value_dtype))
        coding = resolve_coding(self.sizes, self.caps, self.index_coding)
        object.__setattr__(self, "index_coding", coding)
        if self.transport not in ("", "allgather", "reduce"):
            raise ValueError(
                f"transport must be '', 'allgather' or 'reduce', got {self.transport!r}"
            )
        parts = (self.sizes, self.caps, self.value_dtype.value, coding.value)
        key = repr(parts + ((self.transport,) if self.transport else ())).encode()
        # 24 bits: exactly representable as the float32 scalar it is written from.
        object.__setattr__(self, "fingerprint", zlib.crc32(key) & 0xFFFFFF)

    # -- derived offsets ----------------------------------------------------
    @property
    def members(self) -> int:
        return len(self.sizes)

    @property
    def total_capacity(self) -> int:
        return sum(self.caps)

    @property
    def block16(self) -> bool:
        return self.index_coding is IndexCoding.BLOCK16

    @property
    def bitmap(self) -> bool:
        return self.index_coding is IndexCoding.BITMAP

    def bitmap_bytes(self, i: int) -> int:
        """Bytes of member ``i``'s bitmap (bitmap coding)."""
        return _bitmap_bytes(self.sizes[i], self.caps[i])

    def bitmap_offset(self, i: int) -> int:
        """Byte offset of member ``i``'s bitmap among the group's bitmaps."""
        return sum(map(_bitmap_bytes, self.sizes[:i], self.caps[:i]))

    def blocks(self, i: int) -> int:
        """Index blocks of member ``i``: it sends ``blocks(i) - 1`` block
        counts (1 block, no count, with int32 indices or under 65,536
        elements)."""
        return _blocks(self.sizes[i]) if self.block16 else 1

    @property
    def count_words(self) -> int:
        """Block-count words of all members (block16)."""
        return sum(self.blocks(i) - 1 for i in range(self.members))

    def counts_offset(self, i: int) -> int:
        """Word offset of member ``i``'s block counts in the chunk."""
        return 1 + self.members + sum(self.blocks(j) - 1 for j in range(i))

    @property
    def header_words(self) -> int:
        return 1 + self.members + self.count_words

    @property
    def value_words(self) -> int:
        return math.ceil(self.total_capacity * _VALUE_BYTES[self.value_dtype] / 4)

    @property
    def index_words(self) -> int:
        cap = self.total_capacity
        if self.bitmap:
            return math.ceil(self.bitmap_offset(self.members) / 4)
        return math.ceil(cap / 2) if self.block16 else cap

    @property
    def chunk_words(self) -> int:
        return self.header_words + self.value_words + self.index_words

    @property
    def chunk_bytes(self) -> int:
        return 4 * self.chunk_words

    def value_offset(self, i: int) -> int:
        """Offset of member ``i``'s values among the group's values."""
        return sum(self.caps[:i])

    def dense_offset(self, i: int) -> int:
        """Offset of member ``i`` in the dense buffer (with padding slots)."""
        return sum(n + 1 for n in self.sizes[:i])

    @property
    def dense_size(self) -> int:
        return sum(n + 1 for n in self.sizes)

    # -- tensor views --------------------------------------------------------
    def values_view(self, ops: ArrayOps, chunk: Any) -> Any:
        """All members' value slots of a 1-D chunk, in the wire value dtype."""
        raw = ops.narrow(chunk, 0, self.header_words, self.value_words)
        return ops.narrow(ops.view_as(raw, self.value_dtype.value), 0, 0, self.total_capacity)

    def indices_view(self, ops: ArrayOps, chunk: Any) -> Any:
        """All members' index slots: int32, int16 (low 16 bits) with block16,
        or with bitmap every member's bitmap bytes (uint8)."""
        raw = ops.narrow(chunk, 0, self.header_words + self.value_words, self.index_words)
        if self.bitmap:
            return ops.narrow(ops.view_as(raw, "uint8"), 0, 0, self.bitmap_offset(self.members))
        if not self.block16:
            return raw
        return ops.narrow(ops.view_as(raw, "int16"), 0, 0, self.total_capacity)

    def new_chunk(self, ops: ArrayOps, like: Any) -> Any:
        """An int32 send buffer with the fingerprint written in."""
        chunk = ops.zeros(self.chunk_words, "int32", like)
        head = ops.narrow(chunk, 0, 0, 1)
        ops.copy_(head, ops.cast(ops.scalar(float(self.fingerprint), like), "int32"))
        return chunk

    def member_views(self, ops: ArrayOps, chunk: Any, i: int) -> MemberViews:
        """Member ``i``'s value slots, index slots (or bitmap), count word and
        what its coding needs besides (:class:`MemberViews`) in ``chunk``
        (make them once per chunk, then :meth:`pack_into` every step)."""
        n, cap, off = self.sizes[i], self.caps[i], self.value_offset(i)
        values = ops.narrow(self.values_view(ops, chunk), 0, off, cap)
        word = ops.narrow(chunk, 0, 1 + i, 1)
        if self.bitmap:
            nbytes = self.bitmap_bytes(i)
            bits = ops.narrow(self.indices_view(ops, chunk), 0, self.bitmap_offset(i), nbytes)
            scratch = ops.zeros(8 * nbytes, "bool", chunk) if ops.reuses_outputs else None
            pads = ops.index_vector(n + np.arange(cap, dtype=np.int64), chunk)
            return MemberViews(values, bits, word, scratch=scratch, pads=pads)
        indices = ops.narrow(self.indices_view(ops, chunk), 0, off, cap)
        blocks = self.blocks(i)
        if blocks == 1:
            return MemberViews(values, indices, word)
        counts = ops.narrow(chunk, 0, self.counts_offset(i), blocks - 1)
        bounds = ops.index_vector(BLOCK * np.arange(1, blocks, dtype=np.int64), chunk)
        return MemberViews(values, indices, word, counts, bounds)

    def pack_into(
        self,
        ops: ArrayOps,
        views: MemberViews,
        i: int,
        source: Any,
        idx: Any,
        count: Any,
    ) -> Any:
        """Write member ``i``'s message into its :meth:`member_views`: the values
        ``source[idx]`` (in the wire dtype), the indices (``idx`` ascending,
        padded with ``n_i``), and its count word (its selected count, or -1
        when its accumulated gradient was non-finite on this rank). int32
        indices are shifted to the member's place in the dense buffer; block16
        writes their low 16 bits and, per block boundary, how many indices lie
        below it; bitmap sets their bits and a padding slot's ``n_i + slot``.
        float16 values are clipped to its range. Returns the values as written
        (for the residual)."""
        values, indices, word, counts, bounds, scratch, pads = views
        if self.value_dtype is ValueDType.FLOAT16:
            # Beyond float16's range a value would go infinite on the wire (and
            # into the residual): it is sent clipped, the rest stays in the
            # residual (the caller subtracts what was sent).
            ops.gather_clamped_(source, idx, values, FLOAT16_MAX)
        else:
            ops.gather_(source, idx, values)
        if self.bitmap:
            ops.set_bits_(indices, ops.where_below(idx, self.sizes[i], pads), scratch)
        elif self.block16:
            ops.copy_(indices, idx)  # wraps to the low 16 bits
            if counts is not None:
                ops.count_below_(counts, idx, bounds)
        else:
            ops.add_offset_(indices, idx, self.dense_offset(i))
        ops.copy_(word, count)
        return values

    def decode(self, chunk: Any) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Reference decoder of one rank's chunk on the host, written to be
        obviously right rather than fast (tests, debugging): every slot's value
        (float64) and its index in the dense buffer (padding slots included),
        and the members' count words."""
        words = np.asarray(chunk, np.int32).reshape(-1)
        if words.size != self.chunk_words:
            raise ValueError(f"chunk has {words.size} words, the layout {self.chunk_words}")
        cap = self.total_capacity
        raw = words[self.header_words : self.header_words + self.value_words]
        if self.value_dtype is ValueDType.FLOAT32:
            values = raw.view(np.float32)[:cap].astype(np.float64)
        elif self.value_dtype is ValueDType.FLOAT16:
            values = raw.view(np.float16)[:cap].astype(np.float64)
        else:  # bfloat16: the high half of a float32
            half = raw.view(np.uint16)[:cap].astype(np.uint32) << 16
            values = half.view(np.float32).astype(np.float64)
        slots = words[self.header_words + self.value_words :]
        indices = np.empty(cap, np.int64)
        for i in range(self.members):
            lo, hi = self.value_offset(i), self.value_offset(i) + self.caps[i]
            if self.bitmap:
                start, nbytes = self.bitmap_offset(i), self.bitmap_bytes(i)
                region = slots.view(np.uint8)[start : start + nbytes].astype(np.int64)
                bits = (region[:, None] >> np.arange(8)) & 1  # least significant first
                pos = np.flatnonzero(bits.reshape(-1))
                if pos.size != self.caps[i]:
                    raise ValueError(f"member {i} has {pos.size} bits set, not {self.caps[i]}")
                indices[lo:hi] = self.dense_offset(i) + np.minimum(pos, self.sizes[i])
                continue
            if not self.block16:
                indices[lo:hi] = slots[lo:hi]
                continue
            low = slots.view(np.uint16)[lo:hi].astype(np.int64)
            start = self.counts_offset(i)
            ends = list(words[start : start + self.blocks(i) - 1]) + [self.caps[i]]
            block, first = 0, 0
            for end in ends:
                low[first:end] += block * BLOCK
                block, first = block + 1, end
            indices[lo:hi] = self.dense_offset(i) + low
        return values, indices, words[1 : 1 + self.members].copy()

    def check_gathered(self, ops: ArrayOps, gathered: Any, world: int, verify: bool) -> None:
        """The gathered size (no device access): anything but ``world`` chunks
        proves the ranks disagree on the layout; with ``verify``, also every
        rank's fingerprint (one host read: do it once per layout)."""
        got = ops.numel(gathered)
        if got != world * self.chunk_words:
            raise LayoutMismatchError(
                f"allgather returned {got} words, expected {world} ranks x "
                f"{self.chunk_words}: ranks disagree on the sparse layout (different "
                "models, densities or options on different ranks)"
            )
        if not verify:
            return
        rows = ops.reshape(gathered, (world, self.chunk_words))
        prints = ops.to_host(ops.narrow(rows, 1, 0, 1))
        bad = [r for r, (fp,) in enumerate(prints) if fp != self.fingerprint]
        if bad:
            raise LayoutMismatchError(
                f"ranks {bad} sent a different sparse layout than this rank "
                "(different models, densities or options on different ranks)"
            )


@dataclass(frozen=True)
class UnpackPart:
    """The slots of a step's messages that share one index coding, every
    rank's, in rank-major order (rank 0's slots of every such message, then
    rank 1's, ...). Positions are into the concatenated allgather outputs.
    Pure metadata (NumPy int64 vectors).

    int32: ``index = words[indices] + offsets`` (the sender already added the
    member's place in its message). block16: ``index = low16(indices) +
    table[bucket + ordinals]`` where ``bucket`` counts the block ends at or
    below each slot's position (one search over every member's ends at once,
    shifted by ``end_offsets`` to the part's slot numbering) -- or, when no
    member has a second block, ``low16(indices) + offsets``. bitmap: the
    bytes at ``indices`` unpacked to bits; the j-th set bit is slot j (each
    member sets exactly its capacity), ``index = min(bit + offsets, limits)``
    (a padding bit lands in its member's padding slot).
    """

    coding: IndexCoding
    #: Positions of the values, in units of the wire value dtype.
    values: np.ndarray
    #: Positions of the indices: words (int32), half-words (block16) or
    #: bytes (bitmap).
    indices: np.ndarray
    #: Per slot, what to add to its decoded index (None: nothing, or block16
    #: with block counts, which uses ``table`` instead).
    offsets: Optional[np.ndarray]
    #: block16 with block counts: positions of the counts in words, what
    #: shifts each to the part's slot numbering, each slot's number and
    #: member ordinal, and each (member, block)'s first dense slot.
    ends: Optional[np.ndarray] = None
    end_offsets: Optional[np.ndarray] = None
    slots: Optional[np.ndarray] = None
    ordinals: Optional[np.ndarray] = None
    table: Optional[np.ndarray] = None
    #: bitmap: per slot, its member's padding slot (the largest index).
    limits: Optional[np.ndarray] = None


@dataclass(frozen=True)
class UnpackPlan:
    """Where every rank's values, indices and count words of a step's sparse
    messages lie once their allgathered outputs are concatenated in message
    order, and where each message lands in one dense buffer for all of them.
    Pure metadata (NumPy int64 vectors), made once per layout.

    Slots are grouped into :class:`UnpackPart` by index coding; within a part
    every vector is rank-major, so :func:`unpack` adds rank by rank where it
    must (:meth:`~dlgs.core.backend.ArrayOps.index_add_rows_`), and within one
    rank's row every index is unique (messages occupy disjoint parts of the
    buffer) except the padding slots, which only receive zeros.
    """

    parts: Tuple[UnpackPart, ...]
    #: Positions of the count words, in words: row r holds every member's.
    counts: np.ndarray
    #: Each member's first slot in the dense buffer (message order).
    firsts: np.ndarray
    #: Each message's base in the dense buffer.
    bases: Tuple[int, ...]
    dense_size: int

    @classmethod
    def of(cls, layouts: Sequence[GroupLayout], world: int) -> "UnpackPlan":
        if len({lay.value_dtype for lay in layouts}) != 1:
            raise ValueError("the messages of one unpack must share a value dtype")
        word_bases = np.cumsum([0] + [world * lay.chunk_words for lay in layouts])
        bases = [int(b) for b in np.cumsum([0] + [lay.dense_size for lay in layouts])]
        counts = []
        for r in range(world):
            for lay, words in zip(layouts, word_bases):
                start = int(words) + r * lay.chunk_words
                counts.append(start + 1 + np.arange(lay.members, dtype=np.int64))
        parts = []
        for coding in (IndexCoding.INT32, IndexCoding.BLOCK16, IndexCoding.BITMAP):
            chosen = [
                (lay, int(words), base)
                for lay, words, base in zip(layouts, word_bases, bases)
                if lay.index_coding is coding
            ]
            if chosen:
                parts.append(_part(coding, chosen, world))
        firsts = [
            base + lay.dense_offset(m)
            for lay, base in zip(layouts, bases)
            for m in range(lay.members)
        ]
        return cls(
            parts=tuple(parts),
            counts=np.concatenate(counts),
            firsts=np.asarray(firsts, np.int64),
            bases=tuple(bases[:-1]),
            dense_size=bases[-1],
        )


def _part(
    coding: IndexCoding, messages: Sequence[Tuple[GroupLayout, int, int]], world: int
) -> UnpackPart:
    """One coding's :class:`UnpackPart` of ``messages`` (layout, first word of
    its allgather output, dense base)."""
    per_word = 4 // _VALUE_BYTES[messages[0][0].value_dtype]
    values, indices, offsets = [], [], []
    ends, end_offsets, ordinals, table, limits = [], [], [], [], []
    slot, ordinal, first_bit = 0, 0, 0
    for r in range(world):
        for lay, words, base in messages:
            start = words + r * lay.chunk_words
            cap = lay.total_capacity
            at = np.arange(cap, dtype=np.int64)
            values.append(per_word * (start + lay.header_words) + at)
            first_index = start + lay.header_words + lay.value_words
            if coding is IndexCoding.INT32:
                indices.append(first_index + at)
                offsets.append(np.full(cap, base, np.int64))
                continue
            if coding is IndexCoding.BITMAP:
                nbytes = lay.bitmap_offset(lay.members)
                indices.append(4 * first_index + np.arange(nbytes, dtype=np.int64))
                for m in range(lay.members):
                    first = base + lay.dense_offset(m)
                    bit = first_bit + 8 * lay.bitmap_offset(m)
                    offsets.append(np.full(lay.caps[m], first - bit, np.int64))
                    limits.append(np.full(lay.caps[m], first + lay.sizes[m], np.int64))
                first_bit += 8 * nbytes
                continue
            indices.append(2 * first_index + at)
            for m in range(lay.members):
                c, blocks = lay.caps[m], lay.blocks(m)
                first = lay.counts_offset(m)
                ends.append(start + first + np.arange(blocks - 1, dtype=np.int64))
                end_offsets.append(np.full(blocks - 1, slot, np.int64))
                ordinals.append(np.full(c, ordinal, np.int64))
                offsets.append(np.full(c, base + lay.dense_offset(m), np.int64))
                table.append(base + lay.dense_offset(m) + BLOCK * np.arange(blocks))
                ordinal += 1
                slot += c
    cat = np.concatenate
    if coding is IndexCoding.INT32:
        off = cat(offsets)
        return UnpackPart(coding, cat(values), cat(indices), off if off.any() else None)
    if coding is IndexCoding.BITMAP:
        return UnpackPart(coding, cat(values), cat(indices), cat(offsets), limits=cat(limits))
    if not sum(len(e) for e in ends):
        return UnpackPart(coding, cat(values), cat(indices), cat(offsets))
    return UnpackPart(
        coding,
        cat(values),
        cat(indices),
        None,
        ends=cat(ends),
        end_offsets=cat(end_offsets),
        slots=np.arange(slot, dtype=np.int64),
        ordinals=cat(ordinals),
        table=cat(table).astype(np.int64),
    )


def unpack(
    ops: ArrayOps,
    words: Any,
    world: int,
    value_dtype: ValueDType,
    dense: Any,
    scale: Any,
    parts: Sequence["DevicePart"],
    counts_at: Any,
    counts_out: Any = None,
) -> Any:
    """Scatter-add every rank's values (multiplied by ``scale``) of a step's
    sparse messages into ``dense`` (:attr:`UnpackPlan.dense_size`, zeroed by the
    caller), ``words`` being their allgathered outputs concatenated in message
    order. ``parts``: the plan's parts on the device (:meth:`DevicePart.of`);
    ``counts_at``: the count words' positions. Returns every rank's
    count words (rank-major, members in message order) and each member's flag
    (1-D bool): non-finite on some rank. A fixed number of
    operations whatever the numbers of messages and ranks (at most two parts:
    one per index coding). Call :meth:`GroupLayout.check_gathered` on each
    output first."""
    for part in parts:
        values = ops.take(ops.view_as(words, value_dtype.value), part.values, part.scratch[0])
        ops.index_add_rows_(dense, part.decode(ops, words), values, scale, world)
    counts = ops.take(words, counts_at, counts_out)
    return counts, ops.any_negative_rows(counts, world)


class DevicePart:
    """An :class:`UnpackPart`'s vectors on the device and its reused scratch
    (none for a framework that returns new tensors)."""

    def __init__(
        self, ops: ArrayOps, part: UnpackPart, value_dtype: ValueDType, wide: str, like: Any
    ):
        self.block16 = part.coding is IndexCoding.BLOCK16
        self.bitmap = part.coding is IndexCoding.BITMAP
        vec = ops.index_vector
        self.values = vec(part.values, like)
        self.indices = vec(part.indices, like)
        # Shifted indices in ``wide`` (int32 where the buffer allows: one
        # operation; a wider sum is a cast more).
        self.offsets = self.limits = None
        if self.bitmap:
            # Bit positions come as the framework's index dtype: so do these.
            assert part.offsets is not None and part.limits is not None
            wide = "int64"
            self.offsets, self.limits = vec(part.offsets, like), vec(part.limits, like)
        elif part.offsets is not None:
            self.offsets = ops.cast(vec(part.offsets, like), wide)
        self.ends = self.end_offsets = self.slots = self.ordinals = self.table = None
        if part.ends is not None:
            assert part.end_offsets is not None and part.slots is not None
            assert part.ordinals is not None and part.table is not None
            self.ends = vec(part.ends, like)
            self.end_offsets = vec(part.end_offsets, like)
            self.slots = vec(part.slots, like)
            self.ordinals = vec(part.ordinals, like)
            self.table = ops.cast(vec(part.table, like), wide)
        n, slots = len(part.indices), len(part.values)
        self.slots_total = slots
        self.scratch: Tuple[Any, ...] = (None,) * 4
        if ops.reuses_outputs:
            narrow = "uint8" if self.bitmap else "int16" if self.block16 else "int32"
            self.scratch = (
                ops.zeros(slots, value_dtype.value, like),
                ops.zeros(n, narrow, like),
                ops.zeros(slots, wide, like),
                ops.zeros(len(part.ends), "int32", like) if part.ends is not None else None,
            )

    def decode(self, ops: ArrayOps, words: Any) -> Any:
        """This part's slots' indices into the dense buffer (int64 or int32)."""
        s = self.scratch
        if self.bitmap:
            raw = ops.take(ops.view_as(words, "uint8"), self.indices, s[1])
            bits = ops.nonzero_static(ops.unpack_bits(raw), self.slots_total, 0)
            return ops.minimum_(ops.add_indices(bits, self.offsets, s[2]), self.limits)
        if not self.block16:
            idx = ops.take(words, self.indices, s[1])
            return ops.add_indices(idx, self.offsets, s[2]) if self.offsets is not None else idx
        low = ops.unsigned16(ops.take(ops.view_as(words, "int16"), self.indices, s[1]))
        if self.ends is None:
            return ops.add_indices(low, self.offsets, s[2])
        # Each slot's (member, block): how many ends (shifted to the part's
        # slot numbering, so one search serves every member) lie at or below
        # it, plus the ordinal of its member.
        ends = ops.add_indices(ops.take(words, self.ends, s[3]), self.end_offsets, None)
        block = ops.add_indices(ops.count_at_or_below(ends, self.slots), self.ordinals, None)
        return ops.add_indices(low, ops.take(self.table, block), s[2])


@dataclass(frozen=True)
class LayerPlan:
    """How one layer is sent at a given density (pure numbers).

    ``sparse`` is False when the layer is below ``min_sparse_size`` or when a
    sparse message (values and indices) would not be smaller than the dense
    float32 gradient.
    """

    numel: int
    k: int
    capacity: int
    sparse: bool
    value_dtype: ValueDType = ValueDType.FLOAT32
    index_coding: IndexCoding = IndexCoding.INT32

    @property
    def sparse_bytes(self) -> int:
        """Bytes of this layer's sparse message sent alone, less the
        fingerprint (:func:`member_bytes`)."""
        return member_bytes(self.numel, self.capacity, self.value_dtype, self.index_coding)

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank contributes per step when sent by the per-layer rule:
        its sparse message, or the float32 dense gradient."""
        return self.sparse_bytes if self.sparse else self.numel * 4


def per_layer(density: Union[float, Sequence[float]], n: int) -> List[float]:
    """``density`` as a list of floats: ``n`` copies of one, or each of a sequence."""
    if isinstance(density, (int, float, Real)):
        return [float(density)] * n
    return [float(d) for d in density]


def plan_layers(
    sizes: Sequence[int], density: Union[float, Sequence[float]], config: SparsityConfig
) -> List[LayerPlan]:
    """Target count, capacity and sparse/dense decision of each layer, at one
    ``density`` for all or a density per layer (``density="auto"``'s
    per-layer choice)."""
    each = per_layer(density, len(sizes))
    if len(each) != len(sizes):
        raise ValueError(f"density must have one entry per layer ({len(sizes)}), got {len(each)}")
    plans = []
    for n, d in zip(sizes, each):
        k = max(1, math.ceil(d * n))
        cap = min(n, math.ceil(config.max_ratio * k))
        coding = config.index_coding
        # Sparse only where its message (less the count word) beats the dense one.
        sparse = (
            n >= config.min_sparse_size
            and member_bytes(n, cap, config.value_dtype, coding) - 4 < dense_itemsize(config) * n
        )
        plans.append(LayerPlan(n, k, cap, sparse, config.value_dtype, coding))
    return plans


def dense_itemsize(config: SparsityConfig) -> int:
    """Bytes per element of a dense message (``SparsityConfig.dense_dtype``)."""
    return 4 if config.dense_dtype is ValueDType.FLOAT32 else 2


def layout_bytes(
    sizes: Sequence[int], density: Union[float, Sequence[float]], config: SparsityConfig
) -> int:
    """Bytes one rank sends per step layer by layer at ``density`` (one for
    every layer, or each layer's): each sparse
    layer's message at capacity with its fingerprint word, each other layer
    dense (what ``SparseExchange.wire_bytes()`` counts for that layout)."""
    item = dense_itemsize(config)
    return sum(
        p.sparse_bytes + 4 if p.sparse else item * p.numel
        for p in plan_layers(sizes, density, config)
    )


def fit_budget(sizes: Sequence[int], config: SparsityConfig) -> SparsityConfig:
    """``config`` (which has a budget) at the density that fits it
    (:func:`density_for_budget`). Where ``value_dtype="auto"`` chose float16
    and float32 values fit at density 1.0, float32 at density 1.0: a budget
    that asks for no compression gets the plain sum."""
    if config.values_chosen:
        wide = replace(config, value_dtype=ValueDType.FLOAT32)
        if layout_bytes(sizes, 1.0, wide) <= budget_bytes(sizes, config):
            return replace(wide, density=1.0)
    return replace(config, density=density_for_budget(sizes, config))


def budget_bytes(sizes: Sequence[int], config: SparsityConfig) -> float:
    """``config.budget`` in bytes per step (a fraction: of the float32 dense
    bytes of ``sizes``)."""
    budget = config.budget
    assert budget is not None
    return budget if isinstance(budget, int) else budget * 4 * sum(sizes)


def density_for_budget(sizes: Sequence[int], config: SparsityConfig) -> float:
    """The largest density whose layer-wise layout sends at most
    ``config.budget`` bytes per step (an int, or a fraction of the float32
    dense bytes), by bisection over the density (the bytes never fall as it
    rises). ``ValueError`` naming the budget where even one entry per sparse
    layer, with the small layers dense, costs more."""
    budget = config.budget
    target = budget_bytes(sizes, config)
    lo, hi = 1.0 / max(sizes), 1.0  # at lo every layer sends one entry
    least = layout_bytes(sizes, lo, config)
    if least > target:
        raise ValueError(
            f"budget={budget!r} ({target:.0f} bytes per step) is below the least these "
            f"layers can send: {least} bytes (one entry per sparse layer, the layers "
            f"below min_sparse_size={config.min_sparse_size} dense)"
        )
    if layout_bytes(sizes, hi, config) <= target:
        return hi
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if layout_bytes(sizes, mid, config) <= target else (lo, mid)
    return lo
