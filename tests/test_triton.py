"""The fused Triton selection (``kernels="triton"``, dlgs/torch/_triton.py)
against the torch path, bit for bit, under Triton's CPU interpreter
(``TRITON_INTERPRET=1``, set in conftest.py before Triton is imported).

Each case runs the same gradients through two in-process worlds of 2 ranks,
one per path, and compares after every step: every sparse message's send
chunk (values, indices, padding, count words, block16 counts, bitmaps), every
rank's reduced gradient, residual and velocity, and the counts. Given the same
threshold the two must agree exactly; the controllers here get the same one
(``topk`` and ``fixed`` from the same magnitudes; ``dynamic`` from a sum of
|a| that is exact for the integer-valued inputs used with it).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from dlgs.core.config import SparsityConfig  # noqa: E402
from dlgs.core.exchange import SparseExchange  # noqa: E402
from dlgs.core.inprocess import InProcessWorld  # noqa: E402
from dlgs.selfcheck import TorchComm  # noqa: E402
from dlgs.torch import _ops, _triton  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.skipif(
        not _triton.INTERPRETED, reason="needs TRITON_INTERPRET=1 before Triton is imported"
    ),
]

# Small blocks of a few tiles each, so that layers of a few thousand elements
# span several blocks and blocks several tiles (by default a block is a tile of
# 1024 until a layer has more than 1024 of them). The interpreter runs each
# tile's operations in NumPy, one program after another: the layers are small.
TILE, MAX_BLOCKS = 512, 4
LAYERS = [("a", 3000), ("b", 9000), ("bias", 10)]
# Past block16's first 65,536-element boundary (its per-block counts).
BIG = [("a", 3000), ("c", 66000), ("bias", 10)]


class _Ops(type(_ops.OPS)):  # type: ignore[misc]
    """The torch ops, with the Triton kernels at a small tile when asked."""

    def __init__(self, kernels):
        self.kernels = kernels

    def fused_selection(self, like, mode):
        if mode == "triton":
            self.kernels = self.kernels or _triton.TritonSelection(TILE, MAX_BLOCKS)
            return self.kernels
        return super().fused_selection(like, mode)


def _grads(layers, kind: str, rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    out = []
    for name, n in layers:
        if kind == "integers":  # sums of |a| are exact in any order
            x = torch.randint(-64, 65, (n,), generator=g).float() / 8
        else:
            x = torch.randn(n, generator=g)
        if kind == "ties":  # many values exactly at the fixed threshold
            x[::3] = 0.5
            x[1::7] = -0.5
        if kind == "huge":  # beyond float16's range, both signs
            x[::197] = 1e6
            x[5::193] = -7e4
            # Halfway between two bfloat16 values (low 16 bits 0x8000), below
            # an even and an odd one: rounding to nearest even tells them apart.
            x[2::101] = 2.0**15 * (1 + 2.0**-8)
            x[3::103] = -(2.0**15) * (1 + 3 * 2.0**-8)
        if kind == "nonfinite" and step == 1 and name != "bias":
            x[0] = math.nan
            x[n // 2] = math.inf
            x[n - 1] = -math.inf
        out.append(x)
    return out


def _run(layers, config, kind, steps, scale, ops):
    world = InProcessWorld(2, timeout=120.0)

    def make(rank):
        loss = None
        if scale is not None:
            value = torch.tensor(scale)
            loss = lambda: value  # noqa: E731
        return SparseExchange(ops, TorchComm(world, rank), config, layers, loss_scale=loss)

    def record(rank, ex, out):
        flat = torch.cat([out[i].reshape(-1).float() for i in sorted(out)]).clone()
        chunks = [g.chunk.clone() for g in ex.groups if g.sparse]
        state = [
            (
                None if layer.residual is None else layer.residual.clone(),
                None if layer.velocity is None else layer.velocity.clone(),
            )
            for layer in ex.layers
        ]
        counts = [(row.get("selected"), row["capacity"]) for row in ex.stats()]
        return flat, chunks, state, counts, ex.last_step_finite

    return world.run_steps(make, lambda r, s: _grads(layers, kind, r, s), steps, record)


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


CASES = [
    ("int32-f32-topk", dict(index_coding="int32"), "normal", None),
    ("block16-f32-topk", dict(index_coding="block16"), "normal", None),
    ("block16-big", dict(index_coding="block16", value_dtype="bfloat16"), "normal", None),
    ("bitmap-f32-topk", dict(index_coding="bitmap", density=0.1), "normal", None),
    ("int32-f16-topk", dict(index_coding="int32", value_dtype="float16"), "huge", None),
    ("block16-bf16-huge", dict(index_coding="block16", value_dtype="bfloat16"), "huge", None),
    (
        "bitmap-f16-topk",
        dict(index_coding="bitmap", value_dtype="float16", density=0.1),
        "huge",
        None,
    ),
    ("ties-over-capacity", dict(controller="fixed", threshold=0.5), "ties", None),
    ("padding", dict(controller="fixed", threshold=3.0, max_ratio=2.0), "normal", None),
    ("nonfinite", dict(index_coding="block16"), "nonfinite", None),
    ("nonfinite-bf16", dict(value_dtype="bfloat16", index_coding="bitmap"), "nonfinite", None),
    ("nonfinite-scaled", dict(value_dtype="float16"), "nonfinite", 1024.0),
    ("dynamic", dict(controller="dynamic", anchor_every=3), "integers", None),
    ("momentum-masking", dict(controller="dynamic", momentum=0.9), "integers", None),
    ("momentum-unmasked", dict(momentum=0.9, momentum_masking=False), "normal", None),
]


@pytest.mark.parametrize("name,opts,kind,scale", CASES, ids=[c[0] for c in CASES])
def test_triton_equals_torch(name, opts, kind, scale):
    opts = {"controller": "topk", "density": 0.02, "min_sparse_size": 1000, **opts}
    steps = 3
    layers = BIG if name.endswith("big") else LAYERS
    ref = _run(layers, SparsityConfig(kernels="torch", **opts), kind, steps, scale, _Ops(None))
    fused_ops = _Ops(None)
    got = _run(layers, SparsityConfig(kernels="triton", **opts), kind, steps, scale, fused_ops)
    assert fused_ops.kernels is not None and fused_ops.kernels.launches > 0
    for r in range(2):
        for s in range(steps):
            (f0, c0, st0, n0, ok0), (f1, c1, st1, n1, ok1) = ref[r][s], got[r][s]
            where = f"rank {r} step {s}"
            assert ok0 == ok1, where
            assert n0 == n1, f"{where}: counts {n0} != {n1}"
            assert len(c0) == len(c1) and c0, where
            for j, (a, b) in enumerate(zip(c0, c1)):
                bad = torch.nonzero(a != b).view(-1)[:8].tolist()
                assert _same(a, b), f"{where}: chunk {j} differs at words {bad}"
            for (ra, va), (rb, vb) in zip(st0, st1):
                if ok0:  # a skipped step's spare buffers are not state
                    assert _same(ra, rb), f"{where}: residual differs"
                    assert _same(va, vb), f"{where}: velocity differs"
            assert _same(f0, f1), f"{where}: reduced gradient differs"
    # The cases do what they say.
    selected = [(c, cap) for rec in ref for step in rec for c, cap in step[3] if c is not None]
    if kind == "nonfinite":
        assert not ref[0][1][4]
    if name == "ties-over-capacity":
        assert any(c > cap for c, cap in selected)
    if name == "padding":
        assert any(c < cap for c, cap in selected)


def test_options():
    with pytest.raises(ValueError, match="kernels must be one of"):
        SparsityConfig(kernels="cuda")
    with pytest.raises(TypeError, match="kernels must be a str"):
        SparsityConfig(kernels=1)
    # auto on a CPU tensor: the torch path, even where Triton interprets.
    assert _ops.OPS.fused_selection(torch.zeros(1), "auto") is None
    assert _ops.OPS.fused_selection(torch.zeros(1), "torch") is None
    assert isinstance(_ops.OPS.fused_selection(torch.zeros(1), "triton"), _triton.TritonSelection)
    with pytest.raises(ValueError, match="tile must be"):
        _triton.TritonSelection(tile=100)
