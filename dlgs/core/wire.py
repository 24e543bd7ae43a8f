"""Wire format: a merge group's sparse layers in one fixed-size int32 buffer.

Layout of one rank's chunk (all words int32; value bits are reinterpreted)::

    [ fingerprint | count_1 .. count_m | values (C, float32 or float16) | indices (C) ]

with ``C = sum(cap_i)``. Member ``i`` owns values and indices
``[o_i, o_i + cap_i)`` with ``o_i = sum(cap_j, j < i)``. Each index already
includes the member's offset in the group's *dense* buffer, which has one extra
"padding slot" per member (``dense_offset_i + n_i``): unused capacity points
there with value 0, so unpacking never needs the number of selected values on
the host. A step's sparse messages are unpacked together (:class:`UnpackPlan`):
their outputs concatenated, two gathers and one scatter-add into one dense
buffer where each message's part starts at its base, whatever the number of
messages. A count of -1 says the member's
gradient was non-finite on that rank (every receiver then marks the layer
non-finite).

The chunk size is fixed by the layout, so every step sends the same shape
(Horovod's response cache hits and nothing renegotiates) and every rank's chunk
has the same size: a size mismatch after the allgather proves the ranks
disagree on the layout and is reported as an error. The fingerprint lets the
receiver check the same thing word-for-word once per layout.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from .backend import ArrayOps
from .config import SparsityConfig, ValueDType

__all__ = [
    "GroupLayout",
    "LayoutMismatchError",
    "UnpackPlan",
    "member_bytes",
    "unpack",
    "value_bytes",
]


class LayoutMismatchError(RuntimeError):
    """Ranks disagree on a merge group's layout (different models or options)."""


_VALUE_BYTES = {ValueDType.FLOAT32: 4, ValueDType.FLOAT16: 2}


def value_bytes(value_dtype: ValueDType) -> int:
    """Bytes of one value on the wire."""
    return _VALUE_BYTES[ValueDType(value_dtype)]


def member_bytes(capacity: int, value_dtype: ValueDType) -> int:
    """Bytes one layer sent alone adds to its message: the count word, its
    values padded to whole words and its int32 indices (the message adds one
    fingerprint word). Every size formula in dlgs calls this or GroupLayout."""
    return 4 * (1 + math.ceil(capacity * value_bytes(value_dtype) / 4) + capacity)


@dataclass(frozen=True)
class GroupLayout:
    """Offsets of one merge group's chunk; pure metadata, no tensors.

    Args:
        sizes: element count ``n_i`` of each member, in order.
        caps: capacity ``cap_i`` (values sent) of each member.
        value_dtype: dtype of values on the wire.
    """

    sizes: Tuple[int, ...]
    caps: Tuple[int, ...]
    value_dtype: ValueDType = ValueDType.FLOAT32
    fingerprint: int = field(init=False)

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.caps) or not self.sizes:
            raise ValueError("sizes and caps must be non-empty and of equal length")
        for n, c in zip(self.sizes, self.caps):
            if not (0 < c <= n):
                raise ValueError(f"capacity must be in [1, n], got cap={c} for n={n}")
        object.__setattr__(self, "value_dtype", ValueDType(self.value_dtype))
        key = repr((self.sizes, self.caps, self.value_dtype.value)).encode()
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
    def header_words(self) -> int:
        return 1 + self.members

    @property
    def value_words(self) -> int:
        return math.ceil(self.total_capacity * _VALUE_BYTES[self.value_dtype] / 4)

    @property
    def chunk_words(self) -> int:
        return self.header_words + self.value_words + self.total_capacity

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
        return ops.narrow(chunk, 0, self.header_words + self.value_words, self.total_capacity)

    def new_chunk(self, ops: ArrayOps, like: Any) -> Any:
        """An int32 send buffer with the fingerprint written in."""
        chunk = ops.zeros(self.chunk_words, "int32", like)
        head = ops.narrow(chunk, 0, 0, 1)
        ops.copy_(head, ops.cast(ops.scalar(float(self.fingerprint), like), "int32"))
        return chunk

    def member_views(self, ops: ArrayOps, chunk: Any, i: int) -> Tuple[Any, Any, Any]:
        """Member ``i``'s value slots, index slots and count word in ``chunk``
        (views: make them once per chunk, then :meth:`pack_into` every step)."""
        cap, off = self.caps[i], self.value_offset(i)
        return (
            ops.narrow(self.values_view(ops, chunk), 0, off, cap),
            ops.narrow(self.indices_view(ops, chunk), 0, off, cap),
            ops.narrow(chunk, 0, 1 + i, 1),
        )

    def pack_into(
        self,
        ops: ArrayOps,
        views: Tuple[Any, Any, Any],
        i: int,
        source: Any,
        idx: Any,
        count: Any,
    ) -> Any:
        """Write member ``i``'s message into its :meth:`member_views`: the values
        ``source[idx]`` (in the wire dtype), the indices shifted to the member's
        place in the dense buffer, and its count word (its selected count, or -1
        when its accumulated gradient was non-finite on this rank). Returns the
        values as written (for the residual)."""
        values, indices, word = views
        ops.gather_(source, idx, values)
        ops.add_offset_(indices, idx, self.dense_offset(i))
        ops.copy_(word, count)
        return values

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
class UnpackPlan:
    """Where every rank's values, indices and count words of a step's sparse
    messages lie once their allgathered outputs are concatenated in message
    order, and where each message lands in one dense buffer for all of them.
    Pure metadata (NumPy int64 vectors), made once per layout.

    All vectors are rank-major: rank 0's entries of every message, then rank
    1's, and so on; so :func:`unpack` adds rank by rank where it must
    (:meth:`~dlgs.core.backend.ArrayOps.index_add_rows_`), and within one rank's
    row every index is unique (messages occupy disjoint parts of the buffer)
    except the padding slots, which only receive zeros.
    """

    #: Positions of the values, in units of the wire value dtype.
    values: np.ndarray
    #: Positions of the indices, in words.
    indices: np.ndarray
    #: Each index's message base in the dense buffer (None: one message, base 0).
    offsets: Optional[np.ndarray]
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
        per_word = 4 // _VALUE_BYTES[layouts[0].value_dtype]
        word_bases = np.cumsum([0] + [world * lay.chunk_words for lay in layouts])
        bases = [int(b) for b in np.cumsum([0] + [lay.dense_size for lay in layouts])]
        values, indices, offsets, counts = [], [], [], []
        for r in range(world):
            for lay, words, base in zip(layouts, word_bases, bases):
                start = int(words) + r * lay.chunk_words
                slots = np.arange(lay.total_capacity, dtype=np.int64)
                values.append(per_word * (start + lay.header_words) + slots)
                indices.append(start + lay.header_words + lay.value_words + slots)
                offsets.append(np.full(lay.total_capacity, base, np.int64))
                counts.append(start + 1 + np.arange(lay.members, dtype=np.int64))
        firsts = [
            base + lay.dense_offset(m)
            for lay, base in zip(layouts, bases)
            for m in range(lay.members)
        ]
        return cls(
            values=np.concatenate(values),
            indices=np.concatenate(indices),
            offsets=np.concatenate(offsets) if len(layouts) > 1 else None,
            counts=np.concatenate(counts),
            firsts=np.asarray(firsts, np.int64),
            bases=tuple(bases[:-1]),
            dense_size=bases[-1],
        )


def unpack(
    ops: ArrayOps,
    words: Any,
    world: int,
    value_dtype: ValueDType,
    dense: Any,
    scale: Any,
    at: Tuple[Any, Any, Any, Any],
    scratch: Tuple[Any, Any, Any, Any],
) -> Any:
    """Scatter-add every rank's values (multiplied by ``scale``) of a step's
    sparse messages into ``dense`` (:attr:`UnpackPlan.dense_size`, zeroed by the
    caller), ``words`` being their allgathered outputs concatenated in message
    order. ``at``: the plan's values, indices, offsets (or None) and counts as
    index vectors; ``scratch``: reused buffers for what is gathered from
    ``words`` (values, indices, shifted indices, counts). Returns every rank's
    count words (rank-major, members in message order) and each member's flag
    (1-D bool): non-finite on some rank. A fixed number of
    operations whatever the numbers of messages and ranks. Call
    :meth:`GroupLayout.check_gathered` on each output first."""
    values_at, indices_at, offsets, counts_at = at
    values = ops.take(ops.view_as(words, value_dtype.value), values_at, scratch[0])
    indices = ops.take(words, indices_at, scratch[1])
    if offsets is not None:
        indices = ops.add_indices(indices, offsets, scratch[2])
    ops.index_add_rows_(dense, indices, values, scale, world)
    counts = ops.take(words, counts_at, scratch[3])
    return counts, ops.any_negative_rows(counts, world)


@dataclass(frozen=True)
class LayerPlan:
    """How one layer is sent at a given density (pure numbers).

    ``sparse`` is False when the layer is below ``min_sparse_size`` or when a
    sparse message (values + int32 indices) would not be smaller than the dense
    float32 gradient.
    """

    numel: int
    k: int
    capacity: int
    sparse: bool
    value_dtype: ValueDType = ValueDType.FLOAT32

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank contributes per step when sent by the per-layer rule:
        a count word, values and int32 indices, or the float32 dense gradient."""
        return member_bytes(self.capacity, self.value_dtype) if self.sparse else self.numel * 4


def plan_layers(sizes: Sequence[int], density: float, config: SparsityConfig) -> List[LayerPlan]:
    """Target count, capacity and sparse/dense decision of each layer."""
    plans = []
    for n in sizes:
        k = max(1, math.ceil(density * n))
        cap = min(n, math.ceil(config.max_ratio * k))
        # Sparse only where its message (less the count word) beats the dense one.
        sparse = n >= config.min_sparse_size and member_bytes(cap, config.value_dtype) - 4 < 4 * n
        plans.append(LayerPlan(n, k, cap, sparse, config.value_dtype))
    return plans
