"""A ``load_state_dict`` on one rank after training has begun
(tests/test_faults.py): ``python load_worker.py OUT`` on 4 ranks, 2 per node.

For each door and transport (form (b) flat, the reduction and the two-level
exchange; form (a) attached), the shared MLP (mlp_steps.py) trains 8 steps;
rank 1 saves its optimizer state after step 2 and loads it after step 5, as
a user restoring one rank would. Every rank must go on (no hang) and hold the
same parameters after every step. Writes ``OUT/rank{r}.json``: per case the
digests, the exchange's step and whether rank 1's warning came.
"""

import copy
import json
import logging
import sys

import horovod.torch as hvd
import torch
from mlp_steps import dlgs_opts, model_and_opt, train

import dlgs.torch

out = sys.argv[1]
hvd.init(process_sets="dynamic")
rank = hvd.rank()
torch.set_num_threads(1)
warnings = []


class Catch(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())


logging.getLogger("dlgs").addHandler(Catch(level=logging.WARNING))


def form_a(sgd, model):
    compression = dlgs.torch.Compression(
        model.named_parameters(), density=0.05, min_sparse_size=1000, merge="none"
    )
    opt = hvd.DistributedOptimizer(
        sgd, named_parameters=model.named_parameters(), compression=compression
    )
    compression.attach(opt)
    opt.engine = compression.dlgs
    return opt


CASES = {
    "flat": dlgs_opts(0.05, merge="none"),
    "reduce": dlgs_opts(0.05, merge="none", transport="reduce"),
    "hierarchical": dlgs_opts(0.05, merge="none", topology="hierarchical", ranks_per_node=2),
    "form-a": form_a,
}
result = {}
for case, make in CASES.items():
    warnings.clear()
    model, opt = model_and_opt(make)
    digests = []
    for step in range(8):
        digests += train(model, opt, rank, steps=1, start=step)[0]
        if rank == 1 and step == 2:
            saved = copy.deepcopy(opt.state_dict())
        if rank == 1 and step == 5:
            opt.load_state_dict(saved)
    engine = getattr(opt, "engine", None) or opt.dlgs
    result[case] = {
        "digests": digests,
        "step": engine.exchange.step,
        "warned": any("after training began" in w for w in warnings),
    }
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(result, f)
