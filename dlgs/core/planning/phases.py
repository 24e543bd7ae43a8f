"""The online planner's decisions, as a pure state machine.

:func:`decide` takes the planner's options, its frozen :class:`PlannerState`,
a read-only view of the exchange (:class:`ExchangeView`) and one event, and
returns the next state and the actions to carry out, in order::

    state, actions = decide(options, state, view, Stepped(record, ledger))

Events are a finished step (:class:`Stepped`), the results of the actions
that ask for one (:class:`Probed`, :class:`Shared`, :class:`Voted`), a
density change (:class:`DensityChanged`) and a checkpoint (:class:`Loaded`).
An action that asks for a result (:class:`Probe`, :class:`Broadcast`,
:class:`ReadVote`) is always the last of its list; the state then says what
its result continues (``state.pending``), and the driver
(:class:`~dlgs.core.planning.online.OnlinePlanner`) calls :func:`decide` again with
it. Nothing here issues a collective, reads a clock, logs or writes into the
exchange: every rank that holds the same state and sees the same results
decides the same, and tests drive every phase without ranks.

The phases, from ``state.phase``:

``profile``
    time ``profile_steps`` layer-wise steps, probe the collectives (when the
    bytes saved so far pay for it), broadcast rank 0's profile, choose the
    density (``density="auto"``) and plan;
``refine``
    time the steps under the fresh plan, check ``density="auto"``'s choice
    and the guard's verdict against the steps before it (rank 0's verdicts,
    broadcast), measure back-propagation again and plan once more;
``run``
    the plan is settled: a drift vote every ``drift_window`` steps (one
    1-element allgather, read one step later); a vote for drift, or a
    ``reprofile()`` request carried by it, starts ``profile`` again.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple, Union

from ..exchange.records import StepRecord, StepTrace
from .calibration import Calibration
from .dp import CostModel, Plan, fit_cost_model
from .profile import (
    DensityChoice,
    LayerProfile,
    Profile,
    calibrate,
    choose_density,
    contention,
    fit_link,
    plan_at,
    rescale,
)

__all__ = [
    "Action",
    "AutoCheck",
    "Broadcast",
    "DensityChanged",
    "Event",
    "ExchangeView",
    "Ledger",
    "Loaded",
    "Log",
    "PlannerOptions",
    "PlannerState",
    "Probe",
    "Probed",
    "ReadVote",
    "Record",
    "SetDensity",
    "SetPlan",
    "Shared",
    "Snapshot",
    "Stepped",
    "Trace",
    "Vote",
    "Voted",
    "decide",
    "fit_or_flat",
    "guard_verdict",
    "probe_ladder",
    "probe_sizes",
    "ready_densities",
    "restarted",
    "saved",
]

#: A planned message's mode: sparse or not, or its transport (transport="auto").
Mode = Union[bool, str]
Groups = Tuple[Tuple[Tuple[int, ...], Mode], ...]

# Probe message sizes (bytes of one rank's chunk / of the allreduced buffer):
# a ladder from 1 KiB up to the model's dense size, at most 4 MiB
# (:func:`probe_ladder`), of which a profile takes the rungs it can afford.
_PROBE_MIN, _PROBE_MAX = 1 << 10, 4 << 20
#: Probes are sized for runs of this many steps or more: one profile's probes
#: cost at most ``profile_budget`` of the bytes that this many steps of the
#: layout in force send.
HORIZON_STEPS = 1000
#: Collectives started at once to measure the latency of one that joins a
#: batch Horovod has formed (``CostModel.batched``).
BATCH = 4


# -- inputs --------------------------------------------------------------------
@dataclass(frozen=True)
class PlannerOptions:
    """The planner's options that its decisions read (see
    :class:`~dlgs.core.planning.online.OnlinePlanner`, which validates them)."""

    strategy: str = "dp"
    profile_steps: int = 8
    skip_steps: int = 1
    bucket_elements: int = 8192
    max_group: Optional[int] = None
    probe_reps: int = 2
    record: bool = False
    drift_tolerance: float = 0.25
    drift_window: int = 50
    refine: bool = True
    guard: bool = True
    profile_budget: float = 0.01
    calibration_file: Optional[str] = None


class LayerView(Protocol):
    name: str
    numel: int
    sparse: bool


class ExchangeView(Protocol):
    """What the decisions read of the exchange (read-only)."""

    @property
    def step(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def config(self) -> Any: ...  # the exchange's SparsityConfig
    @property
    def layers(self) -> Sequence[LayerView]: ...
    @property
    def density(self) -> float: ...
    @property
    def densities(self) -> Tuple[float, ...]: ...
    @property
    def auto_layers(self) -> Optional[Tuple[float, ...]]: ...
    @property
    def wire_bytes(self) -> int: ...
    @property
    def dense_bytes(self) -> int: ...


@dataclass(frozen=True)
class SnapshotLayer:
    name: str
    numel: int
    sparse: bool = True


@dataclass(frozen=True)
class Snapshot:
    """An :class:`ExchangeView` as plain data (tests; the driver reads the
    exchange live)."""

    step: int
    config: Any
    layers: Tuple[SnapshotLayer, ...]
    density: float
    auto_layers: Optional[Tuple[float, ...]] = None
    wire_bytes: int = 0
    dense_bytes: int = 0
    rank: int = 0
    size: int = 2

    @property
    def densities(self) -> Tuple[float, ...]:
        if self.auto_layers is not None:
            return self.auto_layers
        return (self.density,) * len(self.layers)


@dataclass(frozen=True)
class Ledger:
    """What planning has cost this rank so far (the driver's counts; the
    byte counts are the same on every rank)."""

    saved_bytes: int = 0  # dense float32 bytes minus wire bytes, over the steps seen
    bytes: int = 0  # probes' and broadcasts' bytes
    seconds: float = 0.0  # host time in the planner
    elapsed: float = 0.0  # seconds since the first step seen
    profile_seconds: float = 0.0  # host time the last fresh profile took


# -- events --------------------------------------------------------------------
@dataclass(frozen=True)
class Stepped:
    """A step ended (``view.step`` steps are done)."""

    record: StepRecord
    ledger: Ledger = Ledger()


@dataclass(frozen=True)
class Probed:
    """The result of :class:`Probe`: the fitted collectives and copy cost."""

    pack: CostModel
    allgather: CostModel
    allreduce: CostModel
    #: What priced each one's bytes (``Profile.priced_by``).
    priced_by: Tuple[str, str] = ("probes", "probes")


@dataclass(frozen=True)
class Shared:
    """The result of :class:`Broadcast`: rank 0's value."""

    value: Any


@dataclass(frozen=True)
class Voted:
    """The result of :class:`ReadVote`: every rank's vote word."""

    words: Tuple[int, ...]


@dataclass(frozen=True)
class DensityChanged:
    """The exchange lays out for a new density: answer with a plan for it
    (:class:`SetPlan` with ``defer=False``) or nothing."""

    density: float


@dataclass(frozen=True)
class Loaded:
    """A checkpoint's planner state (:func:`saved`'s form)."""

    saved: Dict[str, Any]


Event = Union[Stepped, Probed, Shared, Voted, DensityChanged, Loaded]


# -- actions -------------------------------------------------------------------
@dataclass(frozen=True)
class Trace:
    """Time the next step layer by layer."""


@dataclass(frozen=True)
class Probe:
    """Time probe collectives of ``sizes`` bytes (answer: :class:`Probed`)."""

    sizes: Tuple[int, ...]


@dataclass(frozen=True)
class Recall:
    """Rank 0's saved collectives at ``path`` (a
    :class:`~dlgs.core.planning.calibration.Calibration`'s ``to_dict()``) for
    this world size, or None, broadcast (answer: :class:`Shared`)."""

    path: str


@dataclass(frozen=True)
class Broadcast:
    """Broadcast rank 0's ``value`` (answer: :class:`Shared`); ``topic``
    names what it carries (``profile``, ``ends``, ``auto``, ``guard``)."""

    value: Any
    topic: str


@dataclass(frozen=True)
class SetDensity:
    density: float
    layers: Optional[Tuple[float, ...]]


@dataclass(frozen=True)
class SetPlan:
    """The plan's messages ``[(layer indices, mode)]``; ``defer``: set it on
    the exchange (from the next step), else hand it to the layout being made."""

    groups: Groups
    defer: bool = True


@dataclass(frozen=True)
class Vote:
    """Start the drift vote: a 1-element allgather of ``word`` (bit 1: drift,
    bit 2: a ``reprofile()`` request), read at the next step."""

    word: int


@dataclass(frozen=True)
class ReadVote:
    """Wait for the vote started a step ago (answer: :class:`Voted`)."""


@dataclass(frozen=True)
class Record:
    """With ``record``: one step's predicted and measured end."""

    timing: Dict[str, float]


@dataclass(frozen=True)
class Log:
    """A log line: on the first rank at ``level`` (the others at DEBUG), or
    at ``level`` on ``every_rank``."""

    msg: str
    args: Tuple[Any, ...] = ()
    level: int = logging.INFO
    every_rank: bool = False


Action = Union[Trace, Probe, Recall, Broadcast, SetDensity, SetPlan, Vote, ReadVote, Record, Log]


# -- state ---------------------------------------------------------------------
class AutoCheck(NamedTuple):
    """``density="auto"``'s pending check: the densities in force before the
    choice (``layers``: per layer, or None for ``density`` in every layer),
    the measured ends of the steps timed at them, and whether those steps
    were sent layer by layer (the guard compares with them then)."""

    density: float
    layers: Optional[Tuple[float, ...]]
    ends: Tuple[float, ...]
    layerwise: bool

    def densities(self, n_layers: int) -> Tuple[float, ...]:
        return self.layers if self.layers is not None else (self.density,) * n_layers

    def to_state(self) -> List[Any]:
        layers = None if self.layers is None else list(self.layers)
        return [self.density, layers, list(self.ends), self.layerwise]

    @classmethod
    def from_state(cls, state: Any, n_layers: int) -> "AutoCheck":
        """Raises ValueError naming ``auto_check`` when ``state`` is malformed."""
        try:
            density, layers, ends, layerwise = state
            layers = None if layers is None else tuple(float(d) for d in layers)
            out = cls(float(density), layers, tuple(float(e) for e in ends), bool(layerwise))
        except (TypeError, ValueError):
            raise ValueError(f"dlgs planner state auto_check is malformed: {state!r:.80}") from None
        if out.layers is not None and len(out.layers) != n_layers:
            raise ValueError(
                f"dlgs planner state auto_check holds {len(out.layers)} densities for "
                f"{n_layers} layers"
            )
        return out


@dataclass(frozen=True)
class Pending:
    """What the next result continues: ``topic`` and what it needs."""

    topic: str  # probe, recall, profile, ends, auto, guard, vote
    fresh: bool = False  # profile: a fresh profile (else the refined one)
    keep: bool = True  # profile (refined): the guard's verdict
    choice: Optional[DensityChoice] = None  # ends: the choice to put in force
    layers: Optional[Tuple[float, ...]] = None  # ends: its per-layer densities
    check: Optional[AutoCheck] = None  # auto: the densities before the choice
    higher: bool = False  # auto: the choice sends more than those
    stepped: Optional[Stepped] = None  # vote, recall: the step to go on with


@dataclass(frozen=True)
class PlannerState:
    """Everything the planner knows, frozen; :func:`decide` returns a new one."""

    #: The profile plans are made from (rank 0's), None while profiling.
    profile: Optional[Profile] = None
    #: The plan made last, None before one (and after a restart).
    plan: Optional[Plan] = None
    #: The profile's layers (ready order) as exchange indices.
    order: Tuple[int, ...] = ()
    #: Steps timed in this phase.
    traces: Tuple[StepTrace, ...] = ()
    #: The density (and per-layer ones, ready order) the plan is for.
    density: Optional[float] = None
    each: Optional[Tuple[float, ...]] = None
    #: The guard rejected the plan: layer-wise in force.
    fallback: bool = False
    #: Whether the layout the profiled steps ran under was layer-wise.
    layerwise_in_force: bool = True
    #: The measured ends of the layer-wise steps profiled before the plan.
    before: Optional[Tuple[float, ...]] = None
    #: ``density="auto"``: the check of a choice that changed the densities.
    auto_check: Optional[AutoCheck] = None
    #: Timing steps under a fresh plan, and whether its first step has passed.
    refining: bool = False
    refine_armed: bool = False
    #: The exchange's step when the plan was made.
    plan_step: int = 0
    #: Drift: this window's ratios, the first window's median, and how many
    #: windows in a row drifted (signed).
    ratios: Tuple[float, ...] = ()
    #: The step before this window's first record: a window is
    #: ``drift_window`` steps, however many of them ran on the host.
    window_start: Optional[int] = None
    baseline: Optional[float] = None
    drifted: int = 0
    #: A drift vote was started and is read at the next step.
    vote_pending: bool = False
    #: ``reprofile()`` asked; carried by the next vote.
    restart_requested: bool = False
    #: The last profile with probes (its collectives are reused when a
    #: re-profile cannot pay for probes).
    collectives: Optional[Profile] = None
    #: Logged that the first probes wait for their bytes.
    waiting: bool = False
    #: The calibration file was asked for (once per job: a re-profile probes).
    recalled: bool = False
    #: The collectives in force came from the calibration file, not probes.
    from_file: bool = False
    #: The last calibration (rank 0's; see ``OnlinePlanner.calibration``).
    calibration: Dict[str, float] = field(default_factory=dict)
    #: Wire bytes of the layer-wise traces (the reference for contention).
    layerwise_bytes: Optional[int] = None
    #: ``density="auto"``'s last choice, and the guard's last verdict.
    density_choice: Optional[DensityChoice] = None
    guard_result: Optional[Dict[str, Any]] = None
    #: Plans made so far.
    plans_made: int = 0
    #: What the next result continues (None between steps).
    pending: Optional[Pending] = None

    @property
    def phase(self) -> str:
        """``profile``, ``refine`` or ``run`` (see the module)."""
        if self.profile is None:
            return "profile"
        return "refine" if self.refining else "run"


class _Decision:
    """One call's work: the state as it changes and the actions so far."""

    def __init__(self, state: PlannerState, view: ExchangeView):
        self.state = state
        self.view = view
        self.actions: List[Action] = []
        # Densities set by this call (the view shows them from the next call).
        self.density: float = view.density
        self.auto_layers: Optional[Tuple[float, ...]] = view.auto_layers

    def set(self, **changes: Any) -> None:
        self.state = replace(self.state, **changes)

    def do(self, action: Action) -> None:
        self.actions.append(action)

    def log(self, msg: str, *args: Any, level: int = logging.INFO) -> None:
        self.actions.append(Log(msg, args, level))

    def set_density(self, density: float, layers: Optional[Tuple[float, ...]]) -> None:
        self.do(SetDensity(density, layers))
        self.density, self.auto_layers = density, layers

    @property
    def densities(self) -> Tuple[float, ...]:
        if self.auto_layers is not None:
            return self.auto_layers
        return (self.density,) * len(self.view.layers)

    def ask(self, action: Action, pending: Pending) -> None:
        """End the call with an action whose result continues ``pending``."""
        self.set(pending=pending)
        self.do(action)


# -- the decision ----------------------------------------------------------------
def decide(
    options: PlannerOptions, state: PlannerState, view: ExchangeView, event: Event
) -> Tuple[PlannerState, Tuple[Action, ...]]:
    """The next state and the actions to carry out, in order (see the module)."""
    d = _Decision(state, view)
    pending = state.pending
    if isinstance(event, (Stepped, DensityChanged, Loaded)):
        if pending is not None:
            raise RuntimeError(f"dlgs planner: {pending.topic!r} is still awaited")
        if isinstance(event, Stepped):
            if state.vote_pending:  # the vote started a window ago: read it first
                d.set(vote_pending=False)
                d.ask(ReadVote(), Pending("vote", stepped=event))
            else:
                _on_step(options, d, event)
        elif isinstance(event, DensityChanged):
            _on_density(options, d, event.density)
        else:
            _on_load(options, d, event.saved)
        return d.state, tuple(d.actions)
    if pending is None:
        raise RuntimeError(f"dlgs planner: {type(event).__name__} arrived unasked")
    expected = {"probe": Probed, "vote": Voted}.get(pending.topic, Shared)
    if not isinstance(event, expected):
        raise RuntimeError(
            f"dlgs planner: {type(event).__name__} arrived while {pending.topic!r} was awaited"
        )
    d.set(pending=None)
    if isinstance(event, Probed):
        _profiled(options, d, event)
    elif isinstance(event, Voted):
        _voted(options, d, event.words, pending)
    else:
        _shared(options, d, event.value, pending)
    return d.state, tuple(d.actions)


def _on_step(opts: PlannerOptions, d: _Decision, ev: Stepped) -> None:
    s, view, record = d.state, d.view, ev.record
    if s.profile is not None:
        if s.plan is None:  # a profile given (or loaded) and no plan yet
            if view.config.auto and s.density_choice is None:
                _choose_density(opts, d, None)
            _replan(opts, d)
        if d.state.refining:
            _refine_step(opts, d, record)
            return
        if _check_drift(opts, d, ev):
            return
        if opts.record:
            t = record.trace
            end = t.end if t is not None else None
            if t is not None and end is not None:
                assert d.state.plan is not None
                first = min(t.arrive.values())
                d.do(
                    Record(
                        {
                            "step": record.step,
                            "predicted_end": d.state.plan.end,
                            "measured_end": end,
                            "compute_end": max(t.done.values()) - first,
                        }
                    )
                )
            d.do(Trace())
        return
    traces = s.traces if record.trace is None else s.traces + (record.trace,)
    d.set(traces=traces)
    if len(traces) < opts.profile_steps:
        if view.step >= opts.skip_steps:
            d.do(Trace())
        return
    if opts.calibration_file is not None and s.collectives is None and not s.recalled:
        # A job before this one may have saved its collectives: no probes then.
        d.set(recalled=True)
        d.ask(Recall(opts.calibration_file), Pending("recall", stepped=ev))
        return
    _probe_or_wait(opts, d, ev)


def _probe_or_wait(opts: PlannerOptions, d: _Decision, ev: Stepped) -> None:
    """The profiled steps are in: probe the collectives, or wait until the
    probes are affordable, or (a re-profile that cannot pay for them) keep
    the collectives fitted last."""
    s, view = d.state, d.view
    sizes = probe_sizes(opts, ev.ledger, view)
    if sizes:
        d.ask(Probe(tuple(sizes)), Pending("probe"))
        return
    if s.collectives is None:
        # The first probes wait until sparse sending has saved their bytes.
        if not s.waiting:
            d.set(waiting=True)
            d.log(
                "dlgs: %d step(s) profiled; the probes wait until sparse sending has "
                "saved the bytes they cost (%.3g MB per step saved so far)",
                len(s.traces),
                ev.ledger.saved_bytes / max(1, view.step) / 1e6,
            )
        return
    # A re-profile the saved bytes cannot pay probes for: the collectives stay
    # as last fitted, compute is measured again.
    d.log(
        "dlgs: re-profiling without probes (they would cost more than sparse "
        "sending has saved): the collectives stay as fitted"
    )
    last = s.collectives
    _share(
        d,
        _measured(d, last.pack, last.allgather, last.allreduce, last.sparsify, last.priced_by),
        fresh=True,
    )


def _profiled(opts: PlannerOptions, d: _Decision, probed: Probed) -> None:
    d.set(from_file=False)
    _share(
        d,
        _measured(d, probed.pack, probed.allgather, probed.allreduce, None, probed.priced_by),
        fresh=True,
    )


def _measured(
    d: _Decision,
    pack: CostModel,
    allgather: CostModel,
    allreduce: CostModel,
    sparsify: Optional[CostModel],
    priced_by: Tuple[str, str],
) -> Profile:
    """This rank's profile from the traced layer-wise steps and ``pack``,
    ``allgather``, ``allreduce`` (probed now unless ``sparsify`` is the last
    profile's, used where no layer was timed sparse; ``priced_by``: what
    priced their bytes)."""
    s, view = d.state, d.view
    layers, sizes, times = _timed_layers(view, s.traces)
    fresh = sparsify is None  # probes ran
    profile = Profile(
        world_size=view.size,
        layers=layers,
        sparsify=fit_or_flat(sizes, times) if times or sparsify is None else sparsify,
        pack=pack,
        allgather=allgather,
        allreduce=allreduce,
        priced_by=priced_by,
    )
    # What the traced steps sent: the layer-wise reference for contention.
    d.set(layerwise_bytes=view.wire_bytes if s.layerwise_in_force else None)
    gamma = s.calibration.get("contention", 0.0)
    if not fresh:
        return replace(profile, contention=gamma)
    if not s.layerwise_in_force:
        return rescale(profile, s.calibration.get("scale", 1.0), gamma)
    ends = _ends(s.traces)
    if not ends:
        return profile
    order = _order(view, layers)
    modes = [view.layers[i].sparse for i in order]
    each = ready_densities(d.densities, d.density, order)
    out, fit = calibrate(
        profile, view.config, d.density if each is None else each, modes, statistics.median(ends)
    )
    d.set(calibration={**fit, "contention": 0.0})  # a fresh layer-wise profile
    if fit["calibrated"]:
        d.log(
            "dlgs: the probes predicted the profiled steps to end at %.3g ms, they ended "
            "at %.3g ms: collective latency x%.3g above its floor",
            fit["predicted"] * 1e3,
            fit["measured"] * 1e3,
            fit["scale"],
        )
    return out


def _remeasured(d: _Decision) -> Profile:
    """The refined profile: backward and sparsify timed again under the plan,
    the collectives and copy cost of the plan's profile kept, and the
    contention fitted from the two."""
    s, view = d.state, d.view
    under = s.profile
    assert under is not None
    layers, sizes, times = _timed_layers(view, s.traces)
    if s.layerwise_bytes is not None:
        gamma = contention(
            sum(layer.backward for layer in under.layers),
            s.layerwise_bytes,
            sum(layer.backward for layer in layers),
            view.wire_bytes,
        )
        d.set(calibration={**s.calibration, "contention": gamma})
        if gamma > 0:
            d.log(
                "dlgs: back-propagation took %.3g ms sending %.3g MB per step layer by "
                "layer and %.3g ms sending %.3g MB under the plan: compute loses %.3g ns "
                "per byte sent",
                sum(layer.backward for layer in under.layers) * 1e3,
                s.layerwise_bytes / 1e6,
                sum(layer.backward for layer in layers) * 1e3,
                view.wire_bytes / 1e6,
                gamma * 1e9,
            )
            # The model charges every plan's bytes to compute: the layer-wise
            # times plus that, not the times under this plan (counted twice).
            layers = under.layers
    return Profile(
        world_size=view.size,
        layers=layers,
        sparsify=fit_or_flat(sizes, times) if times else under.sparsify,
        pack=under.pack,
        allgather=under.allgather,
        allreduce=under.allreduce,
        contention=d.state.calibration.get("contention", 0.0),
        priced_by=under.priced_by,
    )


def _timed_layers(
    view: ExchangeView, traces: Sequence[StepTrace]
) -> Tuple[Tuple[LayerProfile, ...], List[float], List[float]]:
    """Each layer's median backward time, in measured ready order; and the
    sparse layers' sizes and sparsify times."""
    n_layers = len(view.layers)
    arrive = {
        i: statistics.median(t.arrive[i] - min(t.arrive.values()) for t in traces)
        for i in range(n_layers)
    }
    order = sorted(range(n_layers), key=lambda i: (arrive[i], i))
    backward: Dict[int, List[float]] = {i: [] for i in range(n_layers)}
    for t in traces:
        prev_done = None
        for i in sorted(range(n_layers), key=lambda i: t.arrive[i]):
            backward[i].append(0.0 if prev_done is None else max(0.0, t.arrive[i] - prev_done))
            prev_done = t.done[i]
    sizes, times = [], []
    for i, layer in enumerate(view.layers):
        if layer.sparse:
            sizes.append(float(layer.numel))
            times.append(statistics.median(t.done[i] - t.arrive[i] for t in traces))
    layers = tuple(
        LayerProfile(view.layers[i].name, view.layers[i].numel, statistics.median(backward[i]))
        for i in order
    )
    return layers, sizes, times


def _share(d: _Decision, local: Profile, *, fresh: bool, keep: bool = True) -> None:
    """Broadcast this rank's profile and calibration: every rank plans from
    (and reports) rank 0's."""
    d.ask(
        Broadcast((local.to_dict(), d.state.calibration), "profile"),
        Pending("profile", fresh=fresh, keep=keep),
    )


def _shared(opts: PlannerOptions, d: _Decision, value: Any, pending: Pending) -> None:
    topic = pending.topic
    if topic == "profile":
        data, calibration = value
        shared = Profile.from_dict(data)
        d.set(profile=shared, calibration=calibration)
        if pending.fresh:
            d.set(collectives=shared)
        d.log(
            "dlgs profile (rank 0's, %d ranks): allgather %.3g ms (%.3g ms in a batch) + %.3g "
            "ns/B, allreduce %.3g ms (%.3g ms in a batch) + %.3g ns/B, sparsify %.3g us + %.3g "
            "ns/element, backward %.3g ms",
            shared.world_size,
            shared.allgather.alpha * 1e3,
            shared.allgather.in_batch(0) * 1e3,
            shared.allgather.beta * 1e9,
            shared.allreduce.alpha * 1e3,
            shared.allreduce.in_batch(0) * 1e3,
            shared.allreduce.beta * 1e9,
            shared.sparsify.alpha * 1e6,
            shared.sparsify.beta * 1e9,
            sum(layer.backward for layer in shared.layers) * 1e3,
        )
        if pending.fresh:
            ends = _ends(d.state.traces)
            d.set(
                before=ends if d.state.layerwise_in_force else None,
                traces=(),
                fallback=False,  # a fresh profile: the strategy's plan first
            )
            if d.view.config.auto and _choose_density(opts, d, ends):
                return  # the steps to check the choice against are broadcast first
            _plan_fresh(opts, d)
        else:
            d.set(traces=(), refining=False, fallback=not pending.keep)
            _replan(opts, d)
    elif topic == "ends":
        assert pending.choice is not None
        _put_choice(d, pending.choice, pending.layers, tuple(value))
        _plan_fresh(opts, d)
    elif topic == "auto":
        assert pending.check is not None
        _auto_judged(opts, d, value, pending.check, pending.higher)
    elif topic == "recall":
        if value is None:
            assert pending.stepped is not None
            _probe_or_wait(opts, d, pending.stepped)
            return
        saved = Calibration.from_dict(value)
        d.set(from_file=True)
        d.log(
            "dlgs: the collectives saved in %s (%d ranks): no probes",
            opts.calibration_file,
            saved.world_size,
        )
        _share(
            d,
            _measured(d, saved.pack, saved.allgather, saved.allreduce, None, saved.priced_by),
            fresh=True,
        )
    elif topic == "guard":
        d.set(guard_result=value)
        if not value["kept"]:
            d.log(
                "dlgs: the plan's steps ended at %.3g ms (median of %d) against %.3g ms "
                "layer by layer (median of %d), %s the noise margin of %.3g ms: "
                "sending layer by layer",
                value["plan"] * 1e3,
                len(value["plan_steps"]),
                value["layerwise"] * 1e3,
                len(value["layerwise_steps"]),
                # A plan that sends more bytes must win beyond the noise.
                "sending more bytes and not faster beyond" if value.get("more_bytes") else "beyond",
                value["margin"] * 1e3,
            )
        _share(d, _remeasured(d), fresh=False, keep=bool(value["kept"]))
    else:
        raise RuntimeError(f"dlgs planner: a broadcast answered {topic!r}")


def _plan_fresh(opts: PlannerOptions, d: _Decision) -> None:
    _replan(opts, d)
    d.set(refining=opts.refine)


# -- density="auto" --------------------------------------------------------------
def _choose_density(opts: PlannerOptions, d: _Decision, ends: Optional[Tuple[float, ...]]) -> bool:
    """``density="auto"``: the density from the profile (rank 0's, so every
    rank chooses the same), in force with the plan made next. ``ends``: the
    measured ends of the fresh profile's steps (at the density in force),
    which the steps under a new density are checked against; they are
    broadcast first (True: the call ends there)."""
    s, view = d.state, d.view
    assert s.profile is not None
    choice = choose_density(
        s.profile,
        view.config,
        opts.strategy,
        bucket_elements=opts.bucket_elements,
        max_group=opts.max_group,
    )
    d.set(density_choice=choice, auto_check=None)
    layers = None
    if choice.layers:
        index = {layer.name: i for i, layer in enumerate(s.profile.layers)}
        layers = tuple(choice.layers[index[layer.name]] for layer in view.layers)
    if (layers or (choice.density,) * len(view.layers)) == d.densities:
        d.log("dlgs at step %d: %s", view.step, choice.describe())
        return False
    # The layer-wise steps timed so far were at other densities: the guard has
    # nothing to compare the plan with, but the choice has. Rank 0's steps,
    # like the verdict: a checkpoint then saves the same check on every rank.
    if opts.refine and ends is not None:
        d.ask(Broadcast(list(ends), "ends"), Pending("ends", choice=choice, layers=layers))
        return True
    _put_choice(d, choice, layers, ())
    return False


def _put_choice(
    d: _Decision,
    choice: DensityChoice,
    layers: Optional[Tuple[float, ...]],
    ends: Tuple[float, ...],
) -> None:
    if ends:
        d.set(auto_check=AutoCheck(d.density, d.auto_layers, ends, d.state.before is not None))
    d.set(before=None)
    d.set_density(choice.density, layers)
    d.log("dlgs at step %d: %s", d.view.step, choice.describe())


def _check_auto(opts: PlannerOptions, d: _Decision) -> bool:
    """``density="auto"``: start judging whether the densities chosen proved
    themselves against those before (True: the verdict is broadcast first).

    The steps under them are kept only if they are measured to end no later
    than those before, by a margin above the noise (:func:`guard_verdict`
    with ``prove``), or later by at most ``auto_slack`` of back-propagation
    when the choice sends more elements (density times size, summed over the
    layers). Otherwise the densities before are back in force and refinement
    starts again under their plan. The cost model predicts the communication,
    not what it costs a busy host; this measures it, once per profile."""
    s, view = d.state, d.view
    check, choice = s.auto_check, s.density_choice
    d.set(auto_check=None)
    n = len(view.layers)
    if check is None or choice is None or d.densities == check.densities(n):
        return False
    assert s.profile is not None
    backprop = sum(layer.backward for layer in s.profile.layers)
    numel = [layer.numel for layer in view.layers]
    sent = sum(x * m for x, m in zip(d.densities, numel))
    higher = sent > sum(x * m for x, m in zip(check.densities(n), numel))
    allowance = view.config.auto_slack * backprop if higher else 0.0
    verdict = guard_verdict(check.ends, _ends(s.traces), allowance=allowance, prove=True)
    d.ask(
        Broadcast({**verdict, "density": d.density, "before_density": check.density}, "auto"),
        Pending("auto", check=check, higher=higher),
    )
    return True


def _auto_judged(
    opts: PlannerOptions, d: _Decision, verdict: Dict[str, Any], check: AutoCheck, higher: bool
) -> None:
    choice = d.state.density_choice
    assert choice is not None
    kept = bool(verdict["kept"])
    choice = replace(choice, measured=verdict, reverted=None if kept else check.density)
    d.set(density_choice=choice)
    d.log("dlgs at step %d: %s", d.view.step, choice.describe())
    if kept:
        _judge(opts, d)
        return
    if higher and verdict.get("plan") is not None:
        _fit_link(d, verdict["plan"])
    if check.layerwise:
        d.set(before=check.ends)  # the guard compares with them again
    d.set_density(check.density, check.layers)
    _replan(opts, d)  # clears the traces; refinement goes on under this plan


def _fit_link(d: _Decision, measured: float) -> None:
    """The choice that sent more measured slower than the profile predicted
    it: the link is slower than the probes saw
    (:func:`~dlgs.core.planning.profile.fit_link`), and the plans made from here on
    know it. From rank 0's median, so every rank fits the same."""
    s = d.state
    assert s.profile is not None and s.plan is not None
    each = ready_densities(d.densities, d.density, _order(d.view, s.profile.layers))
    part = s.plan.partition()
    density = d.density if each is None else each
    profile, fit = fit_link(s.profile, d.view.config, density, part, measured)
    d.set(profile=profile, calibration={**s.calibration, "link": fit["seconds_per_byte"]})
    if fit["fitted"]:
        d.log(
            "dlgs: the steps under density='auto''s choice ended at %.3g ms, predicted "
            "%.3g ms: collectives now cost at least a ring over a %.3g Mbit/s link",
            fit["measured"] * 1e3,
            fit["predicted"] * 1e3,
            8 / fit["seconds_per_byte"] / 1e6,
        )


# -- refinement and the guard -------------------------------------------------------
def _refine_step(opts: PlannerOptions, d: _Decision, record: StepRecord) -> None:
    """Time steps under the fresh plan (its first step relays buffers and is
    skipped), then judge them and plan once more on every rank."""
    s = d.state
    if record.trace is not None and s.refine_armed:
        d.set(traces=s.traces + (record.trace,))
    if len(d.state.traces) >= opts.profile_steps:
        if not _check_auto(opts, d):
            _judge(opts, d)
        return
    if s.refine_armed or d.view.step > s.plan_step:
        d.set(refine_armed=True)
        d.do(Trace())


def _judge(opts: PlannerOptions, d: _Decision) -> None:
    """The guard: whether the plan timed in refinement may stay (rank 0's
    verdict, broadcast), then the refined profile."""
    s = d.state
    if not (opts.guard and opts.strategy == "dp" and s.before):
        _share(d, _remeasured(d), fresh=False, keep=True)
        return
    # Within the noise the two are a coin toss that would fall differently
    # from run to run: keep the one that sends fewer bytes, a rule every run
    # agrees on. A plan that sends more must be faster beyond the noise.
    more = s.layerwise_bytes is not None and d.view.wire_bytes > s.layerwise_bytes
    verdict = guard_verdict(s.before, _ends(s.traces), prove=more)
    verdict["more_bytes"] = more
    d.ask(Broadcast(verdict, "guard"), Pending("guard"))


# -- drift -------------------------------------------------------------------
def _voted(opts: PlannerOptions, d: _Decision, words: Sequence[int], pending: Pending) -> None:
    # Bit 1: rank 0's drift verdict; bit 2: some rank's reprofile() request.
    asked = [r for r, w in enumerate(words) if w & 2]
    if words[0] & 1 or asked:
        d.log(
            "dlgs: %s (at step %d): profiling again",
            "step time drifted from the plan's calibration for two windows"
            if words[0] & 1
            else f"reprofile() was called on rank(s) {asked}",
            d.view.step,
        )
        d.state = restarted(d.state)
        return
    assert pending.stepped is not None
    _on_step(opts, d, pending.stepped)


def _check_drift(opts: PlannerOptions, d: _Decision, ev: Stepped) -> bool:
    """Re-profile when the measured step drifts from what the plan was made for.

    The ratio of measured (first gradient to end of wait) to predicted end
    is calibrated over the first ``drift_window`` steps after a plan; when
    two windows in a row have medians beyond ``drift_tolerance`` from it
    (in the same direction) and the planner is within ``profile_budget``
    of the elapsed time, rank 0 votes to profile again. Every rank sends
    its vote with a 1-element asynchronous allgather at the window's end
    and reads rank 0's one step later, so the vote never blocks a step,
    and every rank profiles again at the same step. Returns False (the vote
    is read at the next step, see :func:`decide`)."""
    s, record = d.state, ev.record
    if not opts.drift_window or opts.strategy == "none" or record.seconds is None:
        return False
    assert s.plan is not None
    ratios = s.ratios + (record.seconds / max(s.plan.end, 1e-9),)
    # A window is drift_window steps (one record each on the host; steps run
    # on the device alone leave none).
    start = d.view.step - 1 if s.window_start is None else s.window_start
    if d.view.step - start < opts.drift_window:
        d.set(ratios=ratios, window_start=start)
        return False
    ratio = statistics.median(ratios)
    d.set(ratios=(), window_start=d.view.step)  # the next window starts here
    if s.baseline is None:
        d.set(baseline=ratio)
        return False
    drift = ratio / s.baseline - 1.0
    # One window beyond the tolerance is often noise (a busy host); two in a
    # row in the same direction are a drift.
    if abs(drift) <= opts.drift_tolerance:
        drifted = 0
    elif s.drifted * drift > 0:
        drifted = s.drifted + (1 if drift > 0 else -1)
    else:
        drifted = 1 if drift > 0 else -1
    # The next profile is expected to cost what the last one did.
    ledger = ev.ledger
    affordable = ledger.seconds + ledger.profile_seconds <= opts.profile_budget * ledger.elapsed
    vote = abs(drifted) >= 2 and affordable
    if abs(drifted) >= 2:
        d.log(
            "dlgs: drift %+.0f%% at step %d; profiling has cost %.3g s of %.3g s "
            "(profile_budget %g): %s",
            drift * 100,
            d.view.step,
            ledger.seconds,
            ledger.elapsed,
            opts.profile_budget,
            "voting to profile again" if vote else "re-profiling later",
            level=logging.DEBUG,
        )
    d.set(drifted=drifted, vote_pending=True)
    d.do(Vote(int(vote) | (2 if s.restart_requested else 0)))
    return False


def restarted(state: PlannerState) -> PlannerState:
    """Profile again from the next step (the plan in force stays on the
    exchange meanwhile). The caller reads a pending vote first."""
    return replace(
        state,
        profile=None,
        plan=None,
        traces=(),
        ratios=(),
        window_start=None,
        baseline=None,
        drifted=0,
        refining=False,
        auto_check=None,
        restart_requested=False,
        vote_pending=False,
        pending=None,
    )


# -- planning ----------------------------------------------------------------
def _order(view: ExchangeView, layers: Sequence[LayerProfile]) -> Tuple[int, ...]:
    index = {layer.name: i for i, layer in enumerate(view.layers)}
    return tuple(index[layer.name] for layer in layers)


def ready_densities(
    densities: Sequence[float], density: float, order: Sequence[int]
) -> Optional[Tuple[float, ...]]:
    """Each layer's density in ``order`` (exchange indices, ready order), or
    None where every layer is at ``density``."""
    if all(x == density for x in densities):
        return None
    return tuple(densities[i] for i in order)


def _replan(opts: PlannerOptions, d: _Decision, density: Optional[float] = None) -> Groups:
    """Plan from the profile at the densities in force (``density``: a new
    one being laid out) and return the plan's messages; the caller sets it."""
    s, view = d.state, d.view
    assert s.profile is not None
    order = _order(view, s.profile.layers)
    strategy = "none" if s.fallback else opts.strategy
    x = d.density if density is None else density
    each = ready_densities(d.densities, d.density, order)
    plan = plan_at(
        s.profile,
        view.config,
        x if each is None else list(each),
        strategy,
        bucket_elements=opts.bucket_elements,
        max_group=opts.max_group,
    )
    # With transport="auto" a sparse message travels as the plan chose.
    routed = view.config.transport == "auto"
    groups = tuple(
        (tuple(order[p] for p in g.members), g.transport if routed and g.sparse else g.sparse)
        for g in plan.groups
    )
    d.set(
        plan=plan,
        plans_made=s.plans_made + 1,
        plan_step=view.step,
        refine_armed=False,
        # Steps timed under the previous plan no longer count.
        traces=() if s.refining else s.traces,
        order=order,
        layerwise_in_force=strategy == "none",
        ratios=(),  # calibrate drift against this plan
        window_start=None,
        baseline=None,
        density=x,
        each=each,
    )
    d.do(SetPlan(groups, defer=density is None))
    d.log("dlgs plan at step %d (density %g):\n%s", view.step, x, plan.describe())
    return groups


def _on_density(opts: PlannerOptions, d: _Decision, density: float) -> None:
    """The exchange lays out for a new density: the plan for it from the same
    profile (every rank re-plans at the same step, from the same profile)."""
    s = d.state
    if s.profile is None or s.plan is None:
        return
    each = ready_densities(d.densities, d.density, _order(d.view, s.profile.layers))
    if (density, each) != (s.density, s.each):
        _replan(opts, d, density)


# -- checkpoints -------------------------------------------------------------
def saved(state: PlannerState) -> Dict[str, Any]:
    """The planner's checkpoint entry (plain data)."""
    check, choice = state.auto_check, state.density_choice
    return {
        "profile": state.profile.to_dict() if state.profile is not None else None,
        "fallback": state.fallback,
        "guard_result": state.guard_result,
        # density="auto": its last choice (what describe() shows) and, in the
        # middle of its check, the steps it compares with.
        "auto_choice": None if choice is None else choice.summary(),
        "auto_check": None if check is None else check.to_state(),
    }


def _on_load(opts: PlannerOptions, d: _Decision, state: Dict[str, Any]) -> None:
    view = d.view
    # density="auto"'s entries, validated before anything changes.
    check = state.get("auto_check")
    if check is not None:
        check = AutoCheck.from_state(check, len(view.layers))
    summary = state.get("auto_choice")
    if summary is not None:
        DensityChoice.from_summary(summary, Plan(()))
    data = state.get("profile")
    profile = Profile.from_dict(data) if data is not None else None
    if profile is not None and profile.world_size != view.size:
        d.do(
            Log(
                "dlgs: the saved profile was measured with %d workers, this job has %d: "
                "profiling again before planning",
                (profile.world_size, view.size),
                logging.WARNING,
                every_rank=True,
            )
        )
        profile = None
    if not (view.config.auto and profile is not None):
        summary = check = None
    elif not opts.refine:
        check = None
    # A saved profile was measured (and refined) already, unless the
    # checkpoint was taken during density="auto"'s check: the choice is then
    # timed again and compared with the saved steps.
    d.set(
        profile=profile,
        fallback=bool(state.get("fallback", False)),
        guard_result=state.get("guard_result"),
        traces=(),
        refining=check is not None,
        auto_check=check,
        plan=None,
        density_choice=None,
    )
    if profile is not None:
        _replan(opts, d)
        if summary is not None:
            assert d.state.plan is not None
            d.set(density_choice=DensityChoice.from_summary(summary, d.state.plan))


# -- pure helpers ------------------------------------------------------------
def _ends(traces: Sequence[StepTrace]) -> Tuple[float, ...]:
    """Seconds from each traced step's first gradient to the end of its wait."""
    return tuple(t.end for t in traces if t.end is not None)


def probe_ladder(dense_bytes: int) -> List[int]:
    """Probe sizes in bytes, multiples of 4: by factors of 4 up to the
    model's dense size (at most 4 MiB), that size last, from 1 KiB (or a
    256th of the dense size for a model under 256 KiB, at least 64 B, so
    that a small model's probes stay small)."""
    top = min(_PROBE_MAX, max(1024, dense_bytes))
    nbytes = min(_PROBE_MIN, max(64, top // 256 // 4 * 4))
    sizes = []
    while nbytes < top:
        sizes.append(nbytes)
        nbytes *= 4
    return sizes + [top]


def probe_sizes(opts: PlannerOptions, ledger: Ledger, view: ExchangeView) -> List[int]:
    """The probe sizes (bytes) a profile can afford: the smallest rung of
    :func:`probe_ladder`, the largest one affordable and one between them,
    where both kinds of probe at each size, ``probe_reps + 1`` times each
    (and :data:`BATCH` at once at the smallest size), cost no more than (a)
    what sparse sending has saved against dense so far, less what planning
    has spent (so dlgs never sends more than dense Horovod would), and (b)
    ``profile_budget`` of the bytes :data:`HORIZON_STEPS` steps of the layout
    in force send. Empty if not even the two smallest rungs fit. The same on
    every rank (the ledger counts layouts and broadcast results, which every
    rank shares)."""
    budget = min(
        ledger.saved_bytes - ledger.bytes,
        opts.profile_budget * HORIZON_STEPS * view.wire_bytes,
    )
    ladder = probe_ladder(view.dense_bytes)
    calls = 2 * (opts.probe_reps + 1)
    for top in range(len(ladder) - 1, 0, -1):
        sizes = sorted({ladder[0], ladder[top // 2], ladder[top]})
        # Each size alone, and BATCH of the smallest at once.
        if calls * (sum(sizes) + BATCH * sizes[0]) <= budget:
            return sizes
    return []


#: Standard error of a median of normal samples: 1.2533 sigma / sqrt(n); sigma
#: from the median absolute deviation: 1.4826 MAD.
_MEDIAN_SE = 1.2533 * 1.4826


def guard_verdict(
    layerwise: Sequence[float],
    plan: Sequence[float],
    z: float = 2.0,
    floor: float = 0.02,
    allowance: float = 0.0,
    prove: bool = False,
) -> Dict[str, Any]:
    """Whether a plan's timed steps justify keeping it against layer-wise ones.

    The plan is dropped only if the median of ``plan`` exceeds the median of
    ``layerwise`` by more than a noise margin: ``z`` standard errors of the
    difference of the two medians (each estimated from its median absolute
    deviation, robust to a few outlying steps), and at least ``floor`` of the
    layer-wise median. Within the margin the measurement cannot tell them
    apart and the plan, which the cost model chose, stays (unless ``prove``).
    ``allowance``
    (seconds): how much slower the plan may be on top of the margin
    (``density="auto"`` allows a higher density ``auto_slack``). With
    ``prove`` the burden is the plan's: it is kept only if its median plus the
    margin is within ``ma + allowance``, so that a difference the noise hides
    keeps what ran before (the guard asks it of a plan that sends more bytes
    than layer-wise sending: within the noise, the fewer bytes).

    Returns:
        The verdict with its inputs, as plain data: ``layerwise`` and ``plan``
        (medians, s), ``layerwise_steps`` and ``plan_steps`` (the samples),
        ``margin`` and ``allowance`` (s) and ``kept``.
    """
    a, b = list(layerwise), list(plan)
    if not a or not b:
        return {
            "layerwise": None,
            "plan": None,
            "layerwise_steps": a,
            "plan_steps": b,
            "margin": 0.0,
            "allowance": allowance,
            "kept": True,
        }
    ma, mb = statistics.median(a), statistics.median(b)
    mad_a = statistics.median(abs(x - ma) for x in a)
    mad_b = statistics.median(abs(x - mb) for x in b)
    se = _MEDIAN_SE * math.sqrt(mad_a**2 / len(a) + mad_b**2 / len(b))
    margin = max(floor * ma, z * se)
    return {
        "layerwise": ma,
        "plan": mb,
        "layerwise_steps": a,
        "plan_steps": b,
        "margin": margin,
        "allowance": allowance,
        "kept": mb + margin <= ma + allowance if prove else mb <= ma + allowance + margin,
    }


def fit_or_flat(sizes: Sequence[float], times: Sequence[float]) -> CostModel:
    """A line through the points, or a constant when they cannot fix a slope."""
    if len(set(sizes)) >= 2:
        return fit_cost_model(sizes, times)
    return CostModel(max(0.0, statistics.median(times)) if times else 0.0, 0.0)
