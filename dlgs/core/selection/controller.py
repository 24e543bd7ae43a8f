"""Per-layer threshold controllers.

A controller turns a layer's accumulated gradient magnitudes ``|a|`` into a
threshold ``theta`` so that about ``k`` elements satisfy ``|a| >= theta``.
Computing ``theta`` never synchronises the host.

The dynamic controller is the method's core idea: no sort on the hot path. It
keeps ``theta`` from the previous step and corrects it from how many elements
that step selected, in log space::

    theta <- theta * exp(g * (log((c + 1) / (k + 1)) / e + drift))

where ``e = -dlog(count)/dlog(theta)`` is the tail's elasticity, estimated by a
smoothed secant over successive steps and started at ``ln(1/density)`` (exact
for an exponential tail, which is what SIDCo fits to gradients), ``drift`` an
integral term on the linear error ``c/k - 1``, and ``g`` in ``[1/16, 1]`` a loop
gain each layer learns (halved where the count crossed the target since the
last step, up by a quarter where it stayed on one side). Every
``anchor_every`` steps ``theta`` is reset to the exact top-k threshold, as
Ok-Topk does every 32 iterations, which bounds drift.

What the dynamic controller learns lives on the host: an exchange reads every
layer's count once per step (with the step's non-finite verdict, which it reads
anyway) and updates all layers in one NumPy pass, so the device sees one fused
multiply-add per layer for the threshold and nothing for the learning.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Tuple

import numpy as np

from ..backend import ArrayOps
from ..config import Controller, SparsityConfig

__all__ = ["ThresholdController", "make_controller"]

State = Dict[str, Any]

# theta is kept in a range where log/exp of float32 stay finite.
_THETA_MIN = 1e-30
_THETA_MAX = 1e30
# One step may move theta at most by this factor: a bad gradient cannot throw
# the controller off by orders of magnitude.
_MAX_STEP = math.log(8.0)
_ELASTICITY_RANGE = (1.0, 20.0)
_ELASTICITY_SMOOTHING = 0.2
_INTEGRAL_GAIN = 0.2
_MAX_DRIFT = math.log(2.0)
# The loop gain each layer learns (delta-bar-delta): halved when the count
# crosses the target from one step to the next, raised by a quarter while it
# stays on one side, within [_MIN_GAIN, 1]. Error feedback is itself a
# correcting loop (a step that sends too little leaves more in the residual for
# the next), so a full correction overshoots and can lock into a 2-cycle of
# bursts and empty steps; errors within _GAIN_DEADBAND count as on target.
_MIN_GAIN = 1.0 / 16.0
_GAIN_DOWN = 0.5
_GAIN_UP = 1.25
_GAIN_DEADBAND = math.log(1.25)


class ThresholdController:
    """Base: how ``theta`` is chosen before selection and updated after it.

    :meth:`threshold` may change only plain Python entries of the state (it runs
    during a step that may turn out non-finite, and the exchange restores those
    from a copy); the entries that learning changes are named in
    :attr:`vector_keys`, live on the host, and are changed only by :meth:`update`
    / :meth:`update_many`, which the exchange runs once a step is known finite.
    """

    #: The state's host entries that :meth:`update` changes. An exchange keeps
    #: each in one NumPy vector over all its sparse layers (a layer's entry is a
    #: 0-d view of it) and updates them with :meth:`update_many` in one
    #: vectorised host pass per step: no device operation at all.
    vector_keys: Tuple[str, ...] = ()

    def __init__(self, config: SparsityConfig):
        self.config = config

    def init_state(self, ops: ArrayOps, like: Any, density: float) -> State:
        """Fresh state for a layer (also after a density change)."""
        return {}

    def threshold(
        self, ops: ArrayOps, state: State, absx: Any, k: int, step: int, total: Any
    ) -> Any:
        """``theta`` for this step, given ``|a|`` in ``absx`` and its sum
        ``total`` (0-d, on the device); may read ``absx``."""
        raise NotImplementedError

    def reads_magnitudes(self, state: State) -> bool:
        """Whether this step's :meth:`threshold` reads ``absx`` (otherwise
        ``total`` is enough, and a fused selection need not write ``|a|``)."""
        return True

    def update(self, ops: ArrayOps, state: State, theta: Any, count: Any, k: int) -> None:
        """Learn from the count that ``theta`` selected. Reads ``count`` on the
        host where the controller learns (one read: outside an exchange only;
        an exchange batches every layer's into :meth:`update_many`)."""

    def update_many(
        self,
        vectors: Dict[str, np.ndarray],
        counts: np.ndarray,
        k1: np.ndarray,
        anchors: Dict[int, float],
    ) -> None:
        """:meth:`update` for many layers at once, on the host: ``vectors[key]``
        holds the :attr:`vector_keys` entry of every layer, ``counts`` their
        selected counts, ``k1`` their targets plus one and ``anchors`` the
        factors that layers which anchored this step measured (by position)."""

    # -- steps on the device alone (see dlgs.core.exchange.device) ------------
    def steps_before_anchor(self, state: State) -> int:
        """How many steps from now may run without a host decision for this
        layer (the next one that needs the host is an anchor); -1: any."""
        return -1

    def device_threshold(self, ops: ArrayOps, factor: Any, total: Any, n: int) -> Any:
        """``theta`` on a step that is not an anchor, from :attr:`vector_keys`'
        ``factor`` on the device (0-d or 1-element float64)."""
        raise NotImplementedError

    def device_update(
        self, xp: Any, vectors: Dict[str, Any], counts: Any, k1: Any
    ) -> Dict[str, Any]:
        """:meth:`update_many` without anchors, in ``xp``'s vector math (on the
        device): the new value of each :attr:`vector_keys` entry."""
        raise NotImplementedError


class _TopK(ThresholdController):
    def threshold(self, ops, state, absx, k, step, total):
        return ops.clamp(ops.kth_largest(absx, k), _THETA_MIN, _THETA_MAX)


class _Fixed(ThresholdController):
    def init_state(self, ops, like, density):
        return {"theta": ops.scalar(float(self.config.threshold), like)}

    def reads_magnitudes(self, state):
        return False

    def threshold(self, ops, state, absx, k, step, total):
        return state["theta"]


class _DGC(ThresholdController):
    def threshold(self, ops, state, absx, k, step, total):
        n = ops.numel(absx)
        stride = max(1, int(round(1.0 / self.config.sample_ratio)))
        sample = ops.strided(absx, stride)
        m = ops.numel(sample)
        ks = min(m, max(1, math.ceil(k * m / n)))
        return ops.clamp(ops.kth_largest(sample, ks), _THETA_MIN, _THETA_MAX)


class _Dynamic(ThresholdController):
    """theta = factor * scale, with scale = mean |a| of this step's accumulated
    gradient and factor learnt from past counts.

    The scale follows the batch-to-batch (and error-feedback) swings of the
    gradient's magnitude at no extra cost (the exchange sums ``|a|`` anyway, to
    check it is finite); the factor, which only has to follow the tail's
    *shape*, is what the feedback controller adapts, on the host, once per step
    for all layers. On the device a step costs one fused multiply-add per layer.
    """

    vector_keys = ("factor", "prev_factor", "prev_count", "elasticity", "drift", "gain")

    def init_state(self, ops, like, density):
        e0 = min(max(math.log(1.0 / density), _ELASTICITY_RANGE[0]), _ELASTICITY_RANGE[1])
        return {
            "factor": 0.0,
            "prev_factor": 0.0,
            "prev_count": 0.0,
            "elasticity": e0,
            "drift": 0.0,
            "gain": 1.0,
            # Steps since the last anchor; the first step always anchors.
            "since_anchor": -1,
        }

    def reads_magnitudes(self, state):
        return self._anchors(state)

    def _anchors(self, state) -> bool:
        """Whether this step resets theta to the exact top-k threshold."""
        every, since = self.config.anchor_every, state["since_anchor"]
        return since < 0 or bool(every and since + 1 >= every)

    def threshold(self, ops, state, absx, k, step, total):
        n = ops.numel(absx)
        if self._anchors(state):
            exact = ops.clamp(ops.kth_largest(absx, k), _THETA_MIN, _THETA_MAX)
            # The factor this implies (exact / mean); update() installs it, and
            # clears the previous factor: the secant needs two factors applied
            # to comparable inputs, and across an anchor it would mix the
            # corrected and uncorrected one.
            state["anchor"] = ops.mul(exact / ops.clamp(total, _THETA_MIN, math.inf), float(n))
            state["since_anchor"] = 0
            # The exact value itself: factor * mean can round up by an ulp and
            # drop the k-th element.
            return exact
        state["since_anchor"] += 1
        # theta = factor * (total / n), kept above zero (an all-zero layer
        # selects nothing): one operation, the factor a host number.
        return ops.affine(total, float(state["factor"]) / n, _THETA_MIN)

    def steps_before_anchor(self, state):
        every, since = self.config.anchor_every, state["since_anchor"]
        if since < 0:
            return 0
        return max(0, every - 1 - since) if every else -1

    def device_threshold(self, ops, factor, total, n):
        # As threshold()'s affine: float32(factor / n), then one multiply-add.
        return ops.threshold_from_factor(total, factor, n, _THETA_MIN)

    def device_update(self, xp, vectors, counts, k1):
        return _advance(*(vectors[key] for key in self.vector_keys), counts, k1, xp=xp)

    def update(self, ops, state, theta, count, k):
        anchor = state.pop("anchor", None)
        vectors = {key: np.array([float(state[key])]) for key in self.vector_keys}
        self.update_many(
            vectors,
            np.array([float(ops.to_host(count))]),
            np.array([k + 1.0]),
            {0: float(ops.to_host(anchor))} if anchor is not None else {},
        )
        for key in self.vector_keys:
            state[key] = float(vectors[key][0])

    def update_many(self, vectors, counts, k1, anchors):
        factor, prev = vectors["factor"], vectors["prev_factor"]
        for j, anchor in anchors.items():
            factor[j] = min(max(anchor, _THETA_MIN), _THETA_MAX)
            prev[j] = 0.0
        new = _advance(*(vectors[key] for key in self.vector_keys), counts, k1)
        for key in _WRITE_ORDER:
            vectors[key][...] = new[key]


class NumpyMath:
    """The element-wise float64 operations :func:`_advance` is written in, on
    NumPy vectors (an adapter's ``ArrayOps.vector_math`` gives the same on its
    device, for steps traced into a graph)."""

    log = staticmethod(np.log)
    exp = staticmethod(np.exp)
    where = staticmethod(np.where)
    clip = staticmethod(np.clip)
    abs = staticmethod(np.abs)
    copy = staticmethod(np.copy)

    @staticmethod
    def float64(x: Any) -> Any:
        return np.asarray(x, np.float64)

    @staticmethod
    def quiet() -> Any:
        """Masked below: 0/0 where no secant exists."""
        return np.errstate(all="ignore")


NUMPY_MATH = NumpyMath()


def _advance(factor, prev, prev_count, e, drift, gain, count, k1, xp: Any = NUMPY_MATH):
    """The update, element-wise over float64 vectors (NumPy's, or ``xp``'s):
    the new value of each of :attr:`_Dynamic.vector_keys`. The new
    ``prev_factor`` is the old ``factor`` itself, so it is written first
    (:data:`_WRITE_ORDER`)."""
    lo, hi = _ELASTICITY_RANGE
    with xp.quiet():
        c1 = xp.float64(count) + 1.0
        # Secant estimate of the tail's elasticity from the last two steps.
        has_prev = prev > 0
        dlog = xp.log(factor / xp.where(has_prev, prev, factor))
        moved = has_prev & (xp.abs(dlog) > 1e-3)
        safe = xp.where(moved, dlog, 1.0)
        observed = xp.clip(-xp.log(c1 / (prev_count + 1.0)) / safe, lo, hi)
        e = xp.where(moved, e + _ELASTICITY_SMOOTHING * (observed - e), e)
        ratio = c1 / k1
        # The gain: down where the error changed sign since the last step (an
        # overshoot), up where it kept its sign; no previous count, no change.
        err, prev_err = xp.log(ratio), xp.log((prev_count + 1.0) / k1)
        big = (xp.abs(err) > _GAIN_DEADBAND) & (xp.abs(prev_err) > _GAIN_DEADBAND) & has_prev
        gain = xp.where(
            big & (err * prev_err < 0),
            gain * _GAIN_DOWN,
            xp.where(big, gain * _GAIN_UP, gain),
        )
        gain = xp.clip(gain, _MIN_GAIN, 1.0)
        # Integral action on the *linear* error: it cancels the lag behind a
        # steady drift of the tail's shape, and it centres the mean of count/k
        # (what bandwidth sees) rather than its geometric mean.
        drift = xp.clip(
            drift + _INTEGRAL_GAIN * xp.clip(ratio - 1.0, -1.0, 3.0) / e, -_MAX_DRIFT, _MAX_DRIFT
        )
        step = xp.clip(gain * (err / e + drift), -_MAX_STEP, _MAX_STEP)
        new_factor = xp.clip(factor * xp.exp(step), _THETA_MIN, _THETA_MAX)
    return {
        "prev_factor": xp.copy(factor),
        "factor": new_factor,
        "prev_count": c1 - 1.0,
        "elasticity": e,
        "drift": drift,
        "gain": gain,
    }


# In-place writes: ``prev_factor`` takes the old ``factor`` before it changes.
_WRITE_ORDER = ("prev_factor", "factor", "prev_count", "elasticity", "drift", "gain")

_CONTROLLERS = {
    Controller.DYNAMIC: _Dynamic,
    Controller.TOPK: _TopK,
    Controller.FIXED: _Fixed,
    Controller.DGC: _DGC,
}


def make_controller(config: SparsityConfig) -> ThresholdController:
    """The controller named by ``config.controller``."""
    return _CONTROLLERS[Controller(config.controller)](config)
