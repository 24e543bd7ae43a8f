"""The framework-free half of the training benchmark: records, summary, outputs, CLI.

``benchmarks/train_torch.py`` and ``benchmarks/train_tf.py`` time the methods on
their framework and hand every rank's :class:`MethodTimes` to
:func:`write_outputs`, which writes the same CSV / Markdown / PNG for both. This
module imports neither torch, TensorFlow nor Horovod (matplotlib only inside
:func:`plot`), so ``python -m benchmarks.train --framework tensorflow`` never
loads torch and the reporting can be tested without a framework.
"""

from __future__ import annotations

import argparse
import csv
import gc
import logging
import os
import platform
import shlex
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from dlgs.catalog import DEFAULT_COMPUTE_FLOPS
from dlgs.core.config import IndexCoding
from dlgs.core.planning.dp import plan_strategy
from dlgs.core.planning.profile import build_spec

__all__ = [
    "FRAMEWORKS",
    "METHODS",
    "MODELS",
    "SPARSE_METHODS",
    "TORCH_METHODS",
    "DDP_METHODS",
    "ENGINES",
    "TRANSPORT_METHODS",
    "TWO_LEVEL_METHODS",
    "MethodTimes",
    "add_wire_options",
    "base_method",
    "format_markdown",
    "method_cell",
    "parse_args",
    "percentile",
    "plot",
    "sparse_options",
    "summarise",
    "wire_options",
    "write_csv",
    "write_outputs",
]

logger = logging.getLogger(__name__)

# Every method uses this optimizer (plain SGD) so each step does the same arithmetic.
LR = 0.01

#: dlgs methods: (controller, merge, topology). The two-level methods
#: (``dlgs-hier``: ``topology="hierarchical"``; ``dlgs-auto``: ``"auto"``) need
#: several nodes of several ranks (``benchmarks.cluster --ranks-per-node``) and
#: torch; they are not in the default :data:`METHODS`.
SPARSE_METHODS: Dict[str, Tuple[str, str, str]] = {
    "topk": ("topk", "none", "flat"),
    "topk-buckets": ("topk", "buckets", "flat"),
    "dgc": ("dgc", "none", "flat"),
    "dlgs-none": ("dynamic", "none", "flat"),
    "dlgs": ("dynamic", "dp", "flat"),
    "dlgs-hier": ("dynamic", "dp", "hierarchical"),
    "dlgs-auto": ("dynamic", "dp", "auto"),
    "dlgs-reduce": ("dynamic", "dp", "flat"),
    "dlgs-route": ("dynamic", "dp", "flat"),
}
#: dlgs methods whose sparse messages do not all travel by allgather
#: (``transport``): the sparse reduction, or each message by the faster
#: (torch only; not in the default :data:`METHODS`).
TRANSPORT_METHODS: Dict[str, str] = {"dlgs-reduce": "reduce", "dlgs-route": "auto"}
METHODS: Tuple[str, ...] = ("no-comm", "dense", "fp16", "topk", "topk-buckets", "dgc")
METHODS += ("dlgs-none", "dlgs")
#: Methods whose ``topology`` is not flat (two levels: torch only).
TWO_LEVEL_METHODS: Tuple[str, ...] = tuple(
    m for m, (_, _, topology) in SPARSE_METHODS.items() if topology != "flat"
)
#: PyTorch DDP (``benchmarks/ddp_methods.py``): plain, PyTorch's fp16 and
#: PowerSGD (rank 1, 4) hooks, and dlgs's hook layer-wise / with the DP plan.
DDP_METHODS: Tuple[str, ...] = (
    "ddp",
    "ddp-fp16",
    "ddp-powersgd1",
    "ddp-powersgd4",
    "ddp-dlgs-none",
    "ddp-dlgs",
)
#: Methods only the torch adapter runs (two levels, an alltoall, or DDP).
TORCH_METHODS: Tuple[str, ...] = TWO_LEVEL_METHODS + tuple(TRANSPORT_METHODS) + DDP_METHODS
#: The default method list of each ``--engine``.
ENGINES: Dict[str, Tuple[str, ...]] = {
    "horovod": METHODS,
    "ddp": ("no-comm", *DDP_METHODS),
    "both": ("no-comm", "dense", "dlgs-none", "dlgs", *DDP_METHODS),
}


def base_method(method: str) -> str:
    """``method`` without its ``@DENSITY`` suffix (``dlgs@0.001`` -> ``dlgs``)."""
    return method.split("@", 1)[0]


def sparse_options(method: str, density: Any) -> Optional[Dict[str, Any]]:
    """The dlgs options a sparse ``method`` trains with (``density``,
    ``controller``, ``merge``, ``topology`` where not flat and ``transport``
    where not the allgather), ``None``
    for ``no-comm`` / ``dense`` / ``fp16``.
    A ``@DENSITY`` suffix (a number or ``auto``) replaces ``density``, the
    ``--density`` default; :func:`_methods` has validated it."""
    base = base_method(method)
    if base not in SPARSE_METHODS:
        return None
    controller, merge, topology = SPARSE_METHODS[base]
    if "@" in method:
        text = method.split("@", 1)[1]
        density = text if text == "auto" else float(text)
    options: Dict[str, Any] = dict(density=density, controller=controller, merge=merge)
    if topology != "flat":
        options["topology"] = topology
    if base in TRANSPORT_METHODS:
        options["transport"] = TRANSPORT_METHODS[base]
    return options


#: The ``--framework`` choices and how the reports name them.
FRAMEWORKS: Dict[str, str] = {"torch": "torch", "tensorflow": "TensorFlow"}

#: The models each framework implements (``benchmarks/models.py``, ``benchmarks/models_tf.py``).
MODELS: Dict[str, Tuple[str, ...]] = {
    "torch": ("resnet20", "vgg16", "lstm", "bert-small"),
    "tensorflow": ("resnet20", "vgg16", "lstm"),
}

#: Environment variables recorded with every row (empty when unset); any other
#: ``DLGS_*`` variable that is set is recorded too.
ENV_HINTS: Tuple[str, ...] = (
    "DLGS_BANDWIDTH",
    "DLGS_THREADS",
    "HOROVOD_FUSION_THRESHOLD",
    "HOROVOD_CYCLE_TIME",
)


@dataclass
class MethodTimes:
    """One method's measurement on this rank (seconds per timed step).

    ``backward`` / ``step_wait`` stay empty where the breakdown cannot be
    measured (a compiled ``tf.function`` step); ``sparsify`` (host seconds in
    dlgs's submit: selection, packing, starting the collectives, inside
    ``backward``) is only measured for the dlgs-based methods. The reports
    show "—" for an empty list.
    """

    method: str
    iteration: List[float] = field(default_factory=list)
    backward: List[float] = field(default_factory=list)
    step_wait: List[float] = field(default_factory=list)
    sparsify: List[float] = field(default_factory=list)
    wire_bytes: int = 0
    messages: Optional[int] = None
    #: The dp guard's verdict on the first plan ("kept" / "layer-wise"), "" if none ran.
    guard: str = ""
    rounds: int = 1
    #: Sparse methods: the density in force after the last step (``@auto``'s choice).
    density: Optional[float] = None
    #: Sparse methods: :attr:`density` of each round pooled here, in order.
    round_densities: List[float] = field(default_factory=list)
    #: Only on the ``dlgs`` method: :func:`predicted_tails` of its last round.
    predicted_tails: Dict[str, float] = field(default_factory=dict)

    def merge(self, other: "MethodTimes") -> None:
        """Pool another round's steps into this one. Bytes are averaged over
        rounds: a merge plan is re-profiled every round and may differ; the
        message count and the density (``@auto`` chooses anew) are the latest round's."""
        if other.wire_bytes != self.wire_bytes:
            logger.warning(
                "%s: the plan changed between rounds (%d -> %d bytes on the wire); "
                "reporting the mean",
                self.method,
                self.wire_bytes,
                other.wire_bytes,
            )
        if other.density != self.density:
            # density="auto" chooses again from every round's profile.
            logger.warning(
                "%s: the density changed between rounds (%s -> %s); reporting the latest",
                self.method,
                self.density,
                other.density,
            )
            self.density = other.density
        total = self.wire_bytes * self.rounds + other.wire_bytes * other.rounds
        self.rounds += other.rounds
        self.wire_bytes = round(total / self.rounds)
        self.iteration += other.iteration
        self.backward += other.backward
        self.step_wait += other.step_wait
        self.sparsify += other.sparsify
        self.round_densities += other.round_densities
        self.messages = other.messages
        self.guard = other.guard
        self.predicted_tails = other.predicted_tails or self.predicted_tails


def predicted_tails(planner: Any, exchange: Any) -> Dict[str, float]:
    """What dlgs's planner predicts each method adds to a step, in seconds:
    the predicted end of its last message minus the back-propagation it hides
    behind, from the profile the dp planner measured in this run (its layers'
    backward times, selection and packing costs and the collectives it probed).

    ``dlgs``: the plan in force (the guard's fallback included); ``topk``,
    ``dgc``, ``dlgs-none``: layer-wise with the same per-layer rule;
    ``topk-buckets``: the ``buckets`` strategy; ``dense`` / ``fp16``: every
    layer allreduced on its own with 4 / 2 bytes per element (Horovod's tensor
    fusion is not modelled). Empty before the planner has a plan.
    """
    profile, plan = planner.profile, planner.plan
    if profile is None or plan is None:
        return {}
    each = planner.ready_densities(exchange)  # density="auto"'s per-layer choice
    density = exchange.density if each is None else each
    spec, eligible = build_spec(profile, exchange.config, density)
    dense = [False] * len(spec.layers)
    half = replace(
        spec, layers=tuple(replace(x, dense_bytes=x.dense_bytes // 2) for x in spec.layers)
    )
    layerwise = plan_strategy(spec, "none", eligible=eligible)
    plans = {
        "dense": plan_strategy(spec, "none", eligible=dense),
        "fp16": plan_strategy(half, "none", eligible=dense),
        "topk": layerwise,
        "dgc": layerwise,
        "dlgs-none": layerwise,
        "topk-buckets": plan_strategy(
            spec,
            "buckets",
            eligible=eligible,
            bucket_elements=planner.bucket_elements,
            numel=[x.numel for x in profile.layers],
        ),
        "dlgs": plan,
    }
    backward = sum(x.backward for x in spec.layers)
    return {m: max(p.end - backward, 0.0) for m, p in plans.items()}


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated ``q`` quantile (0..1) of ``values``."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _median_or_blank(values: Sequence[float]) -> Any:
    return statistics.median(values) if values else ""


def summarise(
    per_rank: Sequence[Sequence[MethodTimes]],
    *,
    model: str,
    batch: int,
    density: float,
    label: str,
    framework: str = "torch",
    load: Tuple[float, float] = (float("nan"), float("nan")),
    compute: str = "real",
) -> List[Dict[str, Any]]:
    """One CSV row per method from every rank's times (``per_rank[r][m]``).

    Every number is the slowest rank's (largest median iteration): synchronous
    training runs at its pace. Ranks of ``no-comm`` never wait for each other,
    so a per-step maximum over ranks would pair unrelated noise and overstate
    the compute bound; the slowest rank's median does not. ``load``: rank 0's
    host's 1-minute load average at the start and the end (a shared machine
    shows here). ``compute``: ``"real"``, or the emulation's label
    (``benchmarks/emulate.py``), recorded in every row.
    """
    workers = len(per_rank)
    env = {k: os.environ.get(k, "") for k in ENV_HINTS}
    env.update({k: v for k, v in sorted(os.environ.items()) if k.startswith("DLGS_")})
    rows = []
    for m, mine in enumerate(per_rank[0]):
        slowest = max((r[m] for r in per_rank), key=lambda t: statistics.median(t.iteration))
        it = slowest.iteration
        med = statistics.median(it)
        rows.append(
            {
                "label": label,
                "framework": framework,
                "model": model,
                "compute": compute,
                "method": mine.method,
                "workers": workers,
                "density": (
                    (density if mine.density is None else mine.density)
                    if base_method(mine.method) in SPARSE_METHODS
                    else ""
                ),
                "round_densities": "/".join(f"{d:g}" for d in mine.round_densities),
                "batch": batch,
                "steps": len(it),
                "rounds": slowest.rounds,
                "median_step_s": med,
                "p10": percentile(it, 0.1),
                "p90": percentile(it, 0.9),
                "samples_per_s": batch * workers / med,
                "wire_bytes_per_step": mine.wire_bytes,
                "messages": "" if mine.messages is None else mine.messages,
                "guard": mine.guard,
                "backward_s": _median_or_blank(slowest.backward),
                "step_wait_s": _median_or_blank(slowest.step_wait),
                "sparsify_s": _median_or_blank(slowest.sparsify),
                "efficiency_vs_nocomm": "",
                "bound_noise": "",
                "speedup_vs_dense": "",
                "predicted_step_s": "",
                "prediction_error": "",
                "load_start": round(load[0], 2),
                "load_end": round(load[1], 2),
                **env,
            }
        )
    by = {r["method"]: r["median_step_s"] for r in rows}
    bound = next((r for r in rows if r["method"] == "no-comm"), None)
    tails = next((t.predicted_tails for t in per_rank[0] if t.predicted_tails), {})
    for r in rows:
        if "no-comm" in by and r["method"] in tails:
            # The planner predicts what communication adds to the compute bound.
            r["predicted_step_s"] = by["no-comm"] + tails[r["method"]]
            r["prediction_error"] = r["predicted_step_s"] / r["median_step_s"] - 1
        if "no-comm" in by:
            r["efficiency_vs_nocomm"] = by["no-comm"] / r["median_step_s"]
            r["bound_noise"] = beats_bound(r, bound)
        if "dense" in by:
            r["speedup_vs_dense"] = by["dense"] / r["median_step_s"]
    return rows


def beats_bound(row: Dict[str, Any], bound: Optional[Dict[str, Any]]) -> str:
    """``"noise"`` when ``row``'s median step is below the no-comm bound's p10:
    faster than the compute alone by more than the bound's own spread, which
    communication cannot do, so the difference is the machine's noise and no
    result. Empty otherwise (and for the bound itself)."""
    if bound is None or row is bound or row["method"] == "no-comm":
        return ""
    return "noise" if float(row["median_step_s"]) < float(bound["p10"]) else ""


def _efficiency_cell(row: Dict[str, Any]) -> str:
    cell = _fmt(row["efficiency_vs_nocomm"], 100, ".0f", "%")
    return cell + " (noise)" if row.get("bound_noise") == "noise" else cell


def write_csv(rows: Sequence[Dict[str, Any]], path: Path, append: bool) -> List[Dict[str, Any]]:
    """Write ``rows`` (after the existing ones with ``append``); return every row.

    Columns are the union over old and new rows, so a later suite may record
    other environment hints; missing cells are left empty (rows written before
    the ``framework`` column existed are torch's).
    """
    old: List[Dict[str, Any]] = []
    if append and path.exists():
        with open(path, newline="") as f:
            old = list(csv.DictReader(f))
    everything = old + list(rows)
    fields = list(dict.fromkeys(k for r in everything for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(everything)
    return everything


def _fmt(value: Any, scale: float = 1.0, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if value == "" or value is None else f"{float(value) * scale:{spec}}{suffix}"


#: What the Markdown says about an emulated-compute run.
EMULATED = (
    "every layer's forward and backward computation is a wait on an emulated device "
    "clock (benchmarks/emulate.py), not real compute; dlgs, Horovod and the network "
    "run for real, on gradients drawn from a Student-t fitted to real ones. The "
    "no-comm bound is the emulated compute plus what each step's host work adds."
)


def is_emulated(row: Dict[str, Any]) -> bool:
    """Whether a row was measured with emulated compute (rows from before the
    ``compute`` column are real)."""
    return str(row.get("compute") or "real") != "real"


def framework_of(row: Dict[str, Any]) -> str:
    """A row's framework; rows from before the column existed are torch's."""
    return str(row.get("framework") or "torch")


def method_cell(row: Dict[str, Any]) -> str:
    """The method's name; ``@auto`` with the density it chose (each round's,
    where rounds chose differently)."""
    method = str(row["method"])
    rounds = str(row.get("round_densities") or "").split("/")
    if method.endswith("@auto") and len(set(rounds)) > 1:
        return f"{method} (chose {', '.join(rounds)} by round)"
    if method.endswith("@auto") and row.get("density") not in ("", None):
        return f"{method} (chose {float(row['density']):g})"
    return method


def format_markdown(
    rows: Sequence[Dict[str, Any]],
    command: str,
    *,
    versions: str,
    threads: str,
    sample: str,
    timing: str,
    note: str = "",
) -> str:
    """One run's section: the table, what was measured, the command and versions.

    Args:
        rows: this run's rows (:func:`summarise`).
        command: the command line that reproduces the run.
        versions: the framework and Horovod versions, e.g. ``"torch 2.13.0, Horovod 0.28.1"``.
        threads: the threading, e.g. ``"1 torch thread(s) per rank"``.
        sample: what one sample is, e.g. ``"32x32 image"``.
        timing: the paragraph defining the columns (the framework's step differs).
        note: a sentence on the setting.
    """
    r0 = rows[0]
    hints = ", ".join(f"{k}={r0[k]}" for k in r0 if k.isupper() and r0[k] != "") or "none"
    framework = framework_of(r0)
    emulated = is_emulated(r0)
    lines = [
        f"# Training throughput: {r0['model']}"
        + (" (emulated compute)" if emulated else "")
        + ("" if framework == "torch" else f" ({FRAMEWORKS.get(framework, framework)})")
        + f", {r0['workers']} workers"
        + (f" ({r0['label']})" if r0["label"] else ""),
        "",
        f"Command: `{command}`",
        "",
        f"{versions}, Python {platform.python_version()}, world size {r0['workers']}, "
        f"{threads}; per-rank batch {r0['batch']} ({sample} each); host load average "
        f"{r0['load_start']} at the start, {r0['load_end']} at the end, on {os.cpu_count()} "
        f"CPUs; environment: {hints}.",
        "",
        timing,
        "",
        *([f"**Emulated compute** ({r0['compute']}): {EMULATED}", ""] if emulated else []),
        "| method | step ms [p10–p90] | samples/s | wire MB/step | messages | backward ms "
        "| sparsify ms | step wait ms | efficiency vs no-comm | speed-up vs dense "
        "| predicted ms (error) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {method_cell(r)} | {float(r['median_step_s']) * 1e3:.1f} "
            f"[{float(r['p10']) * 1e3:.1f}–{float(r['p90']) * 1e3:.1f}] "
            f"| {float(r['samples_per_s']):.1f} | {int(r['wire_bytes_per_step']) / 1e6:.3f} "
            f"| {r['messages'] if r['messages'] != '' else '—'}"
            f"{' (guard: layer-wise)' if r.get('guard') == 'layer-wise' else ''} "
            f"| {_fmt(r['backward_s'], 1e3, '.1f')} | {_fmt(r.get('sparsify_s'), 1e3, '.1f')} "
            f"| {_fmt(r['step_wait_s'], 1e3, '.1f')} "
            f"| {_efficiency_cell(r)} "
            f"| {_fmt(r['speedup_vs_dense'], 1, '.2f', 'x')} "
            f"| {_predicted(r)} |"
        )
    noisy = [method_cell(r) for r in rows if r.get("bound_noise") == "noise"]
    if noisy:
        lines += [
            "",
            f"**Noise, not a result:** {', '.join(noisy)} measured faster than the no-comm "
            "bound by more than the bound's own spread (median below its p10). Communication "
            "cannot make a step faster than computing it alone: these cells show how noisy "
            "the machine was; compare them only within the spread, or run more `--rounds`.",
        ]
    if note:
        lines += ["", f"Note: {note}"]
    return "\n".join(lines) + "\n"


def _predicted(row: Dict[str, Any]) -> str:
    if row.get("predicted_step_s") in ("", None):
        return "—"
    return (
        f"{float(row['predicted_step_s']) * 1e3:.1f} ({100 * float(row['prediction_error']):+.0f}%)"
    )


def plot(rows: Sequence[Dict[str, Any]], path: Path) -> None:
    """Bar chart of samples/s by method, one panel per (framework, model, label, workers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites: Dict[Tuple[str, str, str, str], List[Dict[str, Any]]] = {}
    for r in rows:
        model = str(r["model"]) + (" (emulated compute)" if is_emulated(r) else "")
        key = (framework_of(r), model, str(r["label"]), str(r["workers"]))
        suites.setdefault(key, []).append(r)
    colours = {m: f"C{i}" for i, m in enumerate(METHODS)}
    tints = iter(f"C{i}" for i in range(len(METHODS), 10 * len(METHODS)))
    fig, axes = plt.subplots(
        1,
        len(suites),
        figsize=(max(6.0, 1.0 + 0.8 * max(map(len, suites.values()))) * len(suites), 4.2),
        squeeze=False,
    )
    for ax, ((framework, model, label, workers), rs) in zip(axes[0], suites.items()):
        names = [r["method"] for r in rs]
        values = [float(r["samples_per_s"]) for r in rs]
        # Error bars: the samples/s of the p90 and p10 step times.
        spread = [
            [v - v * float(r["median_step_s"]) / float(r["p90"]) for v, r in zip(values, rs)],
            [v * float(r["median_step_s"]) / float(r["p10"]) - v for v, r in zip(values, rs)],
        ]
        bars = ax.bar(
            names,
            values,
            yerr=spread,
            capsize=3,
            error_kw={"elinewidth": 0.8, "ecolor": "0.3"},
            color=[
                colours[n] if n in colours else colours.setdefault(n, next(tints)) for n in names
            ],
        )
        for bar, r in zip(bars, rs):
            if r["speedup_vs_dense"] not in ("", None):
                ax.annotate(
                    f"{float(r['speedup_vs_dense']):.2f}x",
                    (bar.get_x() + bar.get_width() / 2, 0),
                    xytext=(0, 3),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    color="white",
                    fontweight="bold",
                    fontsize=8,
                )
        ax.set_ylim(0, max(v + e for v, e in zip(values, spread[1])) * 1.08)
        ax.set_ylabel("samples/s (all workers)")
        name = (
            model if framework == "torch" else f"{model} ({FRAMEWORKS.get(framework, framework)})"
        )
        ax.set_title(f"{name}, {workers} workers" + (f", {label}" if label else ""), fontsize=10)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(
        "Training throughput (median, whiskers p90-p10 step time; in the bar: speed-up "
        "over dense Horovod)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(
    gathered: Sequence[Sequence[Dict[str, Any]]],
    args: argparse.Namespace,
    argv: Sequence[str],
    *,
    batch: int,
    workers: int,
    versions: str,
    threads: str,
    sample: str,
    timing: str,
    load_start: float,
    model: Optional[str] = None,
    compute: str = "real",
) -> str:
    """Rank 0's outputs from every rank's ``vars(MethodTimes)`` (``gathered[rank]``):
    ``train.csv`` (appended with ``--append``), a ``train.md`` section and
    ``train.png`` redrawn from every row. Returns the Markdown section.
    ``model`` replaces ``args.model`` in the rows (an emulated model's name);
    ``compute`` is :func:`summarise`'s."""
    per_rank = [[MethodTimes(**t) for t in ts] for ts in gathered]
    rows = summarise(
        per_rank,
        framework=args.framework,
        model=model or args.model,
        batch=batch,
        density=args.density,
        label=args.label,
        load=(load_start, os.getloadavg()[0]),
        compute=compute,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    everything = write_csv(rows, args.out / "train.csv", args.append)
    command = f"horovodrun -np {workers} python -m benchmarks.train " + " ".join(
        shlex.quote(str(a)) for a in argv
    )
    section = format_markdown(
        rows,
        command,
        versions=versions,
        threads=threads,
        sample=sample,
        timing=timing,
        note=args.note,
    )
    md = args.out / "train.md"
    if args.append and md.exists():
        md.write_text(md.read_text().rstrip("\n") + "\n\n---\n\n" + section)
    else:
        md.write_text(section)
    plot(everything, args.out / "train.png")
    return section


# -- the command line -----------------------------------------------------------


def _methods(text: str) -> List[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    known = (*METHODS, *TORCH_METHODS)
    bad = [m for m in names if base_method(m) not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown method(s) {bad or [text]}; choose from {', '.join(known)} "
            "(a sparse method may end in @DENSITY or, if it merges, @auto)"
        )
    for m in names:
        if "@" in m:
            _density_suffix(m)
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a method is listed twice: {text!r}")
    return names


def _density_suffix(method: str) -> None:
    """Validate ``method``'s ``@DENSITY`` suffix (argparse errors name the method)."""
    base, text = method.split("@", 1)
    if base not in SPARSE_METHODS:
        raise argparse.ArgumentTypeError(
            f"{method!r}: only the sparse methods ({', '.join(SPARSE_METHODS)}) take @DENSITY"
        )
    if text == "auto":
        if SPARSE_METHODS[base][1] != "dp":
            raise argparse.ArgumentTypeError(
                f"{method!r}: @auto needs the dp merge plan (dlgs), got {base!r}"
            )
        return
    try:
        density(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{method!r}: the density {e}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def add_wire_options(parser: argparse.ArgumentParser) -> None:
    """``--value-dtype``, ``--index-coding`` and ``--link-bandwidth`` (read back by
    :func:`wire_options`)."""
    parser.add_argument(
        "--value-dtype",
        choices=["float32", "float16", "bfloat16"],
        default="float32",
        help="sparse methods: dtype of the values on the wire",
    )
    parser.add_argument(
        "--index-coding",
        choices=[c.value for c in IndexCoding],
        default="auto",
        help="sparse methods: how indices are sent (auto: the smallest per message)",
    )
    parser.add_argument(
        "--link-bandwidth",
        type=_link_option,
        default="cluster",
        help="sparse methods: dlgs's link_bandwidth, what the plan prices bytes at that its "
        "probes could not see: a rate (1gbit, 100mbit), 'none', or 'cluster' (the default: "
        "the --bandwidth of benchmarks.cluster, which sets DLGS_BANDWIDTH; none without one)",
    )
    parser.add_argument(
        "--profile-budget",
        type=density,  # a share in (0, 1], as a density is
        default=None,
        help="sparse methods: dlgs's profile_budget, the share of the run probes may cost, in "
        "(0, 1] (default: dlgs's, 0.01); larger lets the probes grow until a slow link's "
        "bytes stand out of the noise",
    )


def _rate(text: str, name: str) -> Optional[int]:
    """``text`` (``1gbit``, ``100mbit``, bit/s or ``none``) in bit/s, or None;
    a ``ValueError`` naming ``name`` otherwise."""
    if text == "none":
        return None
    from benchmarks.cluster import parse_rate

    try:
        return parse_rate(text)
    except ValueError:
        raise ValueError(
            f"{name} must be a rate (1gbit, 100mbit, bit/s) or none, got {text!r}"
        ) from None


def _link_option(text: str) -> str:
    """argparse type of ``--link-bandwidth``: ``cluster`` or a valid rate."""
    if text != "cluster":
        try:
            _rate(text, "--link-bandwidth")
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return text


def link_bandwidth(text: str) -> Optional[int]:
    """``--link-bandwidth``'s value in bit/s, or None (see :func:`add_wire_options`)."""
    if text == "cluster":
        return _rate(os.environ.get("DLGS_BANDWIDTH", "none"), "DLGS_BANDWIDTH")
    return _rate(text, "--link-bandwidth")


def wire_options(args: argparse.Namespace) -> Dict[str, Any]:
    """The sparse methods' wire format and link options from the command line."""
    options: Dict[str, Any] = {"value_dtype": args.value_dtype, "index_coding": args.index_coding}
    rate = link_bandwidth(args.link_bandwidth)
    if rate is not None:
        options["link_bandwidth"] = float(rate)
    if getattr(args, "profile_budget", None) is not None:
        options["profile_budget"] = args.profile_budget
    return options


def density(text: str) -> float:
    """argparse type: a density in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def setup_rank_logging(rank: int, verbose: bool) -> None:
    """INFO on rank 0, warnings elsewhere; dlgs' per-plan INFO lines only with ``verbose``."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
    )
    if not verbose:
        # dlgs logs every layout and plan at INFO; keep the benchmark's output readable.
        logging.getLogger("dlgs").setLevel(logging.WARNING)


def progress_bar(total: int, rank: int):
    """A tqdm bar of ``total`` steps, shown on rank 0 only."""
    from tqdm import tqdm

    # Under horovodrun stderr is a pipe: redraw rarely so the log stays readable.
    interval = 0.1 if sys.stderr.isatty() else 10.0
    return tqdm(total=total, disable=rank != 0, unit="step", mininterval=interval)


def accumulate(mine: Dict[str, "MethodTimes"], got: "MethodTimes", round_: int, rank: int) -> None:
    """Add one round's times of ``got.method`` to this rank's results, and log them."""
    if got.density is not None and not got.round_densities:
        got.round_densities = [got.density]
    if got.method in mine:
        mine[got.method].merge(got)
    else:
        mine[got.method] = got
    logger.info(
        "round %d, %s: median %.1f ms on rank %d, %.3f MB on the wire per step",
        round_ + 1,
        got.method,
        statistics.median(got.iteration) * 1e3,
        rank,
        got.wire_bytes / 1e6,
    )


def settle_steps(profile_steps: int, auto: bool = False) -> int:
    """Steps before a merging method's plan is final and in force: one skipped,
    ``profile_steps`` profiled, the plan's first step (buffers re-laid),
    ``profile_steps`` timed under it for the refined plan, and that plan's
    first step (see ``dlgs.core.planning.online.OnlinePlanner``). With ``auto``
    (``density="auto"``), room for the chosen density to be measured slower
    and the earlier one timed again: ``profile_steps`` and a first step more."""
    return 2 * profile_steps + 3 + (profile_steps + 1 if auto else 0)


def is_auto(method: str) -> bool:
    """Whether ``method`` asks for ``density="auto"`` (``dlgs@auto``)."""
    return method.partition("@")[2] == "auto"


def run_rounds(
    args: argparse.Namespace,
    rank: int,
    barrier: Callable[[], Any],
    one: Callable[[str, int, int, Any], MethodTimes],
) -> Dict[str, MethodTimes]:
    """Every method of ``args`` ``args.rounds`` times in turn on this rank (each
    round in the order of the last shifted by one), behind a progress bar,
    pooled per method (:func:`accumulate`).

    ``barrier()`` runs before each method so that every rank starts it together;
    ``one(method, round_, warmup, bar)`` runs and times one method with
    ``warmup`` untimed steps (:func:`warmup_steps`), ticking ``bar`` per step.
    """
    from tqdm.contrib.logging import logging_redirect_tqdm

    mine: Dict[str, MethodTimes] = {}
    bar = progress_bar(total_steps(args), rank)
    with bar, logging_redirect_tqdm():
        for round_ in range(args.rounds):
            # Each round starts one method later, so no method always runs
            # first (or right after the same neighbour) on a drifting machine.
            shift = round_ % len(args.methods)
            for method in args.methods[shift:] + args.methods[:shift]:
                name = args.emulate.split(":")[-1] if getattr(args, "emulate", None) else args.model
                bar.set_description(f"{name} {method}")
                barrier()
                got = one(
                    method, round_, warmup_steps(method, args.warmup, args.profile_steps), bar
                )
                gc.collect()
                accumulate(mine, got, round_, rank)
    return mine


def guard_verdict(planner: Any) -> str:
    """``"kept"`` or ``"layer-wise"``: the dp guard's verdict on ``planner``'s
    first plan (``dlgs.core.planning.online.OnlinePlanner``); ``""`` if none ran."""
    result = planner.guard_result
    return "" if result is None else "kept" if result["kept"] else "layer-wise"


def is_merging(method: str) -> bool:
    """Whether ``method`` plans merges online (and so needs :func:`settle_steps`)."""
    base = base_method(method)
    return base in SPARSE_METHODS and SPARSE_METHODS[base][1] != "none"


def warmup_steps(method: str, warmup: int, profile_steps: int) -> int:
    """Untimed steps before ``method`` is timed: ``--warmup``, raised for a
    merging method to :func:`settle_steps` so its final plan is in force."""
    if not is_merging(method):
        return warmup
    return max(warmup, settle_steps(profile_steps, is_auto(method)))


def total_steps(args: argparse.Namespace) -> int:
    """Steps one rank runs in all (the progress bar's total)."""
    per_round = sum(
        warmup_steps(m, args.warmup, args.profile_steps) + args.steps for m in args.methods
    )
    return args.rounds * per_round


def parse_args(argv: Optional[Sequence[str]] = None, description: str = "") -> argparse.Namespace:
    """The training benchmark's command line, validated (errors name the option)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.train",
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--framework",
        default="torch",
        choices=list(FRAMEWORKS),
        help="torch: benchmarks/train_torch.py; tensorflow: benchmarks/train_tf.py (Keras 3)",
    )
    every_model = list(dict.fromkeys(m for ms in MODELS.values() for m in ms))
    parser.add_argument(
        "--model",
        default="resnet20",
        choices=every_model,
        help=f"tensorflow has {', '.join(MODELS['tensorflow'])}",
    )
    parser.add_argument(
        "--methods",
        type=_methods,
        default=None,
        help=f"comma list of {METHODS}, the torch-only {TORCH_METHODS} (default: --engine's)",
    )
    parser.add_argument(
        "--engine",
        choices=list(ENGINES),
        default="horovod",
        help="the default methods: Horovod's forms, PyTorch DDP's (plain, fp16 and PowerSGD "
        "hooks, dlgs's hook; torch only) or both, side by side",
    )
    parser.add_argument(
        "--batch", type=positive_int, default=None, help="per-rank batch (default: per model)"
    )
    parser.add_argument("--density", type=density, default=0.01, help="sparse methods")
    add_wire_options(parser)
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per method")
    parser.add_argument(
        "--warmup",
        type=positive_int,
        default=10,
        help="untimed steps before each method is timed; merging methods (topk-buckets, "
        "dlgs) take at least 2 x --profile-steps + 3 (dlgs@auto 3 x --profile-steps + 4), so "
        "that their final plan is in force",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="run the method list this many times, pooling the timed steps (each round "
        "rebuilds and warms up; spreads slow drifts of a shared machine over every method)",
    )
    parser.add_argument(
        "--profile-steps", type=positive_int, default=3, help="dlgs profiling (merging methods)"
    )
    parser.add_argument(
        "--bucket-cap-mb",
        type=positive_float,
        default=None,
        help="DDP methods but PowerSGD's: DDP's bucket_cap_mb (default: DDP's own, 25; the "
        "hooks see gradients a bucket at a time, so a cap near the model's size leaves the "
        "exchange nothing to overlap)",
    )
    parser.add_argument(
        "--tf-mode",
        choices=["function", "py-function", "eager"],
        default=None,
        help="tensorflow only: compile each step with tf.function (default; the exchange "
        "then runs in one tf.py_function) or run it eagerly (slower, but measures the "
        "backward / step-wait breakdown)",
    )
    parser.add_argument(
        "--emulate",
        default=None,
        metavar="SOURCE",
        help="torch only: emulated compute (benchmarks/emulate.py): every layer's computation "
        "becomes a wait of its duration, everything else runs for real; SOURCE is "
        "catalog:MODEL (resnet50, vgg16, bert-base, ptb-lstm; replaces --model), 'measured' "
        "(--model, timed on this machine) or a saved dlgs Profile JSON. Frees the cores for "
        "communication, so that many workers measure the network; trades the compute's "
        "realism (and the host work's cost relative to it) for that",
    )
    parser.add_argument(
        "--emulate-speed",
        type=positive_float,
        default=None,
        help="with --emulate: divide every duration by this (an accelerator that many times "
        "faster than the source) (default: 1)",
    )
    parser.add_argument(
        "--emulate-flops",
        type=positive_float,
        default=None,
        help="with --emulate catalog:MODEL: sustained FLOP/s of one worker "
        f"(default: {DEFAULT_COMPUTE_FLOPS:g}, about a V100)",
    )
    parser.add_argument(
        "--label", default=None, help="suite label (default: $DLGS_BANDWIDTH, else $DLGS_CLUSTER)"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/train"))
    parser.add_argument("--append", action="store_true", help="add rows to an existing CSV")
    parser.add_argument("--note", default="", help="a sentence for the Markdown (the setting)")
    parser.add_argument(
        "--verbose", action="store_true", help="log dlgs's layouts, profiles and plans"
    )
    args = parser.parse_args(argv)
    if args.methods is None:
        args.methods = list(ENGINES[args.engine])
    if args.model not in MODELS[args.framework]:
        parser.error(
            f"argument --model: {args.model!r} is not implemented for --framework "
            f"{args.framework}; choose from {', '.join(MODELS[args.framework])}"
        )
    if args.emulate is None:
        for option in ("emulate_speed", "emulate_flops"):
            if getattr(args, option) is not None:
                parser.error(f"argument --{option.replace('_', '-')}: only with --emulate")
    elif args.framework != "torch":
        parser.error("argument --emulate: only with --framework torch")
    elif args.emulate_flops is not None and not args.emulate.startswith("catalog:"):
        parser.error("argument --emulate-flops: only with --emulate catalog:MODEL")
    if args.framework == "tensorflow":
        torch_only = [m for m in args.methods if base_method(m) in TORCH_METHODS]
        if torch_only:
            parser.error(f"argument --methods: {', '.join(torch_only)} only with --framework torch")
        args.tf_mode = args.tf_mode or "function"
    elif args.tf_mode is not None:
        parser.error("argument --tf-mode: only with --framework tensorflow")
    if args.label is None:
        bandwidth = os.environ.get("DLGS_BANDWIDTH", "")
        use = bandwidth if bandwidth not in ("", "none") else os.environ.get("DLGS_CLUSTER", "")
        args.label = use
    return args
