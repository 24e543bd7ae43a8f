"""Who gets the bytes of a budget: one density against ``budget_split="gradient"``.

Single process, the Fashion-MNIST CNN (``benchmarks.models.FashionCNN``), SGD
lr 0.05 with momentum correction's velocity (m = 0.9) fed to per-layer error
feedback at the one density PowerSGD rank R's bytes give
(:func:`dlgs.core.wire.density_for_budget`, ``min_sparse_size=256`` as in
``benchmarks.convergence``). After :data:`dlgs.core.planning.budget.SPLIT_AFTER`
steps, the residuals are split by the product's own
:func:`~dlgs.core.planning.budget.split_densities` (every residual sampled in
full here) and, per sparse layer, the table gives the entries a step and the
share of the residual's energy (sum of squares) its largest entries of that
count hold, under each::

    python -m benchmarks.budget_shares --powersgd-rank 1 \
        --out benchmarks/results/2026-12-06-budget-shares
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks import ddp_methods
from benchmarks.datasets import fashion_mnist
from benchmarks.models import FashionCNN
from dlgs.core.config import SparsityConfig
from dlgs.core.planning.budget import SPLIT_AFTER, split_densities
from dlgs.core.wire import density_for_budget, layout_bytes, plan_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--powersgd-rank", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.powersgd_rank < 1:
        parser.error(f"--powersgd-rank must be >= 1, got {args.powersgd_rank}")
    torch.manual_seed(args.seed)
    model = FashionCNN()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sizes = [p.numel() for _, p in params]
    budget = ddp_methods.powersgd_bytes(model, args.powersgd_rank)
    # float32 values, as the results of 2026-12-06 (before value_dtype="auto"
    # chose float16 under a budget): more entries, the same split.
    config = SparsityConfig(budget=budget, min_sparse_size=256, value_dtype="float32")
    uniform = density_for_budget(sizes, config)
    plans = plan_layers(sizes, uniform, config)
    x, y = map(torch.from_numpy, fashion_mnist("train"))
    order = np.random.default_rng(args.seed).permutation(len(x))
    residual = [torch.zeros(n) for n in sizes]
    velocity = [torch.zeros(n) for n in sizes]
    for step in range(SPLIT_AFTER):
        idx = torch.from_numpy(order[step * 64 : (step + 1) * 64])
        model.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        with torch.no_grad():
            for i, (_, p) in enumerate(params):
                velocity[i].mul_(0.9).add_(p.grad.reshape(-1))
                if not plans[i].sparse:  # sent dense: nothing kept
                    update = velocity[i]
                else:
                    residual[i].add_(velocity[i])
                    top = residual[i].abs().topk(plans[i].k).indices
                    update = torch.zeros(sizes[i])
                    update[top] = residual[i][top]
                    residual[i][top] = 0.0
                p.sub_(0.05 * update.view_as(p))
    samples = [r.tolist() if pl.sparse else None for r, pl in zip(residual, plans)]
    split = split_densities(sizes, samples, uniform, config, budget)
    lines = [
        f"# Who gets the bytes: PowerSGD rank {args.powersgd_rank}'s {budget} bytes per step",
        "",
        f"Command: `python -m benchmarks.budget_shares --powersgd-rank {args.powersgd_rank} "
        f"--seed {args.seed} --out {args.out}`",
        "",
        f"One density {uniform:.4f} ({layout_bytes(sizes, uniform, config)} bytes); the split "
        f"after {SPLIT_AFTER} steps ({layout_bytes(sizes, split, config)} bytes).",
        "",
        "| layer | entries | one density: entries a step | energy held | split: entries a step "
        "| energy held |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for (name, _), n, r, pl, d in zip(params, sizes, residual, plans, split):
        if not pl.sparse:
            continue
        sq = r.pow(2).sort(descending=True).values
        total = float(sq.sum()) or 1.0
        k_split = max(1, math.ceil(d * n))
        lines.append(
            f"| {name} | {n:,} | {pl.k} | {float(sq[: pl.k].sum()) / total:.0%} "
            f"| {k_split} | {float(sq[:k_split].sum()) / total:.0%} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    (args.out / "budget_shares.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
