"""The merge planner (pure, framework-free): optimal under its own model,
checked against brute force over every partition and every mode."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest

from dlgs.core.planning.dp import (
    CostModel,
    LayerCost,
    PlanSpec,
    fit_cost_model,
    plan_dp,
    plan_strategy,
    simulate,
)


def random_spec(rng: random.Random, L: int) -> PlanSpec:
    layers = []
    for i in range(L):
        n = int(10 ** rng.uniform(2, 7))
        d = rng.choice([0.001, 0.01, 0.1])
        layers.append(
            LayerCost(
                name=f"l{i}",
                backward=rng.uniform(0, 5e-3) * (n / 1e6) + rng.uniform(0, 1e-4),
                sparse_bytes=4 + 8 * max(1, math.ceil(d * n)),
                dense_bytes=4 * n,
                sparsify=rng.uniform(1e-6, 3e-3) * n / 1e6 + rng.uniform(0, 5e-5),
                pack=rng.uniform(0, 1e-3) * n / 1e6,
            )
        )
    bw = 10 ** rng.uniform(6, 10)  # bytes/s: 8 Mbit/s .. 80 Gbit/s
    return PlanSpec(
        tuple(layers),
        allgather=CostModel(rng.uniform(1e-5, 5e-3), rng.uniform(1, 3) / bw),
        allreduce=CostModel(rng.uniform(1e-5, 5e-3), rng.uniform(1, 3) / bw),
    )


def brute_force(spec: PlanSpec, max_group=None, eligible=None, tail=True, keep_sparse=False):
    """Minimum predicted end over every partition into consecutive groups of at
    most ``max_group`` layers and every admissible sparse/dense choice per group
    (sparse only if all members are ``eligible``; DFS sharing prefixes), and
    with ``tail`` every plan that sends the ineligible layers as one fused
    message (:func:`brute_force_tail`)."""
    L = len(spec.layers)
    best = math.inf
    width = max_group or L
    ok = eligible or [True] * L
    table = [
        [
            [
                spec.group_cost(i, j, sparse)[:2]
                for sparse in (True, False)
                if j - i < width
                and (not sparse or all(ok[i : j + 1]))
                and (sparse or not keep_sparse or not any(ok[i : j + 1]))
            ]
            for j in range(L)
        ]
        for i in range(L)
    ]

    def dfs(i: int, c: float, f: float) -> None:
        nonlocal best
        if i == L:
            best = min(best, f)
            return
        row = table[i]
        for j in range(i, L):
            for compute, link in row[j]:
                c2 = c + compute
                dfs(j + 1, c2, (f if f > c2 else c2) + link)

    dfs(0, 0.0, 0.0)
    if tail and max_group is None and sum(not e for e in ok) >= 2:
        best = min(best, brute_force_tail(spec, ok, keep_sparse))
    return best


def _partitions(n: int):
    """Every split of ``0..n-1`` into consecutive runs ``[(first, last), ...]``."""
    for cuts in itertools.product((False, True), repeat=max(0, n - 1)):
        runs, first = [], 0
        for i, cut in enumerate(cuts):
            if cut:
                runs.append((first, i))
                first = i + 1
        yield runs + [(first, n - 1)]


def brute_force_tail(spec: PlanSpec, ok, keep_sparse=False) -> float:
    """Least end over every plan with the fused tail, written from its
    definition: every ineligible layer in one dense message; the others in
    consecutive runs of the model without them, each sparse or dense, and any
    run of them that meets the tail's place (its last member's) in ready
    order may join it. Priced by :func:`simulate` (per-message latency)."""
    small = [i for i, e in enumerate(ok) if not e]
    # The model's units in ready order: each eligible layer, and the tail where
    # its last member lies.
    units = [[i] for i, e in enumerate(ok) if e and i < small[-1]]
    units += [small] + [[i] for i, e in enumerate(ok) if e and i > small[-1]]
    best = math.inf
    for runs in _partitions(len(units)):
        choices = []
        for a, b in runs:
            members = tuple(sorted(i for u in units[a : b + 1] for i in u))
            modes = [True] if all(ok[i] for i in members) else []
            if not keep_sparse or not any(ok[i] for i in members):
                modes.append(False)
            choices.append([(members, m) for m in modes])
        for plan in itertools.product(*choices):
            best = min(best, simulate(spec, list(plan), batching=False).end)
    return best


def test_dp_is_optimal_against_brute_force():
    rng = random.Random(2024)
    checked = 0
    for trial in range(220):
        L = rng.randint(1, 12) if trial % 20 else 12
        spec = random_spec(rng, L)
        plan = plan_dp(spec)
        expect = brute_force(spec)
        assert math.isclose(plan.end, expect, rel_tol=1e-12, abs_tol=1e-15), (trial, L)
        # The returned plan's own timeline reproduces its prediction.
        again = simulate(spec, [(g.first, g.last, g.sparse) for g in plan.groups])
        assert again.end == plan.end
        checked += 1
    assert checked >= 200


def test_dp_is_optimal_with_max_group_and_eligibility():
    rng = random.Random(99)
    for trial in range(120):
        L = rng.randint(1, 11)
        spec = random_spec(rng, L)
        max_group = rng.choice([1, 2, 3, 5, None])
        eligible = [rng.random() < 0.7 for _ in range(L)]
        plan = plan_dp(spec, max_group=max_group, eligible=eligible)
        expect = brute_force(spec, max_group, eligible)
        assert math.isclose(plan.end, expect, rel_tol=1e-12, abs_tol=1e-15), (trial, L)
        assert plan.exact
        for g in plan.groups:
            assert max_group is None or g.last - g.first < max_group
            assert not g.sparse or all(eligible[i] for i in g.members)


def test_thinned_dp_is_marked_and_never_worse_than_layer_wise():
    rng = random.Random(5)
    thinned = 0
    for _ in range(30):
        spec = random_spec(rng, rng.randint(20, 60))
        exact = plan_dp(spec)
        small = plan_dp(spec, max_front=2)
        assert small.end >= exact.end - 1e-12
        thinned += not small.exact
        for part in (
            [(i, i, True) for i in range(len(spec.layers))],
            [(i, i, False) for i in range(len(spec.layers))],
        ):
            assert small.end <= simulate(spec, part).end + 1e-12
        again = simulate(spec, [(g.first, g.last, g.sparse) for g in small.groups])
        assert math.isclose(again.end, small.end, rel_tol=1e-12)
    assert thinned > 0  # the cap was actually exercised


def test_dp_never_worse_than_any_strategy():
    rng = random.Random(7)
    for _ in range(50):
        spec = random_spec(rng, rng.randint(2, 40))
        dp = plan_dp(spec)
        for name in ("none", "all", "buckets", "greedy"):
            other = plan_strategy(spec, name, numel=[4096] * len(spec.layers))
            assert dp.end <= other.end + 1e-12, name
        # Dense everywhere is also a candidate: the plan is never slower than
        # Horovod's layer-wise allreduce under the model.
        dense = simulate(spec, [(i, i, False) for i in range(len(spec.layers))])
        assert dp.end <= dense.end + 1e-12


def test_dp_merges_when_latency_dominates_and_splits_when_bandwidth_does():
    layers = tuple(LayerCost(f"l{i}", 1e-3, 800, 40_000, 1e-5) for i in range(8))
    latency = PlanSpec(layers, CostModel(5e-2, 1e-9), CostModel(5e-2, 1e-9))
    assert len(plan_dp(latency).groups) == 1
    overlap = PlanSpec(layers, CostModel(1e-6, 1e-7), CostModel(1e-6, 1e-7))
    assert len(plan_dp(overlap).groups) > 1
    # Plentiful bandwidth and costly sparsification: everything dense.
    fast = PlanSpec(
        tuple(LayerCost(f"l{i}", 1e-3, 800, 40_000, 5e-3) for i in range(8)),
        CostModel(1e-6, 1e-12),
        CostModel(1e-6, 1e-12),
    )
    assert not any(plan_dp(fast).modes())


def test_strategies_shapes():
    layers = tuple(LayerCost(f"l{i}", 1e-3, 80, 4000, 1e-5) for i in range(6))
    spec = PlanSpec(layers, CostModel(1e-3, 1e-8), CostModel(1e-3, 1e-8))
    assert len(plan_strategy(spec, "none").groups) == 6
    assert len(plan_strategy(spec, "all").groups) == 1
    eligible = [True, True, False, True, True, True]
    allp = plan_strategy(spec, "all", eligible=eligible)
    assert [(g.first, g.last, g.sparse) for g in allp.groups] == [
        (0, 1, True),
        (2, 2, False),
        (3, 5, True),
    ]
    b = plan_strategy(spec, "buckets", numel=[5000] * 6, bucket_elements=8192)
    assert [len(g.members) for g in b.groups] == [2, 2, 2]
    with pytest.raises(ValueError, match="merge must be one of"):
        plan_strategy(spec, "random")


def test_plan_describe_and_timeline_is_consistent():
    rng = random.Random(3)
    spec = random_spec(rng, 9)
    plan = plan_dp(spec)
    prev_end = 0.0
    for g in plan.groups:
        assert g.start >= g.ready and g.start >= prev_end and g.end >= g.start
        prev_end = g.end
    text = plan.describe([layer.name for layer in spec.layers])
    assert "predicted end" in text and len(text.splitlines()) == 2 + len(plan.groups)


def test_fit_cost_model_recovers_line():
    sizes = [1e3, 1e4, 1e5, 1e6]
    model = fit_cost_model(sizes, [2e-4 + 3e-9 * s for s in sizes])
    assert math.isclose(model.alpha, 2e-4, rel_tol=1e-6)
    assert math.isclose(model.beta, 3e-9, rel_tol=1e-6)
    with pytest.raises(ValueError, match="alpha"):
        CostModel(-1.0, 0.0)


def test_dp_sends_ineligible_layers_only_dense():
    rng = random.Random(11)
    for _ in range(40):
        L = rng.randint(2, 10)
        spec = random_spec(rng, L)
        eligible = [rng.random() < 0.6 for _ in range(L)]
        plan = plan_strategy(spec, "dp", eligible=eligible)
        for g in plan.groups:
            if g.sparse:
                assert all(eligible[i] for i in g.members), (eligible, g)
        # Still optimal among the plans that respect eligibility (brute force),
        # the fused tail of the ineligible layers included.
        best = brute_force(spec, None, eligible)
        assert math.isclose(plan.end, best, rel_tol=1e-12, abs_tol=1e-15)


def _queued_spec(backward):
    """Dense 100-byte messages, alpha 10 ms, 1 ms in a batch, bytes free."""
    layers = tuple(LayerCost(f"l{i}", b, 8, 100, 0.0) for i, b in enumerate(backward))
    cost = CostModel(10e-3, 0.0, batched=1e-3)
    return PlanSpec(layers, allgather=cost, allreduce=cost)


def test_simulate_batches_messages_queued_when_their_batch_formed():
    layerwise = [(i, i, False) for i in range(3)]
    # All three ready at once: the first forms a batch, the other two join it.
    plan = simulate(_queued_spec([0.0, 0.0, 0.0]), layerwise)
    assert [round(g.end * 1e3, 9) for g in plan.groups] == [10.0, 11.0, 12.0]
    # The second is ready after the batch formed (5 ms > 0): a new batch at 10 ms,
    # which the third (ready at 5 ms) joins.
    plan = simulate(_queued_spec([0.0, 5e-3, 0.0]), layerwise)
    assert [round(g.start * 1e3, 9) for g in plan.groups] == [0.0, 10.0, 20.0]
    assert round(plan.end * 1e3, 9) == 21.0
    # Without batching (or without a measured batched latency) every message pays alpha.
    assert round(simulate(_queued_spec([0.0] * 3), layerwise, batching=False).end, 9) == 0.03
    unbatched = PlanSpec(_queued_spec([0.0] * 3).layers, CostModel(10e-3, 0.0), CostModel(10e-3, 0))
    assert round(simulate(unbatched, layerwise).end, 9) == 0.03


def test_cost_model_batched_latency_is_validated():
    assert CostModel(1e-3, 1e-9).in_batch(1000) == pytest.approx(1e-3 + 1e-6)
    assert CostModel(1e-3, 1e-9, batched=1e-4).in_batch(1000) == pytest.approx(1e-4 + 1e-6)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="batched must be a finite float >= 0"):
            CostModel(1e-3, 0.0, batched=bad)


def test_dp_with_batching_never_worse_than_layer_wise_or_one_message():
    rng = random.Random(11)
    for _ in range(40):
        base = random_spec(rng, rng.randint(2, 30))
        spec = PlanSpec(
            base.layers,
            allgather=CostModel(base.allgather.alpha, base.allgather.beta, rng.uniform(0, 1e-4)),
            allreduce=CostModel(base.allreduce.alpha, base.allreduce.beta, rng.uniform(0, 1e-4)),
        )
        dp = plan_dp(spec)
        # Its times are the batched prediction of its own partition.
        again = simulate(spec, [(g.first, g.last, g.sparse) for g in dp.groups])
        assert dp.end == pytest.approx(again.end)
        for name in ("none", "all"):
            assert dp.end <= plan_strategy(spec, name).end + 1e-12, name
        assert dp.end <= simulate(spec, [(i, i, False) for i in range(len(spec.layers))]).end


def test_dp_is_optimal_with_contention_against_brute_force():
    rng = random.Random(5)
    for trial in range(60):
        base = random_spec(rng, rng.randint(1, 9))
        spec = PlanSpec(
            base.layers, base.allgather, base.allreduce, contention=rng.uniform(0, 2e-8)
        )
        plan = plan_dp(spec)
        assert math.isclose(plan.end, brute_force(spec), rel_tol=1e-12, abs_tol=1e-15), trial
    # Contention makes bytes cost compute: a dense plan ends later than without it.
    dense = [(i, i, False) for i in range(len(spec.layers))]
    assert simulate(spec, dense).end >= simulate(replace(spec, contention=0.0), dense).end


def test_the_dp_sends_large_sparse_messages_by_reduction_where_it_is_faster():
    """transport="auto": the planner prices each sparse message both ways
    (netmodel.reduction_cost from the profile's allgather) and keeps the
    faster; at 64 workers ResNet-50's large messages go by reduction and the
    plan ends no later than the allgather-only one. transport="reduce" prices
    every sparse message as a reduction."""
    from dlgs.catalog import catalog_profile
    from dlgs.core.config import SparsityConfig
    from dlgs.core.planning.dp import plan_dp
    from dlgs.core.planning.netmodel import reduction_cost
    from dlgs.core.planning.profile import build_spec

    profile = catalog_profile("resnet50", world_size=64, bandwidth_bps=10e9)
    flat, eligible = build_spec(profile, SparsityConfig(), 0.01)
    auto, _ = build_spec(profile, SparsityConfig(transport="auto"), 0.01)
    forced, _ = build_spec(profile, SparsityConfig(transport="reduce"), 0.01)
    want = reduction_cost(profile.allgather, 64, 1.25)
    assert flat.reduction is None and auto.reduction == want
    assert forced.allgather == want and forced.reduction is None
    base, routed = plan_dp(flat, eligible=eligible), plan_dp(auto, eligible=eligible)
    assert routed.end <= base.end
    assert {g.transport for g in base.groups if g.sparse} == {"allgather"}
    reduced = [g for g in routed.groups if g.transport == "reduce"]
    assert reduced, routed.describe()
    for g in routed.groups:  # each message took the faster of the two
        if g.sparse:
            faster = min(
                ("allgather", auto.allgather(g.nbytes)),
                ("reduce", want(g.nbytes)),
                key=lambda x: x[1],
            )[0]
            assert g.transport == faster
    assert " reduce " in routed.describe()


def test_the_fused_tail_pays_one_latency_for_all_small_layers():
    # Large layers (sparse-eligible) interleaved with small ones, 5 ms a message.
    layers = []
    for i in range(6):
        layers.append(LayerCost(f"w{i}", 2e-3, 800, 400_000, 1e-4, 1e-5))
        layers.append(LayerCost(f"b{i}", 1e-5, 4_000, 400, 0.0, 1e-7))
    cost = CostModel(5e-3, 2e-8)  # a large layer dense: 8 ms more
    spec = PlanSpec(tuple(layers), allgather=cost, allreduce=cost)
    eligible = [i % 2 == 0 for i in range(len(layers))]
    fused = plan_dp(spec, eligible=eligible)
    apart = plan_dp(spec, eligible=eligible, tail=False)
    small = tuple(i for i in range(len(layers)) if not eligible[i])
    tails = [g for g in fused.groups if not g.sparse and set(small) <= set(g.members)]
    assert len(tails) == 1 and tails[0].layers, fused.describe()
    # Without the tail every run of small layers pays its own latency.
    assert not any(g.layers for g in apart.groups)
    assert fused.end < apart.end - 4 * 5e-3
    # It prices itself: simulating its groups again gives its times.
    assert simulate(spec, fused.partition()).end == fused.end
    assert "b0..b5 (6 of 11 layers)" in fused.describe(tuple(m.name for m in layers))


def test_keep_sparse_never_sends_an_eligible_layer_dense_and_stays_optimal():
    """A byte budget's plans (``keep_sparse``): eligible layers only in sparse
    messages; optimal among such plans (brute force, the fused tail included)."""
    rng = random.Random(45)
    for trial in range(120):
        L = rng.randint(1, 10)
        spec = random_spec(rng, L)
        eligible = [rng.random() < 0.7 for _ in range(L)]
        plan = plan_dp(spec, eligible=eligible, keep_sparse=True)
        for g in plan.groups:
            assert g.sparse or not any(eligible[i] for i in g.members), (trial, g)
        expect = brute_force(spec, None, eligible, keep_sparse=True)
        assert math.isclose(plan.end, expect, rel_tol=1e-12, abs_tol=1e-15), (trial, L)
        assert plan.end >= plan_dp(spec, eligible=eligible).end - 1e-15
