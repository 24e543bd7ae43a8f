"""Merge planning: which consecutive layers share one message, and whether each
message goes sparse (allgather of values and indices) or dense (allreduce).

Everything here is a pure function of numbers: the planner returns the plan
*and* the times it predicts, so it can be tested against brute force, logged,
and compared with measured iterations.

The model (one iteration, layers in gradient-ready order ``1..L``):

* one compute stream runs back-propagation; layer ``l`` takes ``backward[l]``
  seconds. When its gradient is ready, the hook sparsifies it *on the same
  stream* if its group goes sparse (``sparsify[l]`` seconds) or copies it into
  the group's buffer if the group goes dense and has several members
  (``pack[l]``); either delays every later layer;
* a group's message can start when its last member has been processed and the
  previous message has finished (one link, messages one after another);
* a message of ``b`` bytes costs ``alpha + beta * b`` (a fitted
  :class:`CostModel`; allgather and allreduce each have their own).

With ``c`` the compute clock and ``f`` the link clock after a group, a group
``(i..j, mode)`` maps ``(c, f)`` to::

    c' = c + sum(backward[i..j]) + sum(stream cost of mode over i..j)
    f' = max(f, c') + cost_mode(bytes(i..j))

Both are non-decreasing in ``(c, f)``, so a state dominated in both is never
needed: the DP keeps, for every prefix, the Pareto set of ``(c, f)`` and is
exact under the model (tests compare it with brute force over every partition
and every mode). The iteration's communication ends at ``f`` after group L.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = [
    "CostModel",
    "LayerCost",
    "PlanGroup",
    "Plan",
    "PlanSpec",
    "simulate",
    "plan_dp",
    "plan_strategy",
    "STRATEGIES",
    "fit_cost_model",
]


@dataclass(frozen=True)
class CostModel:
    """Time of one collective: ``alpha + beta * nbytes`` seconds."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        for name in ("alpha", "beta"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite float >= 0, got {v!r}")

    def __call__(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes


def fit_cost_model(sizes: Sequence[float], times: Sequence[float]) -> CostModel:
    """Least-squares fit of ``t = alpha + beta * size`` (MG-WFBP's model),
    clipped to non-negative coefficients."""
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError("need at least two (size, time) measurements of equal count")
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(times) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    if sxx == 0:
        raise ValueError("sizes must not all be equal")
    beta = max(0.0, sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sxx)
    alpha = max(0.0, my - beta * mx)
    return CostModel(alpha, beta)


@dataclass(frozen=True)
class LayerCost:
    """One layer, as the planner sees it.

    Args:
        name: parameter name.
        backward: seconds of back-propagation attributed to this layer (from
            the previous layer's gradient to this one's).
        sparse_bytes: bytes this layer adds to a sparse message (values and
            indices at its capacity, plus its header word).
        dense_bytes: bytes this layer adds to a dense message.
        sparsify: seconds to select and pack it on the compute stream.
        pack: seconds to copy it into a shared dense buffer.
    """

    name: str
    backward: float
    sparse_bytes: int
    dense_bytes: int
    sparsify: float
    pack: float = 0.0


@dataclass(frozen=True)
class PlanSpec:
    """Everything the planner needs (all times in seconds)."""

    layers: Tuple[LayerCost, ...]
    allgather: CostModel
    allreduce: CostModel
    #: Bytes of a sparse message's fixed header (the fingerprint word).
    sparse_header_bytes: int = 4

    def group_cost(self, first: int, last: int, sparse: bool) -> Tuple[float, float, int]:
        """``(compute seconds, link seconds, bytes)`` of group ``first..last``."""
        members = self.layers[first : last + 1]
        compute = sum(m.backward for m in members)
        if sparse:
            compute += sum(m.sparsify for m in members)
            nbytes = self.sparse_header_bytes + sum(m.sparse_bytes for m in members)
            return compute, self.allgather(nbytes), nbytes
        if len(members) > 1:
            compute += sum(m.pack for m in members)
        nbytes = sum(m.dense_bytes for m in members)
        return compute, self.allreduce(nbytes), nbytes


@dataclass(frozen=True)
class PlanGroup:
    """One message: layers ``first..last`` (inclusive, in ready order)."""

    first: int
    last: int
    sparse: bool
    nbytes: int
    ready: float  # when its last member has been processed
    start: float  # when its collective starts
    end: float  # when its collective ends

    @property
    def members(self) -> List[int]:
        return list(range(self.first, self.last + 1))


@dataclass(frozen=True)
class Plan:
    """A merge plan with the times the model predicts for it."""

    groups: Tuple[PlanGroup, ...]
    strategy: str = "custom"
    #: False when the DP had to thin a Pareto set (see :func:`plan_dp`).
    exact: bool = True
    end: float = field(init=False)
    compute_end: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "end", self.groups[-1].end if self.groups else 0.0)
        object.__setattr__(self, "compute_end", self.groups[-1].ready if self.groups else 0.0)

    def member_lists(self) -> List[List[int]]:
        return [g.members for g in self.groups]

    def modes(self) -> List[bool]:
        return [g.sparse for g in self.groups]

    def describe(self, names: Optional[Sequence[str]] = None) -> str:
        """A readable table of the plan and its predicted timeline."""
        lines = [
            f"strategy {self.strategy}: {len(self.groups)} messages, predicted end "
            f"{self.end * 1e3:.3f} ms (compute ends {self.compute_end * 1e3:.3f} ms)",
            f"{'#':>4} {'layers':>11} {'mode':>6} {'bytes':>12} {'ready ms':>10} "
            f"{'start ms':>10} {'end ms':>10}  first..last",
        ]
        for n, g in enumerate(self.groups):
            label = ""
            if names is not None:
                label = (
                    names[g.first] if g.first == g.last else f"{names[g.first]}..{names[g.last]}"
                )
            lines.append(
                f"{n:>4} {f'{g.first}-{g.last}':>11} {'sparse' if g.sparse else 'dense':>6} "
                f"{g.nbytes:>12} {g.ready * 1e3:>10.3f} {g.start * 1e3:>10.3f} "
                f"{g.end * 1e3:>10.3f}  {label}"
            )
        return "\n".join(lines)


Partition = Sequence[Tuple[int, int, bool]]


def simulate(
    spec: PlanSpec, partition: Partition, strategy: str = "custom", *, exact: bool = True
) -> Plan:
    """Predicted timeline of a given partition ``[(first, last, sparse), ...]``
    covering layers ``0..L-1`` in order."""
    expect = 0
    for first, last, _ in partition:
        if first != expect or last < first:
            raise ValueError(
                f"partition must cover 0..{len(spec.layers) - 1} in order: {partition}"
            )
        expect = last + 1
    if expect != len(spec.layers):
        raise ValueError(f"partition must cover 0..{len(spec.layers) - 1} in order: {partition}")
    c = f = 0.0
    groups = []
    for first, last, sparse in partition:
        compute, link, nbytes = spec.group_cost(first, last, sparse)
        c += compute
        start = max(f, c)
        f = start + link
        groups.append(PlanGroup(first, last, sparse, nbytes, c, start, f))
    return Plan(tuple(groups), strategy, exact)


def plan_dp(
    spec: PlanSpec,
    *,
    max_group: Optional[int] = None,
    max_front: int = 256,
    eligible: Optional[Sequence[bool]] = None,
) -> Plan:
    """The plan that minimises the predicted end of communication.

    A DP over prefixes that keeps, per prefix, the Pareto set of
    ``(compute clock, link clock)`` states: exact under the model as long as no
    set grows past ``max_front`` states (then it is thinned evenly, keeping
    both extremes, and ``Plan.exact`` is False). ``max_group`` bounds the
    members of one message (``None``: any). For a fixed last layer, shorter
    groups are tried first and the scan stops once even the cheapest start plus
    the link time of a longer group cannot beat the best state found, since
    a longer group only adds bytes.
    """
    if isinstance(max_front, bool) or not isinstance(max_front, int) or max_front < 2:
        raise ValueError(f"max_front must be an int >= 2, got {max_front!r}")
    if max_group is not None and (not isinstance(max_group, int) or max_group < 1):
        raise ValueError(f"max_group must be None or an int >= 1, got {max_group!r}")
    L = len(spec.layers)
    if L == 0:
        return Plan((), "dp")
    width = L if max_group is None else max_group
    # Layers that may not go sparse (below min_sparse_size: biases, norms, whose
    # updates would otherwise wait in the residual) only enter dense messages.
    barred = [0]
    for is_ok in eligible if eligible is not None else [True] * L:
        barred.append(barred[-1] + (0 if is_ok else 1))
    pre: Dict[str, List[float]] = {}
    for key in ("backward", "sparsify", "pack", "sparse_bytes", "dense_bytes"):
        acc, out = 0.0, [0.0]
        for layer in spec.layers:
            acc += getattr(layer, key)
            out.append(acc)
        pre[key] = out
    back, sprs, pack = pre["backward"], pre["sparsify"], pre["pack"]
    sb, db = pre["sparse_bytes"], pre["dense_bytes"]
    ag, ar, header = spec.allgather, spec.allreduce, spec.sparse_header_bytes
    exact = True
    # fronts[j]: Pareto states after layers 0..j-1 as (c, f, back-pointer);
    # a back-pointer is (prev_j, prev_state_index, sparse).
    fronts: List[list] = [[(0.0, 0.0, None)]]
    for j in range(L):
        cands = []
        c_min = back[j + 1]  # no state can have a smaller compute clock
        f_at_c_min = math.inf  # best link clock among states with c == c_min
        for i in range(j, max(0, j - width + 1) - 1, -1):
            b = back[j + 1] - back[i]
            link_s = ag(header + sb[j + 1] - sb[i])
            link_d = ar(db[j + 1] - db[i])
            # Any state from this or a longer group has c >= c_min and
            # f >= c_min + its link time, which only grows with the group: once
            # that is no better than a state already at c_min, all are dominated.
            if (
                c_min + (min(link_s, link_d) if barred[j + 1] == barred[i] else link_d)
                >= f_at_c_min
            ):
                break
            comp_s = b + sprs[j + 1] - sprs[i]
            comp_d = b + (pack[j + 1] - pack[i] if j > i else 0.0)
            may_sparse = barred[j + 1] == barred[i]
            for si, (c0, f0, _) in enumerate(fronts[i]):
                if may_sparse:
                    c = c0 + comp_s
                    f = (f0 if f0 > c else c) + link_s
                    cands.append((c, f, (i, si, True)))
                    if c <= c_min and f < f_at_c_min:
                        f_at_c_min = f
                c = c0 + comp_d
                f = (f0 if f0 > c else c) + link_d
                cands.append((c, f, (i, si, False)))
                if c <= c_min and f < f_at_c_min:
                    f_at_c_min = f
        front = _pareto(cands)
        if len(front) > max_front:
            exact = False
            step = (len(front) - 1) / (max_front - 1)
            front = [front[round(t * step)] for t in range(max_front)]
        fronts.append(front)
    best = min(range(len(fronts[L])), key=lambda s: (fronts[L][s][1], fronts[L][s][0]))
    parts: List[Tuple[int, int, bool]] = []
    j, s = L, best
    while j > 0:
        bp = fronts[j][s][2]
        i, si, sparse = bp
        parts.append((i, j - 1, sparse))
        j, s = i, si
    parts.reverse()
    plan = simulate(spec, parts, "dp", exact=exact)
    if not exact:
        # A thinned front can miss the optimum; never return worse than the
        # simple plans the search space contains.
        ok = list(eligible) if eligible is not None else [True] * L
        for part in (_none(spec, ok), [(i, i, False) for i in range(L)]):
            other = simulate(spec, part, "dp", exact=False)
            if other.end < plan.end:
                plan = other
    return plan


def _clocks(state):
    return state[0], state[1]


def _pareto(cands):
    """States not dominated in both clocks, sorted by compute clock."""
    cands.sort(key=_clocks)
    front = []
    best_f = math.inf
    for cand in cands:
        if cand[1] < best_f:
            front.append(cand)
            best_f = cand[1]
    return front


# -- baseline strategies --------------------------------------------------------


def _modes_for(spec: PlanSpec, groups: List[Tuple[int, int]], eligible: Sequence[bool]):
    """Sparse for groups of sparse-eligible layers, dense otherwise."""
    return [(i, j, all(eligible[i : j + 1])) for i, j in groups]


def _none(spec, eligible, **_):
    return _modes_for(spec, [(i, i) for i in range(len(spec.layers))], eligible)


def _all(spec, eligible, **_):
    # Eligible layers merged into runs; ineligible (small) layers dense alone.
    groups, run = [], None
    for i, ok in enumerate(eligible):
        if ok:
            run = (run[0], i) if run else (i, i)
        else:
            if run:
                groups.append(run)
                run = None
            groups.append((i, i))
    if run:
        groups.append(run)
    return _modes_for(spec, groups, eligible)


def _buckets(spec, eligible, *, bucket_elements: int = 8192, numel: Sequence[int] = (), **_):
    """OMGS-SGD-style fixed-size merging: consecutive eligible layers until a
    bucket holds at least ``bucket_elements`` elements."""
    groups, run, size = [], None, 0
    for i, ok in enumerate(eligible):
        if not ok:
            if run:
                groups.append(run)
                run, size = None, 0
            groups.append((i, i))
            continue
        run = (run[0], i) if run else (i, i)
        size += numel[i] if numel else 0
        if size >= bucket_elements:
            groups.append(run)
            run, size = None, 0
    if run:
        groups.append(run)
    return _modes_for(spec, groups, eligible)


def _greedy(spec, eligible, **_):
    """MG-WFBP / OMGS merge rule, applied in ready order: merge layer ``l`` into
    the open group when the start latency it saves exceeds the wait it adds
    (its backward and sparsification time, minus the link's idle time)."""
    part = simulate(spec, _none(spec, eligible))
    groups: List[List[int]] = []
    for g in part.groups:
        i = g.first
        if groups and eligible[i] and all(eligible[m] for m in groups[-1]):
            trial = [(m[0], m[-1]) for m in groups] + [(g.first, g.last)]
            merged = [(m[0], m[-1]) for m in groups[:-1]] + [(groups[-1][0], i)]
            t_sep = simulate(spec, _modes_for(spec, trial + _rest(trial, spec), eligible))
            t_mrg = simulate(spec, _modes_for(spec, merged + _rest(merged, spec), eligible))
            if t_mrg.groups[len(merged) - 1].end <= t_sep.groups[len(trial) - 1].end:
                groups[-1].append(i)
                continue
        groups.append([i])
    return _modes_for(spec, [(m[0], m[-1]) for m in groups], eligible)


def _rest(groups, spec):
    last = groups[-1][1]
    return [(i, i) for i in range(last + 1, len(spec.layers))]


STRATEGIES: Dict[str, Callable[..., Partition]] = {
    "none": _none,
    "all": _all,
    "buckets": _buckets,
    "greedy": _greedy,
}


def plan_strategy(
    spec: PlanSpec,
    strategy: str,
    *,
    eligible: Optional[Sequence[bool]] = None,
    bucket_elements: int = 8192,
    numel: Sequence[int] = (),
    max_group: Optional[int] = None,
    max_front: int = 256,
) -> Plan:
    """The plan of a named strategy: ``dp`` (optimal under the model), ``none``
    (layer-wise), ``all`` (one message), ``buckets`` (fixed-size merging) or
    ``greedy`` (the MG-WFBP / OMGS merge rule).

    ``eligible[l]`` says whether layer ``l`` may go sparse in the baseline
    strategies (``dp`` chooses every group's mode itself).
    """
    if strategy == "dp":
        return plan_dp(spec, max_group=max_group, max_front=max_front, eligible=eligible)
    if strategy == "buckets" and len(numel) != len(spec.layers):
        raise ValueError("merge='buckets' needs numel, the element count of every layer")
    if strategy not in STRATEGIES:
        names = ", ".join(repr(s) for s in ("dp", *STRATEGIES))
        raise ValueError(f"merge must be one of {names}, got {strategy!r}")
    ok = list(eligible) if eligible is not None else [True] * len(spec.layers)
    part = STRATEGIES[strategy](spec, ok, bucket_elements=bucket_elements, numel=numel)
    return simulate(spec, part, strategy)
