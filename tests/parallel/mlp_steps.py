"""What the small real-rank workers share (hier_worker.py, reduce_worker.py):
a small MLP whose first two layers are sent sparse, trained a few steps on
per-rank data, and the digest of its parameters after every step."""

import hashlib

import horovod.torch as hvd
import torch

import dlgs.torch


def mlp():
    """The MLP, the same weights on every rank (no collective)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 96),
        torch.nn.ReLU(),
        torch.nn.Linear(96, 40),
        torch.nn.ReLU(),
        torch.nn.Linear(40, 10),
    )


def model_and_opt(make_opt):
    """The MLP (the same weights on every rank) and ``make_opt(sgd, model)``."""
    model = mlp()
    opt = make_opt(torch.optim.SGD(model.parameters(), lr=0.05), model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def dlgs_opts(density, **options):
    """A ``make_opt`` for :func:`model_and_opt`: dlgs's optimizer with the
    MLP's two larger layers sparse, and ``options``."""

    def make(sgd, model):
        return dlgs.torch.DistributedOptimizer(
            sgd,
            named_parameters=model.named_parameters(),
            density=density,
            min_sparse_size=1000,
            **options,
        )

    return make


def form_a_opts(density, **options):
    """A ``make_opt`` for :func:`model_and_opt`: form (a), stock Horovod's
    optimizer with ``dlgs.torch.Compression`` attached, and ``options``."""

    def make(sgd, model):
        compression = dlgs.torch.Compression(
            model.named_parameters(), density=density, min_sparse_size=1000, **options
        )
        opt = hvd.DistributedOptimizer(
            sgd, named_parameters=model.named_parameters(), compression=compression
        )
        compression.attach(opt)
        return opt

    return make


def horovod_opt(sgd, model):
    """Stock Horovod's optimizer, the reference."""
    return hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())


def digest(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def train(model, opt, rank, steps=6, start=0):
    """``steps`` steps on this rank's data from step ``start``; the digests
    and losses."""
    digests, losses = [], []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        digests.append(digest(model))
        losses.append(float(loss))
    return digests, losses
