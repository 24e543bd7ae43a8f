"""Horovod Elastic with a failure and a regrow (tests/test_faults.py):
``python elastic_worker.py OUT FORM`` under ``horovodrun`` with a host
discovery script (``FORM``: ``horovod`` for stock ``hvd.DistributedOptimizer``,
the reference, ``b`` for ``dlgs.torch.DistributedOptimizer`` or ``a`` for
``compression=dlgs.torch.Compression``, attached).

The shared MLP (mlp_steps.py) in ``hvd.elastic.TorchState``, committed every
4 batches, 24 batches in all. The worker on host 127.0.0.1 raises at batch 14
the first time (a marker file says it did): the survivor resets to one rank
and goes on from the last commit; once the failed host's blacklisting cools
down, a new worker joins and every rank resets again. Every rank appends
``{"resets", "batch", "size", "rank", "digest"}`` to ``OUT/log.jsonl`` after
each step; the test checks that the ranks of each reset hold the same
parameters at every batch.
"""

import faulthandler
import json
import os
import sys
import time

import horovod.torch as hvd
import torch
from mlp_steps import digest, mlp

import dlgs.torch

out, form = sys.argv[1:3]
BATCHES, COMMIT_EVERY, FAIL_AT = 40, 4, 14
host = os.environ.get("HOROVOD_HOSTNAME", "")

hang = int(os.environ.get("DLGS_TEST_HANG_S", "0"))
if hang:  # the launcher kills the job soon after: show where every thread waits
    faulthandler.dump_traceback_later(hang, exit=True)
hvd.init()
torch.set_num_threads(1)
# No collective before hvd.elastic.run: a joining worker builds while the others sync.
model = mlp()
sgd = torch.optim.SGD(model.parameters(), lr=0.05)
if form == "horovod":
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
elif form == "a":
    compression = dlgs.torch.Compression(
        model.named_parameters(), density=0.05, merge="none", min_sparse_size=1000
    )
    opt = hvd.DistributedOptimizer(
        sgd, named_parameters=model.named_parameters(), compression=compression
    )
    compression.attach(opt)
else:
    opt = dlgs.torch.DistributedOptimizer(
        sgd,
        named_parameters=model.named_parameters(),
        density=0.05,
        merge="none",
        min_sparse_size=1000,
    )
resets = [0]


def on_reset():
    resets[0] += 1


@hvd.elastic.run
def train(state):
    while state.batch < BATCHES:
        marker = f"{out}/failed"
        if host == "127.0.0.1" and state.batch == FAIL_AT and not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError(f"injected failure at batch {state.batch}")
        g = torch.Generator().manual_seed(100 * state.batch + hvd.rank())
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.batch += 1
        record = {
            "resets": resets[0],
            "batch": state.batch,
            "size": hvd.size(),
            "rank": hvd.rank(),
            "digest": digest(model),
            "time": time.time(),
        }
        with open(f"{out}/log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if state.batch % COMMIT_EVERY == 0:
            state.commit()
        time.sleep(0.25)  # room for the driver to see the failed host come back


state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)
state.register_reset_callbacks([on_reset])
train(state)
