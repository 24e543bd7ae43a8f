"""Torch helpers shared by the Horovod worker (``worker.py``) and the DDP
worker (``ddp_worker.py``); no Horovod here."""

from __future__ import annotations

import hashlib

import torch

__all__ = ["conservation_error", "digest", "mlp", "own_sent", "sparse_grads"]


def mlp(seed: int, hidden: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


class WithEmpty(torch.nn.Module):
    """``mlp(seed)`` with two parameters of no elements: one used in the
    forward pass (its gradient is an empty tensor), one merely present (no
    gradient)."""

    def __init__(self, seed: int):
        super().__init__()
        self.body = mlp(seed)
        self.used = torch.nn.Parameter(torch.zeros(0, 5))
        self.present = torch.nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return self.body(x) + self.used.sum()


def digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def own_sent(exchange) -> dict:
    """This rank's last sent values, decoded from its own send buffers."""
    sent = {}
    for group in exchange.groups:
        if not group.sparse:
            continue
        lay = group.layout
        dense = torch.zeros(lay.dense_size, dtype=torch.float64)
        vals, idx, _ = lay.decode(group.chunk.cpu().numpy())
        dense.index_add_(0, torch.from_numpy(idx), torch.from_numpy(vals))
        for m, i in enumerate(group.members):
            sent[i] = dense[lay.dense_offset(m) : lay.dense_offset(m) + lay.sizes[m]].clone()
    return sent


def sparse_grads(model, k_of, seed, shared_seed):
    """Gradients with at most k non-zeros per layer on this rank: half of them at
    positions every rank shares (``shared_seed`` is the same on every rank, so
    the reduction really adds values from several ranks), half of its own."""
    g = torch.Generator().manual_seed(seed)
    grads = {}
    for name, p in model.named_parameters():
        n = p.numel()
        k = k_of(name, n)
        shared = torch.randperm(n, generator=torch.Generator().manual_seed(shared_seed))[: k // 2]
        own = torch.randperm(n, generator=g)[: k - k // 2]
        idx = torch.unique(torch.cat([shared, own]))[:k]
        flat = torch.zeros(n)
        flat[idx] = torch.randn(idx.numel(), generator=g)
        grads[name] = flat.view_as(p)
    return grads


def conservation_error(exchange, total_in: dict, total_sent: dict) -> dict:
    """Over the sparse layers: the largest |sent + residual - input| (totals
    by layer index), the inputs' scale and how many layers were sparse."""
    worst, scale, sparse = 0.0, 0.0, 0
    for i, layer in enumerate(exchange.layers):
        if layer.residual is None:
            continue
        sparse += 1
        resid = layer.residual[: layer.numel]
        worst = max(worst, (total_sent[i] + resid - total_in[i]).abs().max().item())
        scale = max(scale, total_in[i].abs().max().item())
    return {"max_error": worst, "scale": scale, "sparse_layers": sparse}


#: The door x feature cells that form (a) and the DDP hook share with
#: form (b): transport="auto" and density="auto" (docs/options.md).
DOOR_CELLS = {
    "transport_auto": dict(density=0.05, transport="auto", merge="none"),
    "density_auto": dict(density="auto", merge="dp", profile_steps=2, profile_budget=1.0),
    # A tenth of the dense bytes per step, under a dp plan.
    "budget": dict(
        budget=0.1, budget_split="uniform", merge="dp", profile_steps=2, profile_budget=1.0
    ),
    # ... split between layers by their residuals after 10 steps (the default).
    "budget_split": dict(budget=0.1, merge="dp", profile_steps=2, profile_budget=1.0),
}


def door_cell_record(engine, digests) -> dict:
    """What a door x feature cell shows: the parameters after every step, the
    transport in use, density="auto"'s choice (None before one), the bytes
    a step sends (and dense float32's) and whether a plan is in force."""
    choice = engine.planner.density_choice
    return {
        "digests": digests,
        "transport": engine.exchange.transport.name,
        "choice": None if choice is None else choice.density,
        "wire_bytes": engine.exchange.wire_bytes(),
        "dense_bytes": engine.exchange.dense_bytes(),
        "planned": engine.planner.plan is not None,
        "split": engine.exchange.auto_layers is not None,
    }
