"""Training throughput: dense Horovod, fp16, top-k, DGC and dlgs on real ranks.

Run under horovodrun; every rank trains the same model on synthetic data with
each method in turn (same process, same initial weights) and rank 0 writes::

    OUT/train.csv   one row per method: median step time with p10/p90, global
                    samples/s, bytes this rank puts on the wire per step, the
                    backward / step-wait breakdown, efficiency against the
                    compute-only bound and speed-up over dense Horovod
    OUT/train.md    the table, the exact command, torch/Horovod versions, world size
    OUT/train.png   samples/s by method, annotated with the speed-up over dense

Example::

    horovodrun -np 2 --gloo python -m benchmarks.train --model resnet20 \\
        --methods no-comm,dense,fp16,topk,dgc,dlgs-none,dlgs --steps 20 --warmup 8 \\
        --out benchmarks/results/train-loopback-resnet20

Methods (plain SGD, lr 0.01, no momentum, for all of them, so each step does
the same work; this measures speed, not convergence):

* ``no-comm``: the wrapped torch optimizer alone, no exchange: the compute bound;
* ``dense`` / ``fp16``: ``hvd.DistributedOptimizer`` (fp16: ``hvd.Compression.fp16``);
* ``topk`` / ``topk-buckets`` / ``dgc``: ``dlgs.torch.DistributedOptimizer`` with
  the ``topk`` controller layer-wise / in ``bucket_elements`` buckets, and the
  ``dgc`` (sampled top-k) controller layer-wise;
* ``dlgs-none`` / ``dlgs``: the dynamic controller layer-wise / with the DP merge
  plan (the product default).

A step is a full iteration (zero_grad, forward, backward, step); the median
over ``--steps`` steps (times ``--rounds``) of the slowest rank is reported,
since synchronous training runs at the pace of its slowest worker.

``--append`` adds the rows to an existing CSV (for suites over several
networks, e.g. with ``--label 100mbit``), appends a section to the Markdown
and redraws the plot from every row.
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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import horovod
import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

import dlgs.torch

from .models import LSTMLM, VGG16, BertSmall, ResNet20

__all__ = [
    "METHODS",
    "MODELS",
    "MethodTimes",
    "ModelSpec",
    "build_optimizer",
    "format_markdown",
    "main",
    "plot",
    "run_method",
    "summarise",
    "write_csv",
]

logger = logging.getLogger("benchmarks.train")

# Every method uses this optimizer so each step does the same arithmetic.
LR = 0.01

#: dlgs methods: (controller, merge).
SPARSE_METHODS: Dict[str, Tuple[str, str]] = {
    "topk": ("topk", "none"),
    "topk-buckets": ("topk", "buckets"),
    "dgc": ("dgc", "none"),
    "dlgs-none": ("dynamic", "none"),
    "dlgs": ("dynamic", "dp"),
}
METHODS: Tuple[str, ...] = ("no-comm", "dense", "fp16", *SPARSE_METHODS)

#: Environment variables recorded with every row (empty when unset); any other
#: ``DLGS_*`` variable that is set is recorded too.
ENV_HINTS: Tuple[str, ...] = (
    "DLGS_BANDWIDTH",
    "DLGS_THREADS",
    "HOROVOD_FUSION_THRESHOLD",
    "HOROVOD_CYCLE_TIME",
)

Batch = Tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    """How to build, feed and score one benchmark model.

    Attributes:
        build: a fresh model (seed the global RNG first for equal weights).
        batch: default per-rank batch size.
        make_batch: ``(batch, generator) -> (inputs, targets)``, synthetic.
        loss: ``(outputs, targets) -> scalar``.
        sample: what one sample is, for the report.
    """

    build: Callable[[], nn.Module]
    batch: int
    make_batch: Callable[[int, torch.Generator], Batch]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    sample: str


def _images(batch: int, g: torch.Generator) -> Batch:
    return torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _ptb_tokens(batch: int, g: torch.Generator) -> Batch:
    # 35-token BPTT windows; the target is the next token.
    seq = torch.randint(0, 10000, (batch, 36), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _mlm_tokens(batch: int, g: torch.Generator) -> Batch:
    # BERT-style masked LM: 15% of positions replaced by id 0 ([MASK]) and
    # predicted; the rest are ignored by the loss.
    tokens = torch.randint(1, 8000, (batch, 128), generator=g)
    masked = torch.rand(batch, 128, generator=g) < 0.15
    return tokens.masked_fill(masked, 0), tokens.masked_fill(~masked, -100)


def _sequence_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1), ignore_index=-100)


MODELS: Dict[str, ModelSpec] = {
    "resnet20": ModelSpec(ResNet20, 32, _images, F.cross_entropy, "32x32 image"),
    "vgg16": ModelSpec(VGG16, 32, _images, F.cross_entropy, "32x32 image"),
    "lstm": ModelSpec(LSTMLM, 20, _ptb_tokens, _sequence_loss, "35-token sequence"),
    "bert-small": ModelSpec(BertSmall, 16, _mlm_tokens, _sequence_loss, "128-token sequence"),
}


@dataclass
class MethodTimes:
    """One method's measurement on this rank (seconds per timed step)."""

    method: str
    iteration: List[float] = field(default_factory=list)
    backward: List[float] = field(default_factory=list)
    step_wait: List[float] = field(default_factory=list)
    wire_bytes: int = 0
    messages: Optional[int] = None
    rounds: int = 1

    def merge(self, other: "MethodTimes") -> None:
        """Pool another round's steps into this one. Bytes are averaged over
        rounds: a merge plan is re-profiled every round and may differ; the
        message count is the latest round's."""
        if other.wire_bytes != self.wire_bytes:
            logger.warning(
                "%s: the plan changed between rounds (%d -> %d bytes on the wire); "
                "reporting the mean",
                self.method,
                self.wire_bytes,
                other.wire_bytes,
            )
        total = self.wire_bytes * self.rounds + other.wire_bytes * other.rounds
        self.rounds += other.rounds
        self.wire_bytes = round(total / self.rounds)
        self.iteration += other.iteration
        self.backward += other.backward
        self.step_wait += other.step_wait
        self.messages = other.messages


def build_optimizer(
    method: str, model: nn.Module, density: float, profile_steps: int
) -> torch.optim.Optimizer:
    """The optimizer ``method`` trains with (plain SGD, lr 0.01, inside)."""
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0)
    if method == "no-comm":
        return sgd
    if method in ("dense", "fp16"):
        compression = hvd.Compression.fp16 if method == "fp16" else hvd.Compression.none
        return hvd.DistributedOptimizer(
            sgd, named_parameters=model.named_parameters(), compression=compression
        )
    controller, merge = SPARSE_METHODS[method]
    return dlgs.torch.DistributedOptimizer(
        sgd,
        named_parameters=model.named_parameters(),
        density=density,
        controller=controller,
        merge=merge,
        profile_steps=profile_steps,
    )


def run_method(
    spec: ModelSpec,
    method: str,
    data: Batch,
    *,
    density: float,
    warmup: int,
    steps: int,
    profile_steps: int,
    progress: Optional[Any] = None,
) -> MethodTimes:
    """Warm up, then time ``steps`` full iterations of ``method`` on this rank.

    The model is built from seed 0 and broadcast from rank 0, so every method
    starts from the same weights. For merging dlgs methods the warm-up covers
    the profile and the first planned step; a plan not in force by then is an
    error (the timed steps would measure the profiler).
    """
    torch.manual_seed(0)
    model = spec.build()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = build_optimizer(method, model, density, profile_steps)
    x, y = data
    out = MethodTimes(method)
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = spec.loss(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i >= warmup:
            out.iteration.append(t3 - t0)
            out.backward.append(t2 - t1)
            out.step_wait.append(t3 - t2)
        elif i == warmup - 1 and method in SPARSE_METHODS and SPARSE_METHODS[method][1] != "none":
            if opt.dlgs_planner.plan is None:
                raise RuntimeError(
                    f"{method}: no merge plan after {warmup} warm-up steps; use "
                    f"--warmup >= --profile-steps + 2 ({profile_steps + 2})"
                )
        if progress is not None:
            progress.update(1)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if method == "dense":
        out.wire_bytes = 4 * params
    elif method == "fp16":
        out.wire_bytes = 2 * params
    elif method in SPARSE_METHODS:
        out.wire_bytes = sum(int(r["wire_bytes"]) for r in opt.dlgs_stats())
        out.messages = len(opt.dlgs_exchange.groups)
        if SPARSE_METHODS[method][1] != "none":
            logger.debug("%s: plan in force\n%s", method, opt.dlgs_planner.plan.describe())
    return out


def _percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated ``q`` quantile (0..1) of ``values``."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarise(
    per_rank: Sequence[Sequence[MethodTimes]],
    *,
    model: str,
    batch: int,
    density: float,
    label: str,
    load: Tuple[float, float] = (float("nan"), float("nan")),
) -> List[Dict[str, Any]]:
    """One CSV row per method from every rank's times (``per_rank[r][m]``).

    Every number is the slowest rank's (largest median iteration): synchronous
    training runs at its pace. Ranks of ``no-comm`` never wait for each other,
    so a per-step maximum over ranks would pair unrelated noise and overstate
    the compute bound; the slowest rank's median does not. ``load``: rank 0's
    host's 1-minute load average at the start and the end (a shared machine
    shows here).
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
                "model": model,
                "method": mine.method,
                "workers": workers,
                "density": density if mine.method in SPARSE_METHODS else "",
                "batch": batch,
                "steps": len(it),
                "rounds": slowest.rounds,
                "median_step_s": med,
                "p10": _percentile(it, 0.1),
                "p90": _percentile(it, 0.9),
                "samples_per_s": batch * workers / med,
                "wire_bytes_per_step": mine.wire_bytes,
                "messages": "" if mine.messages is None else mine.messages,
                "backward_s": statistics.median(slowest.backward),
                "step_wait_s": statistics.median(slowest.step_wait),
                "efficiency_vs_nocomm": "",
                "speedup_vs_dense": "",
                "load_start": round(load[0], 2),
                "load_end": round(load[1], 2),
                **env,
            }
        )
    by = {r["method"]: r["median_step_s"] for r in rows}
    for r in rows:
        if "no-comm" in by:
            r["efficiency_vs_nocomm"] = by["no-comm"] / r["median_step_s"]
        if "dense" in by:
            r["speedup_vs_dense"] = by["dense"] / r["median_step_s"]
    return rows


def write_csv(rows: Sequence[Dict[str, Any]], path: Path, append: bool) -> List[Dict[str, Any]]:
    """Write ``rows`` (after the existing ones with ``append``); return every row.

    Columns are the union over old and new rows, so a later suite may record
    other environment hints; missing cells are left empty.
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


def format_markdown(
    rows: Sequence[Dict[str, Any]], command: str, spec: ModelSpec, threads: int, note: str = ""
) -> str:
    """One run's section: the table, what was measured, the command and versions."""
    r0 = rows[0]
    hints = ", ".join(f"{k}={r0[k]}" for k in r0 if k.isupper() and r0[k] != "") or "none"
    lines = [
        f"# Training throughput: {r0['model']}, {r0['workers']} workers"
        + (f" ({r0['label']})" if r0["label"] else ""),
        "",
        f"Command: `{command}`",
        "",
        f"torch {torch.__version__}, Horovod {horovod.__version__}, Python "
        f"{platform.python_version()}, world size {r0['workers']}, {threads} torch thread(s) "
        f"per rank; per-rank batch {r0['batch']} ({spec.sample} each); host load average "
        f"{r0['load_start']} at the start, {r0['load_end']} at the end, on {os.cpu_count()} "
        f"CPUs; environment: {hints}.",
        "",
        "Step times in ms: a full iteration (zero_grad, forward, backward, step), median "
        "[p10–p90] over the timed steps, of the slowest rank (largest median). Backward "
        "(the `backward()` call, which starts the exchange) and step wait (inside "
        "`opt.step()`: waiting for communication, unpacking, the update) are that rank's "
        "medians. "
        "Wire: bytes one rank contributes per step (dense/fp16: 4/2 bytes per parameter; "
        "dlgs: the sum of `dlgs_stats()` `wire_bytes`, values + indices at capacity, dense "
        "layers at 4 bytes; with `--rounds`, the mean over rounds, as each round plans "
        "anew). Efficiency: no-comm median / method median.",
        "",
        "| method | step ms [p10–p90] | samples/s | wire MB/step | messages | backward ms "
        "| step wait ms | efficiency vs no-comm | speed-up vs dense |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {float(r['median_step_s']) * 1e3:.1f} "
            f"[{float(r['p10']) * 1e3:.1f}–{float(r['p90']) * 1e3:.1f}] "
            f"| {float(r['samples_per_s']):.1f} | {int(r['wire_bytes_per_step']) / 1e6:.3f} "
            f"| {r['messages'] if r['messages'] != '' else '—'} "
            f"| {_fmt(r['backward_s'], 1e3, '.1f')} | {_fmt(r['step_wait_s'], 1e3, '.1f')} "
            f"| {_fmt(r['efficiency_vs_nocomm'], 100, '.0f', '%')} "
            f"| {_fmt(r['speedup_vs_dense'], 1, '.2f', 'x')} |"
        )
    if note:
        lines += ["", f"Note: {note}"]
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[Dict[str, Any]], path: Path) -> None:
    """Bar chart of samples/s by method, one panel per (model, label, workers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites: Dict[Tuple[str, str, str], List[Dict[str, Any]]] = {}
    for r in rows:
        suites.setdefault((str(r["model"]), str(r["label"]), str(r["workers"])), []).append(r)
    colours = {m: f"C{i}" for i, m in enumerate(METHODS)}
    fig, axes = plt.subplots(
        1,
        len(suites),
        figsize=(max(6.0, 1.0 + 0.8 * max(map(len, suites.values()))) * len(suites), 4.2),
        squeeze=False,
    )
    for ax, ((model, label, workers), rs) in zip(axes[0], suites.items()):
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
            color=[colours.get(n, "grey") for n in names],
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
        ax.set_title(f"{model}, {workers} workers" + (f", {label}" if label else ""), fontsize=10)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(
        "Training throughput (median, whiskers p90-p10 step time; in the bar: speed-up "
        "over dense Horovod)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _methods(text: str) -> List[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METHODS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown method(s) {bad or [text]}; choose from {', '.join(METHODS)}"
        )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a method is listed twice: {text!r}")
    return names


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _density(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line, validated (errors name the option)."""
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default="resnet20", choices=list(MODELS))
    parser.add_argument(
        "--methods", type=_methods, default=list(METHODS), help=f"comma list of {METHODS}"
    )
    parser.add_argument(
        "--batch", type=_positive_int, default=None, help="per-rank batch (default: per model)"
    )
    parser.add_argument("--density", type=_density, default=0.01, help="sparse methods")
    parser.add_argument("--steps", type=_positive_int, default=20, help="timed steps per method")
    parser.add_argument("--warmup", type=_positive_int, default=8, help="untimed steps first")
    parser.add_argument(
        "--rounds",
        type=_positive_int,
        default=1,
        help="run the method list this many times, pooling the timed steps (each round "
        "rebuilds and warms up; spreads slow drifts of a shared machine over every method)",
    )
    parser.add_argument(
        "--profile-steps", type=_positive_int, default=3, help="dlgs profiling (merging methods)"
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
    merging = [m for m in args.methods if m in SPARSE_METHODS and SPARSE_METHODS[m][1] != "none"]
    if merging and args.warmup < args.profile_steps + 2:
        parser.error(
            f"argument --warmup: {merging} profile for {args.profile_steps} steps after the "
            f"first and plan from the next one: needs --warmup >= {args.profile_steps + 2}, "
            f"got {args.warmup}"
        )
    if args.label is None:
        bandwidth = os.environ.get("DLGS_BANDWIDTH", "")
        use = bandwidth if bandwidth not in ("", "none") else os.environ.get("DLGS_CLUSTER", "")
        args.label = use
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Run the benchmark on this rank (call under horovodrun on every rank)."""
    args = parse_args(argv)
    hvd.init()
    rank = hvd.rank()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
    )
    if not args.verbose:
        # dlgs logs every layout and plan at INFO; keep the benchmark's output readable.
        logging.getLogger("dlgs").setLevel(logging.WARNING)
    threads = int(os.environ.get("DLGS_THREADS", "1"))
    torch.set_num_threads(threads)
    spec = MODELS[args.model]
    batch = args.batch or spec.batch
    data = spec.make_batch(batch, torch.Generator().manual_seed(1000 + rank))
    load_start = os.getloadavg()[0]

    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    mine: Dict[str, MethodTimes] = {}
    total = args.rounds * len(args.methods) * (args.warmup + args.steps)
    # Under horovodrun stderr is a pipe: redraw rarely so the log stays readable.
    interval = 0.1 if sys.stderr.isatty() else 10.0
    bar = tqdm(total=total, disable=rank != 0, unit="step", mininterval=interval)
    with bar, logging_redirect_tqdm():
        for round_ in range(args.rounds):
            for method in args.methods:
                bar.set_description(f"{args.model} {method}")
                hvd.barrier()
                got = run_method(
                    spec,
                    method,
                    data,
                    density=args.density,
                    warmup=args.warmup,
                    steps=args.steps,
                    profile_steps=args.profile_steps,
                    progress=bar,
                )
                gc.collect()
                if method in mine:
                    mine[method].merge(got)
                else:
                    mine[method] = got
                logger.info(
                    "round %d, %s: median %.1f ms on rank %d, %.3f MB on the wire per step",
                    round_ + 1,
                    method,
                    statistics.median(got.iteration) * 1e3,
                    rank,
                    got.wire_bytes / 1e6,
                )
    # Plain dicts: the dataclass pickles as __main__.MethodTimes under ``-m``.
    gathered = hvd.allgather_object([vars(t) for t in mine.values()], name="benchmarks.train.times")
    if rank != 0:
        return
    per_rank = [[MethodTimes(**t) for t in ts] for ts in gathered]
    rows = summarise(
        per_rank,
        model=args.model,
        batch=batch,
        density=args.density,
        label=args.label,
        load=(load_start, os.getloadavg()[0]),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    everything = write_csv(rows, args.out / "train.csv", args.append)
    command = f"horovodrun -np {hvd.size()} python -m benchmarks.train " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    section = format_markdown(rows, command, spec, threads, args.note)
    md = args.out / "train.md"
    if args.append and md.exists():
        md.write_text(md.read_text().rstrip("\n") + "\n\n---\n\n" + section)
    else:
        md.write_text(section)
    plot(everything, args.out / "train.png")
    print(section)


if __name__ == "__main__":
    main()
