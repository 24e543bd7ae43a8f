"""What one layer puts on the wire in a step: its sparse selection (error
feedback, the threshold, packing into its message) or its dense gradient.

A step writes its new residual and velocity into each layer's ``*_next``
buffers; the exchange keeps them when the step was finite on every rank
(:class:`~dlgs.core.exchange.records.LayerRecord`), so nothing here is undone.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from ..backend import ArrayOps
from ..config import SparsityConfig, ValueDType
from ..selection.select import FusedSelection, select_and_pack, select_with_total
from .records import LayerRecord, MessageRecord
from .step import StepState

__all__ = ["LayerSender"]

logger = logging.getLogger(__name__)


class LayerSender:
    """Selects and packs each layer's share of a step (one per exchange).

    Holds what the layers share: the fused selection kernels (chosen at the
    first layout, :attr:`kernels`) and the scratch buffers of the largest
    sparse layer, reused every step."""

    def __init__(self, ops: ArrayOps, config: SparsityConfig, controller: Any):
        self.ops, self.config, self.controller = ops, config, controller
        #: Fused selection kernels (``config.kernels``), or None.
        self.kernels: Optional[FusedSelection] = None
        self.kernels_chosen = False
        self.scratch_abs: Any = None
        self.scratch_mask: Any = None
        #: Keep every layer's state buffers in place: a finished step copies its
        #: new residual (and velocity) over the old one instead of swapping the
        #: two buffers, so a step traced into a graph, which holds the buffers
        #: it was traced with, stays valid across host steps (one copy per
        #: sparse layer per host step).
        self.stable_buffers = False

    def prepare(self, biggest: int, like: Any) -> None:
        """Kernels chosen once; scratch for a sparse layer of ``biggest``
        elements (kept when large enough)."""
        if not self.kernels_chosen and like is not None:  # None: a load before any gradient
            self.kernels = self.ops.fused_selection(like, self.config.kernels)
            self.kernels_chosen = True
            if self.kernels is not None:
                logger.debug("dlgs: sparse layers select with %s kernels", self.kernels.name)
        if biggest and (self.scratch_abs is None or self.ops.numel(self.scratch_abs) < biggest):
            self.scratch_abs = self.ops.zeros(biggest, "float32", like)
            self.scratch_mask = self.ops.zeros(biggest, "bool", like)

    def settle(self, layer: LayerRecord, sparse: bool, finite: Any) -> None:
        """After the step's verdict: a finite step's new residual (a sparse
        layer's) and velocity in force, or a dense layer's flushed residual
        dropped; a non-finite step's controller state put back.

        ``finite``: the verdict as a host ``bool``, or as a 0-d device flag
        (a step traced to run on the device alone: the new state is selected
        into the buffers in force where the flag is true, nothing read; such
        a step has no flushed residual, and its controllers learn on the
        device)."""
        if not isinstance(finite, bool):
            if layer.flush:
                raise RuntimeError("a dense layer's residual is flushed on the host only")
            if sparse:
                self.ops.select_(layer.residual, finite, layer.residual_next)
            if layer.velocity_next is not None:
                self.ops.select_(layer.velocity, finite, layer.velocity_next)
            return
        if finite:
            if sparse:
                self._keep_next(layer, "residual")
            elif layer.flush:
                layer.residual = layer.residual_next = None
            if layer.velocity_next is not None:
                self._keep_next(layer, "velocity")
        elif sparse and layer.ctrl_prev is not None:
            # In place: the bank holds this dict.
            layer.ctrl.clear()
            layer.ctrl.update(layer.ctrl_prev)

    def _keep_next(self, layer: LayerRecord, kind: str) -> None:
        new = getattr(layer, f"{kind}_next")
        if self.stable_buffers:
            self.ops.copy_(getattr(layer, kind), new)
        else:
            setattr(layer, f"{kind}_next", getattr(layer, kind))
            setattr(layer, kind, new)

    def velocity(self, layer: LayerRecord, grad: Any, step: StepState) -> Any:
        """``u' = m u + g / scale`` into the layer's spare velocity buffer."""
        n = layer.numel
        return self.ops.momentum_into_(
            self.ops.narrow(layer.velocity_next, 0, 0, n),
            self.ops.narrow(layer.velocity, 0, 0, n),
            self.config.momentum,
            grad,
            step.inv_scale,
        )

    def dense(self, layer: LayerRecord, grad: Any, step: StepState) -> Any:
        """What a dense layer sends: its gradient (scaled units), or with
        momentum correction its new velocity (unscaled), plus any residual it
        still owes."""
        ops = self.ops
        n = layer.numel
        if self.config.momentum:
            # Momentum correction keeps every layer's velocity locally (the
            # wrapped optimizer has none); a dense layer sends its velocity,
            # whose average is what momentum SGD applies to the averaged
            # gradient. It is sent from a copy: an in-place reduction must not
            # turn this rank's velocity into the average (which it would then
            # carry into steps where the layer is sparse again), whether the
            # layer travels alone or in a merged dense message.
            if layer.velocity is None:
                layer.velocity = ops.zeros(n + 1, "float32", grad)
            if layer.velocity_next is None:
                layer.velocity_next = ops.zeros(n + 1, "float32", grad)
            if layer.send is None:
                layer.send = ops.zeros(n, "float32", grad)
            vel = self.velocity(layer, grad, step)
            if layer.residual is None:
                return ops.copy_(layer.send, vel)
            owed = ops.narrow(layer.residual, 0, 0, n)  # both unscaled
            layer.flush = True
            return ops.add_into_(layer.send, vel, owed, None)
        if layer.residual is not None:
            # The layer went dense (e.g. end of warm-up, or a new plan): send
            # what it still owes with this gradient; the residual is dropped
            # when the step finishes finite.
            owed = ops.narrow(layer.residual, 0, 0, n)
            out = ops.zeros(n, "float32", grad)
            grad = ops.add_into_(out, grad, owed, step.scale)
            layer.flush = True
        return grad

    def sparse(
        self,
        layer: LayerRecord,
        message: MessageRecord,
        grad: Any,
        step: StepState,
        number: int,
        learns_on_host: bool,
        threshold: Optional[Callable[[Any, Any], Any]] = None,
    ) -> None:
        """Error feedback, selection and packing of a sparse layer into its
        slot of ``message`` (step ``number``). ``learns_on_host``: the
        controllers learn in a bank after the step (else here, per layer);
        ``threshold``: the threshold from ``|a|`` and its sum (a step on the
        device alone), else the controller's."""
        ops = self.ops
        plan = layer.plan
        assert plan is not None  # set by the layout before any submit
        k, cap = plan.k, plan.capacity
        layout = message.layout
        assert layout is not None  # sparse messages always have one
        # a = r + g / scale, or with momentum a = r + (m u + g / scale).
        nxt = layer.residual_next
        acc = layer.head(ops, nxt)
        res = layer.head(ops, layer.residual)
        vel = self.velocity(layer, grad, step) if layer.velocity is not None else None
        layer.ctrl_prev = dict(layer.ctrl)  # restored if the step is not finite
        if self.kernels is not None:
            masked = vel is not None and self.config.masks(k, layer.numel)
            layer.count, layer.theta = select_and_pack(
                ops,
                self.kernels,
                layer.work,
                self.controller,
                layer.ctrl,
                layout,
                message.member_views[layer.member],
                layer.member,
                acc,
                res,
                vel if vel is not None else grad,
                step.inv_scale if vel is None else None,
                k,
                number,
                layer.head(ops, self.scratch_abs),
                layer.velocity_next if masked else None,
            )
            if not learns_on_host:
                self.controller.update(ops, layer.ctrl, layer.theta, layer.count, k)
            return
        if vel is not None:
            ops.add_into_(acc, res, vel, None)
        else:
            ops.add_into_(acc, res, grad, step.inv_scale)
        idx, count, theta, total = select_with_total(
            ops,
            self.controller,
            layer.ctrl,
            acc,
            k,
            cap,
            number,
            layer.head(ops, self.scratch_abs),
            layer.head(ops, self.scratch_mask),
            update=not learns_on_host,
            threshold=threshold,
        )
        # The sum of |a| tells whether it has a NaN or an infinity; the verdict
        # travels as the member's count word (-1), so every rank learns it.
        ok = ops.below_inf(total)
        out_vals = layout.pack_into(
            ops,
            message.member_views[layer.member],
            layer.member,
            nxt,
            idx,
            ops.count_or_flag(count, ok),
        )
        if layout.value_dtype is ValueDType.FLOAT32:
            ops.fill_at_(nxt, idx, 0.0)
        else:
            # Keep the rounding error of the narrower wire dtype in the residual.
            ops.sub_at_(nxt, idx, ops.cast(out_vals, "float32"))
        if layer.velocity is not None and self.config.masks(k, layer.numel):
            ops.fill_at_(layer.velocity_next, idx, 0.0)  # DGC factor masking
        layer.count = count
        layer.theta = theta
