"""Fitting probe collectives so that the plan sees the link.

A probe times one collective of a few sizes, a few times each. Other work on
the machine only ever *adds* time, so the collective's cost is a line lying
*under* the samples, not through them: a least-squares line through them lets
one slow small probe tilt the slope to zero, and a plan made from a slope of
zero treats bytes as free (on a 100 Mbit/s link it sent conv layers dense and
crossed the link with half as many bytes again as layer-wise sending).

:func:`fit_probe` therefore fits the tightest line under the fastest sample of
each size (the linear programme ``min sum(t_i - alpha - beta s_i)`` subject to
the line staying under every point, ``alpha, beta >= 0``, solved exactly on
its few vertices), and then asks whether the bytes were *seen*: whether the
line rises, from the smallest probe to the largest, by more than the noise
the samples show (the spread of the repeats of each size but the largest, whose
spread grows with its bytes, and the points' distance above the line). When
they were not (probes too small for the link's bandwidth to stand out of its
latency), the slope is the steepest that the samples allow,
``(t_top - t_bottom + noise) / (s_top - s_bottom)`` (or, where that is
zero, ``t_top / s_top``), through the largest
probe's fastest time: the plan then prices bytes as dearly as the
measurements permit instead of as free, which keeps it near layer-wise sparse
sending on a slow link and changes little on a fast one (where that bound is
small). That bound is the noise's, though, and moves with it from run to run
(1.7 to 13.5 ns/B on one 1 Gbit/s link here, `make bench`), and so do the plans made from it.
Where the user named the link (``link_bandwidth``), bytes that were not seen
are priced instead as the ring over that link costs them (``prior``, from
:mod:`~dlgs.core.planning.netmodel`), under the fastest samples where that
slope allows (a link named slower than the samples allow passes above them):
the same price in every run. Bytes that were seen keep the measured price.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .dp import CostModel

__all__ = ["ProbeFit", "fit_probe", "fit_warning"]


@dataclass(frozen=True)
class ProbeFit:
    """What :func:`fit_probe` found.

    Attributes:
        model: the cost to plan with.
        seen: whether the bytes' time stood out of the noise (else ``model``'s
            slope is the bound the samples allow).
        noise: seconds: the largest spread of one size's repeats (the largest
            size's aside), or distance of a size's fastest sample above the
            fitted line.
        fitted_beta: the slope of the line under the samples, before any bound.
        priced_by: what set ``model``'s slope: ``"probes"`` (the bytes were
            seen), ``"bound"`` (the most the samples allow) or
            ``"link_bandwidth"`` (the link the user named).
    """

    model: CostModel
    seen: bool
    noise: float
    fitted_beta: float
    priced_by: str = "probes"


def _under(sizes: Sequence[float], times: Sequence[float]) -> Tuple[float, float]:
    """The line ``(alpha, beta)``, ``alpha, beta >= 0``, under every point
    ``(sizes[i], times[i])`` that minimises the summed distance to them."""
    candidates: List[Tuple[float, float]] = [(min(times), 0.0)]
    for i, (si, ti) in enumerate(zip(sizes, times)):
        if si > 0:
            candidates.append((0.0, ti / si))
        for sj, tj in zip(sizes[i + 1 :], times[i + 1 :]):
            if sj != si:
                beta = (tj - ti) / (sj - si)
                candidates.append((ti - beta * si, beta))
    scale = max(abs(t) for t in times) or 1.0
    best, best_gap = (min(times), 0.0), float("inf")
    for alpha, beta in candidates:
        if alpha < 0 or beta < 0:
            continue
        gaps = [t - (alpha + beta * s) for s, t in zip(sizes, times)]
        if min(gaps) < -1e-12 * scale:  # above a point
            continue
        if sum(gaps) < best_gap:
            best, best_gap = (alpha, beta), sum(gaps)
    return best


def fit_probe(
    sizes: Sequence[float],
    samples: Sequence[Sequence[float]],
    prior: Optional[CostModel] = None,
) -> ProbeFit:
    """The cost of a collective from ``samples[i]``, the seconds of each repeat
    of a probe of ``sizes[i]`` bytes (see the module's docstring); ``prior``:
    the collective's cost over the link the user named, whose slope prices
    bytes the samples did not see.

    Raises:
        ValueError: fewer than two distinct sizes, or a size without samples.
    """
    if len(sizes) != len(samples) or len(set(sizes)) < 2:
        raise ValueError("need samples of at least two distinct sizes")
    if any(len(s) == 0 for s in samples):
        raise ValueError("every probe size needs at least one sample")
    fastest = [min(s) for s in samples]
    alpha, beta = _under(sizes, fastest)
    lo = min(range(len(sizes)), key=lambda i: sizes[i])
    hi = max(range(len(sizes)), key=lambda i: sizes[i])
    above = max(t - (alpha + beta * s) for s, t in zip(sizes, fastest))
    # The repeats' spread below the largest size: the largest one's grows with
    # its bytes on a busy link, and its fastest repeat bounds it anyway.
    spread = max(max(s) - min(s) for i, s in enumerate(samples) if i != hi)
    noise = max(spread, above)
    rise = beta * (sizes[hi] - sizes[lo])
    if rise > noise or noise == 0.0:
        return ProbeFit(CostModel(alpha, beta), True, noise, beta)
    if prior is not None and prior.beta > 0.0:
        # The named link's slope, under the fastest sample of each size; a
        # link named slower than the samples allow passes above them (through
        # the origin): the user's word over the noise, the same in every run.
        slope = prior.beta
        alpha_under = max(0.0, min(t - slope * s for s, t in zip(sizes, fastest)))
        return ProbeFit(CostModel(alpha_under, slope), False, noise, beta, "link_bandwidth")
    span = sizes[hi] - sizes[lo]
    steepest = max(beta, (fastest[hi] - fastest[lo] + noise) / span)
    if steepest * span <= 1e-9 * max(fastest):
        # The smallest probe as slow as the largest, give or take the noise:
        # the samples bound nothing but this, the largest probe's whole time
        # spent on its bytes.
        steepest = max(beta, fastest[hi] / sizes[hi])
    # Through the largest probe's fastest time: as much of it as bytes as allowed.
    alpha_at = max(0.0, fastest[hi] - steepest * sizes[hi])
    return ProbeFit(CostModel(alpha_at, steepest), False, noise, beta, "bound")


def fit_warning(
    kind: str, sizes: Sequence[float], times: Sequence[float], fit: ProbeFit
) -> Optional[str]:
    """What the planner logs (a warning) about a probe fit of ``kind``
    (``"allgather"``, ``"allreduce"``) over ``sizes`` bytes whose fastest
    repeats took ``times`` seconds, or None where the bytes were seen and cost
    something."""
    model = fit.model
    if fit.seen and model.beta > 0.0:
        return None
    probes = ", ".join(f"{s / 1024:.0f} KiB {t * 1e3:.2f} ms" for s, t in zip(sizes, times))
    if fit.priced_by == "link_bandwidth":
        return (
            f"dlgs: {kind} times did not grow with size beyond their noise ({probes}; noise "
            f"{fit.noise * 1e3:.2f} ms): the plan prices bytes at {model.beta * 1e9:.3g} ns/B, "
            "a ring over the link_bandwidth given"
        )
    if fit.seen:
        return (
            f"dlgs: {kind} times did not grow with size ({probes}), without noise: the plan "
            "treats bytes as free"
        )
    rate = f"{1e-6 / model.beta:.3g} MB/s" if model.beta > 0 else "no bound"
    return (
        f"dlgs: {kind} times did not grow with size beyond their noise ({probes}; noise "
        f"{fit.noise * 1e3:.2f} ms): the probes could not see the link's bandwidth, so the "
        f"plan prices bytes at {model.beta * 1e9:.3g} ns/B, the most the probes allow "
        f"({rate}). On a slow link the plan stays near layer-wise sparse sending; profile "
        "again with larger probes by raising profile_budget, or .dlgs.reprofile() later (on "
        "the optimizer, tape or compression object; one rank is enough)"
    )
