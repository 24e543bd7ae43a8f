"""Mixed precision and non-finite gradients on real ranks (PyTorch).

Scenarios run on every rank under ``horovodrun -np 2``; ``tests/test_amp.py``
asserts on the numbers each rank records.

Usage: ``horovodrun -np 2 --gloo python tests/parallel/amp_worker.py OUT_DIR SCENARIO...``
"""

from __future__ import annotations

import hashlib
import math

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
from scenarios import main, scenario  # tests/parallel, the script's own folder
from worker import own_sent

import dlgs.torch
from benchmarks.datasets import fashion_mnist

torch.set_num_threads(1)

# -- helpers ------------------------------------------------------------------

BATCH = 64
STEPS = 500
DECAY_AT = 350
# Far too high on purpose: fp16 back-propagation overflows until the scaler has
# halved it about a dozen times (the calibration every AMP run goes through).
INIT_SCALE = 2.0**30


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    )


def digest(model) -> str:
    h = hashlib.blake2b(digest_size=8)
    for p in model.parameters():
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def finite(model) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return 100.0 * (model(x).argmax(1) == y).float().mean().item()


_DATA = {}


def data():
    if not _DATA:
        xtr, ytr = map(torch.from_numpy, fashion_mnist("train"))
        xte, yte = map(torch.from_numpy, fashion_mnist("test"))
        _DATA["d"] = (xtr, ytr, xte, yte)
    return _DATA["d"]


def make(form: str, model, scaler):
    """The optimizer of ``form``: dense Horovod, or dlgs in either drop-in form
    with every large layer sparse (layer-wise: a plan might send some dense)."""
    opts = dict(density=0.05, min_sparse_size=1024, merge="none", scaler=scaler)
    # The same optimizer for all: momentum correction (dlgs's momentum=) is a
    # different recipe, covered by the fault-injection and conservation scenarios.
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if form == "dense":
        return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    if form == "compression":
        comp = dlgs.torch.Compression(model.named_parameters(), **opts)
        return hvd.DistributedOptimizer(
            base, named_parameters=model.named_parameters(), compression=comp
        )
    return dlgs.torch.DistributedOptimizer(base, named_parameters=model.named_parameters(), **opts)


def amp_run(form: str, pattern: str, dtype):
    """Train ``STEPS`` steps under autocast(``dtype``); ``pattern`` is
    ``"horovod"`` (synchronize, unscale_, skip_synchronize, step), ``"plain"``
    (``scaler.step(opt)``) or ``"none"`` (no scaler)."""
    xtr, ytr, xte, yte = data()
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE) if pattern != "none" else None
    opt = make(form, model, scaler)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    perm = np.random.default_rng(0).permutation(len(xtr))[hvd.rank() :: hvd.size()]
    digests, skipped = [], 0
    for s in range(STEPS):
        if s == DECAY_AT:  # a low final rate: the end point is not one noisy step
            for group in opt.param_groups:
                group["lr"] *= 0.1
        idx = torch.from_numpy(perm[(s * BATCH) % (len(perm) - BATCH) :][:BATCH])
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            if pattern == "horovod":
                opt.synchronize()
                scaler.unscale_(opt)
                with opt.skip_synchronize():
                    scaler.step(opt)
            else:
                scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
        digests.append(digest(model))
    return {
        "accuracy": accuracy(model, xte, yte),
        "skipped": int(skipped),
        "digests": digests,
        "finite": finite(model),
    }


# -- scenarios ----------------------------------------------------------------


@scenario
def amp_convergence():
    """fp16 autocast with an overflowing GradScaler, and bf16 autocast without one:
    dense Horovod against both dlgs forms, under both AMP patterns."""
    runs = {
        "fp16/dense/horovod": ("dense", "horovod", torch.float16),
        "fp16/optimizer/horovod": ("optimizer", "horovod", torch.float16),
        "fp16/optimizer/plain": ("optimizer", "plain", torch.float16),
        "fp16/compression/horovod": ("compression", "horovod", torch.float16),
        "bf16/dense/none": ("dense", "none", torch.bfloat16),
        "bf16/optimizer/none": ("optimizer", "none", torch.bfloat16),
    }
    return {key: amp_run(*args) for key, args in runs.items()}


def _grads(model, g, scale=1.0):
    return {n: torch.randn(p.shape, generator=g) * scale for n, p in model.named_parameters()}


def _state_finite(ex) -> bool:
    for layer in ex.layers:
        for buf in (layer.residual, layer.velocity):
            if buf is not None and not bool(torch.isfinite(buf).all()):
                return False
        for v in layer.controller_state.values():
            if isinstance(v, torch.Tensor) and not bool(torch.isfinite(v).all()):
                return False
    return True


def _snapshot(ex):
    return {
        i: (
            None if layer.residual is None else layer.residual.clone(),
            {
                k: (v.clone() if isinstance(v, torch.Tensor) else v)
                for k, v in layer.controller_state.items()
            },
        )
        for i, layer in enumerate(ex.layers)
    }


def _changed(ex, snap) -> float:
    """Largest change of any residual or controller value since ``snap``
    (inf if one appeared or disappeared)."""
    worst = 0.0
    for i, layer in enumerate(ex.layers):
        resid, ctrl = snap[i]
        if (resid is None) != (layer.residual is None):
            return math.inf
        if resid is not None:
            worst = max(worst, (layer.residual - resid).abs().max().item())
        if set(ctrl) != set(layer.controller_state):
            return math.inf
        for k, v in ctrl.items():
            now = layer.controller_state[k]
            diff = (now - v).abs().max().item() if isinstance(v, torch.Tensor) else abs(now - v)
            worst = max(worst, diff)
    return worst


@scenario
def fault_injection():
    """A NaN and an Inf on one rank only, in one sparse layer, then a NaN in a
    dense layer, for every controller and for a merged group (no scaler)."""
    out = {}
    cases = {
        "dynamic": dict(density=0.05),
        "topk": dict(density=0.05, controller="topk"),
        "dgc": dict(density=0.05, controller="dgc", sample_ratio=0.1),
        "fixed": dict(density=0.05, controller="fixed", threshold=1.5),
        "dynamic_momentum": dict(density=0.05, momentum=0.9),
        "merged": dict(density=0.05),
    }
    # step -> (rank, layer name, value); layer 0.weight is sparse, 0.bias dense.
    faults = {
        5: (1, "1.weight", math.nan),
        9: (0, "1.weight", math.inf),
        13: (1, "3.bias", math.nan),
    }
    steps = 30
    for name, opts in cases.items():
        model = mlp(1)
        opt = dlgs.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0),
            named_parameters=model.named_parameters(),
            min_sparse_size=1024,
            merge="none",
            **opts,
        )
        ex = opt.dlgs.exchange
        if name == "merged":
            ex.set_plan([([i for i, p in enumerate(ex.layer_plans()) if p.sparse], None)])
        params = dict(model.named_parameters())
        target = ex.layers[ex.index("1.weight")]
        g = torch.Generator().manual_seed(11 + hvd.rank())
        rec = {"finite": [], "nan_layers": [], "unchanged_by_bad_step": [], "ratio": []}
        for s in range(steps):
            grads = _grads(model, g)
            if s in faults and faults[s][0] == hvd.rank():
                _, layer_name, bad = faults[s]
                grads[layer_name].view(-1)[123 % grads[layer_name].numel()] = bad
            for n, p in params.items():
                p.grad = grads[n]
            snap = _snapshot(ex) if s in faults else None
            opt.synchronize()
            rec["finite"].append(ex.last_step_finite)
            rec["nan_layers"].append(
                sorted(n for n, p in params.items() if not bool(torch.isfinite(p.grad).all()))
            )
            if snap is not None:
                rec["unchanged_by_bad_step"].append(_changed(ex, snap))
            if target.count is not None and target.sparse:
                rec["ratio"].append(int(target.count) / target.plan.k)
        rec["state_finite"] = _state_finite(ex)
        rec["messages"] = len(ex.groups)
        out[name] = rec
    return out


@scenario
def scaled_conservation():
    """sent + residual = accumulated unscaled input, with the loss scale changing
    between steps and a step made non-finite (skipped) in between."""
    out = {}
    for name, opts in {
        "float32": dict(density=0.05),
        "float16_wire": dict(density=0.05, value_dtype="float16"),
        "momentum": dict(density=0.05, momentum=0.9, momentum_masking=True),
    }.items():
        model = mlp(3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        scaler.scale(torch.ones(()))  # creates the scale tensor
        opt = dlgs.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0),
            named_parameters=model.named_parameters(),
            min_sparse_size=1024,
            merge="none",
            scaler=scaler,
            **opts,
        )
        ex = opt.dlgs.exchange
        params = dict(model.named_parameters())
        total_in = {
            i: torch.zeros(layer.numel, dtype=torch.float64) for i, layer in enumerate(ex.layers)
        }
        total_sent = {
            i: torch.zeros(layer.numel, dtype=torch.float64) for i, layer in enumerate(ex.layers)
        }
        vel = {
            i: torch.zeros(layer.numel, dtype=torch.float64) for i, layer in enumerate(ex.layers)
        }
        g = torch.Generator().manual_seed(21 + hvd.rank())
        scales = [2.0**10, 2.0**13, 2.0**7, 2.0**7, 2.0**15, 2.0**4, 2.0**9, 2.0**12]
        bad_step, skipped = 3, []
        m = opts.get("momentum", 0.0)
        for s, scale in enumerate(scales):
            scaler.update(new_scale=scale)
            unscaled = _grads(model, g)
            for n, p in params.items():
                p.grad = unscaled[n] * scale
            if s == bad_step and hvd.rank() == 1:
                params["1.weight"].grad.view(-1)[7] = math.inf
            opt.synchronize()
            if not ex.last_step_finite:
                skipped.append(s)
                continue
            for i, layer in enumerate(ex.layers):
                u = unscaled[layer.name].reshape(-1).double()
                vel[i] = m * vel[i] + u if m else u
                total_in[i] += vel[i]
            for i, sent in own_sent(ex).items():
                total_sent[i] += sent.double()
                if m:  # factor masking: sent positions restart their velocity
                    vel[i][sent != 0] = 0.0
        worst, size, sparse_layers = 0.0, 0.0, 0
        for i, layer in enumerate(ex.layers):
            if layer.residual is None or not layer.sparse:
                continue
            sparse_layers += 1
            resid = layer.residual[: layer.numel].double()
            worst = max(worst, (total_sent[i] + resid - total_in[i]).abs().max().item())
            size = max(size, total_in[i].abs().max().item())
        out[name] = {
            "max_error": worst,
            "scale": size,
            "sparse_layers": sparse_layers,
            "skipped": skipped,
        }
    return out


if __name__ == "__main__":
    import sys

    main(sys.argv, hvd)
