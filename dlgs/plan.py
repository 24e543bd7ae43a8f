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
import logging
import math
import re
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from dlgs.catalog import (
    DEFAULT_COMPUTE_FLOPS,
    DEFAULT_KERNEL_S,
    DEFAULT_MEM_BW,
    MODELS,
    catalog_model,
    catalog_profile,
)
from dlgs.clusters import PRESETS, Compute, cluster, compute_of, compute_text
from dlgs.core.config import IndexCoding, SparsityConfig
from dlgs.core.planning.collectives import Cluster, two_level_costs
from dlgs.core.planning.dp import STRATEGIES, CostModel, plan_strategy, simulate
from dlgs.core.planning.netmodel import (
    DEFAULT_LATENCY_S,
    TwoLevels,
    allgather_cost,
    allreduce_cost,
)
from dlgs.core.planning.profile import Profile, build_spec, choose_density
from dlgs.core.wire import plan_layers
from dlgs.simulation import (
    format_bandwidth,
    markdown,
    plot_efficiency,
    plot_simulation,
    simulate_grid,
    write_csv,
)

__all__ = ["build_parser", "main", "parse_bandwidth", "two_level_profile"]

logger = logging.getLogger(__name__)

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
        "--dense-dtype",
        choices=("float32", "float16", "bfloat16"),
        default="float32",
        help="dtype of dlgs' dense messages on the wire (default: float32; the "
        "dense baselines are priced in float32 and, as dense-fused-fp16, in float16)",
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
        help="samples per worker (default: with --cluster, the batch of its GPU's published "
        "throughput on each model; else the model's, 32; 20 for ptb-lstm)",
    )
    common.add_argument(
        "--compute-flops",
        type=_type(_float_in(0, 1e18, low_open=True, what="FLOP/s in (0, 1e18]")),
        default=None,
        help="sustained FLOP/s of one worker (default: with --cluster, its GPU's published "
        f"throughput on each model, dlgs.clusters.THROUGHPUTS; else {DEFAULT_COMPUTE_FLOPS:g})",
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
        dense_dtype=args.dense_dtype,
        index_coding=args.index_coding,
        auto_layers=not getattr(args, "no_auto_layers", False),
        reduce_width=args.reduce_width,
    )


def _compute(args: argparse.Namespace, model: str) -> Compute:
    return compute_of(getattr(args, "cluster", None), model, args.compute_flops, args.batch)


def _catalog(args: argparse.Namespace, model: str, workers: int, bps: float) -> Profile:
    compute = _compute(args, model)
    return catalog_profile(
        model,
        world_size=workers,
        bandwidth_bps=bps,
        latency_s=args.latency,
        batch=compute.batch,
        compute_flops=compute.flops,
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
        compute = _compute(args, args.model)
        batch = compute.batch if compute.batch is not None else model.batch
        source = (
            f"{args.model}: {len(model.layers)} tensors, {model.numel / 1e6:.2f} M parameters, "
            f"batch {batch} x {model.sample}, compute {compute.source} (catalog approximation)"
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
    # Horovod's dense allreduce sends float32 whatever dlgs' dense_dtype.
    spec32 = build_spec(profile, replace(config, dense_dtype="float32"), config.density_at(0))[0]
    dense = plan_strategy(spec32, "none", eligible=[False] * n)
    fused = simulate(spec32, [(0, n - 1, False)], "dense-fused")
    lines = [
        f"# {source}",
        f"# {network}; {density}, values {args.value_dtype}, dense {args.dense_dtype}, "
        f"indices {args.index_coding}",
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
    (args.out / "simulate.md").write_text(markdown(rows, seconds, args, command, models, source))
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
            + f", {compute_text(args.cluster, models, args.compute_flops, args.batch)}",
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
