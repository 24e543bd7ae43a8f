"""``budget_split="gradient"``: a byte budget split between layers as a
global top-k of the residuals would (dlgs/core/planning/budget.py).
The split itself against its definition by brute force; the exchange that
applies it, in process on real (thread) ranks: the same densities on every
rank, the budget met within 5%, error feedback exact across the new layout,
density 1.0 exactly the sum, and checkpoints that carry the split."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from local_world import OPS, LocalWorld, run_steps, sent_and_residuals

from dlgs.core import SparseExchange, SparsityConfig
from dlgs.core.planning.budget import FLOOR, SPLIT_AFTER, split_densities
from dlgs.core.planning.layout import plan_messages
from dlgs.core.wire import density_for_budget, layout_bytes, plan_layers

SIZES = [("w0", 60000), ("b0", 40), ("w1", 25000), ("b1", 16), ("w2", 12000)]
NUMEL = [n for _, n in SIZES]
SPARSE_LAYERS = (0, 2, 4)
#: Per-layer gradient scale: the smallest sparse layer's gradient is the largest.
SCALE = (1.0, 1.0, 2.0, 1.0, 8.0)


def integer_grads(rank, step):
    """Small integers (sums and residuals exact in float32 in any order),
    scaled per layer by :data:`SCALE`."""
    g = np.random.default_rng(100 * step + rank)
    return [
        (np.round(g.standard_normal(n) * 4) * s).astype(np.float32)
        for (_, n), s in zip(SIZES, SCALE)
    ]


def config(**kw):
    return SparsityConfig(**{"min_sparse_size": 1024, "controller": "topk", **kw})


def brute_split(sizes, samples, uniform, cfg, target):
    """The definition: of every magnitude in the samples, the lowest whose
    per-layer shares (at least one entry and FLOOR of ``uniform``) fit ``target``."""
    best = None
    for t in sorted({abs(x) for s in samples if s for x in s if x != 0}):
        each = [
            uniform
            if not s
            else min(1.0, max(1.0 / n, FLOOR * uniform, sum(abs(x) >= t for x in s) / len(s)))
            for n, s in zip(sizes, samples)
        ]
        if layout_bytes(sizes, each, cfg) <= target:
            best = each
            break
    return best or [uniform] * len(sizes)


def test_the_split_is_the_lowest_threshold_that_fits_by_brute_force():
    cfg = config(budget=0.05)
    rng = np.random.default_rng(3)
    sizes = [4000, 100, 2500, 1500]
    for trial in range(20):
        samples = [
            list(rng.standard_normal(rng.integers(20, 60)) * rng.uniform(0.1, 10)),
            None,
            list(rng.standard_normal(rng.integers(20, 60)) * rng.uniform(0.1, 10)),
            list(rng.standard_normal(rng.integers(20, 60)) * rng.uniform(0.1, 10)),
        ]
        target = rng.uniform(0.01, 0.3) * 4 * sum(sizes)
        uniform = 0.02
        got = split_densities(sizes, samples, uniform, cfg, target)
        assert got == brute_split(sizes, samples, uniform, cfg, target), trial
        if got != [uniform] * len(sizes):
            assert layout_bytes(sizes, got, cfg) <= target
        assert got[1] == uniform  # no sample: left as it was


def test_a_layer_whose_magnitudes_are_larger_gets_the_larger_share():
    cfg = config(budget=0.05)
    sizes = [10000, 10000]
    small, large = [0.1 * (i + 1) for i in range(100)], [10.0 * (i + 1) for i in range(100)]
    target = 0.05 * 4 * sum(sizes)
    d = split_densities(sizes, [small, large], 0.02, cfg, target)
    assert d[1] > 0.02 > d[0]
    assert d[0] == FLOOR * 0.02  # starved no further than the floor
    # Nothing fits (a target below one entry each): every layer at the uniform density.
    assert split_densities(sizes, [small, large], 0.02, cfg, 10) == [0.02, 0.02]
    with pytest.raises(ValueError, match="one entry per layer"):
        split_densities(sizes, [small], 0.02, cfg, target)


def test_budget_split_is_checked():
    with pytest.raises(
        ValueError, match="budget_split must be one of 'auto', 'uniform', 'gradient'"
    ):
        SparsityConfig(budget=0.1, budget_split="global")
    with pytest.raises(ValueError, match="budget_split='gradient' splits a byte budget"):
        SparsityConfig(budget_split="gradient")
    assert (
        SparsityConfig(budget=0.1, budget_split="gradient").to_dict()["budget_split"] == "gradient"
    )


def test_budget_split_auto_splits_a_budget_and_nothing_else():
    """The default: the split under a budget (it won on Fashion-MNIST and the
    transformer LM), one density without one; the config holds the
    resolved value, which the ranks compare."""
    assert SparsityConfig(budget=0.1).budget_split == "gradient"
    assert SparsityConfig(budget=5000).to_dict()["budget_split"] == "gradient"
    assert SparsityConfig().budget_split == "uniform"
    assert SparsityConfig(budget=0.1, budget_split="uniform").budget_split == "uniform"


def run_split(budget, steps, make=None):
    def record(rank, ex, out):
        sent, residual = sent_and_residuals(rank, ex, out)
        return (
            sent,
            residual,
            ex.densities,
            ex.wire_bytes(),
            [np.array(out[i]) for i in range(len(SIZES))],
        )

    make = make or (
        lambda rank, comm: SparseExchange(
            OPS, comm, config(budget=budget, budget_split="gradient"), SIZES
        )
    )
    return run_steps(LocalWorld(2, average=False), make, integer_grads, steps, record)


def test_the_exchange_splits_once_on_every_rank_alike_within_the_budget():
    budget = 0.05
    target = budget * 4 * sum(NUMEL)
    steps = SPLIT_AFTER + 4
    recs = run_split(budget, steps)
    uniform = density_for_budget(NUMEL, config(budget=budget))
    for s in range(steps):
        assert recs[0][s][2] == recs[1][s][2]  # the same densities on both ranks
        assert recs[0][s][3] <= target  # never over the budget, counted by the exchange
    # Recorded after each step: the densities in force for the next one.
    before, after = recs[0][SPLIT_AFTER - 2][2], recs[0][SPLIT_AFTER - 1][2]
    assert before == (uniform,) * len(SIZES)
    # From the step after the split: the smallest, loudest layer gets more; the largest less.
    assert after[4] > uniform > after[0] >= FLOOR * uniform
    assert recs[0][-1][3] >= 0.95 * target, (recs[0][-1][3], target)
    # Error feedback loses nothing across the new layout (integers: exactly).
    for rank in range(2):
        for i in SPARSE_LAYERS:
            total_in = sum(integer_grads(rank, s)[i].astype(np.float64) for s in range(steps))
            total_sent = sum(recs[rank][s][0][i] for s in range(steps))
            assert np.array_equal(total_sent + recs[rank][-1][1][i], total_in), (rank, i)
    # Every rank applied the same sums.
    for s in range(steps):
        for a, b in zip(recs[0][s][4], recs[1][s][4]):
            assert np.array_equal(a, b)


def test_a_budget_of_the_dense_bytes_is_the_exact_sum_split_or_not():
    recs = run_split(4 * sum(NUMEL), SPLIT_AFTER + 2)
    for s, rank in itertools.product(range(SPLIT_AFTER + 2), range(2)):
        expect = [a + b for a, b in zip(integer_grads(0, s), integer_grads(1, s))]
        for got, want in zip(recs[rank][s][4], expect):
            assert np.array_equal(got, want)
        assert recs[rank][s][2] == (1.0,) * len(SIZES)


def test_a_checkpoint_carries_the_split_and_a_resumed_run_does_not_split_again():
    budget = 0.05
    states = {}

    def save_at_end(rank, comm):
        ex = SparseExchange(OPS, comm, config(budget=budget, budget_split="gradient"), SIZES)
        states[rank] = ex
        return ex

    recs = run_split(budget, SPLIT_AFTER + 1, make=save_at_end)
    split = recs[0][-1][2]
    saved = {r: ex.state_dict() for r, ex in states.items()}

    def resume(rank, comm):
        ex = SparseExchange(OPS, comm, config(budget=budget, budget_split="gradient"), SIZES)
        ex.load_state_dict(saved[rank], np.zeros(1, np.float32))
        return ex

    again = run_split(budget, 3, make=resume)
    for rank in range(2):
        assert [r[2] for r in again[rank]] == [split] * 3


def test_under_a_budget_a_merge_that_costs_more_than_its_members_alone_is_not_made():
    # The door cells' split (tests/parallel): a 128-entry layer at density
    # 0.45 is bitmap-coded alone (260 bytes) but would pay 2 bytes an index
    # in a group with a 16,384-entry layer (block16).
    cfg = config(budget=0.1, min_sparse_size=64)
    sizes, densities = [128, 16384, 128], [0.4453, 0.0415, 0.1094]
    plans = plan_layers(sizes, densities, cfg)
    names = ["a", "b", "c"]

    def messages(budgeted):
        specs = plan_messages(
            plans, names, [((0, 1, 2), True)], "t", cfg.value_dtype, cfg.index_coding,
            budgeted=budgeted,
        )  # fmt: skip
        return [s.members for s in specs], sum(s.layout.chunk_bytes for s in specs)

    merged, merged_bytes = messages(False)
    alone, alone_bytes = messages(True)
    assert merged == [(0, 1, 2)] and alone == [(0,), (1,), (2,)]
    assert alone_bytes == layout_bytes(sizes, densities, cfg) < merged_bytes
    # At one density the codings agree and the merge (one fingerprint) stays.
    plans = plan_layers(sizes, [0.05] * 3, cfg)
    assert messages(True)[0] == [(0, 1, 2)]
