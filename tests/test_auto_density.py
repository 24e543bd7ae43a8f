"""``density="auto"``: the planner picks the highest density whose
predicted communication ends within back-propagation plus a slack, the same on
every rank, kept across a checkpoint; bad combinations are refused."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from local_world import OPS, LocalWorld, assert_conserved, run_steps, sent_and_residuals
from phase_steps import settle, snapshot, traced, untraced

from dlgs._options import build_configs
from dlgs.catalog import catalog_profile
from dlgs.core import RankMismatchError, SparseExchange, SparsityConfig
from dlgs.core.planning.dp import CostModel, simulate
from dlgs.core.planning.online import OnlinePlanner
from dlgs.core.planning.phases import (
    AutoCheck,
    Broadcast,
    Log,
    PlannerOptions,
    PlannerState,
    SetDensity,
    SetPlan,
    Stepped,
)
from dlgs.core.planning.profile import (
    AUTO_LADDER,
    LayerProfile,
    Profile,
    build_spec,
    choose_density,
    fit_link,
    plan_at,
    raise_layers,
)

SIZES = [("w1", 262144), ("b1", 256), ("w2", 65536), ("b2", 10)]  # backward order


def _profile(bytes_per_s, latency=1e-4, backward=0.02, world=2):
    """Every layer takes ``backward`` seconds; a link of ``bytes_per_s``."""
    layers = tuple(LayerProfile(name, n, backward) for name, n in SIZES)
    link = CostModel(latency, 1.0 / bytes_per_s)
    free = CostModel(0.0, 1e-12)
    return Profile(world, layers, free, free, link, link)


def _auto(**kw):
    return SparsityConfig(density="auto", min_sparse_size=1024, **kw)


def test_a_fast_link_gets_dense_and_slower_links_lower_densities():
    chosen = []
    for bps in (1e12, 1e8, 1e7, 1e6, 1e5, 3e4):
        config = _auto()
        choice = choose_density(_profile(bps), config)
        # What it compared: every density, highest first, down to the floor.
        densities = [d for d, _, _ in choice.candidates]
        assert densities == [1.0, *(d for d in AUTO_LADDER if d >= 0.001)]
        ends = {d: end for d, end, _ in choice.candidates}
        backprop = choice.candidates[0][2]
        # The highest density within auto_slack of back-propagation after the fastest.
        assert choice.bound == pytest.approx(min(ends.values()) + config.auto_slack * backprop)
        assert ends[choice.density] <= choice.bound
        assert all(ends[d] > choice.bound for d in densities if d > choice.density)
        assert choice.fits == (ends[choice.density] <= backprop * (1 + config.auto_slack))
        chosen.append(choice.density)
    assert chosen[0] == 1.0, chosen
    assert chosen == sorted(chosen, reverse=True), chosen  # slower link, lower density
    assert chosen[-1] < 0.01 and chosen[-1] >= 0.001, chosen
    assert set(chosen) <= {1.0, *AUTO_LADDER}


def test_floor_slack_and_a_higher_density_when_nothing_hides():
    slow = _profile(1e5)  # even the floor cannot hide its communication
    choice = choose_density(slow, _auto(density_floor=0.01, auto_slack=0.0))
    assert not choice.fits and choice.density >= 0.01
    ends = {d: end for d, end, _ in choice.candidates}
    assert ends[choice.density] == min(ends.values())
    assert min(ends) == 0.01  # the floor is the last tried
    # More slack: a higher density may end later, also when nothing hides.
    for profile in (_profile(1e6), slow):
        tight = choose_density(profile, _auto(auto_slack=0.0)).density
        loose = choose_density(profile, _auto(auto_slack=1.0)).density
        assert loose > tight, (tight, loose)
    assert "density='auto' chose" in choose_density(_profile(1e6), _auto()).describe()


def _grads(rank, step):
    g = np.random.default_rng(100 * step + rank)
    return [g.standard_normal(n).astype(np.float32) for _, n in SIZES]


def _submit(ex, rank, step):
    """Submit every layer's gradient of ``step``; the density in force for it."""
    density = ex.density
    for i, g in enumerate(_grads(rank, step)):
        ex.submit(i, g)
    return density


def test_every_rank_uses_the_chosen_density_and_a_checkpoint_keeps_it():
    slow = _profile(1e7)
    expect = choose_density(slow, _auto()).density
    assert expect not in (0.01, 1.0)  # a change from the starting density

    def body(rank, comm):
        ex = SparseExchange(OPS, comm, _auto(), SIZES)
        planner = OnlinePlanner("dp", profile=slow)
        ex.step_hooks.append(planner)
        seen = []
        for s in range(4):
            density = _submit(ex, rank, s)
            ex.wait()
            seen.append((density, [(g.members, g.sparse) for g in ex.groups]))
        state = ex.state_dict()
        fresh = SparseExchange(OPS, comm, _auto(), SIZES)
        resumed = OnlinePlanner("dp")
        fresh.step_hooks.append(resumed)
        fresh.load_state_dict(state, like=None)
        for i, g in enumerate(_grads(rank, 4)):
            fresh.submit(i, g)
        out = fresh.wait()
        return (
            seen,
            fresh.density,
            [(g.members, g.sparse) for g in fresh.groups],
            resumed.density_choice.density,
            [np.array(out[i]) for i in range(len(SIZES))],
        )

    r0, r1 = LocalWorld(2).run(body)
    assert r0[:4] == r1[:4], "ranks chose or laid out differently"
    for a, b in zip(r0[4], r1[4]):
        assert np.array_equal(a, b)
    seen, resumed_density, resumed_layout, resumed_choice, _ = r0
    # The first step runs at the starting density; the choice is in force after.
    assert seen[0][0] == 0.01 and seen[-1][0] == expect
    assert resumed_density == expect and resumed_layout == seen[-1][1]
    assert resumed_choice == expect  # describe() still shows the choice


class _Clock:
    """A rank's clock for the exchange and the planner: every reading moves it
    a tick (so probes and layers take the same time whatever their size:
    communication looks free and ``auto`` chooses dense); ``lag()`` makes the
    step in progress end later."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1e-4
        return self.t

    def lag(self, seconds):
        self.t += seconds


@pytest.mark.parametrize("slow", [1.0, 0.01])
def test_auto_keeps_a_density_only_if_its_steps_measure_no_slower(slow):
    """The choice (dense) stays only where its timed steps prove it no slower
    than the starting density's; else the starting density is back."""

    def body(rank, comm):
        clock = _Clock()
        ex = SparseExchange(OPS, comm, _auto(), SIZES, clock=clock)
        planner = OnlinePlanner("dp", profile_steps=2)
        ex.step_hooks.append(planner)
        seen = []
        for s in range(16):
            density = _submit(ex, rank, s)
            if density == slow:
                clock.lag(0.5)  # far beyond the allowance and the noise margin
            ex.wait()
            seen.append(density)
        choice = planner.density_choice
        # A checkpoint after the check (and the refinement it led to): the
        # resumed planner shows the same choice and outcome, at the same density.
        fresh = SparseExchange(OPS, comm, _auto(), SIZES, clock=clock)
        resumed = OnlinePlanner("dp", profile_steps=2)
        fresh.step_hooks.append(resumed)
        fresh.load_state_dict(ex.state_dict(), like=None)
        again = resumed.density_choice
        saved = ("density", "bound", "candidates", "reverted", "measured")
        assert [getattr(again, k) for k in saved] == [getattr(choice, k) for k in saved]
        assert fresh.densities == ex.densities and resumed.settled
        assert again.describe().splitlines()[-1] == choice.describe().splitlines()[-1]
        link = planner.calibration.get("link")
        beta = planner.profile.allreduce.beta
        return seen, choice.density, choice.measured, choice.reverted, planner.settled, link, beta

    r0, r1 = LocalWorld(2).run(body)
    assert r0 == r1, "ranks disagree on the check or the density"
    seen, chosen, measured, reverted, settled, link, allreduce_beta = r0
    # Profiled at the starting density, then dense (free communication, no
    # selection cost) was chosen and its steps timed.
    assert seen[0] == 0.01 and chosen == 1.0 and 1.0 in seen, seen
    assert settled and measured["density"] == 1.0 and measured["before_density"] == 0.01
    assert measured["allowance"] > 0  # a higher density may cost auto_slack more
    if slow == 1.0:
        assert measured["plan"] > measured["layerwise"] + 0.4
        assert not measured["kept"] and reverted == 0.01 and seen[-1] == 0.01
        # The dense steps' lateness taught the model the link: the profile's
        # collectives now charge at least a ring over the fitted link.
        assert link > 0 and allreduce_beta >= link * (1 - 1e-9)
    else:
        assert measured["plan"] < measured["layerwise"] - 0.4
        assert measured["kept"] and reverted is None and seen[-1] == 1.0
        assert link is None


def _under_choice(profile, profile_steps=3):
    """The planner's state after a given ``profile`` chose per-layer densities
    at the first step, and the view with them in force."""
    options = PlannerOptions("dp", profile_steps=profile_steps)
    view = snapshot(SIZES, _auto(), step=1)
    first = Stepped(untraced(0, len(SIZES), 0.1))
    state, view, _ = settle(options, PlannerState(profile=profile), view, first)
    assert state.plan is not None and state.density_choice is not None
    return options, state, replace(view, step=3)


def _check_steps(options, state, view, check, end):
    """Refinement under the choice, ``check`` pending: its last traced step
    ends at ``end`` like the ones before it."""
    n = len(SIZES)
    state = replace(
        state,
        auto_check=check,
        refining=True,
        refine_armed=True,
        traces=tuple(traced(s, n, end).trace for s in range(options.profile_steps - 1)),
    )
    return settle(options, state, view, Stepped(traced(3, n, end)))


def test_a_revert_restores_the_per_layer_densities_before_the_choice():
    """Steps under a new choice measured slower than steps under per-layer
    densities (an earlier choice): those per-layer densities come back, not
    their single density. Driven through the planner's decisions."""
    earlier = (0.01, 0.01, 0.02, 0.01)
    options, state, view = _under_choice(_profile(1e6))
    check = AutoCheck(0.01, earlier, (0.2,) * 3, False)
    state, view, actions = _check_steps(options, state, view, check, 0.7)
    verdicts = [a.value for a in actions if isinstance(a, Broadcast) and a.topic == "auto"]
    assert len(verdicts) == 1 and not verdicts[0]["kept"]
    assert [a for a in actions if isinstance(a, SetDensity)] == [SetDensity(0.01, earlier)]
    assert view.densities == earlier and state.each == earlier
    assert state.density_choice.reverted == 0.01
    # Refinement goes on under the plan for the densities back in force.
    assert isinstance(actions[-1], Log) and state.phase == "refine" and not state.traces
    assert any(isinstance(a, SetPlan) and a.defer for a in actions)


def test_a_checkpoint_taken_during_the_check_resumes_the_check():
    """Saved after the choice (dense) was made and before its steps were
    judged: the resumed planner times the choice again and, its steps being
    slow, goes back to the starting density on every rank."""

    def body(rank, comm):
        clock = _Clock()
        ex = SparseExchange(OPS, comm, _auto(), SIZES, clock=clock)
        planner = OnlinePlanner("dp", profile_steps=2)
        ex.step_hooks.append(planner)
        for s in range(16):
            _submit(ex, rank, s)
            ex.wait()
            if planner.state.auto_check is not None:  # the check is pending
                break
        state = ex.state_dict()
        assert state["hooks"] and ex.density == 1.0
        fresh = SparseExchange(OPS, comm, _auto(), SIZES, clock=clock)
        resumed = OnlinePlanner("dp", profile_steps=2)
        fresh.step_hooks.append(resumed)
        fresh.load_state_dict(state, like=None)
        seen = []
        for step in range(s + 1, s + 9):
            density = _submit(fresh, rank, step)
            if density == 1.0:
                clock.lag(0.5)
            fresh.wait()
            seen.append(density)
        choice = resumed.density_choice
        return seen, choice.measured, choice.reverted, resumed.settled

    r0, r1 = LocalWorld(2).run(body)
    assert r0 == r1, "ranks disagree on the resumed check"
    seen, measured, reverted, settled = r0
    assert seen[0] == 1.0 and seen[-1] == 0.01, seen
    assert not measured["kept"] and reverted == 0.01 and settled


@pytest.mark.parametrize(
    "kwargs, match, exc",
    [
        (dict(density="fast"), "density", TypeError),
        (dict(density="auto", warmup="dgc", warmup_steps=5), "warmup", ValueError),
        (dict(density="auto", density_floor=0.0), "density_floor", ValueError),
        (dict(density="auto", auto_slack=-0.1), "auto_slack", ValueError),
        (dict(density="auto", auto_layers="yes"), "auto_layers", TypeError),
    ],
)
def test_bad_auto_options_name_the_parameter(kwargs, match, exc):
    with pytest.raises(exc, match=match):
        SparsityConfig(**kwargs)


def test_auto_needs_a_profiling_merge_strategy():
    with pytest.raises(ValueError, match="merge='none'"):
        build_configs(None, "auto", "none", {})
    cfg, planner = build_configs(None, "auto", "dp", {})
    assert cfg.auto and planner.strategy == "dp"
    ex = SparseExchange(OPS, LocalWorld(1).comm(0), SparsityConfig(density=0.01), SIZES)
    with pytest.raises(RuntimeError, match="auto"):
        ex.set_density(0.1)


# -- per-layer densities (auto_layers) -------------------------------------------


@pytest.mark.parametrize("model, bps", [("resnet50", 1e9), ("vgg16", 1e8), ("bert-base", 1e10)])
def test_per_layer_densities_fill_the_bound_and_no_layer_can_rise_further(model, bps):
    profile = catalog_profile(model, world_size=8, bandwidth_bps=bps)
    config = SparsityConfig(density="auto")
    choice = choose_density(profile, config)
    flat = choose_density(profile, replace(config, auto_layers=False))
    assert flat.layers == () and flat.density == choice.density
    assert flat.plan.end <= choice.bound
    # Some layers rose, none fell, each to a rung of the ladder; more sent.
    layers = choice.layers
    assert len(layers) == len(profile.layers)
    assert min(layers) == choice.density and max(layers) > choice.density
    assert set(layers) <= {choice.density, *AUTO_LADDER}
    numel = [layer.numel for layer in profile.layers]
    assert sum(d * n for d, n in zip(layers, numel)) > choice.density * sum(numel)
    # The plan in force is the planner's at these densities, within the bound.
    assert choice.plan.end == plan_at(profile, config, layers).end <= choice.bound
    assert "layers raised above" in choice.describe()
    # Maximal: raise_layers, asked again under the plan in force, either finds
    # nothing or a raise whose own plan would end past the bound (where the
    # rounds stopped); and under those messages, one more rung for any layer
    # sent sparse (that stays sparse-worthy there) ends past the bound.
    plan = choice.plan
    again = raise_layers(profile, config, layers, plan, choice.bound)
    if again != layers:
        assert plan_at(profile, config, again).end > choice.bound
    part = plan.partition()
    assert simulate(build_spec(profile, config, again)[0], part).end <= choice.bound
    rungs = sorted(d for d in AUTO_LADDER if choice.density < d < 1.0)
    tried = 0
    for i in (i for g in plan.groups if g.sparse for i in g.members):
        higher = [d for d in rungs if d > again[i]]
        if not higher:
            continue
        up = list(again)
        up[i] = higher[0]
        spec_up, eligible = build_spec(profile, config, up)
        if eligible[i]:
            tried += 1
            assert simulate(spec_up, part).end > choice.bound, (i, again[i], higher[0])
    assert tried > 0


def test_fit_link_makes_the_plan_end_when_it_was_measured_to():
    profile = _profile(1e12)  # the probes saw bytes as free
    config = _auto()
    dense = [(i, i, False) for i in range(len(SIZES))]
    before = simulate(build_spec(profile, config, 1.0)[0], dense).end
    fitted, info = fit_link(profile, config, 1.0, dense, 2 * before)
    assert info["fitted"] == 1.0 and info["predicted"] == pytest.approx(before)
    after = simulate(build_spec(fitted, config, 1.0)[0], dense).end
    assert after == pytest.approx(2 * before, rel=1e-6)
    x = info["seconds_per_byte"]
    # A ring over that link: (P-1) x per chunk byte, 2(P-1)/P x per buffer byte.
    assert fitted.allgather.beta == pytest.approx(max(profile.allgather.beta, x))
    assert fitted.allreduce.beta == pytest.approx(max(profile.allreduce.beta, x))
    assert fitted.allreduce.alpha == profile.allreduce.alpha  # latency untouched
    # Steps no later than predicted teach nothing.
    same, info = fit_link(profile, config, 1.0, dense, before)
    assert same is profile and info["fitted"] == 0.0


# w1 and w2 sparse (min_sparse_size 1024), each at its own density.
LAYERS = [0.05, 0.01, 0.002, 0.01]


def _own_densities(rank, comm, **options):
    ex = SparseExchange(OPS, comm, _auto(controller="topk", **options), SIZES, average=False)
    ex.set_density(0.01, LAYERS)
    return ex


def test_each_layer_is_sent_at_its_own_density_and_reconstructed_exactly():
    ks = [math.ceil(d * n) for d, (_, n) in zip(LAYERS, SIZES)]

    def grads(rank, step):  # at most k_i non-zeros in each sparse layer
        g = np.random.default_rng(10 * step + rank)
        out = []
        for (_, n), k in zip(SIZES, ks):
            x = np.zeros(n, np.float32)
            m = k if n >= 1024 else n
            x[g.choice(n, m, replace=False)] = g.integers(1, 9, m) * g.choice([-1, 1], m)
            out.append(x)
        return out

    def record(rank, ex, out):
        plans = [(layer.plan.k, layer.sparse) for layer in ex.layers]
        return plans, [np.array(out[i]) for i in range(len(SIZES))]

    recs = run_steps(LocalWorld(2, average=False), _own_densities, grads, 2, record)
    for s in range(2):
        plans, outs = recs[0][s]
        assert plans == [(ks[0], True), (ks[1], False), (ks[2], True), (ks[3], False)]
        assert recs[1][s][0] == plans
        for got, want in zip(outs, (a + b for a, b in zip(grads(0, s), grads(1, s)))):
            assert np.array_equal(got, want)


def test_per_layer_densities_conserve_the_gradient():
    """Dense random inputs: what each rank sent (k_i of layer i, decoded from
    its own messages) plus its residual equals what it accumulated."""

    def grads(rank, step):
        g = np.random.default_rng(100 + 10 * step + rank)
        return [g.standard_normal(n).astype(np.float32) for _, n in SIZES]

    steps = 3
    world = LocalWorld(2, average=False)
    recs = run_steps(world, _own_densities, grads, steps, sent_and_residuals)
    for rank in range(2):
        assert sorted(recs[rank][0][0]) == [0, 2]
        for i in (0, 2):
            counts = {np.count_nonzero(recs[rank][s][0][i]) for s in range(steps)}
            assert counts == {math.ceil(LAYERS[i] * SIZES[i][1])}
        assert_conserved(grads, recs, rank, (0, 2), steps)


def test_per_layer_densities_survive_a_checkpoint_and_ranks_must_agree_on_them():
    def body(rank, comm):
        ex = _own_densities(rank, comm)
        for s in range(2):
            _submit(ex, rank, s)
            ex.wait()
        state = ex.state_dict()
        fresh = SparseExchange(OPS, comm, _auto(controller="topk"), SIZES, average=False)
        fresh.load_state_dict(state, like=None)
        _submit(fresh, rank, 2)
        fresh.wait()
        ks = [layer.plan.k for layer in fresh.layers]
        # auto_layers turned off since: one density for every layer again.
        flat = SparseExchange(OPS, comm, _auto(auto_layers=False), SIZES, average=False)
        flat.load_state_dict(state, like=None)
        # A checkpoint from before per-layer densities: the density alone.
        old = SparseExchange(OPS, comm, _auto(), SIZES, average=False)
        old.load_state_dict({k: v for k, v in state.items() if k != "auto_layers"}, like=None)
        assert flat.densities == old.densities == (0.01,) * len(SIZES)
        other = dict(state, auto_layers=[0.05, 0.01, 0.004, 0.01] if rank else LAYERS)
        late = SparseExchange(OPS, comm, _auto(controller="topk"), SIZES, average=False)
        late.load_state_dict(other, like=None)  # no collective: checked at the next gradient
        try:
            _submit(late, rank, 3)
            error = None
        except RankMismatchError as err:
            error = str(err)
        return state["auto_layers"], fresh.densities, ks, error

    for saved, densities, ks, error in LocalWorld(2).run(body):
        assert saved == LAYERS and densities == tuple(LAYERS)
        assert ks == [math.ceil(d * n) for d, (_, n) in zip(LAYERS, SIZES)]
        assert error is not None and "auto_layers" in error


def test_a_new_choice_replaces_per_layer_densities_in_force():
    """A re-profile's choice of one density for every layer, equal to the
    density in force, still clears the per-layer densities in force."""
    ex = SparseExchange(OPS, LocalWorld(1).comm(0), _auto(), SIZES)
    ex.step_hooks.append(OnlinePlanner("dp", profile=_profile(1e12)))  # dense, none raised
    ex.set_density(1.0, [1.0, 0.25, 0.25, 0.25])  # as an earlier profile might have
    assert ex.auto_layers is not None
    for s in range(2):
        _submit(ex, 0, s)
        ex.wait()
    assert ex.auto_layers is None and ex.densities == (1.0,) * len(SIZES)


def test_the_planner_puts_each_layer_at_its_chosen_density_on_every_rank():
    # Ready order differs from the exchange's layer order: the planner maps by name.
    ready = tuple(reversed(_profile(1e6).layers))
    profile = replace(_profile(1e6), layers=ready)
    choice = choose_density(profile, _auto())
    assert choice.layers and max(choice.layers) > choice.density

    def body(rank, comm):
        ex = SparseExchange(OPS, comm, _auto(), SIZES)
        ex.step_hooks.append(OnlinePlanner("dp", profile=profile))
        for s in range(3):
            _submit(ex, rank, s)
            ex.wait()
        return ex.density, ex.densities, [layer.plan.k for layer in ex.layers]

    r0, r1 = LocalWorld(2).run(body)
    assert r0 == r1
    density, densities, ks = r0
    want = {layer.name: d for layer, d in zip(ready, choice.layers)}
    assert density == choice.density
    assert densities == tuple(want[name] for name, _ in SIZES)
    assert ks == [max(1, math.ceil(want[name] * n)) for name, n in SIZES]


@pytest.mark.parametrize(
    "layers, match, exc",
    [
        ([0.1, 0.1], r"one density per layer \(4\)", ValueError),
        ([0.1, 0.0, 0.1, 0.1], r"layers\[1\]", ValueError),
        ([0.1, 1.5, 0.1, 0.1], r"layers\[1\]", ValueError),
        ("0.1", "sequence of densities", TypeError),
    ],
)
def test_bad_per_layer_densities_name_the_parameter(layers, match, exc):
    ex = SparseExchange(OPS, LocalWorld(1).comm(0), _auto(), SIZES)
    with pytest.raises(exc, match=match):
        ex.set_density(0.01, layers)


@pytest.mark.parametrize("slow", [True, False])
def test_a_per_layer_choice_is_checked_against_the_start_and_undone_together(slow):
    """The check of a choice whose global density equals the starting one but
    whose layers rose: it runs (the choice sends more), may end up to
    auto_slack later, and a revert puts every layer back together. Driven
    through the planner's decisions, as refinement would have traced them."""
    profile = _profile(1e6)
    start = choose_density(profile, _auto()).density  # pretend it was the start
    options, state, view = _under_choice(profile)
    chosen = view.densities
    late = 0.2 + (0.5 if slow else -0.1)
    state, view, _ = _check_steps(
        options, state, view, AutoCheck(start, None, (0.2,) * 3, False), late
    )
    measured = state.density_choice.measured
    assert min(chosen) == start and max(chosen) > start
    assert measured["density"] == start == measured["before_density"]
    assert measured["allowance"] > 0  # the raised layers send more than the start
    assert (state.density_choice.reverted is not None) == slow
    assert view.densities == ((start,) * len(SIZES) if slow else chosen)
    # Kept: the refined profile is planned and the plan settles; reverted:
    # refinement goes on.
    assert state.phase == ("refine" if slow else "run")
