"""What a layer's bytes capture: top-k entries against PowerSGD's low rank.

Single process (Horovod at one rank, for the tasks' data shards): trains a
task of :mod:`benchmarks.convergence` densely with its own optimizer for
``--steps`` steps, and over the last ``--last`` steps' gradients gives, for
every matrix PowerSGD at ``--powersgd-rank`` R compresses, the share of the
gradient's energy (sum of squares) that its best rank-R approximation holds
(the truncated SVD: an upper bound on PowerSGD's one power iteration) and the
share that the largest entries holding the same bytes hold (4 bytes an entry
with float16 values and 16-bit indices, 6 with float32 values): what one step
of each compressor can send of that gradient, before error feedback carries
the rest. Where the low rank holds far more, top-k must make it up over
later steps through its residual::

    python -m benchmarks.capture --task transformer --powersgd-rank 4 \\
        --out benchmarks/results/2026-12-06-capture
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Dict, List

import horovod.torch as hvd
import torch

from .convergence import TASKS

#: Bytes an entry costs: float16 / float32 values, 16-bit indices.
ENTRY_BYTES = {"float16": 4, "float32": 6}


def shares(grad: torch.Tensor, rank: int) -> Dict[str, float]:
    """Energy shares of ``grad`` (viewed as PowerSGD views it: first dimension
    by the rest) held by its best rank-``rank`` approximation and by the
    largest entries costing as many bytes."""
    mat = grad.reshape(grad.shape[0], -1).double()
    total = float(mat.pow(2).sum()) or 1.0
    sv = torch.linalg.svdvals(mat)
    out = {"rank": float(sv[:rank].pow(2).sum()) / total}
    sq = mat.reshape(-1).pow(2).sort(descending=True).values
    low_rank_bytes = 4 * rank * sum(mat.shape)
    for dtype, each in ENTRY_BYTES.items():
        k = low_rank_bytes // each
        out[dtype] = float(sq[:k].sum()) / total
    out["energy"] = total
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=list(TASKS), default="transformer")
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--last", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.powersgd_rank < 1:
        parser.error(f"--powersgd-rank must be >= 1, got {args.powersgd_rank}")
    if not 1 <= args.last <= args.steps:
        parser.error(f"--last must be in [1, --steps], got {args.last}")
    hvd.init()
    torch.manual_seed(args.seed)
    task = TASKS[args.task](args.seed, 64 if args.task == "fashion" else 20)
    model = task.model()
    opt = task.optimizer(model.parameters(), task.momentum)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    r = args.powersgd_rank
    compressed = [
        (n, p) for n, p in named if p.dim() > 1 and 2 * r * (p.shape[0] + p[0].numel()) < p.numel()
    ]
    sums: Dict[str, Dict[str, float]] = {n: {} for n, _ in compressed}
    step = 0
    while step < args.steps:
        for x, y in task.batches(step // task.steps_per_epoch):
            opt.zero_grad()
            task.loss(model, x, y).backward()
            if step >= args.steps - args.last:
                for n, p in compressed:
                    for key, v in shares(p.grad, r).items():
                        sums[n][key] = sums[n].get(key, 0.0) + v / args.last
            if task.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), task.clip)
            opt.step()
            step += 1
            if step == args.steps:
                break
    lines: List[str] = [
        f"# What a step's bytes hold: {args.task}, PowerSGD rank {r}",
        "",
        f"Command: `python -m benchmarks.capture --task {args.task} --powersgd-rank {r} "
        f"--steps {args.steps} --last {args.last} --seed {args.seed} --out {args.out}`",
        "",
        f"Means over steps {args.steps - args.last + 1}-{args.steps} of dense training with "
        "the task's optimizer. Energy: the gradient's sum of squares; rank: its best "
        f"rank-{r} approximation's share (SVD); top-k: the largest entries of the same "
        "bytes (float16 values: 4 bytes an entry; float32: 6).",
        "",
        "| layer | shape | share of the energy | rank-R bytes | rank-R holds "
        "| top-k (float16) holds | top-k (float32) holds |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    energy = sum(s["energy"] for s in sums.values()) or 1.0
    for n, p in compressed:
        s = sums[n]
        lines.append(
            f"| {n} | {tuple(p.shape)} | {s['energy'] / energy:.0%} "
            f"| {4 * r * (p.shape[0] + p[0].numel()):,} | {s['rank']:.0%} "
            f"| {s['float16']:.0%} | {s['float32']:.0%} |"
        )
    weighted = {k: sum(s[k] * s["energy"] for s in sums.values()) / energy for k in ENTRY_BYTES}
    rank_all = sum(s["rank"] * s["energy"] for s in sums.values()) / energy
    lines.append(
        f"| all of them | | 100% | | {rank_all:.0%} | {weighted['float16']:.0%} "
        f"| {weighted['float32']:.0%} |"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    (args.out / f"capture-{args.task}-r{r}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
