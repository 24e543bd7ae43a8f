"""The fused Triton selection (``kernels="triton"``, dlgs/torch/_triton.py)
against the torch path, bit for bit, under Triton's CPU interpreter
(``TRITON_INTERPRET=1``).

Each of the self-check's ``fused_equal`` cases (:data:`dlgs.selfcheck.FUSED_CASES`:
every index coding and value dtype, ties at the threshold, counts past the
capacity, padding, NaN and infinities, loss scaling, the dynamic controller,
momentum with and without masking) runs the same gradients through two
in-process worlds of 2 ranks, one per path, and compares after every step
every sparse message's send chunk, every rank's reduced gradient, residuals,
velocities and counts. On a GPU, ``python -m dlgs.selfcheck --device cuda``
runs the same comparison with the default tile.

The cases run in a child process with Triton on its path (tools/install.sh
keeps Triton off the suite's: torch imports it whenever it finds it, and
Triton's library beside TensorFlow's, which other tests load, crashes a
process).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, TRITON_PATH, horovodrun, triton_env, triton_installed

pytestmark = pytest.mark.skipif(
    not triton_installed(), reason="Triton is not installed (tools/install.sh, x86-64 Linux)"
)

# Small blocks of a few tiles each, so that layers of a few thousand elements
# span several blocks and blocks several tiles (by default a block is a tile of
# 1024 until a layer has more than 1024 of them). The interpreter runs each
# tile's operations in NumPy, one program after another: hence small layers.
CHILD = r"""
import json, sys, warnings
import torch
from dlgs import selfcheck
from dlgs.torch import _ops, _triton
assert _triton.INTERPRETED
# inf - inf in a residual on a (discarded) non-finite step, as the torch path.
warnings.filterwarnings("ignore", "invalid value encountered")

class SmallTiles(type(_ops.OPS)):
    kernels = None
    def fused_selection(self, like, mode):
        if mode == "triton":
            if self.kernels is None:
                self.kernels = _triton.TritonSelection(512, 4)
            return self.kernels
        return super().fused_selection(like, mode)

out = {}
for case in selfcheck.FUSED_CASES:
    ops = SmallTiles()
    row = selfcheck.compare_kernels(torch.device("cpu"), case, ops=ops)
    out[case] = [row.ok, row.detail, ops.kernels.launches if ops.kernels else 0]
json.dump(out, sys.stdout)
"""

OPTIONS = r"""
import torch, pytest
from dlgs.core.config import SparsityConfig
from dlgs.torch import _ops, _triton
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
print("ok")
"""


# Every torch door with kernels="triton" on 2 ranks (horovodrun; the DDP hook
# on a torch.distributed Gloo group of the same ranks): the door's exchange
# selects with the fused kernels (launches counted) and the model trains.
DOORS = r"""
import json, sys, torch, torch.distributed as dist, horovod.torch as hvd
import torch.nn.functional as F
import dlgs.torch, dlgs.torch.ddp
hvd.init()
dist.init_process_group(
    "gloo", init_method=f"file://{sys.argv[2]}", rank=hvd.rank(), world_size=hvd.size()
)
opts = dict(density=0.05, min_sparse_size=256, merge="none", kernels="triton")
SGD = torch.optim.SGD


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def train(model, opt, engine):
    before = [p.detach().clone() for p in model.parameters()]
    for s in range(3):
        opt.zero_grad()
        x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
        F.cross_entropy(model(x), y).backward()
        opt.step()
    kernels = engine.exchange.sender.kernels
    moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return type(kernels).__name__, kernels.launches if kernels else 0, moved


out = {}
m = net()
named = m.named_parameters
opt = dlgs.torch.DistributedOptimizer(SGD(m.parameters(), lr=0.1), named_parameters=named(), **opts)
out["b"] = train(m, opt, opt.dlgs)
m = net()
comp = dlgs.torch.Compression(m.named_parameters(), **opts)
opt = hvd.DistributedOptimizer(
    SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(), compression=comp
)
comp.attach(opt)
out["a"] = train(m, opt, comp.dlgs)
m = torch.nn.parallel.DistributedDataParallel(net())
state = dlgs.torch.ddp.SparseState(m, **opts)
m.register_comm_hook(state, dlgs.torch.ddp.sparse_hook)
out["ddp"] = train(m, SGD(m.parameters(), lr=0.1), state.dlgs)
if hvd.rank() == 0:
    json.dump(out, open(sys.argv[1], "w"))
"""


def _child(code: str, interpret: str = "1") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=triton_env(interpret),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def fused_rows():
    proc = _child(CHILD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _cases():
    sys.path.insert(0, str(ROOT))
    from dlgs.selfcheck import FUSED_CASES  # imports torch, not Triton

    return list(FUSED_CASES)


@pytest.mark.parametrize("case", _cases())
def test_triton_equals_torch(fused_rows, case):
    ok, detail, launches = fused_rows[case]
    assert ok, detail
    assert launches > 0


def test_options():
    proc = _child(OPTIONS)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_forcing_triton_on_a_cpu_tensor_without_the_interpreter_says_why():
    code = (
        "import torch\nfrom dlgs.torch import _ops\n"
        "try:\n    _ops.OPS.fused_selection(torch.zeros(1), 'triton')\n"
        "except ValueError as err:\n    print(err)\n"
    )
    proc = _child(code, interpret="0")
    assert "TRITON_INTERPRET=1" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_every_torch_door_selects_with_the_fused_kernels(tmp_path, monkeypatch):
    """Forms (b) and (a) and the DDP hook with kernels="triton" on 2 real
    ranks: the door's exchange runs the fused kernels and the model trains."""
    script, out = tmp_path / "doors.py", tmp_path / "doors.json"
    script.write_text(DOORS)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    horovodrun("gloo", 2, [script, out, tmp_path / "store"], timeout=300, extra_path=TRITON_PATH)
    found = json.loads(out.read_text())
    for door in ("b", "a", "ddp"):
        kind, launches, moved = found[door]
        assert kind == "TritonSelection" and launches > 0 and moved, (door, found[door])
