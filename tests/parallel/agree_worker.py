"""Rank agreement and process sets, run on every rank under ``horovodrun -np 2``.

Like ``worker.py`` (whose helpers it reuses): each scenario records numbers or
error messages; ``tests/test_agreement.py`` loads every rank's record and
asserts. Process sets are added at run time (``HOROVOD_DYNAMIC_PROCESS_SETS``,
set before ``hvd.init()``), in the same order on every rank: ``[0]``, ``[1]``.

Usage: ``horovodrun -np 2 --gloo python tests/parallel/agree_worker.py OUT_DIR SCENARIO...``
"""

from __future__ import annotations

import os
import sys

# hvd.init() reads it: process sets can be added after initialisation.
os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
from scenarios import main, scenario  # noqa: E402  (tests/parallel, the script's own folder)
from worker import digest, flat_params, mlp, train  # noqa: E402

import dlgs.torch  # noqa: E402
from dlgs.core import RankMismatchError  # noqa: E402
from dlgs.core.planning.dp import CostModel  # noqa: E402
from dlgs.core.planning.online import OnlinePlanner  # noqa: E402
from dlgs.core.planning.profile import LayerProfile, Profile  # noqa: E402
from dlgs.torch._engine import HorovodCollectives, build_engine  # noqa: E402

# A hang prints every thread's stack and exits, well before the test's timeout.

# Options that differ between the ranks: (rank 0's value, rank 1's value); every
# other option at its default. Each must be a RankMismatchError on both ranks.
OPTIMIZER_CASES = {
    "bucket_elements": dict(merge="buckets", bucket_elements=(1024, 2048)),
    "drift_window": dict(drift_window=(50, 8)),
    "max_group": dict(max_group=(None, 2)),
    "drift_tolerance": dict(drift_tolerance=(0.25, 0.5)),
    "profile_budget": dict(profile_budget=(0.01, 0.05)),
    "profile_steps": dict(profile_steps=(5, 3)),
    "merge": dict(merge=("dp", "greedy")),
    "gradient_predivide_factor": dict(gradient_predivide_factor=(1.0, 2.0)),
    "op": dict(op=(hvd.Average, hvd.Sum)),
    "compression": dict(compression=(hvd.Compression.none, hvd.Compression.fp16)),
    "backward_passes_per_step": dict(backward_passes_per_step=(1, 2)),
    "density": dict(density=(0.01, 0.02)),
    "scaler": dict(scaler=(None, "scaler")),
}
# OnlinePlanner options the entry points do not expose (yet): built directly.
PLANNER_CASES = {
    "skip_steps": dict(skip_steps=(1, 2)),
    "probe_reps": dict(probe_reps=(3, 4)),
    "refine": dict(refine=(True, False)),
    "guard": dict(guard=(True, False)),
    "record": dict(record=(False, True)),
    "profile": dict(profile=(None, "given")),
}


def _mine(pairs: dict) -> dict:
    mine = {k: v[hvd.rank()] if isinstance(v, tuple) else v for k, v in pairs.items()}
    if mine.get("scaler") == "scaler":
        mine["scaler"] = torch.amp.GradScaler("cpu")
    return mine


def _error(build, *args, **kwargs) -> object:
    """``build(*args, **kwargs)``'s RankMismatchError message, or None if it built."""
    try:
        build(*args, **kwargs)
    except RankMismatchError as err:
        return str(err)
    return None


def _optimizer(**kwargs):
    model = mlp(3)
    return dlgs.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        **kwargs,
    )


def _exchange(**kwargs):
    """The torch adapter's build_engine, with a planner built from ``kwargs``."""
    model = mlp(3)
    extra = kwargs.pop("extra_options", None)
    if kwargs.get("profile") == "given":
        kwargs["profile"] = _a_profile(model)
    return build_engine(
        list(model.named_parameters()),
        dlgs.SparsityConfig(),
        OnlinePlanner("dp", **kwargs),
        HorovodCollectives(),
        average=True,
        prefix="agree",
        extra_options=extra,
    )


def _a_profile(model) -> Profile:
    layers = tuple(LayerProfile(n, p.numel(), 1e-4) for n, p in model.named_parameters())
    cost = CostModel(1e-4, 1e-9)
    return Profile(2, layers, cost, cost, cost, cost)


@scenario
def resume_mismatch():
    """States loaded after training began are each rank's own:
    loads of the same step and of different steps (a stale file on one rank)
    both train on, with the step the ranks agreed kept on every rank. (At the
    start of a job, the agreement refuses a stale file:
    tests/test_resume.py.)"""
    out = {}
    model = mlp(4)
    opt = _optimizer_for(model)

    def step():
        opt.zero_grad()
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()

    def load_and_step(state):
        opt.load_state_dict(state)
        step()

    states = {}
    for s in range(4):
        step()
        states[s] = opt.state_dict()
    out["same_step"] = _error(load_and_step, states[3])
    out["other_step"] = _error(load_and_step, states[(3, 1)[hvd.rank()]])
    out["step"] = opt.dlgs.exchange.step
    out["params"] = [p.detach().sum().item() for p in model.parameters()]
    return out


def _optimizer_for(model):
    return dlgs.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        density=0.05,
        min_sparse_size=64,
        merge="none",
    )


@scenario
def option_mismatch():
    """Every option that shapes the exchange, different on the two ranks."""
    out = {}
    for case, pairs in OPTIMIZER_CASES.items():
        out[case] = _error(_optimizer, **_mine(pairs))
    # The compression form checks the same way.
    model = mlp(3)
    out["compression_form/bucket_elements"] = _error(
        dlgs.torch.Compression,
        model.named_parameters(),
        merge="buckets",
        bucket_elements=(1024, 2048)[hvd.rank()],
    )
    # One rank in the optimizer form, the other in the compression form.
    if hvd.rank() == 0:
        out["form"] = _error(_optimizer)
    else:
        out["form"] = _error(dlgs.torch.Compression, mlp(3).named_parameters())
    # Planner options and an adapter's extra option (a loss scale), through build_engine.
    for case, pairs in PLANNER_CASES.items():
        out[f"planner/{case}"] = _error(_exchange, **_mine(pairs))
    out["extra/loss_scale"] = _error(
        _exchange, extra_options={"loss_scale": (1024.0, 2048.0)[hvd.rank()]}
    )
    # Control: the same (non-default) options on both ranks build fine.
    out["control"] = _error(
        _optimizer,
        merge="buckets",
        gradient_predivide_factor=2.0,
        compression=hvd.Compression.fp16,
    )
    return out


def _dlgs_opt(model, form, process_set):
    opts = dict(density=0.05, min_sparse_size=64, profile_steps=2, drift_window=3)
    base = torch.optim.SGD(model.parameters(), lr=0.05)
    if form == "optimizer":
        return dlgs.torch.DistributedOptimizer(
            base, named_parameters=model.named_parameters(), process_set=process_set, **opts
        )
    comp = dlgs.torch.Compression(model.named_parameters(), process_set=process_set, **opts)
    return hvd.DistributedOptimizer(
        base, named_parameters=model.named_parameters(), compression=comp, process_set=process_set
    )


@scenario
def process_sets():
    """Sets [0] and [1]: each rank trains its own copy on its own set (profiling,
    planning, refining and drift checks included), then set [0] alone with rank
    1 outside it, then the global set: every step finishes, nothing is left
    pending."""
    sets = [hvd.add_process_set([0]), hvd.add_process_set([1])]
    out = {}
    for form in ("optimizer", "compression"):
        model = mlp(4)
        opt = _dlgs_opt(model, form, sets[hvd.rank()])
        digests = train(model, opt, 12)
        planner = opt.dlgs.planner if form == "optimizer" else None
        out[f"split/{form}"] = {
            "digests": digests,
            "finite": bool(torch.isfinite(flat_params(model)).all()),
            "plans_made": planner.plans_made if planner is not None else None,
        }
    # Set [0]: rank 1 is outside and trains on its own gradients (Horovod's rule).
    for form in ("optimizer", "compression"):
        model = mlp(4)
        opt = _dlgs_opt(model, form, sets[0])
        out[f"outside/{form}"] = {"digests": train(model, opt, 8)}
    # The global set afterwards: both ranks meet again and stay identical.
    for form in ("optimizer", "compression"):
        model = mlp(4)
        opt = _dlgs_opt(model, form, hvd.global_process_set)
        out[f"global/{form}"] = {"digests": train(model, opt, 8)}
    out["final"] = digest(model)
    # Form (a) with the optimizer on set [0] and the compressor on the global set:
    # rank 1 would never call compress(), so attach() refuses (found hanging by
    # tools/horovod_tests.py on Horovod's test_optimizer_process_sets).
    model = mlp(4)
    comp = dlgs.torch.Compression(model.named_parameters(), density=0.05, min_sparse_size=64)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        named_parameters=model.named_parameters(),
        compression=comp,
        process_set=sets[0],
    )
    try:
        comp.attach(opt)
        out["attach_other_set"] = None
    except ValueError as err:
        out["attach_other_set"] = str(err)
    return out


if __name__ == "__main__":
    main(sys.argv, hvd)
