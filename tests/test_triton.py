"""The fused Triton selection (``kernels="triton"``, dlgs/torch/_triton.py)
against the torch path, bit for bit, under Triton's CPU interpreter
(``TRITON_INTERPRET=1``, set in conftest.py before Triton is imported).

Each of the self-check's ``fused_equal`` cases (:data:`dlgs.selfcheck.FUSED_CASES`:
every index coding and value dtype, ties at the threshold, counts past the
capacity, padding, NaN and infinities, loss scaling, the dynamic controller,
momentum with and without masking) runs the same gradients through two
in-process worlds of 2 ranks, one per path, and compares after every step
every sparse message's send chunk, every rank's reduced gradient, residuals,
velocities and counts. On a GPU, ``python -m dlgs.selfcheck --device cuda``
runs the same comparison with the default tile.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dlgs import selfcheck  # noqa: E402
from dlgs.core.config import SparsityConfig  # noqa: E402
from dlgs.torch import _ops, _triton  # noqa: E402

pytestmark = [
    # inf - inf in a residual on a (discarded) non-finite step, as the torch path.
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.skipif(
        not _triton.INTERPRETED, reason="needs TRITON_INTERPRET=1 before Triton is imported"
    ),
]

# Small blocks of a few tiles each, so that layers of a few thousand elements
# span several blocks and blocks several tiles (by default a block is a tile of
# 1024 until a layer has more than 1024 of them). The interpreter runs each
# tile's operations in NumPy, one program after another: hence small layers.
TILE, MAX_BLOCKS = 512, 4


class _SmallTiles(type(_ops.OPS)):  # type: ignore[misc]
    """The torch ops, with the Triton kernels at a small tile."""

    kernels = None

    def fused_selection(self, like, mode):
        if mode == "triton":
            if self.kernels is None:
                self.kernels = _triton.TritonSelection(TILE, MAX_BLOCKS)
            return self.kernels
        return super().fused_selection(like, mode)


@pytest.mark.parametrize("case", list(selfcheck.FUSED_CASES))
def test_triton_equals_torch(case):
    ops = _SmallTiles()
    row = selfcheck.compare_kernels(torch.device("cpu"), case, ops=ops)
    assert row.ok, row.detail
    assert ops.kernels is not None and ops.kernels.launches > 0


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
    with pytest.raises(ValueError, match="max_blocks must be"):
        _triton.TritonSelection(max_blocks=3)
