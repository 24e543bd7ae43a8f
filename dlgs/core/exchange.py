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

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from . import checkpoint
from ._checks import check_float
from .backend import ArrayOps
from .bank import ControllerBank
from .checkpoint import STATE_VERSION, check_finite_state
from .config import SparsityConfig, ValueDType
from .controller import ThresholdController, make_controller
from .layout import plan_messages
from .resume import SyncRecord, resolve
from .selection import FusedSelection, select_and_pack
from .transport import MAX_MESSAGE_ELEMENTS, Transport, make_transport
from .wire import (
    GroupLayout,
    LayerPlan,
    MemberViews,
    plan_layers,
)

__all__ = [
    "Collectives",
    "LayerPlan",
    "SparseExchange",
    "StepHook",
    "check_finite_state",
    "log_stats",
    "plan_layers",
    "select",
    "MAX_MESSAGE_ELEMENTS",
    "STATE_VERSION",
]

logger = logging.getLogger(__name__)


# Non-finite steps are logged at most once per this many seconds.
_NONFINITE_LOG_INTERVAL = 30.0
#: A run of this many non-finite steps in a row is warned about (and again at
#: every doubling; twice as many with a loss scaler): a scaler halving from
#: 65536 is finite long before.
NONFINITE_RUN = 16


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
    idx, count, theta, _ = _select(
        ops, controller, state, acc, k, capacity, step, scratch_abs, scratch_mask
    )
    return idx, count, theta


def _select(ops, controller, state, acc, k, capacity, step, scratch_abs, scratch_mask, update=True):
    """:func:`select`, also returning the sum of ``|acc|`` (NaN or infinite
    exactly when some element is, or when finite magnitudes overflow float32:
    the non-finite check). ``update=False`` leaves the controller's update to
    the caller (an exchange updates all its layers at once, at the end of a
    finite step)."""
    n = ops.numel(acc)
    absx = ops.abs_(acc, scratch_abs)
    total = ops.total(absx)
    theta = controller.threshold(ops, state, absx, k, step, total)
    mask = ops.ge_(absx, theta, scratch_mask)
    count = ops.count_nonzero(mask)
    idx = ops.nonzero_static(mask, capacity, n)
    if update:
        controller.update(ops, state, theta, count, k)
    return idx, count, theta, total


class _Layer:
    """Mutable per-layer state: residual, optional velocity, controller state.

    Residual and velocity are double-buffered: a step writes its new state into
    the ``*_next`` buffers and :meth:`SparseExchange.finish` swaps them in only
    if the step was finite on every rank, so a skipped step is undone exactly
    and at no cost (no copy, no extra pass).
    """

    __slots__ = (
        "name",
        "numel",
        "plan",
        "residual",
        "residual_next",
        "velocity",
        "velocity_next",
        "send",
        "ctrl",
        "ctrl_prev",
        "flush",
        "count",
        "theta",
        "group",
        "member",
        "views",
        "work",
    )

    def __init__(self, name: str, numel: int):
        self.name = name
        self.numel = numel
        self.plan: Optional[LayerPlan] = None
        # n + 1 float32, in unscaled gradient units: the last slot is the padding slot.
        self.residual: Any = None
        self.residual_next: Any = None
        self.velocity: Any = None
        self.velocity_next: Any = None
        # A dense layer's send buffer under momentum correction (n float32):
        # its velocity stays this rank's own, whatever the reduction does in place.
        self.send: Any = None
        self.ctrl: Dict[str, Any] = {}
        self.ctrl_prev: Optional[Dict[str, Any]] = None
        self.flush = False  # a dense layer sent what its residual owed this step
        self.count: Any = None
        self.theta: Any = None
        self.group = -1
        self.member = -1
        # Views reused every step (each new view is an operation): buffer id ->
        # (buffer, view of its first ``numel`` elements). Holding the buffer
        # keeps its id from being reused while the entry exists.
        self.views: Dict[int, Tuple[Any, Any]] = {}
        # The fused selection's scratch for this layer (FusedSelection.workspace).
        self.work: Any = None

    def head(self, ops: ArrayOps, buf: Any) -> Any:
        """The first ``numel`` elements of ``buf`` (a cached view)."""
        hit = self.views.get(id(buf))
        if hit is not None and hit[0] is buf:
            return hit[1]
        view = ops.narrow(buf, 0, 0, self.numel)
        self.views[id(buf)] = (buf, view)
        return view


class _Group:
    """One message: sparse (allgather of a packed chunk) or dense (allreduce)."""

    __slots__ = (
        "members",
        "sparse",
        "layout",
        "chunk",
        "dense",
        "ready",
        "handle",
        "verified",
        "name",
        "member_views",
        "outputs",
    )

    def __init__(self, members: List[int], sparse: bool, name: str):
        self.members = members
        self.sparse = sparse
        self.name = name
        self.layout: Optional[GroupLayout] = None
        self.chunk: Any = None  # sparse: int32 send buffer
        self.dense: Any = None  # dense with > 1 member: the send buffer
        self.ready = 0
        self.handle: Any = None
        self.verified = False
        # sparse: per member, its views of ``chunk`` (GroupLayout.member_views).
        self.member_views: List[MemberViews] = []
        # sparse: each member's view of the step's receive buffer (_Unpack.dense).
        self.outputs: List[Any] = []


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
        self.layers = [_Layer(name, int(n)) for name, n in layers]
        self._index = {name: i for i, name in enumerate(names)}
        self._plan: Optional[List[Tuple[List[int], Optional[bool]]]] = None
        self.groups: List[_Group] = []
        self._wire_bytes: Optional[int] = None  # wire_bytes() of the layout in force
        self._dense_bytes = 4 * sum(layer.numel for layer in self.layers)
        self.step = 0
        self._density: Optional[float] = None
        # density="auto": what the planner chose (None: not yet, AUTO_START).
        self._auto_density: Optional[float] = None
        # ... and with auto_layers, each layer's (self.layers order), or None.
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
        self._transport: Transport = make_transport("flat", ops, comm, config.value_dtype)
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
        #: Steps whose gradients were non-finite somewhere (state left untouched).
        self.nonfinite_steps = 0
        self._nonfinite_logged = -math.inf  # time of the last warning
        self._nonfinite_unlogged = 0
        self._nonfinite_run = 0  # consecutive non-finite steps up to the last one
        # What every rank must agree on (step, plan, profile, density) is
        # agreed at the first gradient after construction and after every
        # load, never inside load_state_dict (dlgs.core.resume).
        self._sync_pending = True
        self._loaded = False  # loaded a checkpoint since the last agreement

    # -- introspection -------------------------------------------------------
    def index(self, name: str) -> int:
        return self._index[name]

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
                self.nonfinite_steps += 1
        return self._finite

    @property
    def last_step_seconds(self) -> Optional[float]:
        """Seconds from the first gradient of the last step to the end of its
        wait() (host clock, no device synchronisation); ``last_step.seconds``."""
        return self.last_step.seconds if self.last_step is not None else None

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
        return (self.density,) * len(self.layers)

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
        each = None if layers is None else checkpoint.layer_densities(layers, len(self.layers))
        if (float(density), each) != (self._auto_density, self._auto_layers):
            self._density = None  # lay out again at the next step
        self._auto_density, self._auto_layers = float(density), each

    def trace_next_step(self) -> None:
        """Time the next step layer by layer (:class:`StepTrace` in its
        :class:`StepRecord`). Each timed layer calls ``clock()`` twice, which
        on an asynchronous device waits for it: profiling steps only."""
        self._trace_next = True

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
            if len(set(flat)) != len(flat) or any(not 0 <= i < len(self.layers) for i in flat):
                raise ValueError(
                    f"a plan must list distinct layer indices in [0, {len(self.layers)}), "
                    f"got {plan!r}"
                )
            self._plan = [(list(members), sparse) for members, sparse in plan]
        else:
            self._plan = None
        self._density = None

    def set_groups(self, groups: Optional[Sequence[Sequence[int]]]) -> None:
        """Shorthand for :meth:`set_plan` with every group's mode chosen by rule."""
        self.set_plan(None if groups is None else [(g, None) for g in groups])

    def is_sparse(self, layer: "_Layer") -> bool:
        """Whether ``layer`` is sent sparse under the current layout."""
        return layer.group >= 0 and self.groups[layer.group].sparse

    def layer_plans(self) -> List[LayerPlan]:
        return plan_layers([layer.numel for layer in self.layers], self.densities, self.config)

    # -- layout ----------------------------------------------------------------
    def _relayout(self, like: Any) -> None:
        """(Re)compute plans and groups for the density in force; allocate buffers."""
        density = self.density
        self._density = density
        self.like = like
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
            [layer.name for layer in self.layers],
            self._plan,
            self.prefix,
            self.config.value_dtype,
            self.config.index_coding,
            dense_alone=self.dense_external,
        )
        for layer in self.layers:
            layer.views.clear()
        sparse_layers = {i for m in messages if m.sparse for i in m.members}
        for i, (layer, plan) in enumerate(zip(self.layers, plans)):
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
        self.groups = []
        self._wire_bytes = None
        for gi, spec in enumerate(messages):
            members = list(spec.members)
            group = _Group(members, spec.sparse, spec.name)
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
                self.layers[i].group = gi
                self.layers[i].member = m
                if not spec.sparse:
                    self.layers[i].ctrl = {}
                    self._dense_offsets[i] = spec.offsets[m]
            self.groups.append(group)
        self._modes = tuple(i in sparse_layers for i in range(len(self.layers)))
        self._build_unpack(like)
        self._build_bank(like)
        biggest = max((plans[i].numel for i in sparse_layers), default=0)
        if biggest and (self._scratch_abs is None or ops.numel(self._scratch_abs) < biggest):
            self._scratch_abs = ops.zeros(biggest, "float32", like)
            self._scratch_mask = ops.zeros(biggest, "bool", like)
        logger.debug(
            "dlgs layout at step %d: density %g, %d layers in %d messages (%d sparse)",
            self.step,
            density,
            len(self.layers),
            len(self.groups),
            sum(1 for g in self.groups if g.sparse),
        )

    def _build_unpack(self, like: Any) -> None:
        """The transport's receive buffers; each sparse member's output a view."""
        sparse = [g for g in self.groups if g.sparse]
        outputs = self._transport.layout([g.layout for g in sparse], like)  # type: ignore[misc]
        for group, views in zip(sparse, outputs):
            group.outputs = views
        self._sparse_members = [i for g in sparse for i in g.members]

    def _build_bank(self, like: Any) -> None:
        """The sparse layers' controller learning state in one bank (their
        values carried over), so a step updates every layer at once."""
        # The transport's member order: the step's count words arrive in it.
        layers = [self.layers[i] for i in self._sparse_members]
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
        self._bank.update(self.ops, words.reshape(self.comm.size, -1)[self.comm.rank])

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
        layer = self.layers[i]
        ops = self.ops
        if ops.numel(grad) != layer.numel:
            raise ValueError(
                f"gradient of {layer.name!r} has {ops.numel(grad)} elements, expected {layer.numel}"
            )
        if i in self._submitted:
            raise RuntimeError(f"gradient of {layer.name!r} submitted twice in one step")
        if self._sync_pending and not self._submitted:
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
        group = self.groups[layer.group]
        result = None
        if group.sparse:
            self._sparsify(layer, group, grad)
            group.ready += 1
            if group.ready == len(group.members):
                group.handle = self._transport.start(group.chunk, group.name)
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

    def _dense_send(self, layer: _Layer, grad: Any) -> Any:
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

    def _advance_velocity(self, layer: _Layer, grad: Any) -> Any:
        """``u' = m u + g / scale`` into the layer's spare velocity buffer."""
        n = layer.numel
        return self.ops.momentum_into_(
            self.ops.narrow(layer.velocity_next, 0, 0, n),
            self.ops.narrow(layer.velocity, 0, 0, n),
            self.config.momentum,
            grad,
            self._inv_scale,
        )

    def external_scale(self, i: int) -> Any:
        """The factor (0-d tensor) by which a ``dense_external`` layer's reduced
        tensor must be multiplied to be in the step's scaled units, or None."""
        if self.config.momentum and self._scale is not None:
            return self._scale
        return None

    def _sparsify(self, layer: _Layer, group: _Group, grad: Any) -> None:
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
        idx, count, theta, total = _select(
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
        return [i for i in range(len(self.layers)) if i not in self._submitted]

    def _tracks_state(self) -> bool:
        """Whether this step changed state that a non-finite step must undo."""
        return bool(self.config.momentum) or any(
            g.sparse or any(self.layers[i].flush for i in g.members) for g in self.groups
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
            names = [self.layers[i].name for i in missing[:5]]
            raise RuntimeError(f"wait() before every layer was submitted; missing {names}")
        ops = self.ops
        out: Dict[int, Any] = {}
        handles: List[Any] = []
        verify: List[bool] = []
        for group in self.groups:
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
                        off, n = self._dense_offsets[i], self.layers[i].numel
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
        if finish:
            self.finish()
        return out

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
            layer = self.layers[i]
            sparse = self.is_sparse(layer)
            if finite:
                if sparse:
                    layer.residual, layer.residual_next = layer.residual_next, layer.residual
                elif layer.flush:
                    layer.residual = layer.residual_next = None
                if layer.velocity_next is not None:
                    layer.velocity, layer.velocity_next = layer.velocity_next, layer.velocity
            elif sparse and layer.ctrl_prev is not None:
                # In place: the bank holds this dict.
                layer.ctrl.clear()
                layer.ctrl.update(layer.ctrl_prev)
            layer.ctrl_prev = None
            layer.flush = False
        if not finite:
            self.nonfinite_steps += 1
            self._nonfinite_run += 1
            self._log_nonfinite(external)
        else:
            self._nonfinite_run = 0
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

    def _log_nonfinite(self, external: Sequence[Tuple[int, Any]]) -> None:
        """Name the layers of a non-finite step (rate-limited; reads flags on
        the host, which only a non-finite step pays), and warn of a run of
        them (:data:`NONFINITE_RUN`, then every doubling)."""
        self._nonfinite_unlogged += 1
        run = self._nonfinite_run
        # A scaler that starts high overflows for a while by design (from 2^30,
        # about 15 halvings): twice the run before it is called one.
        first = NONFINITE_RUN * (2 if self.loss_scale is not None else 1)
        long_run = run >= first and run & (run - 1) == 0  # 16 (32), 32 (64), ...
        now = time.monotonic()
        if now - self._nonfinite_logged < _NONFINITE_LOG_INTERVAL and not long_run:
            return
        found = self._nonfinite_names(external)
        names = ", ".join(repr(n) for n in found[:8]) + (" ..." if len(found) > 8 else "")
        if long_run:
            # A scaler backs off to a finite scale within a few steps; a run
            # this long skips every update, whatever the scaler does.
            logger.warning(
                "step %d: the last %d steps were all non-finite (NaN or Inf) on at least "
                "one rank (now in %s): no update has been applied since (with a loss "
                "scaler, or when skipping on .dlgs.last_step_finite). Likely causes: "
                "non-finite parameters or inputs, a learning rate that diverged, a loss "
                "scaler that never backs off (scaler.update() not called), or a damaged "
                "checkpoint",
                self.step,
                run,
                names,
            )
        else:
            # With a loss scaler, overflow is how it calibrates: not worth a warning.
            level = logging.INFO if self.loss_scale is not None else logging.WARNING
            skip = (
                "the loss scaler skips the step"
                if self.loss_scale is not None
                else "without a loss scaler, skip the update when .dlgs.last_step_finite "
                "is False (opt.synchronize(), then step only if finite)"
            )
            logger.log(
                level,
                "step %d: non-finite gradient (NaN or Inf) on at least one rank in %s; "
                "%d such step(s) since the last report, %d in all. Residuals and "
                "thresholds are left as before the step; the optimizer receives NaN "
                "for these layers on every rank (%s)",
                self.step,
                names,
                self._nonfinite_unlogged,
                self.nonfinite_steps,
                skip,
            )
        self._nonfinite_logged = now
        self._nonfinite_unlogged = 0

    def _nonfinite_names(self, external: Sequence[Tuple[int, Any]]) -> List[str]:
        """The layers whose reduced gradient is non-finite this step: each
        member of a merged dense message checked on its own."""
        ops = self.ops
        names = []
        flags = self._transport.bad
        if self._sparse_members and flags is not None:
            bad = ops.to_host(flags)
            names += [self.layers[i].name for i, b in zip(self._sparse_members, bad) if b]
        parts = []
        for first, t in self._dense_out.items():
            members = self.groups[self.layers[first].group].members
            if len(members) == 1:
                parts.append((first, t))
                continue
            flat = ops.reshape(t, (-1,))
            for j in members:
                parts.append((j, ops.narrow(flat, 0, self._dense_offsets[j], self.layers[j].numel)))
        for i, t in parts + list(external):
            if ops.to_host(ops.any_nonfinite([t])):
                names.append(self.layers[i].name)
        return names

    # -- statistics and checkpoints -------------------------------------------
    def message_bytes(self, group: _Group) -> int:
        """Bytes this rank contributes to ``group``'s message per step."""
        if group.sparse:
            assert group.layout is not None
            return 4 * group.layout.chunk_words
        return 4 * sum(self.layers[i].numel for i in group.members)

    def wire_bytes(self) -> int:
        """Bytes this rank contributes per step under the layout in force, over
        all its messages (sparse ones at capacity, with their fingerprint
        word; dense layers as float32, before any Horovod compression). No
        device read; computed once per layout."""
        if self._wire_bytes is None:
            self._wire_bytes = sum(self.message_bytes(g) for g in self.groups)
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
        ops = self.ops
        rows = []
        for layer in self.layers:
            plan = layer.plan
            if plan is None:
                continue
            sparse = self.is_sparse(layer)
            row: Dict[str, Any] = {
                "name": layer.name,
                "numel": layer.numel,
                "sparse": sparse,
                "k": plan.k,
                "capacity": plan.capacity,
                # This rank's contribution: count word, values and indices, or the
                # float32 gradient (before any Horovod compression of dense layers).
                "wire_bytes": plan.wire_bytes if sparse else 4 * layer.numel,
                "message": layer.group,
                "message_bytes": self.message_bytes(self.groups[layer.group]),
            }
            if sparse and layer.count is not None:
                selected = int(ops.to_host(layer.count))
                row.update(
                    selected=selected,
                    sent=min(selected, plan.capacity),
                    density=selected / layer.numel,
                    threshold=float(ops.to_host(layer.theta)),
                )
            rows.append(row)
        return rows

    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals, velocities and controller states, with the step.

        Residuals are rank-local (each rank holds the gradient it has not sent
        yet); the dict is tagged with rank and world size so that
        :meth:`load_state_dict` restores them only where they belong.
        """
        layers = {}
        for layer in self.layers:
            layers[layer.name] = {
                "residual": layer.residual,
                "velocity": layer.velocity,
                # Numbers (device scalars of the fixed controller read on the host).
                "controller": {
                    key: v if isinstance(v, int) else checkpoint.host_number(self.ops, v)
                    for key, v in layer.ctrl.items()
                },
                "k": layer.plan.k if layer.plan is not None else None,
            }
        return {
            "version": STATE_VERSION,
            **self._shared_state(),
            "rank": self.comm.rank,
            "size": self.comm.size,
            "config": self.config.to_dict(),
            "layers": layers,
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
        self._apply_shared(state)
        self._relayout(like)
        self._restore_layers(saved, like, own, restart)
        # Any load counts, even of the state in force: a rank that loads must
        # agree with the other loading ranks (a stale file is an error), never
        # be rolled back or forward silently by them.
        self._sync_pending = self._loaded = True

    def _apply_shared(self, state: Dict[str, Any]) -> None:
        """Put a state's shared part (:func:`dlgs.core.resume.shared`) in
        force: step, plan, ``density="auto"``'s choice and the step hooks'
        states (the planner re-plans from its profile). Laid out anew at the
        next gradient; on an error nothing is changed."""
        auto_layers = state.get("auto_layers")
        if auto_layers is not None:
            auto_layers = checkpoint.layer_densities(auto_layers, len(self.layers))
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
            for hook in self.step_hooks:
                if hasattr(hook, "load_state_dict"):
                    hook.load_state_dict((state.get("hooks") or {}).get(_hook_key(hook), {}), self)
        except Exception:
            self.step, self._plan, self._auto_density, self._auto_layers = old
            raise
        self._density = None

    def _sync(self) -> None:
        """The agreement after construction or a load (:mod:`dlgs.core.resume`),
        at the first gradient of a step: one gather of a small record from
        every rank of the process set, the same verdict on every rank."""
        self._sync_pending = False
        loaded, self._loaded = self._loaded, False
        agree = self._agree
        if agree.size <= 1:
            return
        mine = SyncRecord(loaded, self._shared_state())
        gathered = [
            SyncRecord(*r) for r in agree.allgather_object(tuple(mine), f"{self.prefix}.sync")
        ]
        verdict = resolve(gathered)
        if verdict.root is None:
            return
        part = gathered[verdict.root].shared
        if agree.rank in verdict.adopters:
            self._apply_shared(part)
        logger.log(
            logging.WARNING if agree.rank == 0 else logging.DEBUG,
            "dlgs: rank %d resumed from a checkpoint of step %d and rank(s) %s did not load "
            "one: they take its step, merge plan, profile and density; their residuals "
            "(what they had not sent yet) are not in the checkpoint and their thresholds "
            "start afresh. To resume every rank's residuals, save and load one dlgs state "
            "per rank (docs/design.md, 'Checkpoints and residuals')",
            verdict.root,
            part["step"],
            ", ".join(map(str, verdict.adopters)),
        )

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
            [(layer.name, layer.numel) for layer in self.layers],
            self.config,
            self.comm.rank,
            self.comm.size,
        )

    def _restore_layers(self, saved: Dict[str, Any], like: Any, own: bool, restart: List[str]):
        ops = self.ops
        for layer, density in zip(self.layers, self.densities):
            entry = saved[layer.name]
            plan = layer.plan
            assert plan is not None  # set by _relayout above
            if not self.is_sparse(layer):
                # Sent dense now: restore what it still owed (flushed next step)
                # and, with momentum correction, its velocity.
                for attr in ("residual", "velocity"):
                    setattr(layer, attr, None)
                    if own and entry[attr] is not None:
                        buf = ops.zeros(layer.numel + 1, "float32", like)
                        setattr(layer, attr, ops.copy_(buf, entry[attr]))
                continue
            for attr in ("residual", "velocity"):
                buf = getattr(layer, attr)
                if buf is not None:
                    ops.mul_(buf, 0.0)
                    if own and entry[attr] is not None:
                        ops.copy_(buf, entry[attr])
            fresh = self.controller.init_state(ops, like, density)
            ctrl = entry.get("controller") or {}
            if not restart and entry.get("k") == plan.k and set(ctrl) == set(fresh):
                # Each entry in the kind of its fresh value: Python numbers (the
                # dynamic controller's host state, also from checkpoints that
                # held device scalars) or device scalars (the fixed threshold).
                layer.ctrl = {
                    key: checkpoint.restored(ops, fresh[key], v, like) for key, v in ctrl.items()
                }
            else:
                layer.ctrl = fresh
        self._build_bank(like)


@dataclass
class StepTrace:
    """Host times (``clock()``, after the device finished) of one timed step
    (:meth:`SparseExchange.trace_next_step`)."""

    #: Layer index -> when its gradient was submitted.
    arrive: Dict[int, float] = field(default_factory=dict)
    #: Layer index -> when its selection and packing (or dense send) returned.
    done: Dict[int, float] = field(default_factory=dict)
    #: When the step's wait() ended.
    waited: Optional[float] = None

    @property
    def end(self) -> Optional[float]:
        """Seconds from the first gradient to the end of the wait."""
        if self.waited is None or not self.arrive:
            return None
        return self.waited - min(self.arrive.values())


@dataclass(frozen=True)
class StepRecord:
    """What a finished step hands its step hooks (and leaves in
    :attr:`SparseExchange.last_step`)."""

    #: The step's index (``exchange.step`` was this during it).
    step: int
    #: Host seconds from the first submit to the end of the wait (no device sync).
    seconds: Optional[float]
    #: Host seconds inside submit(): selection, packing, starting collectives.
    submit_seconds: float
    #: Per layer (exchange order), whether it was sent sparse.
    layers_sparse: Tuple[bool, ...]
    #: Layer-by-layer times, if :meth:`SparseExchange.trace_next_step` asked for them.
    trace: Optional[StepTrace] = None


class StepHook(Protocol):
    """What :attr:`SparseExchange.step_hooks` hold (e.g. the online planner).

    Called with the exchange and the step's :class:`StepRecord` after every
    step. Optional members: ``on_density(ex, density)`` returning a plan for a
    new density (applied in that layout) or None; ``state_dict()`` /
    ``load_state_dict(state, ex)``, saved in the exchange's state under
    ``state_key`` (default: the class name).
    """

    def __call__(self, exchange: "SparseExchange", record: StepRecord) -> None: ...


def _plan(layer: _Layer) -> LayerPlan:
    assert layer.plan is not None  # set by the layout
    return layer.plan


def _hook_key(hook: Any) -> str:
    return getattr(hook, "state_key", type(hook).__name__)


def log_stats(exchange: SparseExchange, log: logging.Logger, level: int = logging.INFO):
    """Per-layer statistics of ``exchange``'s last step (:meth:`SparseExchange.stats`,
    which synchronises), also written to ``log`` for every sparse layer."""
    rows = exchange.stats()
    if log.isEnabledFor(level):
        for row in rows:
            if row["sparse"] and "selected" in row:
                log.log(
                    level,
                    "step %d %s: selected %d of %d (density %.4g, target %d), threshold %.3g, "
                    "%d bytes",
                    exchange.step,
                    row["name"],
                    row["selected"],
                    row["numel"],
                    row["density"],
                    row["k"],
                    row["threshold"],
                    row["wire_bytes"],
                )
    return rows
