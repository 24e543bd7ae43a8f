"""The per-job engine (``dlgs/core/engine.py``) with no framework: NumPy arrays,
ranks as threads (``tests/local_world.py``). What every adapter relies on:
back-propagation order, the agreement check, deferred state loading, the
logging cadence and the accessors."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
from local_world import OPS, LocalWorld

from dlgs.core import MergeConfig, RankMismatchError, SparseExchange, SparsityConfig
from dlgs.core.engine import Engine
from dlgs.core.planning.online import OnlinePlanner

# Registration (forward) order, as a framework lists parameters.
LAYERS = [("w1", (64, 64), "float32"), ("b1", (64,), "float32"), ("w2", (32, 64), "float32")]


def engine(comm, *, planner=None, log_every=0, **options):
    opts = dict(density=0.05, min_sparse_size=1024)
    opts.update(options)
    return Engine(
        OPS,
        comm,
        SparsityConfig(**opts),
        planner,
        average=True,
        prefix="t",
        log_every=log_every,
        logger=logging.getLogger("dlgs.test"),
    )


def grads(rank, step):
    g = np.random.default_rng(100 * step + rank)
    return {
        name: g.standard_normal(int(np.prod(shape))).astype(np.float32) for name, shape, _ in LAYERS
    }


def step(eng, rank, s):
    ex = eng.exchange
    g = grads(rank, s)
    for i, pos in enumerate(eng.order):
        ex.submit(i, g[LAYERS[pos][0]])
    out = ex.wait()
    eng.step_done()
    return {LAYERS[pos][0]: np.array(out[i]) for i, pos in enumerate(eng.order)}


def test_build_orders_layers_for_backpropagation():
    world = LocalWorld(2)

    def body(rank, comm):
        eng = engine(comm)
        assert not eng.built and eng.exchange is None and eng.last_step_finite
        assert eng.stats() == [] and eng.state_dict() == {}
        ex = eng.build(LAYERS)
        return [layer.name for layer in ex.layers], eng.order, eng.names

    for names, order, given in world.run(body):
        assert names == ["w2", "b1", "w1"]  # the last layer's gradient is ready first
        assert order == [2, 1, 0]
        assert given == ["w1", "b1", "w2"]


@pytest.mark.parametrize(
    "differ, key",
    [
        ({"density": 0.1}, "sparsity.density"),
        ({"planner": MergeConfig("buckets", bucket_elements=512)}, "planner.bucket_elements"),
        ({"layers": LAYERS[:2]}, "lacks parameters"),
    ],
)
def test_ranks_that_disagree_raise_the_same_error_on_every_rank(differ, key):
    """Every rank gathers every rank's fingerprint and judges the same list:
    all raise, none waits (the LocalWorld fails a collective that hangs)."""
    world = LocalWorld(2, timeout=5)

    def body(rank, comm):
        opts = dict(differ) if rank == 1 else {}
        layers = opts.pop("layers", LAYERS)
        merge = opts.pop("planner", MergeConfig("buckets"))
        eng = engine(comm, planner=OnlinePlanner.from_config(merge), **opts)
        with pytest.raises(RankMismatchError) as err:
            eng.build(layers)
        return str(err.value)

    messages = world.run(body)
    assert messages[0] == messages[1] and key in messages[0]


def test_every_planner_and_config_option_is_in_the_fingerprint():
    """An option added later to either config is checked without anyone
    listing it: the fingerprint holds every field of both."""
    world = LocalWorld(1)

    def body(rank, comm):
        return engine(comm, planner=OnlinePlanner.from_config(MergeConfig("dp"))).options()

    (options,) = world.run(body)
    from dataclasses import fields

    # Every option (init=False fields are the checks' own notes, not options).
    assert {f.name for f in fields(SparsityConfig) if f.init} <= set(options["sparsity"])
    assert {f.name for f in fields(MergeConfig) if f.name != "strategy"} <= set(options["planner"])
    assert options["exchange"]["loss_scaler"] is False


def test_state_loaded_before_the_build_is_applied_by_it_and_resumes_exactly():
    """TensorFlow restores a checkpoint before the first step builds the
    exchange: the engine keeps the state and applies it in build()."""
    world = LocalWorld(2)

    def body(rank, comm):
        a = engine(comm, momentum=0.9)
        a.build(LAYERS)
        for s in range(3):
            step(a, rank, s)
        # A state_dict holds the live buffers (as torch's optimizers do): copy it.
        saved = copy.deepcopy(a.state_dict())
        straight = [step(a, rank, s) for s in (3, 4)]
        b = engine(comm, momentum=0.9)
        b.load_state_dict(saved)
        assert b.state_dict() == saved  # kept, not applied yet
        b.build(LAYERS)
        assert b.exchange.step == 3
        resumed = [step(b, rank, s) for s in (3, 4)]
        return straight, resumed

    for straight, resumed in world.run(body):
        for x, y in zip(straight, resumed):
            for name in x:
                np.testing.assert_array_equal(x[name], y[name])


def test_log_every_logs_on_its_cadence(caplog):
    world = LocalWorld(1)

    def body(rank, comm):
        eng = engine(comm, log_every=2)
        eng.build(LAYERS)
        for s in range(4):
            step(eng, rank, s)
        return eng.stats()

    with caplog.at_level(logging.INFO, logger="dlgs.test"):
        (rows,) = world.run(body)
    steps = sorted({r.getMessage().split()[1] for r in caplog.records if r.levelno == logging.INFO})
    assert steps == ["2", "4"]
    assert {r["name"] for r in rows} == {"w1", "b1", "w2"}


def test_reprofile_restarts_the_planner():
    world = LocalWorld(1)

    def body(rank, comm):
        planner = OnlinePlanner.from_config(MergeConfig("buckets", profile_steps=1))
        eng = engine(comm, planner=planner)
        eng.build(LAYERS)
        for s in range(4):
            step(eng, rank, s)
        assert planner.profile is not None
        eng.reprofile()
        assert planner.profile is None

    world.run(body)


def test_each_step_hands_its_hooks_a_typed_record():
    """The planner's interface: a StepRecord per step, with layer times only
    for steps it asked to time (trace_next_step), and the modes in force."""
    world = LocalWorld(1)
    seen = []

    def hook(ex, record):
        seen.append(record)
        if record.step == 1:
            ex.trace_next_step()

    def body(rank, comm):
        eng = engine(comm)
        eng.build(LAYERS)
        eng.exchange.step_hooks.append(hook)
        for s in range(4):
            step(eng, rank, s)
        return eng.exchange

    (ex,) = world.run(body)
    assert [r.step for r in seen] == [0, 1, 2, 3] and ex.last_step is seen[-1]
    assert [r.trace is not None for r in seen] == [False, False, True, False]
    trace = seen[2].trace
    assert set(trace.arrive) == set(trace.done) == {0, 1, 2}
    assert all(trace.done[i] >= trace.arrive[i] for i in trace.arrive)
    assert trace.end is not None and trace.end >= 0
    assert seen[0].layers_sparse == (True, False, True)  # w2, b1, w1
    assert all(r.seconds is not None and r.seconds >= r.submit_seconds >= 0 for r in seen)


def test_a_dense_plan_applies_in_the_compression_form():
    """With dense_external (Horovod allreduces dense layers itself), a plan's
    dense group still sends its members dense, one by one: the caller gets
    their tensors back, with what their residuals owed."""
    world = LocalWorld(2)

    def body(rank, comm):
        ex = SparseExchange(
            OPS,
            comm,
            SparsityConfig(density=0.05, min_sparse_size=1024),
            [("a", 4096), ("b", 2048)],
            dense_external=True,
        )
        g = [np.ones(4096, np.float32), np.ones(2048, np.float32)]
        assert ex.submit(0, g[0]) is None and ex.submit(1, g[1]) is None  # sparse by the rule
        ex.wait()
        ex.set_plan([([0, 1], False)])
        sent = [ex.submit(i, g[i]) for i in range(2)]
        ex.wait(finish=False)
        ex.finish([(i, s) for i, s in enumerate(sent)])
        return [len(ex.groups), [layer.sparse for layer in ex.layers], sent]

    for groups, sparse, sent in world.run(body):
        assert groups == 2 and sparse == [False, False]
        # First step sent k of the ones; the rest was owed and is flushed now.
        for n, s in zip((4096, 2048), sent):
            assert s is not None and float(np.sum(s)) == 2 * n - np.ceil(0.05 * n)


def test_describe_answers_in_every_state_with_layer_names():
    world = LocalWorld(1)

    def body(rank, comm):
        planner = OnlinePlanner.from_config(MergeConfig("buckets", profile_steps=1, refine=False))
        eng = engine(comm, planner=planner)
        seen = {"unbuilt": eng.describe()}
        eng.build(LAYERS)
        seen["built"] = eng.describe()
        step(eng, rank, 0)
        seen["profiling"] = eng.describe()
        for s in range(1, 4):
            step(eng, rank, s)
        assert planner.plan is not None
        seen["planned"] = eng.describe()
        eng.reprofile()
        seen["reprofiling"] = eng.describe()
        none = engine(comm, planner=OnlinePlanner.from_config(MergeConfig("none")))
        none.build(LAYERS)
        step(none, rank, 0)
        seen["none"] = none.describe()
        half = engine(comm, dense_dtype="float16")
        half.build(LAYERS)
        step(half, rank, 0)
        seen["half"] = half.describe()
        return seen

    ((seen),) = world.run(body)
    assert "no step yet" in seen["unbuilt"]
    assert "layout made at the next gradient" in seen["built"]
    assert "profiling" in seen["profiling"] and "w1" in seen["profiling"]
    planned = seen["planned"]
    assert "strategy buckets" in planned and "first..last" in planned
    # The plan's table names its layers without being told them.
    table = planned.split("first..last")[1].split("layout in force")[0]
    assert "w2" in table or "w1" in table
    # Which cost model priced it: this job's own probes.
    assert "costs: fitted from this job's probes at 1 ranks" in planned
    assert "re-profiling" in seen["reprofiling"] and "layout in force" in seen["reprofiling"]
    assert "merge='none'" in seen["none"] and "sparse" in seen["none"]
    assert "dense messages in float16" in seen["half"]
    assert "dense messages in" not in seen["none"]


@pytest.mark.parametrize("caller", [None, 0, 1])
def test_reprofile_on_one_rank_reaches_every_rank_with_the_next_drift_vote(caller):
    """``.dlgs.reprofile()`` called on one rank only: the
    request travels in the next drift vote and every rank profiles again from
    the same step; never a hang (LocalWorld fails a collective one rank
    misses). Without a call nothing re-plans (drift is switched off)."""
    world = LocalWorld(2, timeout=5.0)

    def body(rank, comm):
        cfg = MergeConfig("buckets", profile_steps=1, drift_window=2, drift_tolerance=1e6)
        planner = OnlinePlanner.from_config(cfg)
        eng = engine(comm, planner=planner)
        eng.build(LAYERS)
        s = 0
        while not planner.settled:
            step(eng, rank, s)
            s += 1
            assert s < 40, "no plan"
        made = planner.plans_made
        if rank == caller:
            eng.reprofile()
        replanned_at = None
        for _ in range(16):
            step(eng, rank, s)
            s += 1
            if replanned_at is None and planner.plan is None:
                replanned_at = eng.exchange.step
        return made, planner.plans_made, replanned_at

    (made0, after0, at0), (made1, after1, at1) = world.run(body)
    assert made0 == made1
    if caller is None:
        assert after0 == after1 == made0 and at0 is None and at1 is None
    else:
        assert at0 == at1 is not None, (at0, at1)
        assert after0 == after1 > made0


def test_elastic_refuses_the_two_level_exchange_and_checks_at_the_agreement():
    """Under Horovod Elastic the core refuses the two-level exchange
    (its process sets belong to the world before a reset), and the ranks'
    layers and options are checked at the first gradient, not in build()."""
    with pytest.raises(ValueError, match="topology='hierarchical' does not survive"):
        Engine(
            OPS,
            None,
            SparsityConfig(),
            None,
            average=True,
            prefix="t",
            topology=lambda: (None, None),
            elastic=True,
        )
    world = LocalWorld(2)

    def body(rank, comm):
        cfg = SparsityConfig(density=0.05 if rank == 0 else 0.1, min_sparse_size=1024)
        eng = Engine(OPS, comm, cfg, None, average=True, prefix="t", elastic=True)
        eng.build(LAYERS)  # no collective here
        with pytest.raises(RankMismatchError, match="density"):
            step(eng, rank, 0)
        return True

    assert world.run(body) == [True, True]
