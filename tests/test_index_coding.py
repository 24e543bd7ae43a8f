"""Index codings of the wire format (``dlgs.core.wire``): every coding
decodes exactly, the step's unpack matches the host reference decoder, and
``auto`` picks the smaller message from sizes alone."""

from __future__ import annotations

import math

import numpy as np
import pytest
from local_world import _DT, OPS, LocalWorld, assert_conserved, run_steps, sent_and_residuals

from dlgs.core import GroupLayout, IndexCoding, SparseExchange, SparsityConfig
from dlgs.core.wire import BLOCK, DevicePart, UnpackPlan, member_bytes, unpack

VALUE_DTYPES = ["float32", "float16"] + (["bfloat16"] if "bfloat16" in _DT else [])


class _Backend:
    """One framework's ops with conversions to and from NumPy."""

    def __init__(self, name):
        self.name = name
        if name == "numpy":
            self.ops, self.like = OPS, None
            self.tensor, self.host = np.asarray, np.asarray
        elif name == "torch":
            torch = pytest.importorskip("torch")
            from dlgs.torch._ops import OPS as ops

            self.ops, self.like = ops, torch.zeros(1)
            self.tensor, self.host = torch.from_numpy, lambda x: x.numpy()
        else:
            tf = pytest.importorskip("tensorflow")
            from dlgs.tensorflow._ops import OPS as ops
            from dlgs.tensorflow._ops import _read

            self.ops, self.like = ops, tf.zeros(1)
            self.tensor, self.host = tf.constant, lambda x: _read(x).numpy()


BACKENDS = ["numpy", "torch", "tensorflow"]


def _selection(rng, n, cap, kind):
    """Ascending indices of one member, padded with ``n`` to ``cap``."""
    if kind == "all":
        idx = np.arange(n)
    elif kind == "none":
        idx = np.array([], np.int64)
    elif kind == "gaps":  # blocks with nothing between them: gaps far above 65,536
        side = min((cap - 1) // 2, 1000)
        lo = rng.choice(2000, side, replace=False)
        hi = n - 1 - rng.choice(2000, side, replace=False)
        idx = np.concatenate([lo, hi, [3 * BLOCK + 7]])
    else:  # random, some padding left
        idx = rng.choice(n, max(1, cap - 3), replace=False)
    idx = np.sort(idx)[:cap]
    return np.concatenate([idx, np.full(cap - idx.size, n, np.int64)]).astype(np.int64)


# (sizes, caps, selection kinds): small layers, a layer with block gaps, an
# all-selected layer, a member that selected nothing, block-boundary sizes.
CASES = [
    ((3000, 1200), (30, 12), ("random", "random")),
    ((5 * BLOCK + 11, 40), (64, 40), ("gaps", "all")),
    ((BLOCK - 1, BLOCK, BLOCK + 1), (700, 655, 656), ("random", "none", "random")),
    ((2 * BLOCK, 1500, 4 * BLOCK + 3), (2 * BLOCK, 15, 900), ("all", "random", "gaps")),
]


def _message(rng, layout, kinds, be=None):
    """One rank's packed chunk (as NumPy) and what it must decode to."""
    be = be or _Backend("numpy")
    chunk = layout.new_chunk(be.ops, be.like)
    want_idx, want_val = [], []
    for m, (n, cap, kind) in enumerate(zip(layout.sizes, layout.caps, kinds)):
        source = np.zeros(n + 1, np.float32)
        source[:n] = rng.integers(1, 60, n) * rng.choice([-1, 1], n)  # exact in 16 bits
        idx = _selection(rng, n, cap, kind)
        count = np.array(int((idx < n).sum()), np.int32)
        views = layout.member_views(be.ops, chunk, m)
        layout.pack_into(be.ops, views, m, be.tensor(source), be.tensor(idx), be.tensor(count))
        want_idx.append(layout.dense_offset(m) + idx)
        want_val.append(source[idx].astype(np.float64))
    return be.host(chunk), np.concatenate(want_idx), np.concatenate(want_val)


@pytest.mark.parametrize("coding", ["int32", "block16", "bitmap", "auto"])
@pytest.mark.parametrize("value_dtype", VALUE_DTYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_coding_decodes_exactly(coding, value_dtype, case):
    sizes, caps, kinds = CASES[case]
    layout = GroupLayout(sizes, caps, value_dtype, coding)
    chunk, idx, vals = _message(np.random.default_rng(case), layout, kinds)
    got_vals, got_idx, counts = layout.decode(chunk)
    assert np.array_equal(got_idx, idx)
    assert np.array_equal(got_vals, vals)
    offsets = [layout.dense_offset(m) for m in range(len(sizes))]
    assert list(counts) == [
        int((part - off < n).sum())
        for part, off, n in zip(np.split(idx, np.cumsum(caps)[:-1]), offsets, sizes)
    ]


def test_auto_picks_the_smaller_coding_from_sizes_alone():
    # 2 bytes per index against 4: block16 wins for ordinary densities...
    wide = GroupLayout((10 * BLOCK,), (6554,), "float32", "auto")
    assert wide.index_coding is IndexCoding.BLOCK16
    assert wide.chunk_bytes < GroupLayout((10 * BLOCK,), (6554,), "float32", "int32").chunk_bytes
    # ... but not where one block count per 65,536 elements outweighs the
    # halved indices (fewer than 1 index per 32,768 elements).
    sparse = GroupLayout((100 * BLOCK,), (50,), "float32", "auto")
    assert sparse.index_coding is IndexCoding.INT32
    assert (
        sparse.chunk_bytes <= GroupLayout((100 * BLOCK,), (50,), "float32", "block16").chunk_bytes
    )
    # Above a density of about 1/15, a bit per element beats 2 bytes per index.
    dense = GroupLayout((10 * BLOCK,), (10 * BLOCK // 10,), "float16", "auto")
    assert dense.index_coding is IndexCoding.BITMAP
    for other in ("int32", "block16"):
        assert (
            dense.chunk_bytes < GroupLayout(dense.sizes, dense.caps, "float16", other).chunk_bytes
        )
    at_1_in_20 = GroupLayout((10 * BLOCK,), (10 * BLOCK // 20,), "float16", "auto")
    assert at_1_in_20.index_coding is IndexCoding.BLOCK16
    # The fingerprint says which coding a chunk uses.
    assert wide.fingerprint != GroupLayout((10 * BLOCK,), (6554,), "float32", "int32").fingerprint
    # Bytes per selected element with float16 values: 4 plus the block counts.
    per = (member_bytes(10 * BLOCK, 6554, "float16", "auto") - 4) / 6554
    assert 4.0 <= per < 4.01


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("value_dtype", ["float32", "float16", "bfloat16"])
def test_the_step_unpack_matches_the_reference_decoder(backend, world, value_dtype):
    """Several messages of every coding and several ranks, packed and unpacked
    at once (the exchange's path) by each framework's ops, against the host
    decoder's sum."""
    be = _Backend(backend)
    if value_dtype == "bfloat16" and backend == "numpy" and "bfloat16" not in _DT:
        pytest.skip("NumPy has no bfloat16 without ml_dtypes")
    rng = np.random.default_rng(7)
    layouts, kinds = [], []
    for (sizes, caps, kind), coding in zip(CASES, ["block16", "int32", "block16", "auto"]):
        layouts.append(GroupLayout(sizes, caps, value_dtype, coding))
        kinds.append(kind)
    assert {lay.index_coding for lay in layouts} == set(IndexCoding) - {IndexCoding.AUTO}
    plan = UnpackPlan.of(layouts, world)
    expect = np.zeros(plan.dense_size, np.float64)
    outputs = []
    for lay, kind, base in zip(layouts, kinds, plan.bases):
        rows = []
        for _ in range(world):
            chunk, idx, vals = _message(rng, lay, kind, be)
            got_vals, got_idx, _ = lay.decode(chunk)
            assert np.array_equal(got_idx, idx) and np.array_equal(got_vals, vals)
            np.add.at(expect, base + idx, vals)
            rows.append(chunk)
        outputs.append(np.concatenate(rows))
    ops = be.ops
    dense = ops.zeros(plan.dense_size, "float32", be.like)
    dtype = layouts[0].value_dtype
    parts = [DevicePart(ops, part, dtype, "int32", be.like) for part in plan.parts]
    counts, bad = unpack(
        ops,
        be.tensor(np.concatenate(outputs)),
        world,
        dtype,
        dense,
        1.0,
        parts,
        ops.index_vector(plan.counts, be.like),
    )
    dense = be.host(dense)
    pad = [
        base + lay.dense_offset(m) + n
        for lay, base in zip(layouts, plan.bases)
        for m, n in enumerate(lay.sizes)
    ]
    assert np.all(dense[pad] == 0)
    assert np.array_equal(dense.astype(np.float64), expect)
    assert not np.asarray(be.host(bad)).any()


N_BIG = 5 * BLOCK + 5
BIG = [("big", N_BIG), ("small", 3000)]


def _big_exchange(coding, average=False):
    def make(rank, comm):
        cfg = SparsityConfig(
            density=0.001, controller="topk", index_coding=coding, min_sparse_size=1024
        )
        return SparseExchange(OPS, comm, cfg, BIG, average=average)

    return make


@pytest.mark.parametrize("coding", ["int32", "block16", "bitmap"])
def test_exchange_reconstructs_k_sparse_inputs_across_far_apart_blocks(coding):
    """Through the exchange, 3 ranks: a layer of 6 blocks whose non-zeros sit
    at its two ends (gaps of 5 blocks) is reconstructed exactly when each rank
    has at most k non-zeros."""
    k = math.ceil(0.001 * N_BIG)

    def grads(rank, step):
        g = np.random.default_rng(10 * step + rank)
        big = np.zeros(N_BIG, np.float32)
        ends = [
            g.choice(1000, k // 2, replace=False),
            N_BIG - 1 - g.choice(1000, k - k // 2, replace=False),
        ]
        big[np.concatenate(ends)] = g.integers(1, 9, k) * g.choice([-1, 1], k)
        small = np.zeros(3000, np.float32)
        small[g.choice(3000, 3, replace=False)] = g.integers(1, 9, 3)
        return [big, small]

    def record(rank, ex, out):
        lays = [g.layout for g in ex.groups if g.sparse]
        assert len(lays) == 2 and all(lay.index_coding is IndexCoding(coding) for lay in lays)
        return [np.array(out[i]) for i in range(len(BIG))]

    recs = run_steps(LocalWorld(3, average=False), _big_exchange(coding), grads, 2, record)
    for s in range(2):
        expect = [sum(parts) for parts in zip(*(grads(r, s) for r in range(3)))]
        for rank in range(3):
            for got, want in zip(recs[rank][s], expect):
                assert np.array_equal(got, want)


@pytest.mark.parametrize("coding", ["int32", "block16", "bitmap"])
def test_exchange_conserves_the_gradient_with_block_counts(coding):
    """Dense random inputs, 4 steps: on every rank what it sent (decoded from
    its own chunks) plus its residual equals what it accumulated."""

    def grads(rank, step):
        g = np.random.default_rng(100 + 10 * step + rank)
        return [g.standard_normal(n).astype(np.float32) for _, n in BIG]

    world = LocalWorld(2, average=False)
    recs = run_steps(world, _big_exchange(coding), grads, 4, sent_and_residuals)
    for rank in range(2):
        assert sorted(recs[rank][0][0]) == list(range(len(BIG)))  # every layer sparse
        assert_conserved(grads, recs, rank, range(len(BIG)), 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_values_are_clipped_not_infinite_on_every_backend(backend):
    be = _Backend(backend)
    layout = GroupLayout((6,), (4,), "float16", "int32")
    chunk = layout.new_chunk(be.ops, be.like)
    source = np.array([1e5, -7e4, 3.0, 65519.0, -2.5, 0.0, 0.0], np.float32)
    idx = np.array([0, 1, 2, 3], np.int64)
    views = layout.member_views(be.ops, chunk, 0)
    sent = layout.pack_into(
        be.ops, views, 0, be.tensor(source), be.tensor(idx), be.tensor(np.array(4, np.int32))
    )
    want = [65504.0, -65504.0, 3.0, 65504.0]
    assert list(np.asarray(be.host(sent), np.float64)) == want
    values, _, counts = layout.decode(be.host(chunk))
    assert list(values) == want and list(counts) == [4]
