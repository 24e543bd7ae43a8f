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
