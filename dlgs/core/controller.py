"""Per-layer threshold controllers.

A controller turns a layer's accumulated gradient magnitudes ``|a|`` into a
threshold ``theta`` so that about ``k`` elements satisfy ``|a| >= theta``. The
state is a dict of 0-d tensors kept on the layer's device, so updating it never
synchronises the host.

The dynamic controller is the method's core idea: no sort on the hot path. It
keeps ``theta`` from the previous step and corrects it from how many elements
that step selected, in log space::

    theta <- theta * ((c + 1) / (k + 1)) ** (1 / e)

where ``e = -dlog(count)/dlog(theta)`` is the tail's elasticity, estimated by a
smoothed secant over successive steps and started at ``ln(1/density)`` (exact
for an exponential tail, which is what SIDCo fits to gradients). Every
``anchor_every`` steps ``theta`` is reset to the exact top-k threshold, as
Ok-Topk does every 32 iterations, which bounds drift.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Sequence, Tuple

from .backend import ArrayOps
from .config import Controller, SparsityConfig

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
# Elements sampled (strided) to measure a layer's magnitude scale each step.
_SCALE_SAMPLE = 65536


class ThresholdController:
    """Base: how ``theta`` is chosen before selection and updated after it.

    :meth:`threshold` may change only plain Python entries of the state (it runs
    during a step that may turn out non-finite, and the exchange restores those
    from a copy); every tensor entry that learning changes is named in
    :attr:`vector_keys` and changed only by :meth:`update` /
    :meth:`update_many`, which the exchange runs once a step is known finite.
    """

    #: The state's tensor entries that :meth:`update` changes. An exchange keeps
    #: each in one vector over all its sparse layers (a layer's entry is an
    #: element view of it) and updates them with :meth:`update_many` in one
    #: vectorised pass per step, not a dozen scalar operations per layer.
    vector_keys: Tuple[str, ...] = ()

    def __init__(self, config: SparsityConfig):
        self.config = config

    def init_state(self, ops: ArrayOps, like: Any, density: float) -> State:
        """Fresh state for a layer (also after a density change)."""
        return {}

    def threshold(self, ops: ArrayOps, state: State, absx: Any, k: int, step: int) -> Any:
        """``theta`` for this step, given ``|a|`` in ``absx``; may read it."""
        raise NotImplementedError

    def update(self, ops: ArrayOps, state: State, theta: Any, count: Any, k: int) -> None:
        """Learn from the count that ``theta`` selected (device tensors only)."""

    def update_many(
        self,
        ops: ArrayOps,
        vectors: Dict[str, Any],
        states: Sequence[State],
        counts: Any,
        k1: Any,
    ) -> None:
        """:meth:`update` for many layers at once: ``vectors[key]`` holds
        :attr:`vector_keys` entries of every layer (``states[j][key]`` is element
        ``j``), ``counts`` their selected counts (float32) and ``k1`` their
        targets plus one."""


class _TopK(ThresholdController):
    def threshold(self, ops, state, absx, k, step):
        return ops.clamp(ops.kth_largest(absx, k), _THETA_MIN, _THETA_MAX)


class _Fixed(ThresholdController):
    def init_state(self, ops, like, density):
        return {"theta": ops.scalar(float(self.config.threshold), like)}

    def threshold(self, ops, state, absx, k, step):
        return state["theta"]


class _DGC(ThresholdController):
    def threshold(self, ops, state, absx, k, step):
        n = ops.numel(absx)
        stride = max(1, int(round(1.0 / self.config.sample_ratio)))
        sample = ops.strided(absx, stride)
        m = ops.numel(sample)
        ks = min(m, max(1, math.ceil(k * m / n)))
        return ops.clamp(ops.kth_largest(sample, ks), _THETA_MIN, _THETA_MAX)


class _Dynamic(ThresholdController):
    """theta = factor * scale, with scale = mean |a| of a strided sample of
    this step's accumulated gradient and factor learnt from past counts.

    The scale follows the batch-to-batch (and error-feedback) swings of the
    gradient's magnitude at almost no cost; the factor, which only has to follow
    the tail's *shape*, is what the feedback controller adapts.
    """

    def _scale(self, ops, absx):
        n = ops.numel(absx)
        return ops.clamp(
            ops.mean(ops.strided(absx, max(1, n // _SCALE_SAMPLE))), _THETA_MIN, _THETA_MAX
        )

    vector_keys = ("factor", "prev_factor", "prev_count", "elasticity", "drift")

    def init_state(self, ops, like, density):
        e0 = min(max(math.log(1.0 / density), _ELASTICITY_RANGE[0]), _ELASTICITY_RANGE[1])
        return {
            "factor": ops.scalar(0.0, like),
            "prev_factor": ops.scalar(0.0, like),
            "prev_count": ops.scalar(0.0, like),
            "elasticity": ops.scalar(e0, like),
            "drift": ops.scalar(0.0, like),
            # Steps since the last anchor; the first step always anchors.
            "since_anchor": -1,
        }

    def threshold(self, ops, state, absx, k, step):
        scale = self._scale(ops, absx)
        every = self.config.anchor_every
        since = state["since_anchor"]
        if since < 0 or (every and since + 1 >= every):
            exact = ops.clamp(ops.kth_largest(absx, k), _THETA_MIN, _THETA_MAX)
            # The factor this implies; update() installs it, and clears the
            # previous factor: the secant needs two factors applied to
            # comparable inputs, and across an anchor it would mix the corrected
            # and uncorrected one.
            state["anchor"] = exact / scale
            state["since_anchor"] = 0
            # The exact value itself: (exact / scale) * scale can round up by
            # an ulp and drop the k-th element.
            return exact
        state["since_anchor"] = since + 1
        return ops.clamp(state["factor"] * scale, _THETA_MIN, _THETA_MAX)

    def _install_anchor(self, ops, state):
        anchor = state.pop("anchor", None)
        if anchor is not None:
            state["factor"] = ops.assign_(state["factor"], anchor)
            state["prev_factor"] = ops.assign_(state["prev_factor"], anchor * 0.0)

    def update(self, ops, state, theta, count, k):
        self._install_anchor(ops, state)
        new = self._advance(ops, *(state[key] for key in self.vector_keys), count, k + 1.0)
        for key in _WRITE_ORDER:
            state[key] = ops.assign_(state[key], new[key])

    def update_many(self, ops, vectors, states, counts, k1):
        for state in states:
            self._install_anchor(ops, state)
        new = self._advance(ops, *(vectors[key] for key in self.vector_keys), counts, k1)
        for key in _WRITE_ORDER:
            ops.assign_(vectors[key], new[key])

    @staticmethod
    def _advance(ops, factor, prev, prev_count, e, drift, count, k1):
        """The update, element-wise (one layer's 0-d state or vectors of many):
        the new value of each of :attr:`vector_keys`. The new ``prev_factor`` is
        the old ``factor`` itself, so it is written first (:data:`_WRITE_ORDER`)."""
        c1 = ops.to_float(count) + 1.0
        # Secant estimate of the tail's elasticity from the last two steps.
        has_prev = prev > 0
        dlog = ops.log(factor / ops.where(has_prev, prev, factor))
        moved = has_prev & ((dlog > 1e-3) | (dlog < -1e-3))
        safe = ops.where(moved, dlog, dlog * 0 + 1.0)
        observed = ops.clamp(-ops.log(c1 / (prev_count + 1.0)) / safe, *_ELASTICITY_RANGE)
        e = ops.where(moved, e + _ELASTICITY_SMOOTHING * (observed - e), e)
        ratio = c1 / k1
        # Integral action on the *linear* error: it cancels the lag behind a
        # steady drift of the tail's shape, and it centres the mean of count/k
        # (what bandwidth sees) rather than its geometric mean.
        drift = ops.clamp(
            drift + _INTEGRAL_GAIN * ops.clamp(ratio - 1.0, -1.0, 3.0) / e,
            -_MAX_DRIFT,
            _MAX_DRIFT,
        )
        step = ops.clamp(ops.log(ratio) / e + drift, -_MAX_STEP, _MAX_STEP)
        new_factor = ops.clamp(factor * ops.exp(step), _THETA_MIN, _THETA_MAX)
        return {
            "prev_factor": factor,
            "factor": new_factor,
            "prev_count": c1 - 1.0,
            "elasticity": e,
            "drift": drift,
        }


# In-place writes: ``prev_factor`` takes the old ``factor`` before it changes.
_WRITE_ORDER = ("prev_factor", "factor", "prev_count", "elasticity", "drift")

_CONTROLLERS = {
    Controller.DYNAMIC: _Dynamic,
    Controller.TOPK: _TopK,
    Controller.FIXED: _Fixed,
    Controller.DGC: _DGC,
}


def make_controller(config: SparsityConfig) -> ThresholdController:
    """The controller named by ``config.controller``."""
    return _CONTROLLERS[Controller(config.controller)](config)
