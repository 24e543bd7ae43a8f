"""Online profiling and planning, run by the exchange at step boundaries.

:class:`OnlinePlanner` is a step hook of :class:`~dlgs.core.exchange.exchange.SparseExchange`:

1. after ``skip_steps`` warm-up steps it times ``profile_steps`` steps: when
   each layer's gradient arrives and how long its sparsification (or packing)
   takes, on the compute stream, with the adapter's clock;
2. it then times probe allgathers and allreduces of several sizes on the job's
   real ranks and network and fits ``alpha + beta * bytes`` to each (MG-WFBP's
   model), and times copies for the packing cost. Probes pay for themselves:
   they spend at most the bytes that sparse sending has saved against dense
   so far (the first ones wait until it has; a re-profile that cannot pay
   keeps the collectives it fitted) and at most ``profile_budget`` of what
   1,000 steps of the layout in force send, and re-profiling after drift waits
   until the planner's time, plus the last profile's, is under
   ``profile_budget`` of the run; the probes' latency is calibrated to the
   profiled steps (:func:`~dlgs.core.planning.profile.calibrate`);
3. rank 0's :class:`~dlgs.core.planning.profile.Profile` is broadcast, so every rank
   plans from the same numbers; the planner is a pure function, so every rank
   derives the same plan, which the exchange applies from the next step;
4. whenever the density changes (warm-up stages) it re-plans from the same
   profile, on every rank at the same step.

Layers are planned in their *measured* arrival order, which is what "ready
order" means for the model; the plan's groups are mapped back to the
exchange's layer indices.

Every decision above is made by :func:`~dlgs.core.planning.phases.decide`, a pure
function of the planner's frozen state, a read-only view of the exchange and
the step's record, which returns the actions to take (time a step, probe,
broadcast, set a plan or a density, vote). :class:`OnlinePlanner` is the
driver: it carries them out through the exchange's collectives and setters,
and keeps the ledger of what planning costs.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import pickle
import time
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._checks import check_int
from ..config import MERGE_STRATEGIES, MergeConfig
from ..exchange.records import StepRecord
from .calibration import Calibration
from .dp import Plan
from .phases import (
    Action,
    Broadcast,
    DensityChanged,
    Event,
    Ledger,
    Loaded,
    Log,
    Mode,
    PlannerOptions,
    PlannerState,
    Probe,
    ReadVote,
    Recall,
    Record,
    SetDensity,
    SetPlan,
    Shared,
    Stepped,
    Trace,
    Vote,
    Voted,
    decide,
    guard_verdict,
    ready_densities,
    restarted,
    saved,
)
from .probing import Prober
from .probing import log_first_rank as _log
from .profile import DensityChoice, Profile

__all__ = ["OnlinePlanner", "MERGE_STRATEGIES", "guard_verdict"]

logger = logging.getLogger(__name__)


class OnlinePlanner:
    """Profiles a few steps, then plans and re-plans the exchange's messages.

    A :class:`~dlgs.core.exchange.records.StepHook` of the exchange.

    Args:
        strategy: ``dp``, ``none``, ``all``, ``buckets`` or ``greedy``.
        profile_steps: steps to time (the medians are used).
        skip_steps: steps before profiling starts (the first step allocates
            buffers and anchors every threshold, so it is not typical).
        bucket_elements: ``buckets`` strategy: elements per bucket.
        max_group: most layers in one message (``dp``; None: any).
        probe_reps: repetitions of each probe collective.
        profile: a ready profile: skip measuring and plan at once.
        record: keep timing every step after planning (one clock read per
            layer per step; on CUDA each read synchronises) into ``timings``.
        drift_tolerance / drift_window: re-profile when the median step of a
            ``drift_window``-step window moves by more than ``drift_tolerance``
            (relative) from the first window after the plan; ``drift_window=0``
            never re-profiles on its own. One tiny broadcast per window.
        refine: after each plan made from a fresh measurement, time
            ``profile_steps`` steps under that plan and plan once more from
            those backward and sparsify times (the collectives stay as fitted).
            The first profile runs before any plan, so it cannot see how the
            plan's own messages slow back-propagation (Horovod's thread and
            the network stack share the cores); ``False`` skips this.
        guard: ``dp`` with ``refine`` only: drop the plan for layer-wise
            sending if the steps timed under it ended later (first gradient to
            the end of the exchange's wait) than the layer-wise steps profiled
            before it by more than the noise of both samples
            (:func:`guard_verdict`). The cost model cannot see every cost of a
            plan's messages (on shared CPU cores their copies and Horovod's
            thread slow back-propagation), the measurement can. A plan that
            sends more bytes than layer-wise sending must have ended sooner
            beyond the noise (within it, the fewer bytes: the same in every
            run). Rank 0's verdict is broadcast, so every rank keeps the same
            plan.
        profile_budget: a re-profile after drift waits until the planner's
            host time, plus what the last profile took, is under this share of
            the time since the first step; a profile's probes spend at most
            this share of the bytes 1,000 steps of the layout in force send,
            and never more than sparse sending has saved against dense float32
            so far.
        link_bandwidth: bit/s of the slowest link, or None: bytes the probes
            could not see against their noise are priced as a ring over this
            link (:mod:`~dlgs.core.planning.netmodel`) instead of at the most
            the samples allow (:func:`~dlgs.core.planning.probefit.fit_probe`).
        calibration_file: a path or None: rank 0 saves the fitted collectives
            there after probing, and a later job at the same world size and
            ``link_bandwidth`` plans from them without probing
            (:mod:`~dlgs.core.planning.calibration`).
    """

    def __init__(
        self,
        strategy: str = "dp",
        *,
        profile_steps: int = 8,
        skip_steps: int = 1,
        bucket_elements: int = 8192,
        max_group: Optional[int] = None,
        probe_reps: int = 2,
        profile: Optional[Profile] = None,
        record: bool = False,
        drift_tolerance: float = 0.25,
        drift_window: int = 50,
        refine: bool = True,
        guard: bool = True,
        profile_budget: float = 0.01,
        link_bandwidth: Optional[float] = None,
        calibration_file: Optional[str] = None,
    ):
        #: The merge options, validated once (:class:`~dlgs.core.config.MergeConfig`).
        self.config = MergeConfig(
            strategy,
            profile_steps,
            bucket_elements,
            max_group,
            drift_tolerance,
            drift_window,
            refine,
            guard,
            profile_budget,
            link_bandwidth,
            calibration_file,
        )
        check_int("skip_steps", skip_steps, 0)
        check_int("probe_reps", probe_reps, 1)
        self.strategy = strategy
        self.profile_steps = profile_steps
        self.skip_steps = skip_steps
        self.bucket_elements = bucket_elements
        self.max_group = max_group
        self.probe_reps = probe_reps
        self.refine = refine
        self.guard = guard
        self.profile_budget = float(profile_budget)
        self.link_bandwidth = None if link_bandwidth is None else float(link_bandwidth)
        self.calibration_file = self.config.calibration_file
        self.drift_tolerance = float(drift_tolerance)
        self.drift_window = drift_window
        if profile is not None and not isinstance(profile, Profile):
            raise TypeError(
                "profile must be None or a dlgs.core.planning.profile.Profile, got "
                f"{type(profile).__name__}"
            )
        self._given_profile = profile  # options() reports this one, not a measured one
        self.record = record
        self._state = PlannerState(profile=profile)
        #: With ``record``: per step after planning, the plan's predicted end of
        #: communication and the measured one (first gradient to the end of
        #: the exchange's wait), in seconds.
        self.timings: List[Dict[str, float]] = []
        self._vote: Optional[Tuple[Any, Any]] = None  # (comm, handle) of a drift vote
        self._started: Optional[float] = None  # perf_counter() at the first step seen
        self._profile_seconds = 0.0  # host time the last fresh profile took
        self._density_plan: Optional[List[Tuple[List[int], Mode]]] = None  # on_density's answer
        #: What planning has cost this rank so far, and what sparse steps saved:
        #: ``seconds`` (host time inside this hook: probes, broadcasts,
        #: planning, bookkeeping), ``bytes`` (this rank's part of the probe
        #: collectives and the planner's broadcasts, counted like
        #: ``exchange.wire_bytes()``), ``probes`` (probe collectives issued),
        #: ``profiles`` (profiles measured), ``broadcasts`` (broadcasts and
        #: drift votes), ``probe_bytes`` (part of ``bytes``), ``probe_seconds``
        #: and ``broadcast_seconds`` (parts of ``seconds``), and
        #: ``saved_bytes`` (over the steps seen, dense float32 bytes minus the
        #: exchange's ``wire_bytes()``: what the probes may spend).
        self.cost: Dict[str, Any] = {
            "seconds": 0.0,
            "bytes": 0,
            "probes": 0,
            "profiles": 0,
            "broadcasts": 0,
            "saved_bytes": 0,
            "probe_bytes": 0,
            "probe_seconds": 0.0,
            "broadcast_seconds": 0.0,
        }
        self._prober = Prober(self.probe_reps, self.link_bandwidth, self.cost)

    # -- state (read-only; see dlgs.core.planning.phases.PlannerState) --------------------
    @property
    def decisions(self) -> PlannerOptions:
        """The options the decisions read (:class:`~dlgs.core.planning.phases.PlannerOptions`),
        from the attributes of the same names (set before the phase that reads
        them, e.g. ``planner.refine = False`` before the plan is made)."""
        return PlannerOptions(
            self.strategy,
            self.profile_steps,
            self.skip_steps,
            self.bucket_elements,
            self.max_group,
            self.probe_reps,
            self.record,
            self.drift_tolerance,
            self.drift_window,
            self.refine,
            self.guard,
            self.profile_budget,
            self.calibration_file,
        )

    @property
    def state(self) -> PlannerState:
        """The planner's frozen state (:class:`~dlgs.core.planning.phases.PlannerState`)."""
        return self._state

    @property
    def phase(self) -> str:
        """``profile``, ``refine`` or ``run`` (:mod:`dlgs.core.planning.phases`)."""
        return self._state.phase

    @property
    def profile(self) -> Optional[Profile]:
        """The profile plans are made from (rank 0's), None while profiling.
        Setting one plans from it at the next step (every rank must set the
        same)."""
        return self._state.profile

    @profile.setter
    def profile(self, profile: Optional[Profile]) -> None:
        if profile is not None and not isinstance(profile, Profile):
            raise TypeError(
                "profile must be None or a dlgs.core.planning.profile.Profile, got "
                f"{type(profile).__name__}"
            )
        self._state = replace(self._state, profile=profile, plan=None)

    @property
    def plan(self) -> Optional[Plan]:
        """The plan made last (in ready order), None before one."""
        return self._state.plan

    @property
    def order(self) -> List[int]:
        """The plan's layers (ready order) as the exchange's layer indices."""
        return list(self._state.order)

    @property
    def guard_result(self) -> Optional[Dict[str, Any]]:
        """The last guard's verdict (:func:`guard_verdict`: its inputs, the
        medians, the noise margin and whether the plan was kept; rank 0's, the
        same on every rank); None until a guard has run. Saved in checkpoints."""
        return self._state.guard_result

    @property
    def density_choice(self) -> Optional[DensityChoice]:
        """``density="auto"``: the last choice and the numbers it compared
        (:class:`~dlgs.core.planning.profile.DensityChoice`); None before."""
        return self._state.density_choice

    @property
    def calibration(self) -> Dict[str, float]:
        """The last calibration of the probes to the traced layer-wise steps
        (:func:`~dlgs.core.planning.profile.calibrate`'s record, with the fitted
        ``contention``; rank 0's; empty before one)."""
        return dict(self._state.calibration)

    @property
    def collectives_from(self) -> Optional[str]:
        """The ``calibration_file`` the collectives in force were read from,
        or None where this job's probes fitted them."""
        return self.calibration_file if self._state.from_file else None

    @property
    def plans_made(self) -> int:
        """How many plans have been made (1 + re-plans after drift or restart)."""
        return self._state.plans_made

    # -- step hook -------------------------------------------------------------
    def __call__(self, ex, record: StepRecord) -> None:
        """Called by the exchange after each step (``ex.step`` steps are done)."""
        if self.strategy == "none" and not self.record:
            return  # layer-wise needs no profile unless predictions are wanted
        t0 = time.perf_counter()
        if self._started is None:
            self._started = t0
        self.cost["saved_bytes"] += ex.dense_bytes() - ex.wire_bytes()
        fresh = self._state.profile is None
        ledger = Ledger(
            saved_bytes=self.cost["saved_bytes"],
            bytes=self.cost["bytes"],
            seconds=self.cost["seconds"],
            elapsed=t0 - self._started,
            profile_seconds=self._profile_seconds,
        )
        try:
            self._drive(ex, Stepped(record, ledger))
        finally:
            seconds = time.perf_counter() - t0
            self.cost["seconds"] += seconds
            if fresh and self._state.profile is not None:
                self._profile_seconds = seconds

    def _drive(self, ex, event: Optional[Event]) -> None:
        """Decide on ``event`` and carry out the actions, feeding each
        result back, until the decision asks for none."""
        view, options = _View(ex), self.decisions
        try:
            while event is not None:
                self._state, actions = decide(options, self._state, view, event)
                event = None
                for action in actions:
                    event = self._carry_out(ex, action)
        except BaseException:
            # A collective or probe failed: nothing is awaited any more.
            self._state = replace(self._state, pending=None)
            raise

    def _carry_out(self, ex, action: Action) -> Optional[Event]:
        if isinstance(action, Trace):
            ex.trace_next_step()
        elif isinstance(action, Log):
            if action.every_rank:
                logger.log(action.level, action.msg, *action.args)
            else:
                _log(ex, action.msg, *action.args, level=action.level)
        elif isinstance(action, SetPlan):
            groups = [(list(members), mode) for members, mode in action.groups]
            if action.defer:
                ex.set_plan(groups)
            else:
                self._density_plan = groups
        elif isinstance(action, SetDensity):
            ex.set_density(action.density, action.layers)
        elif isinstance(action, Record):
            self.timings.append(action.timing)
        elif isinstance(action, Broadcast):
            if action.topic == "profile":
                self.cost["profiles"] += 1
            return Shared(self._broadcast(ex, action.value))
        elif isinstance(action, Probe):
            probed = self._prober.probe(ex, action.sizes)
            if self.calibration_file is not None and ex.comm.rank == 0:
                fitted = Calibration(
                    ex.comm.size,
                    probed.pack,
                    probed.allgather,
                    probed.allreduce,
                    probed.priced_by,
                    self.link_bandwidth,
                )
                problem = fitted.save(self.calibration_file)
                if problem is not None:
                    _log(ex, "dlgs: %s", problem, level=logging.WARNING)
            return probed
        elif isinstance(action, Recall):
            recalled = None
            if ex.comm.rank == 0:  # rank 0's file, broadcast: every rank plans the same
                found, why, level = Calibration.recall(
                    action.path, ex.comm.size, self.link_bandwidth
                )
                if found is None:
                    _log(ex, "dlgs: %s: probing", why, level=level)
                recalled = None if found is None else found.to_dict()
            return Shared(self._broadcast(ex, recalled))
        elif isinstance(action, Vote):
            flag = ex.ops.index_vector([action.word], ex.like)
            self._vote = (ex.comm, ex.comm.allgather_async(flag, f"{ex.prefix}.drift_vote"))
            self.cost["broadcasts"] += 1
            self.cost["bytes"] += 8
        elif isinstance(action, ReadVote):
            return Voted(tuple(self._read_vote(ex)))
        else:  # pragma: no cover - every action is handled above
            raise TypeError(f"dlgs planner: unknown action {action!r}")
        return None

    def _read_vote(self, ex) -> List[int]:
        assert self._vote is not None
        comm, handle = self._vote
        self._vote = None
        return [int(w) for w in ex.ops.to_host(comm.synchronize(handle))]

    def _broadcast(self, ex, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank, counted in :attr:`cost`."""
        t0 = time.perf_counter()
        out = ex.comm.broadcast_object(obj)
        self.cost["broadcast_seconds"] += time.perf_counter() - t0
        self.cost["broadcasts"] += 1
        # Rank 0's object, the same on every rank: every rank counts the same.
        self.cost["bytes"] += len(pickle.dumps(out)) + 8  # payload and its length
        return out

    def options(self) -> Dict[str, Any]:
        """Every constructor option, as plain data every rank must agree on.

        Read generically from the constructor's signature, so an option added
        later is part of the cross-rank check (``dlgs.RankMismatchError``)
        without being listed anywhere: each must be stored under its own
        name. ``profile`` is reported as whether one was given and the hash of
        its content.
        """
        out: Dict[str, Any] = {}
        for name in inspect.signature(type(self).__init__).parameters:
            if name == "self":
                continue
            if name == "profile":
                given = self._given_profile
                digest = None
                if given is not None:
                    text = json.dumps(given.to_dict(), sort_keys=True, default=str)
                    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
                out[name] = {"given": given is not None, "sha256": digest}
            elif hasattr(self, name):
                out[name] = getattr(self, name)
            else:  # a new option must be stored as self.<name> to be checked
                raise AttributeError(f"OnlinePlanner.options: option {name!r} is not stored")
        return out

    #: Key of this hook's state in the exchange's ``state_dict()``.
    state_key = "OnlinePlanner"

    @classmethod
    def from_config(cls, config: MergeConfig, **internal: Any) -> "OnlinePlanner":
        """A planner for ``config``; ``internal``: ``skip_steps``, ``probe_reps``,
        ``profile``, ``record``."""
        if not isinstance(config, MergeConfig):
            raise TypeError(f"config must be a dlgs.MergeConfig, got {type(config).__name__}")
        return cls(**{**config.to_dict(), **internal})

    @property
    def ready(self) -> bool:
        """Whether a plan has been made (it applies from the following step)."""
        return self.plan is not None

    @property
    def settled(self) -> bool:
        """Whether the plan in force is final for this profile (made, and refined
        unless ``refine`` is off); it applies from the following step."""
        return self.plan is not None and not self._state.refining

    def restart(self) -> None:
        """Profile again from the next step and re-plan. The current plan stays
        in force meanwhile.

        **Collective**: call it on every rank of the process set, between the
        same two steps (e.g. ``if step == 1000: opt.dlgs.reprofile()``, never
        under ``if hvd.rank() == 0``). The profile ends in probe collectives
        and a broadcast that every rank must join; a rank that did not restart
        never issues them, and Horovod waits for it forever (it prints stall
        warnings). Nothing tells the other ranks of a one-rank call in time:
        the planner issues no collective every step, and adding one to every
        step to carry this request would tax every step of every job.
        Re-profiling after drift needs no call: the planner agrees on it by a
        broadcast (``drift_window``).
        """
        if self._vote is not None:  # every rank has the same vote pending
            comm, handle = self._vote
            self._vote = None
            comm.synchronize(handle)
        self._state = restarted(self._state)

    def request_restart(self, world_size: int) -> bool:
        """``.dlgs.reprofile()``: profile again, agreed with every rank.

        Safe on one rank: the request travels in the next drift vote (a
        1-element allgather every rank makes every ``drift_window`` steps once
        a plan is in force, the first one two windows after the plan), and
        every rank restarts at the same step when any rank asked. Where no
        vote will come (one rank, ``drift_window=0``, ``merge="none"``) the
        planner restarts at once, which with several ranks is a collective:
        call it on every rank between the same two steps. Returns whether it
        restarted at once."""
        if world_size <= 1 or not self.drift_window or self.strategy == "none":
            self.restart()
            return True
        self._state = replace(self._state, restart_requested=True)
        return False

    def on_density(self, ex, density: float) -> Optional[List[Tuple[List[int], Mode]]]:
        """The density or the per-layer densities changed (the exchange is
        re-laying out for them): the plan for them from the same profile,
        which the exchange applies in this layout, or None to keep the
        current one. Every rank re-plans at the same step, from the same
        profile, so every rank returns the same plan."""
        self._density_plan = None
        self._drive(ex, DensityChanged(density))
        groups, self._density_plan = self._density_plan, None
        return groups

    def ready_densities(self, ex, order: Optional[Sequence[int]] = None) -> Optional[List[float]]:
        """Each layer's density in force in ready order (``order``: exchange
        indices, default the profile's), or None where every layer is at
        ``ex.density`` (``density="auto"``'s per-layer choice, else None)."""
        if order is None:
            assert self.profile is not None
            index = {layer.name: i for i, layer in enumerate(ex.layers)}
            order = [index[layer.name] for layer in self.profile.layers]
        each = ready_densities(ex.densities, ex.density, order)
        return None if each is None else list(each)

    # -- measuring ---------------------------------------------------------------
    # -- checkpoints -------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return saved(self._state)

    def load_state_dict(self, state: Dict[str, Any], ex) -> None:
        self._drive(ex, Loaded(state))


class _View:
    """The exchange as :func:`~dlgs.core.planning.phases.decide` reads it (read live,
    nothing copied per step)."""

    __slots__ = ("_ex",)

    def __init__(self, ex: Any):
        self._ex = ex

    @property
    def step(self) -> int:
        return self._ex.step

    @property
    def rank(self) -> int:
        return self._ex.comm.rank

    @property
    def size(self) -> int:
        return self._ex.comm.size

    @property
    def config(self) -> Any:
        return self._ex.config

    @property
    def layers(self) -> Any:
        return self._ex.layers

    @property
    def density(self) -> float:
        return self._ex.density

    @property
    def densities(self) -> Tuple[float, ...]:
        return self._ex.densities

    @property
    def auto_layers(self) -> Optional[Tuple[float, ...]]:
        return self._ex.auto_layers

    @property
    def wire_bytes(self) -> int:
        return self._ex.wire_bytes()

    @property
    def dense_bytes(self) -> int:
        return self._ex.dense_bytes()
