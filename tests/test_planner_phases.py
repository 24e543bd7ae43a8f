"""The online planner's decisions (:mod:`dlgs.core.planning.phases`), driven phase by
phase without ranks or an exchange: the state they return and the actions
they ask for. The driver that carries them out over real ranks is
covered by the planner's other tests (test_profiling_cost, test_parallel)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from phase_steps import settle, snapshot, traced, untraced

from dlgs.core import SparsityConfig
from dlgs.core.planning.dp import CostModel
from dlgs.core.planning.phases import (
    Broadcast,
    DensityChanged,
    Ledger,
    Loaded,
    Log,
    PlannerOptions,
    PlannerState,
    Probe,
    Probed,
    ReadVote,
    SetPlan,
    Shared,
    Stepped,
    Trace,
    Vote,
    Voted,
    decide,
    probe_ladder,
    saved,
)
from dlgs.core.planning.profile import Profile

SIZES = [("w1", 262144), ("b1", 256), ("w2", 65536), ("b2", 10)]
N = len(SIZES)
CONFIG = SparsityConfig(density=0.01, min_sparse_size=1024)
RICH = Ledger(saved_bytes=10**12)  # sparse sending has paid for any probe
FREE = CostModel(0.0, 1e-12)
PROBED = Probed(FREE, CostModel(1e-4, 1e-9), CostModel(1e-4, 1e-9))
OPTIONS = PlannerOptions("dp", profile_steps=3, skip_steps=1, drift_window=2)


def _profiled(options=OPTIONS, end=0.1):
    """Three traced layer-wise steps, then the probe: the state waiting for
    the profile's broadcast, its view and the last actions."""
    state, view = PlannerState(), snapshot(SIZES, CONFIG, step=1)
    state, actions = decide(options, state, view, Stepped(untraced(0, N, end), RICH))
    assert actions == (Trace(),)  # the first step is skipped, the second timed
    for s in range(1, options.profile_steps + 1):
        view = replace(view, step=s + 1)
        state, actions = decide(options, state, view, Stepped(traced(s, N, end), RICH))
        if s < options.profile_steps:
            assert actions == (Trace(),) and len(state.traces) == s
    assert isinstance(actions[-1], Probe) and state.pending.topic == "probe"
    state, actions = decide(options, state, view, PROBED)
    return state, view, actions


def _slow_link(profile: Profile) -> Profile:
    """``profile`` on a latency-bound link, where merging every layer pays."""
    slow = CostModel(5e-3, 1e-9)
    return replace(profile, allgather=slow, allreduce=slow)


def _planned(options=OPTIONS, end=0.1):
    """Profiled and planned from rank 0's profile (on a slow link): in refinement."""
    state, view, actions = _profiled(options, end)
    local = Profile.from_dict(actions[-1].value[0])
    state, actions = decide(options, state, view, Shared((_slow_link(local).to_dict(), {})))
    return state, view, actions


def _settled(options=OPTIONS):
    """Through refinement (steps as fast as the layer-wise ones): in ``run``."""
    state, view, _ = _planned(options)
    step = view.step
    while state.phase == "refine":
        step += 1
        state, view, _ = settle(
            options, state, replace(view, step=step), Stepped(traced(step, N, 0.05))
        )
    return state, replace(view, step=step)


def test_profiling_times_steps_then_probes_then_plans_from_rank_0s_profile():
    state, view, actions = _profiled()
    # The probes fit the ladder and the budget; their result is measured into
    # this rank's profile, which is broadcast with the calibration.
    (broadcast,) = [a for a in actions if isinstance(a, Broadcast)]
    assert broadcast is actions[-1] and broadcast.topic == "profile"
    local = Profile.from_dict(broadcast.value[0])
    assert [layer.name for layer in local.layers] == ["b2", "w2", "b1", "w1"]  # ready order
    assert local.allgather == PROBED.allgather and state.pending.topic == "profile"
    # Nothing else happens until the broadcast's result arrives.
    with pytest.raises(RuntimeError, match="awaited"):
        decide(OPTIONS, state, view, Stepped(untraced(4, N, 0.1), RICH))
    rank0 = _slow_link(local)
    state, actions = decide(OPTIONS, state, view, Shared((rank0.to_dict(), {"scale": 2.0})))
    # Every rank plans from rank 0's profile and reports its calibration.
    assert state.profile == rank0 == state.collectives and state.calibration == {"scale": 2.0}
    (plan,) = [a for a in actions if isinstance(a, SetPlan)]
    assert plan.defer and sorted(i for members, _ in plan.groups for i in members) == [0, 1, 2, 3]
    assert len(plan.groups) < N  # the slow link makes merging pay
    assert state.phase == "refine" and state.plans_made == 1 and state.before == (0.1,) * 3


def test_the_probes_wait_for_the_bytes_they_cost_and_say_so_once():
    state, view = PlannerState(), snapshot(SIZES, CONFIG)
    poor = Ledger(saved_bytes=0)
    logs = []
    for s in range(8):
        record = untraced(s, N, 0.1) if s == 0 else traced(s, N, 0.1)
        state, actions = decide(OPTIONS, state, replace(view, step=s + 1), Stepped(record, poor))
        logs += [a for a in actions if isinstance(a, Log)]
        assert not any(isinstance(a, Probe) for a in actions)
    assert len(logs) == 1 and "wait until sparse sending has saved" in logs[0].msg
    assert state.waiting and state.phase == "profile"
    # Once the bytes are saved, the next step probes.
    state, actions = decide(OPTIONS, state, view, Stepped(untraced(9, N, 0.1), RICH))
    assert isinstance(actions[-1], Probe)
    assert set(actions[-1].sizes) <= set(probe_ladder(view.dense_bytes))


@pytest.mark.parametrize("end, kept", [(0.5, False), (0.05, True)])
def test_refinement_times_the_plan_and_the_guard_judges_it(end, kept):
    state, view, _ = _planned()
    plan_step = state.plan_step
    # The plan's first step relays buffers: not timed; the next ones are.
    state, actions = decide(
        OPTIONS, state, replace(view, step=plan_step), Stepped(traced(0, N, end))
    )
    assert actions == () and not state.traces
    step = plan_step
    verdicts = []
    while state.phase == "refine":
        step += 1
        state, view, actions = settle(
            OPTIONS, state, replace(view, step=step), Stepped(traced(step, N, end))
        )
        verdicts += [a.value for a in actions if isinstance(a, Broadcast) and a.topic == "guard"]
    (verdict,) = verdicts
    assert verdict["kept"] == kept and state.guard_result == verdict
    assert verdict["layerwise_steps"] == [0.1] * 3 and len(verdict["plan_steps"]) == 3
    assert state.fallback == (not kept) and state.plans_made == 2
    groups = [a for a in actions if isinstance(a, SetPlan)][-1].groups
    # Dropped: every layer alone (layer-wise); kept: merged as planned.
    assert (len(groups) == N) == (not kept)


@pytest.mark.parametrize("factor, kept", [(3, False), (1, True)])
def test_within_the_noise_the_guard_keeps_whichever_sends_fewer_bytes(factor, kept):
    """Steps under the plan as long as the layer-wise ones: a coin toss that
    would fall differently from run to run. A plan that sends more bytes
    than layer-wise sending (``factor`` times) goes back to layer-wise; one
    that sends no more stays."""
    state, view, _ = _planned()
    layerwise = state.layerwise_bytes
    assert layerwise == view.wire_bytes
    view = replace(view, wire_bytes=factor * layerwise)
    step, verdicts = state.plan_step, []
    while state.phase == "refine":
        step += 1
        state, view, actions = settle(
            OPTIONS, state, replace(view, step=step), Stepped(traced(step, N, 0.1))
        )
        verdicts += [a.value for a in actions if isinstance(a, Broadcast) and a.topic == "guard"]
    (verdict,) = verdicts
    assert verdict["plan"] == verdict["layerwise"]
    assert verdict["more_bytes"] is (factor > 1) and verdict["kept"] is kept
    assert state.fallback is (not kept)


def test_drift_is_voted_on_a_window_after_it_shows_twice_and_profiling_starts_again():
    state, view = _settled()
    end = state.plan.end
    step = view.step
    actions_seen = []

    def run(seconds, votes=(0, 0)):
        nonlocal state, view, step
        step += 1
        view = replace(view, step=step)
        state, view, actions = settle(
            OPTIONS, state, view, Stepped(untraced(step, N, seconds), RICH), votes=votes
        )
        actions_seen.append(actions)
        return actions

    run(end), run(end)  # the first window calibrates
    assert state.baseline == pytest.approx(1.0) and not state.vote_pending
    run(3 * end)
    assert run(3 * end)[-1] == Vote(0)  # one window beyond: noise, no vote yet
    assert run(3 * end)[0] == ReadVote()  # read one step later
    assert run(3 * end)[-1] == Vote(1)  # two in a row: rank 0 votes
    actions = run(3 * end, votes=(1, 0))
    assert actions[0] == ReadVote() and any(
        "drifted" in a.msg % a.args for a in actions if isinstance(a, Log)
    )
    assert state.phase == "profile" and state.plan is None and state.baseline is None


def test_a_reprofile_request_travels_in_the_next_vote():
    state, view = _settled()
    state = replace(state, restart_requested=True)
    end, step = state.plan.end, view.step
    words = []
    for seconds in (end, end, end, end):
        step += 1
        state, actions = decide(
            OPTIONS, state, replace(view, step=step), Stepped(untraced(step, N, seconds))
        )
        words += [a.word for a in actions if isinstance(a, Vote)]
    assert words == [2] and state.vote_pending
    state, actions = decide(OPTIONS, state, view, Stepped(untraced(step + 1, N, end)))
    assert actions == (ReadVote(),)
    state, actions = decide(OPTIONS, state, view, Voted((0, 2)))  # rank 1 asked
    assert any("rank(s) [1]" in a.msg % a.args for a in actions if isinstance(a, Log))
    assert state.phase == "profile" and not state.restart_requested


def test_a_new_density_gets_its_plan_for_the_layout_being_made():
    state, view = _settled()
    state2, actions = decide(OPTIONS, state, view, DensityChanged(view.density))
    assert actions == () and state2 == state  # the plan is for this density already
    view = replace(view, density=0.05)
    state2, actions = decide(OPTIONS, state, view, DensityChanged(0.05))
    (plan,) = [a for a in actions if isinstance(a, SetPlan)]
    assert not plan.defer and state2.density == 0.05 and state2.plans_made == state.plans_made + 1


def test_decisions_are_a_pure_function_of_their_inputs():
    state, view, _ = _planned()
    before = replace(state)
    event = Stepped(traced(view.step + 1, N, 0.1))
    first = decide(OPTIONS, state, replace(view, step=view.step + 1), event)
    again = decide(OPTIONS, state, replace(view, step=view.step + 1), event)
    assert first == again and state == before


def test_a_result_nobody_asked_for_is_refused():
    with pytest.raises(RuntimeError, match="unasked"):
        decide(OPTIONS, PlannerState(), snapshot(SIZES, CONFIG), Shared(None))
    state, view, _ = _profiled()
    with pytest.raises(RuntimeError, match="'profile' was awaited"):
        decide(OPTIONS, state, view, Voted((0, 0)))


def test_a_checkpoint_round_trips_and_another_world_size_profiles_again():
    state, view = _settled()
    loaded, actions = decide(OPTIONS, PlannerState(), view, Loaded(saved(state)))
    assert loaded.profile == state.profile and loaded.plan == state.plan and loaded.phase == "run"
    # The plan is set on the exchange again, for the order the profile measured.
    (plan,) = [a for a in actions if isinstance(a, SetPlan)]
    assert plan.defer and [m for m, _ in plan.groups][0][0] == state.order[0]
    other, actions = decide(OPTIONS, PlannerState(), replace(view, size=4), Loaded(saved(state)))
    (warning,) = [a for a in actions if isinstance(a, Log)]
    assert warning.every_rank and "profiling again" in warning.msg
    assert other.phase == "profile" and other.plan is None


def test_a_drift_window_counts_steps_not_the_records_of_host_steps():
    """With steps run on the device alone between host steps, a window still
    ends after drift_window steps (from fewer records)."""
    state, view = _settled()
    end, step = state.plan.end, view.step
    votes = []
    for gap in (1, 1, 3, 5):  # two records fill the first window, then 3 + 5 steps
        step += gap
        state, actions = decide(
            OPTIONS, state, replace(view, step=step), Stepped(untraced(step, N, end))
        )
        votes += [a for a in actions if isinstance(a, Vote)]
    # Window 1 (steps 1-2) calibrates; window 2 ends at the record 3 steps on
    # (a vote); the record 5 steps later reads that vote first.
    assert state.baseline is not None and len(votes) == 1
