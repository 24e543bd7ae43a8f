"""Train a few steps under a given merge strategy with Horovod's timeline on.

Usage: ``HOROVOD_TIMELINE=... horovodrun -np 2 python tests/parallel/timeline.py OUT MERGE STEPS``
Writes ``OUT/plan.json`` (rank 0): the messages in force at the end, and for
every step the messages that step sent (the layout changes when a plan, or the
refined plan, takes effect).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import horovod.torch as hvd
import torch
from worker import mlp, train

import dlgs.torch

torch.set_num_threads(1)


def main(argv):
    out, merge, steps = Path(argv[1]), argv[2], int(argv[3])
    hvd.init()
    model = mlp(9, hidden=96)
    opt = dlgs.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        named_parameters=model.named_parameters(),
        density=0.05,
        min_sparse_size=64,
        merge=merge,
        profile_steps=1,
    )
    ex = opt.dlgs.exchange
    history = []
    for s in range(steps):
        train(model, opt, 1, start=s)
        # A new plan is laid out at the next step's first gradient, so the
        # groups now are the ones this step used.
        history.append([[g.name, g.sparse] for g in ex.groups])
    if hvd.rank() == 0:
        plan = [{"name": g.name, "sparse": g.sparse, "members": g.members} for g in ex.groups]
        (out / "plan.json").write_text(json.dumps({"final": plan, "history": history}))
    hvd.shutdown()  # flushes the timeline


if __name__ == "__main__":
    main(sys.argv)
