"""The sparse allreduce by regions (dlgs/core/reduction.py) on 2, 3 and 4
thread-ranks: exact where every rank's entries and the union fit, error
feedback conserved per rank where they do not, the same bits on every rank,
non-finite ranks seen everywhere, and the region bounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlgs.core.inprocess import InProcessWorld
from dlgs.core.reduction import SparseReduction, balanced_bounds, even_bounds
from dlgs.torch._ops import OPS

SIZE = 1000


def selection(rank, parts, per_rank, seed, capacity):
    """Rank ``rank``'s selected entries: ``per_rank`` distinct indices with
    quarter-integer values (sums of them are exact in float32), ascending,
    padded with SIZE to ``capacity``."""
    rng = np.random.default_rng(seed * 100 + rank)
    idx = np.sort(rng.choice(SIZE, size=per_rank, replace=False))
    vals = rng.integers(1, 64, size=per_rank) * 0.25 * rng.choice([-1, 1], per_rank)
    pad = capacity - per_rank
    return (
        torch.tensor(np.concatenate([idx, np.full(pad, SIZE)]), dtype=torch.int64),
        torch.tensor(np.concatenate([vals, np.zeros(pad)]), dtype=torch.float32),
    )


def run(parts, inputs, send_width, keep_width, theta=0.0, flags=None, bounds=None):
    """Each rank: pack, alltoall, reduce, allgather, unpack, return_unkept
    into a zero residual. Returns per rank (out, counts, bad, residual, kept)."""
    world = InProcessWorld(parts, timeout=60.0)

    def body(rank):
        red = SparseReduction(OPS, SIZE, parts, rank, send_width, keep_width, torch.zeros(1))
        if bounds is not None:
            red.set_bounds(bounds)
        idx, vals = inputs[rank]
        flag = torch.tensor(
            -1 if flags and flags[rank] else int((idx < SIZE).sum()), dtype=torch.int32
        )
        send = red.pack(idx, vals, flag)
        parts_sent = world.meet(rank, "alltoall", send.clone(), list)
        received = torch.cat([p.view(parts, -1)[rank] for p in parts_sent])
        block = red.reduce(received, torch.tensor(theta))
        gathered = world.meet(rank, "allgather", block.clone(), torch.cat)
        out, counts, bad = red.unpack(gathered, 1.0)
        residual = torch.zeros(SIZE + 1)
        red.return_unkept(residual)
        return out.clone(), counts.clone(), bool(bad), residual, red.kept[:SIZE].clone()

    return world.run(body)


def dense(idx, vals):
    out = np.zeros(SIZE + 1)
    np.add.at(out, idx.numpy(), vals.double().numpy())
    return out[:SIZE]


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_inputs_whose_union_fits_come_back_exactly_on_every_rank(parts):
    per_rank = 24
    inputs = [selection(r, parts, per_rank, 1, 32) for r in range(parts)]
    # Room for every entry: each rank's whole selection in any region, the
    # union of every rank's in any owner.
    recs = run(parts, inputs, send_width=per_rank, keep_width=per_rank * parts)
    want = sum(dense(*inputs[r]) for r in range(parts))
    for rank in range(parts):
        out, counts, bad, residual, _ = recs[rank]
        assert torch.equal(out, recs[0][0])  # the same bits everywhere
        np.testing.assert_array_equal(out.double().numpy(), want)
        assert not bad and int(counts.sum()) == int(np.count_nonzero(want))
        assert not residual.any()  # everything was sent and kept


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_what_is_not_sent_or_not_kept_goes_back_into_the_residual(parts):
    """Narrow blocks and a threshold: per rank, what it contributed to the
    kept sums plus what came back is exactly what it selected, and the
    output is the sum of the contributions."""
    per_rank = 80
    inputs = [selection(r, parts, per_rank, 2, 96) for r in range(parts)]
    recs = run(parts, inputs, send_width=12, keep_width=9, theta=4.0)
    kept = recs[0][4]
    contributed = np.zeros(SIZE)
    for rank in range(parts):
        out, counts, bad, residual, mine = recs[rank]
        assert torch.equal(out, recs[0][0]) and torch.equal(mine, kept)
        selected = dense(*inputs[rank])
        back = residual[:SIZE].double().numpy()
        assert residual[SIZE] == 0
        given = selected - back
        # Only kept positions were given, each the rank's whole selected value.
        assert not given[~kept.numpy()].any()
        np.testing.assert_array_equal(
            given[kept.numpy()], selected[kept.numpy()] * (given != 0)[kept.numpy()]
        )
        contributed += given
    out = recs[0][0].double().numpy()
    np.testing.assert_array_equal(out, contributed)
    assert (np.abs(out[kept.numpy()]) >= 4.0).all()
    assert 0 < int(kept.sum()) <= 9 * parts


def test_a_non_finite_rank_makes_every_owner_say_so():
    parts = 3
    inputs = [selection(r, parts, 10, 3, 16) for r in range(parts)]
    recs = run(parts, inputs, send_width=16, keep_width=48, flags=[False, True, False])
    for _, counts, bad, _, _ in recs:
        assert bad and (counts == -1).all()


def test_uneven_bounds_are_used_by_every_rank():
    parts = 3
    inputs = [selection(r, parts, 20, 4, 24) for r in range(parts)]
    bounds = [0, 100, 900, SIZE]
    recs = run(parts, inputs, send_width=20, keep_width=60, bounds=bounds)
    want = sum(dense(*inputs[r]) for r in range(parts))
    np.testing.assert_array_equal(recs[2][0].double().numpy(), want)


def test_even_bounds_cut_equal_regions():
    assert even_bounds(10, 3) == [0, 4, 7, 10]
    assert even_bounds(3, 3) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="non-empty regions"):
        even_bounds(2, 3)


def test_balanced_bounds_share_the_counted_entries():
    edges = list(range(0, 1001, 100))  # 10 bins of 100
    counts = [0, 0, 0, 0, 0, 0, 0, 0, 50, 50]  # everything in the last two bins
    bounds = balanced_bounds(counts, edges, 2)
    assert bounds == [0, 900, 1000]
    assert balanced_bounds([5] * 10, edges, 5) == [0, 200, 400, 600, 800, 1000]
    assert balanced_bounds([0] * 10, edges, 4) == even_bounds(1000, 4)
    # All in one bin: the other regions still get an element each.
    one = balanced_bounds([0] * 9 + [10], edges, 4)
    assert one[0] == 0 and one[-1] == 1000 and all(a < b for a, b in zip(one, one[1:]))


def test_bad_bounds_are_refused_by_name():
    red = SparseReduction(OPS, SIZE, 2, 0, 4, 4, torch.zeros(1))
    with pytest.raises(ValueError, match="strictly ascending"):
        red.set_bounds([0, 500, 500])
    with pytest.raises(ValueError, match="rank must be in"):
        SparseReduction(OPS, SIZE, 2, 2, 4, 4, torch.zeros(1))


def test_an_entry_one_rank_could_not_send_is_returned_even_where_another_rank_kept_it():
    """Rank 0 selects 100-109 and 200-209 in region 0 but sends only its first
    10 (100-109); rank 1 sends 200-209, which the owner keeps: rank 0's
    unsent 200-209 must still come back into its residual."""
    low, high = np.arange(100, 110), np.arange(200, 210)

    def entries(idx, value):
        pad = 24 - idx.size
        return (
            torch.tensor(np.concatenate([idx, np.full(pad, SIZE)]), dtype=torch.int64),
            torch.tensor(
                np.concatenate([np.full(idx.size, value), np.zeros(pad)]), dtype=torch.float32
            ),
        )

    inputs = [entries(np.concatenate([low, high]), 1.0), entries(high, 2.0)]
    recs = run(2, inputs, send_width=10, keep_width=20)
    out, _, _, residual0, kept = recs[0]
    assert kept[high].all() and kept[low].all()
    np.testing.assert_array_equal(out[high].numpy(), 2.0)  # rank 1's alone
    np.testing.assert_array_equal(residual0[high].numpy(), 1.0)  # rank 0's, back
    assert not residual0[low].any() and not recs[1][3].any()


# -- the exchange with transport="reduce" (in-process ranks) ---------------------------

from dlgs.core import SparsityConfig  # noqa: E402
from dlgs.core.exchange import SparseExchange  # noqa: E402
from dlgs.core.inprocess import sent_values  # noqa: E402
from dlgs.selfcheck import TorchComm  # noqa: E402

LAYERS = [("w1", 6000), ("b1", 40), ("w2", 3001), ("w3", 2500)]


def exchange_run(parts, config, grads, steps, record, groups=None):
    """``record(rank, exchange, outputs)`` after every step of every rank."""
    world = InProcessWorld(parts, timeout=60.0)

    def make(rank):
        ex = SparseExchange(OPS, TorchComm(world, rank), config, LAYERS, average=False)
        if groups is not None:
            ex.set_groups(groups)
        return ex

    return InProcessWorld(parts).run_steps(make, grads, steps, record)


def flat_out(out):
    return torch.cat([out[i].reshape(-1) for i in sorted(out)]).clone()


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("groups", [None, [[0, 2], [1], [3]]])
def test_exchange_with_the_reduction_sums_k_sparse_inputs_exactly(parts, groups):
    """Every rank holds at most k non-zeros per layer, at positions shared by
    all ranks (the union fits every block): the sums come back exactly, the
    same bits on every rank, and nothing goes back into a residual."""
    cfg = SparsityConfig(density=0.01, min_sparse_size=1000, transport="reduce", controller="topk")
    rng = np.random.default_rng(7)
    where = {}
    for i, (_, n) in enumerate(LAYERS):
        k = max(1, int(np.ceil(0.01 * n)))
        where[i] = np.linspace(0, n - 1, k).astype(int) if n >= 1000 else np.arange(n)
    # One sign per position on every rank: no sum cancels to zero (an owner
    # keeps no zero sum; it would go back into the residuals).
    signs = {i: rng.choice([-1, 1], where[i].size) for i in range(len(LAYERS))}
    values = {
        (r, i): rng.integers(1, 64, size=where[i].size) * 0.25 * signs[i]
        for r in range(parts)
        for i in range(len(LAYERS))
    }

    def grads(rank, step):
        out = []
        for i, (_, n) in enumerate(LAYERS):
            g = np.zeros(n)
            g[where[i]] = values[rank, i]
            out.append(torch.tensor(g, dtype=torch.float32))
        return out

    def record(rank, ex, out):
        return flat_out(out), {i: v.clone() for i, v in ex.returned().items()}

    recs = exchange_run(parts, cfg, grads, 1, record, groups)
    want = sum(torch.cat(grads(r, 0)).double() for r in range(parts)).numpy()
    got = recs[0][0][0].double().numpy()
    offsets = np.cumsum([0] + [n for _, n in LAYERS])
    for r in range(parts):
        assert torch.equal(recs[r][0][0], recs[0][0][0])
        assert set(recs[r][0][1]) == {0, 2, 3}  # the sparse layers
        assert not any(v.any() for v in recs[r][0][1].values())  # nothing came back
    for i, (_, n) in enumerate(LAYERS):
        lo, hi = offsets[i], offsets[i] + n
        if n >= 1000:  # sparse: the sum, exactly
            np.testing.assert_array_equal(got[lo:hi], want[lo:hi])
        else:  # dense: the in-process allreduce averages
            np.testing.assert_allclose(got[lo:hi], want[lo:hi] / parts, rtol=1e-6)


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_exchange_with_the_reduction_conserves_every_ranks_gradient(parts):
    """Per rank over 4 steps: what it accumulated is its residual plus what it
    contributed (selected, less what came back); the contributions of every
    rank are the outputs; the same bits on every rank."""
    cfg = SparsityConfig(density=0.02, min_sparse_size=1000, transport="reduce")
    steps = 4

    def grads(rank, step):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return [torch.randn(n, generator=g) for _, n in LAYERS]

    def record(rank, ex, out):
        sent = sent_values(ex)
        back = {i: v.double().numpy().copy() for i, v in ex.returned().items()}
        res = {
            i: la.residual[: la.numel].double().numpy().copy()
            for i, la in enumerate(ex.layers)
            if la.residual is not None
        }
        return flat_out(out), sent, back, res

    recs = exchange_run(parts, cfg, grads, steps, record)
    offsets = np.cumsum([0] + [n for _, n in LAYERS])
    for s in range(steps):
        for r in range(1, parts):
            assert torch.equal(recs[r][s][0], recs[0][s][0])
    sparse = sorted(recs[0][-1][3])
    assert sparse, "no sparse layer"
    for i in sparse:
        n = LAYERS[i][1]
        total_out = np.zeros(n)
        for s in range(steps):
            total_out += recs[0][s][0][offsets[i] : offsets[i] + n].double().numpy()
        given_all = np.zeros(n)
        for r in range(parts):
            accumulated = sum(grads(r, s)[i].double().numpy() for s in range(steps))
            given = sum(recs[r][s][1][i] - recs[r][s][2][i] for s in range(steps))
            np.testing.assert_allclose(given + recs[r][-1][3][i], accumulated, rtol=0, atol=1e-5)
            given_all += given
        np.testing.assert_allclose(given_all, total_out, rtol=0, atol=1e-4)


# -- real ranks under horovodrun -------------------------------------------------------

from conftest import ROOT, horovodrun, load_ranks  # noqa: E402


@pytest.mark.parametrize("backend,ranks", [("gloo", 3), ("mpi", 2), ("gloo", 4)])
def test_real_ranks_with_the_reduction_hold_the_same_parameters(backend, ranks, tmp_path):
    worker = ROOT / "tests" / "parallel" / "reduce_worker.py"
    horovodrun(backend, ranks, [worker, tmp_path, 0.05], timeout=240)
    got = load_ranks(tmp_path, ranks)
    for r in got[1:]:
        assert r["dlgs"] == got[0]["dlgs"]  # every step, bit for bit
    assert all(np.isfinite(r["losses"]).all() for r in got)
    assert "sparse" in got[0]["describe"], got[0]["describe"]


def test_real_ranks_with_the_reduction_at_density_one_are_horovods(tmp_path):
    worker = ROOT / "tests" / "parallel" / "reduce_worker.py"
    horovodrun("gloo", 2, [worker, tmp_path, 1.0], timeout=240)
    for r in load_ranks(tmp_path, 2):
        assert r["dlgs"] == r["horovod"]


def test_each_owner_keeps_its_largest_sums():
    """Rank 0 alone selects 40 entries of distinct magnitudes in region 0; its
    owner keeps the 5 largest, and the other 35 go back."""
    idx = np.arange(0, 400, 10)
    vals = np.arange(1, 41, dtype=np.float64) * np.where(idx % 20 == 0, 1, -1)
    pad = 48 - idx.size
    mine = (
        torch.tensor(np.concatenate([idx, np.full(pad, SIZE)]), dtype=torch.int64),
        torch.tensor(np.concatenate([vals, np.zeros(pad)]), dtype=torch.float32),
    )
    none = (torch.full((48,), SIZE, dtype=torch.int64), torch.zeros(48))
    recs = run(2, [mine, none], send_width=40, keep_width=5)
    out, counts, _, residual, kept = recs[0]
    largest = idx[np.argsort(-np.abs(vals))[:5]]
    assert sorted(np.flatnonzero(kept.numpy())) == sorted(largest)
    np.testing.assert_array_equal(out[largest].numpy(), vals[np.argsort(-np.abs(vals))[:5]])
    assert int((residual != 0).sum()) == 35 and int(counts[0]) == 5
