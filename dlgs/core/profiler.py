"""Online profiling and planning, run by the exchange at step boundaries.

:class:`OnlinePlanner` is a step hook of :class:`~dlgs.core.exchange.SparseExchange`:

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
   profiled steps (:func:`~dlgs.core.profile.calibrate`);
3. rank 0's :class:`~dlgs.core.profile.Profile` is broadcast, so every rank
   plans from the same numbers; the planner is a pure function, so every rank
   derives the same plan, which the exchange applies from the next step;
4. whenever the density changes (warm-up stages) it re-plans from the same
   profile, on every rank at the same step.

Layers are planned in their *measured* arrival order, which is what "ready
order" means for the model; the plan's groups are mapped back to the
exchange's layer indices.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import math
import pickle
import statistics
import time
from dataclasses import replace
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from ._checks import check_int
from .config import MERGE_STRATEGIES, MergeConfig
from .exchange import StepRecord, StepTrace
from .planner import CostModel, Plan, fit_cost_model
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

__all__ = ["OnlinePlanner", "MERGE_STRATEGIES", "guard_verdict"]

logger = logging.getLogger(__name__)

#: A planned message's mode: sparse or not, or its transport (transport="auto").
Mode = Union[bool, str]


# Probe message sizes (bytes of one rank's chunk / of the allreduced buffer):
# a ladder from 1 KiB up to the model's dense size, at most 4 MiB
# (:func:`_probe_ladder`), of which a profile takes the rungs it can afford.
_PROBE_MIN, _PROBE_MAX = 1 << 10, 4 << 20
#: Probes are sized for runs of this many steps or more: one profile's probes
#: cost at most ``profile_budget`` of the bytes that this many steps of the
#: layout in force send.
_HORIZON_STEPS = 1000
#: Collectives started at once to measure the latency of one that joins a
#: batch Horovod has formed (``CostModel.batched``).
_BATCH = 4


class OnlinePlanner:
    """Profiles a few steps, then plans and re-plans the exchange's messages.

    A :class:`~dlgs.core.exchange.StepHook` of the exchange.

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
            thread slow back-propagation), the measurement can. Rank 0's
            verdict is broadcast, so every rank keeps the same plan.
        profile_budget: a re-profile after drift waits until the planner's
            host time, plus what the last profile took, is under this share of
            the time since the first step; a profile's probes spend at most
            this share of the bytes 1,000 steps of the layout in force send,
            and never more than sparse sending has saved against dense float32
            so far.
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
        #: The last guard's verdict (:func:`guard_verdict`: its inputs, the
        #: medians, the noise margin and whether the plan was kept; rank 0's,
        #: the same on every rank); None until a guard has run. Saved in
        #: checkpoints.
        self.guard_result: Optional[Dict[str, Any]] = None
        #: ``density="auto"``: the last choice and the numbers it compared
        #: (:class:`~dlgs.core.profile.DensityChoice`); None before.
        self.density_choice: Optional[DensityChoice] = None
        self._fallback = False  # the guard rejected the plan: layer-wise in force
        self._layerwise_in_force = True  # what the profiled steps ran under
        self._before: Optional[List[float]] = None  # their measured ends
        # density="auto": the steps profiled before a choice that changed the
        # densities; the steps under the choice are checked against them
        # once, in refinement.
        self._auto_before: Optional[_AutoCheck] = None
        self._refining = False  # timing steps under a fresh plan
        self._refine_armed = False
        self._plan_step = 0  # ex.step when the current plan was made
        self.drift_tolerance = float(drift_tolerance)
        self.drift_window = drift_window
        self._ratios: List[float] = []
        self._baseline: Optional[float] = None
        self._drifted = 0  # consecutive drift windows beyond the tolerance, signed
        self._vote: Optional[Tuple[Any, Any]] = None  # (comm, handle) of a drift vote
        self._restart_requested = False  # reprofile() asked; carried by the next vote
        self._started: Optional[float] = None  # perf_counter() at the first step seen
        self._collectives: Optional[Profile] = None  # the last profile with probes
        self._waiting = False  # logged that the first probes wait for their bytes
        #: The last calibration of the probes to the traced layer-wise steps
        #: (:func:`~dlgs.core.profile.calibrate`'s record, with the fitted
        #: ``contention``; rank 0's; empty before one).
        self.calibration: Dict[str, float] = {}
        self._layerwise_bytes: Optional[int] = None  # wire bytes of the layer-wise traces
        self._profile_seconds = 0.0  # host time the last fresh profile took
        #: How many plans have been made (1 + re-plans after drift or restart).
        self.plans_made = 0
        if profile is not None and not isinstance(profile, Profile):
            raise TypeError(
                f"profile must be None or a dlgs.core.profile.Profile, got {type(profile).__name__}"
            )
        self.profile = profile
        self._given_profile = profile  # options() reports this one, not a measured one
        self.record = record
        #: With ``record``: per step after planning, the plan's predicted end of
        #: communication and the measured one (first gradient to the end of
        #: the exchange's wait), in seconds.
        self.timings: List[Dict[str, float]] = []
        self.plan: Optional[Plan] = None
        self.order: List[int] = []
        self._traces: List[StepTrace] = []
        self._density: Optional[float] = None  # density the current plan is for
        self._each: Optional[List[float]] = None  # ... and per layer (ready order)
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

    # -- step hook -------------------------------------------------------------
    def __call__(self, ex, record: StepRecord) -> None:
        """Called by the exchange after each step (``ex.step`` steps are done)."""
        if self.strategy == "none" and not self.record:
            return  # layer-wise needs no profile unless predictions are wanted
        t0 = time.perf_counter()
        if self._started is None:
            self._started = t0
        self.cost["saved_bytes"] += ex.dense_bytes() - ex.wire_bytes()
        try:
            self._step(ex, record)
        finally:
            self.cost["seconds"] += time.perf_counter() - t0

    def _broadcast(self, ex, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank, counted in :attr:`cost`."""
        t0 = time.perf_counter()
        out = ex.comm.broadcast_object(obj)
        self.cost["broadcast_seconds"] += time.perf_counter() - t0
        self.cost["broadcasts"] += 1
        # Rank 0's object, the same on every rank: every rank counts the same.
        self.cost["bytes"] += len(pickle.dumps(out)) + 8  # payload and its length
        return out

    def _step(self, ex, record: StepRecord) -> None:
        if self.profile is not None:
            if self.plan is None:
                if ex.config.auto and self.density_choice is None:
                    self._choose_density(ex)  # a profile given at construction
                self._replan(ex)
            assert self.plan is not None
            if self._refining:
                self._refine_step(ex, record)
                return
            self._check_drift(ex, record)
            if self.record:
                t = record.trace
                end = t.end if t is not None else None
                if t is not None and end is not None:
                    first = min(t.arrive.values())
                    self.timings.append(
                        {
                            "step": record.step,
                            "predicted_end": self.plan.end,
                            "measured_end": end,
                            "compute_end": max(t.done.values()) - first,
                        }
                    )
                ex.trace_next_step()
            return
        if record.trace is not None:
            self._traces.append(record.trace)
        if len(self._traces) >= self.profile_steps:
            if self._collectives is None and not self._probe_sizes(ex):
                # The first probes wait until sparse sending has saved their bytes.
                if not self._waiting:
                    self._waiting = True
                    _log(
                        ex,
                        "dlgs: %d step(s) profiled; the probes wait until sparse sending has "
                        "saved the bytes they cost (%.3g MB per step saved so far)",
                        len(self._traces),
                        self.cost["saved_bytes"] / max(1, ex.step) / 1e6,
                    )
                return
            t0 = time.perf_counter()
            self.profile = self._measure(ex)
            ends = _ends(self._traces)
            self._before = ends if self._layerwise_in_force else None
            self._traces = []
            self._fallback = False  # a fresh profile: the strategy's plan first
            if ex.config.auto:
                self._choose_density(ex, ends)
            self._replan(ex)
            self._refining = self.refine
            self._profile_seconds = time.perf_counter() - t0
        elif ex.step >= self.skip_steps:
            ex.trace_next_step()

    def _refine_step(self, ex, record: StepRecord) -> None:
        """Time steps under the fresh plan (its first step relays buffers and is
        skipped), then re-measure and plan once more on every rank."""
        if record.trace is not None and self._refine_armed:
            self._traces.append(record.trace)
        if len(self._traces) >= self.profile_steps:
            assert self.profile is not None
            if self._auto_reverted(ex):
                return  # refine again, at the density measured faster
            keep = self._judge(ex)
            self.profile = self._measure(ex, self.profile)
            self._traces = []
            self._refining = False
            self._fallback = not keep
            self._replan(ex)
            return
        if self._refine_armed or ex.step > self._plan_step:
            self._refine_armed = True
            ex.trace_next_step()

    def _judge(self, ex) -> bool:
        """The guard: whether the plan timed in refinement may stay (rank 0's
        verdict, broadcast to every rank)."""
        if not (self.guard and self.strategy == "dp" and self._before):
            return True
        verdict = guard_verdict(self._before, _ends(self._traces))
        self.guard_result = verdict = self._broadcast(ex, verdict)
        if not verdict["kept"]:
            _log(
                ex,
                "dlgs: the plan's steps ended at %.3g ms (median of %d) against %.3g ms "
                "layer by layer (median of %d), beyond the noise margin of %.3g ms: "
                "sending layer by layer",
                verdict["plan"] * 1e3,
                len(verdict["plan_steps"]),
                verdict["layerwise"] * 1e3,
                len(verdict["layerwise_steps"]),
                verdict["margin"] * 1e3,
            )
        return bool(verdict["kept"])

    def _auto_reverted(self, ex) -> bool:
        """``density="auto"``: whether the densities chosen failed to prove
        themselves against those before. The steps under them are kept only
        if they are measured to end no later than those before, by a margin
        above the noise (:func:`guard_verdict` with ``prove``), or later by at
        most ``auto_slack`` of back-propagation when the choice sends more
        elements (density times size, summed over the layers). Otherwise the
        densities before are back in force and refinement starts again under
        their plan. The cost model predicts the communication, not what it
        costs a busy host; this measures it, once per profile. Rank 0's
        verdict, broadcast, so every rank reverts or keeps together."""
        before, self._auto_before = self._auto_before, None
        choice = self.density_choice
        if before is None or choice is None or ex.densities == before.densities(ex):
            return False
        assert self.profile is not None
        backprop = sum(layer.backward for layer in self.profile.layers)
        numel = [layer.numel for layer in ex.layers]
        sent = sum(d * n for d, n in zip(ex.densities, numel))
        higher = sent > sum(d * n for d, n in zip(before.densities(ex), numel))
        allowance = ex.config.auto_slack * backprop if higher else 0.0
        verdict = guard_verdict(before.ends, _ends(self._traces), allowance=allowance, prove=True)
        verdict = self._broadcast(
            ex, {**verdict, "density": ex.density, "before_density": before.density}
        )
        kept = bool(verdict["kept"])
        reverted = None if kept else before.density
        self.density_choice = replace(choice, measured=verdict, reverted=reverted)
        _log(ex, "dlgs at step %d: %s", ex.step, self.density_choice.describe())
        if kept:
            return False
        if higher and verdict.get("plan") is not None:
            self._fit_link(ex, verdict["plan"])
        if before.layerwise:
            self._before = before.ends  # the guard compares with them again
        ex.set_density(before.density, before.layers)
        self._replan(ex)  # clears the traces; refinement goes on under this plan
        return True

    def _fit_link(self, ex, measured: float) -> None:
        """The choice that sent more measured slower than the profile
        predicted it: the link is slower than the probes saw
        (:func:`~dlgs.core.profile.fit_link`), and the plans made from here on
        (at the densities before it) know it. From rank 0's median, so every
        rank fits the same."""
        assert self.profile is not None and self.plan is not None
        each = self.ready_densities(ex)
        part = [(g.first, g.last, g.sparse) for g in self.plan.groups]
        density = ex.density if each is None else each
        self.profile, fit = fit_link(self.profile, ex.config, density, part, measured)
        self.calibration = {**self.calibration, "link": fit["seconds_per_byte"]}
        if fit["fitted"]:
            _log(
                ex,
                "dlgs: the steps under density='auto''s choice ended at %.3g ms, predicted "
                "%.3g ms: collectives now cost at least a ring over a %.3g Mbit/s link",
                fit["measured"] * 1e3,
                fit["predicted"] * 1e3,
                8 / fit["seconds_per_byte"] / 1e6,
            )

    def _check_drift(self, ex, record: StepRecord) -> None:
        """Re-profile when the measured step drifts from what the plan was made for.

        The ratio of measured (first gradient to end of wait) to predicted end
        is calibrated over the first ``drift_window`` steps after a plan; when
        two windows in a row have medians beyond ``drift_tolerance`` from it
        (in the same direction) and the planner is within ``profile_budget``
        of the elapsed time, rank 0 votes to profile again. Every rank sends
        its vote with a 1-element asynchronous allgather at the window's end
        and reads rank 0's one step later, so the vote never blocks a step,
        and every rank profiles again at the same step.
        """
        if self._vote is not None:
            comm, handle = self._vote
            self._vote = None
            words = [int(w) for w in ex.ops.to_host(comm.synchronize(handle))]
            # Bit 1: rank 0's drift verdict; bit 2: some rank's reprofile() request.
            asked = [r for r, w in enumerate(words) if w & 2]
            if words[0] & 1 or asked:
                _log(
                    ex,
                    "dlgs: %s (at step %d): profiling again",
                    "step time drifted from the plan's calibration for two windows"
                    if words[0] & 1
                    else f"reprofile() was called on rank(s) {asked}",
                    ex.step,
                )
                self.restart()
                return
        if not self.drift_window or self.strategy == "none" or record.seconds is None:
            return
        assert self.plan is not None
        self._ratios.append(record.seconds / max(self.plan.end, 1e-9))
        if len(self._ratios) < self.drift_window:
            return
        ratio = statistics.median(self._ratios)
        self._ratios = []
        if self._baseline is None:
            self._baseline = ratio
            return
        drift = ratio / self._baseline - 1.0
        # One window beyond the tolerance is often noise (a busy host); two in
        # a row in the same direction are a drift.
        if abs(drift) <= self.drift_tolerance:
            self._drifted = 0
        elif self._drifted * drift > 0:
            self._drifted += 1 if drift > 0 else -1
        else:
            self._drifted = 1 if drift > 0 else -1
        assert self._started is not None
        elapsed = time.perf_counter() - self._started
        # The next profile is expected to cost what the last one did.
        spent = self.cost["seconds"] + self._profile_seconds
        affordable = spent <= self.profile_budget * elapsed
        vote = abs(self._drifted) >= 2 and affordable
        if abs(self._drifted) >= 2:
            logger.debug(
                "dlgs: drift %+.0f%% at step %d; profiling has cost %.3g s of %.3g s "
                "(profile_budget %g): %s",
                drift * 100,
                ex.step,
                self.cost["seconds"],
                elapsed,
                self.profile_budget,
                "voting to profile again" if vote else "re-profiling later",
            )
        flag = ex.ops.index_vector([int(vote) | (2 if self._restart_requested else 0)], ex.like)
        self._vote = (ex.comm, ex.comm.allgather_async(flag, f"{ex.prefix}.drift_vote"))
        self.cost["broadcasts"] += 1
        self.cost["bytes"] += 8

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
        return self.plan is not None and not self._refining

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
        self.profile = None
        self.plan = None
        self._traces = []
        self._ratios = []
        self._baseline = None
        self._drifted = 0
        self._refining = False
        self._auto_before = None
        self._restart_requested = False
        if self._vote is not None:  # every rank has the same vote pending
            comm, handle = self._vote
            self._vote = None
            comm.synchronize(handle)

    def request_restart(self, world_size: int) -> None:
        """``.dlgs.reprofile()``: profile again, agreed with every rank.

        Safe on one rank: the request travels in the next drift vote (a
        1-element allgather every rank makes every ``drift_window`` steps once
        a plan is in force, the first one two windows after the plan), and
        every rank restarts at the same step when any rank asked. Where no
        vote will come (one rank, ``drift_window=0``, ``merge="none"``) the
        planner restarts at once, which with several ranks is a collective:
        call it on every rank between the same two steps."""
        if world_size <= 1 or not self.drift_window or self.strategy == "none":
            self.restart()
        else:
            self._restart_requested = True

    def on_density(self, ex, density: float) -> Optional[List[Tuple[List[int], Mode]]]:
        """The density or the per-layer densities changed (the exchange is
        re-laying out for them): the plan for them from the same profile,
        which the exchange applies in this layout, or None to keep the
        current one. Every rank re-plans at the same step, from the same
        profile, so every rank returns the same plan."""
        if self.profile is not None and self.plan is not None:
            if (density, self.ready_densities(ex)) != (self._density, self._each):
                return self._replan(ex, density, defer=False)
        return None

    # -- measuring ---------------------------------------------------------------
    def _measure(self, ex, under: Optional[Profile] = None) -> Profile:
        """Rank 0's profile from the traced steps, broadcast. ``under``: the
        profile of the plan in force; its collectives and copy cost are kept
        (no probes), only backward and sparsify are measured again."""
        n_layers = len(ex.layers)
        arrive = {
            i: statistics.median(t.arrive[i] - min(t.arrive.values()) for t in self._traces)
            for i in range(n_layers)
        }
        order = sorted(range(n_layers), key=lambda i: (arrive[i], i))
        backward: Dict[int, List[float]] = {i: [] for i in range(n_layers)}
        for t in self._traces:
            prev_done = None
            for i in sorted(range(n_layers), key=lambda i: t.arrive[i]):
                backward[i].append(0.0 if prev_done is None else max(0.0, t.arrive[i] - prev_done))
                prev_done = t.done[i]
        sizes, times = [], []
        for i in range(n_layers):
            if ex.is_sparse(ex.layers[i]):
                sizes.append(ex.layers[i].numel)
                times.append(statistics.median(t.done[i] - t.arrive[i] for t in self._traces))
        probes = self._probe_sizes(ex) if under is None else []
        if probes:
            sparsify = _fit_or_flat(sizes, times)
            pack = self._probe_copy(ex)
            allgather = self._probe(ex, "allgather", probes)
            allreduce = self._probe(ex, "allreduce", probes)
        elif under is None:
            # A re-profile the saved bytes cannot pay probes for: the
            # collectives stay as last fitted, compute is measured again.
            last = self._collectives
            assert last is not None
            _log(
                ex,
                "dlgs: re-profiling without probes (they would cost more than sparse "
                "sending has saved): the collectives stay as fitted",
            )
            sparsify = _fit_or_flat(sizes, times) if times else last.sparsify
            pack, allgather, allreduce = last.pack, last.allgather, last.allreduce
        else:
            sparsify = _fit_or_flat(sizes, times) if times else under.sparsify
            pack, allgather, allreduce = under.pack, under.allgather, under.allreduce
        layers = tuple(
            LayerProfile(ex.layers[i].name, ex.layers[i].numel, statistics.median(backward[i]))
            for i in order
        )
        if under is None:
            # What the traced steps sent: the layer-wise reference for contention.
            self._layerwise_bytes = ex.wire_bytes() if self._layerwise_in_force else None
        elif self._layerwise_bytes is not None:
            gamma = contention(
                sum(layer.backward for layer in under.layers),
                self._layerwise_bytes,
                sum(layer.backward for layer in layers),
                ex.wire_bytes(),
            )
            # A new dict: the old one came from a broadcast and may be shared.
            self.calibration = {**self.calibration, "contention": gamma}
            if gamma > 0:
                _log(
                    ex,
                    "dlgs: back-propagation took %.3g ms sending %.3g MB per step layer by "
                    "layer and %.3g ms sending %.3g MB under the plan: compute loses %.3g ns "
                    "per byte sent",
                    sum(layer.backward for layer in under.layers) * 1e3,
                    self._layerwise_bytes / 1e6,
                    sum(layer.backward for layer in layers) * 1e3,
                    ex.wire_bytes() / 1e6,
                    gamma * 1e9,
                )
                # The model charges every plan's bytes to compute: the layer-wise
                # times plus that, not the times under this plan (counted twice).
                layers = under.layers
        local = self._calibrated(
            ex,
            order,
            fresh=bool(probes),
            profile=Profile(
                world_size=ex.comm.size,
                layers=layers,
                sparsify=sparsify,
                pack=pack,
                allgather=allgather,
                allreduce=allreduce,
            ),
        )
        self.cost["profiles"] += 1
        # Rank 0's profile and calibration, so that every rank plans from (and
        # reports) the same numbers.
        data, self.calibration = self._broadcast(ex, (local.to_dict(), self.calibration))
        shared = Profile.from_dict(data)
        if under is None:
            self._collectives = shared
        _log(
            ex,
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
        return shared

    def _calibrated(self, ex, order: List[int], fresh: bool, profile: Profile) -> Profile:
        """Fresh probes fitted to the traced steps (:func:`~dlgs.core.profile.calibrate`)
        when they ran layer by layer, else with the last calibration's scale;
        the contention fitted in refinement either way."""
        gamma = self.calibration.get("contention", 0.0)
        if not fresh:
            return replace(profile, contention=gamma)
        if not self._layerwise_in_force:
            return rescale(profile, self.calibration.get("scale", 1.0), gamma)
        ends = _ends(self._traces)
        if not ends:
            return profile
        modes = [ex.is_sparse(ex.layers[i]) for i in order]
        each = self.ready_densities(ex, order)
        density = ex.density if each is None else each
        out, fit = calibrate(profile, ex.config, density, modes, statistics.median(ends))
        self.calibration = {**fit, "contention": 0.0}  # a fresh layer-wise profile
        if fit["calibrated"]:
            _log(
                ex,
                "dlgs: the probes predicted the profiled steps to end at %.3g ms, they ended "
                "at %.3g ms: collective latency x%.3g above its floor",
                fit["predicted"] * 1e3,
                fit["measured"] * 1e3,
                fit["scale"],
            )
        return out

    def _probe_sizes(self, ex) -> List[int]:
        """The probe sizes (bytes) this profile can afford: the smallest rung of
        :func:`_probe_ladder`, the largest one affordable and one between them,
        where both kinds of probe at each size, ``probe_reps + 1`` times each
        (and :data:`_BATCH` at once at the smallest size), cost no more than
        (a) what sparse sending has saved against dense so far, less what
        planning has spent (so dlgs never sends more than dense
        Horovod would), and (b) ``profile_budget`` of the bytes
        :data:`_HORIZON_STEPS` steps of the layout in force send. Empty if not
        even the two smallest rungs fit. The same on every rank (the ledger
        counts layouts and broadcast results, which every rank shares)."""
        budget = min(
            self.cost["saved_bytes"] - self.cost["bytes"],
            self.profile_budget * _HORIZON_STEPS * ex.wire_bytes(),
        )
        ladder = _probe_ladder(ex)
        calls = 2 * (self.probe_reps + 1)
        for top in range(len(ladder) - 1, 0, -1):
            sizes = sorted({ladder[0], ladder[top // 2], ladder[top]})
            # Each size alone, and _BATCH of the smallest at once.
            if calls * (sum(sizes) + _BATCH * sizes[0]) <= budget:
                return sizes
        return []

    def _probe(self, ex, kind: str, probes: Sequence[int]) -> CostModel:
        ops, comm, clock = ex.ops, ex.comm, ex.clock
        like = ex.like
        sizes, times = [], []
        start = time.perf_counter()
        for nbytes in probes:
            words = nbytes // 4
            buf = ops.zeros(words, "int32" if kind == "allgather" else "float32", like)
            name = f"{ex.prefix}.probe.{kind}.{nbytes}"
            samples = []
            for _ in range(self.probe_reps + 1):  # the first one negotiates
                t0 = clock()
                if kind == "allgather":
                    comm.synchronize(comm.allgather_async(buf, name))
                else:
                    comm.synchronize(comm.allreduce_async(buf, name))
                samples.append(clock() - t0)
            self.cost["probes"] += self.probe_reps + 1
            self.cost["bytes"] += (self.probe_reps + 1) * words * 4
            self.cost["probe_bytes"] += (self.probe_reps + 1) * words * 4
            sizes.append(float(nbytes))
            # The minimum: other work on the machine only ever adds time.
            times.append(min(samples[1:]))
        model = fit_cost_model(sizes, times)
        model = replace(model, batched=self._probe_batch(ex, kind, probes[0], times[0], model))
        self.cost["probe_seconds"] += time.perf_counter() - start
        if model.beta == 0.0:
            _log(
                ex,
                "dlgs: %s times did not grow with size (%s): the plan treats bytes as free. "
                "Expected on loopback or shared memory; on a real network the machine was "
                "busy: profile again later with .dlgs.reprofile() (on the optimizer, tape or "
                "compression object; one rank is enough)",
                kind,
                ", ".join(f"{s / 1024:.0f} KiB {t * 1e3:.2f} ms" for s, t in zip(sizes, times)),
                level=logging.WARNING,
            )
        return model

    def _probe_batch(self, ex, kind: str, nbytes: int, lone: float, model: CostModel) -> float:
        """The latency of a collective that joins a batch (``CostModel.batched``):
        :data:`_BATCH` collectives of ``nbytes`` started at once take ``lone +
        (_BATCH - 1) * (batched + beta * nbytes)``, where ``lone`` is one alone.
        Clipped to ``[0, alpha]``."""
        ops, comm, clock = ex.ops, ex.comm, ex.clock
        words = nbytes // 4
        dtype = "int32" if kind == "allgather" else "float32"
        bufs = [ops.zeros(words, dtype, ex.like) for _ in range(_BATCH)]
        names = [f"{ex.prefix}.probe.{kind}.batch{j}.{nbytes}" for j in range(_BATCH)]
        issue = comm.allgather_async if kind == "allgather" else comm.allreduce_async
        samples = []
        for _ in range(self.probe_reps + 1):  # the first one negotiates
            t0 = clock()
            for handle in [issue(buf, name) for buf, name in zip(bufs, names)]:
                comm.synchronize(handle)
            samples.append(clock() - t0)
        self.cost["probes"] += (self.probe_reps + 1) * _BATCH
        self.cost["bytes"] += (self.probe_reps + 1) * _BATCH * words * 4
        self.cost["probe_bytes"] += (self.probe_reps + 1) * _BATCH * words * 4
        each = (min(samples[1:]) - lone) / (_BATCH - 1) - model.beta * nbytes
        return min(model.alpha, max(0.0, each))

    def _probe_copy(self, ex) -> CostModel:
        ops, clock = ex.ops, ex.clock
        biggest = max(layer.numel for layer in ex.layers)
        src = ops.zeros(biggest, "float32", ex.like)
        dst = ops.zeros(biggest, "float32", ex.like)
        sizes, times = [], []
        for n in sorted({max(1, biggest // 16), max(1, biggest // 4), biggest}):
            samples = []
            for _ in range(3):
                t0 = clock()
                ops.copy_(ops.narrow(dst, 0, 0, n), ops.narrow(src, 0, 0, n))
                samples.append(clock() - t0)
            sizes.append(float(n))
            times.append(min(samples))
        return _fit_or_flat(sizes, times)

    # -- planning ----------------------------------------------------------------
    def _auto_choice(self, ex) -> DensityChoice:
        """:func:`~dlgs.core.profile.choose_density` from the profile, with
        this planner's merge options: the same on every rank."""
        assert self.profile is not None
        return choose_density(
            self.profile,
            ex.config,
            self.strategy,
            bucket_elements=self.bucket_elements,
            max_group=self.max_group,
        )

    def _choose_density(self, ex, ends: Sequence[float] = ()) -> None:
        """``density="auto"``: the density from the fresh profile (rank 0's,
        so every rank chooses the same), in force with the plan made next.
        ``ends``: the measured ends of the steps profiled (at the density in
        force), which the steps under a new density are checked against."""
        assert self.profile is not None
        choice = self._auto_choice(ex)
        self.density_choice = choice
        self._auto_before = None
        layers = None
        if choice.layers:
            index = {layer.name: i for i, layer in enumerate(self.profile.layers)}
            layers = tuple(choice.layers[index[layer.name]] for layer in ex.layers)
        if (layers or (choice.density,) * len(ex.layers)) != ex.densities:
            # The layer-wise steps timed so far were at other densities: the
            # guard has nothing to compare the plan with, but the choice has.
            if self.refine:
                # Rank 0's, like the verdict: a checkpoint then saves the same
                # check on every rank.
                shared: List[float] = self._broadcast(ex, list(ends))
                if shared:
                    self._auto_before = _AutoCheck(
                        ex.density, ex.auto_layers, shared, self._before is not None
                    )
            self._before = None
            ex.set_density(choice.density, layers)
        _log(ex, "dlgs at step %d: %s", ex.step, choice.describe())

    def ready_densities(self, ex, order: Optional[Sequence[int]] = None) -> Optional[List[float]]:
        """Each layer's density in force in ready order (``order``: exchange
        indices, default the profile's), or None where every layer is at
        ``ex.density`` (``density="auto"``'s per-layer choice, else None)."""
        each = ex.densities
        if all(d == ex.density for d in each):
            return None
        if order is None:
            assert self.profile is not None
            index = {layer.name: i for i, layer in enumerate(ex.layers)}
            order = [index[layer.name] for layer in self.profile.layers]
        return [each[i] for i in order]

    def _replan(
        self, ex, density: Optional[float] = None, *, defer: bool = True
    ) -> List[Tuple[List[int], Mode]]:
        """Plan from the profile; with ``defer`` set the plan on the exchange
        (from the next step), else only return it (``on_density``)."""
        assert self.profile is not None
        profile = self.profile
        index = {layer.name: i for i, layer in enumerate(ex.layers)}
        self.order = [index[layer.name] for layer in profile.layers]
        strategy = "none" if self._fallback else self.strategy
        self._layerwise_in_force = strategy == "none"
        d = ex.density if density is None else density
        each = self.ready_densities(ex, self.order)
        plan = plan_at(
            profile,
            ex.config,
            d if each is None else each,
            strategy,
            bucket_elements=self.bucket_elements,
            max_group=self.max_group,
        )
        self.plan = plan
        self.plans_made += 1
        self._plan_step = ex.step
        self._refine_armed = False
        if self._refining:
            self._traces = []  # steps timed under the previous plan no longer count
        self._ratios, self._baseline = [], None  # calibrate drift against this plan
        self._density, self._each = d, each
        # With transport="auto" a sparse message travels as the plan chose.
        routed = ex.config.transport == "auto"
        groups = [
            ([self.order[p] for p in g.members], g.transport if routed and g.sparse else g.sparse)
            for g in plan.groups
        ]
        if defer:
            ex.set_plan(groups)
        _log(ex, "dlgs plan at step %d (density %g):\n%s", ex.step, d, plan.describe())
        return groups

    # -- checkpoints -------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        before, choice = self._auto_before, self.density_choice
        return {
            "profile": self.profile.to_dict() if self.profile is not None else None,
            "fallback": self._fallback,
            "guard_result": self.guard_result,
            # density="auto": its last choice (what describe() shows) and, in
            # the middle of its check, the steps it compares with.
            "auto_choice": None if choice is None else choice.summary(),
            "auto_check": None if before is None else before.to_state(),
        }

    def load_state_dict(self, state: Dict[str, Any], ex) -> None:
        # density="auto"'s entries, validated before anything changes.
        check = state.get("auto_check")
        if check is not None:
            check = _AutoCheck.from_state(check, len(ex.layers))
        summary = state.get("auto_choice")
        if summary is not None:
            DensityChoice.from_summary(summary, Plan(()))
        profile = state.get("profile")
        self.profile = Profile.from_dict(profile) if profile is not None else None
        if self.profile is not None and self.profile.world_size != ex.comm.size:
            logger.warning(
                "dlgs: the saved profile was measured with %d workers, this job has %d: "
                "profiling again before planning",
                self.profile.world_size,
                ex.comm.size,
            )
            self.profile = None
        if not (ex.config.auto and self.profile is not None):
            summary = check = None
        elif not self.refine:
            check = None
        self._fallback = bool(state.get("fallback", False))
        self.guard_result = state.get("guard_result")
        self._traces = []
        # A saved profile was measured (and refined) already, unless the
        # checkpoint was taken during density="auto"'s check: the choice is
        # then timed again and compared with the saved steps.
        self._refining = check is not None
        self._auto_before = check
        self.plan = None
        self.density_choice = None
        if self.profile is not None:
            self._replan(ex)
            if summary is not None:
                assert self.plan is not None
                self.density_choice = DensityChoice.from_summary(summary, self.plan)


class _AutoCheck(NamedTuple):
    """``density="auto"``'s pending check: the densities in force before the
    choice (``layers``: per layer, or None for ``density`` in every layer),
    the measured ends of the steps timed at them, and whether those steps
    were sent layer by layer (the guard compares with them then)."""

    density: float
    layers: Optional[Tuple[float, ...]]
    ends: List[float]
    layerwise: bool

    def densities(self, ex) -> Tuple[float, ...]:
        return self.layers if self.layers is not None else (self.density,) * len(ex.layers)

    def to_state(self) -> List[Any]:
        layers = None if self.layers is None else list(self.layers)
        return [self.density, layers, list(self.ends), self.layerwise]

    @classmethod
    def from_state(cls, state: Any, n_layers: int) -> "_AutoCheck":
        """Raises ValueError naming ``auto_check`` when ``state`` is malformed."""
        try:
            density, layers, ends, layerwise = state
            layers = None if layers is None else tuple(float(d) for d in layers)
            out = cls(float(density), layers, [float(e) for e in ends], bool(layerwise))
        except (TypeError, ValueError):
            raise ValueError(f"dlgs planner state auto_check is malformed: {state!r:.80}") from None
        if out.layers is not None and len(out.layers) != n_layers:
            raise ValueError(
                f"dlgs planner state auto_check holds {len(out.layers)} densities for "
                f"{n_layers} layers"
            )
        return out


def _log(ex, msg: str, *args: Any, level: int = logging.INFO) -> None:
    """Log on the process set's first rank; the others log at DEBUG (every
    rank plans the same, so one line per job is enough)."""
    logger.log(level if ex.comm.rank <= 0 else logging.DEBUG, msg, *args)


def _ends(traces: Sequence[StepTrace]) -> List[float]:
    """Seconds from each traced step's first gradient to the end of its wait."""
    return [t.end for t in traces if t.end is not None]


def _probe_ladder(ex) -> List[int]:
    """Probe sizes in bytes, multiples of 4: by factors of 4 up to the
    model's dense size (at most :data:`_PROBE_MAX`), that size last, from
    :data:`_PROBE_MIN` (or a 256th of the dense size for a model under 256
    KiB, at least 64 B, so that a small model's probes stay small)."""
    top = min(_PROBE_MAX, max(1024, ex.dense_bytes()))
    nbytes = min(_PROBE_MIN, max(64, top // 256 // 4 * 4))
    sizes = []
    while nbytes < top:
        sizes.append(nbytes)
        nbytes *= 4
    return sizes + [top]


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
    apart and the plan, which the cost model chose, stays. ``allowance``
    (seconds): how much slower the plan may be on top of the margin
    (``density="auto"`` allows a higher density ``auto_slack``). With
    ``prove`` the burden is the plan's: it is kept only if its median plus the
    margin is within ``ma + allowance``, so that a difference the noise hides
    keeps what ran before.

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


def _fit_or_flat(sizes: Sequence[float], times: Sequence[float]) -> CostModel:
    """A line through the points, or a constant when they cannot fix a slope."""
    if len(set(sizes)) >= 2:
        return fit_cost_model(sizes, times)
    return CostModel(max(0.0, statistics.median(times)) if times else 0.0, 0.0)
