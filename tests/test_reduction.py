"""The sparse allreduce by regions (dlgs/core/transport/reduction.py) on 2, 3 and 4
thread-ranks: exact where every rank's entries and the union fit, error
feedback conserved per rank where they do not, the same bits on every rank,
non-finite ranks seen everywhere, and the region bounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlgs.core.transport.reduction import SparseReduction, balanced_bounds, even_bounds
from dlgs.inprocess import InProcessWorld
from dlgs.torch._ops import OPS

SIZE = 1000


def selection(rank, parts, per_rank, seed, capacity, size=SIZE):
    """Rank ``rank``'s selected entries: ``per_rank`` distinct indices with
    quarter-integer values (sums of them are exact in float32, float16 and
    bfloat16), ascending, padded with ``size`` to ``capacity``."""
    rng = np.random.default_rng(seed * 100 + rank)
    idx = np.sort(rng.choice(size, size=per_rank, replace=False))
    vals = rng.integers(1, 64, size=per_rank) * 0.25 * rng.choice([-1, 1], per_rank)
    pad = capacity - per_rank
    return (
        torch.tensor(np.concatenate([idx, np.full(pad, size)]), dtype=torch.int64),
        torch.tensor(np.concatenate([vals, np.zeros(pad)]), dtype=torch.float32),
    )


def run(
    parts,
    inputs,
    send_width,
    keep_width,
    theta=0.0,
    flags=None,
    bounds=None,
    size=SIZE,
    value_dtype="float32",
    coding="int32",
):
    """Each rank: pack, alltoall, reduce, allgather, unpack, return_unkept
    into a zero residual. Returns per rank (out, counts, bad, residual, kept,
    the rank's reduction)."""
    world = InProcessWorld(parts, timeout=60.0)

    def body(rank):
        red = SparseReduction(
            OPS, size, parts, rank, send_width, keep_width, torch.zeros(1), value_dtype, coding
        )
        if bounds is not None:
            red.set_bounds(bounds)
        idx, vals = inputs[rank]
        flag = torch.tensor(
            -1 if flags and flags[rank] else int((idx < size).sum()), dtype=torch.int32
        )
        send = red.pack(idx, vals, flag)
        parts_sent = world.meet(rank, "alltoall", send.clone(), list)
        received = torch.cat([p.view(parts, -1)[rank] for p in parts_sent])
        block = red.reduce(received, torch.tensor(theta))
        gathered = world.meet(rank, "allgather", block.clone(), torch.cat)
        out, counts, bad = red.unpack(gathered, 1.0)
        residual = torch.zeros(size + 1)
        red.return_unkept(residual)
        return out.clone(), counts.clone(), bool(bad), residual, red.kept[:size].clone(), red

    return world.run(body)


def dense(idx, vals, size=SIZE):
    out = np.zeros(size + 1)
    np.add.at(out, idx.numpy(), vals.double().numpy())
    return out[:size]


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_inputs_whose_union_fits_come_back_exactly_on_every_rank(parts):
    per_rank = 24
    inputs = [selection(r, parts, per_rank, 1, 32) for r in range(parts)]
    # Room for every entry: each rank's whole selection in any region, the
    # union of every rank's in any owner.
    recs = run(parts, inputs, send_width=per_rank, keep_width=per_rank * parts)
    want = sum(dense(*inputs[r]) for r in range(parts))
    for rank in range(parts):
        out, counts, bad, residual, _, _ = recs[rank]
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
        out, counts, bad, residual, mine, _ = recs[rank]
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
    for _, counts, bad, _, _, _ in recs:
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
    out, _, _, residual0, kept, _ = recs[0]
    assert kept[high].all() and kept[low].all()
    np.testing.assert_array_equal(out[high].numpy(), 2.0)  # rank 1's alone
    np.testing.assert_array_equal(residual0[high].numpy(), 1.0)  # rank 0's, back
    assert not residual0[low].any() and not recs[1][3].any()


# -- wire formats: 16-bit values, compact offsets ---------------------------------------

from dlgs.core.transport.blocks import BlockFormat, block_words, even_width  # noqa: E402
from dlgs.core.transport.reduction import reduction_bytes  # noqa: E402

#: Over three 65,536-element boundaries: compact offsets carry block counts.
LARGE = 200_000


@pytest.mark.parametrize("limit", [1000, 70_000, 300_000])
@pytest.mark.parametrize("value_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("compact", [False, True])
def test_blocks_give_back_the_offsets_exactly_and_the_values_as_written(
    limit, value_dtype, compact
):
    rng = np.random.default_rng(limit)
    rows, width = 3, even_width(37, value_dtype, compact)
    fmt = BlockFormat(OPS, rows, width, limit, value_dtype, compact, torch.zeros(1))
    assert fmt.words == block_words(width, limit, value_dtype, "block16" if compact else "int32")
    offsets = []
    for _ in range(rows):  # ascending, padded with the row's own limit
        n, pad = rng.integers(0, width + 1), rng.integers(1, limit + 1)
        chosen = np.sort(rng.choice(pad, size=n, replace=False))
        offsets.append(np.concatenate([chosen, np.full(width - n, pad)]))
    offsets = torch.tensor(np.concatenate(offsets), dtype=torch.int32)
    values = torch.randn(rows * width, generator=torch.Generator().manual_seed(limit)) * 100
    buffer = torch.zeros(rows * fmt.words, dtype=torch.int32)
    written = fmt.write(buffer, offsets, values, torch.tensor([5, -1, 7], dtype=torch.int32))
    written = written.clone()
    got, vals, words = fmt.read(buffer)
    assert torch.equal(got, offsets)
    assert torch.equal(vals, written)
    assert words.tolist() == [5, -1, 7]
    want = values.to(getattr(torch, value_dtype)).float()
    assert torch.equal(written, want)  # rounded to the wire dtype, nothing else
    if compact and limit > 65536:
        assert fmt.hi == limit // 65536


def test_sixteen_bit_blocks_take_fewer_bytes():
    wide = block_words(1000, LARGE, "float32", "int32")
    assert wide == 1 + 2 * 1000
    assert block_words(1000, LARGE, "float16", "auto") == 1 + LARGE // 65536 + 500 + 500
    sent, kept = reduction_bytes(LARGE, 4000, 4, 1.0, "float16", "auto")
    assert (sent, kept) == (4 * 4 * (1 + 3 + 500 + 500), 4 * (1 + 3 + 500 + 500))


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("value_dtype", ["float16", "bfloat16"])
def test_sixteen_bits_and_compact_offsets_are_exact_where_the_union_fits(parts, value_dtype):
    per_rank = 64
    inputs = [selection(r, parts, per_rank, 5, 80, size=LARGE) for r in range(parts)]
    recs = run(
        parts,
        inputs,
        per_rank,
        per_rank * parts,
        size=LARGE,
        value_dtype=value_dtype,
        coding="auto",
    )
    red = recs[0][5]
    assert red.sending.compact and red.sending.hi == 3 and red.gathered.narrow_values
    want = sum(dense(*inputs[r], size=LARGE) for r in range(parts))
    for out, _, bad, residual, _, _ in recs:
        assert torch.equal(out, recs[0][0])
        np.testing.assert_array_equal(out.double().numpy(), want)
        assert not bad and not residual.any()


@pytest.mark.parametrize("value_dtype", ["float16", "bfloat16"])
def test_what_sixteen_bits_round_off_stays_in_the_residuals(value_dtype):
    """Values and sums not representable in 16 bits, a float16 overflow, and
    narrow blocks: over all ranks, the reduced message plus every residual is
    exactly (to float32 rounding) every rank's selection."""
    parts, per_rank = 3, 120
    inputs = []
    shared, _ = selection(0, parts, per_rank, 6, 128, size=LARGE)  # sums of 3 values each
    for r in range(parts):
        _, vals = selection(r, parts, per_rank, 6, 128, size=LARGE)
        noise = torch.randn(128, generator=torch.Generator().manual_seed(r)) * 37.1
        vals = torch.where(shared < LARGE, vals * 3.3 + noise, vals)
        vals[0] = 1e6  # beyond float16: clipped, the rest stays behind
        inputs.append((shared, vals))
    recs = run(parts, inputs, 30, 25, size=LARGE, value_dtype=value_dtype, coding="auto")
    total = recs[0][0].double().numpy().copy()
    for _, _, _, residual, _, _ in recs:
        assert residual[LARGE] == 0
        total += residual[:LARGE].double().numpy()
    want = sum(dense(*inputs[r], size=LARGE) for r in range(parts))
    np.testing.assert_allclose(total, want, rtol=1e-6, atol=1e-3)
    kept = recs[0][4].numpy()
    assert 0 < kept.sum() <= recs[0][5].keep_width * parts  # 26: rounded up to even
    # The rounding is real: some residual is non-zero where a sum was kept.
    assert any(np.abs(r[3][:LARGE].numpy()[kept]).sum() > 0 for r in recs)


# -- the exchange with transport="reduce" (in-process ranks) ---------------------------

from dlgs.core import SparsityConfig  # noqa: E402
from dlgs.core.exchange.exchange import SparseExchange  # noqa: E402
from dlgs.inprocess import sent_values  # noqa: E402
from dlgs.selfcheck import TorchComm  # noqa: E402

LAYERS = [("w1", 6000), ("b1", 40), ("w2", 3001), ("w3", 2500)]


def exchange_run(parts, config, grads, steps, record, groups=None, plan=None):
    """``record(rank, exchange, outputs)`` after every step of every rank;
    ``groups`` or a ``plan`` (``set_plan``) set on every rank first."""
    world = InProcessWorld(parts, timeout=60.0)

    def make(rank):
        ex = SparseExchange(OPS, TorchComm(world, rank), config, LAYERS, average=False)
        if groups is not None:
            ex.set_plan([(g, None) for g in groups])
        if plan is not None:
            ex.set_plan(plan)
        return ex

    return InProcessWorld(parts).run_steps(make, grads, steps, record)


def flat_out(out):
    return torch.cat([out[i].reshape(-1) for i in sorted(out)]).clone()


def shared_positions(parts, density, seed=7):
    """k-sparse gradients at positions every rank shares, quarter-integer
    values (sums exact), one sign per position on every rank: no sum cancels
    to zero (an owner keeps no zero sum; it would go back into the residuals)."""
    rng = np.random.default_rng(seed)
    where, signs = {}, {}
    for i, (_, n) in enumerate(LAYERS):
        k = max(1, int(np.ceil(density * n)))
        where[i] = np.linspace(0, n - 1, k).astype(int) if n >= 1000 else np.arange(n)
        signs[i] = rng.choice([-1, 1], where[i].size)
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

    return grads


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("groups", [None, [[0, 2], [1], [3]]])
def test_exchange_with_the_reduction_sums_k_sparse_inputs_exactly(parts, groups):
    """Every rank holds at most k non-zeros per layer, at positions shared by
    all ranks (the union fits every block): the sums come back exactly, the
    same bits on every rank, and nothing goes back into a residual."""
    cfg = SparsityConfig(density=0.01, min_sparse_size=1000, transport="reduce", controller="topk")
    grads = shared_positions(parts, 0.01)

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

WORKER = ROOT / "tests" / "parallel" / "reduce_worker.py"


@pytest.fixture(scope="module")
def gloo_four(tmp_path_factory):
    """4 Gloo ranks at density 0.05 and 1.0, one launch. Without tensor fusion:
    which dense tensors Horovod fuses into one ring allreduce depends on
    timing, and at 3 or more ranks where an element falls in the ring decides
    the order of its sum (the ranks agree, two runs may not)."""
    out = tmp_path_factory.mktemp("reduce-gloo-4")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HOROVOD_FUSION_THRESHOLD", "0")
        horovodrun("gloo", 4, [WORKER, out, 0.05, "dense"], timeout=240)
    return load_ranks(out, 4)


@pytest.mark.parametrize(
    "backend,ranks,more", [("gloo", 3, True), ("mpi", 2, False), ("gloo", 4, False)]
)
def test_real_ranks_with_the_reduction_hold_the_same_parameters(
    backend, ranks, more, request, tmp_path, monkeypatch
):
    """Every step bit-identical on every rank. On one launch (``more``) also:
    float16 on the wire, a resumed run equal to the uninterrupted one,
    different widths on different ranks refused on every rank, and
    transport="auto" with one message each way (without tensor fusion, as
    :func:`gloo_four` says why)."""
    if ranks == 4:
        got = request.getfixturevalue("gloo_four")
    else:
        monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")
        args = [WORKER, tmp_path, 0.05] + (["more"] if more else [])
        horovodrun(backend, ranks, args, timeout=240)
        got = load_ranks(tmp_path, ranks)
    for r in got[1:]:
        assert r["dlgs"] == got[0]["dlgs"]  # every step, bit for bit
        assert r["form_a"] == got[0]["form_a"]  # form (a) by the reduction too
    assert got[0]["form_a"][-1] != got[0]["form_a"][0]  # it trains
    assert all(np.isfinite(r["losses"]).all() for r in got)
    assert "sparse" in got[0]["describe"], got[0]["describe"]
    if not more:
        return
    for r in got[1:]:
        assert r["float16"] == got[0]["float16"]
        assert r["routed"] == got[0]["routed"]
    for r in got:
        assert r["resumed"] == r["straight"], f"rank {r['rank']}: the resumed run differs"
        assert r["mismatch"] and "reduce_width" in r["mismatch"], r["mismatch"]
        assert sorted(r["routes"]) == [[0, 0], [1, 0]]  # one message each way
    assert got[0]["float16"] != got[0]["dlgs"]  # float16 did change the wire


def test_real_ranks_with_the_reduction_at_density_one_are_horovods(gloo_four):
    for r in gloo_four:
        assert r["at_one"]["dlgs"] == r["at_one"]["horovod"]
        assert r["at_one"]["form_a"] == r["at_one"]["horovod"]  # form (a) by the reduction too


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
    out, counts, _, residual, kept, _ = recs[0]
    largest = idx[np.argsort(-np.abs(vals))[:5]]
    assert sorted(np.flatnonzero(kept.numpy())) == sorted(largest)
    np.testing.assert_array_equal(out[largest].numpy(), vals[np.argsort(-np.abs(vals))[:5]])
    assert int((residual != 0).sum()) == 35 and int(counts[0]) == 5


# -- balance, 16-bit exchange, resume, bytes (in-process ranks) ---------------------------

MERGED = [[0, 2, 3], [1]]  # one sparse message of 11,501 elements


def skewed(rank, step):
    """Most of layer w1's large entries in its first 600 elements: the first
    of three even regions would take most of every rank's selection."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = [torch.randn(n, generator=g) for _, n in LAYERS]
    out[0][:600] *= 50
    return out


def test_regions_move_to_where_the_ranks_select():
    """Blocks wide enough for the union of the selections where the regions
    share it equally: after the first step's balance the owners keep (almost)
    all of it, where before the first owner's block overflowed."""
    cfg = SparsityConfig(
        density=0.02, min_sparse_size=1000, transport="reduce", reduce_width=3.0, controller="topk"
    )

    def record(rank, ex, out):
        back = sum(int((v != 0).sum()) for v in ex.returned().values())
        return list(ex.transport.reductions[0].bounds), back, ex.transport.rebalances

    recs = exchange_run(3, cfg, skewed, 3, record, MERGED)
    for r in range(3):
        assert [s[0] for s in recs[r]] == [s[0] for s in recs[0]]  # the same bounds everywhere
        assert recs[r][-1][2] == 1  # balanced once, after the first step
    bounds = recs[0][0][0]
    assert bounds[1] < 600 < 11501 // 3, bounds  # the crowded start cut into smaller regions
    first, later = recs[0][0][1], recs[0][2][1]
    assert later < first / 2, (first, later)  # fewer entries held back for a full block


def test_a_sixteen_bit_exchange_loses_nothing_over_the_ranks():
    """float16 on the wire: every rank's gradient over 4 steps is in the
    outputs or in some rank's residual (a sender's rounding in its own, an
    owner's in the owner's); the same bits on every rank."""
    cfg = SparsityConfig(
        density=0.02, min_sparse_size=1000, transport="reduce", value_dtype="float16"
    )
    parts, steps = 3, 4

    def record(rank, ex, out):
        res = {
            i: la.residual[: la.numel].double().numpy().copy()
            for i, la in enumerate(ex.layers)
            if la.residual is not None
        }
        return flat_out(out), res

    recs = exchange_run(parts, cfg, skewed, steps, record, MERGED)
    offsets = np.cumsum([0] + [n for _, n in LAYERS])
    for s in range(steps):
        for r in range(1, parts):
            assert torch.equal(recs[r][s][0], recs[0][s][0])
    for i in sorted(recs[0][-1][1]):
        n = LAYERS[i][1]
        outs = sum(
            recs[0][s][0][offsets[i] : offsets[i] + n].double().numpy() for s in range(steps)
        )
        held = sum(recs[r][-1][1][i] for r in range(parts))
        given = sum(skewed(r, s)[i].double().numpy() for r in range(parts) for s in range(steps))
        np.testing.assert_allclose(outs + held, given, rtol=0, atol=2e-3)


def test_a_resumed_reduction_goes_on_with_the_saved_regions():
    """Saved after 3 steps (the regions balanced at the first), resumed in
    fresh exchanges on every rank: the next 3 steps are the uninterrupted
    run's, bit for bit; without the saved regions they are not."""
    import copy

    cfg = SparsityConfig(density=0.02, min_sparse_size=1000, transport="reduce", reduce_width=1.0)
    states = {}

    def record(rank, ex, out):
        if ex.step == 3:
            states[rank] = copy.deepcopy(ex.state_dict())
        return flat_out(out)

    straight = exchange_run(3, cfg, skewed, 6, record, MERGED)

    def resumed(drop_regions):
        world = InProcessWorld(3, timeout=60.0)

        def make(rank):
            ex = SparseExchange(OPS, TorchComm(world, rank), cfg, LAYERS, average=False)
            state = copy.deepcopy(states[rank])
            if drop_regions:
                state["regions"] = None
            ex.load_state_dict(state, torch.zeros(1))
            return ex

        return world.run_steps(
            make, lambda r, s: skewed(r, s + 3), 3, lambda r, ex, out: flat_out(out)
        )

    again = resumed(False)
    for r in range(3):
        assert all(torch.equal(a, b) for a, b in zip(again[r], straight[r][3:]))
    other = resumed(True)
    assert not all(torch.equal(a, b) for a, b in zip(other[0], straight[0][3:]))


def test_wire_bytes_count_the_reductions_blocks():
    """Four ranks put four blocks into the alltoall and one into the
    allgather per message; the message (under 65,536 elements) takes 16-bit
    offsets with the default coding, int32 ones with ``index_coding="int32"``."""
    base = dict(density=0.02, min_sparse_size=1000, transport="reduce")

    def record(rank, ex, out):
        caps = [g.layout.total_capacity for g in ex.groups if g.sparse]
        return ex.wire_bytes(), caps

    def measure(**options):
        return exchange_run(4, SparsityConfig(**base, **options), skewed, 1, record, MERGED)[0][0]

    (auto, (cap,)), (wide, _), (half, _) = (
        measure(),
        measure(index_coding="int32"),
        measure(value_dtype="float16"),
    )
    dense = 4 * LAYERS[1][1]
    w = int(np.ceil(1.25 * cap / 4))  # the default width
    even = w + w % 2
    assert wide == dense + 4 * 5 * (1 + w + w)
    assert auto == dense + 4 * 5 * (1 + even // 2 + even)
    assert half == dense + 4 * 5 * (1 + even // 2 + even // 2)


# -- transport="auto": each message by allgather or by the reduction ----------------------

from dlgs.core.transport.routing import default_route  # noqa: E402
from dlgs.core.wire import GroupLayout  # noqa: E402


def test_a_plan_routes_each_message_and_every_route_sums_exactly():
    """transport="auto" under a plan that names each sparse message's
    transport: w1 by the reduction, w2 and w3 together by allgather. The
    k-sparse sums come back exactly and alike on every rank, only the reduced
    message hands anything back (nothing here), and wire_bytes() counts each
    message by its route."""
    parts = 3
    cfg = SparsityConfig(
        density=0.01,
        min_sparse_size=1000,
        transport="auto",
        controller="topk",
        reduce_width=3.0,
    )
    plan = [([0], "reduce"), ([2, 3], "allgather"), ([1], False)]
    grads = shared_positions(parts, 0.01, seed=11)

    def record(rank, ex, out):
        sizes = {
            tuple(g.members): (g.layout.dense_size, g.layout.total_capacity, g.layout.chunk_words)
            for g in ex.groups
            if g.sparse
        }
        back = {i: v.clone() for i, v in ex.returned().items()}
        return flat_out(out), list(ex.transport.routes), back, ex.wire_bytes(), sizes

    recs = exchange_run(parts, cfg, grads, 2, record, plan=plan)
    want = sum(torch.cat(grads(r, 0)).double() for r in range(parts)).numpy()
    offsets = np.cumsum([0] + [n for _, n in LAYERS])
    for r in range(parts):
        for step in range(2):
            out, routes, back, wire, sizes = recs[r][step]
            assert torch.equal(out, recs[0][step][0])
            assert routes == [(1, 0), (0, 0)]  # message [0] reduced, [2, 3] gathered
            assert set(back) == {0} and not back[0].any()
    got = recs[0][0][0].double().numpy()
    for i in (0, 2, 3):
        lo, hi = offsets[i], offsets[i + 1]
        np.testing.assert_array_equal(got[lo:hi], want[lo:hi])
    _, _, _, wire, sizes = recs[0][0]
    (size, cap, _), (_, _, words) = sizes[(0,)], sizes[(2, 3)]
    sent, kept = reduction_bytes(size, cap, parts, 3.0, "float32", "auto")
    assert wire == sent + kept + 4 * words + 4 * LAYERS[1][1]


def test_without_a_plan_large_messages_from_three_ranks_are_reduced():
    big = GroupLayout((4_000_000,), (40_000,), "float16", "auto")
    small = GroupLayout((20_000,), (200,), "float16", "auto")
    assert default_route(big, 8, 1.25) == "reduce"
    assert default_route(small, 8, 1.25) == "allgather"
    assert default_route(big, 2, 1.25) == "allgather"  # two ranks: no fewer bytes
    chosen = GroupLayout((20_000,), (200,), "float16", "auto", "reduce")
    assert chosen.fingerprint != small.fingerprint  # a rank routing otherwise is caught
    with pytest.raises(ValueError, match="transport must be"):
        GroupLayout((20_000,), (200,), "float16", "auto", "scatter")


def test_transport_auto_without_an_alltoall_is_the_allgather():
    from dlgs.core.transport.flat import FlatTransport, make_transport

    class NoAllToAll:
        rank, size = 0, 4

    cfg = SparsityConfig(transport="auto")
    assert isinstance(make_transport(cfg, OPS, NoAllToAll()), FlatTransport)
    with pytest.raises(ValueError, match="needs an alltoall"):
        make_transport(SparsityConfig(transport="reduce"), OPS, NoAllToAll())


def test_damaged_saved_regions_are_refused_by_name_and_change_nothing():
    import copy

    cfg = SparsityConfig(density=0.02, min_sparse_size=1000, transport="reduce")
    states = {}

    def record(rank, ex, out):
        states[rank] = copy.deepcopy(ex.state_dict())

    exchange_run(2, cfg, skewed, 1, record, MERGED)
    ex = SparseExchange(OPS, TorchComm(InProcessWorld(2), 0), cfg, LAYERS, average=False)
    for regions in ({"bounds": [[0, 9000, 10]], "steps": 1}, {"bounds": [[0, 10]], "steps": -1}):
        bad = {**copy.deepcopy(states[0]), "regions": regions}
        with pytest.raises(ValueError, match="regions must be"):
            ex.load_state_dict(bad, torch.zeros(1))
        assert ex.step == 0 and ex.transport.state() is None


def test_transport_auto_without_an_alltoall_plans_for_the_allgather():
    from local_world import LocalWorld

    ex = SparseExchange(OPS, LocalWorld(2).comm(0), SparsityConfig(transport="auto"), LAYERS)
    assert ex.transport.name == "flat" and ex.config.transport == "allgather"
