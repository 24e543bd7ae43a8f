"""The array operations the core algorithms are written against.

The core never imports a framework. An adapter passes an object satisfying
:class:`ArrayOps` (``dlgs.torch`` passes one built on torch); the controller,
sparsifier and wire format are then written once and run on any device the
framework supports. Every operation is element-parallel or a reduction: none
needs the host to see a value, so nothing here synchronises a device.

Conventions: ``T`` is the framework's tensor type. Functions with a trailing
underscore may write into their first argument and return it; a framework
without in-place updates returns a new tensor instead, which is why callers
always use the return value.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, Tuple

import numpy as np

__all__ = ["ArrayOps", "host_number"]

T = Any


class ArrayOps(Protocol):
    """Element-wise and reduction primitives, device-agnostic, no host sync."""

    #: Whether an ``out`` buffer is written in place (:meth:`take`,
    #: :meth:`add_indices`); a framework that returns new tensors instead says
    #: False, and the core then allocates no such buffers for it.
    reuses_outputs: bool

    # -- creation and views -------------------------------------------------
    def zeros(self, n: int, dtype: str, like: T) -> T:
        """1-D zeros of ``n`` elements, ``dtype`` in {float32, float16, bfloat16,
        uint8, int16, int32, int64, bool}, on ``like``'s device."""

    def scalar(self, value: float, like: T) -> T:
        """0-d float32 tensor on ``like``'s device."""

    def view_as(self, x: T, dtype: str) -> T:
        """Reinterpret the bits of ``x`` as ``dtype`` along the last dimension."""

    def narrow(self, x: T, dim: int, start: int, length: int) -> T:
        """A view of ``x[..., start:start+length, ...]`` along ``dim``."""

    def reshape(self, x: T, shape: Sequence[int]) -> T: ...

    def numel(self, x: T) -> int:
        """Element count from the tensor's shape (no device access)."""

    def cast(self, x: T, dtype: str) -> T:
        """Value conversion to ``dtype``."""

    # -- hot-path element-wise ---------------------------------------------
    def add_(self, dst: T, src: T) -> T:
        """``dst += src``."""

    def scale_add_(self, dst: T, scale: float, src: T) -> T:
        """``dst = scale * dst + src``."""

    def abs_(self, x: T, out: T) -> T:
        """``out = |x|``."""

    def ge_(self, x: T, thr: T, out: T) -> T:
        """``out = x >= thr`` into a bool ``out``; ``thr`` is 0-d."""

    def count_nonzero(self, mask: T) -> T:
        """Number of true elements, as a 0-d integer tensor (stays on device)."""

    def nonzero_static(self, mask: T, size: int, fill: int) -> T:
        """Indices of the first ``size`` true elements in index order, padded with
        ``fill``; a 1-D int64 tensor of exactly ``size`` elements."""

    def gather_(self, src: T, idx: T, out: T) -> T:
        """``out[i] = src[idx[i]]``."""

    def gather_clamped_(self, src: T, idx: T, out: T, bound: float) -> T:
        """``out[i] = clip(src[idx[i]], -bound, bound)`` (float16 values on the
        wire: no infinity from a finite gradient)."""

    def take(self, src: T, idx: T, out: T | None = None) -> T:
        """``src[idx]`` as a 1-D tensor (``src`` 1-D, ``idx`` an index vector),
        written into ``out`` (a reused buffer of that size and dtype) where the
        framework writes in place; use the return value."""

    def concat(self, xs: Sequence[T]) -> T:
        """The 1-D tensors ``xs`` back to back, as one new 1-D tensor."""

    def add_indices(self, idx: T, offsets: T, out: T | None) -> T:
        """``idx + offsets`` (1-D integer vectors of one length) as an index
        vector for :meth:`index_add_rows_`, written into ``out`` (a buffer of
        ``offsets``' dtype) where the framework writes in place; use the
        return value."""

    def fill_at_(self, dst: T, idx: T, value: float) -> T:
        """``dst[idx] = value``."""

    def sub_at_(self, dst: T, idx: T, vals: T) -> T:
        """``dst[idx] -= vals`` (idx unique except for a slot that stays zero)."""

    def copy_(self, dst: T, src: T) -> T:
        """``dst[:] = src`` with value conversion to ``dst``'s dtype; integers
        too wide for ``dst`` wrap (keep their low bits), as a C cast does.
        ``src`` may have any shape with ``dst``'s element count (row-major),
        or be one element (broadcast)."""

    def write_columns_(self, dst: T, rows: int, start: int, width: int, src: T) -> T:
        """``dst`` (1-D, from :meth:`zeros` or a :meth:`narrow` / :meth:`view_as`
        of it) seen as ``rows`` rows: columns ``[start, start + width)`` of
        every row ``= src`` (``rows * width`` elements, row-major, or one,
        broadcast), converted as :meth:`copy_`. The one write into a 2-D view
        the core makes (frameworks whose tensors are immutable write the
        buffer, not a reshaped copy of it)."""

    def count_below_(self, out: T, sorted_idx: T, bounds: T) -> T:
        """``out[j] = #{i: sorted_idx[i] < bounds[j]}`` into an int32 ``out``
        (``sorted_idx`` ascending; a binary search per bound)."""

    def count_at_or_below(self, ends: T, values: T) -> T:
        """``#{i: ends[i] <= values[j]}`` for every ``j`` (``ends`` ascending),
        a new integer vector."""

    def unsigned16(self, x: T) -> T:
        """An int16 vector's bits read as unsigned, ``[0, 65535]``, as int32."""

    def where_below(self, idx: T, bound: int, other: T) -> T:
        """``idx[i]`` where it is below ``bound``, else ``other[i]`` (a new
        integer vector of ``idx``'s dtype)."""

    def set_bits_(self, out: T, positions: T, scratch: T | None) -> T:
        """Write into the uint8 ``out`` the bitmap with the bits at
        ``positions`` set (unique, below ``8 * len(out)``; bit ``p`` is bit
        ``p % 8``, least significant first, of byte ``p // 8``) and every
        other bit clear. ``scratch``: a bool buffer of ``8 * len(out)`` where
        the framework writes in place, else None."""

    def unpack_bits(self, x: T) -> T:
        """The bits of the uint8 vector ``x``, least significant first: a
        vector of ``8 * len(x)`` elements, nonzero exactly where a bit is set
        (bool or the bit's value; the inverse of :meth:`set_bits_` for
        :meth:`nonzero_static`)."""

    def minimum_(self, x: T, limits: T) -> T:
        """``x = min(x, limits)`` element-wise (integer vectors of one
        length), in place where the framework can; use the return value."""

    def add_offset_(self, dst: T, idx: T, offset: int) -> T:
        """``dst[:] = idx + offset`` into an int32 ``dst``."""

    def index_add_rows_(self, dst: T, idx: T, vals: T, scale: float, rows: int) -> T:
        """``idx`` and ``vals`` are 1-D, ``rows`` rows of equal length back to
        back; for each row r, in row order: ``dst[idx[r, i]] += scale *
        vals[r, i]``. Indices are unique within a row except a padding slot that
        only ever receives zeros. The result must be bit-identical on every rank
        given identical inputs (no atomics racing on one slot across rows)."""

    # -- the sparse reduction by regions (dlgs.core.transport.reduction) --------------
    def region_slots(self, idx: T, bounds: T, width: int) -> Tuple[T, T]:
        """For ascending indices ``idx`` (padded with values ``>= bounds[-1]``)
        and region bounds ``b_0 < ... < b_R`` (a 1-D integer vector): each
        entry's slot ``r * width + j`` (region ``r``, ``j``-th of its entries
        in that region) where ``j < width``, else ``R * width`` (not sent;
        padding too), int64; and its offset ``idx - b_r`` in its region
        (int32; any value where not sent)."""

    def scatter_(self, dst: T, idx: T, src: T) -> T:
        """``dst[idx[i]] = src[i]`` (``idx`` unique, except a slot whose value
        is never read)."""

    def add_unkept_(
        self, dst: T, idx: T, vals: T, sent: T, kept: T, slots: T, sent_below: int
    ) -> T:
        """``dst[idx[i]] += vals[i]`` where entry ``i`` was not both sent
        (``slots[i] < sent_below``) and kept (``kept[idx[i]]``, a bool
        vector), else ``vals[i] - sent[i]`` (what rounding to the wire dtype
        took; ``sent`` may be ``vals``); ``idx`` unique except a padding slot
        whose values are 0."""

    def selected_entries(self, idx: T, vals: T, pad: int) -> Tuple[T, T, T]:
        """A selection's entries in index order: ``(idx, vals, count)`` with
        every entry whose value is 0 (an unused slot) moved to index ``pad``
        (after all others), ``vals`` as float32, ``count`` (0-d) the entries
        with a non-zero value (NaN and infinities included); ties keep their
        order (the same on every run)."""

    def add_high16_(self, out: T, low: T, high: T) -> T:
        """``out = low + 65536 * high`` into an int32 ``out`` (integer inputs)."""

    def mul_(self, x: T, factor: float) -> T:
        """``x *= factor``; with ``factor == 0`` every element becomes 0, NaN and
        infinities included (a buffer marked non-finite must be clearable)."""

    # -- loss scaling and non-finite gradients --------------------------------
    def add_into_(self, out: T, a: T, b: T, scale: T | None) -> T:
        """``out = a + b * scale`` (``scale`` a 0-d tensor, or None for 1); ``a``
        and ``b`` may have any shape with ``out``'s element count."""

    def momentum_into_(self, out: T, v: T, momentum: float, g: T, scale: T | None) -> T:
        """``out = momentum * v + g * scale`` (``scale`` as in :meth:`add_into_`)."""

    def mul(self, x: T, factor: T | float) -> T:
        """``x * factor`` as a new tensor (``factor`` a number or a 0-d tensor)."""

    def reciprocal(self, x: T) -> T:
        """``1 / x`` of a 0-d tensor, as float32."""

    def total(self, x: T) -> T:
        """Sum of 1-D float ``x`` (the core passes magnitudes), 0-d float32:
        NaN if any element is NaN, infinite if any is (or if the sum overflows
        float32)."""

    def below_inf(self, x: T) -> T:
        """0-d bool: the 0-d ``x`` is below +infinity and not NaN (for a sum of
        magnitudes: it is finite)."""

    def count_or_flag(self, count: T, ok: T) -> T:
        """``count`` where the 0-d bool ``ok`` holds, else -1 (0-d integer)."""

    def any_negative_rows(self, x: T, rows: int) -> T:
        """For 1-D integer ``x`` holding ``rows`` rows of equal length back to
        back: 1-D bool, column ``j`` true if some row has ``x[r, j] < 0``."""

    def any_nonfinite(self, xs: Sequence[T]) -> T:
        """0-d bool: some element of some tensor in ``xs`` is NaN or infinite
        (one reduction per tensor, no host read)."""

    def any_true(self, flags: Sequence[T]) -> T:
        """0-d bool: some element of some bool tensor in ``flags`` is true."""

    def threshold_from_factor(self, total: T, factor: T, n: int, floor: float) -> T:
        """``total * float32(factor / n) + floor`` (float32; ``factor`` 0-d or
        1-element float64, divided in float64): the dynamic controller's
        threshold from its factor on the device. An adapter whose steps may run
        on the device alone also gives ``vector_math``, the float64 operations
        of ``dlgs.core.selection.controller.NumpyMath`` on its tensors."""

    def none_true(self, flags: Sequence[T]) -> T:
        """0-d bool: no element of any bool tensor in ``flags`` is true."""

    def select_(self, dst: T, flag: T, src: T) -> T:
        """``dst`` becomes ``src`` where the 0-d bool ``flag`` is true and stays
        as it is otherwise (no host read); same length and dtype."""

    def index_vector(self, values: Sequence[int] | np.ndarray, like: T) -> T:
        """A 1-D integer tensor (int64 where the framework indexes with it)
        holding ``values`` (a sequence or a NumPy vector) on ``like``'s device
        (set-up only)."""

    def nan_at_(self, dst: T, idx: T, flags: T) -> T:
        """``dst[idx[j]] = NaN`` where the bool ``flags[j]`` is true (no host read)."""

    # -- threshold arithmetic on 0-d tensors --------------------------------
    def kth_largest(self, x: T, k: int) -> T:
        """The ``k``-th largest element of 1-D ``x`` (1-based), 0-d."""

    def strided(self, x: T, stride: int) -> T:
        """Every ``stride``-th element of 1-D ``x`` (a view where possible)."""

    def clamp(self, x: T, low: float, high: float) -> T: ...

    def affine(self, x: T, a: float, b: float) -> T:
        """``a * x + b`` for a 0-d ``x`` and Python numbers (one operation: the
        dynamic controller's threshold)."""

    def to_host(self, x: T) -> Any:
        """The value as a Python number or nested list. Synchronises: never per
        layer on the hot path (an exchange reads once per step, at its end: the
        non-finite verdict and the counts its controllers learn from)."""

    def stack(self, xs: Sequence[T]) -> T:
        """Stack 0-d tensors into 1-D."""

    # -- fused kernels --------------------------------------------------------
    def fused_selection(self, like: T, mode: str) -> Any:
        """A :class:`dlgs.core.selection.select.FusedSelection` for tensors like
        ``like``, or None for the operations above. ``mode`` is
        ``SparsityConfig.kernels``: "torch" is always None, "auto" a fused
        one where the framework has one for that device, "triton" one or a
        ``ValueError``/``ImportError`` saying why not."""


def host_number(ops: ArrayOps, value: Any) -> float:
    """A controller entry as a Python float: a number, a NumPy scalar or view,
    or a framework scalar (read on the host: checkpoints and layouts only)."""
    if isinstance(value, (int, float, np.ndarray, np.generic)):
        return float(value)  # type: ignore[arg-type]  # 0-d arrays convert
    return float(np.ravel(ops.to_host(value))[0])
