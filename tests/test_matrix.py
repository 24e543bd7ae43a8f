"""The transport x framework matrix, in process: every way of moving bytes
(the flat allgather, the sparse reduction, the two-level exchange over each)
on every framework's array operations (torch, TensorFlow), each cell held to
the guarantees every lossy path owes (docs/options.md, "Which door has which
feature"):

* density 1.0 is the ranks' exact mean;
* gradients with at most ``k`` non-zeros per rank (per shard, two-level) come
  back exactly;
* error feedback conserves the gradient: what came out over the steps plus
  the ranks' residuals is what went in;
* every rank holds the same bits every step;
* a checkpoint taken between steps resumes exactly where the run would have
  gone on.

Ranks are threads (:class:`dlgs.inprocess.InProcessWorld`), 4 of them, the
two-level exchange as 2 nodes of 2. The doors are thin over these cells: the
real-rank tests (``test_parallel.py``, ``test_reduction.py``,
``test_hierarchical.py``, ``test_tensorflow.py``, ``test_ddp.py``) run the
diagonal that touches every door and every transport under horovodrun and
torchrun.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlgs.core import SparseExchange, SparsityConfig
from dlgs.core.transport.hierarchical import HierarchicalExchange, shard_size
from dlgs.inprocess import InProcessWorld
from dlgs.selfcheck import TorchComm, TorchNodeComm
from dlgs.torch._ops import OPS as TORCH_OPS

NODES, LOCAL = 2, 2
P = NODES * LOCAL
LAYERS = [("w1", 6000), ("b1", 40), ("w2", 3001), ("b2", 10)]
MIN_SPARSE = 1000
SPARSE = [i for i, (_, n) in enumerate(LAYERS) if n >= MIN_SPARSE]
TIMEOUT = 120.0


class _Torch:
    ops = TORCH_OPS
    comm = TorchComm
    node = TorchNodeComm

    @staticmethod
    def tensor(x: np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x, np.float32))

    @staticmethod
    def host(x) -> np.ndarray:
        return x.detach().double().numpy().copy()

    @staticmethod
    def like():
        return torch.zeros(1)


class _Bridge:
    """Collectives on an :class:`InProcessWorld` for any framework, through
    NumPy: gathers concatenate in rank order, reductions average in float64
    in rank order (as :class:`~dlgs.selfcheck.TorchComm` does for torch)."""

    included = True
    to_np = staticmethod(np.asarray)
    from_np = staticmethod(np.asarray)

    def __init__(self, world: InProcessWorld, rank: int):
        self.world, self.rank, self.size = world, rank, world.size

    def _post(self, kind, name, tensor):
        x = self.to_np(tensor).copy()
        combine = {
            "gather": np.concatenate,
            "alltoall": list,
            "reduce": lambda parts: sum(p.astype(np.float64) for p in parts) / len(parts),
            "scatter": lambda parts: sum(p.astype(np.float64) for p in parts) / len(parts),
        }[kind]
        return kind, x.dtype, self.world.post(self.rank, name, x, combine)

    def allgather_async(self, tensor, name):
        return self._post("gather", name, tensor)

    def alltoall_async(self, tensor, name):
        return self._post("alltoall", name, tensor)

    def allreduce_async(self, tensor, name):
        return self._post("reduce", name, tensor)

    def reducescatter_async(self, tensor, name):
        return self._post("scatter", name, tensor)

    def poll(self, handle):
        return self.world.done(handle[2])

    def synchronize(self, handle):
        kind, dtype, meeting = handle
        out = self.world.collect(meeting)
        if kind == "alltoall":
            out = np.concatenate([p.reshape(self.size, -1)[self.rank] for p in out])
        elif kind == "scatter":
            out = out.reshape(self.size, -1)[self.rank]
        return self.from_np(np.asarray(out).astype(dtype))

    def allgather_object(self, obj, name):
        return self.world.meet(self.rank, name, obj, list)


def _tensorflow():
    tf = pytest.importorskip("tensorflow")
    from dlgs.tensorflow._ops import OPS, _read

    class Comm(_Bridge):
        to_np = staticmethod(lambda x: _read(x).numpy())
        from_np = staticmethod(tf.constant)

    class _TF:
        ops = OPS
        comm = Comm
        node = Comm

        @staticmethod
        def tensor(x):
            return tf.constant(np.asarray(x, np.float32))

        @staticmethod
        def host(x):
            return np.asarray(_read(x).numpy(), np.float64).copy()

        @staticmethod
        def like():
            return tf.zeros([1], tf.float32)

    return _TF


def backend(name):
    return _Torch if name == "torch" else _tensorflow()


FRAMEWORKS = ["torch", "tensorflow"]
EXCHANGES = ["flat", "two-level"]
TRANSPORTS = ["allgather", "reduce"]


def run(fw, kind, config, grads, steps, record, *, first=0, states=None):
    """Every rank builds ``kind``'s exchange on framework ``fw`` (loading
    ``states[rank]`` where given), runs steps ``first .. first + steps - 1``
    with ``grads(rank, step)`` (NumPy, one per layer) and returns each rank's
    ``record(rank, exchange, outputs)`` per step."""
    b = backend(fw)
    nodes = [InProcessWorld(LOCAL, timeout=TIMEOUT) for _ in range(NODES)]
    crosses = [InProcessWorld(NODES, timeout=TIMEOUT) for _ in range(LOCAL)]
    world = InProcessWorld(P, timeout=TIMEOUT)

    def body(rank):
        if kind == "flat":
            ex = SparseExchange(b.ops, b.comm(world, rank), config, LAYERS)
        else:
            node, local = divmod(rank, LOCAL)
            ex = HierarchicalExchange(
                b.ops,
                b.node(nodes[node], local),
                b.comm(crosses[local], node),
                config,
                LAYERS,
                world=b.comm(world, rank),
                node_reduce="reducescatter",
            )
        if states is not None:
            ex.load_state_dict(states[rank], b.like())
        out = []
        for s in range(first, first + steps):
            for i, g in enumerate(grads(rank, s)):
                ex.submit(i, b.tensor(g))
            reduced = ex.wait()
            out.append(record(rank, ex, {i: b.host(t) for i, t in reduced.items()}))
        return out

    return InProcessWorld(P, timeout=TIMEOUT).run(body)


def config(transport, **options):
    opts = dict(density=0.02, min_sparse_size=MIN_SPARSE, transport=transport)
    if transport == "reduce":
        opts["reduce_width"] = 4.0  # room for every rank's entries in every cell
    opts.update(options)
    return SparsityConfig(**opts)


def normal(rank, step):
    g = np.random.default_rng(1000 * step + rank)
    return [g.standard_normal(n).astype(np.float32) for _, n in LAYERS]


def outputs(rank, ex, out):
    return [out[i] for i in range(len(LAYERS))]


def mean(grads, step):
    return [
        np.mean([grads(r, step)[i].astype(np.float64) for r in range(P)], 0)
        for i in range(len(LAYERS))
    ]


cells = pytest.mark.parametrize(
    "fw,kind,transport",
    [(f, k, t) for f in FRAMEWORKS for k in EXCHANGES for t in TRANSPORTS],
)


@cells
def test_density_one_is_the_exact_mean(fw, kind, transport):
    recs = run(fw, kind, config(transport, density=1.0), normal, 2, outputs)
    for s in range(2):
        for got, want in zip(recs[0][s], mean(normal, s)):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def k_sparse(rank, step):
    """At most the selection's share of non-zeros per shard of every layer,
    at the same positions on every rank (so the reduction's regions hold
    every rank's entries), small integers (exact sums in float32)."""
    pos = np.random.default_rng(step)
    g = np.random.default_rng(100 * step + rank)
    out = []
    for _, n in LAYERS:
        x = np.zeros(n, np.float32)
        m = shard_size(n, LOCAL)
        for lo in range(0, n, m):
            hi = min(lo + m, n)
            k = int(0.02 * m) // 2
            if k:
                at = pos.choice(np.arange(lo, hi), k, replace=False)
                x[at] = g.integers(-8, 9, k) * 4
        out.append(x if n >= MIN_SPARSE else g.standard_normal(n).astype(np.float32))
    return out


@cells
def test_k_sparse_inputs_come_back_exactly(fw, kind, transport):
    cfg = config(transport, controller="topk")
    recs = run(fw, kind, cfg, k_sparse, 3, outputs)
    for s in range(3):
        want = mean(k_sparse, s)
        for i in SPARSE:
            assert np.array_equal(recs[0][s][i], want[i]), (s, LAYERS[i][0])


def residuals(rank, ex, out):
    """This rank's residuals in whole-layer coordinates (its shard's place
    in the two-level exchange), and the step's outputs."""
    inner = getattr(ex, "inner", ex)
    local = ex.node.rank if inner is not ex else 0
    res = {}
    for i in SPARSE:
        layer = inner.layers[i]
        r = np.asarray(ex.ops.to_host(layer.residual), np.float64)[: layer.numel]
        full = np.zeros(LAYERS[i][1] + len(r) * LOCAL)
        start = local * len(r) if inner is not ex else 0
        full[start : start + len(r)] = r
        res[i] = full[: LAYERS[i][1]]
    return outputs(rank, ex, out), res


@cells
def test_error_feedback_conserves_the_gradient(fw, kind, transport):
    """Over the steps: the sum of the outputs plus the ranks' residuals
    (averaged over the ranks that own each position) is the sum of the means."""
    steps = 4
    recs = run(fw, kind, config(transport), normal, steps, residuals)
    owners = P if kind == "flat" else NODES
    for i in SPARSE:
        went_in = sum(mean(normal, s)[i] for s in range(steps))
        came_out = sum(recs[0][s][0][i] for s in range(steps))
        held = sum(recs[r][-1][1][i] for r in range(P)) / owners
        np.testing.assert_allclose(came_out + held, went_in, rtol=0, atol=2e-5)


@cells
def test_every_rank_holds_the_same_bits(fw, kind, transport):
    recs = run(fw, kind, config(transport), normal, 3, outputs)
    for r in range(1, P):
        for s in range(3):
            for a, b in zip(recs[0][s], recs[r][s]):
                assert np.array_equal(a, b)


@cells
def test_a_checkpoint_resumes_where_the_run_would_have_gone_on(fw, kind, transport):
    cfg = config(transport)
    whole = run(fw, kind, cfg, normal, 4, outputs)

    def saved(rank, ex, out):
        return ex.state_dict()

    states = [rec[-1] for rec in run(fw, kind, cfg, normal, 2, saved)]
    resumed = run(fw, kind, cfg, normal, 2, outputs, first=2, states=states)
    for r in range(P):
        for s in range(2):
            for a, b in zip(whole[r][2 + s], resumed[r][s]):
                assert np.array_equal(a, b)
