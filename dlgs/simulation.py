"""The ``simulate`` grid of ``python -m dlgs.plan`` and its report: every
method's plan per model, worker count and bandwidth (:func:`simulate_grid`),
``simulate.csv``, ``simulate.md`` (speed-ups, the reduction, two levels,
efficiency against the no-communication bound) and the plots. The command
line is :mod:`dlgs.plan`."""

from __future__ import annotations

import argparse
import csv
import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from dlgs.clusters import cluster, compute_text
from dlgs.core.config import SparsityConfig
from dlgs.core.planning.dp import CostModel, Plan, PlanSpec, plan_strategy, simulate
from dlgs.core.planning.netmodel import reduction_cost
from dlgs.core.planning.profile import Profile, build_spec

__all__ = [
    "CSV_FIELDS",
    "METHODS",
    "BUCKET_BYTES",
    "SimRow",
    "best_dlgs",
    "bucketed",
    "buckets",
    "format_bandwidth",
    "markdown",
    "plan_methods",
    "plot_efficiency",
    "plot_simulation",
    "simulate_grid",
    "write_csv",
]

logger = logging.getLogger(__name__)

#: Methods that ``simulate`` predicts, in report order.
METHODS: Tuple[str, ...] = (
    "dense",
    "dense-fused",
    "dense-fused-fp16",
    "dense-fp16",
    "dense-bucketed",
    "dense-bucketed-fp16",
    "dlgs-layerwise",
    "dp-dlgs",
    "dp-dlgs-reduce",
)

#: Columns of ``simulate.csv``.
CSV_FIELDS = (
    "model", "workers", "bandwidth", "bandwidth_bps", "density", "method",
    "predicted_iteration_s", "speedup_vs_dense", "speedup_vs_dense_fused", "messages",
    "sparse_messages", "reduced_messages", "compute_end_s", "exact", "max_group", "max_front",
    "no_comm_s", "efficiency",
)  # fmt: skip


_UNITS_FMT = (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3))


def format_bandwidth(bps: float) -> str:
    """The shortest exact spelling, e.g. ``10gbit``, ``100mbit``, ``2.5gbit``."""
    for unit, scale in _UNITS_FMT:
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


#: Bucket caps (bytes) the bucketed dense baselines try, the fastest per cell:
#: DDP's first bucket (1 MB) and its default cap (25 MB), Horovod's fusion
#: buffer (64 MB) and sizes between.
BUCKET_BYTES: Tuple[int, ...] = (1 << 20, 4 << 20, 16 << 20, 25 << 20, 64 << 20)


def buckets(spec: PlanSpec, cap: int) -> List[Tuple[int, int, bool]]:
    """The layers (ready order) in dense buckets of at least ``cap`` bytes as
    DDP fills them during back-propagation (the last one holds what is
    left): ``[(first, last, False)]``, each allreduced once its last layer is
    ready, in order."""
    parts: List[Tuple[int, int, bool]] = []
    first, size = 0, 0
    for i, layer in enumerate(spec.layers):
        size += layer.dense_bytes
        if size >= cap:
            parts.append((first, i, False))
            first, size = i + 1, 0
    if first < len(spec.layers):
        parts.append((first, len(spec.layers) - 1, False))
    return parts


def bucketed(spec: PlanSpec, strategy: str) -> Plan:
    """Dense buckets at the cap of :data:`BUCKET_BYTES` that the model finds
    fastest for ``spec``: DDP's gradient buckets, or Horovod's tensor fusion,
    tuned for the cell (the baseline a user who tunes ``bucket_cap_mb`` or
    ``HOROVOD_FUSION_THRESHOLD`` gets)."""
    plans = (simulate(spec, buckets(spec, cap), strategy) for cap in BUCKET_BYTES)
    return min(plans, key=lambda plan: plan.end)


def plan_methods(
    spec: PlanSpec,
    eligible: Sequence[bool],
    reduction: CostModel,
    *,
    max_group: Optional[int] = None,
    max_front: int = 256,
    baseline: Optional[PlanSpec] = None,
) -> Dict[str, Plan]:
    """The plan of every method in :data:`METHODS` for one planner input
    (``baseline``: the same with float32 dense messages, for the dense
    methods, where dlgs' ``dense_dtype`` is 16-bit; default ``spec``).

    * ``dense``: every layer allreduced on its own as soon as it is ready
      (Horovod without tensor fusion);
    * ``dense-fused``: all layers packed into one allreduce at the end of
      back-propagation (Horovod's fusion at its best for latency);
    * ``dense-fused-fp16``: the same in float16 (Horovod's
      ``Compression.fp16``: half the bytes);
    * ``dense-fp16``: every layer allreduced alone in float16 (``Compression.fp16``
      without fusion: its messages overlap back-propagation);
    * ``dense-bucketed`` / ``dense-bucketed-fp16``: the layers in buckets
      allreduced as each fills during back-propagation (DDP's buckets,
      Horovod's tensor fusion), in float32 / in float16 (or bfloat16: the
      same bytes), at the cap of :data:`BUCKET_BYTES` the model finds fastest;
    * ``dlgs-layerwise``: each layer its own message, sparse where the
      per-layer rule (``min_sparse_size``, sparse smaller than dense) says so;
    * ``dp-dlgs``: :func:`~dlgs.core.planning.dp.plan_dp` with the same
      eligibility rule as training (a layer the rule sends dense is never put
      in a sparse message);
    * ``dp-dlgs-reduce``: the same DP where each sparse message travels by
      allgather or by the sparse reduction (``reduction``, its cost model:
      :func:`~dlgs.core.planning.netmodel.reduction_cost`), whichever is faster
      (``transport="auto"``).
    """
    n = len(spec.layers)
    base = spec if baseline is None else baseline
    half = replace(
        base, layers=tuple(replace(la, dense_bytes=la.dense_bytes // 2) for la in base.layers)
    )
    dp = dict(eligible=eligible, max_group=max_group, max_front=max_front)
    return {
        "dense": plan_strategy(base, "none", eligible=[False] * n),
        "dense-fused": simulate(base, [(0, n - 1, False)], "dense-fused"),
        "dense-fused-fp16": simulate(half, [(0, n - 1, False)], "dense-fused-fp16"),
        "dense-fp16": replace(
            plan_strategy(half, "none", eligible=[False] * n), strategy="dense-fp16"
        ),
        "dense-bucketed": bucketed(base, "dense-bucketed"),
        "dense-bucketed-fp16": bucketed(half, "dense-bucketed-fp16"),
        "dlgs-layerwise": plan_strategy(spec, "none", eligible=eligible),
        "dp-dlgs": plan_strategy(spec, "dp", **dp),
        "dp-dlgs-reduce": plan_strategy(replace(spec, reduction=reduction), "dp", **dp),
    }


# -- simulate ---------------------------------------------------------------------


@dataclass(frozen=True)
class SimRow:
    """One predicted point of the ``simulate`` grid."""

    model: str
    workers: int
    bandwidth_bps: float
    density: float
    method: str
    plan: Plan
    dense_end: float
    fused_end: float
    max_group: Optional[int]
    max_front: int
    #: Back-propagation alone, no communication: the bound no method beats.
    no_comm: float = 0.0

    @property
    def efficiency(self) -> float:
        """The no-communication bound over the predicted iteration (1.0: every
        byte hidden behind back-propagation)."""
        return self.no_comm / self.plan.end if self.plan.end > 0 else 1.0

    def csv_row(self) -> Dict[str, object]:
        """The CSV row (times in seconds)."""
        return {
            "model": self.model,
            "workers": self.workers,
            "bandwidth": format_bandwidth(self.bandwidth_bps),
            "bandwidth_bps": f"{self.bandwidth_bps:g}",
            "density": f"{self.density:g}",
            "method": self.method,
            "predicted_iteration_s": f"{self.plan.end:.6g}",
            "speedup_vs_dense": f"{self.dense_end / self.plan.end:.4g}",
            "speedup_vs_dense_fused": f"{self.fused_end / self.plan.end:.4g}",
            "messages": len(self.plan.groups),
            "sparse_messages": sum(g.sparse for g in self.plan.groups),
            "reduced_messages": sum(g.transport == "reduce" for g in self.plan.groups),
            "compute_end_s": f"{self.plan.compute_end:.6g}",
            "exact": self.plan.exact,
            "max_group": "none" if self.max_group is None else self.max_group,
            "max_front": self.max_front,
            "no_comm_s": f"{self.no_comm:.6g}",
            "efficiency": f"{self.efficiency:.4g}",
        }


def simulate_grid(
    profiles: Callable[[str, int, float], Profile],
    models: Sequence[str],
    workers: Sequence[int],
    bandwidths: Sequence[float],
    config: SparsityConfig,
    *,
    max_group: Optional[int] = None,
    max_front: int = 256,
    two_level: Optional[
        Callable[[Profile, int, float], Optional[Tuple[Profile, CostModel]]]
    ] = None,
) -> Tuple[List[SimRow], Dict[str, float]]:
    """Plan every method for every ``(model, workers, bandwidth)``.

    Args:
        profiles: ``(model, workers, bandwidth_bps) -> Profile``.
        models, workers, bandwidths: the grid.
        config: sparsity options; its ``density`` is the one planned for.
        max_group, max_front: passed to :func:`~dlgs.core.planning.dp.plan_dp`.
        two_level: ``(profile, workers, bandwidth_bps) -> (profile, reduction)`` of
            the two-level exchange (:func:`two_level_profile`), or None where it
            does not apply: adds the method ``dp-dlgs-hier`` (each sparse
            message's shards between nodes by allgather or by the reduction,
            whichever is faster).

    Returns:
        The rows, and the seconds spent planning each model.
    """
    rows: List[SimRow] = []
    seconds: Dict[str, float] = {}
    float32 = replace(config, dense_dtype="float32")  # the dense baselines' dtype
    for model in models:
        t0 = time.perf_counter()
        for p in workers:
            for bps in bandwidths:
                profile = profiles(model, p, bps)
                spec, eligible = build_spec(profile, config, config.density)
                base = build_spec(profile, float32, config.density)[0]
                reduction = reduction_cost(spec.allgather, p, config.reduce_width)
                plans = plan_methods(
                    spec,
                    eligible,
                    reduction,
                    max_group=max_group,
                    max_front=max_front,
                    baseline=base,
                )
                dense, fused = plans["dense"].end, plans["dense-fused"].end
                methods = list(METHODS)
                no_comm = sum(layer.backward for layer in profile.layers)
                hier = two_level(profile, p, bps) if two_level else None
                if hier is not None:
                    spec_h, eligible_h = build_spec(hier[0], config, config.density)
                    plans["dp-dlgs-hier"] = plan_strategy(
                        replace(spec_h, reduction=hier[1]),
                        "dp",
                        eligible=eligible_h,
                        max_group=max_group,
                        max_front=max_front,
                    )
                    methods.append("dp-dlgs-hier")
                for method in methods:
                    rows.append(
                        SimRow(
                            model=model,
                            workers=p,
                            bandwidth_bps=bps,
                            density=config.density,
                            method=method,
                            plan=plans[method],
                            dense_end=dense,
                            fused_end=fused,
                            max_group=max_group,
                            max_front=max_front,
                            no_comm=no_comm,
                        )
                    )
            logger.info("%s: %d workers done (%.1f s so far)", model, p, time.perf_counter() - t0)
        seconds[model] = time.perf_counter() - t0
        logger.info(
            "%s: %d cells planned in %.1f s", model, len(workers) * len(bandwidths), seconds[model]
        )
    return rows, seconds


def write_csv(rows: Sequence[SimRow], path: Path) -> None:
    """``simulate.csv``: one row per model, workers, bandwidth and method."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow(row.csv_row())


def markdown(
    rows: Sequence[SimRow],
    seconds: Dict[str, float],
    args: argparse.Namespace,
    command: str,
    models: Sequence[str],
    source: str,
) -> str:
    bws = sorted({r.bandwidth_bps for r in rows})
    lines = [
        "# Predicted iteration times: dp-dlgs vs dense allreduce",
        "",
        f"Generated by `dlgs/plan.py` ({time.strftime('%Y-%m-%d %H:%M:%S')}). Command:",
        "",
        "```",
        command,
        "```",
        "",
        f"- model inputs: {source}",
        f"- density {args.density:g}, values {args.value_dtype}, dense messages "
        f"{args.dense_dtype}, indices "
        f"{args.index_coding}, "
        + (
            f"ring-step latency {args.latency * 1e6:g} us"
            if args.cluster is None
            else f"collectives of cluster {args.cluster}: {cluster(args.cluster).source}"
        )
        + f", {compute_text(args.cluster, models, args.compute_flops, args.batch)}, memory "
        f"{args.mem_bw / 1e9:g} GB/s",
        f"- DP: `max_group={args.max_group}`, `max_front={args.max_front}`; planning time per "
        "model (all methods, whole grid): "
        + ", ".join(f"{m} {s:.1f} s" for m, s in seconds.items()),
        "- every number is a prediction of the planner's model (`dlgs.core.planning.dp.simulate`), "
        "not a measurement; the iteration is back-propagation plus unhidden communication "
        "(forward pass and optimizer step left out)",
        "- `dense`: every layer allreduced alone (Horovod without fusion); `dense-fused`: one "
        "allreduce of all layers after back-propagation; `dense-bucketed`: buckets allreduced "
        "as they fill (DDP, Horovod's fusion), at the best cap of 1-64 MB; `-fp16`: float16; "
        "`dlgs-layerwise`: sparse per layer, no merging; `dp-dlgs`: the DP plan",
        "",
        "## Speed-up of dp-dlgs over dense (layer-wise) / over dense-fused",
        "",
    ]
    for model in models:
        cells = {
            (r.workers, r.bandwidth_bps): r
            for r in rows
            if r.model == model and r.method == "dp-dlgs"
        }
        if not cells:
            continue
        lines += _grid(
            model,
            bws,
            cells,
            lambda r: (
                f"{r.dense_end / r.plan.end:.2f}x / {r.fused_end / r.plan.end:.2f}x "
                f"({len(r.plan.groups)} msg)"
            ),
        )
    by = {(r.model, r.workers, r.bandwidth_bps, r.method): r for r in rows}
    lines += [
        "## The sparse reduction",
        "",
        "`dp-dlgs-reduce`: the same DP where each sparse message travels by allgather or by the "
        'sparse reduction by regions (`transport="reduce"`, width '
        f"{args.reduce_width:g}; `dlgs.core.planning.netmodel.reduction_cost`), whichever the "
        "model finds faster. Each cell: its speed-up over dp-dlgs / over dense-fused-fp16 (one "
        "allreduce of float16 gradients, Horovod's `Compression.fp16`) (sparse messages "
        "reduced / sparse messages).",
        "",
    ]

    def reduced(r: SimRow) -> str:
        flat_end = by[r.model, r.workers, r.bandwidth_bps, "dp-dlgs"].plan.end
        fp16_end = by[r.model, r.workers, r.bandwidth_bps, "dense-fused-fp16"].plan.end
        groups = r.plan.groups
        return (
            f"{flat_end / r.plan.end:.2f}x / {fp16_end / r.plan.end:.2f}x "
            f"({sum(g.transport == 'reduce' for g in groups)}/{sum(g.sparse for g in groups)})"
        )

    for model in models:
        cells = {
            (r.workers, r.bandwidth_bps): r
            for r in rows
            if r.model == model and r.method == "dp-dlgs-reduce"
        }
        if cells:
            lines += _grid(model, bws, cells, reduced)
    hier = {(r.model, r.workers, r.bandwidth_bps): r for r in rows if r.method == "dp-dlgs-hier"}
    if hier:
        flat = {(r.model, r.workers, r.bandwidth_bps): r for r in rows if r.method == "dp-dlgs"}
        half_rows = {
            (r.model, r.workers, r.bandwidth_bps): r for r in rows if r.method == "dense-fused-fp16"
        }
        lines += [
            f"## Two levels: nodes of {args.ranks_per_node} ranks",
            "",
            '`dp-dlgs-hier`: `topology="hierarchical"` (a dense reduce-scatter and allgather '
            f"inside each node on {format_bandwidth(args.intra_bandwidth)} links, the sparse "
            "exchange of each rank's shard between nodes over the bandwidths above; "
            "`dlgs.core.planning.netmodel.TwoLevels`), planned by the same DP. Each cell: "
            "its speed-up over flat dp-dlgs / over dense-fused / over dense-fused-fp16 (one "
            "allreduce of float16 gradients, Horovod's `Compression.fp16`, on the flat ring).",
            "",
        ]

        def ratios(h: SimRow) -> str:
            key = (h.model, h.workers, h.bandwidth_bps)
            return (
                f"{flat[key].plan.end / h.plan.end:.2f}x / {h.fused_end / h.plan.end:.2f}x / "
                f"{half_rows[key].plan.end / h.plan.end:.2f}x"
            )

        for model in models:
            cells = {(p, b): r for (m, p, b), r in hier.items() if m == model}
            if cells:
                lines += _grid(model, bws, cells, ratios)
    lines += _efficiency(rows, models, bws)
    inexact = sum(1 for r in rows if r.method == "dp-dlgs" and not r.plan.exact)
    total = sum(1 for r in rows if r.method == "dp-dlgs")
    lines += [
        f"DP fronts thinned (`Plan.exact` False) in {inexact} of {total} cells: there the plan "
        "may be worse than the model's optimum.",
        "",
    ]
    # Every baseline but dense-fused (one group: only when max_group allows) is a
    # partition the DP searches, so an exact DP is never slower than any of them.
    ends = {(r.model, r.workers, r.bandwidth_bps, r.method): r.plan.end for r in rows}
    worse = []
    for (model, p, bw, method), end in ends.items():
        if method != "dp-dlgs":
            continue
        for base in ("dense", "dlgs-layerwise"):
            b = ends[(model, p, bw, base)]
            if end > b * (1 + 1e-9):
                worse.append(
                    f"- {model}, {p} workers, {format_bandwidth(bw)}: dp-dlgs "
                    f"{end * 1e3:.2f} ms > {base} {b * 1e3:.2f} ms (+{end / b - 1:.1%})"
                )
    if worse:
        lines += [
            "Cells where the thinned DP's plan is slower than a baseline that lies in its own "
            "search space (a larger `--max-front` narrows or closes the gap; see "
            "docs/planning.md):",
            "",
            *worse,
            "",
        ]
    return "\n".join(lines)


#: The dlgs methods whose best is compared with the bound.
_DLGS = ("dlgs-layerwise", "dp-dlgs", "dp-dlgs-reduce", "dp-dlgs-hier")


def best_dlgs(rows: Sequence[SimRow]) -> Dict[Tuple[str, int, float], SimRow]:
    """Per ``(model, workers, bandwidth)``: the dlgs method the model finds fastest."""
    return _fastest(rows, _DLGS)


def best_fp16(rows: Sequence[SimRow]) -> Dict[Tuple[str, int, float], SimRow]:
    """Per ``(model, workers, bandwidth)``: the fastest float16 dense method
    (one fused allreduce, each layer alone, or buckets at the best cap,
    overlapping back-propagation)."""
    return _fastest(rows, _FP16)


def _fastest(
    rows: Sequence[SimRow], methods: Sequence[str]
) -> Dict[Tuple[str, int, float], SimRow]:
    best: Dict[Tuple[str, int, float], SimRow] = {}
    for r in rows:
        key = (r.model, r.workers, r.bandwidth_bps)
        if r.method in methods and (key not in best or r.plan.end < best[key].plan.end):
            best[key] = r
    return best


#: The float16 dense methods (Horovod's and DDP's).
_FP16 = ("dense-fused-fp16", "dense-fp16", "dense-bucketed-fp16")


def _efficiency(rows: Sequence[SimRow], models: Sequence[str], bws: Sequence[float]) -> List[str]:
    """Each cell's efficiency against the no-communication bound."""
    best = best_dlgs(rows)
    half = best_fp16(rows)
    lines = [
        "## Against the no-communication bound",
        "",
        "Efficiency: back-propagation alone (no communication, the bound no method beats) over "
        "the predicted iteration. Each cell: the fastest dlgs method's efficiency (which one) / "
        "float16 dense's (the best of dense-fused-fp16, dense-fp16 and dense-bucketed-fp16).",
        "",
    ]
    for model in models:
        cells = {(p, b): r for (m, p, b), r in best.items() if m == model}

        def cell(r: SimRow) -> str:
            fp16 = half[r.model, r.workers, r.bandwidth_bps]
            return f"{r.efficiency:.0%} ({r.method}) / {fp16.efficiency:.0%}"

        if cells:
            lines += _grid(model, bws, cells, cell)
    return lines


def _grid(
    model: str,
    bws: Sequence[float],
    cells: Dict[Tuple[int, float], SimRow],
    cell: Callable[[SimRow], str],
) -> List[str]:
    """A model's table: one row per worker count, one column per bandwidth."""
    lines = [
        f"### {model}",
        "",
        "| workers | " + " | ".join(format_bandwidth(b) for b in bws) + " |",
        "|---:|" + "---:|" * len(bws),
    ]
    for p in sorted({w for w, _ in cells}):
        vals = [cell(cells[p, b]) if (p, b) in cells else "" for b in bws]
        lines.append(f"| {p} | " + " | ".join(vals) + " |")
    return lines + [""]


def _panels(rows: Sequence[SimRow], models: Sequence[str]) -> Tuple[Any, Any, List[float], Any]:
    """A figure with one panel per model, the bandwidths and a colour for each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(2, len(models))
    nrows = math.ceil(len(models) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.0 * ncols, 4.2 * nrows), squeeze=False)
    bws = sorted({r.bandwidth_bps for r in rows})
    colours = plt.get_cmap("viridis")([i / max(1, len(bws) - 1) * 0.85 for i in range(len(bws))])
    return fig, axes, bws, colours


def _line(
    ax: Any, pts: Sequence[Tuple[float, float]], style: str, colour: Any, marked: bool, label: str
) -> None:
    """One series of ``(workers, value)`` points."""
    xs, ys = [x for x, _ in pts], [y for _, y in pts]
    ax.plot(xs, ys, style, color=colour, marker="o" if marked else None, ms=3.5, label=label)


def _save(fig: Any, axes: Any, used: int, path: Path, title: str, ncol: int) -> None:
    """Blank the unused panels, add the legend and title, write ``path``."""
    import matplotlib.pyplot as plt

    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="lower center", ncol=min(ncol, len(labels)), fontsize=8, frameon=False
    )
    fig.suptitle(title, fontsize=10, wrap=True)
    fig.tight_layout(rect=(0, 0.07, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_simulation(rows: Sequence[SimRow], models: Sequence[str], path: Path, title: str) -> None:
    """``simulate.png``: speed-up over dense vs workers, one panel per model,
    one colour per bandwidth; solid dp-dlgs, dashed dense-fused."""
    fig, axes, bws, colours = _panels(rows, models)
    for ax, model in zip(axes.flat, models):
        for bw, colour in zip(bws, colours):
            styles = (("dp-dlgs", "-"), ("dense-fused", "--"), ("dp-dlgs-hier", ":"))
            for method, style in styles + (("dp-dlgs-reduce", "-."),):
                pts = sorted(
                    (r.workers, r.dense_end / r.plan.end)
                    for r in rows
                    if r.model == model and r.bandwidth_bps == bw and r.method == method
                )
                if not pts:
                    continue
                _line(
                    ax, pts, style, colour, method == "dp-dlgs", f"{format_bandwidth(bw)} {method}"
                )
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(model)
        ax.set_xlabel("workers")
        ax.set_ylabel("speed-up over dense allreduce (layer-wise)")
        ax.grid(True, which="both", alpha=0.3)
    _save(fig, axes, len(models), path, title, 4)


def plot_efficiency(rows: Sequence[SimRow], models: Sequence[str], path: Path, title: str) -> None:
    """``efficiency.png``: each method's efficiency against the
    no-communication bound vs workers, one panel per model, one colour per
    bandwidth; solid the fastest dlgs method, dashed fp16 dense (fused),
    dotted fp32 dense (layer-wise)."""
    fig, axes, bws, colours = _panels(rows, models)
    best = best_dlgs(rows)
    for ax, model in zip(axes.flat, models):
        for bw, colour in zip(bws, colours):
            series = {
                "dlgs (fastest)": [r for (m, _, b), r in best.items() if m == model and b == bw],
                "dense-fused-fp16": [
                    r
                    for r in rows
                    if (r.model, r.bandwidth_bps, r.method) == (model, bw, "dense-fused-fp16")
                ],
                "dense": [
                    r for r in rows if (r.model, r.bandwidth_bps, r.method) == (model, bw, "dense")
                ],
            }
            for (name, found), style in zip(series.items(), ("-", "--", ":")):
                pts = sorted((r.workers, 100 * r.efficiency) for r in found)
                if pts:
                    _line(ax, pts, style, colour, style == "-", f"{format_bandwidth(bw)} {name}")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 105)
        ax.set_title(model)
        ax.set_xlabel("workers")
        ax.set_ylabel("% of the no-communication bound")
        ax.grid(True, which="both", alpha=0.3)
    _save(fig, axes, len(models), path, title, 3)
