"""When a traced training step may run the exchange on the device.

An adapter that traces the exchange into a graph (TensorFlow's
``tf.function``) keeps two branches: the device branch, traced for one
layout, and the host branch, which runs the eager step. It asks
:class:`DeviceSchedule` two things and derives nothing itself:

* at trace time, :meth:`DeviceSchedule.trace`: whether the device branch
  can be traced for the layout in force, and which layout version it is for;
* after every host step, :meth:`DeviceSchedule.after_host_step`: how many
  steps may run on the device before the host needs one, agreed over the
  process set (every rank must take the same branch), the layout version
  those steps are for, and whether the step must be traced again now (the
  planner settled a layout the graph was not traced for). The retrace is the
  adapter's :attr:`DeviceSchedule.on_layout` callback, set explicitly.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple, Optional

__all__ = ["DeviceSchedule", "HostDecision", "UNLIMITED"]

logger = logging.getLogger(__name__)

#: A budget of -1 (no limit), as the min-allreduce of budgets sees it.
UNLIMITED = 1 << 62


class HostDecision(NamedTuple):
    """What the host sets after a host step for the traced branches to read."""

    #: The layout version the device branch may run for (-1: none).
    version: int
    #: Steps the device may run from here (-1: no limit, 0: the host runs next).
    budget: int
    #: Whether the device branch can be traced for the layout in force.
    traceable: bool


class DeviceSchedule:
    """One engine's device steps, as seen by the host (see the module).

    Args:
        engine: the :class:`dlgs.core.engine.Engine` whose exchange is traced.

    Attributes:
        on_layout: the adapter's callback that makes the training step be
            traced again (None: a plain ``tf.function``, which keeps the host
            branch after a layout change; logged once per layout).
        traced_version: the layout version of the last trace (-1: none).
    """

    def __init__(self, engine: Any):
        self._engine = engine
        self.on_layout: Optional[Callable[[], None]] = None
        self.traced_version = -1
        self._asked = -1  # the layout version a retrace was asked for
        self._stale_logged = -1
        # Traced at least once: from then on every host step agrees on the
        # budget (every rank traces the same function at the same step, so
        # every rank issues that collective alike).
        self._in_graph = False

    def trace(self) -> Optional[int]:
        """At trace time: the layout version the device branch is traced for,
        or None when it cannot be (the step stays on the host, logged)."""
        self._in_graph = True
        why = self._engine.device_reason(now=False)
        if why is not None:
            logger.debug("dlgs: the exchange stays on the host in this trace: %s", why)
            return None
        ex = self._engine.exchange
        self.traced_version = ex.layout_version
        logger.info(
            "dlgs: the exchange is traced into the graph (layout %d, %d messages)",
            self.traced_version,
            len(ex.groups),
        )
        return self.traced_version

    def after_host_step(self) -> Optional[HostDecision]:
        """After a host step: the agreed budget and the version it is for
        (one 1-element min-allreduce on the process set); the retrace, through
        :attr:`on_layout`, once the planner has settled a layout the step was
        not traced for (not for each layout it tries while profiling). None
        before the first trace and where no step can run on the device."""
        engine = self._engine
        ex = engine.exchange
        if not self._in_graph or ex.device is None:
            return None
        ex.device.prepare()
        traceable = engine.device_reason(now=False) is None
        version = ex.layout_version if traceable else -1
        # A rank whose next step needs the host, or whose graph is not for its
        # layout, counts as 0; anchors or log_every may differ between ranks
        # (e.g. after a resume in which one rank loaded).
        ready = engine.device_reason() is None and self.traced_version == ex.layout_version
        budget = self._agree(engine.device_budget() if ready else 0)
        if traceable and engine.planner_settled() and self._asked != version:
            if self.traced_version != version:
                self._asked = version
                self._retrace(ex.step, version)
        return HostDecision(version, budget, traceable)

    def _retrace(self, step: int, version: int) -> None:
        if self.on_layout is not None:
            logger.info(
                "dlgs at step %d: the layout is settled (version %d): the training step "
                "is traced again to run the exchange in the graph",
                step,
                version,
            )
            self.on_layout()
        elif self._stale_logged != version:
            self._stale_logged = version
            logger.info(
                "dlgs at step %d: the layout changed; this tf.function keeps exchanging on "
                "the host until it is traced again (trace the step with "
                "dlgs.tensorflow.function to do that by itself)",
                step,
            )

    def _agree(self, budget: int) -> int:
        """The smallest ``budget`` over the process set (-1: none)."""
        comm = self._engine.comm
        if comm.size <= 1:
            return budget
        local = UNLIMITED if budget < 0 else budget
        prefix = self._engine.exchange.prefix
        (agreed,) = comm.allreduce_min([local], f"{prefix}.graph_budget")
        return -1 if agreed >= UNLIMITED else agreed
