"""Steps that run with device operations alone (``SparseExchange.device`` and
``device.account``): what a step traced into a
TensorFlow graph runs. In-process ranks on NumPy: a device step
must equal a host step bit for bit, keep the old residuals when some rank was
non-finite, and say why a step cannot run on the device."""

from __future__ import annotations

import numpy as np
import pytest
from local_world import OPS, LocalWorld

from dlgs.core import SparseExchange, SparsityConfig

SIZES = [("w1", 4096), ("b1", 64), ("w2", 2048)]


def _grads(rank, step):
    rng = np.random.default_rng(1000 * step + rank)
    return [rng.standard_normal(n).astype(np.float32) for _, n in SIZES]


def _step(ex, grads, device):
    if device:
        ex.device.begin()
    for i in reversed(range(len(SIZES))):
        ex.submit(i, grads[i])
    if not device:
        out = ex.wait()
        return {i: np.array(v, copy=True) for i, v in out.items()}, ex.last_step_finite
    out = ex.wait(finish=False)
    ok = ex.device.finish()
    return {i: np.array(v, copy=True) for i, v in out.items()}, bool(ok)


@pytest.mark.parametrize("controller", ["topk", "fixed", "topk-momentum"])
def test_device_steps_equal_host_steps_and_are_counted(controller):
    fixed = {"threshold": 0.5} if controller == "fixed" else {}
    momentum = {"momentum": 0.9} if controller.endswith("momentum") else {}
    cfg = SparsityConfig(
        density=0.05,
        min_sparse_size=1024,
        controller=controller.split("-")[0],
        **fixed,
        **momentum,
    )

    def body(rank, comm):
        host = SparseExchange(OPS, comm, cfg, SIZES, prefix="host")
        dev = SparseExchange(OPS, comm, cfg, SIZES, prefix="dev")
        dev.device.keep_buffers()
        seen = []
        for s in range(6):
            a = _step(host, _grads(rank, s), device=False)
            # The first step lays out and verifies: on the host; then on the device.
            why = dev.device.ready()
            b = _step(dev, _grads(rank, s), device=why is None)
            assert (why is None) == (s > 0), why
            seen.append(why)
            for i in a[0]:
                np.testing.assert_array_equal(a[0][i], b[0][i])
            for i, layer in enumerate(host.layers):
                if layer.residual is not None:
                    np.testing.assert_array_equal(layer.residual, dev.layers[i].residual)
                if momentum:  # every layer's velocity, the dense one's too
                    np.testing.assert_array_equal(layer.velocity, dev.layers[i].velocity)
        dev.device.account(5)
        assert dev.step == host.step == 6
        return seen

    LocalWorld(2).run(body)


def test_a_non_finite_device_step_keeps_the_old_residuals_on_every_rank():
    cfg = SparsityConfig(density=0.05, min_sparse_size=1024, controller="topk")

    def body(rank, comm):
        ex = SparseExchange(OPS, comm, cfg, SIZES)
        ex.device.keep_buffers()
        _step(ex, _grads(rank, 0), device=False)
        before = {
            i: np.array(la.residual, copy=True)
            for i, la in enumerate(ex.layers)
            if la.residual is not None
        }
        grads = _grads(rank, 1)
        if rank == 1:
            grads[0][7] = np.nan
        out, ok = _step(ex, grads, device=True)
        assert not ok and np.isnan(out[0]).any()
        for i, r in before.items():
            np.testing.assert_array_equal(ex.layers[i].residual, r)
        ex.device.account(1, nonfinite=1, last_finite=False)
        return ex.step, ex.last_step_finite

    for step, finite in LocalWorld(2).run(body):
        assert step == 2 and not finite


def test_what_keeps_a_step_on_the_host_is_named():
    dyn = SparsityConfig(density=0.05, min_sparse_size=1024)  # the dynamic controller

    def body(rank, comm):
        ex = SparseExchange(OPS, comm, dyn, SIZES)
        reasons = [ex.device.ready()]
        _step(ex, _grads(rank, 0), device=False)
        reasons.append(ex.device.ready())
        ex.device.prepare()  # the dynamic controller's state to the device
        dynamic = ex.device.ready()
        top = SparseExchange(
            OPS,
            comm,
            SparsityConfig(density=0.05, min_sparse_size=1024, controller="topk"),
            SIZES,
            prefix="t",
        )
        _step(top, _grads(rank, 0), device=False)
        calls = []
        top.listeners.append(lambda: calls.append(1))
        top.set_plan([([0, 2], None)])
        reasons.append(top.device.ready())
        _step(top, _grads(rank, 1), device=False)  # lays out and verifies the new plan
        reasons.append(top.device.ready())
        top.trace_next_step()
        reasons.append(top.device.ready())
        every = SparseExchange(
            OPS,
            comm,
            SparsityConfig(density=0.05, min_sparse_size=1024, anchor_every=1),
            SIZES,
            prefix="e",
        )
        _step(every, _grads(rank, 0), device=False)
        every.device.prepare()
        reasons.append(every.device.ready())
        return reasons, len(calls), dynamic

    for reasons, calls, dynamic in LocalWorld(2).run(body):
        assert "laid out anew" in reasons[0]  # before the first step
        assert "not on the device" in reasons[1] and dynamic is None
        assert "laid out anew" in reasons[2] and reasons[3] is None and "timed" in reasons[4]
        assert calls == 2  # set_plan and trace_next_step told the listener
        assert "anchors" in reasons[5]


def test_the_dynamic_controller_learns_on_the_device_as_on_the_host():
    """The default controller on device steps: its factor moves every step on
    the device (the same float64 update, here NumPy's on both sides), anchors
    stay on host steps (the budget says when), a non-finite step changes
    nothing, and after the steps are counted back the host's state equals a
    run of host steps bit for bit."""
    cfg = SparsityConfig(density=0.05, min_sparse_size=1024, anchor_every=4)

    def grads(rank, s):
        g = _grads(rank, s)
        if s == 6 and rank == 1:
            g[0][3] = np.inf
        return g

    def body(rank, comm):
        host = SparseExchange(OPS, comm, cfg, SIZES, prefix="host")
        dev = SparseExchange(OPS, comm, cfg, SIZES, prefix="dev")
        dev.device.keep_buffers()
        kinds, budget, pending, bad = [], 0, 0, 0
        for s in range(14):
            a = _step(host, grads(rank, s), device=False)
            if budget != 0 and dev.device.ready() is None:
                b = _step(dev, grads(rank, s), device=True)
                budget -= 1
                pending += 1
                bad += not b[1]
                kinds.append("d")
            else:
                dev.device.account(pending, bad)
                pending = bad = 0
                b = _step(dev, grads(rank, s), device=False)
                dev.device.prepare()
                budget = dev.device.budget()
                kinds.append("h")
            assert a[1] == b[1] == (s != 6)
            for i in a[0]:
                np.testing.assert_array_equal(a[0][i], b[0][i])
        dev.device.account(pending, bad)
        for x, y in zip(host.layers, dev.layers):
            assert x.controller_state == y.controller_state, x.name
        assert host.nonfinite_steps == dev.nonfinite_steps == 1
        return "".join(kinds), dev.step

    for kinds, step in LocalWorld(2).run(body):
        # Anchors every 4 steps on the host (the first step anchors too); the
        # non-finite step 6 did not count, so step 8 is a host step that does
        # not anchor and step 9 anchors.
        assert kinds == "hdddhdddhhdddh", kinds
        assert step == 14


def test_the_non_finite_check_passes_over_empty_tensors():
    """A parameter with no elements has nothing non-finite (torch's max-norm
    of an empty tensor is an error, so it is left out of the check)."""
    import math

    import torch

    from dlgs.torch._ops import OPS

    empty = torch.zeros(0, 5)
    assert not bool(OPS.any_nonfinite([empty]))
    assert not bool(OPS.any_nonfinite([empty, torch.ones(3)]))
    assert bool(OPS.any_nonfinite([empty, torch.tensor([1.0, math.inf])]))
