"""Real ranks of ``transport="reduce"`` (tests/test_reduction.py):
``python reduce_worker.py OUT DENSITY``. A small MLP trained 6 steps on
per-rank data; each rank writes the digest of its parameters after every
step, and at density 1.0 those of stock Horovod's optimizer on the same data."""

import hashlib
import json
import sys

import horovod.torch as hvd
import torch

import dlgs.torch

out, density = sys.argv[1], float(sys.argv[2])
hvd.init()
rank = hvd.rank()
torch.set_num_threads(1)


def model_and_opt(dlgs_form: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 96),
        torch.nn.ReLU(),
        torch.nn.Linear(96, 40),
        torch.nn.ReLU(),
        torch.nn.Linear(40, 10),
    )
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    if dlgs_form:
        opt = dlgs.torch.DistributedOptimizer(
            sgd,
            named_parameters=model.named_parameters(),
            density=density,
            min_sparse_size=1000,
            transport="reduce",
        )
    else:
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def digest(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def train(model, opt):
    digests, losses = [], []
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        digests.append(digest(model))
        losses.append(float(loss))
    return digests, losses


result = {"rank": rank}
model, opt = model_and_opt(True)
result["dlgs"], result["losses"] = train(model, opt)
result["describe"] = opt.dlgs.describe()
if density == 1.0:
    ref, ref_opt = model_and_opt(False)
    result["horovod"], _ = train(ref, ref_opt)
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(result, f)
