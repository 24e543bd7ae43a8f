"""Predict merge plans and iteration times without a cluster: ``python -m dlgs.plan``.

Two commands, both pure functions of the planner's model
(:mod:`dlgs.core.planning.dp`); nothing here measures anything:

* ``show`` prints the plan of one model on one assumed cluster (one row per
  message, :meth:`~dlgs.core.planning.dp.Plan.describe`), its predicted end and
  the predicted end of plain dense allreduce, layer by layer and fused::

      python -m dlgs.plan show --model resnet50 --workers 8 --bandwidth 10gbit --density 0.01

* ``simulate`` sweeps workers x bandwidths for one or more models and writes
  ``simulate.csv``, ``simulate.md`` and ``simulate.png`` (speed-up over dense
  allreduce)::

      python -m dlgs.plan simulate --models resnet50,vgg16,bert-base,ptb-lstm \\
          --density 0.01 --out benchmarks/results/plan-sim

Model inputs come from :mod:`dlgs.catalog` (built-in models with an
approximate compute model) and :mod:`dlgs.core.planning.netmodel` (ring collectives),
or from a saved :class:`~dlgs.core.planning.profile.Profile` (``--profile``: measured
per-layer backward times and fitted collectives). The predicted iteration is
back-propagation plus the communication that does not overlap it (the plan's
end); the forward pass and the optimizer step are left out, which would add
the same time to every method and shrink every speed-up. See
``docs/planning.md``.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import re
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from dlgs.catalog import (
    DEFAULT_COMPUTE_FLOPS,
    DEFAULT_KERNEL_S,
    DEFAULT_MEM_BW,
    MODELS,
    catalog_model,
    catalog_profile,
)
from dlgs.clusters import PRESETS, cluster
from dlgs.core.config import IndexCoding, SparsityConfig
from dlgs.core.planning.collectives import Cluster, two_level_costs
from dlgs.core.planning.dp import STRATEGIES, CostModel, Plan, PlanSpec, plan_strategy, simulate
from dlgs.core.planning.netmodel import (
    DEFAULT_LATENCY_S,
    TwoLevels,
    allgather_cost,
    allreduce_cost,
    reduction_cost,
)
from dlgs.core.planning.profile import Profile, build_spec, choose_density
from dlgs.core.wire import plan_layers

__all__ = [
    "CSV_FIELDS",
    "METHODS",
    "SimRow",
    "build_parser",
    "format_bandwidth",
    "main",
    "parse_bandwidth",
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
    "dlgs-layerwise",
    "dp-dlgs",
    "dp-dlgs-reduce",
)

_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_RATE = re.compile(
    r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?:([kmgt]?)(?:bit/s|bitps|bit|bps))?\s*$", re.I
)
_BANDWIDTH_RANGE = (
    "a rate > 0 such as 100mbit, 25gbit or 1e9 (bit/s; units bit, kbit, mbit, gbit, tbit)"
)
_MAX_WORKERS = 1_000_000
_DEFAULT_WORKERS = "2,4,8,16,32,64,128,256,512,1024"
_DEFAULT_BANDWIDTHS = "1gbit,10gbit,25gbit,100gbit"
#: Columns of ``simulate.csv``.
CSV_FIELDS = (
    "model", "workers", "bandwidth", "bandwidth_bps", "density", "method",
    "predicted_iteration_s", "speedup_vs_dense", "speedup_vs_dense_fused", "messages",
    "sparse_messages", "reduced_messages", "compute_end_s", "exact", "max_group", "max_front",
    "no_comm_s", "efficiency",
)  # fmt: skip


# -- parsing ----------------------------------------------------------------------


def parse_bandwidth(text: str, option: str = "--bandwidth") -> float:
    """Bit/s from ``1gbit``, ``100mbit``, ``25mbit``, ``10gbit`` or a plain number.

    Units are case-insensitive and may end in ``/s`` or ``ps`` (``10Gbit/s``,
    ``10gbps``); a plain number is bit/s.

    Raises:
        ValueError: not a positive, finite rate (the message names ``option``).
    """
    bps = _bandwidth_or_none(text)
    if bps is None:
        raise ValueError(f"{option} must be {_BANDWIDTH_RANGE}, got {text!r}")
    return bps


def _bandwidth_or_none(text: str) -> Optional[float]:
    m = _RATE.match(text)
    if not m:
        return None
    bps = float(m.group(1)) * _UNITS[(m.group(2) or "").lower() + "bit"]
    return bps if 0 < bps < math.inf else None


def format_bandwidth(bps: float) -> str:
    """The shortest exact spelling, e.g. ``10gbit``, ``100mbit``, ``2.5gbit``."""
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        scale = _UNITS[unit]
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


def _type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse ``type=``: argparse prefixes the option's name to the message."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _bandwidth_arg(text: str) -> float:
    bps = _bandwidth_or_none(text)
    if bps is None:
        raise ValueError(f"must be {_BANDWIDTH_RANGE}, got {text!r}")
    return bps


def _bandwidth_list(text: str) -> List[float]:
    items = [t for t in text.split(",") if t.strip()]
    rates = [_bandwidth_or_none(t) for t in items]
    if not items or any(r is None for r in rates):
        raise ValueError(f"must be comma-separated rates, each {_BANDWIDTH_RANGE}, got {text!r}")
    return [r for r in rates if r is not None]


def _workers(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= _MAX_WORKERS:
        raise ValueError(f"must be an int in [1, {_MAX_WORKERS}], got {text!r}")
    return n


def _workers_list(text: str) -> List[int]:
    items = [t for t in text.split(",") if t.strip()]
    try:
        return [_workers(t) for t in items] if items else [_workers("")]
    except ValueError:
        raise ValueError(
            f"must be comma-separated ints in [1, {_MAX_WORKERS}], got {text!r}"
        ) from None


def _float_in(low: float, high: float, *, low_open: bool, what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        ok = (v > low if low_open else v >= low) and v <= high and math.isfinite(v)
        if not ok:
            raise ValueError(f"must be {what}, got {text!r}")
        return v

    return parse


def _density_arg(text: str) -> object:
    """``--density``: a float in (0, 1], or ``auto`` (``show`` only)."""
    if text == "auto":
        return text
    return _float_in(0, 1, low_open=True, what="a float in (0, 1] or 'auto'")(text)


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = low - 1
        if v < low:
            raise ValueError(f"must be an int >= {low}, got {text!r}")
        return v

    return parse


def _max_group(text: str) -> Optional[int]:
    if text.strip().lower() == "none":
        return None
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise ValueError(f"must be an int >= 1 or 'none' (any length), got {text!r}")
    return v


def _model_list(text: str) -> List[str]:
    models = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        raise ValueError(f"must be comma-separated names from {', '.join(MODELS)}, got {text!r}")
    return models


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m dlgs.plan``."""
    p = argparse.ArgumentParser(
        prog="python -m dlgs.plan",
        description="Predict dlgs merge plans and iteration times from the planner's model.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--density",
        type=_type(_density_arg),
        default=0.01,
        help="fraction of each sparse layer sent (default: 0.01); show also takes 'auto': "
        "the density (and per-layer densities) density='auto' would choose",
    )
    common.add_argument(
        "--value-dtype",
        choices=("float32", "float16", "bfloat16"),
        default="float32",
        help="dtype of sparse values on the wire (default: float32)",
    )
    common.add_argument(
        "--index-coding",
        choices=[c.value for c in IndexCoding],
        default="auto",
        help="how sparse indices are sent (default: auto, the smallest per message)",
    )
    common.add_argument(
        "--reduce-width",
        type=_type(_float_in(0.25, 64, low_open=False, what="a float in [0.25, 64]")),
        default=1.25,
        help="the sparse reduction's block width as a multiple of capacity over the ranks "
        "(SparsityConfig.reduce_width; default: 1.25), for dp-dlgs-reduce",
    )
    common.add_argument(
        "--latency",
        type=_type(_float_in(0, 10, low_open=False, what="seconds in [0, 10]")),
        default=DEFAULT_LATENCY_S,
        help=f"latency of one ring step in seconds (default: {DEFAULT_LATENCY_S:g})",
    )
    common.add_argument(
        "--batch",
        type=_type(_int_at_least(1)),
        default=None,
        help="samples per worker (default: the model's, 32; 20 for ptb-lstm)",
    )
    common.add_argument(
        "--compute-flops",
        type=_type(_float_in(0, 1e18, low_open=True, what="FLOP/s in (0, 1e18]")),
        default=DEFAULT_COMPUTE_FLOPS,
        help=f"sustained FLOP/s of one worker (default: {DEFAULT_COMPUTE_FLOPS:g})",
    )
    common.add_argument(
        "--mem-bw",
        type=_type(_float_in(0, 1e15, low_open=True, what="bytes/s in (0, 1e15]")),
        default=DEFAULT_MEM_BW,
        help=f"memory bandwidth of one worker in bytes/s, for the sparsify and pack costs "
        f"(default: {DEFAULT_MEM_BW:g})",
    )
    common.add_argument(
        "--max-group",
        type=_type(_max_group),
        default=None,
        help="most layers in one message, or 'none' (default: none)",
    )
    common.add_argument(
        "--max-front",
        type=_type(_int_at_least(2)),
        default=256,
        help="most Pareto states the DP keeps per prefix; past it the front is thinned and "
        "the plan may be approximate, which the output then says (default: 256; ResNet-50 "
        "and BERT-base at some bandwidths need more to be exact)",
    )
    common.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="a saved Profile JSON: measured layers and collectives replace the catalog's",
    )
    common.add_argument(
        "--cluster",
        choices=sorted(PRESETS),
        default=None,
        help="price collectives as the cluster's library chooses its algorithms "
        "(dlgs.clusters, docs/netmodel.md: NCCL's tuning model, ring and tree, two levels) "
        "instead of the flat ring of --latency; --bandwidth(s) are then per node (default: "
        "the preset's) and dp-dlgs-hier uses the preset's nodes",
    )
    common.add_argument("-v", "--verbose", action="store_true", help="debug logging")

    show = sub.add_parser(
        "show",
        parents=[common],
        help="print one plan and its predicted times",
        description="Print the merge plan of one model on one cluster and compare it with "
        "dense allreduce. With --profile, the profile's layers and fitted collectives are "
        "used and --model is ignored; giving --bandwidth as well replaces the fitted "
        "collectives by the analytic ring model at --bandwidth and --workers (default: the "
        "profile's world size).",
    )
    show.add_argument("--model", choices=MODELS, help="built-in model (required without --profile)")
    show.add_argument(
        "--workers",
        type=_type(_workers),
        default=None,
        help=f"ranks, an int in [1, {_MAX_WORKERS}] (default: 8, or the profile's)",
    )
    show.add_argument(
        "--bandwidth",
        type=_type(_bandwidth_arg),
        default=None,
        help="link bandwidth, e.g. 1gbit, 100mbit, 25gbit or bit/s (default: 10gbit)",
    )
    merges = ("dp", *STRATEGIES)
    show.add_argument(
        "--merge",
        choices=merges,
        default="dp",
        help="merge strategy: dp (optimal under the model), none (layer-wise), all, "
        "buckets, greedy (MG-WFBP/OMGS rule) (default: dp)",
    )
    show.add_argument(
        "--no-auto-layers",
        action="store_true",
        help="--density auto: one density for every layer (auto_layers=False)",
    )
    show.add_argument(
        "--bucket-elements",
        type=_type(_int_at_least(1)),
        default=8192,
        help="--merge buckets: elements per bucket (default: 8192)",
    )

    sim = sub.add_parser(
        "simulate",
        parents=[common],
        help="sweep workers x bandwidths, write CSV/MD/PNG",
        description="Predict the iteration time of dp-dlgs, layer-wise sparse dlgs, dense "
        "allreduce (layer-wise, as Horovod without fusion) and dense-fused (one allreduce) "
        "for every model, worker count and bandwidth. With --profile, the profile's layers "
        "and compute costs are swept over the grid with analytic ring collectives.",
    )
    sim.add_argument(
        "--model",
        action="append",
        choices=MODELS,
        default=None,
        help="a built-in model (repeatable; joins --models)",
    )
    sim.add_argument(
        "--models",
        type=_type(_model_list),
        default=None,
        help=f"comma-separated built-in models (default: {','.join(MODELS)})",
    )
    sim.add_argument(
        "--workers",
        type=_type(_workers_list),
        default=_workers_list(_DEFAULT_WORKERS),
        help=f"comma-separated ranks (default: {_DEFAULT_WORKERS})",
    )
    sim.add_argument(
        "--bandwidths",
        type=_type(_bandwidth_list),
        default=None,
        help=f"comma-separated link bandwidths (default: {_DEFAULT_BANDWIDTHS}; with "
        "--cluster, the preset's bandwidth per node)",
    )
    sim.add_argument(
        "--out",
        type=Path,
        default=Path("plan-sim"),
        help="output folder (default: plan-sim in the current directory)",
    )
    sim.add_argument(
        "--ranks-per-node",
        type=_type(_int_at_least(2)),
        default=None,
        help="also predict topology='hierarchical' (dp-dlgs-hier) for nodes of this many "
        "ranks: --bandwidths are then the links between nodes",
    )
    sim.add_argument(
        "--intra-bandwidth",
        type=_bandwidth_arg,
        default=parse_bandwidth("100gbit"),
        help="with --ranks-per-node: the links inside a node (default: 100gbit, PCIe-class; "
        "NVLink is several times more)",
    )
    sim.add_argument(
        "--intra-latency",
        type=_type(_float_in(0.0, 1.0, low_open=False, what="a latency in seconds")),
        default=5e-6,
        help="with --ranks-per-node: ring-step latency inside a node in seconds (default 5e-6)",
    )
    sim.add_argument("--no-plot", action="store_true", help="skip simulate.png")
    return p


# -- planning ---------------------------------------------------------------------


def _config(args: argparse.Namespace) -> SparsityConfig:
    return SparsityConfig(
        density=args.density,
        value_dtype=args.value_dtype,
        index_coding=args.index_coding,
        auto_layers=not getattr(args, "no_auto_layers", False),
        reduce_width=args.reduce_width,
    )


def _catalog(args: argparse.Namespace, model: str, workers: int, bps: float) -> Profile:
    return catalog_profile(
        model,
        world_size=workers,
        bandwidth_bps=bps,
        latency_s=args.latency,
        batch=args.batch,
        compute_flops=args.compute_flops,
        mem_bw=args.mem_bw,
        kernel_s=DEFAULT_KERNEL_S,
    )


def _with_network(profile: Profile, workers: int, bps: float, latency_s: float) -> Profile:
    """``profile`` with its collectives replaced by the ring model."""
    return Profile(
        world_size=workers,
        layers=profile.layers,
        sparsify=profile.sparsify,
        pack=profile.pack,
        allgather=allgather_cost(workers, bps, latency_s),
        allreduce=allreduce_cost(workers, bps, latency_s),
    )


def _priced(args: argparse.Namespace, profile: Profile, workers: int, bps: float) -> Profile:
    """``profile`` with collectives from ``--cluster`` at ``bps`` per node, or
    else the flat ring of ``--latency`` at ``bps`` per link."""
    if args.cluster is None:
        return _with_network(profile, workers, bps, args.latency)
    c = cluster(args.cluster).with_bandwidth(bps)
    return replace(
        profile,
        world_size=workers,
        allgather=c.cost("allgather", workers),
        allreduce=c.cost("allreduce", workers),
    )


def _network(args: argparse.Namespace, workers: int, bps: float) -> str:
    if args.cluster is None:
        return (
            f"ring model: {workers} workers, {format_bandwidth(bps)} links, "
            f"latency {args.latency * 1e6:g} us per step"
        )
    c = cluster(args.cluster)
    nodes, _ = c.nodes(workers)
    return (
        f"cluster {c.name} ({c.library} model, docs/netmodel.md): {workers} ranks on "
        f"{nodes} node(s) of {c.local}, {format_bandwidth(bps)} per node"
    )


def two_level_profile(
    profile: Profile,
    workers: int,
    local: int,
    bandwidth_bps: float,
    intra_bps: float,
    latency_s: float,
    intra_latency_s: float,
    config: SparsityConfig,
    on: Optional[Cluster] = None,
) -> Optional[Tuple[Profile, CostModel]]:
    """``profile`` as the two-level exchange sees it on nodes of ``local``
    ranks (None unless ``workers`` is at least 2 such nodes): sparse messages
    cost :meth:`~dlgs.core.planning.netmodel.TwoLevels.sparse_cost`, selection
    ``local`` times less (each rank selects a shard); dense ones, and the
    compute, are as flat. With ``on``, the cluster's collectives
    (:func:`~dlgs.core.planning.collectives.two_level_costs`) at
    ``bandwidth_bps`` per node replace the rings of ``intra_bps`` and the
    latencies. Returned with the cost of a sparse message whose shards go
    between nodes by the sparse reduction (``config.reduce_width``), which
    the planner weighs against the allgather (``transport="auto"``)."""
    if workers % local or workers // local < 2:
        return None
    big = 10**7
    chunk = plan_layers([big], config.density, config)[0].sparse_bytes
    ratio, width = 4 * big / chunk, config.reduce_width
    if on is not None:
        sized = on.with_bandwidth(bandwidth_bps)
        sparse, dense = two_level_costs(sized, workers, ratio)
        reduced, _ = two_level_costs(sized, workers, ratio, width)
    else:
        net = TwoLevels(
            workers // local, local, bandwidth_bps, intra_bps, latency_s, intra_latency_s
        )
        sparse, dense = net.sparse_cost(ratio), net.dense_cost()
        reduced = net.sparse_cost(ratio, width)
    sel = profile.sparsify
    priced = replace(
        profile,
        allgather=sparse,
        allreduce=dense,
        sparsify=CostModel(sel.alpha, sel.beta / local, sel.batched),
    )
    return priced, reduced


def plan_methods(
    spec: PlanSpec,
    eligible: Sequence[bool],
    reduction: CostModel,
    *,
    max_group: Optional[int] = None,
    max_front: int = 256,
) -> Dict[str, Plan]:
    """The plan of every method in :data:`METHODS` for one planner input.

    * ``dense``: every layer allreduced on its own as soon as it is ready
      (Horovod without tensor fusion);
    * ``dense-fused``: all layers packed into one allreduce at the end of
      back-propagation (Horovod's fusion at its best for latency);
    * ``dense-fused-fp16``: the same in float16 (Horovod's
      ``Compression.fp16``: half the bytes);
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
    half = replace(
        spec, layers=tuple(replace(la, dense_bytes=la.dense_bytes // 2) for la in spec.layers)
    )
    dp = dict(eligible=eligible, max_group=max_group, max_front=max_front)
    return {
        "dense": plan_strategy(spec, "none", eligible=[False] * n),
        "dense-fused": simulate(spec, [(0, n - 1, False)], "dense-fused"),
        "dense-fused-fp16": simulate(half, [(0, n - 1, False)], "dense-fused-fp16"),
        "dlgs-layerwise": plan_strategy(spec, "none", eligible=eligible),
        "dp-dlgs": plan_strategy(spec, "dp", **dp),
        "dp-dlgs-reduce": plan_strategy(replace(spec, reduction=reduction), "dp", **dp),
    }


# -- show -------------------------------------------------------------------------


def _show(args: argparse.Namespace) -> int:
    if args.profile is not None:
        profile = args.loaded_profile
        if args.model is not None:
            logger.info("--profile given: ignoring --model %s", args.model)
        if args.bandwidth is not None:
            workers = args.workers if args.workers is not None else profile.world_size
            profile = _priced(args, profile, workers, args.bandwidth)
            network = _network(args, workers, args.bandwidth)
        else:
            network = (
                f"fitted collectives at {profile.world_size} workers: allgather "
                f"{profile.allgather.alpha * 1e6:.1f} us + "
                f"{profile.allgather.beta * 1e9:.3f} ns/B, "
                f"allreduce {profile.allreduce.alpha * 1e6:.1f} us + "
                f"{profile.allreduce.beta * 1e9:.3f} ns/B"
            )
        source = f"profile {args.profile} ({len(profile.layers)} tensors)"
    else:
        workers = args.workers if args.workers is not None else 8
        preset = cluster(args.cluster) if args.cluster else None
        bps = args.bandwidth if args.bandwidth is not None else 1e10
        if args.bandwidth is None and preset is not None:
            bps = preset.inter_bps
        profile = _priced(args, _catalog(args, args.model, workers, bps), workers, bps)
        model = catalog_model(args.model)
        batch = args.batch if args.batch is not None else model.batch
        source = (
            f"{args.model}: {len(model.layers)} tensors, {model.numel / 1e6:.2f} M parameters, "
            f"batch {batch} x {model.sample}, compute {args.compute_flops / 1e12:g} TFLOP/s "
            f"(catalog approximation)"
        )
        network = _network(args, workers, bps)
    config = _config(args)
    # The dense baselines do not depend on the density; auto's plan is its own.
    spec, eligible = build_spec(profile, config, config.density_at(0))
    names = [layer.name for layer in spec.layers]
    n = len(spec.layers)
    chosen: List[str] = []
    if config.auto:
        choice = choose_density(
            profile,
            config,
            args.merge,
            bucket_elements=args.bucket_elements,
            max_group=args.max_group,
        )
        plan = choice.plan
        density = f"density 'auto' (chose {choice.density:g})"
        chosen = [f"# {line}" for line in choice.describe().splitlines()]
    else:
        plan = plan_strategy(
            spec,
            args.merge,
            eligible=eligible,
            bucket_elements=args.bucket_elements,
            numel=[layer.numel for layer in profile.layers],
            max_group=args.max_group,
            max_front=args.max_front,
        )
        density = f"density {args.density:g}"
    dense = plan_strategy(spec, "none", eligible=[False] * n)
    fused = simulate(spec, [(0, n - 1, False)], "dense-fused")
    lines = [
        f"# {source}",
        f"# {network}; {density}, values {args.value_dtype}, indices {args.index_coding}",
        *chosen,
        plan.describe(names),
    ]
    if args.merge == "dp" and not plan.exact:
        lines.append(
            f"# note: a Pareto front exceeded --max-front {args.max_front} and was thinned; "
            "the plan may be slightly worse than the model's optimum"
        )
    rows = [
        (
            f"predicted end, {args.merge} plan",
            f"{plan.end * 1e3:.3f} ms ({len(plan.groups)} messages, "
            f"{sum(g.sparse for g in plan.groups)} sparse)",
        ),
        (
            "predicted end, dense allreduce (layer-wise)",
            f"{dense.end * 1e3:.3f} ms ({len(dense.groups)} messages)",
        ),
        ("predicted end, dense allreduce (fused)", f"{fused.end * 1e3:.3f} ms (1 message)"),
        ("back-propagation alone", f"{dense.compute_end * 1e3:.3f} ms"),
        (
            "speed-up over dense allreduce",
            f"{dense.end / plan.end:.2f}x layer-wise, {fused.end / plan.end:.2f}x fused",
        ),
    ]
    if config.auto and choice.layers:
        # What the raised layers add: elements selected in the plan's sparse messages.
        numel = [layer.numel for layer in profile.layers]
        sparse = [i for g in plan.groups if g.sparse for i in g.members]
        each = plan_layers(numel, choice.layers, config)
        one = plan_layers(numel, choice.density, config)
        ours, flat = sum(each[i].k for i in sparse), sum(one[i].k for i in sparse)
        rows.append(
            (
                "elements sent sparse per step",
                f"{ours} at the per-layer densities, {flat} at {choice.density:g} "
                f"(+{100 * (ours - flat) / max(1, flat):.0f}%)",
            )
        )
    width = max(len(label) for label, _ in rows) + 1
    lines += [""] + [f"{label + ':':<{width}} {value}" for label, value in rows]
    print("\n".join(lines))
    return 0


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
    for model in models:
        t0 = time.perf_counter()
        for p in workers:
            for bps in bandwidths:
                profile = profiles(model, p, bps)
                spec, eligible = build_spec(profile, config, config.density)
                reduction = reduction_cost(spec.allgather, p, config.reduce_width)
                plans = plan_methods(
                    spec, eligible, reduction, max_group=max_group, max_front=max_front
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


def _markdown(
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
        f"- density {args.density:g}, values {args.value_dtype}, indices "
        f"{args.index_coding}, "
        + (
            f"ring-step latency {args.latency * 1e6:g} us"
            if args.cluster is None
            else f"collectives of cluster {args.cluster}: {cluster(args.cluster).source}"
        )
        + f", compute {args.compute_flops / 1e12:g} TFLOP/s, memory "
        f"{args.mem_bw / 1e9:g} GB/s",
        f"- DP: `max_group={args.max_group}`, `max_front={args.max_front}`; planning time per "
        "model (all methods, whole grid): "
        + ", ".join(f"{m} {s:.1f} s" for m, s in seconds.items()),
        "- every number is a prediction of the planner's model (`dlgs.core.planning.dp.simulate`), "
        "not a measurement; the iteration is back-propagation plus unhidden communication "
        "(forward pass and optimizer step left out)",
        "- `dense`: every layer allreduced alone (Horovod without fusion); `dense-fused`: one "
        "allreduce of all layers after back-propagation; `dlgs-layerwise`: sparse per layer, "
        "no merging; `dp-dlgs`: the DP plan",
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
    best: Dict[Tuple[str, int, float], SimRow] = {}
    for r in rows:
        key = (r.model, r.workers, r.bandwidth_bps)
        if r.method in _DLGS and (key not in best or r.plan.end < best[key].plan.end):
            best[key] = r
    return best


def _efficiency(rows: Sequence[SimRow], models: Sequence[str], bws: Sequence[float]) -> List[str]:
    """Each cell's efficiency against the no-communication bound."""
    best = best_dlgs(rows)
    half = {
        (r.model, r.workers, r.bandwidth_bps): r for r in rows if r.method == "dense-fused-fp16"
    }
    lines = [
        "## Against the no-communication bound",
        "",
        "Efficiency: back-propagation alone (no communication, the bound no method beats) over "
        "the predicted iteration. Each cell: the fastest dlgs method's efficiency (which one) / "
        "dense-fused-fp16's.",
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


def _simulate(args: argparse.Namespace, command: str) -> int:
    config = _config(args)
    profiles: Callable[[str, int, float], Profile]
    if args.profile is not None:
        if args.model or args.models:
            logger.info("--profile given: ignoring --model/--models")
        base = args.loaded_profile
        models = [f"profile:{args.profile.stem}"]
        source = (
            f"profile {args.profile} ({len(base.layers)} tensors; measured compute, "
            + ("ring-model" if args.cluster is None else f"cluster {args.cluster}")
            + " collectives)"
        )

        def profiles(model: str, p: int, bps: float) -> Profile:
            return _priced(args, base, p, bps)

    else:
        models = list(dict.fromkeys((args.model or []) + (args.models or [])))
        models = models or list(MODELS)
        source = "built-in catalog (`dlgs.catalog`: approximate compute model) and " + (
            "ring collectives (`dlgs.core.planning.netmodel`)"
            if args.cluster is None
            else f"the {args.cluster} cluster's collectives (`dlgs.clusters`, docs/netmodel.md)"
        )

        def profiles(model: str, p: int, bps: float) -> Profile:
            return _priced(args, _catalog(args, model, p, bps), p, bps)

    logger.info(
        "simulating %s x workers %s x bandwidths %s at density %g (dp max_group=%s, max_front=%d)",
        ",".join(models),
        ",".join(map(str, args.workers)),
        ",".join(format_bandwidth(b) for b in args.bandwidths),
        args.density,
        args.max_group,
        args.max_front,
    )
    two_level = None
    if args.ranks_per_node is not None:

        def two_level(profile: Profile, p: int, bps: float) -> Optional[Tuple[Profile, CostModel]]:
            return two_level_profile(
                profile,
                p,
                args.ranks_per_node,
                bps,
                args.intra_bandwidth,
                args.latency,
                args.intra_latency,
                config,
                on=cluster(args.cluster) if args.cluster else None,
            )

    rows, seconds = simulate_grid(
        profiles,
        models,
        args.workers,
        args.bandwidths,
        config,
        max_group=args.max_group,
        max_front=args.max_front,
        two_level=two_level,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "simulate.csv")
    (args.out / "simulate.md").write_text(_markdown(rows, seconds, args, command, models, source))
    written = ["simulate.csv", "simulate.md"]
    if not args.no_plot:
        plot_simulation(
            rows,
            models,
            args.out / "simulate.png",
            "predicted speed-up over layer-wise dense allreduce (solid: dp-dlgs, dash-dot: "
            "dp-dlgs-reduce, dashed: "
            + ("dense-fused, dotted: dp-dlgs-hier" if args.ranks_per_node else "dense-fused")
            + f"); density {args.density:g}, "
            + (
                f"ring-step latency {args.latency * 1e6:g} us"
                if args.cluster is None
                else f"cluster {args.cluster} ({cluster(args.cluster).library} model)"
            )
            + f", {args.compute_flops / 1e12:g} TFLOP/s",
        )
        plot_efficiency(
            rows,
            models,
            args.out / "efficiency.png",
            "efficiency against the no-communication bound (back-propagation alone); "
            f"density {args.density:g}"
            + ("" if args.cluster is None else f", cluster {args.cluster}"),
        )
        written += ["simulate.png", "efficiency.png"]
    logger.info("wrote %s to %s", ", ".join(written), args.out)
    print(f"wrote {len(rows)} rows to {args.out / 'simulate.csv'}")
    return 0


def _check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check alone: option combinations and the profile
    file (``parser.error`` exits with status 2 and one line, no traceback)."""
    args.loaded_profile = None
    if args.profile is not None:
        try:
            args.loaded_profile = Profile.load(args.profile)
        except OSError as err:
            parser.error(f"argument --profile: cannot read {args.profile}: {err.strerror or err}")
        except ValueError as err:
            parser.error(f"argument --profile: {args.profile}: {err}")
    if args.command == "simulate":
        preset = cluster(args.cluster) if args.cluster else None
        if args.bandwidths is None:
            args.bandwidths = [preset.inter_bps] if preset else _bandwidth_list(_DEFAULT_BANDWIDTHS)
        if preset is not None and args.ranks_per_node is None:
            args.ranks_per_node = preset.local
    if args.command == "show" and args.cluster and args.profile and args.bandwidth is None:
        args.bandwidth = cluster(args.cluster).inter_bps  # the preset's, not the fitted costs
    if args.command != "show":
        if args.density == "auto":
            parser.error("argument --density: 'auto' is for show (simulate sweeps one density)")
        return
    if args.profile is None and args.model is None:
        parser.error(f"argument --model: required without --profile; one of {', '.join(MODELS)}")
    if args.no_auto_layers and args.density != "auto":
        parser.error("argument --no-auto-layers: only with --density auto")
    if args.density == "auto" and args.max_front != 256:
        parser.error("argument --max-front: not with --density auto (it plans with the default)")
    if args.profile is not None and args.workers is not None and args.bandwidth is None:
        parser.error(
            "argument --workers: with --profile it needs --bandwidth too (the profile's "
            "fitted collectives are not rescaled to another world size)"
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m dlgs.plan``; returns the exit status.

    Raises:
        SystemExit: bad or conflicting options, or an unreadable or malformed
            ``--profile`` (argparse's error: status 2 and one line naming the
            option or the profile's field).
    """
    raw = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(raw)
    _check_options(parser, args)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.DEBUG if args.verbose else logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    if args.command == "show":
        return _show(args)
    return _simulate(args, "python -m dlgs.plan " + shlex.join(raw))


if __name__ == "__main__":
    raise SystemExit(main())
