"""Cluster presets for the collective cost model, and the published
measurements it is checked against (docs/netmodel.md).

Each preset is a :class:`~dlgs.core.planning.collectives.Cluster` whose
numbers come from a public source named in :data:`SOURCES`; each
:class:`Figure` is one published ``nccl-tests`` result, and
:func:`check_published` prices it with the preset the figure was measured
on (the algorithm the run forced, or the model's own choice), giving the
model's deviation. A figure a preset was calibrated on says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .core.planning.collectives import Cluster

__all__ = [
    "PRESETS",
    "SOURCES",
    "THROUGHPUTS",
    "Compute",
    "Figure",
    "FIGURES",
    "Throughput",
    "calibrate",
    "check_published",
    "cluster",
    "compute_of",
    "compute_text",
    "published_seconds",
]

#: Where each number comes from (cited in docs/netmodel.md).
SOURCES: Dict[str, str] = {
    "tuning": "NCCL v2.27.7-1, src/graph/tuning.cc (ncclTopoTuneModel): latency tables, "
    "protocol factors, the choice by least time",
    "nccl-1455": "https://github.com/NVIDIA/nccl/issues/1455 (8x H100 SXM, NCCL_ALGO=RING "
    "busbw 365-370 GB/s at 2-4 GB)",
    "nccl-tests-212": "https://github.com/NVIDIA/nccl-tests/issues/212 (NVIDIA: ~480 GB/s "
    "busbw with NVLS on 8x H100)",
    "nccl-tests-290": "https://github.com/NVIDIA/nccl-tests/issues/290 (NVIDIA: 46-48 GB/s "
    "per NDR 400 Gbit/s NIC)",
    "nccl-tests-319": "https://github.com/NVIDIA/nccl-tests/issues/319 (NVIDIA: ~48 GB/s per "
    "CX7 NIC, up to ~396 GB/s aggregated with RING on 8 NICs)",
    "azure-h100": "github.com/Azure/AI-benchmarking-guide, Azure Results/ND_H100_v5_results.md "
    "(NCCL 2.18.5, all_reduce_perf, NVLS)",
    "azure-a100": "github.com/Azure/AI-benchmarking-guide, Azure_Results/ND_A100_v4_results.md "
    "(NCCL 2.18.5, all_reduce_perf)",
    "nccl-812": "https://github.com/NVIDIA/nccl/issues/812 (NVIDIA: DGX-A100 with 8x 200 "
    "Gbit/s IB measures 192 GB/s allreduce busbw)",
    "nccl-1244": "https://github.com/NVIDIA/nccl/issues/1244 (2 nodes x 8 H20, NCCL 2.21.5, "
    "NCCL_ALGO=NVLSTree: 46-47 us from 4 B to 1 KB)",
    "nccl-tests-29": "https://github.com/NVIDIA/nccl-tests/issues/29 (NVIDIA: 12.2 GB/s is "
    "as good as a 100 Gbit/s card gets)",
    "nccl-450": "https://github.com/NVIDIA/nccl/issues/450 (4 nodes x 8 V100, 100 Gbit/s "
    "TCP sockets: best busbw 4-6 GB/s at 8-128 MB)",
    "together-h100": "github.com/togethercomputer/together-nccl-tests, "
    "benchmarks/H100/results/20260305_220944 (8x H100 SXM, NCCL 2.26.2; all_reduce with NVLS "
    "and with NCCL_ALGO=RING, all_gather, reduce_scatter; out-of-place times)",
    "p5-efa": "github.com/KeitaW/p5-nccl-test-2024-07-19, nccl-test-output-v2.22.3-1.log (2 AWS "
    "p5 nodes x 8 H100, EFA 3200 Gbit/s per node, NCCL 2.22.3 with NVLS; out-of-place times)",
    "coreweave-a100": "github.com/coreweave/nccl-tests, README.md at f46d73d (16 nodes x 8 "
    "A100-SXM4-80GB, InfiniBand with SHARP, NCCL 2.12-2.15; out-of-place times)",
}

# The launch overhead and bandwidth ramp of each GPU's presets: what calibrate()
# finds on that GPU's calibration figures in FIGURES (a test reruns the fit).
_H100_RAMP = dict(overhead_s=16e-6, ramp_efficiency=0.75, ramp_s=55e-6)
_A100_RAMP = dict(overhead_s=24e-6, ramp_efficiency=0.9, ramp_s=115e-6)
_H100 = dict(
    local=8, intra_busbw=370e9, nvls_busbw=480e9, gpu="hopper", nic_efficiency=0.96, **_H100_RAMP
)
_A100 = dict(local=8, intra_busbw=231.6e9, gpu="ampere", nic_efficiency=0.96, **_A100_RAMP)

#: The presets of ``python -m dlgs.plan simulate --cluster``.
PRESETS: Dict[str, Cluster] = {
    "h100-ib400": Cluster(
        "h100-ib400",
        inter_bps=8 * 400e9,
        source="8x H100 SXM per node (ring busbw 370 GB/s: nccl-1455; NVLS 480 GB/s: "
        "nccl-tests-212), 8x 400 Gbit/s InfiniBand per node at 96% (nccl-tests-290)",
        **_H100,  # type: ignore[arg-type]
    ),
    "a100-ib200": Cluster(
        "a100-ib200",
        inter_bps=8 * 200e9,
        source="8x A100 SXM per node (ring busbw 231.6 GB/s: azure-a100), 8x 200 Gbit/s "
        "InfiniBand per node at 96% (nccl-812)",
        **_A100,  # type: ignore[arg-type]
    ),
    "a100-eth100": Cluster(
        "a100-eth100",
        inter_bps=100e9,
        source="8x A100 SXM per node (azure-a100), one 100 Gbit/s NIC per node at 97.6% "
        "(nccl-tests-29)",
        **{**_A100, "nic_efficiency": 0.976},  # type: ignore[arg-type]
    ),
    "a100-eth25": Cluster(
        "a100-eth25",
        inter_bps=25e9,
        source="8x A100 SXM per node (azure-a100), one 25 Gbit/s NIC per node at 97.6% "
        "(as the 100 Gbit/s card of nccl-tests-29)",
        **{**_A100, "nic_efficiency": 0.976},  # type: ignore[arg-type]
    ),
}


def cluster(name: str) -> Cluster:
    """The preset ``name`` (:data:`PRESETS`)."""
    if name not in PRESETS:
        raise ValueError(f"cluster must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]


@dataclass(frozen=True)
class Figure:
    """One published collective measurement (nccl-tests' definitions: busbw
    is algbw times ``2(P-1)/P`` for allreduce)."""

    source: str
    preset: str
    world_size: int
    collective: str
    nbytes: float
    #: ``"busbw"`` in bytes/s, or ``"time"`` in seconds.
    kind: str
    value: float
    #: The algorithm the run forced (a key of :meth:`Cluster.lines`, or its first part:
    #: ``"ring"`` for ``NCCL_ALGO=RING`` with NCCL choosing the protocol), or "" (NCCL chose).
    algorithm: str = ""
    #: The preset took this figure as an input (not a check).
    calibration: bool = False
    note: str = ""


_G = 1e9
#: The published figures of docs/netmodel.md's table.
FIGURES: List[Figure] = [
    Figure("nccl-1455", "h100-ib400", 8, "allreduce", 2 * 2**30, "busbw", 367 * _G,
           "ring/simple", calibration=True, note="RING forced, 365-370 GB/s"),
    *[
        Figure("azure-h100", "h100-ib400", 8, "allreduce", size, "busbw", bw * _G,
               calibration=True)
        for size, bw in [(2**10, 0.07), (2**16, 2.72), (2**20, 43.70), (2**24, 234.45),
                         (2**27, 400.61), (2**30, 466.35), (8 * 2**30, 478.87)]
    ],
    *[
        Figure("azure-a100", "a100-ib200", 8, "allreduce", size, "busbw", bw * _G,
               calibration=True)
        for size, bw in [(2**10, 0.04), (2**20, 36.22), (2**27, 174.18), (2**30, 228.10),
                         (8 * 2**30, 231.58)]
    ],
    Figure("nccl-812", "a100-ib200", 32, "allreduce", 8 * 2**30, "busbw", 192 * _G,
           calibration=True, note="several DGX-A100 nodes; size and count not stated"),
    *[
        Figure(source, preset, ranks, collective, size, "time", us * 1e-6, algorithm)
        for source, preset, ranks, collective, algorithm, sweep in [
            ("together-h100", "h100-ib400", 8, "allreduce", "", [
                34.94, 35.66, 41.45, 126.39, 586.97, 4018.9]),
            ("together-h100", "h100-ib400", 8, "allreduce", "ring", [
                37.38, 40.27, 44.38, 125.47, 699.15, 5206.02]),
            ("together-h100", "h100-ib400", 8, "allgather", "", [
                34.88, 35.45, 40.1, 70.73, 388.74, 2726.63]),
            ("together-h100", "h100-ib400", 8, "reducescatter", "", [
                34.71, 34.89, 40.81, 71.87, 380.4, 2717.07]),
            ("p5-efa", "h100-ib400", 16, "allreduce", "", [
                65.74, 107.4, 138.1, 283.1, 874.1, 4575.2]),
            ("coreweave-a100", "a100-ib200", 128, "allreduce", "", [
                56.74, 90.06, 143.4, 447.8, 2619.6, 18266.0]),
        ]
        for size, us in zip([2**10, 2**16, 2**20, 2**24, 2**27, 2**30], sweep)
    ],
    Figure("nccl-tests-319", "h100-ib400", 32, "allreduce", 8 * 2**30, "busbw", 396 * _G,
           "ring", note="RING, 8 NICs; 'up to ~396 GB/s'; nodes not stated"),
    Figure("nccl-1244", "h100-ib400", 16, "allreduce", 2**10, "time", 46.5e-6, "nvls/simple",
           note="H20 nodes (NVLink as H100), NVLSTree forced, 4 B to 1 KB"),
    Figure("nccl-450", "a100-eth100", 32, "allreduce", 2**27, "busbw", 5 * _G,
           note="V100 nodes, TCP sockets (no RDMA); 4-6 GB/s"),
]  # fmt: skip


@dataclass(frozen=True)
class Checked:
    """A figure and what the model says of it."""

    figure: Figure
    model: float
    algorithm: str

    @property
    def deviation(self) -> float:
        """The model's time over the published time, less 1 (positive: the
        model is slower than the run; busbw figures are turned into times)."""
        f = self.figure
        return (self.model / f.value if f.kind == "time" else f.value / self.model) - 1


def _chunk(f: "Figure") -> float:
    """The bytes :meth:`Cluster.cost` takes for ``f``: nccl-tests' size is the
    whole buffer, and an allgather is priced by one rank's chunk of it."""
    return f.nbytes / f.world_size if f.collective == "allgather" else f.nbytes


def _bus_factor(f: "Figure") -> float:
    """nccl-tests' busbw over algbw: ``2(P-1)/P`` for an allreduce, ``(P-1)/P`` else."""
    p = f.world_size
    return 2 * (p - 1) / p if f.collective == "allreduce" else (p - 1) / p


def published_seconds(f: "Figure") -> float:
    """The seconds ``f`` reports, or implies by its busbw."""
    return f.value if f.kind == "time" else f.nbytes * _bus_factor(f) / f.value


def _priced(c: Cluster, f: "Figure") -> Tuple[float, str]:
    """Seconds and algorithm as the simulator and planner price ``f`` (the
    fastest line), or the algorithm the run forced."""
    lines = c.lines(f.collective, f.world_size)
    nbytes = _chunk(f)
    if f.algorithm:
        return c.time(f.collective, f.world_size, nbytes, f.algorithm), f.algorithm
    name = min(lines, key=lambda k: lines[k][0] + lines[k][1] * nbytes)
    return lines[name][0] + lines[name][1] * nbytes, name.replace("/ramp", " (ramping)")


def check_published(figures: Optional[List[Figure]] = None) -> List[Checked]:
    """Each figure priced by the model on its preset."""
    out = []
    for f in figures if figures is not None else FIGURES:
        t, name = _priced(cluster(f.preset), f)
        model = t if f.kind == "time" else f.nbytes * _bus_factor(f) / t
        out.append(Checked(f, model, name))
    return out


#: The grids :func:`calibrate` searches: 0-100 us of overhead by 1 us, a ramp at
#: 0.2-1.0 of the bandwidth by 0.05, 0-500 us of ramp latency by 5 us.
_OVERHEADS = tuple(i * 1e-6 for i in range(0, 101))
_EFFICIENCIES = tuple(i / 20 for i in range(4, 21))
_RAMPS = tuple(i * 5e-6 for i in range(0, 101))


def calibrate(
    base: Cluster,
    figures: Sequence[Figure],
    overheads: Sequence[float] = _OVERHEADS,
    efficiencies: Sequence[float] = _EFFICIENCIES,
    ramps: Sequence[float] = _RAMPS,
) -> Cluster:
    """``base`` with the ``overhead_s``, ``ramp_efficiency`` and ``ramp_s``
    from the grids that fit ``figures`` best (least squared log-ratio of the
    model's seconds to the published ones, every figure priced as
    :func:`check_published` prices it). How the presets' values were found."""
    if not figures:
        raise ValueError("figures must hold at least one figure")
    plain = replace(base, overhead_s=0.0, ramp_efficiency=1.0, ramp_s=0.0)
    o = np.asarray(overheads, dtype=float)[:, None, None, None]
    e = np.asarray(efficiencies, dtype=float)[None, :, None, None]
    r = np.asarray(ramps, dtype=float)[None, None, :, None]
    loss = np.zeros((o.shape[0], e.shape[1], r.shape[2]))
    for f in figures:
        if f.algorithm:
            lines = plain.lines_of(f.collective, f.world_size, f.algorithm)
        else:
            lines = plain.lines(f.collective, f.world_size)
        a = np.array([ab[0] for ab in lines.values()])[None, None, None, :]
        bx = np.array([ab[1] for ab in lines.values()])[None, None, None, :] * _chunk(f)
        t = np.minimum(o + a + bx / e, o + a + r + bx).min(axis=-1)
        loss += np.log(t / published_seconds(f)) ** 2
    i, j, k = (int(x) for x in np.unravel_index(int(np.argmin(loss)), loss.shape))
    return replace(
        base,
        overhead_s=float(overheads[i]),
        ramp_efficiency=float(efficiencies[j]),
        ramp_s=float(ramps[k]),
    )


def _size(nbytes: float) -> str:
    for unit, div in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= div:
            return f"{nbytes / div:g} {unit}"
    return f"{nbytes:g} B"


def figures_table(checked: Optional[List[Checked]] = None) -> str:
    """docs/netmodel.md's table of published figures against the model
    (markdown), and the count of check figures within the goals."""
    checked = checked if checked is not None else check_published()
    rows = [
        "| source | preset | ranks | collective | size | priced as | published | model | "
        "time vs published | role |",
        "|---|---|---:|---|---:|---|---:|---:|---:|---|",
    ]
    for c in checked:
        f = c.figure
        if f.kind == "busbw":
            pub, mod = f"{f.value / 1e9:.4g} GB/s busbw", f"{c.model / 1e9:.4g} GB/s"
        else:
            pub, mod = f"{f.value * 1e6:.3g} us", f"{c.model * 1e6:.3g} us"
        algo = f"{c.algorithm}, forced" if f.algorithm else c.algorithm
        rows.append(
            f"| {f.source} | {f.preset} | {f.world_size} | {f.collective} | {_size(f.nbytes)} | "
            f"{algo} | {pub} | {mod} | {c.deviation:+.0%} | "
            f"{'calibration' if f.calibration else 'check'} |"
        )
    checks = [c for c in checked if not c.figure.calibration]
    large = [c for c in checks if c.figure.nbytes >= 2**16]
    near = sum(abs(c.deviation) <= 0.15 for c in large)
    within = sum(abs(c.deviation) <= 0.25 for c in checks)
    rows += [
        "",
        f"Check figures (none a preset was fitted on): **{near} of {len(large)} from 64 KB up "
        f"within 15%** of the published time, **{within} of {len(checks)} from 1 KB up within "
        "25%**.",
    ]
    return "\n".join(rows)


# -- compute ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Throughput:
    """One published training throughput of one GPU, for a catalog model."""

    gpu: str
    #: The catalog model it stands for.
    model: str
    #: Samples (images, sequences) per second per GPU, the whole training step.
    samples_per_s: float
    #: Samples per GPU and step in that run.
    batch: int
    source: str
    #: Forward multiply-accumulates per sample of the model the run trained,
    #: where that is not ``model`` itself (BERT-large for ``bert-base``).
    macs: Optional[float] = None


def _bert_large_macs(seq: int) -> float:
    from .catalog import bert_layers

    return float(sum(layer.macs for layer in bert_layers(1024, 4096, 24, seq)))


#: Published training throughputs per GPU, mixed precision (see :func:`compute_of`).
THROUGHPUTS: List[Throughput] = [
    Throughput("ampere", "resnet50", 2470, 256,
               "1x A100 80GB, PyTorch ResNet-50 v1.5, NVIDIA DeepLearningExamples "
               "(PyTorch/Classification/ConvNets/resnet50v1.5/README.md, pytorch-21.03)"),
    Throughput("ampere", "bert-base", 580, 256,
               "1x A100 80GB, PyTorch BERT-large pre-training at 128 tokens, NVIDIA "
               "DeepLearningExamples (PyTorch/LanguageModeling/BERT/README.md, pytorch-21.11)",
               macs=_bert_large_macs(128)),
    Throughput("hopper", "resnet50", 56041 / 8, 400,
               "DGX H100 (8 GPUs), MXNet ResNet-50 v1.5, MLPerf Training v3.0 closed "
               "(mlcommons/training_results_v3.0, NVIDIA/results/dgxh100_ngc23.04_mxnet/resnet/"
               "result_0.txt: 56,041 images/s per node)"),
]  # fmt: skip


@dataclass(frozen=True)
class Compute:
    """What one worker computes with, for :func:`~dlgs.catalog.catalog_profile`."""

    flops: float
    batch: Optional[int]
    #: Where it comes from (the report's line).
    source: str


def _sustained(t: Throughput) -> float:
    """The FLOP/s that makes the catalog's compute model (forward ``2 macs``,
    backward ``4 macs`` per sample) run ``t``'s step: ``6 macs x samples/s``."""
    from .catalog import catalog_model

    macs = t.macs
    if macs is None:
        macs = sum(layer.macs for layer in catalog_model(t.model).layers)
    return 6.0 * macs * t.samples_per_s


def compute_of(
    preset: Optional[str],
    model: str,
    compute_flops: Optional[float] = None,
    batch: Optional[int] = None,
) -> Compute:
    """The compute of ``model``'s workers: ``compute_flops`` and ``batch`` where
    given; else, on a ``preset``, its GPU's published throughput on the model
    (:data:`THROUGHPUTS`) and that run's batch; else the catalog's default
    (:data:`~dlgs.catalog.DEFAULT_COMPUTE_FLOPS`, the model's batch)."""
    from .catalog import DEFAULT_COMPUTE_FLOPS

    if compute_flops is not None:
        return Compute(compute_flops, batch, f"{compute_flops / 1e12:g} TFLOP/s (given)")
    gpu = None if preset is None else cluster(preset).gpu
    mine = [t for t in THROUGHPUTS if t.gpu == gpu]
    if not mine:
        return Compute(
            DEFAULT_COMPUTE_FLOPS, batch, f"{DEFAULT_COMPUTE_FLOPS / 1e12:g} TFLOP/s (default)"
        )
    found = next((t for t in mine if t.model == model), None)
    if found is not None:
        flops = _sustained(found)
        return Compute(
            flops,
            found.batch if batch is None else batch,
            f"{flops / 1e12:.0f} TFLOP/s ({found.samples_per_s:.0f} samples/s per GPU at batch "
            f"{found.batch})",
        )
    # No published run of this model on this GPU: the median of the GPU's
    # other models, at the model's own batch.
    flops = float(np.median([_sustained(t) for t in mine]))
    return Compute(flops, batch, f"{flops / 1e12:.0f} TFLOP/s ({gpu}'s median, no {model} figure)")


def compute_text(
    preset: Optional[str],
    models: Sequence[str],
    compute_flops: Optional[float] = None,
    batch: Optional[int] = None,
) -> str:
    """The reports' words for the workers' compute on ``models`` (:func:`compute_of`)."""
    each = {m: compute_of(preset, m, compute_flops, batch) for m in models}
    if len({c.source for c in each.values()}) == 1:
        return f"compute {next(iter(each.values())).source}"
    return "compute per model: " + "; ".join(f"{m} {c.source}" for m, c in each.items())
