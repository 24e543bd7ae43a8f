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

from dataclasses import dataclass
from typing import Dict, List, Optional

from .core.planning.collectives import Cluster

__all__ = ["PRESETS", "SOURCES", "Figure", "FIGURES", "check_published", "cluster"]

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
}

_H100 = dict(local=8, intra_busbw=370e9, nvls_busbw=480e9, gpu="hopper", nic_efficiency=0.96)
_A100 = dict(local=8, intra_busbw=231.6e9, gpu="ampere", nic_efficiency=0.96)

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
    #: The algorithm the run forced (a key of :meth:`Cluster.lines`), or "" (NCCL chose).
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
        Figure("azure-h100", "h100-ib400", 8, "allreduce", size, "busbw", bw * _G, "nvls/simple",
               calibration=size == 8 * 2**30)
        for size, bw in [(2**10, 0.07), (2**16, 2.72), (2**20, 43.70), (2**24, 234.45),
                         (2**27, 400.61), (2**30, 466.35), (8 * 2**30, 478.87)]
    ],
    *[
        Figure("azure-a100", "a100-ib200", 8, "allreduce", size, "busbw", bw * _G,
               calibration=size == 8 * 2**30)
        for size, bw in [(2**10, 0.04), (2**20, 36.22), (2**27, 174.18), (2**30, 228.10),
                         (8 * 2**30, 231.58)]
    ],
    Figure("nccl-812", "a100-ib200", 32, "allreduce", 8 * 2**30, "busbw", 192 * _G,
           calibration=True, note="several DGX-A100 nodes; size and count not stated"),
    Figure("nccl-tests-319", "h100-ib400", 32, "allreduce", 8 * 2**30, "busbw", 396 * _G,
           "ring/simple", note="RING, 8 NICs; 'up to ~396 GB/s'; nodes not stated"),
    Figure("nccl-1244", "h100-ib400", 16, "allreduce", 4, "time", 46.5e-6, "nvls/simple",
           note="H20 nodes (NVLink as H100), NVLSTree forced, 4 B to 1 KB"),
    Figure("nccl-1244", "h100-ib400", 16, "allreduce", 2**10, "time", 46.5e-6, "nvls/simple",
           note="as above, 1 KB"),
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
        """(model - figure) / figure."""
        return (self.model - self.figure.value) / self.figure.value


def check_published(figures: Optional[List[Figure]] = None) -> List[Checked]:
    """Each figure priced by the model on its preset."""
    out = []
    for f in figures if figures is not None else FIGURES:
        c = cluster(f.preset)
        lines = c.lines(f.collective, f.world_size)
        if f.algorithm:
            name = f.algorithm
        else:
            name = min(lines, key=lambda k: lines[k][0] + lines[k][1] * f.nbytes)
        t = c.time(f.collective, f.world_size, f.nbytes, name)
        if f.kind == "time":
            model = t
        else:
            p = f.world_size
            factor = 2 * (p - 1) / p if f.collective == "allreduce" else (p - 1) / p
            model = f.nbytes / t * factor
        out.append(Checked(f, model, name))
    return out


def _size(nbytes: float) -> str:
    for unit, div in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= div:
            return f"{nbytes / div:g} {unit}"
    return f"{nbytes:g} B"


def figures_table(checked: Optional[List[Checked]] = None) -> str:
    """docs/netmodel.md's table of published figures against the model (markdown)."""
    rows = [
        "| source | preset | ranks | collective | size | algorithm | published | model | "
        "deviation |",
        "|---|---|---:|---|---:|---|---:|---:|---:|",
    ]
    for c in checked if checked is not None else check_published():
        f = c.figure
        if f.kind == "busbw":
            pub, mod = f"{f.value / 1e9:.4g} GB/s busbw", f"{c.model / 1e9:.4g} GB/s"
        else:
            pub, mod = f"{f.value * 1e6:.3g} us", f"{c.model * 1e6:.3g} us"
        dev = "calibration" if f.calibration else f"{c.deviation:+.0%}"
        algo = c.algorithm + ("" if f.algorithm else " (model's choice)")
        rows.append(
            f"| {f.source} | {f.preset} | {f.world_size} | {f.collective} | {_size(f.nbytes)} | "
            f"{algo} | {pub} | {mod} | {dev} |"
        )
    return "\n".join(rows)
