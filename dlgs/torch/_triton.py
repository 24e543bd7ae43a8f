"""A layer's selection and packing in three Triton kernels.

The torch path (:mod:`dlgs.torch._ops`, driven by ``dlgs.core.exchange.exchange``)
issues about 18 kernels per sparse layer per step: add, abs, sum, compare,
count, ``nonzero_static``, gather, index coding, count word, residual clear.
Here the same work is three kernels (plus the controller's own: the sum of the
partial sums and the threshold's multiply-add):

1. :func:`_accumulate`: ``acc = residual + src * scale`` written in place of
   the spare residual, and per block of ``block`` elements the sum of
   ``|acc|`` (the controller's scale and the non-finite check).
2. :func:`_count`: per block, how many ``|acc| >= theta``.
3. :func:`_compact`: per block, its selected elements in ascending index order
   at the block's place (the exclusive prefix of the block counts) in the
   send chunk: values in the wire dtype, indices in the message's coding
   (int32 shifted to the member's offset, or block16's low 16 bits and its
   per-65,536 block counts; bitmap: an int64 index vector the torch op turns
   into bits), the padding slots, the count word (-1 when the sum is not
   finite), and the residual (and with momentum masking the velocity) cleared
   where a value was sent (or left with the wire dtype's rounding error).

Semantics are the torch path's bit for bit given the same ``theta``
(tests/test_triton.py runs both under Triton's CPU interpreter): ties select
(``>=``), NaN never selects, infinities do, selections past the capacity stay
in the residual, padding slots carry index ``n`` and value 0. What may differ
is the sum of ``|acc|`` (a different order of float32 additions; the
dynamic controller's threshold follows it, so its selection may differ at
the margin) and, with a loss scale, ``residual + grad / scale`` where a
compiler fuses the multiply-add (CUDA and Triton do by default).

Blocks: ``block`` is a power of two, at least :data:`TILE` and at most what
keeps the block count within :data:`MAX_BLOCKS` (every program of the
compaction reads all block counts once to find its place). Each program walks
its block in tiles of :data:`TILE` elements, in order.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Optional

import torch
import triton
import triton.language as tl

__all__ = ["TritonSelection", "MAX_BLOCKS", "TILE"]

#: Most blocks per layer (each compaction program reads every block's count).
MAX_BLOCKS = 1024
#: Elements per tile (a power of two that divides block16's 65,536).
TILE = 1024

_F16_MAX = 65504.0
_BLOCK16 = 1 << 16

# Codings of the index slots (constexpr CODING).
INT32, BLOCK16, INDEX64 = 0, 1, 2
# Value dtypes on the wire (constexpr VALUE).
F32, F16, BF16 = 0, 1, 2


@triton.jit
def _accumulate(
    res, src, scale, acc, partials, n, block, HAS_SCALE: tl.constexpr, TILE: tl.constexpr
):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * block
    total = 0.0
    if HAS_SCALE:
        s = tl.load(scale)
    for t in range(0, block, TILE):
        offs = start + t + tl.arange(0, TILE)
        m = offs < n
        r = tl.load(res + offs, mask=m, other=0.0)
        g = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_SCALE:
            a = r + g * s
        else:
            a = r + g
        tl.store(acc + offs, a, mask=m)
        total += tl.sum(tl.where(m, tl.abs(a), 0.0), axis=0)
    tl.store(partials + pid, total)


@triton.jit
def _count(acc, theta, counts, n, block, TILE: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * block
    th = tl.load(theta)
    c = 0
    for t in range(0, block, TILE):
        offs = start + t + tl.arange(0, TILE)
        m = offs < n
        a = tl.load(acc + offs, mask=m, other=0.0)
        c += tl.sum(((tl.abs(a) >= th) & m).to(tl.int32), axis=0)
    tl.store(counts + pid, c)


@triton.jit
def _store_index(ptrs, idx, offset, mask, CODING: tl.constexpr):
    """Index slots in the message's coding: int32 shifted to the member's
    place, block16's low 16 bits, or the int64 index itself."""
    if CODING == 0:
        tl.store(ptrs, (idx + offset).to(tl.int32), mask=mask)
    elif CODING == 1:
        tl.store(ptrs, idx.to(tl.int16), mask=mask)
    else:
        tl.store(ptrs, idx, mask=mask)


@triton.jit
def _compact(
    acc,
    theta,
    total,
    counts,
    nblocks,
    values,
    indices,
    word,
    count_out,
    bcounts,
    velocity,
    n,
    cap,
    offset,
    block,
    VALUE: tl.constexpr,
    CODING: tl.constexpr,
    MASK_VELOCITY: tl.constexpr,
    TILE: tl.constexpr,
    MAX_BLOCKS: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    start = pid.to(tl.int64) * block
    parts = tl.arange(0, MAX_BLOCKS)
    per_block = tl.load(counts + parts, mask=parts < nblocks, other=0)
    base = tl.sum(tl.where(parts < pid, per_block, 0), axis=0)
    selected = tl.sum(per_block, axis=0)
    th = tl.load(theta)
    for t in range(0, block, TILE):
        offs = start + t + tl.arange(0, TILE)
        m = offs < n
        a = tl.load(acc + offs, mask=m, other=0.0)
        sel = (tl.abs(a) >= th) & m
        pos = base + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        keep = sel & (pos < cap)
        if VALUE == 0:
            tl.store(values + pos, a, mask=keep)
            tl.store(acc + offs, tl.zeros_like(a), mask=keep)
        else:
            if VALUE == 1:
                # float16 clipped to its range (NaN passes: the comparisons fail).
                c = tl.where(a > 65504.0, 65504.0, tl.where(a < -65504.0, -65504.0, a))
                v = c.to(tl.float16)
                back = v.to(tl.float32)
            else:
                # bfloat16 rounded to nearest even in integers, as torch rounds:
                # the same bits wherever it runs (Triton's CPU interpreter
                # truncates a float32 -> bfloat16 cast). Infinities stay
                # infinite; a NaN is never selected.
                bits = a.to(tl.uint32, bitcast=True)
                half = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                v = half.to(tl.uint16).to(tl.bfloat16, bitcast=True)
                back = (half << 16).to(tl.float32, bitcast=True)
            tl.store(values + pos, v, mask=keep)
            # The wire dtype's rounding error stays in the residual.
            tl.store(acc + offs, a - back, mask=keep)
        if MASK_VELOCITY:
            tl.store(velocity + offs, tl.zeros_like(a), mask=keep)
        _store_index(indices + pos, offs, offset, keep, CODING)
        base += tl.sum(sel.to(tl.int32), axis=0)
        if CODING == 1:
            # The count of indices below each 65,536 boundary that ends a tile.
            end = start + t + TILE
            tl.store(
                bcounts + (end // 65536 - 1),
                tl.minimum(base, cap),
                mask=(end % 65536 == 0) & (end <= n),
            )
    # Padding: slots from min(selected, cap) to cap, spread over the programs.
    used = tl.minimum(selected, cap)
    share = (cap + nprog - 1) // nprog
    lo = pid.to(tl.int64) * share
    hi = tl.minimum(lo + share, cap)
    for t in range(0, share, TILE):
        slots = lo + t + tl.arange(0, TILE)
        pad = (slots >= used) & (slots < hi)
        if VALUE == 0:
            tl.store(values + slots, tl.zeros((TILE,), tl.float32), mask=pad)
        elif VALUE == 1:
            tl.store(values + slots, tl.zeros((TILE,), tl.float16), mask=pad)
        else:
            tl.store(values + slots, tl.zeros((TILE,), tl.bfloat16), mask=pad)
        _store_index(indices + slots, tl.zeros((TILE,), tl.int64) + n, offset, pad, CODING)
    if pid == 0:
        tot = tl.load(total)
        tl.store(count_out, selected)
        tl.store(word, tl.where(tot < float("inf"), selected, -1))


class _Work:
    """One layer's reused scratch: per-block partial sums and counts, its count
    (0-d int32) and, for bitmap messages, an int64 index vector."""

    __slots__ = ("n", "block", "blocks", "partials", "counts", "count", "index")

    def __init__(self, n: int, like: torch.Tensor, tile: int, max_blocks: int):
        self.n = n
        block = tile
        while -(-n // block) > max_blocks:
            block *= 2
        self.block = block
        self.blocks = max(1, -(-n // block))
        dev = like.device
        self.partials = torch.zeros(self.blocks, dtype=torch.float32, device=dev)
        self.counts = torch.zeros(self.blocks, dtype=torch.int32, device=dev)
        self.count = torch.zeros((), dtype=torch.int32, device=dev)
        self.index: Optional[torch.Tensor] = None


_VALUE = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}


class TritonSelection:
    """:class:`dlgs.core.selection.select.FusedSelection` with the kernels above."""

    name = "triton"

    def __init__(self, tile: int = TILE, max_blocks: int = MAX_BLOCKS):
        if tile & (tile - 1) or not 16 <= tile <= _BLOCK16:
            raise ValueError(f"tile must be a power of two in [16, 65536], got {tile}")
        if max_blocks & (max_blocks - 1) or not 1 <= max_blocks <= MAX_BLOCKS:
            raise ValueError(
                f"max_blocks must be a power of two in [1, {MAX_BLOCKS}], got {max_blocks}"
            )
        self.tile = tile
        self.max_blocks = max_blocks
        self.launches = 0  # kernels launched (tests, the self-check)
        # The interpreter patches triton.language while a kernel runs: ranks
        # simulated as threads (tests, the self-check) take turns.
        self._turn = _INTERPRETER_LOCK if INTERPRETED else contextlib.nullcontext()

    def workspace(self, n: int, like: torch.Tensor) -> _Work:
        return _Work(n, like, self.tile, self.max_blocks)

    def accumulate(self, work: _Work, acc, res, src, scale) -> torch.Tensor:
        src = src if src.dim() == 1 else src.reshape(-1)
        with self._turn:
            self._accumulate(work, acc, res, src, scale)
        self.launches += 1
        return work.partials

    def _accumulate(self, work: _Work, acc, res, src, scale) -> None:
        _accumulate[(work.blocks,)](
            res,
            src,
            scale if scale is not None else res,
            acc,
            work.partials,
            work.n,
            work.block,
            HAS_SCALE=scale is not None,
            TILE=self.tile,
        )

    def pack(
        self,
        work: _Work,
        acc,
        theta,
        total,
        values,
        indices,
        word,
        block_counts,
        offset: int,
        coding: str,
        velocity=None,
    ) -> Any:
        """Kernels 2 and 3: count, then compact into the member's views.
        ``coding``: "int32", "block16" or "index64" (``indices`` is then
        ignored: the selection goes to an int64 vector, returned). Returns
        ``(count, that vector or None)``."""
        cap = values.numel()
        code = {"int32": INT32, "block16": BLOCK16, "index64": INDEX64}[coding]
        if code == INDEX64:
            if work.index is None or work.index.numel() != cap:
                work.index = torch.empty(cap, dtype=torch.int64, device=acc.device)
        with self._turn:
            self._pack(
                work, acc, theta, total, values, indices, word, block_counts, offset, code, velocity
            )
        self.launches += 2
        return work.count, (work.index if code == INDEX64 else None)

    def _pack(
        self, work, acc, theta, total, values, indices, word, block_counts, offset, code, velocity
    ):
        n, cap = work.n, values.numel()
        if code == INDEX64:
            indices = work.index
        grid = (work.blocks,)
        _count[grid](acc, theta, work.counts, n, work.block, TILE=self.tile)
        _compact[grid](
            acc,
            theta,
            total,
            work.counts,
            work.blocks,
            values,
            indices,
            word,
            work.count,
            block_counts if block_counts is not None else word,
            velocity if velocity is not None else acc,
            n,
            cap,
            offset,
            work.block,
            VALUE=_VALUE[values.dtype],
            CODING=code,
            MASK_VELOCITY=velocity is not None,
            TILE=self.tile,
            MAX_BLOCKS=self.max_blocks,
        )


#: Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1`` when this
#: module was imported: Triton reads it when a kernel is defined).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_INTERPRETER_LOCK = threading.Lock()
