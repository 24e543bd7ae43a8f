"""Emulated compute (``benchmarks/emulate.py``): durations, hook order, gradients."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from torch import nn

from benchmarks.emulate import (
    EmulatedNet,
    Emulation,
    emulation_from,
    fit_tail,
    measure_layers,
    student_t,
)
from dlgs.catalog import catalog_model
from dlgs.core.planning.dp import CostModel
from dlgs.core.planning.profile import LayerProfile, Profile


def _emulation(backward=(0.004, 0.002, 0.006), numel=(300, 2000, 50)):
    layers = tuple(
        LayerProfile(f"l{i}.weight", n, b) for i, (n, b) in enumerate(zip(numel, backward))
    )
    return Emulation("toy", "test", layers, 8, 1.0)


def test_catalog_source_follows_the_compute_model_and_the_speed():
    slow = emulation_from("catalog:resnet50", flops=10e12)
    fast = emulation_from("catalog:resnet50", flops=10e12, speed=4.0)
    spec = catalog_model("resnet50")
    assert [x.name for x in slow.layers] == [x.name for x in spec.layers]
    assert slow.batch == spec.batch == 32
    # 2 x (2 x macs x batch) / flops per layer; 4x faster device, a quarter of it.
    expect = 4 * spec.macs * 32 / 10e12
    assert slow.backward == pytest.approx(expect)
    assert fast.backward == pytest.approx(expect / 4)
    assert slow.forward == pytest.approx(slow.backward / 2)
    assert "emulated compute" in fast.label and "/ 4" in fast.label
    assert Emulation.from_dict(json.loads(json.dumps(fast.to_dict()))) == fast


def test_profile_and_measured_sources(tmp_path):
    layers = (LayerProfile("b", 10, 0.02), LayerProfile("a", 30, 0.01))
    flat = CostModel(1e-4, 1e-9)
    prof = Profile(2, layers, flat, flat, flat, flat)
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(prof.to_dict()))
    got = emulation_from(str(path), speed=2.0)
    assert got.name == "gpu" and [x.backward for x in got.layers] == [0.01, 0.005]
    measured = emulation_from("measured", measure=lambda: ("m", 4, layers))
    assert measured.layers == layers and measured.batch == 4


@pytest.mark.parametrize(
    "source, kwargs, word",
    [
        ("catalog:alexnet", {}, "catalog:MODEL"),
        ("no/such/file.json", {}, "--emulate"),
        ("measured", {}, "--emulate measured"),
        ("catalog:vgg16", {"speed": 0.0}, "--emulate-speed"),
        ("catalog:vgg16", {"speed": math.inf}, "--emulate-speed"),
    ],
)
def test_bad_sources_name_the_option(source, kwargs, word):
    with pytest.raises(ValueError, match=word):
        emulation_from(source, **kwargs)


def test_backward_hands_out_gradients_in_ready_order_no_earlier_than_their_time():
    emu = _emulation()
    net = EmulatedNet(emu, rank=0)
    # Forward order is the reverse of the gradient-ready order.
    assert [n for n, _ in net.named_parameters()] == ["l2.weight", "l1.weight", "l0.weight"]
    ready = []
    for name, p in net.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: ready.append((name, time.perf_counter()))
        )
    for _ in range(2):
        for p in net.parameters():
            p.grad = None
        ready.clear()
        loss = net(torch.zeros(()))
        t0 = time.perf_counter()
        loss.backward()
        assert [n for n, _ in ready] == ["l0.weight", "l1.weight", "l2.weight"]
        # Waits only ever end late: each gradient is ready no earlier than the
        # cumulative emulated backward time.
        due = 0.0
        for (name, t), layer in zip(ready, emu.layers):
            due += layer.backward
            assert t - t0 >= due - 1e-4, (name, t - t0, due)
        # The gradient is the step's draw (two draws, in turn), copied.
        for i, p in enumerate(net.parameters()):
            assert torch.equal(p.grad, net.draws[i][net.step % 2])
            assert p.grad.data_ptr() != net.draws[i][net.step % 2].data_ptr()
    assert not torch.equal(net.draws[0][0], net.draws[0][1])


def test_gradients_differ_by_rank_and_are_shared_between_nets():
    emu = _emulation(backward=(0.0, 0.0, 0.0))
    a, b = EmulatedNet(emu, rank=0), EmulatedNet(emu, rank=1)
    assert all(not torch.equal(x[0], y[0]) for x, y in zip(a.draws, b.draws))
    again = EmulatedNet(emu, rank=0)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a.draws, again.draws))
    shared = EmulatedNet(emu, rank=0, draws=a.draws)
    assert shared.draws is a.draws


def test_student_t_draws_have_the_distribution_s_tail():
    g = torch.Generator().manual_seed(0)
    x = student_t(400_000, 4, g)
    # P(|T| > 4.604) = 0.01 for 4 degrees of freedom; P(|T| > 2.776) = 0.05.
    assert (x.abs() > 4.604).float().mean().item() == pytest.approx(0.01, rel=0.1)
    assert (x.abs() > 2.776).float().mean().item() == pytest.approx(0.05, rel=0.05)
    before = torch.get_rng_state()
    again = student_t(1000, 4, torch.Generator().manual_seed(1))
    assert torch.equal(again, student_t(1000, 4, torch.Generator().manual_seed(1)))
    assert torch.equal(torch.get_rng_state(), before)  # the global generator is untouched
    with pytest.raises(ValueError, match="df"):
        student_t(10, 0, g)


def test_measure_layers_times_every_parameter_in_ready_order():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    data = (torch.randn(5, 8), torch.randint(0, 4, (5,)))
    layers = measure_layers(model, data, nn.functional.cross_entropy, steps=2)
    assert sorted(x.name for x in layers) == sorted(n for n, _ in model.named_parameters())
    # The last layer's gradients are ready first.
    assert {x.name for x in layers[:2]} == {"2.weight", "2.bias"}
    assert all(x.backward >= 0 for x in layers)
    assert {x.name: x.numel for x in layers}["0.weight"] == 128


def test_fitted_tails_are_the_ones_the_benchmark_uses():
    from benchmarks.emulate import FAMILY, FITTED_DF

    dfs = (2, 3, 4, 8, 12, 30)
    best, ratios, by_df = fit_tail(dfs=dfs, models=("resnet20", "lstm"))
    assert set(ratios) == {"resnet20", "lstm"} and all(len(r) > 0 for r in ratios.values())
    # Heavier tails (fewer degrees of freedom) put the top 1% further out.
    assert [by_df[d] for d in dfs] == sorted(by_df.values(), reverse=True)
    assert best["resnet20"] == FITTED_DF["resnet20"] and best["lstm"] == FITTED_DF["lstm"]
    assert emulation_from("catalog:resnet50").df == FITTED_DF[FAMILY["resnet50"]]
