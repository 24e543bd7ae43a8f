"""Per-step overhead of the gradient exchange: operations, allocations, host time.

On a GPU every tensor operation is a kernel launch that costs the host several
microseconds, so what decides the exchange's cost there is how many operations a
step issues. This benchmark counts them with ``torch.profiler`` on real ranks
(``horovodrun -np 2``), for each model and method, and times the host work:

* ``ops``: every profiler event of one training step (``sum(e.count for e in
  prof.key_averages())``, nested operations included), averaged over the profiled
  steps; ``top_ops``: the outermost ``aten::`` ones (what Python, hooks and autograd
  issued); ``allocs``:
  tensor creations (``aten::empty`` and kin, a count); ``kernels``: CUDA kernels, with
  ``--device cuda``.
* ``added``: ``ops`` minus those of ``no-comm`` (the same step without any
  communication): what the method adds. ``budget``: the goal for what dlgs
  adds, 10 per sparse layer + 2 per dense layer + 20 per message.
* ``hook_ms``: host time inside dlgs' gradient hooks per step (selection,
  packing, starting collectives; ``.dlgs.exchange.last_step.submit_seconds``),
  ``step_ms``: host time inside ``opt.step()`` (waiting, unpacking, the update),
  both medians of the timed (unprofiled) steps, of the rank with the larger one.

Methods: ``no-comm``, ``dense`` (``hvd.DistributedOptimizer``), ``dlgs-none`` and
``dlgs-buckets`` (``dlgs.torch.DistributedOptimizer``, dynamic controller, layer by
layer and in size buckets), ``dlgs-a`` (form (a): ``hvd.DistributedOptimizer`` with
``dlgs.torch.Compression``, layer by layer), ``topk`` and ``dgc`` (the other
controllers, layer by layer). The DP merge plan is left out: its layout depends on
the link, and any layout it picks is one of the above kinds of messages.

Old and new code side by side: ``--trees new=.,old=/path/to/checkout`` runs the
same benchmark code against each tree's ``dlgs`` (first on ``sys.path``), interleaved in
rounds. Steps: ``--warmup`` untimed (the first anchor of the dynamic controller
included; merging methods then run until their plan is final), ``--steps`` timed,
``--profiled`` profiled; anchor steps (every
``anchor_every`` = 32 steps) fall outside the window with the defaults.

Writes ``overhead.csv``, ``overhead.md`` and ``overhead.png``::

    python -m benchmarks.overhead --out bench-results/overhead
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

logger = logging.getLogger("benchmarks.overhead")

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("resnet20", "vgg16", "lstm", "bert-small")
METHODS = ("no-comm", "dense", "dlgs-none", "dlgs-buckets", "dlgs-a", "topk", "dgc")
#: method: (form, controller, merge)
DLGS_METHODS = {
    "dlgs-none": ("b", "dynamic", "none"),
    "dlgs-buckets": ("b", "dynamic", "buckets"),
    "dlgs-a": ("a", "dynamic", "none"),
    "topk": ("b", "topk", "none"),
    "dgc": ("b", "dgc", "none"),
}
#: Per-rank batch: small, as operation counts do not depend on it.
BATCH = {"resnet20": 8, "vgg16": 8, "lstm": 4, "bert-small": 4}
CSV_FIELDS = (
    "tree",
    "round",
    "model",
    "method",
    "device",
    "workers",
    "ops",
    "top_ops",
    "allocs",
    "kernels",
    "added",
    "sparse_layers",
    "dense_layers",
    "messages",
    "budget",
    "hook_ms",
    "step_ms",
    "iteration_ms",
)


# -- on every rank ----------------------------------------------------------------


def _build(method: str, model, density: float):
    import horovod.torch as hvd
    import torch

    import dlgs.torch

    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    if method == "no-comm":
        return sgd, None
    if method == "dense":
        return hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters()), None
    form, controller, merge = DLGS_METHODS[method]
    if form == "a":
        comp = dlgs.torch.Compression(
            model.named_parameters(), density=density, controller=controller, merge=merge
        )
        opt = hvd.DistributedOptimizer(
            sgd, named_parameters=model.named_parameters(), compression=comp
        )
        comp.attach(opt)
        return opt, comp.dlgs
    opt = dlgs.torch.DistributedOptimizer(
        sgd,
        named_parameters=model.named_parameters(),
        density=density,
        controller=controller,
        merge=merge,
    )
    return opt, opt.dlgs


_ALLOCATORS = (
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::zeros",
    "aten::zeros_like",
    "aten::ones",
    "aten::full",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::new_zeros",
    "aten::scalar_tensor",
)


def _count(prof) -> Dict[str, float]:
    """Operations, outermost operations, allocations and CUDA kernels in ``prof``.

    Outermost: an ``aten::`` operation not called by another ``aten::`` operation
    (what Python, a hook or an autograd node issued). Allocations: the operations
    that create a tensor's storage (``aten::empty`` and kin), so a count, not bytes.
    """
    from torch.autograd import DeviceType

    ops = top = allocs = kernels = 0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            kernels += 1
            continue
        ops += 1
        parent = e.cpu_parent
        if e.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::")):
            top += 1
        if e.name in _ALLOCATORS:
            allocs += 1
    return {"ops": ops, "top_ops": top, "allocs": allocs, "kernels": kernels}


def measure(model_name: str, method: str, args) -> Dict[str, Any]:
    """One (model, method) on this rank."""
    import horovod.torch as hvd
    import torch
    from torch.profiler import ProfilerActivity, profile

    from .train_torch import MODELS as SPECS

    spec = SPECS[model_name]
    device = torch.device(args.device)
    if device.type == "cuda":  # one GPU per rank, as Horovod's examples pin it
        device = torch.device("cuda", hvd.local_rank())
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = spec.build().to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt, engine = _build(method, model, args.density)
    g = torch.Generator().manual_seed(1 + hvd.rank())
    x, y = (t.to(device) for t in spec.make_batch(BATCH[model_name], g))
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def step():
        opt.zero_grad()
        spec.loss(model(x), y).backward()
        t = time.perf_counter()
        opt.step()
        sync()
        return time.perf_counter() - t

    for _ in range(args.warmup):
        step()
    if method in DLGS_METHODS and DLGS_METHODS[method][2] != "none":
        # A merging strategy profiles, probes and plans first: measure it once its
        # plan is final (the same step on every rank), from the step after.
        for _ in range(100):
            if engine.planner.settled:
                break
            step()
        else:
            raise RuntimeError(f"{method}: no final merge plan after {args.warmup + 100} steps")
        step()
    hooks, steps, iters = [], [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        steps.append(step())
        iters.append(time.perf_counter() - t0)
        if engine is not None:
            hooks.append(engine.exchange.last_step.submit_seconds)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.profiled):
            step()
        sync()
    counts = {k: v / args.profiled for k, v in _count(prof).items()}
    row: Dict[str, Any] = {
        "model": model_name,
        "method": method,
        "device": device.type,
        "workers": hvd.size(),
        **counts,
        "hook_ms": 1e3 * statistics.median(hooks) if hooks else "",
        "step_ms": 1e3 * statistics.median(steps),
        "iteration_ms": 1e3 * statistics.median(iters),
        "sparse_layers": "",
        "dense_layers": "",
        "messages": "",
    }
    if engine is not None:
        ex = engine.exchange
        sparse = sum(1 for layer in ex.layers if ex.is_sparse(layer))
        row.update(
            sparse_layers=sparse,
            dense_layers=len(ex.layers) - sparse,
            messages=len(ex.groups),
        )
    return row


def worker(args) -> None:
    tree = os.environ.get("DLGS_OVERHEAD_TREE")
    if tree:  # this tree's dlgs, before anything imports one
        sys.path.insert(0, tree)
    import horovod.torch as hvd
    import torch

    import dlgs

    if tree and not Path(dlgs.__file__).resolve().is_relative_to(Path(tree).resolve()):
        raise RuntimeError(f"dlgs imported from {dlgs.__file__}, not from {tree}")

    hvd.init()
    torch.set_num_threads(1)
    logging.getLogger("dlgs").setLevel(logging.WARNING)
    rows = []
    for model_name in args.models:
        for method in args.methods:
            rows.append(measure(model_name, method, args))
            if hvd.rank() == 0:
                print(f"[overhead] {model_name} {method}: {rows[-1]['ops']:.0f} ops", flush=True)
    Path(args.worker_out, f"rank{hvd.rank()}.json").write_text(json.dumps(rows))


# -- the driver ---------------------------------------------------------------------


def _merge_ranks(per_rank: List[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """One row per (model, method): rank 0's counts, the larger rank's host times."""
    out = []
    for rows in zip(*per_rank):
        row = dict(rows[0])
        for key in ("hook_ms", "step_ms", "iteration_ms"):
            vals = [r[key] for r in rows if r[key] != ""]
            row[key] = max(vals) if vals else ""
        out.append(row)
    base = {r["model"]: r["ops"] for r in out if r["method"] == "no-comm"}
    for r in out:
        r["added"] = r["ops"] - base[r["model"]] if r["model"] in base else ""
        if r["sparse_layers"] != "":
            r["budget"] = 10 * r["sparse_layers"] + 2 * r["dense_layers"] + 20 * r["messages"]
        else:
            r["budget"] = ""
    return out


def run_tree(tree: str, path: Path, args, argv_worker: List[str]) -> List[Dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        env.setdefault("OMP_NUM_THREADS", "1")
        # The benchmark code is this checkout's; dlgs is the tree's (the worker puts
        # it first on sys.path before importing anything).
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        env["DLGS_OVERHEAD_TREE"] = str(path)
        cmd = [
            str(Path(sys.executable).parent / "horovodrun"),
            "-np",
            str(args.workers),
            "--gloo",
            sys.executable,
            "-m",
            "benchmarks.overhead",
            "--worker-out",
            tmp,
            *argv_worker,
        ]
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.workers)]
    return _merge_ranks(per_rank)


def _fmt(v: Any, spec: str = ".0f") -> str:
    return "" if v in ("", None) else format(float(v), spec)


def summarise(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Median over rounds per (tree, model, method), with the min-max of host times."""
    keys: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in rows:
        keys.setdefault((r["tree"], r["model"], r["method"]), []).append(r)
    out = []
    for rs in keys.values():
        s = dict(rs[0])
        s["rounds"] = len(rs)
        for key in ("ops", "top_ops", "allocs", "kernels", "added"):
            vals = [float(r[key]) for r in rs if r[key] != ""]
            s[key] = statistics.median(vals) if vals else ""
        for key in ("hook_ms", "step_ms", "iteration_ms"):
            vals = [float(r[key]) for r in rs if r[key] != ""]
            s[key] = statistics.median(vals) if vals else ""
            s[key + "_range"] = (min(vals), max(vals)) if vals else None
        out.append(s)
    return out


def format_markdown(summary, command: str, versions: str) -> str:
    lines = [
        "# Per-step overhead: operations and host time",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores; {versions}. "
        "Operation counts: torch.profiler events per training step (nested included), "
        "mean over the profiled steps; `added` = ops - no-comm's; `budget` = 10 per sparse "
        "layer + 2 per dense layer + 20 per message (the goal for what dlgs adds). "
        "Host times: median over rounds of each round's median (min-max over rounds); "
        "hook = dlgs' gradient hooks per step, step = inside `opt.step()`.",
        "",
        "| tree | model | method | ops | added | budget | top-level | allocs | kernels "
        "| sparse / dense layers, messages | hook ms | step ms | iteration ms |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]

    def rng(s, key):
        r = s.get(key + "_range")
        if not r or s[key] == "":
            return ""
        return f"{s[key]:.2f} [{r[0]:.2f}–{r[1]:.2f}]"

    for s in summary:
        layers = (
            f"{s['sparse_layers']} / {s['dense_layers']}, {s['messages']}"
            if s["sparse_layers"] != ""
            else ""
        )
        lines.append(
            f"| {s['tree']} | {s['model']} | {s['method']} | {_fmt(s['ops'])} | "
            f"{_fmt(s['added'])} | {_fmt(s['budget'])} | {_fmt(s['top_ops'])} | "
            f"{_fmt(s['allocs'])} | {_fmt(s['kernels']) if s['device'] == 'cuda' else '–'} | "
            f"{layers} | {rng(s, 'hook_ms')} | {rng(s, 'step_ms')} | {rng(s, 'iteration_ms')} |"
        )
    return "\n".join(lines) + "\n"


def plot(summary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(s["model"] for s in summary))
    trees = list(dict.fromkeys(s["tree"] for s in summary))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        methods = [
            m for m in METHODS if any(s["model"] == model and s["method"] == m for s in summary)
        ]
        width = 0.8 / len(trees)
        for t, tree in enumerate(trees):
            vals = []
            for m in methods:
                s = next(
                    (
                        s
                        for s in summary
                        if (s["tree"], s["model"], s["method"]) == (tree, model, m)
                    ),
                    None,
                )
                vals.append(float(s["added"]) if s and s["added"] != "" else 0.0)
            ax.bar([i + t * width for i in range(len(methods))], vals, width, label=tree)
        budgets = [
            next(
                (
                    float(s["budget"])
                    for s in summary
                    if s["model"] == model and s["method"] == m and s["budget"] != ""
                ),
                None,
            )
            for m in methods
        ]
        for i, b in enumerate(budgets):
            if b:
                ax.hlines(b, i - 0.4, i + 0.8, colors="k", linestyles="dashed", linewidth=0.8)
        ax.set_xticks(
            [i + 0.4 - width / 2 for i in range(len(methods))], methods, rotation=30, fontsize=8
        )
        ax.set_yscale("log")
        ax.set_title(model, fontsize=10)
        ax.set_ylabel("operations added per step")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        "Operations the exchange adds per training step (dashed: the goal's budget)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), type=lambda s: s.split(","))
    p.add_argument("--methods", default=",".join(METHODS), type=lambda s: s.split(","))
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--profiled", type=int, default=4, help="profiled steps")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--trees", default="current=.", help="NAME=PATH,... whose dlgs to run")
    p.add_argument("--out", type=Path, default=Path("bench-results/overhead"))
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for m in args.models:
        if m not in MODELS:
            p.error(f"--models: unknown model {m!r}; choose from {', '.join(MODELS)}")
    for m in args.methods:
        if m not in METHODS:
            p.error(f"--methods: unknown method {m!r}; choose from {', '.join(METHODS)}")
    if not 0 < args.density <= 1:
        p.error(f"--density must be in (0, 1], got {args.density}")
    if args.device not in ("cpu", "cuda"):
        p.error(f"--device must be cpu or cuda, got {args.device!r}")
    for name in ("workers", "steps", "profiled", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker_out:
        worker(args)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    trees = []
    for item in args.trees.split(","):
        name, _, path = item.partition("=")
        if not path or not Path(path, "dlgs").is_dir():
            raise SystemExit(f"--trees: {item!r} is not NAME=PATH with PATH/dlgs a directory")
        trees.append((name, Path(path).resolve()))
    passthrough = [
        "--models",
        ",".join(args.models),
        "--methods",
        ",".join(args.methods),
        "--density",
        str(args.density),
        "--device",
        args.device,
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--profiled",
        str(args.profiled),
    ]
    rows = []
    for rnd in range(args.rounds):
        # Interleaved: every tree once per round, in alternating order.
        order = trees if rnd % 2 == 0 else trees[::-1]
        for name, path in order:
            logger.info("round %d/%d: tree %s (%s)", rnd + 1, args.rounds, name, path)
            for r in run_tree(name, path, args, passthrough):
                rows.append({"tree": name, "round": rnd + 1, **r})
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "overhead.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    import horovod
    import torch

    versions = (
        f"torch {torch.__version__}, Horovod {horovod.__version__}, Gloo, {args.workers} ranks"
    )
    summary = summarise(rows)
    command = "python -m benchmarks.overhead " + " ".join(shlex.quote(a) for a in argv)
    md = format_markdown(summary, command, versions)
    (args.out / "overhead.md").write_text(md)
    plot(summary, args.out / "overhead.png")
    print(md)


if __name__ == "__main__":
    main()
