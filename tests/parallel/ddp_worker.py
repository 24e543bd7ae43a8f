"""DDP communication-hook scenarios (``dlgs.torch.ddp``), run on every rank
under ``torchrun --nproc-per-node 2`` with the Gloo backend; no Horovod.

Like ``worker.py``: each scenario records numbers on real ranks and
``tests/test_ddp.py`` asserts on every rank's record.

Usage: ``python -m torch.distributed.run --standalone --nproc-per-node 2
tests/parallel/ddp_worker.py OUT_DIR SCENARIO...``
"""

from __future__ import annotations

import io
import pickle
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from scenarios import main, scenario  # tests/parallel, the script's own folder
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_common import (
    DOOR_CELLS,
    WithEmpty,
    conservation_error,
    digest,
    door_cell_record,
    mlp,
    own_sent,
    sparse_grads,
)

import dlgs.torch.ddp
from dlgs.core import RankMismatchError

torch.set_num_threads(1)


class _Dist:
    """What ``scenarios.main`` needs of a Horovod module, on torch.distributed."""

    @staticmethod
    def init() -> None:
        dist.init_process_group("gloo")

    @staticmethod
    def rank() -> int:
        return dist.get_rank()


def batch(step: int, n: int = 16):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def batch_inf_on_rank1(step: int, bad: int = 2):
    """:func:`batch`, with an infinity in rank 1's input at step ``bad``."""
    x, y = batch(step)
    if step == bad and dist.get_rank() == 1:
        x = x.clone()
        x[0, 0] = float("inf")
    return x, y


def ddp(seed: int = 0, hidden: int = 64, **kwargs) -> DDP:
    """The MLP in DDP (which broadcasts rank 0's parameters); small buckets, so
    that the rebuilt buckets after the first step are several."""
    kwargs.setdefault("bucket_cap_mb", 0.01)
    return DDP(mlp(seed, hidden), **kwargs)


def sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(model, opt, steps: int, start: int = 0, passes: int = 1):
    """``steps`` steps of ``passes`` micro-batches each (the first ones under
    ``no_sync``); each step's parameter digest."""
    digests = []
    for s in range(start, start + steps):
        opt.zero_grad()
        for j in range(passes):
            x, y = batch(s * passes + j)
            if j < passes - 1:
                with model.no_sync():
                    F.cross_entropy(model(x), y).backward()
            else:
                F.cross_entropy(model(x), y).backward()
        opt.step()
        digests.append(digest(model))
    return digests


def hooked(model: DDP, **options) -> dlgs.torch.ddp.SparseState:
    state = dlgs.torch.ddp.SparseState(model, **options)
    model.register_comm_hook(state, dlgs.torch.ddp.sparse_hook)
    return state


class _Dot(torch.nn.Module):
    """``sum(p * c)`` over the parameters of ``inner``: its gradient is ``c``,
    exactly, back-propagated through DDP's forward (so DDP's reducer runs)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, grads: dict) -> torch.Tensor:
        return sum((p * grads[n]).sum() for n, p in self.inner.named_parameters())


def dot_ddp(seed: int, hidden: int = 128) -> DDP:
    return DDP(_Dot(mlp(seed, hidden)), bucket_cap_mb=0.01)


def _bf16_reference_hook(state, bucket):
    """DDP's ``bf16_compress_hook`` (torch/distributed/algorithms/ddp_comm_hooks/
    default_hooks.py), which DDP refuses to register without CUDA: the bucket
    cast to bfloat16 and divided, summed, cast back into the bucket."""
    buffer = bucket.buffer()
    wire = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(wire, async_op=True).get_future()

    def back(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return fut.then(back)


# -- scenarios ----------------------------------------------------------------


@scenario
def dense_equals_ddp():
    """density=1.0 through the hook: DDP's own result, bit for bit, with and
    without gradient accumulation under no_sync()."""
    out = {}
    for passes in (1, 2):
        plain = ddp()
        base = train(plain, sgd(plain), 5, passes=passes)
        model = ddp()
        hooked(model, density=1.0)
        mine = train(model, sgd(model), 5, passes=passes)
        out[f"passes{passes}"] = {"plain": base, "hook": mine}
    # dense_dtype: DDP's own fp16 compression hook, bit for bit, and its bf16
    # one (which DDP registers on CUDA only) as written in the reference hook.
    for dtype, builtin in (
        ("float16", default_hooks.fp16_compress_hook),
        ("bfloat16", _bf16_reference_hook),
    ):
        plain = ddp()
        plain.register_comm_hook(None, builtin)
        base = train(plain, sgd(plain), 5)
        model = ddp()
        hooked(model, density=1.0, dense_dtype=dtype)
        mine = train(model, sgd(model), 5)
        out[dtype] = {"plain": base, "hook": mine}
    return out


@scenario
def sparse_training():
    """density 0.05: every rank's parameters after every step, layer-wise
    (every eligible layer sparse, DDP's rebuilt buckets) and under the default
    planner (profiling, then a plan: on loopback it may find dense cheaper),
    with no_sync() accumulation too; and layer-wise by the sparse reduction
    (its collectives have an alltoall)."""
    out = {}
    cases = [("none", 1, "allgather"), ("none", 2, "allgather"), ("dp", 1, "allgather")]
    cases += [("dp", 2, "allgather"), ("none", 1, "reduce")]
    for merge, passes, transport in cases:
        model = ddp(hidden=128)
        state = hooked(
            model,
            density=0.05,
            min_sparse_size=64,
            profile_steps=2,
            merge=merge,
            transport=transport,
        )
        digests = train(model, sgd(model), 8, passes=passes)
        ex = state.dlgs.exchange
        name = f"{merge}.passes{passes}" + ("" if transport == "allgather" else f".{transport}")
        out[name] = {
            "digests": digests,
            "step": ex.step,
            "sparse_messages": sum(1 for g in ex.groups if g.sparse),
            "planned": state.dlgs.planner.plan is not None,
            "transport": ex.transport.name,
        }
    return out


@scenario
def exact_reconstruction():
    """<= k non-zeros per rank and layer: the averaged gradient is exact."""
    out = {}
    for name, opts in {
        "topk": dict(controller="topk"),
        "dynamic_anchor_every_step": dict(anchor_every=1),
    }.items():
        model = dot_ddp(2)
        state = hooked(model, density=0.05, min_sparse_size=64, merge="none", **opts)
        ex = state.dlgs.exchange
        plans = {
            layer.name.removeprefix("inner."): plan
            for layer, plan in zip(ex.layers, ex.layer_plans())
        }
        worst, sparse = 0.0, sum(1 for p in plans.values() if p.sparse)
        inner = model.module.inner
        for s in range(4):
            grads = sparse_grads(
                inner,
                lambda nm, n, plans=plans: plans[nm].k if plans[nm].sparse else n,
                seed=100 * s + 7 + dist.get_rank() * 1000,
                shared_seed=s,
            )
            model.zero_grad()
            model(grads).backward()
            for nm, p in inner.named_parameters():
                expect = grads[nm].clone()
                dist.all_reduce(expect)
                worst = max(worst, (p.grad - expect / 2).abs().max().item())
        out[name] = {"max_diff": worst, "sparse_layers": sparse}
    return out


@scenario
def conservation():
    """Per rank: what it sent plus its residual equals all it was given."""
    model = dot_ddp(3)
    state = hooked(model, density=0.05, min_sparse_size=64, merge="none")
    ex = state.dlgs.exchange
    params = dict(model.module.inner.named_parameters())
    total_in = {i: torch.zeros(layer.numel) for i, layer in enumerate(ex.layers)}
    total_sent = {i: torch.zeros(layer.numel) for i, layer in enumerate(ex.layers)}
    g = torch.Generator().manual_seed(5 + dist.get_rank())
    for _ in range(6):
        grads = {n: torch.randn(p.shape, generator=g) for n, p in params.items()}
        model.zero_grad()
        model(grads).backward()
        for i, layer in enumerate(ex.layers):
            total_in[i] += grads[layer.name.removeprefix("inner.")].reshape(-1)
        for i, sent in own_sent(ex).items():
            total_sent[i] += sent
    return conservation_error(ex, total_in, total_sent)


class _Branches(torch.nn.Module):
    """An MLP with a head used on even steps only."""

    def __init__(self):
        super().__init__()
        self.body = mlp(4, 128)
        self.other = torch.nn.Linear(10, 10)
        self.step = 0

    def forward(self, x):
        y = self.body(x)
        return self.other(y) if self.step % 2 == 0 else y


@scenario
def unused_parameters():
    """find_unused_parameters=True: a head unused on odd steps; ranks agree."""
    torch.manual_seed(0)
    net = _Branches()
    model = DDP(net, find_unused_parameters=True, bucket_cap_mb=0.01)
    hooked(model, density=0.05, min_sparse_size=64, merge="none")
    opt = sgd(model)
    digests = []
    for s in range(6):
        net.step = s
        opt.zero_grad()
        x, y = batch(s)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        digests.append(digest(model))
    return {"digests": digests}


@scenario
def empty_parameters():
    """Parameters with no elements train as under plain DDP: sparse with
    ranks identical, and density 1.0 equal to DDP without a hook."""
    out = {}
    for case, density in (("sparse", 0.05), ("dense", 1.0), ("plain", None)):
        torch.manual_seed(0)
        model = DDP(WithEmpty(0), bucket_cap_mb=0.01, find_unused_parameters=True)
        if density is not None:
            hooked(model, density=density, min_sparse_size=64, merge="none")
        out[case] = train(model, sgd(model), 4)
    return out


def _save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _resume_run(options: dict, saved_at: int, more: int, keep_dlgs: bool = True):
    """Train ``saved_at`` steps, save, train ``more``; then a fresh model,
    optimizer and state load the checkpoint (dlgs' part unless not
    ``keep_dlgs``) and train the same ``more`` steps: both runs' digests."""
    model = ddp(hidden=128)
    state = hooked(model, density=0.05, min_sparse_size=64, **options)
    opt = sgd(model)
    train(model, opt, saved_at)
    if options.get("merge") == "dp" and not state.dlgs.planner.settled:
        raise RuntimeError(f"no plan in force after {saved_at} steps")
    saved = _save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "dlgs": state.state_dict()}
    )
    on = train(model, opt, more, start=saved_at)
    model2 = ddp(seed=9, hidden=128)
    state2 = hooked(model2, density=0.05, min_sparse_size=64, **options)
    opt2 = sgd(model2)
    ckpt = torch.load(io.BytesIO(saved), weights_only=False)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    if keep_dlgs:
        state2.load_state_dict(ckpt["dlgs"])
    return on, train(model2, opt2, more, start=saved_at)


@scenario
def resume():
    """Save model, optimizer and dlgs state mid-run; training on equals a
    fresh model that loads them (each rank its own dlgs state): layer-wise,
    and with a DP plan in force (profiled 2 steps, planned, then saved)."""
    layerwise = dict(merge="none", anchor_every=3)
    on, resumed = _resume_run(layerwise, 3, 4)
    # Negative control: without dlgs' residuals and thresholds the run differs.
    _, without = _resume_run(layerwise, 3, 4, keep_dlgs=False)
    on_dp, resumed_dp = _resume_run(dict(merge="dp", profile_steps=2), 10, 4)
    return {
        "on": on,
        "resumed": resumed,
        "without_dlgs_state": without,
        "on_dp": on_dp,
        "resumed_dp": resumed_dp,
    }


@scenario
def one_rank_load():
    """Rank 1 alone loads its state of step 1 after step 3; every
    rank goes on (no agreement on one rank), with the same parameters."""
    model = ddp(hidden=128)
    state = hooked(model, density=0.05, min_sparse_size=64, merge="none")
    opt = sgd(model)
    digests = train(model, opt, 2)
    saved = _save(state.state_dict())
    digests += train(model, opt, 2, start=2)
    if dist.get_rank() == 1:
        state.load_state_dict(torch.load(io.BytesIO(saved), weights_only=False))
    digests += train(model, opt, 3, start=4)
    return {"digests": digests, "step": state.dlgs.exchange.step}


@scenario
def pickled_state():
    """A pickled state keeps its options and checkpoint; bound to the model
    again, it trains on as the original."""
    model = ddp(hidden=128)
    state = hooked(model, density=0.05, min_sparse_size=64, merge="none")
    opt = sgd(model)
    train(model, opt, 2)
    blob = pickle.dumps(state)
    params = _save({"model": model.state_dict(), "opt": opt.state_dict()})
    on = train(model, opt, 3, start=2)
    copy = pickle.loads(blob)
    unbound = ""
    try:
        copy.dlgs.describe()
    except RuntimeError as err:
        unbound = str(err)
    model2 = ddp(seed=9, hidden=128)
    ckpt = torch.load(io.BytesIO(params), weights_only=False)
    model2.load_state_dict(ckpt["model"])
    model2.register_comm_hook(copy.bind(model2), dlgs.torch.ddp.sparse_hook)
    opt2 = sgd(model2)
    opt2.load_state_dict(ckpt["opt"])
    resumed = train(model2, opt2, 3, start=2)
    errors = {}
    try:  # bound once only: a second bind would drop what the state learnt
        copy.bind(model2)
    except RuntimeError as err:
        errors["twice"] = str(err)
    # A state saved with a GradScaler needs one again.
    scaled = hooked(ddp(hidden=128), density=0.05, scaler=torch.amp.GradScaler("cpu"))
    again = pickle.loads(pickle.dumps(scaled))
    try:
        again.bind(ddp(hidden=128))
    except ValueError as err:
        errors["scaler"] = str(err)
    return {"on": on, "resumed": resumed, "unbound": unbound, "errors": errors}


@scenario
def error_mid_step():
    """An error inside the hook fails the step (raised by backward, with every
    bucket's future failed: no hang). DDP's own reducer cannot go on after a
    failed hook, so training stops there, as with any hook."""
    model = ddp(hidden=128)
    state = hooked(model, density=0.05, min_sparse_size=64, merge="none")
    opt = sgd(model)
    train(model, opt, 1)
    message = ""
    if dist.get_rank() >= 0:  # every rank fails the same step, as on a real bad input
        ex = state.dlgs.exchange

        def refuse(i, grad):  # the exchange refuses a gradient (as on a bad input)
            raise RuntimeError(f"injected: gradient {i} refused")

        ex.submit = refuse  # shadows the method on this instance only
        try:
            opt.zero_grad()
            x, y = batch(1)
            F.cross_entropy(model(x), y).backward()
        except RuntimeError as err:
            message = str(err)
        del ex.submit
    return {"message": message, "pending": state.dlgs.exchange.pending() != []}


@scenario
def amp_nonfinite():
    """GradScaler: a step non-finite on rank 1 only is skipped on both ranks
    (the scale halves on both), and the residuals keep unscaled units."""
    model = ddp(hidden=128)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    hooked(model, density=0.05, min_sparse_size=64, merge="none", scaler=scaler)
    opt = sgd(model)
    digests, scales = [], []
    for s in range(5):
        opt.zero_grad()
        x, y = batch_inf_on_rank1(s)
        loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        digests.append(digest(model))
        scales.append(float(scaler.get_scale()))
    return {"digests": digests, "scales": scales}


@scenario
def momentum_and_warmup():
    """Momentum correction (the optimizer without momentum) and DGC's warm-up
    through the hook: ranks bit-identical after every step."""
    model = ddp(hidden=128)
    hooked(
        model,
        density=0.02,
        min_sparse_size=64,
        merge="none",
        momentum=0.9,
        warmup="dgc",
        warmup_steps=2,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0)
    return {"digests": train(model, opt, 8)}


@scenario
def nonfinite_step():
    """A step non-finite on rank 1 only: every rank reads NaN for it and
    learns the same verdict; skipping that update keeps ranks identical."""
    model = ddp(hidden=128)
    state = hooked(model, density=0.05, min_sparse_size=64, merge="none")
    opt = sgd(model)
    digests, finite = [], []
    for s in range(5):
        opt.zero_grad()
        x, y = batch_inf_on_rank1(s)
        F.cross_entropy(model(x), y).backward()
        finite.append(bool(state.dlgs.last_step_finite))
        if finite[-1]:
            opt.step()
        digests.append(digest(model))
    return {"digests": digests, "finite": finite}


@scenario
def mismatch():
    """Ranks with different options: RankMismatchError on every rank, no hang."""
    model = ddp()
    try:
        hooked(model, density=0.05 if dist.get_rank() == 0 else 0.1)
    except RankMismatchError as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}


@scenario
def door_cells():
    """The hook under each of worker.py's ``DOOR_CELLS``: 14 steps."""
    out = {}
    for name, opts in DOOR_CELLS.items():
        model = ddp(hidden=128)
        state = hooked(model, min_sparse_size=64, **opts)
        out[name] = door_cell_record(state.dlgs, train(model, sgd(model), 14))
    return out


@scenario
def two_level():
    """topology='hierarchical' on 2 nodes of 2 ranks (4 ranks, ranks_per_node=2):
    every rank's parameters after every step by the allgather and by the
    reduction between nodes, and under topology='auto'; at density 1.0 the
    result against DDP's own (another summation order: close, not equal)."""
    out = {}
    two = dict(topology="hierarchical", ranks_per_node=2)
    plain = ddp(hidden=128)
    base = train(plain, sgd(plain), 3)
    model = ddp(hidden=128)
    hooked(model, density=1.0, **two)
    dense = train(model, sgd(model), 3)
    diff = max((a - b).abs().max().item() for a, b in zip(plain.parameters(), model.parameters()))
    out["dense"] = {"max_diff": diff, "plain": base, "hook": dense}
    for transport in ("allgather", "reduce"):
        model = ddp(hidden=128)
        state = hooked(
            model, density=0.05, min_sparse_size=64, merge="none", transport=transport, **two
        )
        ex = state.dlgs.exchange
        out[transport] = {
            "digests": train(model, sgd(model), 5),
            "two_level": ex.dense_external is False and hasattr(ex, "node"),
            "step": ex.step,
        }
    model = ddp(hidden=128)
    state = hooked(model, density=0.05, min_sparse_size=64, topology="auto", ranks_per_node=2)
    out["auto"] = {"digests": train(model, sgd(model), 3), "describe": state.dlgs.describe()}
    sub = dist.new_group([0, 1])
    try:
        if dist.get_rank() < 2:
            hooked(ddp(process_group=sub), density=0.05, **two)
        out["subgroup"] = None
    except ValueError as err:
        out["subgroup"] = str(err)
    return out


@scenario
def bad_input():
    """Errors name the option; nothing is built."""
    out = {}
    model = ddp()
    for name, call in {
        "not_ddp": lambda: dlgs.torch.ddp.SparseState(model.module, density=0.05),
        "density": lambda: dlgs.torch.ddp.SparseState(model, density=2.0),
        "scaler": lambda: dlgs.torch.ddp.SparseState(model, density=0.05, scaler=object()),
    }.items():
        try:
            call()
            out[name] = None
        except (TypeError, ValueError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


if __name__ == "__main__":
    main(sys.argv, _Dist)
