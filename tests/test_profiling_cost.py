"""Profiling pays for itself (``dlgs/core/planning/online.py``), with no framework:
the planner's byte ledger and probe sizes on ranks as threads
(``tests/local_world.py``), and the guard's statistic."""

from __future__ import annotations

import numpy as np
import pytest
from local_world import OPS, LocalWorld

from dlgs.core import SparseExchange, SparsityConfig
from dlgs.core.planning.online import OnlinePlanner, guard_verdict
from dlgs.core.planning.phases import probe_ladder

# Backward order; 82,186 elements, 328,744 dense bytes per step.
SIZES = [("w1", 65536), ("b1", 256), ("w2", 16384), ("b2", 10)]


def _exchange(comm, planner, sizes=SIZES, density=0.01):
    # 16-bit indices pinned: the byte figures below assume them (``auto``
    # would send a bitmap at density 0.6).
    cfg = SparsityConfig(density=density, min_sparse_size=1024, index_coding="block16")
    ex = SparseExchange(OPS, comm, cfg, sizes)
    ex.step_hooks.append(planner)
    return ex


def _steps(ex, rank, steps, planner, at_step=None):
    rng = np.random.default_rng(rank)
    ledger = []
    for s in range(steps):
        if at_step is not None:
            at_step(s)
        for i, layer in enumerate(ex.layers):
            ex.submit(i, rng.standard_normal(layer.numel).astype(np.float32))
        ex.wait()
        cost = planner.cost
        ledger.append((s, cost["bytes"], cost["saved_bytes"], cost["probes"]))
    return ledger


@pytest.mark.parametrize(
    "sizes, density, waits",
    [
        (SIZES, 0.01, False),
        # 4,096 elements at density 0.6 (6 bytes per element with 16-bit
        # indices): a step saves about 1.6 KB against dense, less than the
        # smallest probes (64 + 256 B, both kinds, 3 calls each, and 4 x 64 B
        # at once: 3.5 KB).
        ([("w", 4096)], 0.6, True),
    ],
)
def test_probes_never_spend_more_than_sparse_sending_saved(sizes, density, waits):
    def body(rank, comm):
        planner = OnlinePlanner("dp", profile_steps=1)
        ex = _exchange(comm, planner, sizes, density)
        ledger = _steps(ex, rank, 12, planner)
        return ledger, planner.plans_made, planner.cost["probe_bytes"], ex.wire_bytes()

    results = LocalWorld(2).run(body)
    assert results[0] == results[1], "ranks' ledgers differ (their probes could too)"
    ledger, plans, probe_bytes, wire = results[0]
    assert plans >= 1 and ledger[-1][3] > 0, "no profile was measured"
    for step, spent, saved, _ in ledger:
        assert spent <= saved, f"step {step}: planning spent {spent} B, sparse steps saved {saved}"
    # At most profile_budget (1%) of what 1,000 steps of the layout send.
    assert probe_bytes <= 0.01 * 1000 * wire
    # One step skipped, one profiled: without waiting, the probes follow step 1.
    first = next(s for s, _, _, probes in ledger if probes)
    assert (first > 1) is waits, ledger[:4]


def test_a_reprofile_the_savings_cannot_pay_keeps_the_fitted_collectives():
    def body(rank, comm):
        planner = OnlinePlanner("dp", profile_steps=1, refine=False)
        ex = _exchange(comm, planner)
        seen = {}

        def at_step(s):
            if s == 6:  # every rank, between the same two steps
                seen["before"] = (planner.profile, planner.cost["probes"], planner.plans_made)
                planner.restart()
                # As if planning had spent a gigabyte more than sparse sending saved.
                planner.cost["bytes"] = planner.cost["saved_bytes"] + 10**9

        _steps(ex, rank, 10, planner, at_step)
        return seen["before"], planner.profile, planner.cost["probes"], planner.plans_made

    results = LocalWorld(2).run(body)
    (profile, probes, plans), after, probes_after, plans_after = results[0]
    assert plans_after > plans, "no re-plan after restart()"
    assert probes_after == probes, "the re-profile probed without the bytes to pay for it"
    assert (after.allgather, after.allreduce) == (profile.allgather, profile.allreduce)
    assert results[1][2:] == results[0][2:]


def test_probe_ladder_scales_down_for_a_small_model():
    def body(rank, comm):
        big = _exchange(comm, OnlinePlanner("dp"))
        small = _exchange(comm, OnlinePlanner("dp"), [("w", 4096), ("b", 64)])
        return probe_ladder(big.dense_bytes()), probe_ladder(small.dense_bytes())

    big, small = LocalWorld(1).run(body)[0]
    assert big == [1024, 4096, 16384, 65536, 262144, 328744]
    # 16,640 dense bytes: from a 256th of it (rounded to a word, at least 64 B),
    # not from 1 KiB.
    assert small == [64, 256, 1024, 4096, 16384, 16640]
    assert all(s % 4 == 0 for s in big + small)


def test_guard_keeps_a_plan_whose_difference_is_within_the_noise():
    layerwise = [10.0, 12.0, 9.0, 11.0, 15.0, 10.5, 9.5, 11.5]
    plan = [x + 0.6 for x in layerwise]  # 5% slower, samples spread by ~10%
    v = guard_verdict(layerwise, plan)
    assert v["kept"] and v["plan"] > v["layerwise"]
    assert v["margin"] > v["plan"] - v["layerwise"]
    # Its inputs are recorded.
    assert v["layerwise_steps"] == layerwise and v["plan_steps"] == plan


def test_guard_drops_a_plan_that_is_slower_beyond_the_noise():
    layerwise = [10.0, 10.1, 9.9, 10.05, 9.95, 10.0, 10.2, 9.8]
    plan = [x * 1.3 for x in layerwise]
    v = guard_verdict(layerwise, plan)
    assert not v["kept"]
    # One outlying step does not move the medians' verdict.
    assert guard_verdict(layerwise, [*plan[:-1], 1.0])["kept"] is False
    assert guard_verdict([*layerwise[:-1], 100.0], layerwise)["kept"] is True


@pytest.mark.parametrize("slower, kept", [(1.01, True), (1.03, False)])
def test_guard_margin_is_at_least_two_percent(slower, kept):
    # Identical steps on each side (no spread): only the 2% floor remains.
    assert guard_verdict([1.0] * 3, [slower] * 3)["kept"] is kept


def test_guard_without_samples_keeps_the_plan():
    assert guard_verdict([], [1.0])["kept"] and guard_verdict([1.0], [])["kept"]


def test_the_profile_measures_the_latency_of_a_collective_in_a_batch():
    def body(rank, comm):
        planner = OnlinePlanner("dp", profile_steps=1)
        _steps(_exchange(comm, planner), rank, 6, planner)
        return planner.profile

    p0, p1 = LocalWorld(2).run(body)
    assert p0 == p1, "ranks plan from different profiles"
    for cost in (p0.allgather, p0.allreduce):
        assert cost.batched is not None and 0.0 <= cost.batched <= cost.alpha, cost


def _profile(alpha=5e-3, batched=1e-3):
    from dlgs.core.planning.dp import CostModel
    from dlgs.core.planning.profile import LayerProfile, Profile

    layers = tuple(LayerProfile(f"l{i}", n, 2e-3) for i, n in enumerate([65536, 256, 16384, 10]))
    return Profile(
        world_size=4,
        layers=layers,
        sparsify=CostModel(1e-5, 1e-9),
        pack=CostModel(0.0, 1e-10),
        allgather=CostModel(alpha, 1e-8, batched),
        allreduce=CostModel(alpha, 1e-8, batched),
    )


def _layerwise_end(profile, modes):
    from dlgs.core.planning.dp import simulate
    from dlgs.core.planning.profile import build_spec

    spec = build_spec(profile, SparsityConfig(density=0.01, min_sparse_size=1024), 0.01)[0]
    return simulate(spec, [(i, i, m) for i, m in enumerate(modes)]).end


MODES = [True, False, True, False]


def test_calibration_scales_latency_to_reproduce_the_profiled_steps():
    from dlgs.core.planning.profile import calibrate

    # Without a batched latency the predicted end is continuous in the scale,
    # so the fit is exact (with one, a message that stops joining a batch makes
    # it jump, and the fit ends on the jump).
    raw = _profile(batched=None)
    cfg = SparsityConfig(density=0.01, min_sparse_size=1024)
    measured = 0.7 * _layerwise_end(raw, MODES)
    fitted, info = calibrate(raw, cfg, 0.01, MODES, measured)
    assert info["calibrated"] and info["measured"] == measured
    assert _layerwise_end(fitted, MODES) == pytest.approx(measured, rel=1e-6)
    assert 0 < info["scale"] < 1 and fitted.allgather.alpha < raw.allgather.alpha
    assert fitted.allgather.beta == raw.allgather.beta and fitted.contention == 0


@pytest.mark.parametrize("factor", [1.01, 1.6])
def test_calibration_leaves_a_prediction_that_is_right_or_too_fast_alone(factor):
    from dlgs.core.planning.profile import calibrate

    raw = _profile()
    cfg = SparsityConfig(density=0.01, min_sparse_size=1024)
    fitted, info = calibrate(raw, cfg, 0.01, MODES, factor * _layerwise_end(raw, MODES))
    assert not info["calibrated"] and fitted == raw


def test_calibration_cannot_scale_latency_below_its_floor():
    from dlgs.core.planning.profile import calibrate

    raw = _profile()
    cfg = SparsityConfig(density=0.01, min_sparse_size=1024)
    fitted, info = calibrate(raw, cfg, 0.01, MODES, 1e-9)
    assert info["scale"] == pytest.approx(0, abs=1e-9)
    assert fitted.allgather.alpha == pytest.approx(raw.allgather.batched)


def test_contention_is_the_slowdown_per_extra_byte():
    from dlgs.core.planning.profile import contention

    # 10 ms slower while sending 1 MB more: 10 ns per byte.
    assert contention(0.100, 50_000, 0.110, 1_050_000) == pytest.approx(1e-8)
    # Fewer bytes and faster: the same slope.
    assert contention(0.110, 1_050_000, 0.100, 50_000) == pytest.approx(1e-8)
    # More bytes but not slower, slower without more bytes, or no difference: none.
    assert contention(0.100, 50_000, 0.095, 1_050_000) == 0.0
    assert contention(0.100, 50_000, 0.120, 50_000) == 0.0


def test_the_online_profile_is_calibrated_to_its_own_steps():
    def body(rank, comm):
        planner = OnlinePlanner("dp", profile_steps=2)
        _steps(_exchange(comm, planner), rank, 6, planner)
        return planner.calibration, planner.profile

    (cal0, p0), (cal1, p1) = LocalWorld(2).run(body)
    assert p0 == p1, "ranks plan from different calibrated profiles"
    assert set(cal0) >= {"measured", "predicted", "scale", "contention", "calibrated"}
    assert p0.contention == cal0["contention"]


def test_guard_with_prove_keeps_only_a_plan_shown_no_slower():
    before = [1.00, 1.01, 0.99, 1.00, 1.02]
    # Within the noise: the plain guard keeps it, a plan that must prove itself goes.
    same = [1.01, 1.00, 1.02, 0.99, 1.01]
    assert guard_verdict(before, same)["kept"] is True
    assert guard_verdict(before, same, prove=True)["kept"] is False
    # Clearly faster: kept either way; an allowance lets a slower one stay.
    assert guard_verdict(before, [0.8] * 5, prove=True)["kept"] is True
    v = guard_verdict(before, same, allowance=0.1, prove=True)
    assert v["kept"] is True and v["allowance"] == 0.1
