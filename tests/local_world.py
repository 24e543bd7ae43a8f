"""The core's exchange with no framework: NumPy arrays and P ranks as threads.

:class:`NumpyOps` implements :class:`dlgs.core.backend.ArrayOps` on NumPy, and
:class:`LocalWorld` gives each rank a :class:`~dlgs.core.exchange.exchange.Collectives`
whose collectives meet in one process (each rank runs in its own thread, as
each runs in its own process under horovodrun). A collective that not every
rank reaches fails after a timeout instead of hanging, naming who is missing,
so tests of the core can check agreement as well as arithmetic.

Used by ``tests/test_exchange_local.py``; not part of the product.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence

import numpy as np

from dlgs.core.selection.controller import NUMPY_MATH
from dlgs.inprocess import InProcessWorld, sent_values

_DT = {
    "float64": np.float64,
    "float32": np.float32,
    "float16": np.float16,
    "uint8": np.uint8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
}
_DT["bool"] = np.bool_
try:  # bfloat16 for NumPy (installed with TensorFlow)
    import ml_dtypes

    _DT["bfloat16"] = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover - bfloat16 tests skip without it
    pass


class NumpyOps:
    vector_math = NUMPY_MATH  # the controllers' float64 math, as on the host
    """ArrayOps on NumPy arrays (in place where the protocol allows)."""

    reuses_outputs = True

    def zeros(self, n, dtype, like):
        return np.zeros(n, _DT[dtype])

    def fused_selection(self, like, mode):
        if mode == "triton":
            raise ValueError("kernels='triton' is for PyTorch tensors")
        return None

    def scalar(self, value, like):
        return np.array(value, np.float32)  # 0-d and writable, like a device scalar

    def view_as(self, x, dtype):
        return x.view(_DT[dtype])

    def narrow(self, x, dim, start, length):
        index = [slice(None)] * x.ndim
        index[dim] = slice(start, start + length)
        return x[tuple(index)]

    def reshape(self, x, shape):
        return np.reshape(x, tuple(shape))

    def numel(self, x):
        return int(np.size(x))

    def cast(self, x, dtype):
        return np.asarray(x).astype(_DT[dtype])

    def add_(self, dst, src):
        dst += np.reshape(src, -1)
        return dst

    def scale_add_(self, dst, scale, src):
        dst *= scale
        dst += np.reshape(src, -1)
        return dst

    def abs_(self, x, out):
        return np.abs(x, out=out)

    def ge_(self, x, thr, out):
        return np.greater_equal(x, thr, out=out)

    def count_nonzero(self, mask):
        return np.int64(np.count_nonzero(mask))

    def nonzero_static(self, mask, size, fill):
        idx = np.flatnonzero(mask)[:size]
        return np.concatenate([idx, np.full(size - idx.size, fill, np.int64)])

    def gather_(self, src, idx, out):
        out[...] = src[idx]
        return out

    def gather_clamped_(self, src, idx, out, bound):
        out[...] = np.clip(src[idx], np.float32(-bound), np.float32(bound))
        return out

    def take(self, src, idx, out=None):
        return np.take(src, idx, out=out) if out is not None else src[idx]

    def concat(self, xs):
        return np.concatenate(list(xs))

    def add_indices(self, idx, offsets, out):
        return np.add(idx, offsets, out=out) if out is not None else idx + offsets

    def fill_at_(self, dst, idx, value):
        dst[idx] = value
        return dst

    def sub_at_(self, dst, idx, vals):
        np.subtract.at(dst, idx, np.asarray(vals, dst.dtype))
        return dst

    def copy_(self, dst, src):
        dst[...] = np.reshape(np.asarray(src), dst.shape)
        return dst

    def write_columns_(self, dst, rows, start, width, src):
        cols = np.reshape(dst, (rows, -1))[:, start : start + width]
        src = np.asarray(src)
        cols[...] = src.reshape(()) if src.size == 1 else src.reshape(rows, width)
        return dst

    def count_below_(self, out, sorted_idx, bounds):
        out[...] = np.searchsorted(sorted_idx, bounds, side="left")
        return out

    def count_at_or_below(self, ends, values):
        return np.searchsorted(ends, values, side="right").astype(np.int64)

    def unsigned16(self, x):
        return np.asarray(x, np.int16).view(np.uint16).astype(np.int32)

    def where_below(self, idx, bound, other):
        return np.where(idx < bound, idx, other)

    def set_bits_(self, out, positions, scratch):
        scratch[...] = False
        scratch[positions] = True
        out[...] = np.packbits(scratch, bitorder="little")
        return out

    def unpack_bits(self, x):
        return np.unpackbits(np.asarray(x, np.uint8), bitorder="little").astype(bool)

    def minimum_(self, x, limits):
        return np.minimum(x, limits, out=x)

    def add_offset_(self, dst, idx, offset):
        dst[...] = idx + offset
        return dst

    def index_add_rows_(self, dst, idx, vals, scale, rows):
        vals = np.asarray(vals, np.float32) * np.float32(scale)
        np.add.at(dst, np.reshape(idx, -1), np.reshape(vals, -1))
        return dst

    def mul_(self, x, factor):
        if factor == 0.0:
            x[...] = 0  # clears NaN too (NaN * 0 is NaN)
        else:
            x *= factor
        return x

    def add_into_(self, out, a, b, scale):
        b = np.reshape(b, -1)
        out[...] = np.reshape(a, -1) + (b if scale is None else b * scale)
        return out

    def momentum_into_(self, out, v, momentum, g, scale):
        g = np.reshape(g, -1)
        out[...] = v * np.float32(momentum) + (g if scale is None else g * scale)
        return out

    def mul(self, x, factor):
        return x * factor

    def reciprocal(self, x):
        return np.float32(1.0) / np.float32(x)

    def total(self, x):
        with np.errstate(over="ignore"):
            return np.float32(np.sum(x, dtype=np.float32))

    def below_inf(self, x):
        return np.less(x, np.inf)

    def count_or_flag(self, count, ok):
        return np.where(ok, count, -1)

    def any_negative_rows(self, x, rows):
        return (np.reshape(x, (rows, -1)) < 0).any(axis=0)

    def any_nonfinite(self, xs):
        return not all(np.isfinite(x).all() for x in xs)

    def any_true(self, flags):
        return any(bool(np.any(f)) for f in flags)

    def threshold_from_factor(self, total, factor, n, floor):
        a = np.float32(float(np.asarray(factor).reshape(())) / n)
        return np.float32(total * a + np.float32(floor))

    def none_true(self, flags):
        return not self.any_true(flags)

    def select_(self, dst, flag, src):
        if flag:
            dst[...] = src
        return dst

    def index_vector(self, values, like):
        return np.asarray(values, np.int64)

    def nan_at_(self, dst, idx, flags):
        dst[idx] += np.where(flags, np.float32(np.nan), np.float32(0))
        return dst

    def kth_largest(self, x, k):
        return np.partition(x, x.size - k)[x.size - k]

    def strided(self, x, stride):
        return x[::stride]

    def clamp(self, x, low, high):
        return np.clip(x, np.float32(low), np.float32(high))

    def affine(self, x, a, b):
        return np.float32(x * np.float32(a) + np.float32(b))

    def to_host(self, x):
        return np.asarray(x).tolist()

    def stack(self, xs):
        return np.stack(xs)


OPS = NumpyOps()


class LocalWorld(InProcessWorld):
    """``size`` ranks in one process (:class:`dlgs.inprocess.InProcessWorld`);
    :meth:`run` runs ``fn(rank, comm)`` on each, in threads.

    Args:
        size: number of ranks.
        timeout: seconds a collective waits for the other ranks before failing.
        average: allreduce averages (``hvd.Average``), else sums (``hvd.Sum``).
    """

    def __init__(self, size: int, timeout: float = 10.0, average: bool = True):
        super().__init__(size, timeout)
        self.average = average

    def comm(self, rank: int) -> "LocalComm":
        return LocalComm(self, rank)

    def run(self, fn: Callable[[int, "LocalComm"], Any]) -> List[Any]:  # type: ignore[override]
        """``fn(rank, comm)`` on every rank concurrently; each rank's result."""
        return super().run(lambda r: fn(r, self.comm(r)))


class LocalComm:
    """One rank's :class:`~dlgs.core.exchange.exchange.Collectives` in a :class:`LocalWorld`."""

    def __init__(self, world: LocalWorld, rank: int):
        self.world = world
        self.rank = rank
        self.size = world.size
        self.included = True

    def allgather_async(self, chunk, name):
        return ("gather", name, np.array(chunk, copy=True))

    def allreduce_async(self, tensor, name):
        return ("reduce", name, tensor)

    def synchronize(self, handle):
        kind, name, tensor = handle
        if kind == "gather":
            return self.world.meet(self.rank, name, tensor, np.concatenate)
        div = self.size if self.world.average else 1
        total = self.world.meet(
            self.rank, name, np.array(tensor, np.float64), lambda ps: sum(ps) / div
        )
        tensor[...] = total.astype(tensor.dtype).reshape(tensor.shape)
        return tensor

    def broadcast_object(self, obj):
        return self.world.meet(self.rank, "broadcast_object", obj, lambda ps: ps[0])

    def allgather_object(self, obj, name):
        return self.world.meet(self.rank, name, obj, list)


def run_steps(
    world: LocalWorld,
    make: Callable[[int, LocalComm], Any],
    grads: Callable[[int, int], Sequence[np.ndarray]],
    steps: int,
    record: Callable[[int, Any, Dict[int, Any]], Any] = lambda r, ex, out: None,
) -> List[List[Any]]:
    """Build an exchange per rank with ``make(rank, comm)`` and run ``steps``
    steps (:meth:`dlgs.inprocess.InProcessWorld.run_steps`). Returns each
    rank's records."""
    return world.run_steps(lambda rank: make(rank, world.comm(rank)), grads, steps, record)


def sent_and_residuals(rank, ex, out):
    """A :func:`run_steps` record: :func:`sent_values` and the residuals of
    the same layers (float64)."""
    sent = sent_values(ex)
    return sent, {i: np.asarray(ex.layers[i].residual[:-1], np.float64) for i in sent}


def assert_conserved(grads, recs, rank, layers, steps, rtol=1e-5) -> None:
    """Error feedback loses nothing: on ``rank``, over ``steps`` steps recorded
    by :func:`sent_and_residuals`, what each of ``layers`` sent plus its last
    residual equals the gradients it was given."""
    for i in layers:
        total_in = sum(grads(rank, s)[i].astype(np.float64) for s in range(steps))
        total_sent = sum(recs[rank][s][0][i] for s in range(steps))
        err = np.abs(total_sent + recs[rank][-1][1][i] - total_in).max()
        assert err <= rtol * np.abs(total_in).max(), (rank, i, err)
