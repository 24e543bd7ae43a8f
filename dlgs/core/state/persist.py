"""An exchange's checkpoints and the agreements that follow them.

:class:`SharedState` is what every rank of an exchange holds alike (the step,
the merge plan, ``density="auto"``'s choice); :class:`ExchangeCheckpoints`
saves and loads an exchange's state (its shared part and this rank's layers:
residuals, velocities, thresholds) and runs the agreement of
:mod:`dlgs.core.state.resume` at the first gradient after construction, a load,
Horovod Elastic's reset or ``resync()``. Saving and loading issue no
collective: Horovod's recipes call them on one rank.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from .._checks import check_float
from ..config import SparsityConfig
from ..exchange.messages import bank_of
from . import checkpoint
from .checkpoint import STATE_VERSION

if TYPE_CHECKING:
    from ..exchange.internals import ExchangeInternals

__all__ = ["ExchangeCheckpoints", "SharedState"]

logger = logging.getLogger(__name__)


class SharedState:
    """What every rank of an exchange holds alike (besides the step hooks'
    and the transport's own shared state)."""

    __slots__ = ("step", "plan", "auto_density", "auto_layers")

    def __init__(self) -> None:
        #: Steps finished.
        self.step = 0
        #: The merge plan in force: ``[(members, mode), ...]`` or None (layer-wise).
        self.plan: Optional[List[Tuple[List[int], Any]]] = None
        #: ``density="auto"``: the density the planner chose (None: not yet).
        self.auto_density: Optional[float] = None
        #: ... and with ``auto_layers``, each layer's, or None.
        self.auto_layers: Optional[Tuple[float, ...]] = None

    def density(self, config: SparsityConfig) -> float:
        """The density in force (``config``'s at this step, or ``"auto"``'s choice)."""
        if self.auto_density is not None:
            return self.auto_density
        return config.density_at(self.step)

    def densities(self, config: SparsityConfig, n: int) -> Tuple[float, ...]:
        """Each of ``n`` layers' density in force."""
        return self.auto_layers or (self.density(config),) * n

    def choose_density(
        self, config: SparsityConfig, density: float, layers: Optional[Sequence[float]], n: int
    ) -> bool:
        """``density="auto"``'s choice, or ``budget_split="gradient"``'s
        (every layer's, or each of ``n`` layers' own); returns whether it
        changed."""
        if not (config.auto or config.budget_split == "gradient"):
            raise RuntimeError(
                "set_density() needs density='auto' or budget_split='gradient' (the density "
                "is fixed)"
            )
        check_float("density", density, low=0, high=1, low_open=True)
        each = None if layers is None else checkpoint.layer_densities(layers, n)
        changed = (float(density), each) != (self.auto_density, self.auto_layers)
        self.auto_density, self.auto_layers = float(density), each
        return changed

    def set_plan(self, plan: Optional[Sequence[Tuple[Sequence[int], Any]]], n: int) -> None:
        """A merge plan of ``n`` layers' indices (checked), or None."""
        if plan is not None:
            flat = [i for members, _ in plan for i in members]
            if len(set(flat)) != len(flat) or any(not 0 <= i < n for i in flat):
                raise ValueError(
                    f"a plan must list distinct layer indices in [0, {n}), got {plan!r}"
                )
        self.plan = None if plan is None else [(list(m), mode) for m, mode in plan]

    def values(self) -> Tuple[Any, ...]:
        return (self.step, self.plan, self.auto_density, self.auto_layers)

    def put(self, values: Tuple[Any, ...]) -> None:
        self.step, self.plan, self.auto_density, self.auto_layers = values


class ExchangeCheckpoints:
    """Saving, loading and agreeing for one exchange (its
    :attr:`~dlgs.core.exchange.exchange.SparseExchange.checkpoints`)."""

    def __init__(self, exchange: "ExchangeInternals"):
        self.exchange = exchange

    def shared(self) -> Dict[str, Any]:
        """What every rank must hold alike (:data:`dlgs.core.state.resume.SHARED_KEYS`)."""
        ex = self.exchange
        s = ex.shared
        return {
            "step": s.step,
            "plan": s.plan,
            "hooks": {
                hook_key(h): h.state_dict() for h in ex.step_hooks if hasattr(h, "state_dict")
            },
            "auto_density": s.auto_density,
            "auto_layers": None if s.auto_layers is None else list(s.auto_layers),
            "regions": ex.transport.state(),
        }

    def save(self) -> Dict[str, Any]:
        """The exchange's ``state_dict()``: tagged with rank and world size,
        since residuals are rank-local."""
        ex = self.exchange
        return {
            "version": STATE_VERSION,
            **self.shared(),
            "rank": ex.comm.rank,
            "size": ex.comm.size,
            "config": ex.config.to_dict(),
            "layers": checkpoint.layer_states(ex.ops, ex.records),
        }

    def check(self, state: Any) -> Tuple[bool, List[str]]:
        """Validate a state without changing anything: whether it is this
        rank's own, and the options whose change restarts the thresholds."""
        ex = self.exchange
        if ex.in_step:
            raise RuntimeError("load_state_dict() in the middle of a step")
        return checkpoint.validate(
            ex.ops,
            state,
            [(layer.name, layer.numel) for layer in ex.records],
            ex.config,
            ex.comm.rank,
            ex.comm.size,
        )

    def load(self, state: Dict[str, Any], like: Any) -> None:
        """The exchange's ``load_state_dict()``: restore a state, validating
        everything before changing anything. Call it between steps; it issues
        no collective, so it is safe on one rank (Horovod's resume recipe).
        What every rank must agree
        on (the step, the merge plan, the planner's profile, ``density="auto"``'s
        choice) is agreed at the first gradient of the next step, which every
        rank reaches (:mod:`dlgs.core.state.resume`); after training began a load is
        this rank's alone (docs/design.md, 'Checkpoints and residuals').

        Errors (nothing is changed): another state version, other parameter
        names, a residual / velocity whose size is not its parameter's,
        naming the parameter and both sizes, or a residual, velocity or
        threshold that is NaN or infinite. Documented resets, each with a
        warning: another rank's or world size's residuals and velocities are
        set to zero; a changed controller, ``threshold``, density or warm-up
        restarts the thresholds.
        """
        ex = self.exchange
        own, restart = self.check(state)
        if not own:
            logger.warning(
                "dlgs state was saved by rank %s of %s, this is rank %d of %d: residuals "
                "reset to zero (save one state per rank to resume exactly)",
                state.get("rank"),
                state.get("size"),
                ex.comm.rank,
                ex.comm.size,
            )
        if restart:
            logger.warning(
                "dlgs options changed since the checkpoint (%s): thresholds start afresh "
                "(residuals are kept)",
                ", ".join(restart),
            )
        if ex.agreement.training:
            # After the ranks agreed and stepped, the others do not know of
            # this load: an agreement on this rank alone would wait for them
            # forever. This rank's own layers load now; the shared
            # part is kept for the next agreement every rank runs (after
            # Horovod Elastic's reset), else the agreed one stays.
            self._restore_layers(state["layers"], like, own, restart)
            ex.agreement.stashed = state
            if any(state.get(k) != v for k, v in self.shared().items() if k != "hooks"):
                logger.warning(
                    "dlgs: a state loaded after training began restores this rank's residuals "
                    "and thresholds; the step (%s, checkpoint %s), plan and density stay as "
                    "the ranks agreed (docs/design.md, 'Checkpoints and residuals')",
                    ex.step,
                    state.get("step"),
                )
            # No host step is asked for: the ranks take host or device steps
            # together (TensorFlow's graph budget), and only this rank knows
            # of the load; a traced step's bank takes the loaded thresholds.
            ex.device.push()
            return
        self.apply_shared(state)
        ex.relayout(like)
        self._restore_layers(state["layers"], like, own, restart)
        ex.request_host_step()  # the agreement, and buffers a traced step does not hold
        # Any load counts, even of the state in force: a rank that loads must
        # agree with the other loading ranks (a stale file is an error), never
        # be rolled back or forward silently by them.
        ex.agreement.due(loaded=True)

    def agree_again(self, holds_state: bool, bounded: bool = False) -> None:
        """Every rank agrees at the next gradient (then lays out anew): a
        state loaded since the last agreement takes part as a load, with its
        shared part; ``holds_state``: so does what this rank holds without one;
        ``bounded``: ``resync()`` asked (see
        :meth:`~dlgs.core.state.resume.Agreement.due`)."""
        stashed = self.exchange.agreement.due(holds_state=holds_state, bounded=bounded)
        if stashed is not None:
            self.apply_shared(stashed)
        self.exchange.relayout_next()

    def before_step(self) -> None:
        """At a step's first gradient: the agreement where one is due (and a
        new one where Horovod Elastic reset the job to another world)."""
        agreement = self.exchange.agreement
        changed = agreement.world_changed()
        if changed is not None:
            # Every rank of the new world sees the change (or is new, its
            # agreement pending) and agrees, then lays out anew for it.
            logger.info("dlgs: the job is now rank %d of %d (was %d of %d)", *changed)
            # What this rank holds stands as a loaded state would: a worker
            # that joined (fresh, nothing loaded) takes it.
            self.agree_again(holds_state=True)
        if agreement.pending:
            part = agreement.run(self.shared)
            if part is not None:
                self.apply_shared(part)

    def apply_shared(self, state: Dict[str, Any]) -> None:
        """Put a state's shared part (:func:`dlgs.core.state.resume.shared`) in
        force: step, plan, ``density="auto"``'s choice and the step hooks'
        states (the planner re-plans from its profile). Laid out anew at the
        next gradient; on an error nothing is changed."""
        ex = self.exchange
        config, s = ex.config, ex.shared
        auto_layers = state.get("auto_layers")
        if auto_layers is not None:
            auto_layers = checkpoint.layer_densities(auto_layers, len(ex.records))
        plan = state.get("plan")
        old = s.values()
        s.step = state["step"]
        s.plan = [(list(m), mode) for m, mode in plan] if plan is not None else None
        # The density the planner chose stays in force (before the planner
        # re-plans from its saved profile at it); with auto_layers turned off
        # since, one density for every layer. budget_split="gradient"'s split
        # stays in force the same way.
        split = config.budget_split == "gradient"
        s.auto_density = state.get("auto_density") if config.auto or split else None
        s.auto_layers = auto_layers if config.auto and config.auto_layers or split else None
        try:
            ex.transport.load_state(state.get("regions"))
            for hook in ex.step_hooks:
                if hasattr(hook, "load_state_dict"):
                    hook.load_state_dict((state.get("hooks") or {}).get(hook_key(hook), {}), ex)
        except Exception:
            s.put(old)
            ex.transport.load_state(None)
            raise
        ex.relayout_next()

    def _restore_layers(self, saved: Dict[str, Any], like: Any, own: bool, restart: List[str]):
        ex = self.exchange
        laid = ex.messages
        checkpoint.restore_layers(
            ex.ops,
            ex.controller,
            ex.records,
            [laid is not None and laid.sparse(la) for la in ex.records],
            ex.densities,
            saved,
            like,
            own=own,
            restart=bool(restart),
        )
        if laid is not None:
            laid.bank = bank_of(ex.ops, ex.controller, ex.records, laid.sparse_members)


def hook_key(hook: Any) -> str:
    """The key of a step hook's state in the exchange's shared state."""
    return getattr(hook, "state_key", type(hook).__name__)
