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

Horovod negotiates every request queued when one of its cycles starts at
once, so a message that waited behind the previous one costs less than
``alpha`` (``CostModel.batched``, measured by probing several collectives at
once). :func:`simulate` predicts with that; the DP's search does not (its
states would have to carry when each batch was formed) and stays exact under
per-message ``alpha``, which never under-charges a plan; its result is then
the better, under the full model, of its plan and the layer-wise ones.

The core stays free of any deep-learning framework; the DP uses numpy (a
dependency of both torch and TensorFlow) to extend whole Pareto sets at once,
which makes 1,000-layer models plannable in about 0.1 s (see
``benchmarks/planner.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union, cast

import numpy as np

__all__ = [
    "CostModel",
    "add_costs",
    "envelope",
    "scale_cost",
    "LayerCost",
    "Part",
    "PlanGroup",
    "Plan",
    "PlanSpec",
    "simulate",
    "plan_dp",
    "plan_strategy",
    "sparse_transport",
    "STRATEGIES",
    "fit_cost_model",
]


@dataclass(frozen=True)
class CostModel:
    """Time of one collective: ``alpha + beta * nbytes`` seconds, or the least
    of several such lines where the library picks an algorithm by size.

    ``others``: the ``(alpha, beta)`` of the other algorithms a library
    chooses between (e.g. NCCL's tree and ring, MPI's recursive doubling and
    ring; :mod:`~dlgs.core.planning.netmodel`): the collective takes the
    fastest at each size, so the cost is the lower envelope of the lines.
    A fitted model has one line.

    ``batched``: the latency of a collective that joins a batch Horovod has
    already formed (its background thread negotiates every request that is
    queued when a cycle starts, once, then runs them one after another, or
    fused), in seconds; ``None`` (the default) when unknown, which charges
    every collective ``alpha``. Measured by probing several collectives at
    once (:class:`~dlgs.core.planning.online.OnlinePlanner`).
    """

    alpha: float
    beta: float
    batched: Optional[float] = None
    others: Tuple[Tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "batched"):
            v = getattr(self, name)
            if v is None and name == "batched":
                continue
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite float >= 0, got {v!r}")
        for line in self.others:
            if len(line) != 2 or not all(math.isfinite(v) and v >= 0 for v in line):
                raise ValueError(f"others must hold (alpha, beta) pairs >= 0, got {line!r}")

    @property
    def lines(self) -> Tuple[Tuple[float, float], ...]:
        """Every ``(alpha, beta)`` the collective chooses between."""
        return ((self.alpha, self.beta),) + tuple(self.others)

    @property
    def least_alpha(self) -> float:
        """The smallest latency of any line (a lower bound at every size)."""
        return min(a for a, _ in self.lines)

    @property
    def least_beta(self) -> float:
        """The smallest per-byte cost of any line (a lower bound at every size)."""
        return min(b for _, b in self.lines)

    def __call__(self, nbytes: Any) -> Any:
        t = self.alpha + self.beta * nbytes
        for a, b in self.others:
            t = np.minimum(t, a + b * nbytes)
        return t

    def in_batch(self, nbytes: float) -> float:
        """Time of a collective of ``nbytes`` that joins a batch already formed."""
        latency = self.alpha if self.batched is None else self.batched
        return min([latency + self.beta * nbytes] + [a + b * nbytes for a, b in self.others])


def envelope(lines: Sequence[Tuple[float, float]]) -> CostModel:
    """The collective that takes the fastest of ``lines`` (``(alpha, beta)``
    pairs), without those another beats at every size."""
    kept = sorted(set(lines))
    kept = [ab for ab in kept if not any(o != ab and o[0] <= ab[0] and o[1] <= ab[1] for o in kept)]
    best = min(kept)
    return CostModel(best[0], best[1], others=tuple(ab for ab in kept if ab != best))


def add_costs(a: CostModel, b: CostModel, scale: float = 1.0) -> CostModel:
    """One collective after the other: ``a(x) + b(scale * x)``. The least of
    lines plus the least of lines is the least over every pair of them."""
    if a.batched is not None or b.batched is not None:
        raise ValueError("add_costs takes models without a batched latency")
    return envelope([(a1 + a2, b1 + scale * b2) for a1, b1 in a.lines for a2, b2 in b.lines])


def scale_cost(c: CostModel, alpha: float, beta: float) -> CostModel:
    """Every line's latency times ``alpha`` and per-byte cost times ``beta``."""
    batched = None if c.batched is None else alpha * c.batched
    lines = [(alpha * a, beta * b) for a, b in c.lines]
    out = envelope(lines)
    return CostModel(out.alpha, out.beta, batched, out.others)


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


def sparse_transport(allgather: CostModel, reduction: Optional[CostModel], nbytes: float) -> str:
    """``"reduce"`` where a sparse message of ``nbytes`` (flat chunk bytes
    from one rank) is predicted faster by the reduction than by the
    allgather, else ``"allgather"``: the one rule the planner and
    ``transport="auto"`` (:mod:`dlgs.core.transport.routing`) choose by."""
    if reduction is not None and reduction(nbytes) < allgather(nbytes):
        return "reduce"
    return "allgather"


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
    #: Seconds the compute stream loses per byte a message sends (the CPU
    #: that communication takes from back-propagation where they share
    #: cores), charged when the message is sent; 0 where compute has cores
    #: (or a device) of its own.
    contention: float = 0.0
    #: The sparse reduction by regions (``transport="reduce"``), as a
    #: function of the same bytes ``allgather`` takes (a message's flat chunk
    #: from one rank; :func:`~dlgs.core.planning.netmodel.reduction_cost`), or None: a
    #: sparse message then always travels by allgather. Where set, each
    #: sparse message takes whichever of the two the model finds faster.
    reduction: Optional[CostModel] = None

    def sparse_model(self, nbytes: float) -> Tuple[CostModel, str]:
        """The collective a sparse message of ``nbytes`` (flat chunk bytes)
        travels by, and its transport's name: the allgather, or the reduction
        where it is set and predicted faster."""
        if sparse_transport(self.allgather, self.reduction, nbytes) == "reduce":
            assert self.reduction is not None
            return self.reduction, "reduce"
        return self.allgather, "allgather"

    def sparse_link(self, nbytes: Any) -> Any:
        """Link seconds of sparse messages of ``nbytes`` (a float or a numpy
        array): the faster of the allgather and the reduction."""
        t = self.allgather(nbytes)
        return t if self.reduction is None else np.minimum(t, self.reduction(nbytes))

    def group_cost(self, first: int, last: int, sparse: bool) -> Tuple[float, float, int]:
        """``(compute seconds, link seconds, bytes)`` of group ``first..last``."""
        members = self.layers[first : last + 1]
        compute = sum(m.backward for m in members)
        if sparse:
            compute += sum(m.sparsify for m in members)
            nbytes = self.sparse_header_bytes + sum(m.sparse_bytes for m in members)
            return compute + self.contention * nbytes, self.sparse_model(nbytes)[0](nbytes), nbytes
        if len(members) > 1:
            compute += sum(m.pack for m in members)
        nbytes = sum(m.dense_bytes for m in members)
        return compute + self.contention * nbytes, self.allreduce(nbytes), nbytes


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
    #: How it travels: ``"allreduce"`` (dense), ``"allgather"`` or ``"reduce"``.
    transport: str = ""
    #: Its members where they are not ``first..last`` (the fused tail of small
    #: layers, :func:`plan_dp`), else empty.
    layers: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.transport:
            object.__setattr__(self, "transport", "allgather" if self.sparse else "allreduce")

    @property
    def members(self) -> List[int]:
        return list(self.layers) if self.layers else list(range(self.first, self.last + 1))

    @property
    def part(self) -> "Part":
        """This group as :func:`simulate` takes it."""
        if self.layers:
            return (tuple(self.layers), self.sparse)
        return (self.first, self.last, self.sparse)


@dataclass(frozen=True)
class Plan:
    """A merge plan with the times the model predicts for it."""

    groups: Tuple[PlanGroup, ...]
    strategy: str = "custom"
    #: False when the DP had to thin a Pareto set (see :func:`plan_dp`).
    exact: bool = True
    #: Layer names in ready order (what ``first``/``last`` index), when known.
    names: Tuple[str, ...] = ()
    end: float = field(init=False)
    compute_end: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "end", self.groups[-1].end if self.groups else 0.0)
        object.__setattr__(self, "compute_end", self.groups[-1].ready if self.groups else 0.0)

    def modes(self) -> List[bool]:
        return [g.sparse for g in self.groups]

    def partition(self) -> List["Part"]:
        """Its groups as :func:`simulate` takes them (to price it again)."""
        return [g.part for g in self.groups]

    def describe(self, names: Optional[Sequence[str]] = None) -> str:
        """A readable table of the plan and its predicted timeline (times in
        milliseconds from the first gradient; ``bytes``: what one rank sends
        in the message). ``names``: layer names in ready order, the order of
        ``first``/``last`` (default: :attr:`names`, filled in by
        :func:`plan_strategy`)."""
        if names is None and self.names:
            names = self.names
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
            if g.layers:  # some of first..last: the fused tail, or layers around it
                label = f"{label} ({len(g.layers)} of {g.last - g.first + 1} layers)"
            lines.append(
                f"{n:>4} {f'{g.first}-{g.last}':>11} {_MODES[g.transport]:>6} "
                f"{g.nbytes:>12} {g.ready * 1e3:>10.3f} {g.start * 1e3:>10.3f} "
                f"{g.end * 1e3:>10.3f}  {label}"
            )
        if any(g.layers for g in self.groups):
            lines.append(
                "(k of n layers): the small layers (below min_sparse_size) travel in one "
                "fused message; a group around them skips them"
            )
        return "\n".join(lines)


#: A group as :func:`simulate` takes it: ``(first, last, sparse)`` for layers
#: ``first..last``, or ``(members, sparse)`` for any set of them (the fused tail).
Part = Union[Tuple[int, int, bool], Tuple[Tuple[int, ...], bool]]
Partition = Sequence[Tuple[int, int, bool]]

#: A message's mode in :meth:`Plan.describe`, by transport.
_MODES = {"allreduce": "dense", "allgather": "sparse", "reduce": "reduce"}


def simulate(
    spec: PlanSpec,
    partition: Sequence[Part],
    strategy: str = "custom",
    *,
    exact: bool = True,
    batching: bool = True,
) -> Plan:
    """Predicted timeline of a given partition ``[(first, last, sparse), ...]``
    covering layers ``0..L-1`` in order; a group may instead be ``(members,
    sparse)``, any set of layers (the fused tail), and is then ready when its
    last member has been processed (messages go in the order they are ready).

    With ``batching`` (and a cost model that knows ``batched``), a message
    that was ready when the batch in flight was formed -- it waited behind
    the previous message -- joins that batch: Horovod negotiates it in the
    same cycle, so it costs ``CostModel.in_batch`` instead of ``alpha``.
    ``batching=False`` charges every message ``alpha`` (the DP's model)."""
    if any(len(part) == 2 for part in partition):
        return _simulate_sets(spec, partition, strategy, exact, batching)
    runs = cast(Partition, partition)
    expect = 0
    for first, last, _ in runs:
        if first != expect or last < first:
            raise ValueError(
                f"partition must cover 0..{len(spec.layers) - 1} in order: {partition}"
            )
        expect = last + 1
    if expect != len(spec.layers):
        raise ValueError(f"partition must cover 0..{len(spec.layers) - 1} in order: {partition}")
    c = f = 0.0
    formed = -math.inf  # when the batch in flight was formed
    groups = []
    for first, last, sparse in runs:
        compute, link, nbytes = spec.group_cost(first, last, sparse)
        c += compute
        model, transport = spec.sparse_model(nbytes) if sparse else (spec.allreduce, "allreduce")
        if batching and model.batched is not None and c <= formed:
            start = f  # queued when the batch was formed: negotiated with it
            link = model.in_batch(nbytes)
        else:
            start = formed = max(f, c)
        f = start + link
        groups.append(PlanGroup(first, last, sparse, nbytes, c, start, f, transport))
    return Plan(tuple(groups), strategy, exact)


def _simulate_sets(
    spec: PlanSpec,
    partition: Sequence[Part],
    strategy: str,
    exact: bool,
    batching: bool,
) -> Plan:
    """:func:`simulate` for groups given as sets of layers (any of them may be
    ``(first, last, sparse)``): the compute stream processes the layers in
    ready order, each with its group's stream cost, and a group's message is
    ready after its last member (its contention charged then)."""
    L = len(spec.layers)
    sets: List[Tuple[List[int], bool]] = []
    for part in partition:
        if len(part) == 3:
            first, last, sparse = part  # type: ignore[misc]
            sets.append((list(range(first, last + 1)), bool(sparse)))
        else:
            listed, sparse = part  # type: ignore[misc]
            sets.append((sorted(int(i) for i in listed), bool(sparse)))
    flat = [i for members, _ in sets for i in members]
    if sorted(flat) != list(range(L)) or any(not members for members, _ in sets):
        raise ValueError(f"partition must cover 0..{L - 1}, each layer once: {partition}")
    group_of = [0] * L
    for g, (members, _) in enumerate(sets):
        for i in members:
            group_of[i] = g
    header = spec.sparse_header_bytes
    sizes = [
        header + sum(spec.layers[i].sparse_bytes for i in m)
        if sparse
        else sum(spec.layers[i].dense_bytes for i in m)
        for m, sparse in sets
    ]
    c = f = 0.0
    formed = -math.inf
    groups = []
    done = 0  # layers processed so far
    for g in sorted(range(len(sets)), key=lambda g: sets[g][0][-1]):
        members, sparse = sets[g]
        for i in range(done, members[-1] + 1):
            m, (own, own_sparse) = spec.layers[i], sets[group_of[i]]
            c += m.backward
            if own_sparse:
                c += m.sparsify
            elif len(own) > 1:
                c += m.pack
        done = members[-1] + 1
        nbytes = sizes[g]
        c += spec.contention * nbytes
        model, transport = spec.sparse_model(nbytes) if sparse else (spec.allreduce, "allreduce")
        link = model(nbytes)
        if batching and model.batched is not None and c <= formed:
            start = f
            link = model.in_batch(nbytes)
        else:
            start = formed = max(f, c)
        f = start + link
        contiguous = members == list(range(members[0], members[-1] + 1))
        layers = () if contiguous else tuple(members)
        groups.append(
            PlanGroup(members[0], members[-1], sparse, nbytes, c, start, f, transport, layers)
        )
    return Plan(tuple(groups), strategy, exact)


def plan_dp(
    spec: PlanSpec,
    *,
    max_group: Optional[int] = None,
    max_front: int = 256,
    eligible: Optional[Sequence[bool]] = None,
    tail: bool = True,
    keep_sparse: bool = False,
) -> Plan:
    """The plan that minimises the predicted end of communication.

    A DP over prefixes that keeps, per prefix, the Pareto set of
    ``(compute clock, link clock)`` states, vectorised with numpy: for the
    last layer ``j`` of a group, every state of every admissible first layer
    ``i`` is extended at once, in both modes, and the non-dominated results
    become prefix ``j + 1``'s set.

    Exact under the model as long as no set grows past ``max_front`` states
    (``Plan.exact`` is then True). Otherwise the set keeps the ``max_front``
    states with the smallest lower bound on the iteration's end (the larger of
    ``f`` plus the least link time still to come and ``c`` plus the backward
    time still to come), and ``Plan.exact`` is False; the result is still never
    worse than the layer-wise plans. ``max_group`` bounds the members of one
    message (``None``: any).

    Pruning that keeps exactness: the best of the layer-wise plans is an upper
    bound ``U`` on the optimum, so a state whose lower bound exceeds ``U`` and a
    group whose cheapest possible completion exceeds ``U`` are never extended.

    With ``tail`` (and no ``max_group``), the layers that may not go sparse
    (``eligible`` False: those below ``min_sparse_size``) may also travel as
    one fused dense message, wherever they lie, sent when the last of them is
    ready, instead of one message per run of them: at scale each message
    pays a latency that grows with the ranks. The DP prices that choice by
    the same search over a model in which the small layers are one layer at
    the position of the last of them (their back-propagation and packing
    charged where they run), which is exact for every plan with that tail
    (each of its groups may still take neighbouring large layers, dense);
    the better of the two searches is the plan.

    With ``keep_sparse`` an eligible layer never enters a dense message (a
    byte budget: the plan sends no more than sparse sending of every eligible
    layer would); groups of them still merge.
    """
    if isinstance(max_front, bool) or not isinstance(max_front, int) or max_front < 2:
        raise ValueError(f"max_front must be an int >= 2, got {max_front!r}")
    if max_group is not None and (
        isinstance(max_group, bool) or not isinstance(max_group, int) or max_group < 1
    ):
        raise ValueError(f"max_group must be None or an int >= 1, got {max_group!r}")
    L = len(spec.layers)
    if L == 0:
        return Plan((), "dp")
    width = L if max_group is None else max_group
    ok = [bool(e) for e in eligible] if eligible is not None else [True] * L
    if len(ok) != L:
        raise ValueError(f"eligible must have one entry per layer ({L}), got {len(ok)}")
    partition, exact = _search(spec, ok, width, max_front, keep_sparse)
    # The final choice and its times use the full model (batching included):
    # the DP's partition, a layer-wise one or (without max_group) one message
    # for every eligible layer, or the plan with the fused tail, whichever is
    # predicted to end first (the earlier in this list on a tie).
    fixed = _layerwise(spec, ok, keep_sparse) + ([_all(spec, ok)] if max_group is None else [])
    candidates = [simulate(spec, part, "dp", exact=exact) for part in fixed]
    if partition is not None:
        candidates.insert(0, simulate(spec, partition, "dp", exact=exact))
    if tail and max_group is None:
        fused = _with_tail(spec, ok, max_front, keep_sparse)
        if fused is not None:
            candidates.append(fused)
    return min(candidates, key=lambda p: p.end)


def _with_tail(
    spec: PlanSpec, ok: Sequence[bool], max_front: int, keep_sparse: bool = False
) -> Optional[Plan]:
    """The best plan in which every ineligible layer travels in one dense
    message (:func:`plan_dp`'s ``tail``), or None with fewer than two of them."""
    small = [i for i, e in enumerate(ok) if not e]
    if len(small) < 2:
        return None
    layers: List[LayerCost] = []
    stands_for: List[List[int]] = []
    carry = 0.0  # small layers' stream time before the next layer of the model
    for i, m in enumerate(spec.layers):
        if ok[i]:
            layers.append(replace(m, backward=m.backward + carry))
            stands_for.append([i])
            carry = 0.0
            continue
        carry += m.backward + m.pack  # the tail has several members: packed
        if i == small[-1]:
            dense = sum(spec.layers[j].dense_bytes for j in small)
            layers.append(LayerCost("(small layers)", carry, 0, dense, 0.0, 0.0))
            stands_for.append(small)
            carry = 0.0
    reduced = replace(spec, layers=tuple(layers))
    eligible = [len(members) == 1 and ok[members[0]] for members in stands_for]
    partition, exact = _search(reduced, eligible, len(layers), max_front, keep_sparse)
    if partition is None:
        return None
    parts = [
        (tuple(sorted(i for k in range(a, b + 1) for i in stands_for[k])), sparse)
        for a, b, sparse in partition
    ]
    return simulate(spec, parts, "dp", exact=exact)


def _search(
    spec: PlanSpec, ok: Sequence[bool], width: int, max_front: int, keep_sparse: bool = False
) -> Tuple[Optional[List[Tuple[int, int, bool]]], bool]:
    """The DP's search (see :func:`plan_dp`): its partition under per-message
    ``alpha`` (None if the bound pruned every plan) and whether it is exact."""
    L = len(spec.layers)
    # Layers that may not go sparse (below min_sparse_size: biases, norms, whose
    # updates would otherwise wait in the residual) only enter dense messages;
    # a group may go sparse iff no barred layer lies in it. With keep_sparse,
    # the other way round too: a group may go dense iff no eligible layer does.
    barred = np.concatenate(([0], np.cumsum([0 if e else 1 for e in ok])))
    kept = np.concatenate(([0], np.cumsum([1 if e and keep_sparse else 0 for e in ok])))

    def prefix(key: str) -> "np.ndarray":
        values = np.array([getattr(m, key) for m in spec.layers], dtype=np.float64)
        return np.concatenate(([0.0], np.cumsum(values)))

    back, sprs, pack = prefix("backward"), prefix("sparsify"), prefix("pack")
    sb, db = prefix("sparse_bytes"), prefix("dense_bytes")
    ag, ar = spec.allgather, spec.allreduce
    header = float(spec.sparse_header_bytes)

    # The search charges every message alpha (batching=False): its states
    # (compute clock, link clock) would not carry when a batch was formed.
    simple = [
        simulate(spec, part, "dp", exact=False, batching=False)
        for part in _layerwise(spec, ok, keep_sparse)
    ]
    # (With a hair of slack so that rounding never prunes the bound's own states.)
    bound = min(p.end for p in simple) * (1 + 1e-12)
    # Least link time still needed after prefix j: every remaining layer in its
    # cheaper mode at the bandwidth term, plus one message's latency.
    red = spec.reduction if spec.reduction is not None else ag
    sparse_beta = min(ag.least_beta, red.least_beta)
    least_alpha = min(ag.least_alpha, red.least_alpha, ar.least_alpha)
    per_layer = np.minimum(
        np.where(ok, sparse_beta * np.diff(sb), np.inf),
        np.where(np.diff(kept) == 0, ar.least_beta * np.diff(db), np.inf),
    )
    link_after = np.concatenate((np.cumsum(per_layer[::-1])[::-1] + least_alpha, [0]))
    back_after = back[L] - back

    # All states of all prefixes, appended prefix by prefix: prefix j's set is
    # rows start[j]:start[j + 1]. Each row: clocks, its prefix, its parent row
    # and the mode of the group that produced it.
    store = _States(1 + L * min(max_front, 64))
    store.push(np.zeros(1), np.zeros(1), 0, np.array([-1]), np.zeros(1, dtype=bool))
    start = [0, 1]
    exact = True
    for j in range(L):
        first = np.arange(max(0, j - width + 1), j + 1)
        may_sparse = barred[first] == barred[j + 1]
        cheapest = np.minimum(
            np.where(may_sparse, spec.sparse_link(header + sb[j + 1] - sb[first]), np.inf),
            np.where(kept[first] == kept[j + 1], ar(db[j + 1] - db[first]), np.inf),
        )
        # A longer group only adds link time: cut those that cannot beat the bound.
        hopeless = np.nonzero(back[j + 1] + cheapest + link_after[j + 1] > bound)[0]
        lo = int(first[hopeless[-1]]) + 1 if hopeless.size else int(first[0])
        lo = min(lo, j)
        rows = np.arange(start[lo], start[j + 1])
        c0, f0, i = store.c[rows], store.f[rows], store.prefix[rows]
        b = back[j + 1] - back[i]
        sparse_ok = barred[i] == barred[j + 1]
        dense_ok = kept[i] == kept[j + 1]
        gamma = spec.contention
        c_s = c0 + b + (sprs[j + 1] - sprs[i]) + gamma * (header + sb[j + 1] - sb[i])
        f_s = np.maximum(f0, c_s) + spec.sparse_link(header + sb[j + 1] - sb[i])
        c_d = c0 + b + np.where(i < j, pack[j + 1] - pack[i], 0.0) + gamma * (db[j + 1] - db[i])
        f_d = np.maximum(f0, c_d) + ar(db[j + 1] - db[i])
        c = np.concatenate((c_s[sparse_ok], c_d[dense_ok]))
        f = np.concatenate((f_s[sparse_ok], f_d[dense_ok]))
        parent = np.concatenate((rows[sparse_ok], rows[dense_ok]))
        sparse = np.concatenate(
            (np.ones(int(sparse_ok.sum()), bool), np.zeros(int(dense_ok.sum()), bool))
        )
        lower = np.maximum(f + link_after[j + 1], c + back_after[j + 1])
        keep = _pareto(c, f, lower <= bound)
        if keep.size > max_front:
            exact = False
            best = np.argpartition(lower[keep], max_front - 1)[:max_front]
            keep = keep[np.sort(best)]
        store.push(c[keep], f[keep], j + 1, parent[keep], sparse[keep])
        start.append(store.size)
        if 0 < L - j - 1 <= width and keep.size:
            # Completing any kept state with all remaining layers in one message is
            # a plan in the search space: its end tightens the bound as we go.
            bound = min(
                bound,
                _one_message_end(spec, keep, c, f, j + 1, back, sprs, pack, sb, db, barred, kept),
            )
    if start[L] < start[L + 1]:
        return store.partition(start[L], start[L + 1]), exact
    return None, exact


def _one_message_end(spec, keep, c, f, j, back, sprs, pack, sb, db, barred, kept) -> float:
    """Least end over states ``keep`` of sending layers ``j..L-1`` as one message."""
    L = len(spec.layers)
    ck, fk = c[keep], f[keep]
    gamma = spec.contention
    end = math.inf
    if kept[L] == kept[j]:
        c_d = ck + (back[L] - back[j]) + (pack[L] - pack[j] if L - j > 1 else 0.0)
        c_d = c_d + gamma * (db[L] - db[j])
        end = float(np.min(np.maximum(fk, c_d))) + spec.allreduce(db[L] - db[j])
    if barred[L] == barred[j]:
        nbytes = spec.sparse_header_bytes + sb[L] - sb[j]
        c_s = ck + (back[L] - back[j]) + (sprs[L] - sprs[j]) + gamma * nbytes
        link = spec.sparse_link(nbytes)
        end = min(end, float(np.min(np.maximum(fk, c_s))) + link)
    return end * (1 + 1e-12)


class _States:
    """Growable columns of DP states (clocks, prefix, parent row, mode)."""

    def __init__(self, capacity: int) -> None:
        self.size = 0
        self.c = np.empty(capacity)
        self.f = np.empty(capacity)
        self.prefix = np.empty(capacity, dtype=np.int64)
        self.parent = np.empty(capacity, dtype=np.int64)
        self.sparse = np.empty(capacity, dtype=bool)

    def push(self, c, f, prefix: int, parent, sparse) -> None:
        n = len(c)
        if self.size + n > len(self.c):
            grow = max(2 * len(self.c), self.size + n)
            for name in ("c", "f", "prefix", "parent", "sparse"):
                old = getattr(self, name)
                new = np.empty(grow, dtype=old.dtype)
                new[: self.size] = old[: self.size]
                setattr(self, name, new)
        end = self.size + n
        self.c[self.size : end] = c
        self.f[self.size : end] = f
        self.prefix[self.size : end] = prefix
        self.parent[self.size : end] = parent
        self.sparse[self.size : end] = sparse
        self.size = end

    def partition(self, lo: int, hi: int) -> List[Tuple[int, int, bool]]:
        """Groups leading to the final state with the earliest link clock."""
        row = lo + int(np.lexsort((self.c[lo:hi], self.f[lo:hi]))[0])
        parts = []
        while self.parent[row] >= 0:
            up = int(self.parent[row])
            parts.append((int(self.prefix[up]), int(self.prefix[row]) - 1, bool(self.sparse[row])))
            row = up
        parts.reverse()
        return parts


def _pareto(c, f, alive):
    """Indices of the states not dominated in both clocks, by compute clock."""
    idx = np.nonzero(alive)[0]
    if idx.size == 0:
        return idx
    # Ties in c are rare (then a dominated state may survive: harmless).
    order = idx[np.argsort(c[idx])]
    fo = f[order]
    before = np.minimum.accumulate(np.concatenate(([np.inf], fo[:-1])))
    return order[fo < before]


def _layerwise(
    spec: PlanSpec, eligible: Sequence[bool], keep_sparse: bool = False
) -> List[Partition]:
    """The plans the DP's search space always contains and bounds itself by
    (every layer dense is not one of them with ``keep_sparse``)."""
    L = len(spec.layers)
    dense = [] if keep_sparse and any(eligible) else [[(i, i, False) for i in range(L)]]
    return [_none(spec, eligible)] + dense


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
    keep_sparse: bool = False,
) -> Plan:
    """The plan of a named strategy: ``dp`` (optimal under the model), ``none``
    (layer-wise), ``all`` (one message), ``buckets`` (fixed-size merging) or
    ``greedy`` (the MG-WFBP / OMGS merge rule).

    ``eligible[l]`` says whether layer ``l`` may go sparse in the baseline
    strategies (``dp`` chooses every group's mode itself; with
    ``keep_sparse`` never dense for an eligible layer, as the others do).
    """
    names = tuple(layer.name for layer in spec.layers)
    if strategy == "dp":
        plan = plan_dp(
            spec,
            max_group=max_group,
            max_front=max_front,
            eligible=eligible,
            keep_sparse=keep_sparse,
        )
        return replace(plan, names=names)
    if strategy == "buckets" and len(numel) != len(spec.layers):
        raise ValueError("merge='buckets' needs numel, the element count of every layer")
    if strategy not in STRATEGIES:
        known = ", ".join(repr(s) for s in ("dp", *STRATEGIES))
        raise ValueError(f"merge must be one of {known}, got {strategy!r}")
    ok = list(eligible) if eligible is not None else [True] * len(spec.layers)
    part = STRATEGIES[strategy](spec, ok, bucket_elements=bucket_elements, numel=numel)
    return replace(simulate(spec, part, strategy), names=names)
