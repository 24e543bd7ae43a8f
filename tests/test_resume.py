"""Resuming without a collective in the checkpoint methods, on the
core with ranks as threads (``tests/local_world.py``): Horovod's recipe loads on
rank 0 only, and the ranks agree at the next gradient instead. The same recipe
on real ranks, both torch forms and TensorFlow: ``tests/test_recipes.py``."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
from local_world import OPS, LocalWorld

from dlgs.core import RankMismatchError, SparseExchange, SparsityConfig
from dlgs.core.state.resume import SyncRecord, resolve, shared

SIZES = [("w1", 4096), ("b1", 64), ("w2", 2048), ("b2", 10)]  # backward order
SPARSE = (0, 2)


def exchange(comm, **options):
    opts = dict(density=0.05, min_sparse_size=1024)
    opts.update(options)
    return SparseExchange(OPS, comm, SparsityConfig(**opts), SIZES)


def gaussian(rank, step):
    g = np.random.default_rng(1000 * step + rank)
    return [g.standard_normal(n).astype(np.float32) for _, n in SIZES]


def step(ex, grads):
    for i, g in enumerate(grads):
        ex.submit(i, g)
    return {i: np.array(v) for i, v in ex.wait().items()}


class Counting:
    """A rank's collectives, counting every call (to show that a method issues none)."""

    def __init__(self, comm):
        self._comm = comm
        self.calls = []

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if callable(attr):

            def counted(*args, **kwargs):
                self.calls.append(name)
                return attr(*args, **kwargs)

            return counted
        return attr


# -- the verdict (pure) ---------------------------------------------------------------


def _part(step_, plan=None):
    return {"step": step_, "plan": plan, "hooks": {}, "auto_density": None, "auto_layers": None}


def test_equal_states_need_nothing_whoever_loaded():
    assert resolve([SyncRecord(True, _part(4)), SyncRecord(True, _part(4))]) == (None, [])
    assert resolve([SyncRecord(False, _part(0))] * 3) == (None, [])


def test_ranks_that_did_not_load_take_the_lowest_loading_ranks_state():
    recs = [SyncRecord(False, _part(0)), SyncRecord(True, _part(7)), SyncRecord(False, _part(0))]
    assert resolve(recs) == (1, [0, 2])


def test_loading_ranks_that_disagree_or_unexplained_differences_are_errors():
    with pytest.raises(RankMismatchError, match="step 2 on rank 1 but 4 on rank 0"):
        resolve([SyncRecord(True, _part(4)), SyncRecord(True, _part(2))])
    plan = [([0, 2], True)]
    with pytest.raises(RankMismatchError, match="plan .* on rank 1"):
        resolve([SyncRecord(True, _part(4)), SyncRecord(True, _part(4, plan))])
    with pytest.raises(RankMismatchError, match="without a checkpoint loaded"):
        resolve([SyncRecord(False, _part(4)), SyncRecord(False, _part(5))])


# -- on ranks ---------------------------------------------------------------------------


def _trained_state(rank, comm, steps=3):
    """A checkpoint of an exchange trained ``steps`` steps with two sparse
    layers merged (a plan every rank must share), and its last outputs."""
    ex = exchange(comm)
    ex.set_plan([([0, 2], None)])
    for s in range(steps):
        step(ex, gaussian(rank, s))
    return copy.deepcopy(ex.state_dict())


def test_rank_zero_loads_alone_and_every_rank_agrees_at_the_next_gradient(caplog):
    """Horovod's recipe: only rank 0 loads. load_state_dict and state_dict
    issue no collective (on one rank alone they return at once); at the next
    step rank 1 takes rank 0's step and plan, keeps empty residuals, and both
    ranks reduce the same gradients; one warning says so."""
    world = LocalWorld(2, timeout=2.0)

    def body(rank, comm):
        state = _trained_state(rank, comm)
        counting = Counting(comm)
        ex = exchange(counting)
        if rank == 0:
            ex.load_state_dict(state, like=None)
            ex.state_dict()
        loaded_calls = list(counting.calls)
        outs = [step(ex, gaussian(rank, s)) for s in range(3, 6)]
        merged = [g.members for g in ex.groups if len(g.members) > 1]
        residuals = {i: np.array(ex.layers[i].residual) for i in SPARSE}
        return loaded_calls, outs, ex.step, merged, residuals, state

    with caplog.at_level(logging.WARNING, logger="dlgs"):
        (calls0, outs0, step0, merged0, _, _), (calls1, outs1, step1, merged1, _, _) = world.run(
            body
        )
    assert calls0 == [] and calls1 == []
    assert step0 == step1 == 6
    assert merged0 == merged1 == [[0, 2]], "rank 1 did not take rank 0's plan"
    for s, (a, b) in enumerate(zip(outs0, outs1)):
        for i in a:
            assert np.array_equal(a[i], b[i]), f"step {s}, layer {i}: ranks differ"
    msgs = [r.getMessage() for r in caplog.records if "did not load" in r.getMessage()]
    assert len(msgs) == 1 and "rank 0 resumed from a checkpoint of step 3" in msgs[0], msgs


def test_the_loading_rank_keeps_its_residuals_and_the_others_start_empty():
    """Negative control included: rank 0's restored residual is its saved one,
    rank 1's is zero before the first step after the agreement."""

    def body(rank, comm):
        state = _trained_state(rank, comm)
        ex = exchange(comm)
        if rank == 0:
            ex.load_state_dict(state, like=None)
        before = {
            i: None if ex.layers[i].residual is None else np.array(ex.layers[i].residual)
            for i in SPARSE
        }
        saved = {i: np.asarray(state["layers"][SIZES[i][0]]["residual"]) for i in SPARSE}
        step(ex, gaussian(rank, 3))
        return before, saved

    (before0, saved0), (before1, _) = LocalWorld(2, timeout=2.0).run(body)
    for i in SPARSE:
        assert np.array_equal(before0[i], saved0[i])
        assert np.abs(saved0[i]).max() > 0
        assert before1[i] is None, "rank 1 holds a residual it never had"


def test_every_rank_loading_its_own_file_resumes_exactly_with_no_warning(caplog):
    """The other recipe: each rank loads its own state of the same step; the
    agreement finds nothing to do and the run goes on as if uninterrupted."""

    def body(rank, comm):
        ex = exchange(comm)
        ex.set_plan([([0, 2], None)])
        for s in range(3):
            step(ex, gaussian(rank, s))
        state = copy.deepcopy(ex.state_dict())
        straight = [step(ex, gaussian(rank, s)) for s in range(3, 5)]
        fresh = exchange(comm)
        fresh.load_state_dict(state, like=None)
        resumed = [step(fresh, gaussian(rank, s)) for s in range(3, 5)]
        return straight, resumed

    with caplog.at_level(logging.WARNING, logger="dlgs"):
        results = LocalWorld(2).run(body)
    for straight, resumed in results:
        for a, b in zip(straight, resumed):
            for i in a:
                assert np.array_equal(a[i], b[i])
    assert not [r for r in caplog.records if "did not load" in r.getMessage()]


def test_a_damaged_checkpoint_is_refused_naming_the_layer():
    def body(rank, comm):
        state = _trained_state(rank, comm)
        ex = exchange(comm)
        out = {}
        for what in ("residual", "controller"):
            bad = copy.deepcopy(state)
            if what == "residual":
                bad["layers"]["w2"]["residual"][5] = np.nan
            else:
                bad["layers"]["w2"]["controller"]["factor"] = float("inf")
            with pytest.raises(ValueError, match="'w2'.*NaN or infinite") as info:
                ex.load_state_dict(bad, like=None)
            out[what] = str(info.value)
        assert ex.step == 0  # nothing was changed
        ex.load_state_dict(state, like=None)  # the undamaged one loads
        step(ex, gaussian(rank, 3))
        return out

    for out in LocalWorld(2).run(body):
        assert "without its 'dlgs' entry" in out["residual"]


def test_a_run_of_non_finite_steps_is_reported_as_such(caplog):
    """Every step non-finite (what a NaN that never leaves does): after 16 in
    a row a warning says so with likely causes; the per-step warning tells a
    loop without a loss scaler how to skip."""

    def body(rank, comm):
        ex = exchange(comm)
        for s in range(17):
            grads = gaussian(rank, s)
            grads[0][3] = np.nan
            step(ex, grads)
        return ex.nonfinite_steps

    with caplog.at_level(logging.WARNING, logger="dlgs"):
        counts = LocalWorld(2).run(body)
    assert counts == [17, 17]
    msgs = [r.getMessage() for r in caplog.records]
    runs = [m for m in msgs if "the last 16 steps were all non-finite" in m]
    assert len(runs) == 2 and "'w1'" in runs[0] and "damaged checkpoint" in runs[0], msgs
    first = [m for m in msgs if m.startswith("step 0:")]
    assert first and ".dlgs.last_step_finite" in first[0]


def test_a_merged_dense_message_names_only_its_non_finite_members(caplog):
    def body(rank, comm):
        ex = exchange(comm)
        ex.set_plan([([1, 3], False)])  # b1 and b2 in one dense message
        grads = gaussian(rank, 0)
        grads[3][2] = np.inf  # b2 only
        step(ex, grads)
        return ex.last_step_finite

    with caplog.at_level(logging.WARNING, logger="dlgs"):
        assert LocalWorld(2).run(body) == [False, False]
    msgs = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    assert msgs and all("'b2'" in m and "'b1'" not in m for m in msgs), msgs


def test_shared_holds_what_every_rank_must_agree_on_and_no_residual():
    def body(rank, comm):
        return shared(_trained_state(rank, comm))

    a, b = LocalWorld(2).run(body)
    assert a == b and a["step"] == 3 and a["plan"] == [([0, 2], None)]


def test_a_damaged_state_kept_for_later_is_refused_when_loaded():
    """An engine built lazily (TensorFlow) keeps a restored state until its
    first step: a damaged one is refused at the restore, on the loading rank,
    not inside a step the other ranks are already in."""
    from dlgs.core import Engine

    def body(rank, comm):
        state = _trained_state(rank, comm)
        state["layers"]["w1"]["velocity"] = np.full(4097, np.inf, np.float32)
        engine = Engine(OPS, comm, SparsityConfig(density=0.05), average=True, prefix="e")
        with pytest.raises(ValueError, match="'w1': its velocity holds NaN or infinite"):
            engine.load_state_dict(state)
        return engine.built

    assert LocalWorld(2).run(body) == [False, False]
