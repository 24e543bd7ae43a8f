"""Time per-tensor gradient *selection* kernels over tensor sizes and densities.

Methods, on ``x = torch.randn(n)`` with ``k = ceil(density * n)``:

* ``dynamic``: the project's own path, :func:`dlgs.core.select` with the
  dynamic controller, steady state (``anchor_every=0``: it anchors once, in the
  warm-up, and never again while timed).
* ``dynamic_amortized``: the same with the default ``anchor_every=32``, timed
  over blocks of 32 consecutive calls (exactly one exact-top-k anchor each),
  divided by 32.
* ``topk``: ``torch.topk(x.abs(), k, sorted=False)``, the baseline.
* ``dgc``: :func:`dlgs.core.select` with the DGC controller (exact top-k of a
  strided sample).
* ``single_pass``: ``|x| >= t`` and a count into preallocated buffers, with
  ``t`` the exact k-th largest magnitude: the memory-bound lower bound.

Nothing in a timed region reads a device value on the host; on CUDA the device
is synchronised before and after each timed sample (which runs the method one
or more times back to back, so that a sample lasts at least ``--min-sample-ms``).

Writes ``kernels.csv``, ``kernels.md`` (table, goals, command line, versions)
and ``kernels.png`` (time vs size, log-log, one panel per density) to ``--out``
(default ``benchmarks/results/kernels-<device>``)::

    python -m benchmarks.kernels --sizes 1e4,1e5,1e6,1e7,2.5e7 --out benchmarks/results/kernels-cpu
    python -m benchmarks.kernels --device cuda --sizes 1e4,1e5,1e6,1e7,2.5e7,1e8
"""

from __future__ import annotations

import argparse
import csv
import datetime
import logging
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlgs.core import SparsityConfig, make_controller, select
from dlgs.torch._ops import OPS

__all__ = [
    "METHODS",
    "Cell",
    "Result",
    "Timer",
    "estimate_bytes",
    "format_markdown",
    "goal_lines",
    "main",
    "make_method",
    "measure",
    "parse_args",
    "plot_results",
    "run_grid",
    "write_csv",
]

logger = logging.getLogger("benchmarks.kernels")

METHODS: tuple[str, ...] = ("dynamic", "dynamic_amortized", "topk", "dgc", "single_pass")
AMORTIZE_CALLS = 32

# Goals from the issue, checked against the measurements in kernels.md.
GOAL_SIZE = 25_000_000
GOAL_DENSITY = 0.001
GOAL_SPEEDUP_VS_TOPK = 5.0
GOAL_RATIO_VS_SINGLE_PASS = 2.0

# Peak bytes per element of one cell: x (4), |x| scratch (4), mask (1),
# topk's x.abs() temporary (4) and its (value, index) working set (16), with
# some headroom.
BYTES_PER_ELEMENT = 32

CSV_FIELDS = (
    "method", "size", "density", "device", "threads", "median_ms", "p10_ms", "p90_ms",
    "selected_count", "achieved_density", "speedup_vs_topk", "ratio_vs_single_pass",
    "k", "repeats", "calls_per_sample", "status",
)


@dataclass(frozen=True)
class Cell:
    """One (size, density) point of the grid."""

    size: int
    density: float

    @property
    def k(self) -> int:
        return max(1, math.ceil(self.density * self.size))


@dataclass
class Result:
    """Timing of one method on one cell (times in milliseconds per call)."""

    method: str
    cell: Cell
    device: str
    threads: int
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    selected_count: int | None = None
    repeats: int = 0
    calls_per_sample: int = 0
    status: str = "ok"
    speedup_vs_topk: float | None = None
    ratio_vs_single_pass: float | None = None

    @property
    def achieved_density(self) -> float | None:
        if self.selected_count is None:
            return None
        return self.selected_count / self.cell.size

    def row(self) -> dict[str, Any]:
        """The CSV row."""
        def num(v: float | None, fmt: str) -> str:
            return "" if v is None else format(v, fmt)

        return {
            "method": self.method,
            "size": self.cell.size,
            "density": self.cell.density,
            "device": self.device,
            "threads": self.threads,
            "median_ms": num(self.median_ms, ".6g"),
            "p10_ms": num(self.p10_ms, ".6g"),
            "p90_ms": num(self.p90_ms, ".6g"),
            "selected_count": "" if self.selected_count is None else self.selected_count,
            "achieved_density": num(self.achieved_density, ".6g"),
            "speedup_vs_topk": num(self.speedup_vs_topk, ".4g"),
            "ratio_vs_single_pass": num(self.ratio_vs_single_pass, ".4g"),
            "k": self.cell.k,
            "repeats": self.repeats,
            "calls_per_sample": self.calls_per_sample,
            "status": self.status,
        }


# -- argument parsing ------------------------------------------------------------

def _float_list(text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e


def _size_list(text: str) -> list[int]:
    sizes = [round(v) for v in _float_list(text)]
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return sizes


def _density_list(text: str) -> list[float]:
    densities = _float_list(text)
    if not densities or any(not 0 < d <= 1 for d in densities):
        raise argparse.ArgumentTypeError(f"densities must be in (0, 1], got {text!r}")
    return densities


def _method_list(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        raise argparse.ArgumentTypeError(f"unknown methods {unknown}; choose from {list(METHODS)}")
    return [m for m in METHODS if m in methods]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels",
        description="Time gradient selection kernels (dlgs select vs torch.topk vs a single pass).",
    )
    p.add_argument("--sizes", type=_size_list, default=_size_list("1e4,1e5,1e6,1e7,2.5e7"),
                   help="tensor sizes, comma-separated (default: 1e4,1e5,1e6,1e7,2.5e7)")
    p.add_argument("--densities", type=_density_list, default=_density_list("0.01,0.001"),
                   help="densities, comma-separated (default: 0.01,0.001)")
    p.add_argument("--methods", type=_method_list, default=list(METHODS),
                   help=f"methods to time (default: {','.join(METHODS)})")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default: 2)")
    p.add_argument("--repeats", type=int, default=20,
                   help="most timed samples per method and cell (default: 20)")
    p.add_argument("--min-repeats", type=int, default=5,
                   help="fewest timed samples per method and cell, whatever the time cap "
                        "(default: 5; dynamic_amortized, whose samples are 32 calls, 3)")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed calls before timing, fewer for slow calls (default: 5; "
                        "dynamic always makes at least 3)")
    p.add_argument("--method-seconds", type=float, default=2.0,
                   help="time cap for one method's samples in one cell; large sizes get fewer "
                        "samples, down to --min-repeats (default: 2.0)")
    p.add_argument("--min-sample-ms", type=float, default=2.0,
                   help="a timed sample repeats the call until it lasts about this long "
                        "(default: 2.0)")
    p.add_argument("--max-seconds", type=float, default=240.0,
                   help="budget for the whole run; cells left when it is spent are skipped and "
                        "listed in kernels.md (default: 240)")
    p.add_argument("--max-bytes", type=float, default=None,
                   help="skip sizes needing more than this many bytes (estimated "
                        f"{BYTES_PER_ELEMENT} per element; default: half the free device/host "
                        "memory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default: benchmarks/results/kernels-<device>)")
    p.add_argument("--no-plot", action="store_true", help="do not write kernels.png")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = p.parse_args(argv)
    if args.threads < 1 or args.repeats < 1 or args.min_repeats < 1 or args.warmup < 0:
        p.error("--threads, --repeats, --min-repeats must be >= 1 and --warmup >= 0")
    args.min_repeats = min(args.min_repeats, args.repeats)
    if args.out is None:
        args.out = Path("benchmarks") / "results" / f"kernels-{args.device}"
    return args


# -- timing ------------------------------------------------------------------------

def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


@dataclass
class Timer:
    """One method being timed on one cell.

    A sample runs ``fn`` ``calls`` times back to back (a multiple of ``block``)
    between two device synchronisations; ``times`` holds seconds per call.
    """

    name: str
    fn: Callable[[], Any]
    selected: Callable[[], int]
    block: int = 1
    min_warmup: int = 1
    min_repeats: int = 5
    calls: int = 0
    target: int = 0
    times: list[float] = field(default_factory=list)

    def sample(self, sync: Callable[[], None], calls: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            self.fn()
        sync()
        return (time.perf_counter() - t0) / calls


def measure(
    timers: Sequence[Timer],
    sync: Callable[[], None],
    *,
    warmup: int = 5,
    repeats: int = 20,
    seconds: float = 2.0,
    min_sample_s: float = 2e-3,
    deadline: float = math.inf,
) -> None:
    """Fill each timer's ``times``, interleaving the methods sample by sample so
    that a burst of load from elsewhere on the host hits them all alike.

    Each method first gets ``warmup`` untimed calls (at least its
    ``min_warmup``, more only within half of ``seconds``), then a probe sample
    of ``block`` calls that sizes its samples (at least ``min_sample_s`` each)
    and their number (its ``min_repeats`` to ``repeats``, within ``seconds``;
    only ``min_repeats`` once ``time.perf_counter()`` passes ``deadline``).
    """
    for t in timers:
        t_end = time.perf_counter() + seconds / 2
        for i in range(max(warmup, t.min_warmup)):
            t.fn()
            if i + 1 >= t.min_warmup:
                sync()
                if time.perf_counter() > t_end:
                    break  # slow calls: a few warm up enough
        sync()
        probe = t.sample(sync, t.block)
        unit = probe * t.block  # seconds per block
        blocks = max(1, math.ceil(min_sample_s / max(unit, 1e-9)))
        t.calls = blocks * t.block
        t.target = max(t.min_repeats, min(repeats, int(seconds // max(unit * blocks, 1e-9))))
        t.times = [probe] if blocks == 1 else []
    while True:
        late = time.perf_counter() > deadline
        pending = [
            t for t in timers
            if len(t.times) < (min(t.target, t.min_repeats) if late else t.target)
        ]
        if not pending:
            return
        for t in pending:
            t.times.append(t.sample(sync, t.calls))


def make_method(
    name: str, x: torch.Tensor, k: int, density: float, threshold: torch.Tensor,
    scratch_abs: torch.Tensor, scratch_mask: torch.Tensor,
) -> tuple[Callable[[], Any], Callable[[], int]]:
    """``(call, selected)``: one selection of ``name`` on ``x``, and a function
    that reads (synchronising) how many elements the last call selected."""
    if name == "topk":
        def call_topk() -> Any:
            return torch.topk(x.abs(), k, sorted=False)

        return call_topk, lambda: k

    if name == "single_pass":
        last: dict[str, torch.Tensor] = {}

        def call_single() -> Any:
            torch.abs(x, out=scratch_abs)
            torch.ge(scratch_abs, threshold, out=scratch_mask)
            last["count"] = torch.count_nonzero(scratch_mask)
            return last["count"]

        return call_single, lambda: int(last["count"])

    if name == "dynamic":
        config = SparsityConfig(density=density, anchor_every=0)
    elif name == "dynamic_amortized":
        config = SparsityConfig(density=density)  # default anchor_every=32
    elif name == "dgc":
        config = SparsityConfig(density=density, controller="dgc")
    else:
        raise ValueError(f"unknown method {name!r}")
    controller = make_controller(config)
    state = controller.init_state(OPS, x, density)
    step = [0]
    out: dict[str, Any] = {}

    def call_select() -> Any:
        idx, count, _theta = select(
            OPS, controller, state, x, k, k, step[0], scratch_abs, scratch_mask
        )
        step[0] += 1
        out["count"] = count
        return idx

    return call_select, lambda: int(out["count"])


# -- the grid ----------------------------------------------------------------------

def estimate_bytes(size: int) -> int:
    """Estimated peak memory of one cell."""
    return BYTES_PER_ELEMENT * size


def _default_max_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        avail = 8 << 30
    return avail // 2


def run_grid(args: argparse.Namespace) -> tuple[list[Result], list[str]]:
    """Time every method on every cell; returns the results and notes on what
    was skipped."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    device = torch.device(args.device)
    sync = _synchronizer(device)
    max_bytes = int(args.max_bytes) if args.max_bytes is not None else _default_max_bytes(device)
    cells = [Cell(s, d) for s in args.sizes for d in args.densities]
    results: list[Result] = []
    notes: list[str] = []
    start = time.perf_counter()
    deadline = start + args.max_seconds

    def skipped(cell: Cell, status: str) -> None:
        for m in args.methods:
            results.append(Result(m, cell, args.device, args.threads, status=status))

    with logging_redirect_tqdm(loggers=[logger]), tqdm(
        total=len(cells), desc="kernels", unit="cell", file=sys.stderr
    ) as bar:
        for size in args.sizes:
            size_cells = [c for c in cells if c.size == size]
            need = estimate_bytes(size)
            if need > max_bytes:
                msg = (f"size {size:.3g} skipped: needs about {need / 2**30:.2f} GiB, "
                       f"more than --max-bytes {max_bytes / 2**30:.2f} GiB")
                logger.warning(msg)
                notes.append(msg)
                for cell in size_cells:
                    skipped(cell, "skipped: memory")
                bar.update(len(size_cells))
                continue
            x = scratch_abs = scratch_mask = None
            for cell in size_cells:
                elapsed = time.perf_counter() - start
                if elapsed > args.max_seconds:
                    msg = (f"size {cell.size:.3g}, density {cell.density:g} skipped: "
                           f"--max-seconds {args.max_seconds:g} spent ({elapsed:.0f} s elapsed)")
                    logger.warning(msg)
                    notes.append(msg)
                    skipped(cell, "skipped: budget")
                    bar.update(1)
                    continue
                if x is None:
                    gen = torch.Generator(device=device).manual_seed(args.seed)
                    x = torch.randn(size, generator=gen, device=device, dtype=torch.float32)
                    scratch_abs = torch.empty(size, dtype=torch.float32, device=device)
                    scratch_mask = torch.empty(size, dtype=torch.bool, device=device)
                bar.set_postfix_str(f"n={cell.size:.3g} d={cell.density:g}")
                results += _time_cell(args, cell, x, scratch_abs, scratch_mask, sync, deadline)
                bar.update(1)
            del x, scratch_abs, scratch_mask
            if device.type == "cuda":
                torch.cuda.empty_cache()
    _fill_ratios(results)
    return results, notes


def _time_cell(
    args: argparse.Namespace, cell: Cell, x: torch.Tensor, scratch_abs: torch.Tensor,
    scratch_mask: torch.Tensor, sync: Callable[[], None], deadline: float,
) -> list[Result]:
    k = cell.k
    # The exact k-th largest |x|, the threshold of single_pass (untimed).
    threshold = torch.topk(x.abs(), k, sorted=False).values.min()
    timers = []
    for method in args.methods:
        fn, selected = make_method(method, x, k, cell.density, threshold, scratch_abs, scratch_mask)
        timer = Timer(method, fn, selected, min_warmup=min(1, args.warmup),
                      min_repeats=args.min_repeats)
        if method == "dynamic":
            # The first call anchors (exact top-k); time the steady state after it.
            timer.min_warmup = 3
        elif method == "dynamic_amortized":
            timer.block = AMORTIZE_CALLS
            timer.min_repeats = min(args.min_repeats, 3)
        timers.append(timer)
    measure(timers, sync, warmup=args.warmup, repeats=args.repeats, seconds=args.method_seconds,
            min_sample_s=args.min_sample_ms / 1e3, deadline=deadline)
    out = []
    for t in timers:
        ms = np.asarray(t.times) * 1e3
        res = Result(
            t.name, cell, args.device, args.threads,
            median_ms=float(np.median(ms)),
            p10_ms=float(np.percentile(ms, 10)),
            p90_ms=float(np.percentile(ms, 90)),
            selected_count=t.selected(),
            repeats=len(t.times),
            calls_per_sample=t.calls,
        )
        logger.debug("%s n=%d d=%g: median %.4g ms over %d samples of %d calls, selected %s (k=%d)",
                     t.name, cell.size, cell.density, res.median_ms, res.repeats, t.calls,
                     res.selected_count, k)
        out.append(res)
    return out


def _fill_ratios(results: list[Result]) -> None:
    by_cell: dict[Cell, dict[str, Result]] = {}
    for r in results:
        by_cell.setdefault(r.cell, {})[r.method] = r
    for methods in by_cell.values():
        topk = methods.get("topk")
        single = methods.get("single_pass")
        for r in methods.values():
            if r.median_ms is None or r.median_ms <= 0:
                continue
            if topk is not None and topk.median_ms is not None:
                r.speedup_vs_topk = topk.median_ms / r.median_ms
            if single is not None and single.median_ms:
                r.ratio_vs_single_pass = r.median_ms / single.median_ms


# -- outputs -----------------------------------------------------------------------

def write_csv(results: Sequence[Result], path: Path) -> None:
    """One row per size x density x method."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in results:
            w.writerow(r.row())


def _fmt(v: float | None, fmt: str = ".3g", suffix: str = "") -> str:
    return "n/a" if v is None else f"{v:{fmt}}{suffix}"


def _table(results: Sequence[Result]) -> str:
    head = ("| size | density | method | median ms | p10 ms | p90 ms | selected | achieved density "
            "| speedup vs topk | x single_pass | samples x calls |")
    lines = [head, "|" + "---:|" * 2 + ":---|" + "---:|" * 8]
    for r in results:
        if r.median_ms is None:
            lines.append(f"| {r.cell.size:.3g} | {r.cell.density:g} | {r.method} | {r.status} "
                         "| | | | | | | |")
            continue
        lines.append(
            f"| {r.cell.size:.3g} | {r.cell.density:g} | {r.method} | {r.median_ms:.4g} "
            f"| {r.p10_ms:.4g} | {r.p90_ms:.4g} | {r.selected_count} "
            f"| {_fmt(r.achieved_density, '.3e')} | {_fmt(r.speedup_vs_topk, '.2f', 'x')} "
            f"| {_fmt(r.ratio_vs_single_pass, '.2f', 'x')} | {r.repeats} x {r.calls_per_sample} |"
        )
    return "\n".join(lines)


def goal_lines(results: Sequence[Result]) -> list[str]:
    """Markdown bullets stating whether each goal was met, from the measurements."""
    cell = {r.method: r for r in results
            if r.cell.size == GOAL_SIZE and math.isclose(r.cell.density, GOAL_DENSITY)}
    where = f"density {GOAL_DENSITY:g}, {GOAL_SIZE:.3g} elements"
    dyn = cell.get("dynamic")
    out = []
    if dyn is None or dyn.median_ms is None:
        status = dyn.status if dyn is not None else "not in the grid"
        return [f"- Goals at {where}: **not measured** (`dynamic` {status})."]
    topk, single = cell.get("topk"), cell.get("single_pass")
    if dyn.speedup_vs_topk is None or topk is None:
        out.append(f"- `dynamic` >= {GOAL_SPEEDUP_VS_TOPK:g}x faster than `topk` at {where}: "
                   "**not measured** (no `topk` timing).")
    else:
        met = dyn.speedup_vs_topk >= GOAL_SPEEDUP_VS_TOPK
        out.append(
            f"- `dynamic` >= {GOAL_SPEEDUP_VS_TOPK:g}x faster than `topk` at {where}: "
            f"**{'MET' if met else 'NOT MET'}**: `topk` {topk.median_ms:.4g} ms / `dynamic` "
            f"{dyn.median_ms:.4g} ms = {dyn.speedup_vs_topk:.2f}x."
        )
    if dyn.ratio_vs_single_pass is None or single is None:
        out.append(f"- `dynamic` within {GOAL_RATIO_VS_SINGLE_PASS:g}x of `single_pass` at "
                   f"{where}: **not measured** (no `single_pass` timing).")
    else:
        met = dyn.ratio_vs_single_pass <= GOAL_RATIO_VS_SINGLE_PASS
        out.append(
            f"- `dynamic` within {GOAL_RATIO_VS_SINGLE_PASS:g}x of `single_pass` at {where}: "
            f"**{'MET' if met else 'NOT MET'}**: `dynamic` {dyn.median_ms:.4g} ms / `single_pass` "
            f"{single.median_ms:.4g} ms = {dyn.ratio_vs_single_pass:.2f}x."
        )
    amort = cell.get("dynamic_amortized")
    if amort is not None and amort.median_ms is not None:
        out.append(
            f"- For reference, `dynamic_amortized` (one anchor per {AMORTIZE_CALLS} calls) at "
            f"{where}: {amort.median_ms:.4g} ms, {_fmt(amort.speedup_vs_topk, '.2f', 'x')} "
            f"faster than `topk`, {_fmt(amort.ratio_vs_single_pass, '.2f', 'x')} of "
            "`single_pass`."
        )
    return out


def _load_average() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except (OSError, AttributeError):
        return None


def _environment(
    args: argparse.Namespace, load_start: tuple[float, float, float] | None
) -> list[str]:
    device = torch.device(args.device)
    if device.type == "cuda":
        hw = torch.cuda.get_device_name(device)
    else:
        hw = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        hw = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
    env = [
        (f"- torch {torch.__version__}, Python {platform.python_version()}, "
         f"device `{args.device}` ({hw}), torch threads {torch.get_num_threads()} "
         f"(`--threads {args.threads}`), {os.cpu_count()} CPUs visible"),
    ]
    load_end = _load_average()
    if load_start is not None and load_end is not None:
        env.append(f"- host load average (1 min) at the start / end of the run: "
                   f"{load_start[0]:.2f} / {load_end[0]:.2f} on {os.cpu_count()} CPUs")
        if args.device == "cpu" and max(load_start[0], load_end[0]) > 0.5 * (os.cpu_count() or 1):
            env.append("- **warning**: the host was busy with other work during the run, so "
                       "CPU times are noisy, multi-threaded kernels most (a descheduled worker "
                       "thread stalls the whole parallel kernel)")
    return env


def format_markdown(
    results: Sequence[Result], notes: Sequence[str], args: argparse.Namespace,
    command: str, elapsed: float, load_start: tuple[float, float, float] | None = None,
) -> str:
    """The whole kernels.md."""
    parts = [
        f"# Selection kernels on {args.device}",
        "",
        (f"Generated {datetime.datetime.now().isoformat(timespec='seconds')} by "
         f"`benchmarks/kernels.py` in {elapsed:.0f} s."),
        "",
        "Command:",
        "",
        "```",
        command,
        "```",
        "",
        *_environment(args, load_start),
        "",
        (f"Input `x = torch.randn(n)` (seed {args.seed}), `k = ceil(density * n)`. Times are "
         "per call: median, 10th and 90th percentile over the timed samples; a sample runs the "
         f"call back to back until it lasts about {args.min_sample_ms:g} ms "
         "(`samples x calls`), and the methods of a cell are sampled in turn, so that load from "
         "elsewhere hits them alike. `dynamic` is `dlgs.core.select` in steady state "
         "(`anchor_every=0`, anchored once in the warm-up); `dynamic_amortized` is the default "
         f"`anchor_every={AMORTIZE_CALLS}`, timed over blocks of {AMORTIZE_CALLS} calls that "
         "include one exact-top-k anchor; `dgc` is `select` with the DGC controller; `topk` is "
         "`torch.topk(x.abs(), k, sorted=False)`; `single_pass` is `|x| >= t` and a count into "
         "preallocated buffers, `t` the exact k-th largest (the lower bound). `x single_pass` is "
         "the method's time over `single_pass`'s."),
        "",
        "## Goals",
        "",
        *goal_lines(results),
        "",
        "## Results",
        "",
        _table(results),
        "",
    ]
    if notes:
        parts += ["## Skipped", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(parts)


def plot_results(results: Sequence[Result], path: Path, title: str) -> None:
    """Time vs size, log-log, one line per method, one panel per density."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    densities = sorted({r.cell.density for r in results}, reverse=True)
    methods = [m for m in METHODS if any(r.method == m for r in results)]
    styles = {"dynamic": "o-", "dynamic_amortized": "o--", "topk": "s-", "dgc": "^-",
              "single_pass": "k:"}
    fig, axes = plt.subplots(1, len(densities), figsize=(6 * len(densities), 4.6),
                             sharey=True, squeeze=False)
    for ax, d in zip(axes[0], densities):
        for m in methods:
            pts = sorted((r.cell.size, r.median_ms) for r in results
                         if r.method == m and r.cell.density == d and r.median_ms is not None)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, styles.get(m, "o-"), label=m, markersize=4)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"density {d:g}")
        ax.set_xlabel("tensor size (elements)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("time per call (ms, median)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> list[Result]:
    """Run the benchmark and write kernels.csv, kernels.md and kernels.png."""
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    torch.set_num_threads(args.threads)
    command = "python -m benchmarks.kernels" + ("" if not raw else " " + shlex.join(raw))
    logger.info("torch %s on %s, %d threads; sizes %s, densities %s, methods %s",
                torch.__version__, args.device, torch.get_num_threads(),
                ",".join(f"{s:.3g}" for s in args.sizes),
                ",".join(f"{d:g}" for d in args.densities), ",".join(args.methods))
    load_start = _load_average()
    t0 = time.perf_counter()
    results, notes = run_grid(args)
    elapsed = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(results, args.out / "kernels.csv")
    md = format_markdown(results, notes, args, command, elapsed, load_start)
    (args.out / "kernels.md").write_text(md)
    if not args.no_plot:
        plot_results(results, args.out / "kernels.png",
                     f"selection time per call, {args.device}, torch {torch.__version__}, "
                     f"threads={torch.get_num_threads()}")
    logger.info("wrote %s/kernels.{csv,md%s} in %.1f s", args.out,
                "" if args.no_plot else ",png", elapsed)
    for line in goal_lines(results):
        logger.info("%s", line)
    print(_table(results))
    return results


if __name__ == "__main__":
    main()
