"""``python -m dlgs.selfcheck``: dlgs' engine on one device, with torch and nothing else.

No Horovod and no network: an in-process world of 2 to 64 ranks (threads of
this process, :class:`dlgs.inprocess.InProcessWorld`) runs the real
exchange (selection, packing, every index coding and value dtype, unpacking,
residuals, controllers, momentum correction, loss scaling, non-finite
handling) on the device, its collectives done in-process. It checks, and
reports as CSV and Markdown:

* ``identical``: every rank's outputs bit-identical, every case;
* ``exact`` / ``conserved``: inputs with at most k non-zeros per rank come back
  exactly; per rank, what was sent plus the residual equals the accumulated
  input (error feedback loses nothing);
* ``nonfinite``: a NaN on one rank is flagged on every rank and leaves the state;
* ``cpu_equal``: on a GPU, the ``topk`` controller's outputs equal the CPU
  path's bit for bit (its selection is exact; the ``dynamic`` controller's
  threshold is a float32 product whose rounding may differ by an ulp between
  devices, so its selections may differ at the threshold: not compared);
* ``fused_equal``: where the fused Triton kernels run (CUDA with Triton, or
  Triton's CPU interpreter), each of :data:`FUSED_CASES` through both paths:
  messages, reduced gradients, residuals and counts bit-identical;
* ``adversarial``: every rank selecting the same indices with values mixing
  1e8 and 1, unpacked 100 times: the same bits every time on every rank;
* ``host_reads``: reads of device values per step (planned: one, two on an
  anchor step); on CUDA the hot path runs under
  ``torch.cuda.set_sync_debug_mode("error")``, so an unplanned sync fails;
* ``launches``: operations (CPU) or CUDA kernels per step, per sparse layer,
  and for one sparse layer's selection and packing, for both paths;
* ``memory``: device memory flat over 20 steps (CUDA);
* ``primitives``: int64 -> int16 wrap at 32767/32768/65535/65536/131071,
  ``searchsorted`` into a chunk view, ``nonzero_static`` below/at/above its size
  and empty, non-finite detection at the first/middle/last element of odd sizes;
* ``deterministic``: a full step under ``torch.use_deterministic_algorithms(True)``;
* ``timing``: selection (and packing) and unpacking times by size, ranks and
  path, the selection's share of the device's copy bandwidth.

``--quick`` (seconds on this CPU) runs in the test suite so that the check
cannot rot before a GPU comes; ``--device cuda`` is the one command a session
with a GPU runs (within 8 minutes on one GPU)::

    python -m dlgs.selfcheck --device cpu --quick --out /tmp/selfcheck
    python -m dlgs.selfcheck --device cuda --out benchmarks/results/selfcheck-cuda

Exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import csv
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .core import SparseExchange, SparsityConfig
from .inprocess import InProcessWorld, sent_values
from .torch._ops import OPS

__all__ = ["TorchComm", "TorchNodeComm", "main", "run_checks"]

logger = logging.getLogger(__name__)

#: Layers of the check model (backward order): two sparse, a small dense, a bias.
LAYERS = [("w1", 6000), ("b1", 40), ("w2", 3000), ("b2", 10)]
#: The fused kernels' cases add a layer past block16's first 65,536-element boundary.
BIG = [("w1", 6000), ("w9", 66000), ("b2", 10)]

#: ``SparsityConfig.kernels`` of every check but those comparing the two paths
#: (``--kernels``; "auto": the fused kernels on CUDA where Triton imports).
KERNELS = "auto"


def _config(**opts: Any) -> SparsityConfig:
    return SparsityConfig(**{"density": 0.02, "min_sparse_size": 1000, "kernels": KERNELS, **opts})


class TorchComm:
    """:class:`~dlgs.core.exchange.exchange.Collectives` on an :class:`InProcessWorld`,
    with torch tensors: gathers concatenate the ranks' chunks in rank order;
    reductions sum in float64, in rank order, then average."""

    included = True

    def __init__(self, world: InProcessWorld, rank: int):
        self.world, self.rank, self.size = world, rank, world.size

    def allgather_async(self, chunk, name):
        return ("gather", name, chunk.clone())

    def alltoall_async(self, tensor, name):
        return ("alltoall", name, tensor.clone())

    def allreduce_async(self, tensor, name):
        return ("reduce", name, tensor)

    def synchronize(self, handle):
        kind, name, tensor = handle
        if kind == "gather":
            return self.world.meet(self.rank, name, tensor, torch.cat)
        if kind == "alltoall":
            parts = self.world.meet(self.rank, name, tensor, list)
            return torch.cat([p.view(self.size, -1)[self.rank] for p in parts])

        def average(parts):
            total = parts[0].double().clone()
            for p in parts[1:]:
                total += p.double()
            return total / len(parts)

        tensor.copy_(self.world.meet(self.rank, name, tensor, average).to(tensor.dtype))
        return tensor

    def broadcast_object(self, obj):
        return self.world.meet(self.rank, "broadcast_object", obj, lambda parts: parts[0])

    def allgather_object(self, obj, name):
        return self.world.meet(self.rank, name, obj, list)


class TorchNodeComm:
    """:class:`~dlgs.core.transport.hierarchical.NodeCollectives` on an
    :class:`InProcessWorld` of one node's ranks: the reduce-scatter averages in
    float64, in rank order; every rank gets its block of the same result."""

    def __init__(self, world: InProcessWorld, rank: int):
        self.world, self.rank, self.size = world, rank, world.size

    @staticmethod
    def _mean(parts):
        total = parts[0].double().clone()
        for p in parts[1:]:
            total += p.double()
        return (total / len(parts)).to(parts[0].dtype)

    def reducescatter_async(self, tensor, name):
        return ("scatter", self.world.post(self.rank, name, tensor.clone(), self._mean))

    def allreduce_async(self, tensor, name):
        return ("reduce", self.world.post(self.rank, name, tensor.clone(), self._mean))

    def allgather_async(self, tensor, name):
        return ("gather", self.world.post(self.rank, name, tensor.clone(), torch.cat))

    def poll(self, handle):
        return self.world.done(handle[1])

    def synchronize(self, handle):
        kind, meeting = handle
        full = self.world.collect(meeting)
        if kind != "scatter":
            return full
        return full.view(self.size, -1)[self.rank].clone()


@dataclass
class Row:
    """One checked property of one case."""

    check: str
    case: str
    ranks: int
    ok: bool
    detail: str = ""


def _grads(rank: int, step: int, device, *, sparse_k: Optional[Dict[str, int]] = None):
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for name, n in LAYERS:
        x = torch.randn(n, generator=g)
        if sparse_k is not None and name in sparse_k:
            keep = torch.randperm(n, generator=g)[: sparse_k[name]]
            y = torch.zeros(n)
            y[keep] = x[keep]
            x = y
        out.append(x.to(device))
    return out


def _run_world(
    ranks: int,
    device,
    config: SparsityConfig,
    steps: int,
    grads: Callable[[int, int], List[torch.Tensor]],
    record: Callable[[int, SparseExchange, Dict[int, Any]], Any],
    loss_scale: Optional[float] = None,
    layers: Sequence[Tuple[str, int]] = LAYERS,
    ops: Any = OPS,
) -> List[List[Any]]:
    world = InProcessWorld(ranks, timeout=120.0)

    def make(rank):
        scale = None
        if loss_scale is not None:
            value = torch.tensor(loss_scale, device=device)
            scale = lambda: value  # noqa: E731
        return SparseExchange(ops, TorchComm(world, rank), config, layers, loss_scale=scale)

    return world.run_steps(make, grads, steps, record)


def _flat(out: Dict[int, Any]) -> torch.Tensor:
    return torch.cat([out[i].reshape(-1).float().cpu() for i in sorted(out)])


def check_cases(device, ranks: Sequence[int], steps: int) -> List[Row]:
    """identical / exact / conserved / nonfinite over codings, dtypes, controllers."""
    rows: List[Row] = []
    cases = []
    for coding in ("int32", "block16", "bitmap", "auto"):
        for dtype in ("float32", "float16", "bfloat16"):
            cases.append((f"{coding}/{dtype}/topk", dict(index_coding=coding, value_dtype=dtype)))
    cases += [
        ("auto/float32/dynamic", dict(controller="dynamic", anchor_every=3)),
        ("auto/float32/momentum", dict(controller="dynamic", momentum=0.9)),
        ("auto/float16/dgc", dict(controller="dgc", value_dtype="float16")),
    ]
    for p in ranks:
        for name, opts in cases:
            opts = {"controller": "topk", **opts}
            cfg = _config(**opts)
            scale = 1024.0 if "momentum" in name else None
            recs = _run_world(
                p,
                device,
                cfg,
                steps,
                lambda r, s: _grads(r, s, device),
                lambda r, ex, out: (_flat(out), sent_values(ex), _residuals(ex)),
                loss_scale=scale,
            )
            same = all(
                torch.equal(recs[0][s][0], recs[r][s][0]) for r in range(p) for s in range(steps)
            )
            rows.append(Row("identical", name, p, same))
            if "momentum" not in name:
                rows.append(_conserved(name, p, recs, steps, device))
    # k-sparse inputs come back exactly (topk, float32 values: no rounding).
    for p in ranks:
        k = {"w1": 6000 // 50 - 1, "w2": 3000 // 50 - 1}
        cfg = _config(controller="topk")
        recs = _run_world(
            p,
            device,
            cfg,
            2,
            lambda r, s, k=k: _grads(r, s, device, sparse_k=k),
            lambda r, ex, out: _flat(out),
        )
        ok = True
        for s in range(2):
            want = (
                sum(
                    torch.cat([g.cpu() for g in _grads(r, s, device, sparse_k=k)]).double()
                    for r in range(p)
                )
                / p
            )
            ok &= bool(torch.equal(recs[0][s], want.float())) or _close_bits(recs[0][s], want)
        rows.append(Row("exact", "k-sparse/topk", p, ok))
    rows.append(_nonfinite(device, max(ranks)))
    return rows


def _close_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal to the float64 average rounded once more at most (the average of
    float32 values over ranks, summed in float32 in rank order)."""
    return bool((got.double() - want).abs().max() <= 1e-6 * max(1.0, want.abs().max().item()))


def _residuals(ex: SparseExchange) -> Dict[int, np.ndarray]:
    return {
        i: layer.residual[: layer.numel].double().cpu().numpy()
        for i, layer in enumerate(ex.layers)
        if layer.residual is not None
    }


def _conserved(name, p, recs, steps, device) -> Row:
    worst = 0.0
    for r in range(p):
        for i in range(len(LAYERS)):
            if i not in recs[r][-1][2]:
                continue
            total_in = sum(_grads(r, s, device)[i].double().cpu().numpy() for s in range(steps))
            total_sent = sum(recs[r][s][1][i] for s in range(steps))
            err = np.abs(total_sent + recs[r][-1][2][i] - total_in).max()
            worst = max(worst, float(err / max(1.0, np.abs(total_in).max())))
    return Row("conserved", name, p, worst <= 1e-5, f"max rel error {worst:.2e}")


def _nonfinite(device, p: int) -> Row:
    cfg = _config()

    def grads(rank, step):
        gs = _grads(rank, step, device)
        if step == 2 and rank == p - 1:
            gs[0][17] = float("nan")
        return gs

    recs = _run_world(
        p,
        device,
        cfg,
        4,
        grads,
        lambda r, ex, out: (ex.last_step_finite, _residuals(ex), _flat(out)),
    )
    verdicts = [[rec[0] for rec in recs[r]] for r in range(p)]
    ok = all(v == [True, True, False, True] for v in verdicts)
    # The bad step left every residual as it was.
    ok &= all(
        np.array_equal(recs[r][1][1][i], recs[r][2][1][i]) for r in range(p) for i in recs[r][1][1]
    )
    ok &= all(torch.equal(recs[0][3][2], recs[r][3][2]) for r in range(p))
    return Row("nonfinite", "nan on the last rank at step 2", p, ok, str(verdicts[0]))


def check_cpu_equal(device, p: int, steps: int) -> List[Row]:
    if device.type == "cpu":
        return [Row("cpu_equal", "topk", p, True, "n/a: the device is the CPU")]
    cfg = _config(controller="topk")
    here = _run_world(
        p, device, cfg, steps, lambda r, s: _grads(r, s, device), lambda r, ex, out: _flat(out)
    )
    cpu = torch.device("cpu")
    ref = _run_world(
        p, cpu, cfg, steps, lambda r, s: _grads(r, s, cpu), lambda r, ex, out: _flat(out)
    )
    diffs = [float((a - b).abs().max()) for a, b in zip(here[0], ref[0])]
    ok = all(torch.equal(a, b) for a, b in zip(here[0], ref[0]))
    return [Row("cpu_equal", "topk", p, ok, f"max |diff| per step {diffs}")]


#: The fused kernels against the torch path (``fused_equal``; also
#: tests/test_triton.py under Triton's CPU interpreter): case -> (options,
#: inputs, loss scale). Cases ending in "big" use :data:`BIG`.
FUSED_CASES: Dict[str, Tuple[Dict[str, Any], str, Optional[float]]] = {
    "int32-f32-topk": (dict(index_coding="int32"), "normal", None),
    "block16-f32-topk": (dict(index_coding="block16"), "normal", None),
    "block16-bf16-big": (dict(index_coding="block16", value_dtype="bfloat16"), "normal", None),
    "bitmap-f32-topk": (dict(index_coding="bitmap", density=0.1), "normal", None),
    "int32-f16-huge": (dict(index_coding="int32", value_dtype="float16"), "huge", None),
    "block16-bf16-huge": (dict(index_coding="block16", value_dtype="bfloat16"), "huge", None),
    "bitmap-f16-huge": (
        dict(index_coding="bitmap", value_dtype="float16", density=0.1),
        "huge",
        None,
    ),
    "ties-over-capacity": (dict(controller="fixed", threshold=0.5), "ties", None),
    "padding": (dict(controller="fixed", threshold=3.0, max_ratio=2.0), "normal", None),
    "nonfinite": (dict(index_coding="block16"), "nonfinite", None),
    "nonfinite-bf16": (dict(value_dtype="bfloat16", index_coding="bitmap"), "nonfinite", None),
    "nonfinite-scaled": (dict(value_dtype="float16"), "nonfinite", 1024.0),
    "dynamic": (dict(controller="dynamic", anchor_every=3), "integers", None),
    "momentum-masking": (
        dict(controller="dynamic", momentum=0.9, momentum_masking=True),
        "integers",
        None,
    ),
    "momentum-unmasked": (dict(momentum=0.9, momentum_masking=False), "normal", None),
}


def _fused_grads(layers, kind: str, rank: int, step: int, device) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    out = []
    for _, n in layers:
        if kind == "integers":  # sums of |a| exact in any order: the same dynamic theta
            x = torch.randint(-64, 65, (n,), generator=g).float() / 8
        else:
            x = torch.randn(n, generator=g)
        if kind == "ties":  # many values exactly at the fixed threshold
            x[::3] = 0.5
            x[1::7] = -0.5
        if kind == "huge":  # beyond float16's range, both signs
            x[::197] = 1e6
            x[5::193] = -7e4
            # Halfway between two bfloat16 values (low 16 bits 0x8000), above
            # an even and an odd one: rounding to nearest even tells them apart.
            x[2::101] = 2.0**15 * (1 + 2.0**-8)
            x[3::103] = -(2.0**15) * (1 + 3 * 2.0**-8)
        if kind == "nonfinite" and step == 1 and n >= 1000:
            x[0] = float("nan")
            x[n // 2] = float("inf")
            x[n - 1] = -float("inf")
        out.append(x.to(device))
    return out


def _bits_equal(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def fused_unavailable(device, ops: Any = OPS) -> Optional[str]:
    """Why the fused kernels cannot run on ``device`` (None: they can)."""
    try:
        ops.fused_selection(torch.zeros(1, device=device), "triton")
    except (ImportError, ValueError) as err:
        return str(err)
    return None


def compare_kernels(device, case: str, ops: Any = OPS, ranks: int = 2, steps: int = 3) -> Row:
    """``fused_equal``: one of :data:`FUSED_CASES` through ``kernels="torch"``
    and ``kernels="triton"`` (``ops.fused_selection``) on ``device``: after
    every step, every sparse message's send chunk, every rank's reduced
    gradient, residuals, velocities and counts bit-identical, and the case
    doing what it says (a non-finite step, a count past the capacity, padding)."""
    opts, kind, scale = FUSED_CASES[case]
    opts = {"controller": "topk", **opts}
    layers = BIG if case.endswith("big") else [(n, m) for n, m in LAYERS if n != "b1"]

    def record(rank, ex, out):
        return (
            _flat(out),
            [g.chunk.clone() for g in ex.groups if g.sparse],
            [(_clone(lay.residual), _clone(lay.velocity)) for lay in ex.layers],
            [(row.get("selected"), row["capacity"]) for row in ex.stats()],
            ex.last_step_finite,
        )

    runs = {}
    for kernels in ("torch", "triton"):
        runs[kernels] = _run_world(
            ranks,
            device,
            _config(kernels=kernels, **opts),
            steps,
            lambda r, s: _fused_grads(layers, kind, r, s, device),
            record,
            loss_scale=scale,
            layers=layers,
            ops=ops,
        )
    ref, got = runs["torch"], runs["triton"]
    problems = []
    for r in range(ranks):
        for s in range(steps):
            (f0, c0, st0, n0, ok0), (f1, c1, st1, n1, ok1) = ref[r][s], got[r][s]
            where = f"rank {r} step {s}"
            if ok0 != ok1 or n0 != n1:
                problems.append(f"{where}: finite {ok0}/{ok1}, counts {n0}/{n1}")
            for j, (a, b) in enumerate(zip(c0, c1)):
                if not _bits_equal(a, b):
                    words = torch.nonzero(a != b).view(-1)[:4].tolist()
                    problems.append(f"{where}: message {j} differs at words {words}")
            if ok0:  # a skipped step's spare buffers are not state
                for i, ((ra, va), (rb, vb)) in enumerate(zip(st0, st1)):
                    if not (_bits_equal(ra, rb) and _bits_equal(va, vb)):
                        problems.append(f"{where}: layer {i}'s residual or velocity differs")
            if not _bits_equal(f0, f1):
                problems.append(f"{where}: reduced gradients differ")
    selected = [(c, cap) for rec in ref for st in rec for c, cap in st[3] if c is not None]
    if kind == "nonfinite" and ref[0][1][4]:
        problems.append("no non-finite step")
    if case == "ties-over-capacity" and not any(c > cap for c, cap in selected):
        problems.append("no count past the capacity")
    if case == "padding" and not any(c < cap for c, cap in selected):
        problems.append("no padding")
    detail = "; ".join(problems[:3]) or (
        f"messages, reduced gradients, residuals and counts bit-identical over {steps} steps"
    )
    return Row("fused_equal", case, ranks, not problems, detail)


def _clone(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.clone()


def check_fused(device, cases: Sequence[str]) -> List[Row]:
    why = fused_unavailable(device)
    if why is not None:
        return [Row("fused_equal", "all", 2, True, f"n/a: {why}")]
    return [compare_kernels(device, case) for case in cases]


def check_adversarial(device, p: int, repeats: int) -> List[Row]:
    """Every rank selects the same k indices, values alternating 1e8 and 1 in
    rank order: a float32 sum depends on its order; the unpack's must not."""
    n, k = 6000, 119
    cfg = _config(controller="topk")
    idx = torch.arange(0, n, n // k)[:k]

    def grads(rank, step):
        gs = [torch.zeros(m, device=device) for _, m in LAYERS]
        gs[0][idx.to(device)] = 1e8 if rank % 2 == 0 else 1.0
        gs[2][:5] = 1.0
        return gs

    recs = _run_world(p, device, cfg, repeats, grads, lambda r, ex, out: _flat(out))
    first = recs[0][0]
    ok = all(torch.equal(first, recs[r][s]) for r in range(p) for s in range(repeats))
    return [Row("adversarial", f"{p} ranks x {repeats} unpacks", p, ok)]


class _CountingOps(type(OPS)):  # type: ignore[misc]
    reads = 0

    def to_host(self, x):
        _CountingOps.reads += 1
        return super().to_host(x)


def check_host_reads(device, steps: int = 6) -> List[Row]:
    """Reads per step on one rank of a 2-rank world (planned: 1, 2 on an anchor
    step, more on a layout's first step); on CUDA, submit() runs under
    sync-debug mode "error" after the first steps."""
    ops = _CountingOps()
    world = InProcessWorld(2, timeout=60.0)
    cfg = _config(anchor_every=4)
    per_step: List[List[int]] = [[], []]
    strict = device.type == "cuda"

    def body(rank):
        ex = SparseExchange(ops, TorchComm(world, rank), cfg, LAYERS)
        for s in range(steps):
            gs = _grads(rank, s, device)
            if s < 2:  # layout and agreement: both ranks submit together
                for i, g in enumerate(gs):
                    ex.submit(i, g)
            else:
                # Rank 1 first; then rank 0 alone, so that sync-debug mode (global
                # to the process) sees rank 0's submit() and no other thread's read.
                if rank == 1:
                    for i, g in enumerate(gs):
                        ex.submit(i, g)
                world.meet(rank, "mid", None, list)
                if rank == 0:
                    if strict:
                        torch.cuda.set_sync_debug_mode("error")
                    try:
                        for i, g in enumerate(gs):
                            ex.submit(i, g)
                    finally:
                        if strict:
                            torch.cuda.set_sync_debug_mode("default")
            world.meet(rank, "before", None, list)
            before = _CountingOps.reads
            ex.wait()
            world.meet(rank, "after", None, list)
            per_step[rank].append(_CountingOps.reads - before)
        return None

    world.run(body)
    # Both thread-ranks count into one counter: halve.
    reads = [n // 2 for n in per_step[0]]
    # Steps 0 (layout check + anchor) and 4 (anchor) may read more; the others once.
    ok = all(r == 1 for s, r in enumerate(reads) if s not in (0, 4)) and reads[4] == 2
    mode = "submit() under sync-debug 'error'" if strict else "CPU: counted only"
    return [Row("host_reads", "per step, anchor_every=4", 2, ok, f"{reads} ({mode})")]


def _step_launches(device, layers, opts) -> Tuple[int, int, str]:
    """Profiler events (CPU) or CUDA kernels of one steady step of a 1-rank world
    whose collectives launch nothing, and of the third layer's submit() alone
    (``w2``, sparse, not the step's first: its selection and packing)."""
    from torch.profiler import ProfilerActivity, profile

    cfg = _config(anchor_every=0, **opts)
    ex = SparseExchange(OPS, _Replica(1), cfg, layers)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen).to(device) for _, n in layers]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])

    def count(prof) -> int:
        if device.type == "cuda":
            return sum(1 for e in prof.events() if e.device_type.name == "CUDA")
        return sum(1 for _ in prof.events())

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):  # layout, anchor, one steady step
        for i, g in enumerate(grads):
            ex.submit(i, g)
        ex.wait()
    with profile(activities=acts) as prof:
        for i, g in enumerate(grads):
            ex.submit(i, g)
        ex.wait()
        sync()
    for i in (0, 1):
        ex.submit(i, grads[i])
    with profile(activities=acts) as one:
        ex.submit(2, grads[2])
        sync()
    for i in range(3, len(grads)):
        ex.submit(i, grads[i])
    ex.wait()
    return count(prof), count(one), "CUDA kernels" if device.type == "cuda" else "profiler events"


def check_launches(device) -> List[Row]:
    """Launches of one step; what one more sparse layer (sent alone, as its own
    message) adds: the step with two sparse layers more, minus it, halved; and
    one sparse layer's selection and packing alone. For the torch path and,
    where they run, the fused kernels (the goal on CUDA: at most 6 for a
    sparse layer's selection and packing)."""
    more = LAYERS + [("w3", 4000), ("w4", 2500)]
    paths = ["torch"]
    if device.type == "cuda" and fused_unavailable(device) is None:
        paths.append("triton")
    rows = []
    for kernels in paths:
        for name, opts in (("topk", dict(controller="topk")), ("dynamic", {})):
            base, select, unit = _step_launches(device, LAYERS, dict(opts, kernels=kernels))
            bigger, _, _ = _step_launches(device, more, dict(opts, kernels=kernels))
            per_layer = (bigger - base) / 2
            ok = kernels != "triton" or name != "dynamic" or select <= 6
            rows.append(
                Row(
                    "launches",
                    f"{name}/{kernels}",
                    1,
                    ok,
                    f"{base} {unit} per step (2 sparse and 2 dense layers, layer-wise); each "
                    f"sparse layer with its message adds {per_layer:g}; selecting and packing "
                    f"one: {select}",
                )
            )
    return rows


def check_memory(device) -> List[Row]:
    """Device memory after each of 20 steps of rank 0 of 2 (its peer's chunk a
    copy of its own), one thread: flat once the layout is made."""
    if device.type != "cuda":
        return [Row("memory", "20 steps", 2, True, "n/a: CPU")]
    cfg = _config()
    ex = SparseExchange(OPS, _Replica(2), cfg, LAYERS)
    used: List[int] = []
    for s in range(20):
        for i, g in enumerate(_grads(0, s, device)):
            ex.submit(i, g)
        ex.wait()
        del g
        torch.cuda.synchronize(device)
        used.append(torch.cuda.memory_allocated(device))
    ok = len(set(used[5:])) == 1
    return [Row("memory", "20 steps", 2, ok, f"allocated at steps 5..19: {sorted(set(used[5:]))}")]


def check_primitives(device) -> List[Row]:
    rows = []
    vals = [32767, 32768, 65535, 65536, 131071]
    got = torch.tensor(vals, dtype=torch.int64, device=device).to(torch.int16).cpu().tolist()
    want = np.array(vals, np.int64).astype(np.int16).tolist()
    rows.append(Row("primitives", "int64 -> int16 wrap", 1, got == want, f"{got}"))
    u16 = OPS.unsigned16(torch.tensor([-1, -32768, 5], dtype=torch.int16, device=device))
    rows.append(Row("primitives", "unsigned16", 1, u16.cpu().tolist() == [65535, 32768, 5]))
    base = torch.arange(0, 400, 3, dtype=torch.int64, device=device)
    view = base[10:90]  # a chunk view: storage offset 10
    bounds = torch.tensor([0, 31, 32, 100, 1000], dtype=torch.int64, device=device)
    out = torch.zeros(5, dtype=torch.int32, device=device)
    OPS.count_below_(out, view, bounds)
    want_ss = np.searchsorted(view.cpu().numpy(), bounds.cpu().numpy(), side="left").tolist()
    rows.append(
        Row(
            "primitives",
            "searchsorted into a chunk view",
            1,
            out.cpu().tolist() == want_ss,
            f"{out.cpu().tolist()}",
        )
    )
    ok = True
    for n_true, size in ((3, 5), (5, 5), (7, 5), (0, 5)):
        mask = torch.zeros(20, dtype=torch.bool, device=device)
        mask[torch.arange(n_true) * 2] = True
        got = OPS.nonzero_static(mask, size, 20).cpu().tolist()
        ref = (list(range(0, 2 * n_true, 2))[:size] + [20] * size)[:size]
        ok &= got == ref
    rows.append(Row("primitives", "nonzero_static below/at/above size, empty", 1, ok))
    ok = True
    for n in (1, 7, 1001, (1 << 20) + 1):
        for pos in sorted({0, n // 2, n - 1}):
            for bad in (float("nan"), float("inf"), -float("inf")):
                x = torch.zeros(n, device=device)
                x[pos] = bad
                ok &= bool(OPS.to_host(OPS.any_nonfinite([x])))
        ok &= not bool(OPS.to_host(OPS.any_nonfinite([torch.zeros(n, device=device)])))
    rows.append(Row("primitives", "non-finite at first/middle/last of odd sizes", 1, ok))
    return rows


def check_deterministic(device) -> List[Row]:
    cfg = _config()
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _run_world(2, device, cfg, 3, lambda r, s: _grads(r, s, device), lambda r, ex, out: None)
        row = Row("deterministic", "use_deterministic_algorithms(True)", 2, True, "a step runs")
    except RuntimeError as err:  # an op without a deterministic kernel: reported
        row = Row("deterministic", "use_deterministic_algorithms(True)", 2, False, str(err)[:200])
    finally:
        torch.use_deterministic_algorithms(before)
    return [row]


class _Replica:
    """Rank 0 of ``size`` ranks that all send what it sends: times the unpack of
    ``size`` chunks with one process."""

    included = True
    rank = 0

    def __init__(self, size: int):
        self.size = size

    def allgather_async(self, chunk, name):
        return chunk if self.size == 1 else torch.cat([chunk] * self.size)

    def allreduce_async(self, tensor, name):
        return tensor

    def synchronize(self, handle):
        return handle

    def broadcast_object(self, obj):
        return obj

    def allgather_object(self, obj, name):
        return [obj] * self.size


def _median_seconds(fn: Callable[[], Any], sync: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check_timing(device, sizes: Sequence[int], ranks: Sequence[int], repeats: int) -> List[Row]:
    """Selection (with packing) and unpacking times by size, ranks and path.
    ``% copy``: the selection's essential traffic (gradient and residual read,
    accumulation written: 12 bytes per element) per second, as a share of
    what ``copy_`` moves per second (8 bytes per element) on the same size."""
    rows = []
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    paths = ["torch"]
    if device.type == "cuda" and fused_unavailable(device) is None:
        paths.append("triton")
    for n in sizes:
        src = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
        dst = torch.empty_like(src)
        copy = _median_seconds(lambda d=dst, x=src: d.copy_(x), sync, max(repeats, 5))
        rows.append(
            Row(
                "timing",
                f"{n:.1e} elements, copy_",
                1,
                True,
                f"{copy * 1e3:.3f} ms, {8 * n / copy / 1e9:.1f} GB/s",
            )
        )
        for kernels in paths:
            for p in ranks:
                cfg = _config(density=0.01, kernels=kernels)
                ex = SparseExchange(OPS, _Replica(p), cfg, [("w", n)])
                select, unpack = [], []
                for r in range(repeats + 2):
                    sync()
                    t0 = time.perf_counter()
                    ex.submit(0, src)
                    sync()
                    t1 = time.perf_counter()
                    ex.wait()
                    sync()
                    t2 = time.perf_counter()
                    if r >= 2:  # the first steps lay out and anchor
                        select.append(t1 - t0)
                        unpack.append(t2 - t1)
                sel = statistics.median(select)
                rows.append(
                    Row(
                        "timing",
                        f"{n:.1e} elements, {kernels}",
                        p,
                        True,
                        f"select+pack {sel * 1e3:.3f} ms ({100 * 12 * copy / (8 * sel):.0f}% "
                        f"copy), unpack {statistics.median(unpack) * 1e3:.3f} ms "
                        f"(median of {repeats})",
                    )
                )
                del ex
    return rows


def run_checks(
    device: torch.device,
    quick: bool,
    kernels: str = "auto",
    progress: Optional[Callable[[List[Row]], None]] = None,
) -> List[Row]:
    """Every check; ``quick``: small worlds and sizes (seconds on a CPU);
    ``kernels``: :data:`KERNELS` for the checks that do not compare paths;
    ``progress``: called with the rows so far after each check (so that a run
    stopped by a time limit leaves what it did)."""
    global KERNELS
    KERNELS = kernels
    ranks = (2, 3) if quick else (2, 8, 64)
    steps = 3 if quick else 6
    rows: List[Row] = []
    fused_cases = ("int32-f32-topk", "nonfinite") if quick else tuple(FUSED_CASES)
    plan: List[Tuple[str, Callable[[], List[Row]]]] = [
        ("cases", lambda: check_cases(device, ranks, steps)),
        ("fused_equal", lambda: check_fused(device, fused_cases)),
        ("cpu_equal", lambda: check_cpu_equal(device, max(ranks), steps)),
        (
            "adversarial",
            lambda: check_adversarial(device, 8 if quick else 64, 10 if quick else 100),
        ),
        ("host_reads", lambda: check_host_reads(device)),
        ("launches", lambda: check_launches(device)),
        ("memory", lambda: check_memory(device)),
        ("primitives", lambda: check_primitives(device)),
        ("deterministic", lambda: check_deterministic(device)),
        (
            "timing",
            lambda: check_timing(
                device,
                (100_000,) if quick else (1_000_000, 25_000_000, 100_000_000),
                (2,) if quick else (8, 32, 128),
                2 if quick else 5,
            ),
        ),
    ]
    for name, fn in plan:
        t0 = time.perf_counter()
        got = fn()
        rows += got
        if progress is not None:
            progress(rows)
        logger.info(
            "%s: %d checked, %d failed in %.1f s",
            name,
            len(got),
            sum(not r.ok for r in got),
            time.perf_counter() - t0,
        )
    return rows


def write(rows: Sequence[Row], out: Path, device: torch.device, command: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "selfcheck.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["check", "case", "ranks", "ok", "detail"])
        for r in rows:
            w.writerow([r.check, r.case, r.ranks, r.ok, r.detail])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    failed = [r for r in rows if not r.ok]
    lines = [
        f"# dlgs self-check on {name}",
        "",
        f"`{command}` — torch {torch.__version__}, {len(rows)} checks, {len(failed)} failed.",
        "",
        "| check | case | ranks | ok | detail |",
        "|---|---|---:|---|---|",
    ]
    lines += [
        f"| {r.check} | {r.case} | {r.ranks} | {'yes' if r.ok else '**NO**'} | "
        f"{r.detail.replace('|', '/')} |"
        for r in rows
    ]
    text = "\n".join(lines) + "\n"
    (out / "selfcheck.md").write_text(text)
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dlgs.selfcheck", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    parser.add_argument("--quick", action="store_true", help="small worlds and sizes")
    parser.add_argument("--out", type=Path, default=Path("selfcheck-results"))
    parser.add_argument(
        "--kernels",
        default="auto",
        choices=("auto", "torch", "triton"),
        help="SparsityConfig.kernels for the checks that do not compare the two paths",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    # The checks inject non-finite steps on purpose, on up to 64 ranks at once.
    logging.getLogger("dlgs.core").setLevel(logging.ERROR)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    command = "python -m dlgs.selfcheck " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = run_checks(
        device, args.quick, args.kernels, lambda so_far: write(so_far, args.out, device, command)
    )
    print(write(rows, args.out, device, command))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
