"""Fashion-MNIST on real ranks: dense Horovod against dlgs, same seed and epochs.

Usage: ``horovodrun -np 2 --gloo python tests/parallel/convergence.py OUT_DIR EPOCHS``

Writes ``OUT_DIR/rank{r}.json`` with per-epoch test accuracy for each method,
and (for dlgs) each sparse layer's selected count / target over the steps.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F

import dlgs.torch
from benchmarks.datasets import fashion_mnist
from benchmarks.models import FashionCNN

torch.set_num_threads(1)
BATCH = 64
TRACK_FROM = 50  # steps of warm-up before the controller's tracking is measured


def evaluate(model, x, y) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), 1000):
            correct += (model(x[i : i + 1000]).argmax(1) == y[i : i + 1000]).sum().item()
    model.train()
    return 100.0 * correct / len(x)


def run(method: str, epochs: int, data):
    xtr, ytr, xte, yte = data
    torch.manual_seed(0)
    model = FashionCNN()
    if method == "dense":
        base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    else:
        # DGC's recipe for momentum SGD: dlgs keeps the momentum locally
        # (momentum correction) and the wrapped optimizer has none.
        base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0)
        opt = dlgs.torch.DistributedOptimizer(
            base,
            named_parameters=model.named_parameters(),
            density=float(method),
            momentum=0.9,
            min_sparse_size=1024,
            # Layer-wise: every layer above min_sparse_size really goes sparse
            # (a DP plan could send some dense, which would flatter the result).
            merge="none",
        )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    acc, ratios, step = [], {}, 0
    start = time.perf_counter()
    for epoch in range(epochs):
        perm = np.random.default_rng(epoch).permutation(len(xtr))[hvd.rank() :: hvd.size()]
        for i in range(0, len(perm) - BATCH + 1, BATCH):
            idx = torch.from_numpy(perm[i : i + BATCH])
            opt.zero_grad()
            F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
            step += 1
            if method != "dense" and step > TRACK_FROM:
                for row in opt.dlgs.stats():
                    if row["sparse"]:
                        ratios.setdefault(row["name"], []).append(row["selected"] / row["k"])
        acc.append(evaluate(model, xte, yte))
    return {
        "accuracy": acc,
        "seconds": time.perf_counter() - start,
        "steps": step,
        "selected_over_target": ratios,
    }


def main(argv):
    out_dir, epochs = Path(argv[1]), int(argv[2])
    hvd.init()
    xtr, ytr = map(torch.from_numpy, fashion_mnist("train"))
    xte, yte = map(torch.from_numpy, fashion_mnist("test"))
    data = (xtr, ytr, xte, yte)
    results = {m: run(m, epochs, data) for m in ("dense", "0.01")}
    (out_dir / f"rank{hvd.rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv)
