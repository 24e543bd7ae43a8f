"""The per-job engine: what every adapter does around one exchange, once.

An adapter (``dlgs.torch``, ``dlgs.tensorflow``) knows its framework's
parameters, gradient hooks and Horovod module; everything else about running
dlgs in a job lives here:

* building the :class:`~dlgs.core.exchange.exchange.SparseExchange` over the layers in
  back-propagation order (the reverse of registration order),
* the rank-agreement check over a fingerprint of every option that shapes the
  exchange (:func:`~dlgs.core.state.consistency.agreed_options`, so an option added
  later is checked without anyone remembering to),
* attaching the merge planner as the exchange's step hook,
* the logging cadence (``log_every``),
* checkpoint state, including a state loaded before the exchange exists
  (TensorFlow restores checkpoints before the first step builds it),
* the one set of accessors every adapter exposes as ``.dlgs``
  (:class:`Engine`'s public members).

The engine holds no framework object except what the adapter hands in (the
array ops, the collectives, a ``like`` tensor for the device).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .backend import ArrayOps
from .config import SparsityConfig
from .exchange.exchange import Collectives, SparseExchange
from .exchange.protocol import Exchange
from .exchange.views import log_stats
from .planning.budget import SPLIT_AFTER
from .state.checkpoint import check_finite_state
from .state.consistency import agreed_options, check_ranks_agree, signature
from .transport.hierarchical import HierarchicalExchange
from .transport.topology import TopologyProbe, probe_topology

__all__ = ["Engine", "check_unique_names"]


def check_unique_names(kind: str, names: Sequence[str]) -> None:
    """dlgs keys per-layer state by name: ``kind`` (``"parameter"`` or
    ``"variable"``) names must be unique."""
    dups = sorted(n for n, count in Counter(names).items() if count > 1)
    if dups:
        raise ValueError(
            f"{kind} names must be unique to key dlgs' per-{kind} state, duplicates: "
            f"{dups[:5]} (give them distinct names)"
        )


class Engine:
    """One job's sparse exchange and everything around it.

    Adapters create it with their options, call :meth:`build` once with the
    layers (which checks that every rank agrees), then drive
    :attr:`exchange` per step and call :meth:`step_done` after each. Users
    reach it as ``opt.dlgs`` / ``tape.dlgs`` / ``compression.dlgs``.

    Args:
        ops: the framework's array operations.
        comm: the collectives on Horovod's process set; ``included`` False
            means this rank is outside the set and takes no part.
        config: the sparsification options.
        planner: the merge planner (an :class:`~dlgs.core.planning.online.OnlinePlanner`),
            attached as the exchange's step hook; None for none.
        average: average (``op=Average``) or sum over ranks.
        prefix: prefix of the Horovod tensor names (distinct per engine).
        dense_external: the caller allreduces dense layers itself (the
            ``compression=`` form).
        extra_options: more options every rank must agree on (e.g.
            ``backward_passes_per_step``).
        log_every: log per-layer statistics every this many steps (0: never).
        loss_scale: the loss scaler's reader (see :class:`SparseExchange`).
        logger: where statistics are logged (the adapter's logger).
        topology: None for the flat exchange; for the two-level one
            (:class:`~dlgs.core.transport.hierarchical.HierarchicalExchange`), a function
            returning ``(node, cross)`` collectives, called by :meth:`build`
            after every rank was checked to agree (making them may be a
            collective, such as adding Horovod process sets).
        choose_topology: with ``topology``, time both exchanges' collectives
            for this model first and keep the faster
            (:func:`~dlgs.core.transport.topology.probe_topology`; ``topology="auto"``).
        elastic: under Horovod Elastic, where no collective may run outside
            the function ``hvd.elastic.run`` wraps (a worker that joins builds
            its optimizer while the others synchronise): the ranks' layers and
            options are checked at every agreement (the first gradient, and
            the first after every reset) instead of in :meth:`build`. The
            two-level exchange is refused there: its node and cross-node
            process sets belong to the world before a reset.
    """

    def __init__(
        self,
        ops: ArrayOps,
        comm: Collectives,
        config: SparsityConfig,
        planner: Any = None,
        *,
        average: bool,
        prefix: str,
        dense_external: bool = False,
        extra_options: Optional[Dict[str, Any]] = None,
        log_every: int = 0,
        loss_scale: Optional[Callable[[], Any]] = None,
        logger: Optional[logging.Logger] = None,
        topology: Optional[Callable[[], Tuple[Any, Any]]] = None,
        choose_topology: bool = False,
        elastic: bool = False,
    ):
        if elastic and topology is not None:
            raise ValueError(
                "topology='hierarchical' does not survive Horovod Elastic's resets (its process "
                "sets belong to the world before the reset): use topology='flat' under "
                "hvd.elastic.run"
            )
        self.ops = ops
        self.elastic = elastic
        self._topology = topology
        self._choose_topology = choose_topology
        #: ``topology="auto"``'s measurement (:class:`~dlgs.core.transport.topology.TopologyProbe`).
        self.topology_probe: Optional[TopologyProbe] = None
        self.comm = comm
        self.config = config
        self._planner = planner
        self.average = average
        self.prefix = prefix
        self.dense_external = dense_external
        self.extra_options = dict(extra_options or {})
        self.extra_options["loss_scaler"] = loss_scale is not None
        self.log_every = log_every
        self._loss_scale = loss_scale
        self.logger = logger or logging.getLogger(__name__)
        self._exchange: Optional[Exchange] = None
        #: Exchange layer index -> position in the list given to :meth:`build`.
        self.order: List[int] = []
        #: Layer names in the order given to :meth:`build` (None before).
        self.names: Optional[List[str]] = None
        self._like: Any = None
        self._pending_state: Optional[Dict[str, Any]] = None

    # -- construction -------------------------------------------------------------
    def options(self) -> Dict[str, Any]:
        """Every option every rank must agree on (what :meth:`build` checks)."""
        return agreed_options(
            self.config,
            self._planner,
            self.comm,
            average=self.average,
            prefix=self.prefix,
            dense_external=self.dense_external,
            **self.extra_options,
        )

    def build(
        self,
        layers: Sequence[Tuple[str, Sequence[int], str]],
        *,
        like: Any = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> Exchange:
        """Build the exchange over ``layers`` (``(name, shape, dtype)`` in
        registration order; exchanged in reverse, the order back-propagation
        produces gradients), after checking that every rank of the process set
        has the same layers and options (:class:`~dlgs.RankMismatchError`
        otherwise, on every rank). ``like``: a tensor on the exchange's device
        (for states loaded before the first step). Applies a state loaded
        before this call."""
        if self._exchange is not None:
            raise RuntimeError("this dlgs engine is built already")
        names = [str(n) for n, _, _ in layers]
        order = list(reversed(range(len(layers))))
        ordered = [layers[i] for i in order]
        sig = signature(ordered, self.options())

        def check() -> None:
            check_ranks_agree(
                sig,
                # A fixed name: one derived from an option (prefix) could itself differ.
                lambda sig: self.comm.allgather_object(sig, "dlgs.signature"),
                size=self.comm.size,
            )

        if self.comm.included and not self.elastic:  # a rank outside the set takes no part
            check()
        numel = [(str(n), math.prod(int(s) for s in shape)) for n, shape, _ in ordered]
        exchange: Any
        two_levels = None
        if self._topology is not None:
            node, cross = self._topology()
            two_levels = node, cross
            if self._choose_topology and like is not None:
                self.topology_probe = probe_topology(
                    self.ops,
                    self.comm,
                    node,
                    cross,
                    [n for _, n in numel],
                    self.config,
                    like,
                    prefix=self.prefix,
                )
                if self.topology_probe.choice == "flat":
                    two_levels = None
        if two_levels is not None:
            node, cross = two_levels
            exchange = HierarchicalExchange(
                self.ops,
                node,
                cross,
                self.config,
                numel,
                world=self.comm,
                prefix=self.prefix,
                clock=clock,
                loss_scale=self._loss_scale,
            )
        else:
            exchange = SparseExchange(
                self.ops,
                self.comm,
                self.config,
                numel,
                average=self.average,
                prefix=self.prefix,
                dense_external=self.dense_external,
                clock=clock,
                loss_scale=self._loss_scale,
            )
        if self.elastic:
            exchange.agreement.elastic_check = check
        if self._planner is not None:
            exchange.step_hooks.append(self._planner)
        self._exchange, self.order, self.names, self._like = exchange, order, names, like
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
        return exchange

    @property
    def built(self) -> bool:
        return self._exchange is not None

    @property
    def loss_scale(self) -> Optional[Callable[[], Any]]:
        return self._loss_scale

    @loss_scale.setter
    def loss_scale(self, reader: Optional[Callable[[], Any]]) -> None:
        """Read the loss scale with ``reader`` from the next step on (a TF tape
        re-created every step hands in its scaler every time)."""
        self._loss_scale = reader
        if self._exchange is not None:
            self._exchange.loss_scale = reader

    # -- per step ---------------------------------------------------------------------
    def complete(
        self, grad_of: Optional[Callable[[int], Any]], finish: bool = True
    ) -> Dict[int, Any]:
        """The end of a step, the same for every door: each layer not handed
        in yet gets ``grad_of(i)`` (its gradient, flat; None: every layer
        must have been handed in already), then the step's
        collectives complete. Returns each layer's reduced gradient (flat) for
        the door's copy-back. Any error drops the step, so that the next one
        (or Horovod Elastic's restore) starts clean, and is raised again.
        ``finish=False``: the caller ends the step itself (form (a), whose
        dense layers Horovod reduces; a step traced onto the device)."""
        ex = self._exchange
        assert ex is not None, "complete() before the exchange was built"
        try:
            if grad_of is not None:
                for i in ex.pending():
                    ex.submit(i, grad_of(i))
            return ex.wait(finish=finish)
        except BaseException:
            ex.abort_step()
            raise

    # -- steps on the device alone (TensorFlow's graph) ------------------------------
    def planner_settled(self) -> bool:
        """Whether the planner needs no step on the host: settled (``run``) or
        merging nothing, and not recording every step. (Drift votes, which
        need every step's time, pause on device steps.)"""
        planner = self._planner
        if planner is None:
            return True
        if planner.record:
            return False
        return planner.strategy == "none" or planner.phase == "run"

    def device_reason(self, now: bool = True) -> Optional[str]:
        """Why the next step cannot run with device operations alone (the
        exchange's :meth:`~dlgs.core.exchange.device.DeviceSteps.ready`, then
        the planner), or None. ``now=False``: why no such step can be traced
        for the layout in force."""
        device = getattr(self._exchange, "device", None)
        if device is None:
            return "the two-level exchange runs on the host"
        why = device.ready(now)
        if why is None and now and not self.planner_settled():
            return "the merge planner is profiling or planning"
        return why

    def device_budget(self) -> int:
        """How many steps may run on the device from here before the host
        needs one: up to the next warm-up stage, the step before the next log
        line, the next threshold anchor and the planner's next drift vote;
        -1: no limit."""
        ex = self._exchange
        assert ex is not None
        step, config, limits = ex.step, ex.config, []
        if config.warmup_steps and not config.auto:
            if step < len(config.warmup) * config.warmup_steps:
                limits.append((step // config.warmup_steps + 1) * config.warmup_steps - step)
        if self.log_every:
            # The step that brings ex.step to a multiple of log_every logs: on the host.
            limits.append((step // self.log_every + 1) * self.log_every - step - 1)
        anchors = ex.device.budget()
        if anchors >= 0:
            limits.append(anchors)
        for hook in ex.step_hooks:  # a hook's host step (the budget's split)
            until = getattr(hook, "host_steps_until", None)
            wait = until(ex) if until is not None else -1
            if wait >= 0:
                limits.append(wait)
        planner = self._planner
        window = planner.drift_window if planner is not None else 0
        if window and planner.strategy != "none" and planner.phase == "run":
            # The drift vote (which carries one-rank reprofile() requests)
            # needs a host step at the end of every drift_window steps.
            limits.append(window - 1 - step % window)
        return min(limits) if limits else -1

    def step_done(self) -> None:
        """Called by the adapter after each exchanged step: logs every
        ``log_every`` steps (each log reads device values once)."""
        ex = self._exchange
        if self.log_every and ex is not None and ex.step % self.log_every == 0:
            log_stats(ex, self.logger)

    # -- what users reach as .dlgs ----------------------------------------------------
    def _settle(self) -> None:
        """Before anything is read: an adapter whose steps may run without the
        host (TensorFlow's traced steps) counts them into the exchange here."""

    @property
    def exchange(self) -> Optional[Exchange]:
        """The core :class:`~dlgs.core.exchange.exchange.SparseExchange` (per-layer plans
        and state); None before the first step where the adapter builds lazily."""
        self._settle()
        return self._exchange

    @property
    def planner(self) -> Any:
        """The :class:`~dlgs.core.planning.online.OnlinePlanner`: its ``plan`` is the
        merge plan in force with its predicted times (None before the first),
        its ``profile`` the measured one (``profile.save(path)``)."""
        return self._planner

    def resync(self) -> None:
        """After every rank loaded a state while training (a roll-back of the
        whole job), agree on the loaded step, plan and density at the next
        gradient, as at a resume: equal states take effect, states of
        different steps (a stale file on one rank) raise
        :class:`~dlgs.RankMismatchError` on every rank. A collective at the
        next gradient: call it on **every** rank between the same two steps
        (a load alone keeps the agreed step and plan, docs/design.md). A rank
        that calls it alone waits at most
        :data:`~dlgs.core.state.resume.RESYNC_WAIT_SECONDS` for the others
        there, then raises :class:`~dlgs.RankMismatchError`; its exit ends
        the others (they are in their step, waiting for it)."""
        self._settle()
        if self._exchange is not None:
            self._exchange.resync()

    def reprofile(self) -> None:
        """Profile again and re-plan (the plan in force stays until then).

        Safe on one rank: the request reaches every rank with the planner's
        next drift vote (every ``drift_window`` steps once a plan is in force;
        the first two windows after a plan), and every rank profiles again
        from the same step. With ``drift_window=0`` or ``merge="none"`` it
        takes effect at once and is then a collective: call it on every rank
        between the same two steps
        (:meth:`~dlgs.core.planning.online.OnlinePlanner.request_restart`);
        called on one rank alone it raises
        :class:`~dlgs.RankMismatchError` there at the next gradient, after
        :data:`~dlgs.core.state.resume.RESYNC_WAIT_SECONDS`, as
        :meth:`resync` does."""
        if self._planner is not None and self._planner.request_restart(self.comm.size):
            if self._exchange is None:
                return
            if self.comm.size > 1:
                # Every rank restarted, or this one alone by mistake: the ranks
                # meet at the next gradient (a bounded wait, the same as
                # resync()'s), so a one-rank call is a named error, not a hang.
                self._exchange.resync()
            else:
                self._exchange.request_host_step()  # it profiles at once

    def describe(self) -> str:
        """What dlgs is doing now, in every state (before the first step,
        profiling, layer by layer, planned, re-profiling): the layout in force,
        message by message with layer names, and the plan with its predicted
        timeline when there is one. Reads no device value."""
        self._settle()
        ex = self._exchange
        if ex is None:
            return "dlgs: no step yet (the exchange is built at the first gradient)"
        sparse = sum(1 for g in ex.groups if g.sparse)
        each = ex.densities
        density = f"density {ex.density:g}" + (
            f" (per layer {min(each):g} to {max(each):g})" if ex.auto_layers is not None else ""
        )
        budget = ex.config.budget
        if budget is not None:
            of = f"{budget} bytes" if isinstance(budget, int) else f"{budget:g} of the dense bytes"
            density = f"byte budget {of} per step: {density} chosen"
            if ex.config.budget_split == "gradient":
                density += (
                    ", split between layers by their residuals"
                    if ex.auto_layers is not None
                    else f", split between layers by their residuals after step {SPLIT_AFTER}"
                )
        if ex.config.value_dtype.value != "float32":
            density += f", values in {ex.config.value_dtype.value}"
        if ex.config.dense_dtype.value != "float32":
            density += f", dense messages in {ex.config.dense_dtype.value}"
        lines = [] if self.topology_probe is None else [self.topology_probe.describe()]
        lines += [
            f"dlgs at step {ex.step}: {density}, {len(ex.layers)} layers in "
            f"{len(ex.groups)} messages ({sparse} sparse), {ex.wire_bytes()} bytes per step "
            "from this rank"
            if ex.groups
            else f"dlgs at step {ex.step}: layout made at the next gradient"
        ]
        p = self._planner
        if p is None or p.strategy == "none":
            lines.append("merge='none': every layer is its own message")
        elif p.plan is None:
            what = "re-profiling" if p.plans_made else "profiling"
            lines.append(
                f"merge={p.strategy!r}: {what} ({p.profile_steps} timed steps), then planning; "
                "the layout below stays in force until then"
            )
        else:
            if p.density_choice is not None:
                lines.append(p.density_choice.describe())
            guard = p.guard_result
            if guard is not None and guard.get("plan") is not None:
                lines.append(
                    f"guard: steps ended at {guard['plan'] * 1e3:.3f} ms under the plan, "
                    f"{guard['layerwise'] * 1e3:.3f} ms layer by layer: "
                    + ("plan kept" if guard["kept"] else "sending layer by layer")
                    + (
                        " (the plan sends more bytes, so it had to be faster beyond the "
                        f"noise, {guard['margin'] * 1e3:.3f} ms)"
                        if guard.get("more_bytes")
                        else ""
                    )
                )
            lines.append(p.plan.describe())
            if p.profile is not None:
                lines.append(_costs_line(p.profile, p.collectives_from))
        lines.append("layout in force (backward order):")
        for n, g in enumerate(ex.groups):
            names = [ex.layers[i].name for i in g.members]
            label = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"
            mode = "sparse" if g.sparse else "dense"
            lines.append(f"{n:>4} {mode:>6} {ex.message_bytes(g):>12} B  {label}")
        return "\n".join(lines)

    @property
    def last_step_finite(self) -> bool:
        """Whether the last step's gradients were finite on every rank (the same
        on every rank; see :attr:`dlgs.core.SparseExchange.last_step_finite`).
        True before the first step."""
        self._settle()
        return self._exchange is None or self._exchange.last_step_finite

    @property
    def nonfinite_steps(self) -> int:
        """Steps whose gradients were non-finite somewhere (dlgs' state was left
        as before each)."""
        self._settle()
        return 0 if self._exchange is None else self._exchange.nonfinite_steps

    def stats(self) -> List[Dict[str, Any]]:
        """Per-layer statistics of the last step: selected count, achieved
        density, threshold, bytes sent. Reads device values; call it every few
        steps, not every step."""
        self._settle()
        if self._exchange is None:
            return []
        return log_stats(self._exchange, self.logger, logging.DEBUG)

    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals, velocities, controller states, step and plan
        (docs/design.md, "Checkpoints and residuals"); save one per rank."""
        self._settle()
        if self._exchange is None:
            return dict(self._pending_state or {})
        return self._exchange.state_dict()

    def check_state_dict(self, state: Any) -> None:
        """Validate ``state`` without changing anything (what
        :meth:`load_state_dict` checks first); no-op before the build."""
        if self._exchange is not None and state:
            self._exchange.check_state_dict(state)

    def split_checkpoint(
        self, state: Dict[str, Any]
    ) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
        """An optimizer checkpoint that carries this engine's state under
        ``"dlgs"``: the rest, and that entry validated (:meth:`check_state_dict`;
        None when absent). Validate first, load the optimizer's part, then
        :meth:`load_state_dict` the entry: a bad entry changes nothing."""
        rest = dict(state)
        mine = rest.pop("dlgs", None)
        if mine is not None:
            self.check_state_dict(mine)
        return rest, mine

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`. No collective, so safe on one rank
        (Horovod's resume recipe); the ranks agree on the step, plan and
        profile at the next gradient (see :meth:`SparseExchange.load_state_dict`).
        Before the build, kept and applied by :meth:`build`."""
        self._settle()  # steps that ran without the host count before the load
        if not state:
            return
        if self._exchange is None:
            check_finite_state(self.ops, state)  # here, not at a step the others are in
            self._pending_state = state
            return
        self._exchange.load_state_dict(state, like=self._like)


#: How ``describe()`` says what priced a collective's bytes (``Profile.priced_by``).
_PRICED_BY = {
    "probes": "",
    "bound": " (bytes not seen by the probes, as large as profile_budget allowed: the most "
    "their samples allow; link_bandwidth= makes it the named link's, a larger profile_budget "
    "lets the probes grow)",
    "link_bandwidth": " (bytes not seen by the probes: the link_bandwidth given)",
    "steps": " (raised to what the steps under density='auto''s choice took)",
}


def _costs_line(profile: Any, source: Optional[str] = None) -> str:
    """Which collective cost model the plan was priced with: the job's own
    probes, fitted, or the ones a calibration_file kept (never a preset's
    model: docs/netmodel.md), and what priced the bytes where the probes could
    not see them."""
    ag, ar = profile.allgather, profile.allreduce
    by_ag, by_ar = (_PRICED_BY[p] for p in profile.priced_by)
    where = "this job's probes" if source is None else f"the calibration_file {source}"
    return (
        f"costs: fitted from {where} at {profile.world_size} ranks: allgather "
        f"{ag.alpha * 1e6:.1f} us + {ag.beta * 1e9:.3f} ns/B{by_ag}, allreduce "
        f"{ar.alpha * 1e6:.1f} us + {ar.beta * 1e9:.3f} ns/B{by_ar}"
    )
