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
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from . import checkpoint
from ._checks import check_float, check_int
from .backend import ArrayOps
from .bank import ControllerBank
from .checkpoint import STATE_VERSION, check_finite_state
from .config import SparsityConfig, ValueDType
from .controller import make_controller
from .layout import plan_messages
from .nonfinite import NonFiniteLog
from .records import LayerRecord, MessageRecord, StepHook, StepRecord, StepTrace
from .resume import agree_shared
from .selection import FusedSelection, select, select_and_pack, select_with_total
from .transport import MAX_MESSAGE_ELEMENTS, Transport, make_transport
from .views import LayerInfo, MessageInfo, layer_stats, log_stats
from .wire import (
    LayerPlan,
    plan_layers,
)

__all__ = [
    "Collectives",
    "LayerInfo",
    "LayerPlan",
    "MessageInfo",
    "SparseExchange",
    "StepHook",
    "StepRecord",
    "StepTrace",
    "check_finite_state",
    "log_stats",
    "plan_layers",
    "select",
    "MAX_MESSAGE_ELEMENTS",
    "STATE_VERSION",
]

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

    Non-finite gradients: if any rank's gradient of any layer is NaN or
    infinite in a step (or a dense layer's reduced gradient is), every rank
    (1) returns outputs that are non-finite for the same layers (a sparse
    layer's output gets NaN in its first element; dense layers carry Horovod's
    non-finite average), so that a loss scaler skips the step everywhere, and
    (2) leaves every residual, velocity and controller state as if the step had
    not happened. The verdict costs one host read per step (an 8-byte flag, as
    a loss scaler's own check does); :attr:`last_step_finite` holds it.
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
    ):
        names = [name for name, _ in layers]
        if len(set(names)) != len(names):
            dups = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"layer names must be unique, duplicates: {dups}")
        too_big = [(name, int(n)) for name, n in layers if int(n) + 1 > MAX_MESSAGE_ELEMENTS]
        if too_big:
            name, n = too_big[0]
            raise ValueError(
                f"parameter {name!r} has {n} elements; dlgs indexes a message with int32, "
                f"so a layer may have at most {MAX_MESSAGE_ELEMENTS - 1} elements (split the "
                "parameter, or leave it out of named_parameters and reduce it yourself)"
            )
        if loss_scale is not None and not callable(loss_scale):
            raise TypeError(
                f"loss_scale must be a callable or None, got {type(loss_scale).__name__}"
            )
        self.ops = ops
        self.comm = comm
        # Where the step, plan and density are agreed after construction or a
        # load (the process set; a two-level exchange: every rank of the job).
        self._agree = agree if agree is not None else comm
        self.config = config
        self.controller = make_controller(config)
        self.average = average
        self.prefix = prefix
        self.dense_external = dense_external
        self.clock = clock
        self._layers = [LayerRecord(name, int(n)) for name, n in layers]
        self._index = {name: i for i, name in enumerate(names)}
        self._plan: Optional[List[Tuple[List[int], Optional[bool]]]] = None
        self._groups: List[MessageRecord] = []
        self._layer_views = tuple(
            LayerInfo(layer, lambda: self._groups, i) for i, layer in enumerate(self._layers)
        )
        self._group_views: Tuple[MessageInfo, ...] = ()
        self._wire_bytes: Optional[int] = None  # wire_bytes() of the layout in force
        self._dense_bytes = 4 * sum(layer.numel for layer in self._layers)
        self.step = 0
        self._density: Optional[float] = None
        # density="auto": what the planner chose (None: not yet, AUTO_START).
        self._auto_density: Optional[float] = None
        # ... and with auto_layers, each layer's (self._layers order), or None.
        self._auto_layers: Optional[Tuple[float, ...]] = None
        self._scratch_abs: Any = None
        self._scratch_mask: Any = None
        # Fused selection kernels (config.kernels), chosen at the first layout.
        self._kernels: Optional[FusedSelection] = None
        self._kernels_chosen = False
        # The controller's vector_keys state of every sparse layer, one host
        # vector per key (a layer's entries are 0-d views): updated in one pass
        # per finite step, from the count words the step gathered (read once,
        # with the non-finite verdict) and each target k + 1.
        self._bank: Optional[ControllerBank] = None
        # How sparse messages travel and come back summed (dlgs.core.transport).
        self._transport: Transport = make_transport(config, ops, comm)
        if config.transport == "auto" and self._transport.name == "flat":
            # No alltoall here (TensorFlow): the planner must not price a reduction.
            self.config = config = dataclasses.replace(config, transport="allgather")
            logger.debug("dlgs: transport='auto' without an alltoall: every message by allgather")
        # Sparse layers in the transport's member order (its flags and count words).
        self._sparse_members: List[int] = []
        self._submitted: set = set()
        self._dense_offsets: Dict[int, int] = {}
        #: A tensor on the exchange's device (the first gradient seen).
        self.like: Any = None
        self._step_start: Optional[float] = None
        self._submit_seconds = 0.0
        self._modes: Tuple[bool, ...] = ()  # per layer: sparse in the layout in force
        #: Called with the exchange and the step's :class:`StepRecord` at the end
        #: of every step (profiling, planning).
        self.step_hooks: List[StepHook] = []
        #: The last finished step's :class:`StepRecord` (None before the first).
        self.last_step: Optional[StepRecord] = None
        self._trace: Optional[StepTrace] = None
        self._trace_next = False
        self.loss_scale = loss_scale
        self._open = False  # a step has begun (first submit) and not finished
        self._scale: Any = None  # this step's loss scale (0-d) or None
        self._inv_scale: Any = None
        self._out_scale: Any = 1.0  # applied to sparse outputs: scale / world
        self._flags: List[Any] = []  # device bools: something non-finite this step
        self._dense_out: Dict[int, Any] = {}  # dense outputs to check this step
        self._finite = True
        # A step's flags and dense outputs, not checked yet (no state to undo).
        self._lazy_flag: Any = None
        self._nonfinite = NonFiniteLog(lambda: self.loss_scale is not None)
        # What every rank must agree on (step, plan, profile, density) is
        # agreed at the first gradient after construction and after every
        # load, never inside load_state_dict (dlgs.core.resume).
        self._sync_pending = True
        self._loaded = False  # loaded a checkpoint since the last agreement
        # (size, rank) at the last agreement: another at a step's first
        # gradient (Horovod Elastic's reset) makes every rank agree again.
        self._world: Optional[Tuple[int, int]] = None
        # A state loaded while training: its shared part, for the next agreement.
        self._stashed: Optional[Dict[str, Any]] = None
        #: Under Horovod Elastic (:class:`~dlgs.core.engine.Engine`'s ``elastic``):
        #: the check that every rank has the same layers and options, run at
        #: each agreement (every rank) instead of at construction; None elsewhere.
        self.elastic_check: Optional[Callable[[], None]] = None
        #: Keep every layer's state buffers in place: a finished step copies its
        #: new residual (and velocity) over the old one instead of swapping the
        #: two buffers, so a step traced into a graph, which holds the buffers
        #: it was traced with, stays valid across host steps (one copy per
        #: sparse layer per host step).
        self.stable_buffers = False
        #: Increases whenever the messages are laid out anew (a traced step is
        #: for one layout).
        self.layout_version = 0
        #: Called (no argument) when the next step must run on the host: a plan,
        #: a density or a timed step was asked for, or a state loaded, between
        #: steps (see :meth:`device_ready`).
        self.listeners: List[Callable[[], None]] = []
        self._device_saved: Any = None  # begin_device_step()'s
        # The bank's vectors on the device (prepare_device_steps), the layout
        # they are for, and each sparse layer's position in them.
        self._device_bank: Optional[Dict[str, Any]] = None
        self._device_bank_version = -1
        self._bank_pos: Dict[int, int] = {}

    # -- introspection -------------------------------------------------------
    @property
    def layers(self) -> Tuple[LayerInfo, ...]:
        """Every layer, in the exchange's order: read-only live views."""
        return self._layer_views

    @property
    def groups(self) -> Tuple[MessageInfo, ...]:
        """The messages of the layout in force (none before the first step):
        read-only live views."""
        return self._group_views

    def index(self, name: str) -> int:
        return self._index[name]

    @property
    def transport(self) -> Transport:
        """How the sparse messages travel (:mod:`dlgs.core.transport`); for
        reading (its bounds, counters), never for issuing collectives."""
        return self._transport

    @property
    def last_step_finite(self) -> bool:
        """Whether the last finished step's gradients were finite on every rank
        (all layers, dense ones included). Reading it after a step with no
        sparse layer and no momentum correction checks that step's dense outputs
        then (read it before ``zero_grad``) and synchronises the device once."""
        if self._lazy_flag is not None:
            (flags, dense), self._lazy_flag = self._lazy_flag, None
            if dense:
                flags = flags + [self.ops.any_nonfinite(dense)]
            if self.ops.to_host(self.ops.any_true(flags)):
                self._finite = False
                self._nonfinite.found_late()
        return self._finite

    @property
    def nonfinite_steps(self) -> int:
        """Steps whose gradients were non-finite somewhere (state left untouched)."""
        return self._nonfinite.steps

    @property
    def last_submit_seconds(self) -> Optional[float]:
        """Host seconds spent inside submit() in the last step: selection,
        packing and starting collectives (on a GPU: launching them)."""
        return self.last_step.submit_seconds if self.last_step is not None else None

    @property
    def agreement_pending(self) -> bool:
        """The next step's first :meth:`submit` agrees the step, plan and
        density across ranks first (after construction or a load): a blocking
        collective on every rank."""
        return self._sync_pending

    @property
    def in_step(self) -> bool:
        """A step has begun (a gradient was submitted) and not finished."""
        return self._open

    @property
    def density(self) -> float:
        """Density in force for the current step; with ``density="auto"``'s
        per-layer choice, the one chosen for every layer, which some layers
        exceed (:attr:`densities`)."""
        if self._auto_density is not None:
            return self._auto_density
        return self.config.density_at(self.step)

    @property
    def densities(self) -> Tuple[float, ...]:
        """Each layer's density in force (:attr:`layers` order): :attr:`density`
        for every layer, unless ``density="auto"`` chose per-layer densities."""
        if self._auto_layers is not None:
            return self._auto_layers
        return (self.density,) * len(self._layers)

    @property
    def auto_layers(self) -> Optional[Tuple[float, ...]]:
        """With ``density="auto"``: the per-layer densities in force
        (:attr:`layers` order), or None when every layer is at :attr:`density`."""
        return self._auto_layers

    def set_density(self, density: float, layers: Optional[Sequence[float]] = None) -> None:
        """With ``density="auto"``: the density chosen (by the planner, the
        same on every rank), in force from the next step's layout; ``layers``:
        each layer's own (:attr:`layers` order), or None for ``density`` in
        every layer."""
        if not self.config.auto:
            raise RuntimeError("set_density() needs density='auto' (the density is fixed)")
        if self._submitted:
            raise RuntimeError("set_density() in the middle of a step")
        check_float("density", density, low=0, high=1, low_open=True)
        each = None if layers is None else checkpoint.layer_densities(layers, len(self._layers))
        if (float(density), each) != (self._auto_density, self._auto_layers):
            self._density = None  # lay out again at the next step
            self.request_host_step()
        self._auto_density, self._auto_layers = float(density), each

    def trace_next_step(self) -> None:
        """Time the next step layer by layer (:class:`StepTrace` in its
        :class:`StepRecord`). Each timed layer calls ``clock()`` twice, which
        on an asynchronous device waits for it: profiling steps only."""
        self._trace_next = True
        self.request_host_step()

    def set_plan(self, plan: Optional[Plan]) -> None:
        """Replace the merge plan: ``[(layer indices, sparse), ...]`` where
        ``sparse`` is True/False or None (sparse if every member would be sent
        sparse on its own). Layers in no group are sent alone by the per-layer
        rule. Takes effect at the next step; every rank must set the same plan.
        ``None`` restores layer-wise sending."""
        if self._submitted:
            raise RuntimeError("set_plan() in the middle of a step")
        if plan is not None:
            flat = [i for members, _ in plan for i in members]
            if len(set(flat)) != len(flat) or any(not 0 <= i < len(self._layers) for i in flat):
                raise ValueError(
                    f"a plan must list distinct layer indices in [0, {len(self._layers)}), "
                    f"got {plan!r}"
                )
            self._plan = [(list(members), sparse) for members, sparse in plan]
        else:
            self._plan = None
        self._density = None
        self.request_host_step()

    def set_groups(self, groups: Optional[Sequence[Sequence[int]]]) -> None:
        """Shorthand for :meth:`set_plan` with every group's mode chosen by rule."""
        self.set_plan(None if groups is None else [(g, None) for g in groups])

    def is_sparse(self, layer: LayerInfo) -> bool:
        """Whether ``layer`` is sent sparse under the current layout
        (:attr:`LayerInfo.sparse`)."""
        return layer.sparse

    def _sparse(self, layer: LayerRecord) -> bool:
        return layer.group >= 0 and self._groups[layer.group].sparse

    def layer_plans(self) -> List[LayerPlan]:
        return plan_layers([layer.numel for layer in self._layers], self.densities, self.config)

    # -- layout ----------------------------------------------------------------
    def _relayout(self, like: Any) -> None:
        """(Re)compute plans and groups for the density in force; allocate buffers."""
        density = self.density
        self._density = density
        self.like = like
        self.layout_version += 1
        for hook in self.step_hooks:
            on_density = getattr(hook, "on_density", None)
            # A planner may answer a density change with a plan for it, which
            # applies in this very layout (the exchange writes its own plan).
            groups = on_density(self, density) if on_density is not None else None
            if groups is not None:
                self._plan = [(list(members), sparse) for members, sparse in groups]
        plans = self.layer_plans()
        densities = self.densities
        ops = self.ops
        if not self._kernels_chosen and like is not None:  # None: a load before any gradient
            self._kernels = ops.fused_selection(like, self.config.kernels)
            self._kernels_chosen = True
            if self._kernels is not None:
                logger.debug("dlgs: sparse layers select with %s kernels", self._kernels.name)
        messages = plan_messages(
            plans,
            [layer.name for layer in self._layers],
            self._plan,
            self.prefix,
            self.config.value_dtype,
            self.config.index_coding,
            dense_alone=self.dense_external,
        )
        for layer in self._layers:
            layer.views.clear()
        sparse_layers = {i for m in messages if m.sparse for i in m.members}
        for i, (layer, plan) in enumerate(zip(self._layers, plans)):
            old = layer.plan
            layer.plan = plan
            layer.group = layer.member = -1
            if i in sparse_layers:
                if layer.residual is None:
                    layer.residual = ops.zeros(layer.numel + 1, "float32", like)
                if layer.residual_next is None:
                    layer.residual_next = ops.zeros(layer.numel + 1, "float32", like)
                if self.config.momentum and layer.velocity is None:
                    layer.velocity = ops.zeros(layer.numel + 1, "float32", like)
                if old is None or old.k != plan.k or not layer.ctrl:
                    layer.ctrl = self.controller.init_state(ops, like, densities[i])
                if self._kernels is not None and layer.work is None:
                    layer.work = self._kernels.workspace(layer.numel, like)
            else:
                layer.residual_next = None  # a dense layer flushes its residual
            if self.config.momentum and layer.velocity is not None:
                if layer.velocity_next is None:
                    layer.velocity_next = ops.zeros(layer.numel + 1, "float32", like)
        self._groups = []
        self._wire_bytes = None
        for gi, spec in enumerate(messages):
            members = list(spec.members)
            group = MessageRecord(members, spec.sparse, spec.name)
            if spec.sparse:
                layout = spec.layout
                assert layout is not None
                group.layout = layout
                group.chunk = layout.new_chunk(ops, like)
                group.member_views = [
                    layout.member_views(ops, group.chunk, m) for m in range(len(members))
                ]
            elif len(members) > 1:
                group.dense = ops.zeros(spec.size, "float32", like)
            for m, i in enumerate(members):
                self._layers[i].group = gi
                self._layers[i].member = m
                if not spec.sparse:
                    self._layers[i].ctrl = {}
                    self._dense_offsets[i] = spec.offsets[m]
            self._groups.append(group)
        self._group_views = tuple(MessageInfo(g, n) for n, g in enumerate(self._groups))
        self._modes = tuple(i in sparse_layers for i in range(len(self._layers)))
        self._build_unpack(like)
        self._build_bank()
        biggest = max((plans[i].numel for i in sparse_layers), default=0)
        if biggest and (self._scratch_abs is None or ops.numel(self._scratch_abs) < biggest):
            self._scratch_abs = ops.zeros(biggest, "float32", like)
            self._scratch_mask = ops.zeros(biggest, "bool", like)
        logger.debug(
            "dlgs layout at step %d: density %g, %d layers in %d messages (%d sparse)",
            self.step,
            density,
            len(self._layers),
            len(self._groups),
            sum(1 for g in self._groups if g.sparse),
        )

    def _build_unpack(self, like: Any) -> None:
        """The transport's receive buffers; each sparse member's output a view."""
        sparse = [g for g in self._groups if g.sparse]
        outputs = self._transport.layout([g.layout for g in sparse], like)  # type: ignore[misc]
        for position, (group, views) in enumerate(zip(sparse, outputs)):
            group.outputs = views
            group.position = position
        self._sparse_members = [i for g in sparse for i in g.members]

    def _build_bank(self) -> None:
        """The sparse layers' controller learning state in one bank (their
        values carried over), so a step updates every layer at once."""
        # The transport's member order: the step's count words arrive in it.
        layers = [self._layers[i] for i in self._sparse_members]
        self._bank = ControllerBank.of(
            self.ops,
            self.controller,
            [layer.ctrl for layer in layers],
            [_plan(la).k for la in layers],
        )

    def _read_verdict(self, dense_flag: Any) -> Tuple[bool, Any]:
        """Whether the step was finite on every rank, and every rank's count
        words (for the controllers), in one host read: the step's only one (an
        anchor step adds one, :meth:`_update_bank`). A sparse member that was
        non-finite on some rank carries -1 as its count word (every rank sees
        every rank's words), so the words are the sparse verdict; a dense
        layer's verdict (``dense_flag``, 0-d bool or None) travels with them."""
        ops = self.ops
        counts = self._transport.counts if self._sparse_members and self._flags else None
        if counts is None:
            return dense_flag is None or not ops.to_host(dense_flag), None
        if dense_flag is None:
            host = np.asarray(ops.to_host(counts)).reshape(-1)
            return bool(host.min() >= 0), host
        flag = ops.cast(ops.reshape(dense_flag, (1,)), "int32")
        host = np.asarray(ops.to_host(ops.concat([flag, counts]))).reshape(-1)
        return bool(host[0] == 0 and host[1:].min() >= 0), host[1:]

    def _update_bank(self, words: Any) -> None:
        """The controller's update of every sparse layer after a finite step,
        from the count words the step gathered (read with the verdict: this
        rank's row is what its layers selected; on an anchor step, one more
        read, of the anchors), then host arithmetic; no device operation."""
        assert self._bank is not None and words is not None
        words = np.asarray(words, np.float64)
        own = self._transport.own_counts(words, self.comm.rank, self.comm.size)
        self._bank.update(self.ops, own)

    # -- the per-step path -----------------------------------------------------
    def _begin_step(self) -> None:
        """Once per step, at the first submit: read the loss scale."""
        self._open = True
        if self._trace_next:
            self._trace, self._trace_next = StepTrace(), False
        ops = self.ops
        base = 1.0 / self.comm.size if self.average else 1.0
        scale = self.loss_scale() if self.loss_scale is not None else None
        self._scale = scale
        if scale is None:
            self._inv_scale = None
            self._out_scale = base
        else:
            self._inv_scale = ops.reciprocal(scale)
            self._out_scale = ops.mul(scale, base) if base != 1.0 else scale

    def submit(self, i: int, grad: Any) -> Any:
        """Hand in layer ``i``'s gradient; starts its group's collective once
        every member is in. Call at most once per layer per step.

        With ``dense_external``, returns the tensor the caller must allreduce
        for a dense layer (its gradient, plus any residual it still owed);
        otherwise None. Multiply the caller's reduced result by
        :meth:`external_scale` (when not None) before handing it on.
        """
        layer = self._layers[i]
        ops = self.ops
        if ops.numel(grad) != layer.numel:
            raise ValueError(
                f"gradient of {layer.name!r} has {ops.numel(grad)} elements, expected {layer.numel}"
            )
        if i in self._submitted:
            raise RuntimeError(f"gradient of {layer.name!r} submitted twice in one step")
        if not self._submitted:
            world = (self._agree.size, self._agree.rank)
            if world != self._world and self._world is not None:
                # Horovod Elastic reset the job to another size or ranking:
                # every rank of the new world sees the change (or is new, its
                # agreement pending) and agrees, then lays out anew for it.
                logger.info(
                    "dlgs: the job is now rank %d of %d (was %d of %d)",
                    *world[::-1],
                    *self._world[::-1],
                )
                # What this rank holds stands as a loaded state would: a
                # worker that joined (fresh, nothing loaded) takes it.
                self._agree_again(holds_state=True)
            if self._sync_pending:
                self._sync()
        if self._density is None or self.density != self._density:
            self._relayout(grad)
        entered = time.perf_counter()  # never synchronises a device
        if not self._open:
            self._begin_step()
        if self._step_start is None:
            self._step_start = entered
        trace = self._trace
        if trace is not None:
            t0 = self.clock()
        self._submitted.add(i)
        group = self._groups[layer.group]
        result = None
        if group.sparse:
            self._sparsify(layer, group, grad)
            group.ready += 1
            if group.ready == len(group.members):
                group.handle = self._transport.start(group.position, group.chunk, group.name)
        else:
            grad = self._dense_send(layer, grad)
            if self.dense_external:
                result = grad
                group.handle = grad
            elif len(group.members) == 1:
                group.handle = self.comm.allreduce_async(grad, group.name)
            else:
                off = self._dense_offsets[i]
                ops.copy_(ops.narrow(group.dense, 0, off, layer.numel), grad)
                group.ready += 1
                if group.ready == len(group.members):
                    group.handle = self.comm.allreduce_async(group.dense, group.name)
        if trace is not None:
            trace.arrive[i] = t0
            trace.done[i] = self.clock()
        self._submit_seconds += time.perf_counter() - entered
        return result

    def _dense_send(self, layer: LayerRecord, grad: Any) -> Any:
        """What a dense layer sends: its gradient (scaled units), or with
        momentum correction its new velocity (unscaled), plus any residual it
        still owes. State goes to the ``*_next`` buffers (see :meth:`finish`)."""
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
            vel = self._advance_velocity(layer, grad)
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
            grad = ops.add_into_(out, grad, owed, self._scale)
            layer.flush = True
        return grad

    def _advance_velocity(self, layer: LayerRecord, grad: Any) -> Any:
        """``u' = m u + g / scale`` into the layer's spare velocity buffer."""
        n = layer.numel
        return self.ops.momentum_into_(
            self.ops.narrow(layer.velocity_next, 0, 0, n),
            self.ops.narrow(layer.velocity, 0, 0, n),
            self.config.momentum,
            grad,
            self._inv_scale,
        )

    def external_scale(self) -> Any:
        """The factor (0-d tensor) by which a ``dense_external`` layer's reduced
        tensor must be multiplied to be in the step's scaled units, or None."""
        if self.config.momentum and self._scale is not None:
            return self._scale
        return None

    def _sparsify(self, layer: LayerRecord, group: MessageRecord, grad: Any) -> None:
        ops = self.ops
        plan = layer.plan
        assert plan is not None  # set by _relayout before any submit
        k, cap = plan.k, plan.capacity
        layout = group.layout
        assert layout is not None  # sparse groups always have one
        # This step's accumulation goes into the spare buffers (finish() swaps
        # them in): a = r + g / scale, or with momentum a = r + (m u + g / scale).
        nxt = layer.residual_next
        acc = layer.head(ops, nxt)
        res = layer.head(ops, layer.residual)
        vel = self._advance_velocity(layer, grad) if layer.velocity is not None else None
        layer.ctrl_prev = dict(layer.ctrl)  # restored if the step is not finite
        bank = self._bank
        if self._kernels is not None:
            masked = vel is not None and self.config.momentum_masking
            layer.count, layer.theta = select_and_pack(
                ops,
                self._kernels,
                layer.work,
                self.controller,
                layer.ctrl,
                layout,
                group.member_views[layer.member],
                layer.member,
                acc,
                res,
                vel if vel is not None else grad,
                self._inv_scale if vel is None else None,
                k,
                self.step,
                layer.head(ops, self._scratch_abs),
                layer.velocity_next if masked else None,
            )
            if bank is None:
                self.controller.update(ops, layer.ctrl, layer.theta, layer.count, k)
            return
        if vel is not None:
            ops.add_into_(acc, res, vel, None)
        else:
            ops.add_into_(acc, res, grad, self._inv_scale)
        threshold = None
        if bank is not None and self._device_saved is not None:
            # A step on the device alone: theta from the factor there.
            dev = self._device_bank
            assert dev is not None
            factor = ops.narrow(dev["factor"], 0, self._bank_pos[self._index[layer.name]], 1)

            def threshold(absx: Any, total: Any) -> Any:
                return self.controller.device_threshold(ops, factor, total, layer.numel)

        idx, count, theta, total = select_with_total(
            ops,
            self.controller,
            layer.ctrl,
            acc,
            k,
            cap,
            self.step,
            layer.head(ops, self._scratch_abs),
            layer.head(ops, self._scratch_mask),
            update=bank is None,
            threshold=threshold,
        )
        # The sum of |a| tells whether it has a NaN or an infinity; the verdict
        # travels as the member's count word (-1), so every rank learns it.
        ok = ops.below_inf(total)
        out_vals = layout.pack_into(
            ops,
            group.member_views[layer.member],
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
        if layer.velocity is not None and self.config.momentum_masking:
            ops.fill_at_(layer.velocity_next, idx, 0.0)  # DGC factor masking
        layer.count = count
        layer.theta = theta

    def pending(self) -> List[int]:
        """Layers not yet submitted this step."""
        return [i for i in range(len(self._layers)) if i not in self._submitted]

    def _tracks_state(self) -> bool:
        """Whether this step changed state that a non-finite step must undo."""
        return bool(self.config.momentum) or any(
            g.sparse or any(self._layers[i].flush for i in g.members) for g in self._groups
        )

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
            names = [self._layers[i].name for i in missing[:5]]
            raise RuntimeError(f"wait() before every layer was submitted; missing {names}")
        ops = self.ops
        out: Dict[int, Any] = {}
        handles: List[Any] = []
        verify: List[bool] = []
        for group in self._groups:
            if not group.sparse:
                if self.dense_external:
                    out[group.members[0]] = group.handle
                    continue
                reduced = self.comm.synchronize(group.handle)
                if self.config.momentum and self._scale is not None:
                    reduced = ops.mul(reduced, self._scale)  # velocities are unscaled
                if len(group.members) == 1:
                    out[group.members[0]] = reduced
                else:
                    for i in group.members:
                        off, n = self._dense_offsets[i], self._layers[i].numel
                        out[i] = ops.narrow(ops.reshape(reduced, (-1,)), 0, off, n)
                self._dense_out[group.members[0]] = reduced
            else:
                handles.append(group.handle)
                verify.append(not group.verified)
                group.verified = True
                for i, view in zip(group.members, group.outputs):
                    out[i] = view
            group.ready = 0
            group.handle = None
        if handles:
            # Every sparse message of the step at once; members non-finite on
            # some rank read NaN on every rank.
            self._flags.append(self._transport.finish(handles, verify, self._out_scale))
            self._take_back()
        if finish:
            self.finish()
        return out

    def returned(self) -> Dict[int, Any]:
        """For checks: what the last step put back into each sparse layer's
        residual because the transport did not deliver it (a reduction's
        unsent or unkept entries; empty for the allgather), by layer index
        (``numel`` float32, views valid until the next step's :meth:`wait`)."""
        sparse = [g for g in self._groups if g.sparse]
        return {
            i: view
            for group, views in zip(sparse, self._transport.returned())
            for i, view in zip(group.members, views)
        }

    def _take_back(self) -> None:
        """What the transport did not deliver of this rank's selection (a
        reduction's unsent or unkept entries) back into the new residuals."""
        if not self._transport.returned():  # the allgather delivers everything
            return
        for i, view in self.returned().items():
            layer = self._layers[i]
            self.ops.add_(layer.head(self.ops, layer.residual_next), view)

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
        ops = self.ops
        flags = list(self._flags)  # the lazy path's
        theirs = [t for _, t in external] if verdicts is None else list(verdicts)
        dense = list(self._dense_out.values()) + theirs
        self._lazy_flag = None
        words = None  # the step's count words, read with the verdict
        if self._tracks_state():
            finite, words = self._read_verdict(ops.any_nonfinite(dense) if dense else None)
        else:
            # Nothing to undo (every layer dense, no momentum correction): the
            # dense outputs are checked only if asked (last_step_finite), so a
            # dense step costs neither a pass over them nor a host sync.
            self._lazy_flag = (flags, dense) if flags or dense else None
            finite = True
        submitted = sorted(self._submitted)
        if finite and self._bank is not None:
            self._update_bank(words)
        for i in submitted:
            layer = self._layers[i]
            sparse = self._sparse(layer)
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
            layer.ctrl_prev = None
            layer.flush = False
        if not finite:
            self._nonfinite.nonfinite(self.step, lambda: self._nonfinite_names(external))
        else:
            self._nonfinite.finite()
        self._finite = finite
        self._flags.clear()
        self._dense_out.clear()
        self._open = False
        self._submitted.clear()
        start, self._step_start = self._step_start, None
        submit, self._submit_seconds = self._submit_seconds, 0.0
        trace, self._trace = self._trace, None
        if trace is not None:
            trace.waited = self.clock()
        record = StepRecord(
            step=self.step,
            seconds=time.perf_counter() - start if start is not None else None,
            submit_seconds=submit,
            layers_sparse=self._modes,
            trace=trace,
        )
        self.last_step = record
        self.step += 1
        for hook in list(self.step_hooks):
            hook(self, record)
        return finite

    def _keep_next(self, layer: LayerRecord, kind: str) -> None:
        """The step's new ``residual`` / ``velocity`` (in ``*_next``) in force."""
        new = getattr(layer, f"{kind}_next")
        if self.stable_buffers:
            self.ops.copy_(getattr(layer, kind), new)
        else:
            setattr(layer, f"{kind}_next", getattr(layer, kind))
            setattr(layer, kind, new)

    def request_host_step(self) -> None:
        """The next step must run on the host (it tells :attr:`listeners`):
        called by the setters here, after a load, and by whatever changes the
        step hooks' needs between steps (``reprofile()``)."""
        for listener in list(self.listeners):
            listener()

    # -- steps on the device alone (traced into a graph) ---------------------------
    def device_ready(self, now: bool = True) -> Optional[str]:
        """None when the next step can run with device operations alone (no
        host read: traced once into a graph and run many times), else why
        not. Such a step submits and waits as usual, then ends with
        :meth:`finish_on_device`; the host's side (the step count, the
        controllers' learning, the step hooks) does not run: steps that need
        it run on the host. Needs: the layout of the density in force made
        and verified, no agreement, timed step or relayout pending, a
        controller that learns nothing on the host, the allgather transport,
        and no dense layer still owing a residual.
        ``now=False``: whether such a step can be traced now, for later steps
        (an anchor due next is no obstacle; an agreement or a timed step due
        is: a submit would run it while tracing)."""
        if self._open or self._submitted:
            return "a step is under way"
        if self._density is None or self.density != self._density:
            return "the messages are laid out anew at the next step"
        if self._sync_pending:
            return "the ranks agree on the step and plan at the next step"
        if self._trace_next:
            return "the next step is timed layer by layer"
        if self._bank is not None:
            name = self.config.controller.value
            if getattr(self.ops, "vector_math", None) is None or self._kernels is not None:
                return f"the {name!r} controller learns on the host with these array ops"
            if now and self._bank.steps_before_anchor() == 0:
                return "the next step anchors thresholds (on the host)"
            if self._device_bank is None or self._device_bank_version != self.layout_version:
                return "the controllers' state is not on the device (prepare_device_steps)"
        if self.dense_external:
            return "dense layers are reduced by the caller"
        if self._transport.name != "flat":
            return f"transport {self.config.transport!r}"
        if any(not g.verified for g in self._groups if g.sparse):
            return "a message's layout is not verified across ranks yet"
        if any(layer.residual is not None and not self._sparse(layer) for layer in self._layers):
            return "a dense layer still owes its residual"
        return None

    def device_budget(self) -> int:
        """How many steps may run on the device from here before one needs the
        host for the controllers (a threshold's anchor); -1: any."""
        return -1 if self._bank is None else self._bank.steps_before_anchor()

    def prepare_device_steps(self) -> None:
        """After a host step, before steps on the device: the controllers'
        learning state copied to the device (allocated once per layout; needs
        ``ops.vector_math``). No-op where no controller learns."""
        if self._bank is None or getattr(self.ops, "vector_math", None) is None:
            return
        if self._device_bank is None or self._device_bank_version != self.layout_version:
            self._device_bank = self._bank.to_device(self.ops, self.like)
            self._device_bank_version = self.layout_version
            self._bank_pos = {i: j for j, i in enumerate(self._sparse_members)}
        else:
            self._bank.push(self.ops, self._device_bank)

    def begin_device_step(self) -> None:
        """Before the submits of a step that ends with :meth:`finish_on_device`:
        what the last host step left for :meth:`stats` and the verdict (each
        layer's count and threshold, the transport's count words) is kept and
        put back at its end, so that a step traced into a graph leaves none of
        the graph's tensors behind."""
        self._device_saved = (
            [(layer.count, layer.theta) for layer in self._layers],
            self._transport.counts,
            self._transport.bad,
        )

    def finish_on_device(self) -> Any:
        """End a step of :meth:`device_ready`'s kind (after :meth:`wait` with
        ``finish=False``) with device operations alone: every sparse layer
        keeps its new residual (and every layer its new velocity, with
        momentum correction) where the step was finite on every rank (its
        count words all non-negative and every dense output finite), the old
        one otherwise. Returns that verdict (0-d bool). Nothing on the host
        advances: the caller counts the steps that ran this way and hands
        them to :meth:`account_device_steps`."""
        if self._device_saved is None:
            raise RuntimeError("finish_on_device() needs begin_device_step() before the step")
        ops = self.ops
        flags = list(self._flags)
        counts = self._transport.counts if self._sparse_members else None
        if counts is not None:
            flags.append(ops.any_negative_rows(counts, 1))
        dense = list(self._dense_out.values())
        if dense:
            flags.append(ops.any_nonfinite(dense))
        ok = ops.none_true(flags)  # a step has sparse members or dense outputs
        dev = self._device_bank
        math = getattr(ops, "vector_math", None)
        if self._bank is not None and dev is not None and counts is not None and math is not None:
            # The controllers learn from this rank's counts, kept where finite.
            n = len(self._sparse_members)
            own = ops.cast(ops.narrow(counts, 0, self.comm.rank * n, n), "float64")
            vectors = {key: ops.cast(dev[key], "float64") for key in self._bank.keys}
            new = self.controller.device_update(math, vectors, own, ops.cast(dev["k1"], "float64"))
            for key, value in new.items():
                ops.select_(dev[key], ok, value)
        for i in sorted(self._submitted):
            layer = self._layers[i]
            if self._sparse(layer):
                ops.select_(layer.residual, ok, layer.residual_next)
            if layer.velocity_next is not None:  # momentum correction
                ops.select_(layer.velocity, ok, layer.velocity_next)
        self.abort_step()  # the step's host bookkeeping, as before it
        return ok

    def abort_step(self) -> None:
        """Drop the step under way, so that the next one starts clean: what
        :meth:`finish_on_device` ends with (the host's bookkeeping put back as
        before :meth:`begin_device_step`), and what an adapter calls after an
        error inside a step (a failed trace, a DDP hook that raised)."""
        saved, self._device_saved = self._device_saved, None
        if saved is not None:
            for layer, (count, theta) in zip(self._layers, saved[0]):
                layer.count, layer.theta = count, theta
            self._transport.counts, self._transport.bad = saved[1], saved[2]
        for group in self._groups:
            group.ready, group.handle = 0, None
        for layer in self._layers:
            layer.ctrl_prev = None
        self._flags.clear()
        self._dense_out.clear()
        self._open = False
        self._submitted.clear()
        self._step_start, self._submit_seconds, self._trace = None, 0.0, None
        self._scale = self._inv_scale = None
        self._out_scale = 1.0

    def account_device_steps(
        self, steps: int, nonfinite: int = 0, last_finite: bool = True
    ) -> None:
        """``steps`` steps ran on the device alone (:meth:`finish_on_device`),
        ``nonfinite`` of them not finite on some rank, the last one finite or
        not: count them (and report the non-finite ones, as a host step would)."""
        check_int("steps", steps, 0)
        check_int("nonfinite", nonfinite, 0)
        if nonfinite > steps:
            raise ValueError(f"nonfinite must be at most steps ({steps}), got {nonfinite}")
        if not steps:
            return
        self.step += steps
        bank, dev = self._bank, self._device_bank
        current = self._device_bank_version == self.layout_version
        if bank is not None and dev is not None and current:
            bank.pull(self.ops, dev, steps - nonfinite)
        self._lazy_flag = None  # the last step's verdict is this one
        self._finite = bool(last_finite)
        self._nonfinite.device_steps(self.step - 1, steps, nonfinite, bool(last_finite))

    def _nonfinite_names(self, external: Sequence[Tuple[int, Any]]) -> List[str]:
        """The layers whose reduced gradient is non-finite this step: each
        member of a merged dense message checked on its own."""
        ops = self.ops
        names = []
        flags = self._transport.bad
        if self._sparse_members and flags is not None:
            bad = ops.to_host(flags)
            names += [self._layers[i].name for i, b in zip(self._sparse_members, bad) if b]
        parts = []
        for first, t in self._dense_out.items():
            members = self._groups[self._layers[first].group].members
            if len(members) == 1:
                parts.append((first, t))
                continue
            flat = ops.reshape(t, (-1,))
            for j in members:
                parts.append(
                    (j, ops.narrow(flat, 0, self._dense_offsets[j], self._layers[j].numel))
                )
        for i, t in parts + list(external):
            if ops.to_host(ops.any_nonfinite([t])):
                names.append(self._layers[i].name)
        return names

    # -- statistics and checkpoints -------------------------------------------
    def message_bytes(self, message: Any) -> int:
        """Bytes this rank contributes to ``message`` (a :class:`MessageInfo`,
        or the exchange's own record) per step."""
        group = self._groups[message.index] if isinstance(message, MessageInfo) else message
        if group.sparse:
            assert group.layout is not None
            return self._transport.message_bytes(group.layout)
        return 4 * sum(self._layers[i].numel for i in group.members)

    def wire_bytes(self) -> int:
        """Bytes this rank contributes per step under the layout in force, over
        all its messages (sparse ones at capacity, with their fingerprint
        word; dense layers as float32, before any Horovod compression). No
        device read; computed once per layout."""
        if self._wire_bytes is None:
            self._wire_bytes = sum(self.message_bytes(g) for g in self._groups)
        return self._wire_bytes

    def dense_bytes(self) -> int:
        """Bytes per step of a dense float32 exchange of every layer (what
        Horovod's allreduce moves without compression): the reference for
        :meth:`wire_bytes`."""
        return self._dense_bytes

    def stats(self) -> List[Dict[str, Any]]:
        """Per-layer numbers of the last step (synchronises; not for the hot path).

        Keys: name, numel, sparse, k, capacity, selected (count with
        ``|a| >= theta``), sent (``min(selected, capacity)``), density
        (selected / numel), threshold, wire_bytes (this layer's part of this
        rank's message per step: count word, values and indices, or the
        float32 gradient), message (the layer's message), message_bytes (that
        whole message from this rank, with its 4-byte fingerprint word: what
        the collective moves; :meth:`wire_bytes` sums them).
        """
        return layer_stats(self)

    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals, velocities and controller states, with the step.

        Residuals are rank-local (each rank holds the gradient it has not sent
        yet); the dict is tagged with rank and world size so that
        :meth:`load_state_dict` restores them only where they belong.
        """
        return {
            "version": STATE_VERSION,
            **self._shared_state(),
            "rank": self.comm.rank,
            "size": self.comm.size,
            "config": self.config.to_dict(),
            "layers": checkpoint.layer_states(self.ops, self._layers),
        }

    def _shared_state(self) -> Dict[str, Any]:
        """What every rank must hold alike (:data:`dlgs.core.resume.SHARED_KEYS`)."""
        return {
            "step": self.step,
            "plan": self._plan,
            "hooks": {
                _hook_key(h): h.state_dict() for h in self.step_hooks if hasattr(h, "state_dict")
            },
            "auto_density": self._auto_density,
            "auto_layers": None if self._auto_layers is None else list(self._auto_layers),
            "regions": self._transport.state(),
        }

    def load_state_dict(self, state: Dict[str, Any], like: Any) -> None:
        """Restore a :meth:`state_dict`, validating everything before changing
        anything. Call it between steps.

        Issues no collective, so it is safe on one rank: Horovod's resume
        recipe loads on rank 0 only and hands the parameters and the wrapped
        optimizer's state to the others with its broadcasts. What every rank
        must agree on (the step, the merge plan, the planner's profile,
        ``density="auto"``'s choice) is agreed at the first gradient of the
        next step, which every rank reaches (:mod:`dlgs.core.resume`): ranks
        that did not load a state take the loading ranks' (their residuals
        stay as they were, empty in a fresh job, and their thresholds start
        afresh; logged once); ranks that loaded states that disagree raise
        :class:`~dlgs.core.consistency.RankMismatchError` there, all of them.

        Errors (nothing is changed): another state version, other parameter
        names, a residual / velocity whose size is not its parameter's (a
        checkpoint of another model), naming the parameter and both sizes, or
        a residual, velocity or threshold that is NaN or infinite (a damaged
        checkpoint: every later step would be non-finite).

        Documented resets, each with a warning: residuals and velocities saved
        by another rank or at another world size are set to zero (they are at
        most a few steps' worth of gradient this rank had not sent yet); a
        changed controller, a changed ``threshold`` of the fixed controller, or a
        changed density or warm-up restart the thresholds (the dynamic
        controller re-anchors on the exact top-k at the next step). Residuals
        are float32 whatever the parameters' dtype, so a dtype change needs no
        reset.
        """
        own, restart = self.check_state_dict(state)
        saved = state["layers"]
        if not own:
            logger.warning(
                "dlgs state was saved by rank %s of %s, this is rank %d of %d: residuals "
                "reset to zero (save one state per rank to resume exactly)",
                state.get("rank"),
                state.get("size"),
                self.comm.rank,
                self.comm.size,
            )
        if restart:
            logger.warning(
                "dlgs options changed since the checkpoint (%s): thresholds start afresh "
                "(residuals are kept)",
                ", ".join(restart),
            )
        if self.training:
            # After the ranks agreed and stepped, the others do not know of
            # this load: an agreement on this rank alone would wait for them
            # forever (issue 42), and a step or plan in force here alone
            # would split the ranks' messages. This rank's own layers load now;
            # the shared part is kept for the next agreement every rank runs
            # (after Horovod Elastic's reset), else the agreed one stays.
            self._restore_layers(saved, like, own, restart)
            self._stashed = state
            if any(state.get(k) != v for k, v in self._shared_state().items() if k != "hooks"):
                logger.warning(
                    "dlgs: a state loaded after training began restores this rank's residuals "
                    "and thresholds; the step (%s, checkpoint %s), plan and density stay as "
                    "the ranks agreed (docs/design.md, 'Checkpoints and residuals')",
                    self.step,
                    state.get("step"),
                )
            # Residuals were restored in place; the controllers' state goes to
            # the device bank a traced step reads. No host step is asked for:
            # the ranks take host or device steps together (TensorFlow's graph
            # budget), and only this rank knows of the load.
            if self._device_bank is not None and self._device_bank_version == self.layout_version:
                assert self._bank is not None
                self._bank.push(self.ops, self._device_bank)
            return
        self._apply_shared(state)
        self._relayout(like)
        self._restore_layers(saved, like, own, restart)
        self.request_host_step()  # the agreement, and buffers a traced step does not hold
        # Any load counts, even of the state in force: a rank that loads must
        # agree with the other loading ranks (a stale file is an error), never
        # be rolled back or forward silently by them.
        self._sync_pending = self._loaded = True

    def resync(self) -> None:
        """Agree at the next gradient, every rank (see
        :meth:`dlgs.core.engine.Engine.resync`): a state loaded since the last
        agreement takes part as a load, with its step, plan and density."""
        if self._submitted:
            raise RuntimeError("resync() in the middle of a step")
        self._agree_again(holds_state=False)
        self.request_host_step()  # the agreement, on every rank

    def _agree_again(self, holds_state: bool) -> None:
        """Every rank agrees at the next gradient (then lays out anew): a state
        loaded since the last agreement takes part as a load, with its shared
        part; ``holds_state``: so does what this rank holds without one."""
        stashed, self._stashed = self._stashed, None
        if stashed is not None:
            self._apply_shared(stashed)
        self._loaded = self._loaded or holds_state or stashed is not None
        self._sync_pending, self._density = True, None

    @property
    def training(self) -> bool:
        """The ranks agreed and no agreement is due: a load now is this rank's
        alone (the others learn nothing of it)."""
        # Under Horovod Elastic a load is the restore every surviving rank
        # runs before the reset, after which every rank agrees.
        # On one rank there is no one to tell: a load takes the whole state.
        world = self._world
        elastic = self.elastic_check is not None
        return world is not None and world[0] > 1 and not self._sync_pending and not elastic

    def _apply_shared(self, state: Dict[str, Any]) -> None:
        """Put a state's shared part (:func:`dlgs.core.resume.shared`) in
        force: step, plan, ``density="auto"``'s choice and the step hooks'
        states (the planner re-plans from its profile). Laid out anew at the
        next gradient; on an error nothing is changed."""
        auto_layers = state.get("auto_layers")
        if auto_layers is not None:
            auto_layers = checkpoint.layer_densities(auto_layers, len(self._layers))
        plan = state.get("plan")
        old = (self.step, self._plan, self._auto_density, self._auto_layers)
        self.step = state["step"]
        self._plan = [(list(m), s) for m, s in plan] if plan is not None else None
        # The density the planner chose stays in force (before the planner
        # re-plans from its saved profile at it).
        self._auto_density = state.get("auto_density") if self.config.auto else None
        # With auto_layers turned off since, one density for every layer.
        per_layer = self.config.auto and self.config.auto_layers
        self._auto_layers = auto_layers if per_layer else None
        try:
            self._transport.load_state(state.get("regions"))
            for hook in self.step_hooks:
                if hasattr(hook, "load_state_dict"):
                    hook.load_state_dict((state.get("hooks") or {}).get(_hook_key(hook), {}), self)
        except Exception:
            self.step, self._plan, self._auto_density, self._auto_layers = old
            self._transport.load_state(None)
            raise
        self._density = None

    def _sync(self) -> None:
        """The agreement after construction or a load (:mod:`dlgs.core.resume`),
        at the first gradient of a step: one gather of a small record from
        every rank of the process set, the same verdict on every rank."""
        self._sync_pending = False
        self._stashed = None
        loaded, self._loaded = self._loaded, False
        agree = self._agree
        self._world = (agree.size, agree.rank)
        if agree.size <= 1:
            return
        if self.elastic_check is not None:
            self.elastic_check()
        part = agree_shared(agree, loaded, self._shared_state(), f"{self.prefix}.sync")
        if part is not None:
            self._apply_shared(part)

    def check_state_dict(self, state: Any) -> Tuple[bool, List[str]]:
        """Validate a :meth:`state_dict` for this exchange without changing
        anything (what :meth:`load_state_dict` checks first). Returns whether
        it is this rank's own state and the options whose change restarts the
        thresholds."""
        if self._submitted:
            raise RuntimeError("load_state_dict() in the middle of a step")
        return checkpoint.validate(
            self.ops,
            state,
            [(layer.name, layer.numel) for layer in self._layers],
            self.config,
            self.comm.rank,
            self.comm.size,
        )

    def _restore_layers(self, saved: Dict[str, Any], like: Any, own: bool, restart: List[str]):
        sparse = [self._sparse(layer) for layer in self._layers]
        checkpoint.restore_layers(
            self.ops,
            self.controller,
            self._layers,
            sparse,
            self.densities,
            saved,
            like,
            own=own,
            restart=bool(restart),
        )
        self._build_bank()


def _plan(layer: LayerRecord) -> LayerPlan:
    assert layer.plan is not None  # set by the layout
    return layer.plan


def _hook_key(hook: Any) -> str:
    return getattr(hook, "state_key", type(hook).__name__)
