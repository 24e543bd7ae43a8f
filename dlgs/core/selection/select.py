"""A sparse layer's selection and packing through fused kernels.

The exchange's own path (:func:`select` and
:meth:`GroupLayout.pack_into`) is written once against :class:`ArrayOps`, one
framework operation per pass: about 18 device kernels per sparse layer per
step. A framework may also offer :class:`FusedSelection` (``dlgs.torch``: three
Triton kernels on CUDA), which does the same work with the same results in
fewer passes; :func:`select_and_pack` drives it. The controller is unchanged:
it still computes ``theta`` from the step's sum of ``|a|`` (or, on the steps
it needs them, from the magnitudes themselves).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Protocol, Tuple

from ..backend import ArrayOps
from ..wire import GroupLayout, MemberViews
from .controller import ThresholdController

__all__ = ["FusedSelection", "select", "select_and_pack", "select_with_total"]


def select(
    ops: ArrayOps,
    controller: ThresholdController,
    state: Dict[str, Any],
    acc: Any,
    k: int,
    capacity: int,
    step: int,
    scratch_abs: Any,
    scratch_mask: Any,
) -> Tuple[Any, Any, Any]:
    """One layer's selection: ``|acc| >= theta`` with ``theta`` from the controller.

    Five memory-bound passes (``|a|``, its sum, compare, count, compaction) and
    no sort (except when the controller anchors). Updates the controller's
    state from the count it selected (the dynamic controller reads it on the
    host: an exchange instead batches every layer's count into one read per step).

    Args:
        acc: the accumulated gradient (1-D, ``n`` elements).
        k: target count; capacity: most indices returned.
        scratch_abs / scratch_mask: reusable float32 / bool buffers of ``n``.

    Returns:
        ``(idx, count, theta)``: ``capacity`` int64 indices of the first
        selected elements in index order, padded with ``n`` (a slot that reads
        as zero); the number of elements at or above ``theta`` (0-d, on
        device); the threshold used.
    """
    idx, count, theta, _ = select_with_total(
        ops, controller, state, acc, k, capacity, step, scratch_abs, scratch_mask
    )
    return idx, count, theta


def select_with_total(
    ops,
    controller,
    state,
    acc,
    k,
    capacity,
    step,
    scratch_abs,
    scratch_mask,
    update=True,
    threshold=None,
):
    """:func:`select`, also returning the sum of ``|acc|`` (NaN or infinite
    exactly when some element is, or when finite magnitudes overflow float32:
    the non-finite check). ``update=False`` leaves the controller's update to
    the caller (an exchange updates all its layers at once, at the end of a
    finite step); ``threshold(absx, total)``: theta from the caller instead
    of the controller (a step on the device alone)."""
    n = ops.numel(acc)
    absx = ops.abs_(acc, scratch_abs)
    total = ops.total(absx)
    if threshold is None:
        theta = controller.threshold(ops, state, absx, k, step, total)
    else:
        theta = threshold(absx, total)
    mask = ops.ge_(absx, theta, scratch_mask)
    count = ops.count_nonzero(mask)
    idx = ops.nonzero_static(mask, capacity, n)
    if update:
        controller.update(ops, state, theta, count, k)
    return idx, count, theta, total


class FusedSelection(Protocol):
    """Selection and packing of one layer in a few fused device kernels.

    Given ``theta``, the result must be bit-identical to the :class:`ArrayOps`
    path: the first ``capacity`` elements with ``|a| >= theta`` in ascending
    index order, padding slots with index ``n`` and value 0, the count word
    (the full count, -1 when ``total`` is not finite), and the residual
    cleared where a value was sent (or left with the wire dtype's rounding
    error). The sum of ``|a|`` may differ in its last bits (another order of
    additions)."""

    #: Short name, for logs and reports.
    name: str

    def workspace(self, n: int, like: Any) -> Any:
        """Scratch for a layer of ``n`` elements, reused every step."""

    def accumulate(self, work: Any, acc: Any, res: Any, src: Any, scale: Any) -> Any:
        """``acc = res + src * scale`` (``scale`` a 0-d tensor or None for 1);
        returns partial sums of ``|acc|`` (a 1-D float32 vector whose sum is
        the layer's, NaN or infinite exactly when an element of ``acc`` is)."""

    def pack(
        self,
        work: Any,
        acc: Any,
        theta: Any,
        total: Any,
        values: Any,
        indices: Any,
        word: Any,
        block_counts: Any,
        offset: int,
        coding: str,
        velocity: Any = None,
    ) -> Any:
        """Select ``|acc| >= theta`` and write the member's slots (``coding``
        "int32": ``index + offset``; "block16": the low 16 bits and
        ``block_counts``; "index64": an int64 vector, returned, for the
        caller to code) and the count word, and clear ``acc`` (and
        ``velocity`` when given) where a value was sent. Returns ``(count,
        index)``: the full count (0-d int32, reused) and the int64 vector for
        "index64", else None."""


def select_and_pack(
    ops: ArrayOps,
    kernels: FusedSelection,
    work: Any,
    controller: ThresholdController,
    state: dict,
    layout: GroupLayout,
    views: MemberViews,
    member: int,
    acc: Any,
    res: Any,
    src: Any,
    scale: Any,
    k: int,
    step: int,
    scratch_abs: Any,
    velocity: Optional[Any] = None,
) -> Tuple[Any, Any]:
    """One sparse layer's step through ``kernels``: accumulate into ``acc``
    (the spare residual), choose ``theta``, select and pack into ``views``.
    Returns ``(count, theta)`` (0-d, on the device); the controller's update
    is the caller's (an exchange batches it)."""
    partials = kernels.accumulate(work, acc, res, src, scale)
    total = ops.total(partials)
    # |a| is materialised only for a controller that reads it this step (top-k,
    # DGC, the dynamic controller's anchors); otherwise theta needs the sum alone.
    absx = ops.abs_(acc, scratch_abs) if controller.reads_magnitudes(state) else acc
    theta = controller.threshold(ops, state, absx, k, step, total)
    if layout.bitmap:
        coding = "index64"
    elif layout.block16:
        coding = "block16"
    else:
        coding = "int32"
    count, idx = kernels.pack(
        work,
        acc,
        theta,
        total,
        views.values,
        views.indices,
        views.word,
        views.counts,
        layout.dense_offset(member) if coding == "int32" else 0,
        coding,
        velocity,
    )
    if idx is not None:
        n = layout.sizes[member]
        ops.set_bits_(views.indices, ops.where_below(idx, n, views.pads), views.scratch)
    return count, theta
