"""A byte budget split between layers by their gradients.

With ``budget=`` dlgs first sends every sparse layer at the one density that
fits the budget (:func:`dlgs.core.wire.density_for_budget`). That starves
the small layers: on the Fashion-MNIST CNN at PowerSGD rank 1's bytes (a
density of 0.006) the output layer's 1,280 weights send 8 entries a step,
which hold 6% of its residual's energy after 10 steps, while this split of
the same bytes gives it 356 and 89% (``python -m benchmarks.budget_shares``;
``docs/benchmarks.md``, "Accuracy per byte").

``budget_split="gradient"`` splits the same bytes as a global top-k would, once
the residuals have shown which layers wait: after :data:`SPLIT_AFTER` steps at
the uniform density, rank 0 samples every sparse layer's residual (a strided
sample of at most :data:`SAMPLE` magnitudes per layer, read to the host once),
finds the one magnitude threshold whose per-layer densities (each layer's
share of its sample at or above it, but no less than a quarter of the uniform
density) fit the budget under the same arithmetic as ``wire_bytes()``
(:func:`split_densities`), and broadcasts them; every rank
lays its messages out for them at the next step. The densities are kept in
the exchange's shared state, so checkpoints carry them.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence

from ..config import SparsityConfig
from ..wire import layout_bytes

__all__ = ["FLOOR", "SAMPLE", "SPLIT_AFTER", "BudgetSplit", "split_densities"]

#: Steps at the uniform density before the split (the residuals' evidence).
SPLIT_AFTER = 10
#: The most magnitudes sampled per layer.
SAMPLE = 4096
#: No layer's density falls below this fraction of the uniform one. The split
#: is made once: a layer it left with one entry a step would stay starved
#: however its residual grew.
FLOOR = 0.25


def split_densities(
    sizes: Sequence[int],
    samples: Sequence[Optional[Sequence[float]]],
    uniform: float,
    config: SparsityConfig,
    target: float,
) -> List[float]:
    """Each layer's density under one magnitude threshold ``t``: a sampled
    layer's share of ``samples[i]`` (absolute values) at or above ``t``, at
    least :data:`FLOOR` of ``uniform`` and one entry of the layer; a layer
    without a sample (sent dense) keeps ``uniform``. ``t`` is the lowest of
    the samples' values whose densities' layer-wise layout (:func:`layout_bytes`) sends at most
    ``target`` bytes; where even the highest does not fit, ``uniform`` for
    every layer (which fits: it came from the budget)."""
    if len(samples) != len(sizes):
        raise ValueError(
            f"samples must have one entry per layer ({len(sizes)}), got {len(samples)}"
        )
    sorted_samples = [
        None if s is None else sorted((abs(float(x)) for x in s), reverse=True) for s in samples
    ]

    def densities(t: float) -> List[float]:
        out = []
        for n, s in zip(sizes, sorted_samples):
            if not s:
                out.append(uniform)
                continue
            above = _count_at_least(s, t)
            out.append(min(1.0, max(1.0 / n, FLOOR * uniform, above / len(s))))
        return out

    candidates = sorted({x for s in sorted_samples if s for x in s if x > 0}, reverse=True)
    if not candidates:
        return [uniform] * len(sizes)
    # Bytes rise as t falls: the last candidate that fits, by bisection.
    lo, hi = -1, len(candidates)  # candidates[lo] fits (-1: none yet), candidates[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if layout_bytes(sizes, densities(candidates[mid]), config) <= target:
            lo = mid
        else:
            hi = mid
    if lo < 0:
        return [uniform] * len(sizes)
    return densities(candidates[lo])


def _count_at_least(descending: Sequence[float], t: float) -> int:
    """How many of ``descending`` (sorted high to low) are >= ``t``."""
    lo, hi = 0, len(descending)
    while lo < hi:
        mid = (lo + hi) // 2
        if descending[mid] >= t:
            lo = mid + 1
        else:
            hi = mid
    return lo


class BudgetSplit:
    """The exchange's step hook for ``budget_split="gradient"`` (see the
    module). One ``broadcast_object`` on the process set, at the end of step
    :data:`SPLIT_AFTER`, on every rank alike; nothing on any other step."""

    state_key = "budget_split"

    def __init__(self, after: int = SPLIT_AFTER):
        self.after = after
        self.done = False

    def host_steps_until(self, ex: Any) -> int:
        """Steps from ``ex``'s next one until one must run on the host (the
        step whose end splits); -1: none."""
        if self.done:
            return -1
        return max(0, self.after - 1 - ex.step)

    def __call__(self, exchange: Any, record: Any) -> None:
        ex = exchange
        if self.done or ex.step < self.after:
            return
        self.done = True
        densities = self.choose(ex) if ex.comm.rank == 0 else None
        if ex.comm.size > 1:
            densities = ex.comm.broadcast_object(densities)
        ex.set_density(ex.density, densities)

    @staticmethod
    def choose(ex: Any) -> List[float]:
        """Rank 0's split from its residuals (one host read of the samples)."""
        ops, config = ex.ops, ex.config
        sizes = [layer.numel for layer in ex.records]
        picked, parts = [], []
        for i, layer in enumerate(ex.records):
            if layer.plan is None or not layer.plan.sparse or layer.residual is None:
                continue
            stride = max(1, math.ceil(layer.numel / SAMPLE))
            picked.append(i)
            parts.append(ops.strided(layer.head(ops, layer.residual), stride))
        samples: List[Optional[List[float]]] = [None] * len(sizes)
        if parts:
            flat = ops.to_host(ops.concat(parts))
            at = 0
            for i, part in zip(picked, parts):
                n = ops.numel(part)
                samples[i] = flat[at : at + n]
                at += n
        budget = config.budget
        target = budget if isinstance(budget, int) else budget * 4 * sum(sizes)
        return split_densities(sizes, samples, ex.density, config, target)

    def state_dict(self) -> dict:
        return {"done": self.done}

    def load_state_dict(self, state: dict, ex: Any) -> None:
        self.done = bool(state.get("done", False))
