"""``density="auto"`` (issue 15): the planner picks the highest density whose
predicted communication ends within back-propagation plus a slack, the same on
every rank, kept across a checkpoint; bad combinations are refused."""

from __future__ import annotations

import numpy as np
import pytest
from local_world import OPS, LocalWorld

from dlgs._options import build_configs
from dlgs.core import SparseExchange, SparsityConfig
from dlgs.core.planner import CostModel
from dlgs.core.profile import AUTO_LADDER, LayerProfile, Profile, choose_density
from dlgs.core.profiler import OnlinePlanner

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
        fresh.step_hooks.append(OnlinePlanner("dp"))
        fresh.load_state_dict(state, like=None)
        for i, g in enumerate(_grads(rank, 4)):
            fresh.submit(i, g)
        out = fresh.wait()
        return (
            seen,
            fresh.density,
            [(g.members, g.sparse) for g in fresh.groups],
            [np.array(out[i]) for i in range(len(SIZES))],
        )

    r0, r1 = LocalWorld(2).run(body)
    assert r0[:3] == r1[:3], "ranks chose or laid out differently"
    for a, b in zip(r0[3], r1[3]):
        assert np.array_equal(a, b)
    seen, resumed_density, resumed_layout, _ = r0
    # The first step runs at the starting density; the choice is in force after.
    assert seen[0][0] == 0.01 and seen[-1][0] == expect
    assert resumed_density == expect and resumed_layout == seen[-1][1]


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
        return seen, choice.density, choice.measured, choice.reverted, planner.settled

    r0, r1 = LocalWorld(2).run(body)
    assert r0 == r1, "ranks disagree on the check or the density"
    seen, chosen, measured, reverted, settled = r0
    # Profiled at the starting density, then dense (free communication, no
    # selection cost) was chosen and its steps timed.
    assert seen[0] == 0.01 and chosen == 1.0 and 1.0 in seen, seen
    assert settled and measured["density"] == 1.0 and measured["before_density"] == 0.01
    assert measured["allowance"] > 0  # a higher density may cost auto_slack more
    if slow == 1.0:
        assert measured["plan"] > measured["layerwise"] + 0.4
        assert not measured["kept"] and reverted == 0.01 and seen[-1] == 0.01
    else:
        assert measured["plan"] < measured["layerwise"] - 0.4
        assert measured["kept"] and reverted is None and seen[-1] == 1.0


@pytest.mark.parametrize(
    "kwargs, match, exc",
    [
        (dict(density="fast"), "density", TypeError),
        (dict(density="auto", warmup="dgc", warmup_steps=5), "warmup", ValueError),
        (dict(density="auto", density_floor=0.0), "density_floor", ValueError),
        (dict(density="auto", auto_slack=-0.1), "auto_slack", ValueError),
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
