"""torch implementation of :class:`dlgs.core.backend.ArrayOps`.

Device-agnostic: the same calls run on CPU and CUDA. Nothing here calls
``.item()`` or otherwise reads a device value, except :meth:`to_host`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["TorchOps", "OPS"]

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}


class TorchOps:
    """Array primitives for the core, on torch tensors."""

    reuses_outputs = True

    def zeros(self, n: int, dtype: str, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n, dtype=_DTYPES[dtype], device=like.device)

    def scalar(self, value: float, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(value, dtype=torch.float32, device=like.device)

    def view_as(self, x: torch.Tensor, dtype: str) -> torch.Tensor:
        return x.view(_DTYPES[dtype])

    def narrow(self, x: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
        return x.narrow(dim, start, length)

    def reshape(self, x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        # view() where it can: one operation where reshape() issues two.
        return x.view(tuple(shape)) if x.is_contiguous() else x.reshape(tuple(shape))

    def numel(self, x: torch.Tensor) -> int:
        return x.numel()

    def cast(self, x: torch.Tensor, dtype: str) -> torch.Tensor:
        return x.to(_DTYPES[dtype])

    def add_(self, dst, src):
        return dst.add_(src.reshape(-1))

    def scale_add_(self, dst, scale, src):
        return dst.mul_(scale).add_(src.reshape(-1))

    def abs_(self, x, out):
        return torch.abs(x, out=out)

    def ge_(self, x, thr, out):
        return torch.ge(x, thr, out=out)

    def count_nonzero(self, mask):
        return torch.count_nonzero(mask)

    def nonzero_static(self, mask, size, fill):
        return torch.nonzero_static(mask, size=size, fill_value=fill).view(-1)

    def gather_(self, src, idx, out):
        if out.dtype == src.dtype:
            return torch.index_select(src, 0, idx, out=out)
        return out.copy_(src.index_select(0, idx))

    def gather_clamped_(self, src, idx, out, bound):
        # One temporary, as gather_ into another dtype: the cast makes values
        # beyond float16's range infinite, the clamp in place brings them back.
        return out.copy_(src.index_select(0, idx)).clamp_(-bound, bound)

    def take(self, src, idx, out=None):
        if out is not None and out.dtype == src.dtype:
            return torch.index_select(src, 0, idx, out=out)
        return torch.index_select(src, 0, idx)

    def concat(self, xs):
        return torch.cat(list(xs))

    def add_indices(self, idx, offsets, out):
        return torch.add(idx, offsets, out=out)

    def fill_at_(self, dst, idx, value):
        return dst.scatter_(0, idx, value)  # two operations where index_fill_ issues three

    def sub_at_(self, dst, idx, vals):
        return dst.index_add_(0, idx, vals, alpha=-1)

    def copy_(self, dst, src):
        # A 0-d source broadcasts; reshaping it would be one more operation.
        if src.dim() == 0 or src.shape == dst.shape:
            return dst.copy_(src)
        if dst.is_contiguous() and src.numel() == dst.numel():
            dst.view(src.shape).copy_(src)  # a strided source: no copy of it first
            return dst
        return dst.copy_(src.reshape(dst.shape))

    def write_columns_(self, dst, rows, start, width, src):
        cols = dst.view(rows, -1).narrow(1, start, width)
        if src.numel() == 1:
            return cols.copy_(src.reshape(()))
        return cols.copy_(src.reshape(rows, width))

    def count_below_(self, out, sorted_idx, bounds):
        return torch.searchsorted(sorted_idx, bounds, out_int32=True, out=out)

    def count_at_or_below(self, ends, values):
        if values.dtype != ends.dtype:
            values = values.to(ends.dtype)
        return torch.searchsorted(ends, values, right=True)

    def unsigned16(self, x):
        return x.to(torch.int32).bitwise_and_(0xFFFF)

    def where_below(self, idx, bound, other):
        return torch.where(torch.lt(idx, _const(bound, idx.dtype, idx.device)), idx, other)

    def set_bits_(self, out, positions, scratch):
        scratch.zero_().scatter_(0, positions, True)
        # Distinct powers of two: the sum of a byte's bits fits in uint8.
        bits = scratch.view(torch.uint8).view(-1, 8).mul(_bit_weights(out.device))
        return torch.sum(bits, 1, dtype=torch.uint8, out=out)

    def unpack_bits(self, x):
        # Each bit's own value, not a bool: nonzero where set, one operation less.
        return x.view(-1, 1).bitwise_and(_bit_weights(x.device)).view(-1)

    def minimum_(self, x, limits):
        return torch.minimum(x, limits, out=x)

    def add_offset_(self, dst, idx, offset):
        if not offset:
            return dst.copy_(idx)
        # A cached 0-d offset of dst's dtype: a Python int would cost a cast
        # (four more operations), an int64 sum a temporary.
        return dst.copy_(idx).add_(_const(offset, dst.dtype, dst.device))

    def index_add_rows_(self, dst, idx, vals, scale, rows):
        if vals.dtype != torch.float32:
            vals = vals.to(torch.float32)
        alpha = 1.0
        if isinstance(scale, torch.Tensor):
            vals = vals * scale
        else:
            alpha = scale  # folded into the scatter: no pass, no temporary
        if dst.device.type == "cpu":
            # The CPU kernel adds serially in index order: deterministic.
            return dst.index_add_(0, idx, vals, alpha=alpha)
        # Elsewhere scatter-adds race; rows (ranks) have unique indices, so
        # adding one row at a time gives the same bits on every rank.
        idx, vals = idx.view(rows, -1), vals.view(rows, -1)
        for r in range(rows):
            dst.index_add_(0, idx[r], vals[r], alpha=alpha)
        return dst

    def region_slots(self, idx, bounds, width):
        parts = bounds.numel() - 1
        bounds = bounds.to(idx.dtype)
        # Region of each entry: how many upper bounds are at or below it.
        region = torch.searchsorted(bounds[1:], idx, right=True)
        starts = torch.searchsorted(idx, bounds[:-1])
        inside = region.clamp(max=parts - 1)
        pos = torch.arange(idx.numel(), device=idx.device) - starts[inside]
        sent = torch.lt(region, parts) & torch.lt(pos, width)
        trash = _const(parts * width, torch.int64, idx.device)
        slots = torch.where(sent, inside * width + pos, trash)
        local = (idx - bounds[inside]).to(torch.int32)
        return slots, local

    def scatter_(self, dst, idx, src):
        return dst.index_copy_(0, idx, src.to(dst.dtype) if src.dtype != dst.dtype else src)

    def add_unkept_(self, dst, idx, vals, sent, kept, slots, sent_below):
        keep = kept.index_select(0, idx) & torch.lt(slots, sent_below)
        if sent is vals:
            back = torch.where(keep, _const(0.0, vals.dtype, vals.device), vals)
        else:
            back = torch.where(keep, vals - sent, vals)
        return dst.index_add_(0, idx, back.to(dst.dtype))

    def selected_entries(self, idx, vals, pad):
        keep = vals != 0
        idx = torch.where(keep, idx.to(torch.int64), _const(pad, torch.int64, idx.device))
        order = torch.argsort(idx, stable=True)
        vals = vals.index_select(0, order)
        return idx.index_select(0, order), vals.to(torch.float32), torch.count_nonzero(keep)

    def add_high16_(self, out, low, high):
        return torch.add(low, high.to(out.dtype), alpha=65536, out=out)

    def mul_(self, x, factor):
        return x.mul_(factor) if factor != 0.0 else x.zero_()

    def add_into_(self, out, a, b, scale):
        a, b = _flat(a), _flat(b)
        if scale is None:
            return torch.add(a, b, out=out)
        return torch.addcmul(a, b, scale, out=out)

    def momentum_into_(self, out, v, momentum, g, scale):
        g = _flat(g)
        if scale is None:
            return torch.add(g, v, alpha=momentum, out=out)
        return torch.mul(v, momentum, out=out).addcmul_(g, scale)

    def mul(self, x, factor):
        return x * factor

    def reciprocal(self, x):
        return torch.reciprocal(x.to(torch.float32))

    def total(self, x):
        # Not linalg.vector_norm(x, 1): one event fewer, but 15x slower on the CPU.
        return x.sum()

    def below_inf(self, x):
        # A Python inf would become a tensor (four more operations) every call.
        return torch.lt(x, _const(math.inf, x.dtype, x.device))

    def count_or_flag(self, count, ok):
        return torch.where(ok, count, _const(-1, count.dtype, count.device))

    def any_negative_rows(self, x, rows):
        return torch.lt(x, _const(0, x.dtype, x.device)).view(rows, -1).any(0)

    def any_nonfinite(self, xs):
        # The max-norm propagates NaN and cannot overflow (a sum could); NaN < inf
        # is false, so one comparison covers both.
        # torch's one-kernel norm of a list (torch.linalg has none).
        # Empty tensors (a parameter with no elements) hold nothing non-finite,
        # and the max-norm of an empty tensor is undefined: left out.
        flat = [x if x.dim() == 1 else x.reshape(-1) for x in xs if x.numel()]
        if not flat:
            return torch.zeros((), dtype=torch.bool, device=xs[0].device)
        norms = torch._foreach_norm(flat, math.inf)  # noqa: SLF001
        return ~torch.lt(
            torch.stack(norms), _const(math.inf, norms[0].dtype, norms[0].device)
        ).all()

    def any_true(self, flags):
        if len(flags) == 1:
            return flags[0].any()
        return torch.cat([f if f.dim() == 1 else f.reshape(1) for f in flags]).any()

    def threshold_from_factor(self, total, factor, n, floor):
        a = (factor.reshape(()) / float(n)).to(torch.float32)
        return total.to(torch.float32) * a + floor

    def none_true(self, flags):
        return torch.logical_not(self.any_true(flags))

    def select_(self, dst, flag, src):
        return dst.copy_(torch.where(flag, src, dst))

    def index_vector(self, values, like):
        host = torch.from_numpy(np.asarray(values, dtype=np.int64))
        return host.to(like.device) if like.device.type != "cpu" else host

    def nan_at_(self, dst, idx, flags):
        marks = torch.where(
            flags, _const(math.nan, dst.dtype, dst.device), _const(0.0, dst.dtype, dst.device)
        )
        return dst.index_add_(0, idx, marks)

    def kth_largest(self, x, k):
        return torch.topk(x, k, sorted=False).values.min()

    def strided(self, x, stride):
        return x[::stride]

    def clamp(self, x, low, high):
        return torch.clamp(x, low, high)

    def affine(self, x, a, b):
        return torch.add(_const(float(b), x.dtype, x.device), x, alpha=a)

    def to_host(self, x: torch.Tensor) -> Any:
        return x.tolist()

    def stack(self, xs):
        return torch.stack(list(xs))

    def fused_selection(self, like, mode):
        if mode == "torch":
            return None
        if mode == "auto" and like.device.type != "cuda":
            return None
        try:
            from . import _triton
        except ImportError as err:
            if mode == "auto":
                return None
            raise ImportError(
                f"kernels='triton' needs Triton (pip install triton): {err}"
            ) from None
        if like.device.type != "cuda" and not _triton.INTERPRETED:
            raise ValueError(
                f"kernels='triton' runs on CUDA tensors (got {like.device.type}); on the CPU "
                "only under Triton's interpreter (TRITON_INTERPRET=1, for tests)"
            )
        return _triton.TritonSelection()


_CONSTS: dict = {}


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``x`` as 1-D; a tensor that already is one as it is (no operation), a
    contiguous one as a view (one operation)."""
    if x.dim() == 1:
        return x
    return x.view(-1) if x.is_contiguous() else x.reshape(-1)


def _bit_weights(device: torch.device) -> torch.Tensor:
    """The uint8 row ``[1, 2, 4, ..., 128]``, cached per device."""
    key = ("bits", device)
    t = _CONSTS.get(key)
    if t is None:
        t = _CONSTS[key] = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8).to(device)
    return t


def _const(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached 0-d constant: a Python scalar in ``torch.where`` would build a
    tensor (one more operation, on a GPU one more launch) every call."""
    key = (value if value == value else "nan", dtype, device)
    t = _CONSTS.get(key)
    if t is None:
        t = _CONSTS[key] = torch.tensor(value, dtype=dtype, device=device)
    return t


OPS = TorchOps()
