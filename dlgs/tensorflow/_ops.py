"""TensorFlow implementation of :class:`dlgs.core.backend.ArrayOps`.

The core is written against *mutable* buffers: it narrows a view into a send
buffer and writes into it (``gather_`` into a message's value slots,
``fill_at_`` on a residual) without using the return value. TensorFlow tensors
are immutable, so every buffer the core allocates with :meth:`TFOps.zeros` is a
1-D ``tf.Variable`` and :meth:`TFOps.narrow` / :meth:`TFOps.view_as` on it
return a :class:`_View` (variable, offset, length, dtype). Writes into a view
are in-place variable updates (``ResourceStridedSliceAssign``,
``ResourceScatterUpdate/Add/Sub``); reads are slices of the variable. Tensors
that did not come from :meth:`zeros` (gradients, collective outputs, controller
scalars) stay ordinary immutable tensors and the same operations return new
tensors for them, as the protocol allows.

Nothing here calls ``.numpy()`` except :meth:`TFOps.to_host` and, eagerly on
the CPU, the controllers' 0-d results. The same operations trace into a graph
(a step that runs on the device alone, ``DeviceSteps.ready``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

__all__ = ["TFOps", "OPS"]

_DTYPES = {
    "float64": tf.float64,
    "float32": tf.float32,
    "float16": tf.float16,
    "bfloat16": tf.bfloat16,
    "uint8": tf.uint8,
    "int16": tf.int16,
    "int32": tf.int32,
    "int64": tf.int64,
    "bool": tf.bool,
}


_CONSTS: dict = {}


def _ivec(*values: int) -> tf.Tensor:
    """A cached int32 vector constant (shape arguments): Python lists send
    TensorFlow's eager ops through their slow fallback path (~150 us)."""
    t = _CONSTS.get(values)
    if t is None:
        with tf.init_scope(), tf.device("CPU:0"):
            t = _CONSTS[values] = tf.constant(values, tf.int32)
    return t


class _View:
    """``length`` elements of dtype ``dtype`` starting at element ``start`` of
    a 1-D variable reinterpreted as ``dtype`` (same or half the width)."""

    __slots__ = ("var", "start", "length", "dtype")

    def __init__(self, var: tf.Variable, start: int, length: int, dtype: tf.DType):
        self.var = var
        self.start = start
        self.length = length
        self.dtype = dtype

    @property
    def device(self) -> str:
        return self.var.device

    @property
    def ratio(self) -> int:
        """Elements of the view's dtype per element of the variable."""
        return self.var.dtype.size // self.dtype.size

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.ratio == 1 and self.length == self.var.shape[0]

    def _slice(self, start: int, length: int) -> tf.Tensor:
        # Raw ops: ``var[a:b]`` goes through ~300 us of Python per call.
        t = tf.raw_ops.ReadVariableOp(resource=self.var.handle, dtype=self.var.dtype)
        if start == 0 and length == self.var.shape[0]:
            return t
        return tf.raw_ops.Slice(input=t, begin=_ivec(start), size=_ivec(length))

    def _assign(self, start: int, value: tf.Tensor) -> None:
        var = self.var
        size, length = int(var.shape[0]), int(value.shape[0])
        if start == 0 and length == size:
            tf.raw_ops.AssignVariableOp(resource=var.handle, value=value)
        elif 2 * length >= size:
            # Most of the variable (a layer's residual, which has one spare
            # element): one concatenation and a whole assignment. On CPU,
            # ResourceStridedSliceAssign was the slowest operation of a traced
            # step on large layers (benchmarks/tf_exchange_ops.py --ops).
            whole = tf.raw_ops.ReadVariableOp(resource=var.handle, dtype=var.dtype)
            parts = [value]
            if start:
                parts.insert(0, tf.raw_ops.Slice(input=whole, begin=_ivec(0), size=_ivec(start)))
            if start + length < size:
                rest = size - start - length
                parts.append(
                    tf.raw_ops.Slice(input=whole, begin=_ivec(start + length), size=_ivec(rest))
                )
            tf.raw_ops.AssignVariableOp(resource=var.handle, value=tf.concat(parts, 0))
        else:
            tf.raw_ops.ResourceStridedSliceAssign(
                ref=var.handle,
                begin=_ivec(start),
                end=_ivec(start + length),
                strides=_ivec(1),
                value=value,
            )

    def read(self) -> tf.Tensor:
        var, r = self.var, self.ratio
        if r == 1:
            out = self._slice(self.start, self.length)
            return out if var.dtype == self.dtype else tf.bitcast(out, self.dtype)
        w0, w1 = self.start // r, -(-(self.start + self.length) // r)
        words = tf.reshape(tf.bitcast(self._slice(w0, w1 - w0), self.dtype), [-1])
        return tf.slice(words, _ivec(self.start - w0 * r), _ivec(self.length))

    def write(self, value: Any) -> None:
        value = _vec(value, self.dtype)
        var, r = self.var, self.ratio
        if r == 1:
            if var.dtype != self.dtype:
                value = tf.bitcast(value, var.dtype)
            self._assign(self.start, value)
            return
        # Narrower dtype than the variable (float16 values in an int32 chunk):
        # read-modify-write the words the view touches.
        w0, w1 = self.start // r, -(-(self.start + self.length) // r)
        words = tf.reshape(tf.bitcast(self._slice(w0, w1 - w0), self.dtype), [-1])
        lo = self.start - w0 * r
        merged = tf.concat([words[:lo], value, words[lo + self.length :]], 0)
        self._assign(w0, tf.bitcast(tf.reshape(merged, [-1, r]), var.dtype))

    def indices(self, idx: tf.Tensor) -> tf.Tensor:
        """Indices into the variable for view indices ``idx`` (same width only)."""
        if self.ratio != 1:
            raise NotImplementedError("indexed updates on a narrower view")
        return idx + self.start if self.start else idx


def _as_view(x: Any) -> _View | None:
    if isinstance(x, _View):
        return x
    if isinstance(x, tf.Variable):
        return _View(x, 0, int(x.shape[0]), x.dtype)
    return None


def _read(x: Any) -> tf.Tensor:
    view = _as_view(x)
    return view.read() if view is not None else tf.convert_to_tensor(x)


def as_input(grad: Any) -> tf.Tensor:
    """A gradient as the exchange takes it: flat float32."""
    return tf.reshape(tf.cast(grad, tf.float32), [-1])


def _flat(x: Any) -> tf.Tensor:
    t = _read(x)
    return t if t.shape.rank == 1 else tf.reshape(t, _ivec(-1))


def _vec(x: Any, dtype: tf.DType) -> tf.Tensor:
    """``x`` as a 1-D tensor of ``dtype`` (no op when it already is one)."""
    t = _flat(x)
    return t if t.dtype == dtype else tf.cast(t, dtype)


class _TFMath:
    """The controllers' float64 vector math (``dlgs.core.selection.controller.NumpyMath``)
    in TensorFlow ops: what a step traced into a graph learns with."""

    log = staticmethod(tf.math.log)
    exp = staticmethod(tf.math.exp)
    abs = staticmethod(tf.abs)
    copy = staticmethod(tf.identity)

    @staticmethod
    def where(cond: Any, x: Any, y: Any) -> tf.Tensor:
        return tf.where(cond, tf.cast(x, tf.float64), tf.cast(y, tf.float64))

    @staticmethod
    def clip(x: Any, low: float, high: float) -> tf.Tensor:
        return tf.clip_by_value(x, tf.constant(low, tf.float64), tf.constant(high, tf.float64))

    @staticmethod
    def float64(x: Any) -> tf.Tensor:
        return tf.cast(x, tf.float64)

    @staticmethod
    def quiet() -> Any:
        return contextlib.nullcontext()  # TensorFlow does not warn on 0/0


class TFOps:
    """Array primitives for the core, on TensorFlow tensors and variables."""

    #: The controllers' float64 vector math on the device.
    vector_math = _TFMath()

    def threshold_from_factor(self, total, factor, n, floor):
        # float32(factor / n) (a float64 division, as the host's), then one
        # float32 multiply and add, as affine() on the host.
        a = tf.cast(tf.reshape(_read(factor), []) / float(n), tf.float32)
        return tf.cast(total, tf.float32) * a + _scalar_const(float(floor), tf.float32)

    # take() and add_indices() return new tensors: cheaper than a variable's update.
    reuses_outputs = False

    def fused_selection(self, like: Any, mode: str) -> None:
        if mode == "triton":
            raise ValueError(
                "kernels='triton' is for PyTorch tensors; TensorFlow uses kernels='auto' or 'torch'"
            )
        return None

    def zeros(self, n: int, dtype: str, like: Any) -> tf.Variable:
        with tf.device(_device(like)):
            return tf.Variable(tf.zeros([n], _DTYPES[dtype]), trainable=False)

    def scalar(self, value: float, like: Any) -> Any:
        if _on_host(like):
            return np.float32(value)
        with tf.device(_device(like)):
            return tf.constant(value, tf.float32)

    def view_as(self, x: Any, dtype: str) -> Any:
        dt = _DTYPES[dtype]
        view = _as_view(x)
        if view is not None:
            if view.var.dtype.size % dt.size:
                raise NotImplementedError(f"view of {view.var.dtype.name} as {dtype}")
            scale = view.dtype.size // dt.size if view.dtype.size >= dt.size else None
            if scale is None:
                raise NotImplementedError(f"view of {view.dtype.name} as wider {dtype}")
            return _View(view.var, view.start * scale, view.length * scale, dt)
        x = tf.convert_to_tensor(x)
        if x.dtype == dt:
            return x
        out = tf.bitcast(x, dt)
        if x.dtype.size > dt.size:  # bitcast adds a trailing dimension
            out = tf.reshape(out, tf.concat([tf.shape(x)[:-1], [-1]], 0))
        return out

    def narrow(self, x: Any, dim: int, start: int, length: int) -> Any:
        view = _as_view(x)
        if view is not None:
            if dim != 0:
                raise NotImplementedError("buffers are 1-D")
            return _View(view.var, view.start + start, length, view.dtype)
        x = tf.convert_to_tensor(x)
        begin = [0] * x.shape.rank
        size = [-1] * x.shape.rank
        begin[dim], size[dim] = start, length
        return tf.slice(x, begin, size)

    def reshape(self, x: Any, shape: Sequence[int]) -> tf.Tensor:
        return tf.reshape(_read(x), list(shape))

    def numel(self, x: Any) -> int:
        if isinstance(x, _View):
            return x.length
        return int(x.shape.num_elements())

    def cast(self, x: Any, dtype: str) -> tf.Tensor:
        return tf.cast(_read(x), _DTYPES[dtype])

    # -- element-wise --------------------------------------------------------
    def _update(self, dst: Any, value: tf.Tensor) -> Any:
        view = _as_view(dst)
        if isinstance(dst, (np.ndarray, np.generic)):
            return np.asarray(_host(value), dst.dtype).reshape(np.shape(dst))
        if view is None:
            return tf.reshape(tf.cast(value, dst.dtype), tf.shape(dst))
        view.write(value)
        return dst

    def add_(self, dst, src):
        return self._update(dst, _flat(dst) + _vec(src, _dtype(dst)))

    def scale_add_(self, dst, scale, src):
        return self._update(dst, _flat(dst) * scale + _vec(src, _dtype(dst)))

    def abs_(self, x, out):
        # The result is only read (controller, compare): a new tensor avoids
        # writing the scratch buffer and reading it back.
        return tf.abs(_read(x))

    def ge_(self, x, thr, out):
        return tf.greater_equal(_read(x), thr if _is_np(thr) else tf.cast(thr, _dtype(x)))

    def count_nonzero(self, mask):
        mask = _read(mask)
        if not _gpus():
            # A sum of int32 (count_nonzero casts to int64 first, a full pass);
            # not where a GPU is, where TensorFlow sums int32 in host memory.
            return tf.reduce_sum(tf.cast(mask, tf.int32))
        return tf.math.count_nonzero(mask, dtype=tf.int32)

    def nonzero_static(self, mask, size, fill):
        # tf.where has a data-dependent shape (on GPU it synchronises once to
        # size its output); truncating and padding restores the fixed size
        # the wire format needs.
        found = tf.reshape(tf.cast(tf.where(_read(mask)), tf.int32), _ivec(-1))
        padded = tf.concat([found, _fill(size, fill)], 0)
        return tf.slice(padded, _ivec(0), _ivec(size))

    @staticmethod
    def _gather(src, idx) -> tf.Tensor:
        return tf.gather(_read(src), idx)  # not ResourceGather: see _scatter

    def gather_(self, src, idx, out):
        return self._update(out, self._gather(src, idx))

    def gather_clamped_(self, src, idx, out, bound):
        # Clipped and cast before the one write into ``out`` (a view of the chunk).
        vals = tf.clip_by_value(self._gather(src, idx), -bound, bound)
        return self._update(out, tf.cast(vals, _dtype(out)))

    def _scatter(self, dst, idx, vals, kind: str):
        """``dst[idx] (kind)= vals``; ``idx`` / ``vals`` may be lists of rows,
        applied one after the other (one read and one write of ``dst``)."""
        fn = {
            "update": tf.tensor_scatter_nd_update,
            "add": tf.tensor_scatter_nd_add,
            "sub": tf.tensor_scatter_nd_sub,
        }[kind]
        rows = list(zip(idx, vals)) if isinstance(idx, list) else [(idx, vals)]
        view = _as_view(dst)
        if view is None:
            for i, v in rows:
                v = tf.broadcast_to(v, tf.shape(i)) if v.shape.rank == 0 else v
                dst = fn(dst, tf.reshape(i, [-1, 1]), v)
            return dst
        # Dense ops on the whole variable, not Resource* scatters: a sparse
        # access puts a variable in copy-on-read mode for good (every later
        # ReadVariableOp copies it), which cost more on large layers than
        # this one copy (benchmarks/tf_exchange_ops.py --ops).
        var = view.var
        whole = tf.raw_ops.ReadVariableOp(resource=var.handle, dtype=var.dtype)
        if var.dtype != view.dtype:
            whole = tf.bitcast(whole, view.dtype)
        for i, v in rows:
            pos = tf.reshape(view.indices(_flat(i)), _ivec(-1, 1))  # same width only
            v = v if v.dtype == view.dtype else tf.cast(v, view.dtype)
            v = tf.broadcast_to(v, tf.shape(pos)[:1]) if v.shape.rank == 0 else v
            whole = fn(whole, pos, v)  # from the second row on, in place
        new = whole if var.dtype == view.dtype else tf.bitcast(whole, var.dtype)
        tf.raw_ops.AssignVariableOp(resource=var.handle, value=new)
        return dst

    def take(self, src, idx, out=None):
        return self._gather(src, idx)

    def concat(self, xs):
        return tf.concat([_read(x) for x in xs], 0)

    def add_indices(self, idx, offsets, out):
        return _read(idx) + tf.cast(offsets, idx.dtype)

    def fill_at_(self, dst, idx, value):
        # A scalar update: one op, no tensor of ``len(idx)`` values.
        dtype = _dtype(dst)
        value = bool(value) if dtype == tf.bool else float(value)
        return self._scatter(dst, idx, _scalar_const(value, dtype), "update")

    def sub_at_(self, dst, idx, vals):
        return self._scatter(dst, idx, _flat(vals), "sub")

    def copy_(self, dst, src):
        return self._update(dst, _vec(src, _dtype(dst)))

    def write_columns_(self, dst, rows, start, width, src):
        view = _as_view(dst)
        if view is None:
            raise TypeError("write_columns_ writes a buffer made by zeros()")
        grid = tf.reshape(view.read(), _ivec(rows, -1))
        cols = int(grid.shape[1])
        new = _vec(src, view.dtype)
        if int(new.shape[0]) == 1:
            new = tf.broadcast_to(tf.reshape(new, _ivec()), _ivec(rows, width))
        else:
            new = tf.reshape(new, _ivec(rows, width))
        parts = [new]
        if start:
            parts.insert(0, tf.slice(grid, _ivec(0, 0), _ivec(rows, start)))
        if start + width < cols:
            parts.append(tf.slice(grid, _ivec(0, start + width), _ivec(rows, -1)))
        view.write(tf.concat(parts, 1) if len(parts) > 1 else new)
        return dst

    def region_slots(self, idx, bounds, width):
        idx = _read(idx)
        bounds = tf.cast(_read(bounds), idx.dtype)
        parts = int(bounds.shape[0]) - 1
        # Region of each entry: how many upper bounds are at or below it.
        region = tf.searchsorted(bounds[1:], idx, side="right", out_type=tf.int64)
        starts = tf.searchsorted(idx, bounds[:-1], side="left", out_type=tf.int64)
        inside = tf.minimum(region, parts - 1)
        pos = tf.range(int(idx.shape[0]), dtype=tf.int64) - tf.gather(starts, inside)
        sent = tf.logical_and(region < parts, pos < width)
        slots = tf.where(sent, inside * width + pos, tf.constant(parts * width, tf.int64))
        local = tf.cast(idx - tf.gather(bounds, inside), tf.int32)
        return slots, local

    def scatter_(self, dst, idx, src):
        return self._scatter(dst, idx, _vec(src, _dtype(dst)), "update")

    def add_unkept_(self, dst, idx, vals, sent, kept, slots, sent_below):
        idx, vals = _read(idx), _read(vals)
        keep = tf.logical_and(
            tf.cast(tf.gather(_read(kept), idx), tf.bool), _read(slots) < sent_below
        )
        if sent is vals:
            back = tf.where(keep, tf.zeros_like(vals), vals)
        else:
            back = tf.where(keep, vals - tf.cast(_read(sent), vals.dtype), vals)
        return self._scatter(dst, idx, tf.cast(back, _dtype(dst)), "add")

    def selected_entries(self, idx, vals, pad):
        idx, vals = tf.cast(_read(idx), tf.int64), _read(vals)
        keep = tf.not_equal(vals, tf.zeros([], vals.dtype))  # NaN and infinities are kept
        idx = tf.where(keep, idx, tf.constant(pad, tf.int64))
        order = tf.argsort(idx, stable=True)
        vals = tf.cast(tf.gather(vals, order), tf.float32)
        return tf.gather(idx, order), vals, tf.reduce_sum(tf.cast(keep, tf.int64))

    def add_high16_(self, out, low, high):
        value = tf.cast(_read(low), tf.int32) + 65536 * tf.cast(_read(high), tf.int32)
        return self._update(out, value)

    def count_below_(self, out, sorted_idx, bounds):
        idx = _read(sorted_idx)
        found = tf.searchsorted(idx, tf.cast(bounds, idx.dtype), side="left", out_type=tf.int32)
        return self._update(out, found)

    def count_at_or_below(self, ends, values):
        ends = _read(ends)
        return tf.searchsorted(ends, tf.cast(values, ends.dtype), side="right", out_type=tf.int64)

    def unsigned16(self, x):
        return tf.bitwise.bitwise_and(tf.cast(_read(x), tf.int32), 0xFFFF)

    def where_below(self, idx, bound, other):
        idx = _read(idx)
        return tf.where(idx < bound, idx, tf.cast(other, idx.dtype))

    def set_bits_(self, out, positions, scratch):
        # Positions are unique, so adding each bit's power of two into its
        # byte sets it (no carries): one scatter, no bool buffer.
        pos = tf.cast(_read(positions), tf.int32)
        powers = tf.bitwise.left_shift(1, tf.bitwise.bitwise_and(pos, 7))
        found = tf.scatter_nd(
            tf.reshape(tf.bitwise.right_shift(pos, 3), _ivec(-1, 1)),
            powers,
            _ivec(self.numel(out)),
        )
        return self._update(out, tf.cast(found, tf.uint8))

    def unpack_bits(self, x):
        bits = tf.bitwise.bitwise_and(tf.reshape(_read(x), _ivec(-1, 1)), _bit_weights())
        return tf.reshape(tf.not_equal(bits, 0), _ivec(-1))

    def minimum_(self, x, limits):
        x = _read(x)
        return tf.minimum(x, tf.cast(limits, x.dtype))

    def add_offset_(self, dst, idx, offset):
        return self._update(dst, _vec(idx, tf.int32) + offset)

    def index_add_rows_(self, dst, idx, vals, scale, rows):
        idx, vals = _read(idx), tf.cast(_read(vals), tf.float32)
        if not _is_np(scale) or scale != 1.0:
            vals = vals * scale
        # Every rank must compute the same bits. A slot selected on several
        # ranks receives one value per row; scatter kernels that run in
        # parallel (GPU, and TensorFlow's CPU kernel from 1024 updates with
        # several threads, see tensorflow/core/kernels/scatter_functor.h) add
        # them in any order. Indices are unique within a row, so adding one row
        # at a time is deterministic. With two rows the order cannot matter
        # (0 + a + b == 0 + b + a exactly), so one op does.
        if rows <= 2:
            return self._scatter(dst, tf.reshape(idx, [-1]), tf.reshape(vals, [-1]), "add")
        idx, vals = tf.reshape(idx, _ivec(rows, -1)), tf.reshape(vals, _ivec(rows, -1))
        each = range(rows)
        return self._scatter(dst, [idx[r] for r in each], [vals[r] for r in each], "add")

    def mul_(self, x, factor):
        view = _as_view(x)
        if view is not None and factor == 0.0 and view.whole:
            view.var.assign(tf.zeros_like(view.var))
            return x
        return self._update(x, _flat(x) * factor)

    # -- loss scaling and non-finite gradients ---------------------------------
    def add_into_(self, out, a, b, scale):
        b = _vec(b, _dtype(out))
        return self._update(out, _flat(a) + (b if scale is None else b * scale))

    def momentum_into_(self, out, v, momentum, g, scale):
        g = _vec(g, _dtype(out))
        return self._update(out, _flat(v) * momentum + (g if scale is None else g * scale))

    def mul(self, x, factor):
        return _read(x) * factor

    def reciprocal(self, x):
        if _is_np(x):
            return np.float32(1.0) / np.float32(x)
        return tf.math.reciprocal(tf.cast(x, tf.float32))

    def total(self, x):
        x = _read(x)
        return _maybe_host(tf.reduce_sum(x), x)  # propagates NaN and inf

    def below_inf(self, x):
        return np.less(x, np.inf) if _is_np(x) else tf.less(x, _scalar_const(np.inf, x.dtype))

    def count_or_flag(self, count, ok):
        if _is_np(ok) and _is_np(count):
            return np.where(ok, count, -1)
        count = tf.convert_to_tensor(count)
        return tf.where(ok, count, tf.constant(-1, count.dtype))

    def any_negative_rows(self, x, rows):
        return tf.reduce_any(tf.reshape(_read(x), _ivec(rows, -1)) < 0, axis=0)

    def any_nonfinite(self, xs):
        finite = [tf.reduce_all(tf.math.is_finite(_read(x))) for x in xs]
        return tf.logical_not(tf.reduce_all(tf.stack(finite)))

    def any_true(self, flags):
        return tf.reduce_any(tf.concat([tf.reshape(tf.cast(f, tf.bool), [-1]) for f in flags], 0))

    def none_true(self, flags):
        return tf.logical_not(self.any_true(flags))

    def select_(self, dst, flag, src):
        a, b = _as_view(dst), _as_view(src)
        if a is not None and b is not None and a.whole and b.whole and a.length >= _COND_COPY:
            # A large whole variable (a layer's residual): copy only when the
            # flag holds (one pass), not a select that reads three.
            def copy() -> tf.Tensor:
                a.write(b.read())
                return tf.constant(True)

            tf.cond(flag, copy, lambda: tf.constant(False))
            return dst
        return self._update(dst, tf.where(flag, _read(src), _read(dst)))

    def index_vector(self, values, like):
        values = np.asarray(values, np.int64)
        if values.size and values.max() > np.iinfo(np.int32).max:
            raise ValueError(
                "the TensorFlow adapter indexes with int32, and dlgs needs index "
                f"{int(values.max())} here (all ranks' sparse messages together, or the "
                "receive buffer of every sparse layer, exceed 2**31 - 1 elements): raise "
                "min_sparse_size so that the largest layers are sent dense"
            )
        with tf.device(_device(like)):
            return tf.constant(values.astype(np.int32), tf.int32)

    def nan_at_(self, dst, idx, flags):
        marks = tf.where(flags, tf.constant(np.nan, tf.float32), tf.constant(0.0, tf.float32))
        return self._scatter(dst, idx, marks, "add")

    # -- threshold arithmetic on 0-d tensors ---------------------------------
    # On the CPU the controllers' 0-d arithmetic (the threshold, an anchor's
    # factor) runs in NumPy: the values already live in host memory, so
    # reading them synchronises nothing, and a NumPy scalar operation costs
    # about 1 us against about 50 us for an eager TensorFlow op. On a GPU they
    # stay device tensors (no host synchronisation on the hot path). The
    # dynamic controller learns on the host anyway, once per step (core).
    def kth_largest(self, x, k):
        x = _read(x)
        return _maybe_host(tf.reduce_min(tf.math.top_k(x, k, sorted=False).values), x)

    def strided(self, x, stride):
        x = _read(x)
        if stride == 1:
            return x
        return tf.strided_slice(x, [0], [int(x.shape[0])], [stride])

    def clamp(self, x, low, high):
        return (
            np.clip(x, np.float32(low), np.float32(high))
            if _is_np(x)
            else (tf.clip_by_value(x, low, high))
        )

    def affine(self, x, a, b):
        if _is_np(x):
            return np.float32(x * np.float32(a) + np.float32(b))
        return x * a + b

    def to_host(self, x: Any) -> Any:
        if _is_np(x):
            return np.asarray(x).tolist()
        return _read(x).numpy().tolist()

    def stack(self, xs):
        if all(_is_np(x) for x in xs):
            return np.stack(xs)
        return tf.stack([_read(x) for x in xs])


#: From this many elements, select_ on whole variables copies under a tf.cond.
_COND_COPY = 1 << 16


def _scalar_const(value: float, dtype: tf.DType) -> tf.Tensor:
    key = ("scalar", value, dtype.name)
    t = _CONSTS.get(key)
    if t is None:
        with tf.init_scope():
            t = _CONSTS[key] = tf.constant(value, dtype)
    return t


def _bit_weights() -> tf.Tensor:
    """The uint8 row ``[1, 2, 4, ..., 128]`` (cached)."""
    t = _CONSTS.get("bits")
    if t is None:
        with tf.init_scope():
            t = _CONSTS["bits"] = tf.constant([[1 << j for j in range(8)]], tf.uint8)
    return t


def _fill(n: int, value: int) -> tf.Tensor:
    key = ("fill", n, value)
    t = _CONSTS.get(key)
    if t is None:
        with tf.init_scope(), tf.device("CPU:0"):
            t = _CONSTS[key] = tf.fill([n], tf.constant(value, tf.int32))
    return t


def _is_np(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic, float, int))


@functools.lru_cache(maxsize=None)
def _gpus() -> bool:
    """Whether TensorFlow sees a GPU (asked once)."""
    return bool(tf.config.list_physical_devices("GPU"))


def _on_host(like: Any) -> bool:
    return "GPU" not in _device(like).upper()


def _maybe_host(t: tf.Tensor, like: Any) -> Any:
    """A 0-d result as a NumPy scalar when it lives on the CPU and runs
    eagerly (while a graph is traced it stays a tensor of the graph)."""
    return np.float32(t.numpy()) if _on_host(like) and tf.executing_eagerly() else t


def _host(x: Any) -> Any:
    return x.numpy() if isinstance(x, tf.Tensor) else x


def _dtype(x: Any) -> tf.DType:
    return x.dtype if isinstance(x, (_View, tf.Variable)) else tf.convert_to_tensor(x).dtype


def _device(like: Any) -> str:
    if like is None:
        return ""
    return getattr(like, "device", "") or ""


OPS = TFOps()
