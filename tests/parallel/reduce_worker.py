"""Real ranks of ``transport="reduce"`` (tests/test_reduction.py):
``python reduce_worker.py OUT DENSITY``. The shared MLP (mlp_steps.py)
trained 6 steps on per-rank data; each rank writes the digest of its
parameters after every step, and at density 1.0 those of stock Horovod's
optimizer on the same data."""

import json
import sys

import horovod.torch as hvd
import torch
from mlp_steps import dlgs_opts, horovod_opt, model_and_opt, train

out, density = sys.argv[1], float(sys.argv[2])
hvd.init()
rank = hvd.rank()
torch.set_num_threads(1)
dlgs_opt = dlgs_opts(density, transport="reduce")


result = {"rank": rank}
model, opt = model_and_opt(dlgs_opt)
result["dlgs"], result["losses"] = train(model, opt, rank)
result["describe"] = opt.dlgs.describe()
if density == 1.0:
    result["horovod"], _ = train(*model_and_opt(horovod_opt), rank)
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(result, f)
