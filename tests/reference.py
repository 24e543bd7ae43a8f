"""A plain reference of error-feedback sparsification, written from the method's
definition and sharing no code with ``dlgs.core`` (loops and NumPy). State is
float32, as the method keeps it, so that which element reaches a threshold is
decided on the same numbers; the reduction is summed in float64.

Given each step's gradients on every rank and the threshold each sparse layer
used (which the controllers choose; their own tests check how well), it
computes what every rank must send, keep and receive:

* ``a = r + g`` (or with momentum correction ``u = m·u + g``, ``a = r + u``);
* a sparse layer sends the first ``capacity`` elements (in index order) with
  ``|a| >= theta``, rounded to the wire dtype, and keeps the rest, plus the
  rounding error, in ``r``; momentum correction clears ``u`` where it sent
  (factor masking: ``momentum_masking``, by default where the layer sends at
  most 1% of its entries a step);
* a dense layer sends its gradient (or velocity), plus whatever residual it
  still holds from when it was sparse;
* every rank receives the average (or sum) of what all ranks sent.

Layer targets follow the method's rule: ``k = ceil(d·n)`` for the density ``d``
of the step (warm-up stages first), ``capacity = min(n, ceil(max_ratio·k))``,
sparse when ``n >= min_sparse_size`` and the sparse message (its values and
indices, each padded to 4-byte words) is smaller than the float32 gradient,
unless a merge plan forces the mode of a group. Indices cost 4 bytes each
(``int32``), or 2 each plus 4 per 65,536-element block boundary
(``block16``); ``auto`` takes the smaller.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np


class Reference:
    """Every rank's state, advanced one step at a time with :meth:`step`."""

    def __init__(
        self,
        sizes: Sequence[int],
        ranks: int,
        *,
        density: float,
        min_sparse_size: int = 1024,
        max_ratio: float = 1.0,
        momentum: float = 0.0,
        momentum_masking: Optional[bool] = None,
        warmup: Sequence[float] = (),
        warmup_steps: int = 0,
        value_dtype: str = "float32",
        index_coding: str = "auto",
        average: bool = True,
    ):
        self.sizes = list(sizes)
        self.ranks = ranks
        self.density, self.warmup, self.warmup_steps = density, list(warmup), warmup_steps
        self.min_sparse_size, self.max_ratio = min_sparse_size, max_ratio
        self.momentum, self.value_dtype, self.average = momentum, value_dtype, average
        self.index_coding, self.momentum_masking = index_coding, momentum_masking
        self.residual: List[Dict[int, np.ndarray]] = [{} for _ in range(ranks)]
        self.velocity = [[np.zeros(n, np.float32) for n in sizes] for _ in range(ranks)]
        self.t = 0

    def density_at(self, t: int) -> float:
        stage = t // self.warmup_steps if self.warmup_steps else len(self.warmup)
        return self.warmup[stage] if stage < len(self.warmup) else self.density

    def target(self, n: int, t: int) -> Tuple[int, int, bool]:
        """``(k, capacity, sparse by the rule)`` of an ``n``-element layer at step ``t``."""
        k = max(1, math.ceil(self.density_at(t) * n))
        cap = min(n, math.ceil(self.max_ratio * k))
        value_bytes = 4 * math.ceil(cap * (4 if self.value_dtype == "float32" else 2) / 4)
        int32 = 4 * cap
        block16 = 4 * math.ceil(cap / 2) + 4 * (n // 65536)
        bitmap = 4 * math.ceil(math.ceil((n + cap) / 8) / 4)
        index_bytes = {"int32": int32, "block16": block16, "bitmap": bitmap}
        index_bytes["auto"] = min(index_bytes.values())
        message = value_bytes + index_bytes[self.index_coding]
        return k, cap, n >= self.min_sparse_size and message < 4 * n

    def step(
        self,
        grads: Sequence[Sequence[np.ndarray]],
        thetas: Sequence[Dict[int, float]],
        modes: Optional[Dict[int, bool]] = None,
    ) -> List[np.ndarray]:
        """Advance every rank by one step.

        Args:
            grads: ``grads[rank][layer]``, flat.
            thetas: ``thetas[rank][layer]``: the threshold each sparse layer used.
            modes: ``layer -> sparse`` forced by a merge plan (others by the rule).

        Returns:
            Each layer's reduced gradient (the same on every rank).
        """
        out = [np.zeros(n) for n in self.sizes]
        for r in range(self.ranks):
            for i, n in enumerate(self.sizes):
                k, cap, sparse = self.target(n, self.t)
                masking = self.momentum_masking
                if masking is None:  # dlgs's default: by the layer's density
                    masking = not self.warmup and k <= math.ceil(0.01 * n)
                if modes and i in modes:
                    sparse = modes[i]
                g = np.asarray(grads[r][i], np.float32)
                if self.momentum:
                    self.velocity[r][i] = self.velocity[r][i] * np.float32(self.momentum) + g
                    x = self.velocity[r][i]
                else:
                    x = g
                if sparse:
                    a = self.residual[r].get(i, np.zeros(n, np.float32)) + x
                    chosen = [j for j in range(n) if abs(a[j]) >= thetas[r][i]][:cap]
                    vals = a[chosen]
                    if self.value_dtype == "float16":  # clipped to its range
                        vals = np.clip(vals, -65504, 65504).astype(np.float16).astype(np.float32)
                    elif self.value_dtype == "bfloat16":  # round to nearest even
                        bits = vals.astype(np.float32).view(np.uint32).astype(np.uint64)
                        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
                        vals = bits.astype(np.uint32).view(np.float32)
                    keep = a.copy()
                    keep[chosen] -= vals
                    self.residual[r][i] = keep
                    if self.momentum and masking:
                        self.velocity[r][i][chosen] = 0.0
                    sent = np.zeros(n, np.float32)
                    sent[chosen] = vals
                else:
                    sent = x + self.residual[r].pop(i, np.float32(0))
                out[i] += sent.astype(np.float64)
        self.t += 1
        if self.average:
            out = [o / self.ranks for o in out]
        return out


def plan_modes(ref: Reference, plan, step: int) -> Dict[int, bool]:
    """Layer -> sparse for a merge plan (``[(members, sparse or None)]``) in
    force at ``step`` (None: layer-wise); ``None`` groups are sparse when every
    member is by the rule."""
    modes: Dict[int, bool] = {}
    for members, sparse in plan or []:
        if sparse is None:
            sparse = all(ref.target(ref.sizes[i], step)[2] for i in members)
        modes.update({i: bool(sparse) for i in members})
    return modes


def compare_run(
    ref: Reference,
    rank: int,
    grads: Sequence[Sequence[Sequence[np.ndarray]]],
    thetas: Sequence[Sequence[Dict[int, float]]],
    outs: Sequence[Sequence[np.ndarray]],
    residuals: Sequence[Dict[int, np.ndarray]],
    plans: Sequence[Optional[list]],
) -> Dict[str, float]:
    """Replay a real run through the reference and measure how far ``rank``'s
    results are from it.

    Args:
        grads: ``grads[step][rank][layer]``: every rank's gradients (flat,
            exchange order).
        thetas: ``thetas[step][rank]``: the thresholds each rank's sparse layers used.
        outs: ``outs[step][layer]``: this rank's reduced gradients.
        residuals: ``residuals[step]``: this rank's residual per sparse layer.
        plans: the merge plan in force at each step (None: layer-wise).

    Returns:
        ``out``: the largest output error relative to the output's scale
        (max(1, max |output|)); ``residual``: the same for the residuals;
        ``modes``: steps at which the set of sparse layers (the thresholds
        reported) differs from the
        reference's rule; ``first_bad_step``: the first step off by more
        than 1e-6 (-1: none).
    """
    worst_out = worst_res = 0.0
    wrong_modes = 0
    first_bad = -1
    for s in range(len(outs)):
        modes = plan_modes(ref, plans[s], s)
        want = ref.step(grads[s], thetas[s], modes)
        sparse = {
            i for i, n in enumerate(ref.sizes) if (modes[i] if i in modes else ref.target(n, s)[2])
        }
        wrong_modes += set(thetas[s][rank]) != sparse
        for i, w in enumerate(want):
            scale = max(1.0, float(np.abs(w).max()))
            got = np.asarray(outs[s][i], np.float64)
            worst_out = max(worst_out, float(np.abs(got - w).max()) / scale)
        for i, r in residuals[s].items():
            want_r = ref.residual[rank][i]
            scale = max(1.0, float(np.abs(want_r).max()))
            worst_res = max(worst_res, float(np.abs(np.asarray(r) - want_r).max()) / scale)
        if first_bad < 0 and max(worst_out, worst_res) > 1e-6:
            first_bad = s
    return {
        "out": worst_out,
        "residual": worst_res,
        "modes": float(wrong_modes),
        "first_bad_step": float(first_bad),
    }


def replay(
    sizes: Sequence[int],
    ranks: int,
    rank: int,
    grads,
    thetas,
    outs,
    residuals,
    plans,
    **options,
) -> Dict[str, float]:
    """:func:`compare_run` for a multi-rank test: ``thetas[r][step]`` is rank
    ``r``'s record as allgathered; ``options`` are :class:`Reference`'s."""
    steps = len(outs)
    by_step = [[thetas[r][s] for r in range(ranks)] for s in range(steps)]
    ref = Reference(sizes, ranks, **options)
    return compare_run(ref, rank, grads, by_step, outs, residuals, plans)
