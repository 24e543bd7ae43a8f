"""The per-step sparse gradient exchange, written once for every framework.

An adapter creates one :class:`SparseExchange` per optimizer, hands it the
framework's :class:`~dlgs.core.backend.ArrayOps` and a :class:`Collectives`
object, and then, every step:

1. calls :meth:`SparseExchange.submit` with each layer's flat gradient as soon
   as it is ready (PyTorch: from the gradient hook, so communication overlaps
   the rest of back-propagation);
2. calls :meth:`SparseExchange.wait`, which completes the collectives and
   returns each layer's averaged dense gradient.

For a *sparse* layer ``submit`` adds the gradient to the layer's residual
(error feedback), selects ``|a| >= theta`` into its slot of the merge group's
send buffer, and once every member of the group is in, starts one allgather.
A *dense* layer (small, or density too high for sparse to pay) is allreduced as
Horovod would. Nothing on this path reads a device value on the host.

Non-finite gradients: if any rank's gradient of any layer is NaN or infinite
in a step (or a dense layer's reduced gradient is), every rank (1) returns
outputs that are non-finite for the same layers (a sparse layer's output gets
NaN in its first element; dense layers carry Horovod's non-finite average), so
that a loss scaler skips the step everywhere, and (2) leaves every residual,
velocity and controller state as if the step had not happened. The verdict
(:func:`dlgs.core.exchange.step.verdict`) costs one host read per step (an 8-byte flag,
as a loss scaler's own check does).

The exchange coordinates collaborators, each in its module:
:class:`~dlgs.core.exchange.step.StepState` (the step under way),
:class:`~dlgs.core.exchange.sending.LayerSender` (each layer's selection),
:func:`~dlgs.core.exchange.messages.lay_out` (the layout in force), the transport
(:mod:`dlgs.core.transport.flat`), :class:`~dlgs.core.state.persist.ExchangeCheckpoints`
with :class:`~dlgs.core.state.resume.Agreement`, and
:class:`~dlgs.core.exchange.device.DeviceSteps`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from ..backend import ArrayOps
from ..config import SparsityConfig
from ..planning.budget import BudgetSplit
from ..selection.controller import make_controller
from ..state.persist import ExchangeCheckpoints, SharedState
from ..state.resume import Agreement
from ..transport.flat import Transport, make_transport
from ..wire import LayerPlan, fit_budget, plan_layers
from .device import DeviceSteps
from .messages import Messages, lay_out_plan
from .nonfinite import NonFiniteLog
from .records import LayerRecord, MessageRecord, StepHook, StepRecord, check_layers
from .sending import LayerSender
from .step import StepState, nonfinite_names, verdict
from .views import LayerInfo, MessageInfo, layer_stats

__all__ = ["Collectives", "SparseExchange"]

logger = logging.getLogger(__name__)


class Collectives(Protocol):
    """What the exchange and the engine need from the communication library.

    ``size`` and ``rank`` are the process set's; ``included`` is False on a
    rank outside the set (which takes no part in anything)."""

    size: int
    rank: int
    included: bool

    def allgather_async(self, chunk: Any, name: str) -> Any:
        """Start an allgather of a 1-D int32 chunk; return a handle."""

    def allreduce_async(self, tensor: Any, name: str) -> Any:
        """Start an allreduce with the user's reduction op; return a handle."""

    def synchronize(self, handle: Any) -> Any:
        """Wait for a handle and return the collective's output tensor."""

    def broadcast_object(self, obj: Any) -> Any:
        """The first rank's ``obj`` on every rank (picklable Python objects)."""

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every rank's ``obj``, in rank order (picklable Python objects)."""

    def allreduce_min(self, values: Sequence[int], name: str) -> List[int]:
        """The element-wise minimum of small integers over the set, blocking
        (TensorFlow's graph steps agree on their budget with it)."""


Plan = Sequence[Tuple[Sequence[int], Optional[bool]]]


class SparseExchange:
    """Error-feedback sparse exchange of a fixed set of named layers.

    Args:
        ops: the framework's array operations.
        comm: the collectives (Horovod's, wrapped by the adapter).
        config: sparsification options.
        layers: ``(name, numel)`` of every layer, in the order gradients
            usually become ready (backward order); names must be unique and
            the same on every rank.
        average: divide the sum over ranks by the number of ranks.
        prefix: prefix of the Horovod tensor names used by this exchange.
        dense_external: the caller allreduces dense layers itself (Horovod's
            own path in the ``compression=`` form): dense layers are never
            merged and :meth:`submit` returns their tensor for the caller.
        clock: a function returning seconds, used only while profiling (an
            adapter on an asynchronous device synchronises in it).
        loss_scale: with mixed precision and a dynamic loss scaler, a function
            returning the scale (a 0-d tensor on the device, or None for 1) by
            which this step's gradients are multiplied; called once per step,
            at the first :meth:`submit`. Residuals, velocities and the sparse
            values on the wire are kept in unscaled units, and every output is
            returned in the step's scaled units (the scaler unscales it), so
            what waits in a residual means the same whatever the scale does.
        agree: the collectives on which the step, merge plan and density are
            agreed after construction or a checkpoint load (default ``comm``;
            a two-level exchange passes every rank of the job, so that its
            cross-node sets cannot resume at different steps).
        agree_group: with ``agree`` wider than ``comm``: which of its sets
            ``comm`` is (a two-level exchange's local rank). What only ranks
            moving bytes together share (the reduction's regions) is agreed
            within the group (:data:`dlgs.core.state.resume.GROUP_KEYS`).
    """

    def __init__(
        self,
        ops: ArrayOps,
        comm: Collectives,
        config: SparsityConfig,
        layers: Sequence[Tuple[str, int]],
        *,
        average: bool = True,
        prefix: str = "dlgs",
        dense_external: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        loss_scale: Optional[Callable[[], Any]] = None,
        agree: Optional[Collectives] = None,
        agree_group: Optional[int] = None,
    ):
        check_layers(layers)
        if loss_scale is not None and not callable(loss_scale):
            raise TypeError(
                f"loss_scale must be a callable or None, got {type(loss_scale).__name__}"
            )
        self.ops = ops
        self.comm = comm
        if config.budget is not None:  # the density (and values) that fit the byte budget
            config = fit_budget([int(n) for _, n in layers], config)
        self.config = config
        self.controller = make_controller(config)
        self.average = average
        self.prefix = prefix
        self.dense_external = dense_external
        self.clock = clock
        self.loss_scale = loss_scale
        #: Every layer's record (written by the exchange and its collaborators).
        self.records = [LayerRecord(name, int(n)) for name, n in layers]
        self._index = {layer.name: i for i, layer in enumerate(self.records)}
        self._layer_views = tuple(
            LayerInfo(layer, lambda: self._messages_records(), i)
            for i, layer in enumerate(self.records)
        )
        #: The layout in force (None before the first gradient).
        self.messages: Optional[Messages] = None
        self._version = 0
        #: What every rank holds alike: step, plan, density="auto"'s choice.
        self.shared = SharedState()
        self._dense_bytes = 4 * sum(layer.numel for layer in self.records)
        self._density: Optional[float] = None  # of the layout in force
        #: How sparse messages travel and come back summed (dlgs.core.transport.flat).
        self.transport: Transport = make_transport(config, ops, comm)
        if config.transport == "auto" and self.transport.name == "flat":
            # Collectives without an alltoall: the planner must not price a reduction.
            self.config = config = dataclasses.replace(config, transport="allgather")
            logger.debug("dlgs: transport='auto' without an alltoall: every message by allgather")
        #: Each layer's selection and packing.
        self.sender = LayerSender(ops, config, self.controller)
        #: The step under way.
        self.current = StepState()
        #: A tensor on the exchange's device (the first gradient seen).
        self.like: Any = None
        #: Called with the exchange and the step's :class:`StepRecord` at the end
        #: of every step (profiling, planning).
        self.step_hooks: List[StepHook] = []
        if config.budget_split == "gradient":  # the budget's split, once (planning.budget)
            self.step_hooks.append(BudgetSplit())
        #: The last finished step's :class:`StepRecord` (None before the first).
        self.last_step: Optional[StepRecord] = None
        #: The steps' verdicts: the last one's, the non-finite ones counted.
        self.verdicts = NonFiniteLog(lambda: self.loss_scale is not None)
        #: What every rank must agree on (step, plan, profile, density) is
        #: agreed at the first gradient after construction and after every
        #: load, never inside load_state_dict (dlgs.core.state.resume).
        self.agreement = Agreement(
            agree if agree is not None else comm, f"{prefix}.sync", group=agree_group
        )
        #: Called (no argument) when the next step must run on the host: a plan,
        #: a density or a timed step was asked for, or a state loaded, between
        #: steps (see :class:`~dlgs.core.exchange.device.DeviceSteps`).
        self.listeners: List[Callable[[], None]] = []
        #: Steps on the device alone (traced into a graph).
        self.device = DeviceSteps(self)
        #: Saving, loading and the agreements after them.
        self.checkpoints = ExchangeCheckpoints(self)

    def _messages_records(self) -> Tuple[MessageRecord, ...]:
        return self.messages.records if self.messages is not None else ()

    # -- introspection -------------------------------------------------------
    @property
    def layers(self) -> Tuple[LayerInfo, ...]:
        """Every layer, in the exchange's order: read-only live views."""
        return self._layer_views

    @property
    def groups(self) -> Tuple[MessageInfo, ...]:
        """The messages of the layout in force (none before the first step):
        read-only live views."""
        return self.messages.views if self.messages is not None else ()

    def index(self, name: str) -> int:
        return self._index[name]

    @property
    def step(self) -> int:
        """Steps finished (host and device ones), the same on every rank."""
        return self.shared.step

    @step.setter
    def step(self, value: int) -> None:
        self.shared.step = value

    @property
    def layout_version(self) -> int:
        """Increases whenever the messages are laid out anew (a traced step is
        for one layout)."""
        return self._version

    @property
    def last_step_finite(self) -> bool:
        """Whether the last finished step's gradients were finite on every rank
        (all layers, dense ones included). Reading it after a step with no
        sparse layer and no momentum correction checks that step's dense outputs
        then (read it before ``zero_grad``) and synchronises the device once."""
        return self.verdicts.last_finite(self.ops)

    @property
    def nonfinite_steps(self) -> int:
        """Steps whose gradients were non-finite somewhere (state left untouched)."""
        return self.verdicts.steps

    @property
    def in_step(self) -> bool:
        """A step has begun (a gradient was submitted) and not finished."""
        return self.current.open or bool(self.current.submitted)

    @property
    def layout_due(self) -> bool:
        """The next step lays the messages out anew (a plan or density changed)."""
        return self._density is None or self.density != self._density

    @property
    def density(self) -> float:
        """Density in force for the current step; with ``density="auto"``'s
        per-layer choice, the one chosen for every layer, which some layers
        exceed (:attr:`densities`)."""
        return self.shared.density(self.config)

    @property
    def densities(self) -> Tuple[float, ...]:
        """Each layer's density in force (:attr:`layers` order)."""
        return self.shared.densities(self.config, len(self.records))

    @property
    def auto_layers(self) -> Optional[Tuple[float, ...]]:
        """With ``density="auto"``: the per-layer densities in force, or None."""
        return self.shared.auto_layers

    def set_density(self, density: float, layers: Optional[Sequence[float]] = None) -> None:
        """With ``density="auto"``: the density chosen (by the planner, the
        same on every rank), in force from the next step's layout; ``layers``:
        each layer's own (:attr:`layers` order), or None for ``density`` in
        every layer."""
        self._between_steps("set_density()")
        if self.shared.choose_density(self.config, density, layers, len(self.records)):
            self.relayout_next()
            self.request_host_step()

    def trace_next_step(self) -> None:
        """Time the next step layer by layer (:class:`StepTrace` in its
        :class:`StepRecord`). Each timed layer calls ``clock()`` twice, which
        on an asynchronous device waits for it: profiling steps only."""
        self.current.timed_next = True
        self.request_host_step()

    def set_plan(self, plan: Optional[Plan]) -> None:
        """Replace the merge plan: ``[(layer indices, sparse), ...]`` where
        ``sparse`` is True/False or None (sparse if every member would be sent
        sparse on its own). Layers in no group are sent alone by the per-layer
        rule. Takes effect at the next step; every rank must set the same plan.
        ``None`` restores layer-wise sending."""
        self._between_steps("set_plan()")
        self.shared.set_plan(plan, len(self.records))
        self.relayout_next()
        self.request_host_step()

    def layer_plans(self) -> List[LayerPlan]:
        return plan_layers([layer.numel for layer in self.records], self.densities, self.config)

    def relayout_next(self) -> None:
        """Lay the messages out anew at the next gradient."""
        self._density = None

    def _between_steps(self, what: str) -> None:
        if self.current.submitted:
            raise RuntimeError(f"{what} in the middle of a step")

    def request_host_step(self) -> None:
        """The next step must run on the host (it tells :attr:`listeners`):
        called by the setters here, after a load, and by whatever changes the
        step hooks' needs between steps (``reprofile()``)."""
        for listener in list(self.listeners):
            listener()

    # -- layout ----------------------------------------------------------------
    def relayout(self, like: Any) -> None:
        """Lay the messages out for the density in force (buffers carried over)."""
        density = self._density = self.density
        self.like = like
        self._version += 1
        for hook in self.step_hooks:
            on_density = getattr(hook, "on_density", None)
            # A planner may answer a density change with a plan for it, which
            # applies in this very layout (the exchange writes its own plan).
            groups = on_density(self, density) if on_density is not None else None
            if groups is not None:
                self.shared.plan = [(list(members), sparse) for members, sparse in groups]
        self.messages = lay_out_plan(
            self.ops,
            self.config,
            self.controller,
            self.records,
            self.densities,
            self.shared.plan,
            self.transport,
            self.sender,
            like,
            self._version,
            prefix=self.prefix,
            dense_alone=self.dense_external,
        )
        logger.debug(
            "dlgs layout at step %d: density %g, %d layers in %d messages (%d sparse)",
            self.step,
            density,
            len(self.records),
            len(self.messages.records),
            sum(1 for m in self.messages.records if m.sparse),
        )

    # -- the per-step path -----------------------------------------------------
    def submit(self, i: int, grad: Any) -> Any:
        """Hand in layer ``i``'s gradient; starts its message's collective once
        every member is in. Call at most once per layer per step.

        With ``dense_external``, returns the tensor the caller must allreduce
        for a dense layer (its gradient, plus any residual it still owed);
        otherwise None. Multiply the caller's reduced result by
        :meth:`external_scale` (when not None) before handing it on.
        """
        layer = self.records[i]
        ops, step = self.ops, self.current
        step.check(i, layer.name, ops.numel(grad), layer.numel)
        if not step.submitted:
            self.checkpoints.before_step()
        if self.layout_due:
            self.relayout(grad)
        laid = self.messages
        assert laid is not None
        entered = time.perf_counter()  # never synchronises a device
        if not step.open:
            scale = self.loss_scale() if self.loss_scale is not None else None
            step.begin(ops, scale, self.comm.size, self.average)
        trace = step.trace
        if trace is not None:
            t0 = self.clock()
        step.submitted.add(i)
        message = laid.records[layer.group]
        result = None
        if message.sparse:
            self.sender.sparse(
                layer,
                message,
                grad,
                step,
                self.step,
                learns_on_host=laid.bank is not None,
                threshold=self.device.threshold(i),
            )
            if laid.arrived(message):
                message.handle = self.transport.start(message.position, message.chunk, message.name)
        else:
            grad = self.sender.dense(layer, grad, step)
            if self.dense_external:
                result = message.handle = grad
            else:
                laid.add_dense(ops, self.comm, message, i, grad)
        if trace is not None:
            trace.arrive[i] = t0
            trace.done[i] = self.clock()
        step.submit_seconds += time.perf_counter() - entered
        return result

    def external_scale(self) -> Any:
        """The factor (0-d tensor) by which a ``dense_external`` layer's reduced
        tensor must be multiplied to be in the step's scaled units, or None."""
        if self.config.momentum and self.current.scale is not None:
            return self.current.scale
        return None

    def pending(self) -> List[int]:
        """Layers not yet submitted this step."""
        return [i for i in range(len(self.records)) if i not in self.current.submitted]

    def wait(self, finish: bool = True) -> Dict[int, Any]:
        """Complete the step's collectives: every layer must have been submitted.
        Returns each layer's reduced dense gradient: flat float32 views into
        reused buffers (valid until the next step's :meth:`wait`), or for a
        layer allreduced alone, whatever the collective returned.

        With ``finish=False`` (for ``dense_external``: the caller's dense
        results are not in yet) the caller must call :meth:`finish` after it.
        """
        missing = self.pending()
        if missing:
            names = [self.records[i].name for i in missing[:5]]
            raise RuntimeError(f"wait() before every layer was submitted; missing {names}")
        ops, step, laid = self.ops, self.current, self.messages
        assert laid is not None
        out: Dict[int, Any] = {}
        handles: List[Any] = []
        verify: List[bool] = []
        for message in laid.records:
            if message.sparse:
                handles.append(message.handle)
                verify.append(not message.verified)
                message.verified = True
                out.update(zip(message.members, message.outputs))
            elif self.dense_external:
                out[message.members[0]] = message.handle
            else:
                # Velocities are unscaled: momentum correction's output is scaled back.
                scale = step.scale if self.config.momentum else None
                reduced = laid.reduced_dense(ops, self.comm, message, scale)
                out.update(laid.members_of(ops, message, reduced, self.records))
                step.dense_out[message.members[0]] = reduced
            message.ready, message.handle = 0, None
        if handles:
            # Every sparse message of the step at once; members non-finite on
            # some rank read NaN on every rank.
            step.flags.append(self.transport.finish(handles, verify, step.out_scale))
            # What the transport did not deliver of this rank's selection (a
            # reduction's unsent or unkept entries) back into the new residuals.
            for i, view in self.returned().items():
                layer = self.records[i]
                ops.add_(layer.head(ops, layer.residual_next), view)
        if finish:
            self.finish()
        return out

    def returned(self) -> Dict[int, Any]:
        """For checks: what the last step put back into each sparse layer's
        residual because the transport did not deliver it (a reduction's
        unsent or unkept entries; empty for the allgather), by layer index
        (``numel`` float32, views valid until the next step's :meth:`wait`)."""
        back = self.transport.returned()
        sparse = [m for m in self._messages_records() if m.sparse] if back else []
        return {i: v for m, views in zip(sparse, back) for i, v in zip(m.members, views)}

    def finish(
        self, external: Sequence[Tuple[int, Any]] = (), verdicts: Optional[Sequence[Any]] = None
    ) -> bool:
        """End the step: keep its new residuals, velocities and controller
        states if it was finite on every rank, else leave the old ones (one
        host read). ``external``: ``(layer index, reduced tensor)`` of dense
        layers the caller reduced itself, checked too; ``verdicts``: tensors
        non-finite exactly where ``external`` is, checked instead of it
        (``external`` then only names layers in a warning). Returns whether
        the step was finite."""
        step, laid = self.current, self.messages
        assert laid is not None
        theirs = [t for _, t in external] if verdicts is None else list(verdicts)
        dense = list(step.dense_out.values()) + theirs
        # Nothing to undo (every layer dense, no momentum correction): the
        # dense outputs are checked only if asked (last_step_finite), so a
        # dense step costs neither a pass over them nor a host sync.
        finite, words = True, None  # the step's count words, read with the verdict
        tracks = laid.tracks(self.records, self.config.momentum)
        if tracks:
            counts = self.transport.counts if laid.sparse_members and step.flags else None
            finite, words = verdict(self.ops, counts, dense, on_device=False)
        if finite:
            laid.learn(self.ops, self.transport, words, self.comm)
        for i in sorted(step.submitted):
            self.sender.settle(self.records[i], laid.sparse(self.records[i]), finite)
        if not finite:
            at = (self.ops, laid, self.records, self.transport.bad, step.dense_out, external)
            self.verdicts.nonfinite(self.step, functools.partial(nonfinite_names, *at))
        else:
            self.verdicts.finite()
            self.verdicts.lazy = [] if tracks else dense
        start, submit, trace = step.started, step.submit_seconds, step.trace
        if trace is not None:
            trace.waited = self.clock()
        self.abort_step()
        record = StepRecord(
            step=self.step,
            seconds=time.perf_counter() - start if start is not None else None,
            submit_seconds=submit,
            layers_sparse=laid.modes,
            trace=trace,
        )
        self.last_step = record
        self.step += 1
        for hook in list(self.step_hooks):
            hook(self, record)
        return finite

    def abort_step(self) -> None:
        """Drop the step under way, so that the next one starts clean: how
        every step ends (:meth:`finish` after keeping what it keeps, a step on
        the device after its own), and what an adapter calls after an error
        inside a step (a failed trace, a DDP hook that raised)."""
        self.device.restore()
        for message in self._messages_records():
            message.ready, message.handle = 0, None
        for layer in self.records:
            layer.ctrl_prev, layer.flush = None, False
        self.current.drop()

    # -- statistics and checkpoints -------------------------------------------
    def message_bytes(self, message: Any) -> int:
        """Bytes this rank contributes to ``message`` (a :class:`MessageInfo`) per step."""
        assert self.messages is not None
        return self.messages.wire_bytes[message.index]

    def wire_bytes(self) -> int:
        """Bytes this rank contributes per step under the layout in force, over
        all its messages (sparse ones at capacity, with their fingerprint
        word; dense layers as float32, before any Horovod compression)."""
        return sum(self.messages.wire_bytes) if self.messages is not None else 0

    def dense_bytes(self) -> int:
        """Bytes per step of a dense float32 exchange of every layer (what
        Horovod's allreduce moves without compression): the reference for
        :meth:`wire_bytes`."""
        return self._dense_bytes

    def stats(self) -> List[Dict[str, Any]]:
        """Per-layer numbers of the last step (synchronises; not for the hot
        path): see :func:`dlgs.core.exchange.views.layer_stats`."""
        return layer_stats(self)

    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals, velocities and controller states, with the
        step, plan and density every rank holds alike; tagged with rank and
        world size, since residuals are rank-local (each rank holds the
        gradient it has not sent yet)."""
        return self.checkpoints.save()

    def load_state_dict(self, state: Dict[str, Any], like: Any) -> None:
        """Restore a :meth:`state_dict` between steps, validated first; no
        collective, so safe on one rank (Horovod's resume recipe). See
        :meth:`dlgs.core.state.persist.ExchangeCheckpoints.load`."""
        self.checkpoints.load(state, like)

    def check_state_dict(self, state: Any) -> Tuple[bool, List[str]]:
        """Validate a :meth:`state_dict` without changing anything: whether it
        is this rank's own, and the options whose change restarts the thresholds."""
        return self.checkpoints.check(state)

    def resync(self) -> None:
        """Agree at the next gradient, every rank (see
        :meth:`dlgs.core.engine.Engine.resync`): a state loaded since the last
        agreement takes part as a load, with its step, plan and density."""
        self._between_steps("resync()")
        self.checkpoints.agree_again(holds_state=False, bounded=True)
        self.request_host_step()  # the agreement, on every rank
