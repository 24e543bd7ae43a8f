"""Loading a dlgs checkpoint that does not match.

One process, real Horovod at size 1 (the exchange, its controllers and the
planner run as on many ranks; rank-local residuals make the state per rank).
Every mismatch either raises an error naming the parameter and both values,
with nothing changed, or is a documented reset that logs a warning.
"""

from __future__ import annotations

import copy
import logging

import horovod.torch as hvd
import pytest
import torch
import torch.nn.functional as F
from conftest import bind_horovod

import dlgs.torch
from dlgs.core.exchange.exchange import SparseExchange
from dlgs.core.planning.layout import split_oversized
from dlgs.core.transport.flat import MAX_MESSAGE_ELEMENTS
from dlgs.core.wire import LayerPlan


@pytest.fixture(scope="module", autouse=True)
def horovod():
    bind_horovod(hvd)
    hvd.init()


def mlp(hidden: int = 64, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)
    )


def trained(model, steps: int = 4, **options):
    opts = dict(density=0.05, min_sparse_size=64, merge="none")
    opts.update(options)
    opt = dlgs.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        **opts,
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return opt


def step(model, opt):
    opt.zero_grad()
    F.cross_entropy(model(torch.randn(16, 32)), torch.randint(0, 10, (16,))).backward()
    opt.step()


def test_other_shapes_fail_naming_the_parameter_and_change_nothing():
    saved = trained(mlp(64)).state_dict()
    model = mlp(32)
    opt = trained(model, steps=2)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(saved)
    msg = str(info.value)
    assert "'2.weight'" in msg or "'0.weight'" in msg, msg
    assert "elements" in msg and "32" in msg, msg
    after = opt.state_dict()
    assert after["dlgs"]["step"] == before["dlgs"]["step"] == 2
    assert after["dlgs"]["plan"] == before["dlgs"]["plan"]
    # The wrapped optimizer's own state was not loaded either (checked first).
    for key, st in before["state"].items():
        assert torch.equal(st["momentum_buffer"], after["state"][key]["momentum_buffer"])
    step(model, opt)  # still usable


@pytest.mark.parametrize(
    "saved_opts, new_opts, word",
    [
        (dict(), dict(controller="topk"), "controller"),
        (dict(controller="topk"), dict(), "controller"),
        (dict(controller="fixed", threshold=0.5), dict(controller="dgc"), "controller"),
        (
            dict(controller="fixed", threshold=0.5),
            dict(controller="fixed", threshold=2.0),
            "threshold",
        ),
        (dict(density=0.05), dict(density=0.1), "density"),
    ],
)
def test_changed_thresholding_restarts_with_a_warning(saved_opts, new_opts, word, caplog):
    saved = trained(mlp(), **saved_opts).state_dict()
    model = mlp()
    opt = trained(model, steps=1, **new_opts)
    with caplog.at_level(logging.WARNING, logger="dlgs"):
        opt.load_state_dict(saved)
    assert any(word in r.getMessage() and "afresh" in r.getMessage() for r in caplog.records)
    ex = opt.dlgs.exchange
    if new_opts.get("controller") == "fixed":
        for layer in ex.layers:
            if layer.sparse:
                assert float(layer.controller_state["theta"]) == new_opts["threshold"]
    for _ in range(3):  # trains on (no KeyError from a foreign controller state)
        step(model, opt)
    assert ex.step == saved["dlgs"]["step"] + 3
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_state_of_another_world_size_resets_residuals(caplog):
    state = trained(mlp()).state_dict()
    state["dlgs"]["size"] = 4
    model = mlp()
    opt = trained(model, steps=1)
    with caplog.at_level(logging.WARNING, logger="dlgs"):
        opt.load_state_dict(state)
    assert any("residuals reset" in r.getMessage() for r in caplog.records)
    ex = opt.dlgs.exchange
    assert all(float(layer.residual.abs().sum()) == 0 for layer in ex.layers if layer.sparse)


def test_profile_of_another_world_size_is_measured_again(caplog):
    model = mlp()
    opt = trained(model, steps=12, merge="dp", profile_steps=2)
    state = opt.state_dict()
    hooks = state["dlgs"]["hooks"]
    (key,) = [k for k, v in hooks.items() if v.get("profile")]
    hooks[key]["profile"]["world_size"] = 4
    with caplog.at_level(logging.WARNING, logger="dlgs"):
        opt.load_state_dict(state)
    assert any("measured with 4 workers" in r.getMessage() for r in caplog.records)
    assert opt.dlgs.planner.profile is None
    for _ in range(8):
        step(model, opt)
    assert opt.dlgs.planner.profile is not None and opt.dlgs.planner.profile.world_size == 1


def test_every_parameter_frozen_loads():
    model = mlp()
    for p in model.parameters():
        p.requires_grad_(False)
    opt = dlgs.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters()
    )
    opt.load_state_dict(opt.state_dict())


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda s: s.update(step=-1), ["step", ">= 0"]),
        (lambda s: s.update(step="3"), ["step"]),
        (lambda s: s.update(plan=[([0, 99], True)]), ["plan"]),
        (lambda s: s.update(version=99), ["version"]),
        (lambda s: s.pop("layers"), ["layers"]),
    ],
)
def test_malformed_state_fails_and_changes_nothing(edit, words):
    model = mlp()
    opt = trained(model, steps=2)
    state = opt.state_dict()
    edit(state["dlgs"])
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(state)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert opt.dlgs.exchange.step == 2


# -- int32 indices --------------------------------------------------------------


class _Comm:
    size, rank = 1, 0


def test_layer_beyond_int32_indexing_is_refused_at_construction():
    with pytest.raises(ValueError) as info:
        SparseExchange(
            None, _Comm(), dlgs.SparsityConfig(), [("small", 10), ("huge", MAX_MESSAGE_ELEMENTS)]
        )
    assert "'huge'" in str(info.value) and "int32" in str(info.value)


def test_merged_groups_beyond_int32_are_split_in_order():
    n = 2**29
    plans = [LayerPlan(n, 10, 10, True) for _ in range(5)] + [LayerPlan(100, 1, 1, False)]
    groups = split_oversized([(list(range(5)), True), ([5], False)], plans)
    assert groups == [([0, 1, 2], True), ([3, 4], True), ([5], False)]
    for members, _ in groups:
        assert sum(plans[i].numel + 1 for i in members) <= MAX_MESSAGE_ELEMENTS
