"""Reporting non-finite steps: rate-limited, naming the layers, and a
warning when every step of a long run was non-finite."""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, List

from .step import verdict

__all__ = ["NONFINITE_RUN", "NonFiniteLog"]

logger = logging.getLogger(__name__)

#: Non-finite steps are logged at most once per this many seconds.
LOG_INTERVAL = 30.0
#: A run of this many non-finite steps in a row is warned about (and again at
#: every doubling; twice as many with a loss scaler): a scaler halving from
#: 65536 is finite long before.
NONFINITE_RUN = 16


class NonFiniteLog:
    """Counts an exchange's non-finite steps and reports them.

    Args:
        scaled: whether a loss scaler drives the exchange (its overflow steps
            are how it calibrates: logged at INFO, and a run must be twice as
            long to be warned about).
    """

    def __init__(self, scaled: Callable[[], bool]):
        self._scaled = scaled
        #: Steps whose gradients were non-finite somewhere.
        self.steps = 0
        #: Consecutive non-finite steps up to the last one.
        self.run = 0
        self._logged = -math.inf  # time of the last report
        self._unlogged = 0
        #: The last step was finite on every rank.
        self.last = True
        #: A step with nothing to undo: its dense outputs, checked only when
        #: asked (``last_step_finite``).
        self.lazy: List[Any] = []

    def last_finite(self, ops: Any) -> bool:
        """Whether the last step was finite on every rank; a step with nothing
        to undo has its dense outputs checked now (one host read), and is
        counted, not reported, when one is not."""
        if self.lazy:
            lazy, self.lazy = self.lazy, []
            if not verdict(ops, None, lazy, on_device=False)[0]:
                self.steps += 1
                self.last = False
        return self.last

    def finite(self) -> None:
        """A finite step: the run ends."""
        self.run, self.last, self.lazy = 0, True, []

    def device_steps(self, step: int, steps: int, nonfinite: int, last_finite: bool) -> None:
        """``steps`` steps up to ``step`` ran on the device alone, ``nonfinite``
        of them non-finite (which layers is not known there): counted, and
        reported like one non-finite step when there were any."""
        if nonfinite:
            self.steps += nonfinite - 1
            # All non-finite: the run goes on; else it ended somewhere among them.
            self.run = self.run + nonfinite - 1 if nonfinite == steps else 0
            self.nonfinite(step, lambda: [f"{nonfinite} of the last {steps} steps"])
        if last_finite:
            self.run = 0
        self.last, self.lazy = bool(last_finite), []

    def nonfinite(self, step: int, names: Callable[[], List[str]]) -> None:
        """A non-finite step: count it, and report it (naming the layers that
        ``names()`` finds, a host read only a reported step pays) at most once
        per :data:`LOG_INTERVAL`, or at a long run (:data:`NONFINITE_RUN`,
        then every doubling)."""
        self.steps += 1
        self.run += 1
        self._unlogged += 1
        self.last, self.lazy = False, []
        run, scaled = self.run, self._scaled()
        # A scaler that starts high overflows for a while by design (from 2^30,
        # about 15 halvings): twice the run before it is called one.
        first = NONFINITE_RUN * (2 if scaled else 1)
        long_run = run >= first and run & (run - 1) == 0  # 16 (32), 32 (64), ...
        now = time.monotonic()
        if now - self._logged < LOG_INTERVAL and not long_run:
            return
        found = names()
        shown = ", ".join(repr(n) for n in found[:8]) + (" ..." if len(found) > 8 else "")
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
                step,
                run,
                shown,
            )
        else:
            # With a loss scaler, overflow is how it calibrates: not worth a warning.
            level = logging.INFO if scaled else logging.WARNING
            skip = (
                "the loss scaler skips the step"
                if scaled
                else "without a loss scaler, skip the update when .dlgs.last_step_finite "
                "is False (opt.synchronize(), then step only if finite)"
            )
            logger.log(
                level,
                "step %d: non-finite gradient (NaN or Inf) on at least one rank in %s; "
                "%d such step(s) since the last report, %d in all. Residuals and "
                "thresholds are left as before the step; the optimizer receives NaN "
                "for these layers on every rank (%s)",
                step,
                shown,
                self._unlogged,
                self.steps,
                skip,
            )
        self._logged = now
        self._unlogged = 0
