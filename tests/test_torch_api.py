"""The PyTorch adapter in one process (real Horovod, size 1): API surface,
errors for bad input, statistics, and the selection path on one layer."""

from __future__ import annotations

import logging

import horovod.torch as hvd
import pytest
import torch
from conftest import bind_horovod

import dlgs
import dlgs.torch
from dlgs.core import SparsityConfig, make_controller, select
from dlgs.torch._ops import OPS


@pytest.fixture(scope="module", autouse=True)
def horovod():
    bind_horovod(hvd)
    hvd.init()
    yield


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def wrap(m, **kw):
    return dlgs.torch.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(), **kw
    )


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(density=0.0), ValueError, ["density", "(0, 1]"]),
        (dict(density=1.01), ValueError, ["density", "(0, 1]"]),
        (dict(density="0.01"), TypeError, ["density"]),
        (dict(controller="bogus"), ValueError, ["controller", "'dynamic'"]),
        (dict(max_ratio=20), ValueError, ["max_ratio", "[1.0, 16.0]"]),
        (dict(no_such_option=1), TypeError, ["no_such_option"]),
        (dict(op=hvd.Adasum), ValueError, ["op"]),
        (dict(groups=2), ValueError, ["groups"]),
        (dict(backward_passes_per_step=0), ValueError, ["backward_passes_per_step", ">= 1"]),
        (dict(log_every=-1), ValueError, ["log_every"]),
        (dict(merge="fastest"), ValueError, ["merge", "'dp'"]),
        (dict(max_group=0), ValueError, ["max_group", ">= 1"]),
        (dict(profile_steps=0), ValueError, ["profile_steps", ">= 1"]),
        (dict(drift_tolerance=0), ValueError, ["drift_tolerance"]),
        (dict(config=SparsityConfig(), density=0.5, controller="topk"), ValueError, ["config="]),
    ],
)
def test_bad_options_raise_naming_the_parameter(kwargs, exc, words):
    with pytest.raises(exc) as info:
        wrap(model(), **kwargs)
    for w in words:
        assert w in str(info.value)


def test_bad_named_parameters():
    m = model()
    named = list(m.named_parameters())
    with pytest.raises(ValueError, match="unique"):
        dlgs.torch.Compression([named[0], (named[0][0], named[1][1])])
    with pytest.raises(ValueError, match="tuples"):
        dlgs.torch.Compression([p for _, p in named])
    with pytest.raises(ValueError, match="named_parameters is required"):
        dlgs.torch.Compression(None)
    # Horovod's own check: a parameter of the optimizer without a name.
    with pytest.raises(ValueError, match="not named"):
        dlgs.torch.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=named[:1]
        )
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        dlgs.torch.DistributedOptimizer(m, named_parameters=named)


def test_compression_rejects_foreign_tensor():
    m = model()
    comp = dlgs.torch.Compression(m.named_parameters(), min_sparse_size=1)
    with pytest.raises(ValueError, match="not the .grad"):
        comp.compress(torch.zeros(3))


def test_generated_class_mirrors_horovod():
    m = model()
    opt = wrap(m, density=0.1, min_sparse_size=100)
    assert isinstance(opt, torch.optim.SGD)
    assert type(opt).__name__ == "SGD"
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(8, 64)).sum().backward()
        opt.step()
    rows = opt.dlgs.stats()
    sparse = [r for r in rows if r["sparse"]]
    assert {r["name"] for r in sparse} == {"0.weight", "2.weight"}
    ex = opt.dlgs.exchange
    params = dict(m.named_parameters())
    for r in sparse:
        # Checked against what really happened, not the code's own formulas:
        # one rank, so the reduced gradient holds exactly the values it sent,
        # and the message is the buffer handed to the allgather.
        assert r["sent"] == int(torch.count_nonzero(params[r["name"]].grad))
        assert 0 < r["sent"] <= r["capacity"] and r["sent"] <= r["selected"]
        chunk = ex.groups[ex.layers[ex.index(r["name"])].message].chunk
        assert r["message_bytes"] == chunk.numel() * chunk.element_size()
        assert r["wire_bytes"] == r["message_bytes"] - 4  # alone: the message's fingerprint word
        assert r["threshold"] > 0
    real = sum(
        g.chunk.numel() * 4 if g.sparse else 4 * sum(ex.layers[i].numel for i in g.members)
        for g in ex.groups
    )
    assert ex.wire_bytes() == real
    assert "dlgs" in opt.state_dict()
    assert not hasattr(opt, "dlgs_stats")  # the dlgs 0.1 names are gone


def test_log_every_logs_per_layer_statistics(caplog):
    m = model()
    opt = wrap(m, density=0.1, min_sparse_size=16, log_every=2)
    with caplog.at_level(logging.INFO, logger="dlgs.torch"):
        for _ in range(2):
            opt.zero_grad()
            m(torch.randn(8, 64)).sum().backward()
            opt.step()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("dlgs.torch")]
    assert any("0.weight" in line and "threshold" in line for line in lines), lines


@pytest.mark.parametrize("controller", ["dynamic", "topk", "dgc"])
def test_select_matches_a_slow_reference(controller):
    """The fast path's selection equals the obvious mask over |a| >= theta."""
    torch.manual_seed(1)
    n, d = 100_000, 0.01
    cfg = SparsityConfig(density=d, controller=controller)
    ctrl = make_controller(cfg)
    x = torch.randn(n) * torch.rand(n) ** 4  # heavier tail than a Gaussian
    state = ctrl.init_state(OPS, x, d)
    k = int(n * d)
    scratch, mask = torch.empty(n), torch.empty(n, dtype=torch.bool)
    for step in range(3):
        idx, count, theta = select(OPS, ctrl, state, x, k, 2 * k, step, scratch, mask)
        expect = torch.nonzero(x.abs() >= theta).view(-1)
        assert int(count) == expect.numel()
        got = idx[idx < n]
        assert torch.equal(got, expect[: 2 * k])
        assert (idx[got.numel() :] == n).all()
    if controller == "topk":
        assert int(count) == k


def test_package_exports():
    assert dlgs.SparsityConfig is SparsityConfig
    assert set(dlgs.torch.__all__) == {"Compression", "DistributedOptimizer", "ddp"}
    assert dlgs.torch.ddp.sparse_hook is not None  # imported on first use


@pytest.mark.parametrize("base", ["sgd", "adam"])
def test_horovod_broadcast_helpers_work(base):
    m = model()
    inner = (
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        if base == "sgd"
        else torch.optim.Adam(m.parameters())
    )
    opt = dlgs.torch.DistributedOptimizer(
        inner, named_parameters=m.named_parameters(), density=0.1, min_sparse_size=100
    )
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.dlgs.exchange.step == 0  # the state initialisation sent nothing
    opt.zero_grad()
    m(torch.randn(8, 64)).sum().backward()
    opt.step()
    assert opt.dlgs.exchange.step == 1


def test_compression_form_exposes_the_planner_like_the_optimizer():
    model = torch.nn.Linear(64, 32)
    comp = dlgs.torch.Compression(model.named_parameters(), merge="buckets", bucket_elements=512)
    assert comp.dlgs.planner.strategy == "buckets" and comp.dlgs.planner.bucket_elements == 512
    assert comp.dlgs.planner.config == dlgs.MergeConfig("buckets", bucket_elements=512)
    comp.dlgs.reprofile()  # between steps: profiles again from the next step


def test_compression_attach_wants_an_optimizer():
    comp = dlgs.torch.Compression(model().named_parameters(), density=0.1)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        comp.attach(comp)


def test_the_torch_backend_runs_the_engine_without_horovod():
    """dlgs.torch._ops and the core need torch only (a GPU self-check, another
    adapter): with Horovod unimportable, an exchange on the torch backend runs a
    step and reconstructs a k-sparse gradient exactly; the Horovod forms fail
    only when asked for."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys
        sys.modules["horovod"] = None  # any import of Horovod now fails
        import torch
        import dlgs.torch
        from dlgs.core import SparseExchange, SparsityConfig
        from dlgs.torch._ops import OPS

        class One:
            size, rank, included = 1, 0, True
            def allgather_async(self, chunk, name): return chunk.clone()
            def allreduce_async(self, tensor, name): return tensor
            def synchronize(self, handle): return handle
            def broadcast_object(self, obj): return obj
            def allgather_object(self, obj, name): return [obj]

        cfg = SparsityConfig(density=0.01, min_sparse_size=100, controller="topk")
        ex = SparseExchange(OPS, One(), cfg, [("w", 5000)])
        g = torch.zeros(5000)
        g[torch.randperm(5000, generator=torch.Generator().manual_seed(0))[:50]] = 1.5
        ex.submit(0, g)
        out = ex.wait()[0]
        assert ex.layers[0].sparse and torch.equal(out, g), "not exact"
        try:
            dlgs.torch.DistributedOptimizer
        except ImportError:
            print("forms need horovod")
        assert "horovod.torch" not in sys.modules or sys.modules["horovod.torch"] is None
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["forms", "need", "horovod", "ok"]
