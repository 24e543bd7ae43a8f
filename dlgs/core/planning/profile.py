"""Measured costs of one job, and the planner input built from them.

A :class:`Profile` is what the online profiler measures (per-layer backward
times, the sparsify and pack cost per element, the fitted collectives at the
job's real world size) in a form that can be saved as JSON, broadcast to every
rank, and turned into a :class:`~dlgs.core.planning.dp.PlanSpec` for any density.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .._checks import check_float, check_int
from ..config import SparsityConfig
from ..wire import dense_itemsize, per_layer, plan_layers
from .dp import CostModel, LayerCost, Part, Plan, PlanSpec, plan_strategy, simulate
from .netmodel import reduction_cost

__all__ = [
    "AUTO_LADDER",
    "DensityChoice",
    "LayerProfile",
    "Profile",
    "build_spec",
    "choose_density",
    "calibrate",
    "contention",
    "fit_link",
    "plan_at",
    "raise_layers",
    "rescale",
    "PROFILE_VERSION",
    "PRICED_BY",
    "cost_model_from_dict",
    "costs_from_dict",
    "known_fields",
    "valid_field",
    "read_json",
    "priced_by_from",
]

PROFILE_VERSION = 1


@dataclass(frozen=True)
class LayerProfile:
    """One layer in gradient-ready order: its size and backward seconds."""

    name: str
    numel: int
    backward: float


@dataclass(frozen=True)
class Profile:
    """Costs of one job on its real ranks and network.

    Attributes:
        world_size: ranks the collectives were measured with.
        layers: in gradient-ready order.
        sparsify: seconds to select and pack a layer vs its element count.
        pack: seconds to copy a layer into a shared dense buffer vs elements.
        allgather: seconds vs bytes of one rank's chunk.
        allreduce: seconds vs bytes of the buffer.
        contention: seconds of compute lost per byte sent (``PlanSpec.contention``),
            from back-propagation timed under two layouts (:func:`contention`);
            0 if none.
        priced_by: what priced the bytes of ``allgather`` and of
            ``allreduce``: ``"probes"`` (the probes saw them), ``"bound"``
            (they did not: the most their samples allow) or
            ``"link_bandwidth"`` (they did not: a ring over the link the user
            named; see :func:`~dlgs.core.planning.probefit.fit_probe`), or
            ``"steps"`` (raised by :func:`fit_link` from steps that ended later
            than predicted).
    """

    world_size: int
    layers: Tuple[LayerProfile, ...]
    sparsify: CostModel
    pack: CostModel
    allgather: CostModel
    allreduce: CostModel
    contention: float = 0.0
    priced_by: Tuple[str, str] = ("probes", "probes")

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["version"] = PROFILE_VERSION
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Profile":
        """The profile saved by :meth:`to_dict`, validated field by field.

        Raises:
            ValueError: a missing, unknown or malformed field; the message
                names it (e.g. ``layers[3].numel``) and what it accepts.
        """
        if not isinstance(d, dict):
            raise ValueError(f"a profile must be a JSON object, got {type(d).__name__}")
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version must be {PROFILE_VERSION}, got {d.get('version')!r}")
        known_fields(
            "profile",
            d,
            ("version", "world_size", "layers", *_COST_FIELDS, "contention", "priced_by"),
            optional=("version", "contention", "priced_by"),
        )
        contention = d.get("contention", 0.0)
        valid_field(check_float, "contention", contention, low=0)
        priced_by = priced_by_from(d.get("priced_by", ("probes", "probes")))
        valid_field(check_int, "world_size", d["world_size"], 1)
        raw = d["layers"]
        if not isinstance(raw, (list, tuple)) or not raw:
            raise ValueError(
                "layers must be a non-empty list of {name, numel, backward} objects, "
                f"got {raw!r:.60}"
            )
        layers = []
        for i, layer in enumerate(raw):
            where = f"layers[{i}]"
            known_fields(where, layer, ("name", "numel", "backward"))
            name = layer["name"]
            if not isinstance(name, str) or not name:
                raise ValueError(f"{where}.name must be a non-empty string, got {name!r}")
            valid_field(check_int, f"{where}.numel", layer["numel"], 0)
            valid_field(check_float, f"{where}.backward", layer["backward"], low=0)
            layers.append(LayerProfile(name, layer["numel"], float(layer["backward"])))
        names = [layer.name for layer in layers]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"layers[].name must be unique, repeated: {dups[:5]}")
        costs = costs_from_dict(d, _COST_FIELDS)
        return cls(
            world_size=d["world_size"],
            layers=tuple(layers),
            sparsify=costs["sparsify"],
            pack=costs["pack"],
            allgather=costs["allgather"],
            allreduce=costs["allreduce"],
            contention=float(contention),
            priced_by=priced_by,
        )

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Profile":
        """Read a profile saved by :meth:`save`.

        Raises:
            OSError: the file cannot be read.
            ValueError: it is not JSON, or a field is missing or malformed.
        """
        return cls.from_dict(read_json(path))


_COST_FIELDS = ("sparsify", "pack", "allgather", "allreduce")
#: What may price a profile's collectives' bytes (``Profile.priced_by``).
PRICED_BY = ("probes", "bound", "link_bandwidth", "steps")


def costs_from_dict(d: Dict[str, Any], keys: Sequence[str]) -> Dict[str, CostModel]:
    """The cost models saved under ``keys`` of ``d`` (see
    :func:`cost_model_from_dict`); the collectives among them must cost something.

    Raises:
        ValueError: a malformed one, or a free allgather or allreduce, named.
    """
    costs = {key: cost_model_from_dict(key, d[key]) for key in keys}
    for key in ("allgather", "allreduce"):
        # A free collective makes every plan's predicted time 0 (and the
        # speed-ups a division by zero); no measurement gives one.
        if key in costs and costs[key].alpha == 0 and costs[key].beta == 0:
            raise ValueError(f"{key}.alpha and {key}.beta are both 0: a collective takes time")
    return costs


def read_json(path: Union[str, Path]) -> Any:
    """The JSON value in the file at ``path``.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON.
    """
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"not a JSON file ({err})") from None


def cost_model_from_dict(key: str, raw: Any) -> CostModel:
    """The :class:`CostModel` saved as ``raw`` (``asdict`` form) under ``key``,
    validated field by field.

    Raises:
        ValueError: a missing, unknown or malformed field, named (``key.beta``).
    """
    known_fields(key, raw, ("alpha", "beta", "batched", "others"), optional=("batched", "others"))
    for coef in ("alpha", "beta"):
        valid_field(check_float, f"{key}.{coef}", raw[coef], low=0)
    batched = raw.get("batched")
    if batched is not None:
        valid_field(check_float, f"{key}.batched", batched, low=0)
        batched = float(batched)
    others = raw.get("others") or ()
    if not isinstance(others, (list, tuple)):
        raise ValueError(f"{key}.others must be a list of [alpha, beta], got {others!r:.60}")
    for i, line in enumerate(others):
        if not isinstance(line, (list, tuple)) or len(line) != 2:
            raise ValueError(f"{key}.others[{i}] must be [alpha, beta], got {line!r:.60}")
        for coef, v in zip(("alpha", "beta"), line):
            valid_field(check_float, f"{key}.others[{i}].{coef}", v, low=0)
    lines = tuple((float(a), float(b)) for a, b in others)
    return CostModel(float(raw["alpha"]), float(raw["beta"]), batched, lines)


def priced_by_from(value: Any) -> Tuple[str, str]:
    """``Profile.priced_by`` read back: two of :data:`PRICED_BY`.

    Raises:
        ValueError: anything else, naming ``priced_by``.
    """
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or any(p not in PRICED_BY for p in value)
    ):
        raise ValueError(
            f"priced_by must be two of {', '.join(PRICED_BY)} (allgather, allreduce), "
            f"got {value!r:.60}"
        )
    return (str(value[0]), str(value[1]))


def known_fields(
    where: str, obj: Any, fields: Sequence[str], optional: Sequence[str] = ("version",)
) -> None:
    """``obj`` is a dict with exactly ``fields`` (those in ``optional`` may be absent)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be an object with {', '.join(fields)}, got {obj!r:.60}")
    prefix = "" if where == "profile" else f"{where}."
    missing = [f for f in fields if f not in obj and f not in optional]
    if missing:
        raise ValueError(f"{prefix}{missing[0]} is missing")
    unknown = sorted(set(obj) - set(fields))
    if unknown:
        raise ValueError(f"unknown field {prefix}{unknown[0]} (expected {', '.join(fields)})")


def valid_field(check: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    """A file's field of the wrong type is bad data like any other: ValueError."""
    try:
        check(*args, **kwargs)
    except TypeError as err:
        raise ValueError(str(err)) from None


def build_spec(
    profile: Profile, config: SparsityConfig, density: Union[float, Sequence[float]]
) -> Tuple[PlanSpec, List[bool]]:
    """The planner's input at ``density`` (one for every layer, or one per
    layer in the profile's ready order), and which layers the per-layer rule
    (``min_sparse_size``, sparse smaller than dense) would send sparse."""
    plans = plan_layers([layer.numel for layer in profile.layers], density, config)
    layers = []
    for layer, plan in zip(profile.layers, plans):
        layers.append(
            LayerCost(
                name=layer.name,
                backward=layer.backward,
                sparse_bytes=plan.sparse_bytes,
                dense_bytes=dense_itemsize(config) * layer.numel,
                sparsify=profile.sparsify(layer.numel),
                pack=profile.pack(layer.numel),
            )
        )
    # How sparse messages travel (SparsityConfig.transport): by allgather, by
    # the reduction, or each by the faster of the two.
    allgather, reduction = profile.allgather, None
    if config.transport != "allgather":
        reduction = reduction_cost(allgather, profile.world_size, config.reduce_width)
        if config.transport == "reduce":
            allgather, reduction = reduction, None
    spec = PlanSpec(
        tuple(layers),
        allgather,
        profile.allreduce,
        contention=profile.contention,
        reduction=reduction,
    )
    return spec, [p.sparse for p in plans]


#: The densities ``density="auto"`` tries below dense, highest first (those at
#: or above its floor, then the floor itself).
AUTO_LADDER = (0.25, 0.1, 0.05, 0.025, 0.01, 0.005, 0.0025, 0.001, 0.0005, 0.00025, 0.0001)


@dataclass(frozen=True)
class DensityChoice:
    """What :func:`choose_density` chose and the numbers it compared.

    ``candidates``: ``(density, predicted end, back-propagation)`` seconds of
    every density tried, highest first; ``bound``: the end the chosen one had
    to meet (the fastest predicted end plus ``auto_slack`` of
    back-propagation); ``fits``: whether the chosen one is predicted to end
    within back-propagation plus ``auto_slack`` (its communication hidden).
    ``measured``: after the steps under the choice were timed, the check
    against the steps before it (:func:`~dlgs.core.planning.online.guard_verdict`'s
    record with ``density`` and ``before_density``); ``reverted``: the density
    those steps measured slower than, now in force; None while untimed, or
    kept. ``layers``: with ``config.auto_layers``, every layer's density in
    the profile's ready order, ``density`` or higher where a layer's extra
    bytes are predicted to fit within ``bound`` (:func:`raise_layers`); empty
    when every layer is at ``density``. ``plan`` is the plan at these.
    """

    density: float
    bound: float
    fits: bool
    candidates: Tuple[Tuple[float, float, float], ...]
    plan: Plan
    measured: Optional[Dict[str, Any]] = None
    reverted: Optional[float] = None
    layers: Tuple[float, ...] = ()

    def summary(self) -> Dict[str, Any]:
        """Plain data for a checkpoint (:meth:`from_summary`): all but the plan,
        the per-layer densities by layer name."""
        names = self.plan.names
        layers = dict(zip(names, self.layers)) if self.layers and names else {}
        return {
            "density": self.density,
            "bound": self.bound,
            "fits": self.fits,
            "candidates": [list(c) for c in self.candidates],
            "layers": layers,
            "measured": self.measured,
            "reverted": self.reverted,
        }

    @classmethod
    def from_summary(cls, summary: Dict[str, Any], plan: Plan) -> "DensityChoice":
        """The choice saved by :meth:`summary`, with ``plan`` (the plan now in
        force) in place of the one it was made with.

        Raises:
            ValueError: ``summary`` is malformed (names ``auto_choice``).
        """
        try:
            by_name = summary.get("layers") or {}
            layers = tuple(float(by_name[n]) for n in plan.names) if by_name else ()
            return cls(
                float(summary["density"]),
                float(summary["bound"]),
                bool(summary["fits"]),
                tuple((float(d), float(e), float(b)) for d, e, b in summary["candidates"]),
                plan,
                summary.get("measured"),
                summary.get("reverted"),
                layers,
            )
        except (AttributeError, KeyError, TypeError, ValueError):
            raise ValueError(
                f"dlgs planner state auto_choice is malformed: {summary!r:.80}"
            ) from None

    def describe(self) -> str:
        backprop = self.candidates[0][2] if self.candidates else 0.0
        fastest = min(end for _, end, _ in self.candidates) if self.candidates else 0.0
        head = (
            f"density='auto' chose {self.density:g}: the highest density predicted to end "
            f"within {self.bound * 1e3:.3f} ms (the fastest, {fastest * 1e3:.3f} ms, plus "
            f"auto_slack of back-propagation's {backprop * 1e3:.3f} ms); its communication is "
            + ("predicted to hide" if self.fits else "not predicted to hide")
        )
        rows = [f"  {d:>8g}: predicted end {end * 1e3:.3f} ms" for d, end, _ in self.candidates]
        raised = [(i, d) for i, d in enumerate(self.layers) if d > self.density]
        if raised:
            names = self.plan.names or tuple(str(i) for i in range(len(self.layers)))
            shown = ", ".join(f"{names[i]} {d:g}" for i, d in raised[:6])
            more = f" and {len(raised) - 6} more" if len(raised) > 6 else ""
            rows.append(
                f"  {len(raised)} of {len(self.layers)} layers raised above {self.density:g} "
                f"(their extra bytes predicted to fit within the bound): {shown}{more}; "
                f"predicted end {self.plan.end * 1e3:.3f} ms"
            )
        m = self.measured
        if m is not None and m.get("plan") is not None:
            raised_note = " (layers raised)" if self.layers else ""
            rows.append(
                f"  measured: steps at {m['density']:g}{raised_note} ended at "
                f"{m['plan'] * 1e3:.3f} ms "
                f"(median), at {m['before_density']:g} before at {m['layerwise'] * 1e3:.3f} ms; "
                f"it may end {m['allowance'] * 1e3:.3f} ms later, less a noise margin of "
                f"{m['margin'] * 1e3:.3f} ms: "
                + ("kept" if m["kept"] else f"back to {self.reverted:g}")
            )
        return "\n".join([head, *rows])


def plan_at(
    profile: "Profile",
    config: SparsityConfig,
    density: Union[float, Sequence[float]],
    strategy: str = "dp",
    *,
    bucket_elements: int = 8192,
    max_group: Optional[int] = None,
) -> Plan:
    """The ``strategy`` plan for ``profile``'s layers at ``density`` (one, or
    one per layer in ready order): :func:`build_spec`, then
    :func:`~dlgs.core.planning.dp.plan_strategy`."""
    spec, eligible = build_spec(profile, config, density)
    return plan_strategy(
        spec,
        strategy,
        eligible=eligible,
        bucket_elements=bucket_elements,
        numel=[layer.numel for layer in profile.layers],
        max_group=max_group,
        # A byte budget: no eligible layer dense (no plan sends more than it).
        keep_sparse=config.budget is not None,
    )


def choose_density(
    profile: "Profile",
    config: SparsityConfig,
    strategy: str = "dp",
    *,
    bucket_elements: int = 8192,
    max_group: Optional[int] = None,
) -> DensityChoice:
    """``density="auto"``: the highest density, from dense down the
    :data:`AUTO_LADDER` to ``config.density_floor``, whose plan (``strategy``
    at that density, from ``profile``) is predicted to end within
    ``config.auto_slack`` of back-propagation after the fastest of them.

    Where some density's communication hides behind back-propagation, the
    fastest ends with back-propagation (plus its selection cost) and this is
    "within back-propagation plus the slack"; where none hides, it is the
    highest density that costs at most the slack more than the fastest. A
    pure function of the profile and the config: every rank, given rank 0's
    profile, chooses the same.

    With ``config.auto_layers``, single layers then rise above that density
    (:func:`raise_layers`, alternating with re-planning at the raised
    densities, until no layer can rise: every round raises a layer a rung, so
    at most layers x rungs rounds) while the plan still ends within the same
    bound; the choice's ``layers``, ``plan`` and ``fits`` are
    then at the raised densities."""
    floor = config.density_floor
    ladder = [1.0] + [d for d in AUTO_LADDER if floor < d < 1.0] + [floor]
    backprop = sum(layer.backward for layer in profile.layers)
    plans = {
        d: plan_at(
            profile, config, d, strategy, bucket_elements=bucket_elements, max_group=max_group
        )
        for d in dict.fromkeys(ladder)
    }
    tried = tuple((d, plan.end, backprop) for d, plan in plans.items())
    bound = min(plan.end for plan in plans.values()) + config.auto_slack * backprop
    density = next(d for d, plan in plans.items() if plan.end <= bound)
    plan = plans[density]
    each: Tuple[float, ...] = (density,) * len(profile.layers)
    rounds = len(profile.layers) * len(AUTO_LADDER) if config.auto_layers else 0
    for _ in range(rounds):
        # Raised under the plan's messages, then re-planned at the raised
        # densities (the merge planner may group them better, leaving room
        # to raise more), until no layer can rise.
        higher = raise_layers(profile, config, each, plan, bound)
        if higher == each:
            break
        raised = plan_at(
            profile, config, higher, strategy, bucket_elements=bucket_elements, max_group=max_group
        )
        if raised.end > bound:
            break
        plan, each = raised, higher
    layers = each if any(d > density for d in each) else ()
    fits = plan.end <= backprop * (1.0 + config.auto_slack)
    return DensityChoice(density, bound, fits, tried, plan, layers=layers)


def raise_layers(
    profile: "Profile",
    config: SparsityConfig,
    density: Union[float, Sequence[float]],
    plan: Plan,
    bound: float,
) -> Tuple[float, ...]:
    """Per-layer densities (ready order) at or above ``density`` (one for
    every layer, or each layer's: rungs of the :data:`AUTO_LADDER` above the
    lowest), higher where a layer has the time to hide more: the layers
    ``plan`` sends sparse go up the ladder one rung at a time, round after
    round in ready order, as long as ``plan``'s messages at the new densities
    are predicted to end by ``bound`` and the layer's sparse message stays
    smaller than its dense gradient. A pure function of its arguments."""
    start = per_layer(density, len(profile.layers))
    base = min(start)
    rungs = [base] + sorted(d for d in AUTO_LADDER if base < d < 1.0)
    if not set(start) <= set(rungs):
        raise ValueError(
            f"density must be rungs of AUTO_LADDER above its lowest, got {start!r:.80}"
        )
    sized = [build_spec(profile, config, d) for d in rungs]
    level = [rungs.index(d) for d in start]
    spec = sized[0][0]
    part = plan.partition()
    layers = [sized[lv][0].layers[i] for i, lv in enumerate(level)]
    sparse = [i for g in plan.groups if g.sparse for i in g.members]
    changed = True
    while changed:
        changed = False
        for i in sparse:
            up = level[i] + 1
            if up == len(rungs) or not sized[up][1][i]:
                continue
            trial = layers[:i] + [sized[up][0].layers[i]] + layers[i + 1 :]
            if simulate(replace(spec, layers=tuple(trial)), part).end <= bound:
                layers, level[i], changed = trial, up, True
    return tuple(rungs[lv] for lv in level)


def calibrate(
    profile: Profile,
    config: SparsityConfig,
    density: Union[float, Sequence[float]],
    modes: Sequence[bool],
    measured_end: float,
    tolerance: float = 0.02,
) -> Tuple[Profile, Dict[str, float]]:
    """The profile's collective latency fitted to the steps it was measured on:
    layer by layer, layer ``i`` (ready order) sent sparse iff ``modes[i]``,
    whose median measured end (first gradient to the end of the exchange) was
    ``measured_end`` seconds.

    The probes time lone, synchronous collectives, which on a busy host pay
    wake-ups and polling that collectives overlapping in a step share. When
    the model predicts the steps more than ``tolerance`` too slow, both
    collectives' latency is scaled down, ``alpha' = floor + s * (alpha -
    floor)`` with ``s`` in ``[0, 1]`` (``floor``: the latency in a batch, or
    0), by bisection on ``s``, which moves the prediction monotonically. A
    prediction too fast is left alone: one number cannot tell a latency from
    a compute cost (see :func:`contention`).

    Returns:
        The profile, and ``{"measured", "predicted", "scale", "calibrated"}``
        (``predicted``: before calibration; ``calibrated``: 1.0 or 0.0).
    """
    part = [(i, i, bool(m)) for i, m in enumerate(modes)]

    def end(scale: float) -> float:
        spec = build_spec(rescale(profile, scale, profile.contention), config, density)[0]
        return simulate(spec, part).end

    predicted = end(1.0)
    info = {"measured": measured_end, "predicted": predicted, "scale": 1.0, "calibrated": 0.0}
    if not measured_end > 0 or predicted <= (1 + tolerance) * measured_end:
        return profile, info
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if end(mid) >= measured_end else (mid, hi)
    return rescale(profile, hi, profile.contention), {**info, "scale": hi, "calibrated": 1.0}


def fit_link(
    profile: Profile,
    config: SparsityConfig,
    density: Union[float, Sequence[float]],
    partition: Sequence[Part],
    measured_end: float,
    tolerance: float = 0.02,
) -> Tuple[Profile, Dict[str, float]]:
    """The profile's per-byte costs raised to a ring link fitted to steps that
    ended later than predicted: the steps ran ``partition`` (ready order) at
    ``density`` and their median measured end was ``measured_end`` seconds.

    The probes are small (the byte ledger bounds them), and a small collective
    can fit in a link's buffers or a shaper's burst: they may see bytes as
    nearly free. When a plan that sent many bytes measures more than
    ``tolerance`` later than predicted, this finds the inverse bandwidth ``x``
    (seconds per byte of one link) at which it would have ended then, by
    bisection, and charges each collective at least what a ring charges over
    such a link: ``(P-1) x`` per byte of an allgather's chunk, ``2(P-1)/P x``
    per byte of an allreduce. A prediction already as late is left alone.

    Returns:
        The profile, and ``{"measured", "predicted", "seconds_per_byte",
        "fitted"}`` (``predicted``: before; ``fitted``: 1.0 or 0.0).
    """
    p = profile.world_size

    def at(x: float) -> Profile:
        ag, ar = profile.allgather, profile.allreduce
        gather, reduce = max(ag.beta, (p - 1) * x), max(ar.beta, 2 * (p - 1) / p * x)
        # A slope raised here was priced by the timed steps, not the probes.
        priced_by = (
            "steps" if gather > ag.beta else profile.priced_by[0],
            "steps" if reduce > ar.beta else profile.priced_by[1],
        )
        return replace(
            profile,
            allgather=replace(ag, beta=gather),
            allreduce=replace(ar, beta=reduce),
            priced_by=priced_by,
        )

    def end(x: float) -> float:
        return simulate(build_spec(at(x), config, density)[0], partition).end

    predicted = end(0.0)
    info = {
        "measured": measured_end,
        "predicted": predicted,
        "seconds_per_byte": 0.0,
        "fitted": 0.0,
    }
    if p < 2 or not measured_end > (1 + tolerance) * predicted:
        return profile, info
    hi = 1e-9
    while end(hi) < measured_end and hi < _SLOWEST_LINK:
        hi *= 4
    lo = 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if end(mid) >= measured_end else (mid, hi)
    return at(hi), {**info, "seconds_per_byte": hi, "fitted": 1.0}


#: :func:`fit_link` looks no further than this many seconds per byte (a link
#: of 0.8 Mbit/s): beyond it, the lateness is not the link's.
_SLOWEST_LINK = 1e-5


def contention(
    backward_before: float, bytes_before: float, backward_after: float, bytes_after: float
) -> float:
    """Seconds of back-propagation lost per byte sent (``PlanSpec.contention``),
    from two layouts timed on the same job: back-propagation took
    ``backward_before`` seconds while each step sent ``bytes_before`` bytes
    (the layer-wise steps profiled first) and ``backward_after`` while it sent
    ``bytes_after`` (the steps timed under the first plan). 0 unless the
    layout that sent more also computed longer: the slowdown per extra byte."""
    more = bytes_after - bytes_before
    slower = backward_after - backward_before
    if more == 0 or slower * more <= 0:
        return 0.0
    return slower / more


def rescale(profile: Profile, scale: float, contention: float) -> Profile:
    """``profile`` with both collectives' latency scaled by ``scale`` above
    their floor (the latency in a batch, or 0) and ``contention`` set: what
    :func:`calibrate` fits, applied to another profile."""

    def lower(c: CostModel) -> CostModel:
        floor = c.batched if c.batched is not None else 0.0
        alpha = floor + scale * (c.alpha - floor) if c.alpha > floor else c.alpha
        batched = None if c.batched is None else min(c.batched, alpha)
        return CostModel(alpha, c.beta, batched)

    return replace(
        profile,
        allgather=lower(profile.allgather),
        allreduce=lower(profile.allreduce),
        contention=contention,
    )
