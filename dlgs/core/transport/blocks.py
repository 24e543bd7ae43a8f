"""Fixed-size blocks of ``(offset, value)`` entries, the reduction's wire format.

:class:`~dlgs.core.transport.reduction.SparseReduction` moves ``rows`` blocks per
collective (one per region owner, or one per rank): each of ``width`` entries
with an offset in ``[0, limit]`` (ascending within a block, padded at the end
with the largest) and a value, plus one int32 word (a count or a flag). A
block is a whole number of int32 words::

    [word] [block counts: hi words] [offsets] [values]

* **offsets**: int32, or their low 16 bits with, per 65,536-element boundary
  below ``limit``, the count of the block's offsets under it (``compact``;
  the allgather's ``block16`` coding, applied per block). Half the bytes where
  ``width`` is large against ``limit / 65536``.
* **values**: float32, float16 or bfloat16 (a 16-bit value takes half a
  word). :meth:`BlockFormat.write` rounds to them; the caller keeps the
  rounding error (the reduction puts it back into a residual).

Every operation is on whole blocks at once (no loop over rows or entries, no
host read); the buffers are made once.
"""

from __future__ import annotations

from typing import Any, Tuple

from ..backend import ArrayOps
from ..config import IndexCoding, ValueDType

__all__ = ["BlockFormat", "block_words", "compact_offsets", "even_width"]

_SPAN = 65536  # offsets per 16-bit block


def compact_offsets(width: int, limit: int, coding: IndexCoding) -> bool:
    """Whether blocks of ``width`` offsets up to ``limit`` use 16-bit offsets
    with block counts: never with ``int32`` coding, else where smaller (the
    counts, one word per 65,536 offsets, cost less than the saved half
    words)."""
    if IndexCoding(coding) is IndexCoding.INT32:
        return False
    return limit // _SPAN < width // 2


def even_width(width: int, value_dtype: ValueDType, compact: bool) -> int:
    """``width`` rounded up to even where a 16-bit part packs two per word."""
    narrow = compact or ValueDType(value_dtype) is not ValueDType.FLOAT32
    return width + (width % 2 if narrow else 0)


def block_words(width: int, limit: int, value_dtype: ValueDType, coding: IndexCoding) -> int:
    """int32 words of one block of at most ``width`` entries with offsets up
    to ``limit``, as :class:`BlockFormat` lays it out (pure arithmetic)."""
    compact = compact_offsets(width, limit, coding)
    width = even_width(width, value_dtype, compact)
    return _words(width, limit, ValueDType(value_dtype), compact)


def _words(width: int, limit: int, value_dtype: ValueDType, compact: bool) -> int:
    hi = limit // _SPAN if compact else 0
    narrow = value_dtype is not ValueDType.FLOAT32
    return 1 + hi + (width // 2 if compact else width) + (width // 2 if narrow else width)


class BlockFormat:
    """``rows`` blocks of ``width`` entries back to back in a flat int32 buffer.

    Args:
        ops: the framework's array operations.
        rows: blocks per buffer.
        width: entries per block (even where a part is 16-bit:
            :func:`even_width`).
        limit: the largest offset any block holds (its padding included).
        value_dtype: the values' dtype on the wire.
        compact: 16-bit offsets with block counts (:func:`compact_offsets`).
        like: a tensor on the device.
    """

    def __init__(
        self,
        ops: ArrayOps,
        rows: int,
        width: int,
        limit: int,
        value_dtype: ValueDType,
        compact: bool,
        like: Any,
    ):
        value_dtype = ValueDType(value_dtype)
        if even_width(width, value_dtype, compact) != width:
            raise ValueError(f"width must be even with 16-bit parts, got {width}")
        self.ops, self.rows, self.width, self.limit = ops, rows, width, limit
        self.value_dtype, self.compact = value_dtype, compact
        self.narrow_values = value_dtype is not ValueDType.FLOAT32
        #: Block-count words per block (compact offsets).
        self.hi = limit // _SPAN if compact else 0
        offset_words = width // 2 if compact else width
        value_words = width // 2 if self.narrow_values else width
        self._at = (1, 1 + self.hi, 1 + self.hi + offset_words)  # counts, offsets, values
        self._words = (offset_words, value_words)
        #: int32 words per block.
        self.words = _words(width, limit, value_dtype, compact)
        cells = rows * width
        self.offsets = ops.zeros(cells, "int32", like)
        self.values = ops.zeros(cells, "float32", like)
        self.written = ops.zeros(cells, "float32", like) if self.narrow_values else None
        self.word = ops.zeros(rows, "int32", like)
        if self.hi:
            span = (self.hi + 1) * _SPAN  # above any offset: rows' keys never overlap
            hi = self.hi

            def per_row(value, n, dtype="int64"):
                vec = ops.index_vector([value(r) for r in range(rows) for _ in range(n)], like)
                return vec if dtype == "int64" else ops.cast(vec, dtype)

            # Each offset keyed by its row, so one binary search serves every row.
            self._row_keys = per_row(lambda r: r * span, width)
            self._keys = ops.zeros(cells, "int64", like)
            self._edges = ops.index_vector(
                [r * span + (b + 1) * _SPAN for r in range(rows) for b in range(hi)], like
            )
            self._below = ops.zeros(rows * hi, "int32", like)
            self._row_entries = per_row(lambda r: -r * width, hi, "int32")
            self._row_counts = per_row(lambda r: r * width, hi, "int32")
            # In the counts' dtype, so the search casts nothing per step.
            self._positions = ops.cast(ops.index_vector(list(range(cells)), like), "int32")
            self._row_spans = per_row(lambda r: -r * hi, width)
            self._counts = ops.zeros(rows * hi, "int32", like)

    def block(self, buffer: Any) -> Any:
        """``buffer`` (``rows * words`` int32) as ``(rows, words)``."""
        return self.ops.reshape(buffer, (self.rows, self.words))

    def _part(self, blocks: Any, at: int, words: int, dtype: str) -> Any:
        ops = self.ops
        return ops.view_as(ops.narrow(blocks, 1, self._at[at], words), dtype)

    def write(self, buffer: Any, offsets: Any, values: Any, word: Any) -> Any:
        """Write ``rows * width`` entries (``offsets`` integer, each row
        ascending; ``values`` float32, rounded to the wire dtype) and ``rows``
        words into ``buffer``. Returns ``values`` as written: where they are
        16-bit, their float32 values in the format's own buffer (valid until
        the next write), else ``values``."""
        ops, rows, width, at = self.ops, self.rows, self.width, self._at
        ops.write_columns_(buffer, rows, 0, 1, word)  # one word, or one per row
        if self.compact:
            # Low 16 bits (an int32 -> int16 copy keeps them) and per row the
            # number of offsets below each 65,536 boundary.
            ops.write_columns_(ops.view_as(buffer, "int16"), rows, 2 * at[1], width, offsets)
            if self.hi:
                keys = ops.add_indices(offsets, self._row_keys, self._keys)
                below = ops.count_below_(self._below, keys, self._edges)
                counts = ops.add_indices(below, self._row_entries, self._counts)
                ops.write_columns_(buffer, rows, at[0], self.hi, counts)
        else:
            ops.write_columns_(buffer, rows, at[1], width, offsets)
        if not self.narrow_values:
            ops.write_columns_(ops.view_as(buffer, "float32"), rows, at[2], width, values)
            return values
        dtype = self.value_dtype.value
        ops.write_columns_(ops.view_as(buffer, dtype), rows, 2 * at[2], width, values)
        # Read back from the buffer (where tensors are immutable, a view taken
        # before the write would hold the old values).
        return ops.copy_(self.written, self._part(self.block(buffer), 2, self._words[1], dtype))

    def read(self, buffer: Any) -> Tuple[Any, Any, Any]:
        """The ``(offsets, values, word)`` of ``rows`` blocks in ``buffer``:
        int32 ``rows * width``, float32 ``rows * width`` and int32 ``rows``
        (the format's buffers, valid until the next read)."""
        ops, width = self.ops, self.width
        blocks = self.block(buffer)
        ops.copy_(self.word, ops.narrow(blocks, 1, 0, 1))
        if self.compact:
            low = ops.unsigned16(ops.reshape(self._part(blocks, 1, self._words[0], "int16"), (-1,)))
            if self.hi:
                # An entry's 65,536-block: the boundaries its row's counts put
                # at or below its position (each row's counts shifted past the
                # rows before, so one search serves every row).
                counts = ops.copy_(self._counts, ops.narrow(blocks, 1, self._at[0], self.hi))
                ends = ops.add_indices(counts, self._row_counts, self._below)
                high = ops.count_at_or_below(ends, self._positions)
                ops.add_high16_(self.offsets, low, ops.add_indices(high, self._row_spans, None))
            else:
                ops.copy_(self.offsets, low)
        else:
            ops.copy_(self.offsets, ops.narrow(blocks, 1, self._at[1], width))
        if self.narrow_values:
            wire = self._part(blocks, 2, self._words[1], self.value_dtype.value)
        else:
            wire = self._part(blocks, 2, width, "float32")
        ops.copy_(self.values, wire)
        return self.offsets, self.values, self.word
