"""The two-level exchange (dlgs/core/transport/hierarchical.py) on 2 nodes of 2 ranks,
as threads of this process: each node's ranks meet in one in-process world,
each local rank's ranks across the nodes in another (the collectives a
multi-node Horovod job would run on its node and cross process sets)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ROOT, horovodrun, load_ranks

from dlgs.core import SparsityConfig
from dlgs.core.exchange.exchange import SparseExchange
from dlgs.core.exchange.protocol import EXCHANGE_MEMBERS
from dlgs.core.planning.layout import plan_messages
from dlgs.core.transport.hierarchical import HierarchicalExchange, shard_size
from dlgs.core.transport.topology import probe_topology
from dlgs.core.wire import plan_layers
from dlgs.inprocess import InProcessWorld, sent_values
from dlgs.selfcheck import TorchComm, TorchNodeComm
from dlgs.torch._ops import OPS

NODES, LOCAL = 2, 2
P = NODES * LOCAL
LAYERS = [("w1", 6000), ("b1", 40), ("w2", 3001), ("b2", 10)]


def run(config, grads, steps, record, layers=LAYERS, before=None, **options):
    """``record(rank, exchange, outputs)`` after every step of every rank;
    ``before(rank, exchange)`` first; ``options`` for the exchange."""
    nodes = [InProcessWorld(LOCAL, timeout=60.0) for _ in range(NODES)]
    crosses = [InProcessWorld(NODES, timeout=60.0) for _ in range(LOCAL)]
    world = InProcessWorld(P, timeout=60.0)

    def make(rank):
        node, local = divmod(rank, LOCAL)
        ex = HierarchicalExchange(
            OPS,
            TorchNodeComm(nodes[node], local),
            TorchComm(crosses[local], node),
            config,
            layers,
            world=TorchComm(world, rank),
            **options,
        )
        if before is not None:
            before(rank, ex)
        return ex

    return InProcessWorld(P).run_steps(make, grads, steps, record)


def normal(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(n, generator=g) for _, n in LAYERS]


def flat(out):
    return torch.cat([out[i].reshape(-1) for i in sorted(out)]).clone()


def test_dense_layers_are_the_mean_of_every_rank():
    cfg = SparsityConfig(density=1.0)
    recs = run(cfg, normal, 2, lambda r, ex, out: flat(out))
    for s in range(2):
        want = sum(torch.cat(normal(r, s)).double() for r in range(P)) / P
        for r in range(P):
            assert torch.equal(recs[r][s], recs[0][s])
        assert torch.allclose(recs[0][s].double(), want, rtol=0, atol=1e-6)


#: Node buckets: every layer in one (the default here), each layer alone, and
#: two buckets of two layers (6,000 + 40 padded shards, then 3,001 + 10); the
#: node reduction timed (the default) or each one.
BUCKETS = [
    {},
    {"node_bucket_elements": 1, "node_reduce": "reducescatter"},
    {"node_bucket_elements": 6100, "node_reduce": "allreduce"},
]


def test_node_buckets_are_consecutive_layers_up_to_the_size():
    cfg = SparsityConfig(density=0.02, min_sparse_size=1000)
    make = lambda **kw: HierarchicalExchange(  # noqa: E731
        OPS, _SoloNode(LOCAL), _Solo(NODES), cfg, LAYERS, **kw
    )
    assert make().buckets == [[0, 1, 2, 3]]
    assert make(node_bucket_elements=1).buckets == [[0], [1], [2], [3]]
    assert make(node_bucket_elements=6100).buckets == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="node_bucket_elements must be >= 1"):
        make(node_bucket_elements=0)
    with pytest.raises(TypeError, match="node_bucket_elements must be an int"):
        make(node_bucket_elements=2.5)
    with pytest.raises(ValueError, match="node_reduce must be one of 'auto'"):
        make(node_reduce="ring")


def test_auto_node_reduction_is_timed_once_and_agreed_in_the_node():
    cfg = SparsityConfig(density=0.02, min_sparse_size=1000)
    recs = run(cfg, normal, 2, lambda r, ex, out: (ex.node_reduce, ex.node_probe))
    for node in range(NODES):
        ranks = [recs[node * LOCAL + j] for j in range(LOCAL)]
        # The same choice and the same (node-averaged) times on every rank of a node.
        assert all(rec == ranks[0] for rec in ranks), ranks
        (choice, probe), again = ranks[0][0], ranks[0][1]
        assert again == ranks[0][0]  # probed at the first step only
        assert choice == min(probe, key=probe.get) and set(probe) == {"reducescatter", "allreduce"}


@pytest.mark.parametrize("options", BUCKETS)
def test_ranks_hold_the_same_bits_every_step(options):
    cfg = SparsityConfig(density=0.02, min_sparse_size=1000, anchor_every=3)
    recs = run(cfg, normal, 5, lambda r, ex, out: flat(out), **options)
    for s in range(5):
        for r in range(1, P):
            assert torch.equal(recs[r][s], recs[0][s]), (r, s)


def test_a_budget_splits_each_shard_alike_on_every_rank_within_it():
    """``budget=`` under two levels bounds what each rank sends between nodes
    (its shards' messages); the default split (``budget_split="auto"``) runs
    after step 10 on each cross-node set, and every rank keeps the same bits."""
    from dlgs.core.planning.budget import SPLIT_AFTER

    cfg = SparsityConfig(budget=0.1, min_sparse_size=1000)
    assert cfg.budget_split == "gradient"
    steps = SPLIT_AFTER + 3
    recs = run(
        cfg,
        normal,
        steps,
        lambda r, ex, out: (flat(out), ex.inner.auto_layers, ex.inner.wire_bytes()),
    )
    shards = [shard_size(n, LOCAL) for _, n in LAYERS]
    target = 0.1 * 4 * sum(shards)
    for s in range(steps):
        for r in range(P):
            assert torch.equal(recs[r][s][0], recs[0][s][0]), (r, s)
            assert recs[r][s][2] <= target, (r, s, recs[r][s][2], target)
    assert recs[0][SPLIT_AFTER - 2][1] is None  # one density until the split
    for r in range(P):
        assert recs[r][-1][1] is not None, r  # split, on every rank
        assert recs[r][-1][1] == recs[r % LOCAL][-1][1]  # alike within a cross-node set
    assert recs[0][-1][1] != recs[1][-1][1]  # each set splits its own shards

    # Every rank resumes from its own checkpoint: the splits are agreed within
    # each cross-node set (they differ between sets), not refused as a mismatch.
    saved = run(cfg, normal, steps, lambda r, ex, out: ex.state_dict())
    again = run(
        cfg,
        normal,
        2,
        lambda r, ex, out: (flat(out), ex.inner.auto_layers),
        before=lambda r, ex: ex.load_state_dict(saved[r][-1], torch.zeros(1)),
    )
    for r in range(P):
        assert again[r][-1][1] == recs[r][-1][1], r
        assert torch.equal(again[r][-1][0], again[0][-1][0]), r


@pytest.mark.parametrize("options", BUCKETS)
@pytest.mark.parametrize("transport", ["allgather", "reduce"])
def test_k_sparse_node_means_come_back_exactly(options, transport):
    """Each node's mean has at most k' = ceil(density * shard) non-zeros per
    shard (on its local rank 0, times LOCAL): every value arrives, exactly,
    whether the shards travel between nodes by allgather or by the sparse
    reduction (blocks wide enough for every shard's entries)."""
    density = 0.02
    cfg = SparsityConfig(
        density=density,
        min_sparse_size=1000,
        controller="topk",
        transport=transport,
        reduce_width=float(NODES * NODES),  # any region may hold every node's entries
    )
    rng = np.random.default_rng(0)
    plant = {}
    for node in range(NODES):
        vecs = []
        for _, n in LAYERS:
            v = np.zeros(n)
            m = shard_size(n, LOCAL)
            k = int(np.ceil(density * m))
            for shard in range(LOCAL):
                lo, hi = shard * m, min(n, (shard + 1) * m)
                pos = rng.choice(np.arange(lo, hi), size=min(k, hi - lo), replace=False)
                v[pos] = rng.integers(1, 64, size=pos.size) * 0.25 * rng.choice([-1, 1], pos.size)
            vecs.append(v)
        plant[node] = vecs

    def grads(rank, step):
        node, local = divmod(rank, LOCAL)
        return [
            torch.tensor(v * LOCAL if local == 0 else 0 * v, dtype=torch.float32)
            for v in plant[node]
        ]

    def record(rank, ex, out):
        return flat(out), ex.inner.transport.name

    recs = run(cfg, grads, 1, record, **options)
    want = sum(np.concatenate(plant[node]) for node in range(NODES)) / NODES
    for r in range(P):
        np.testing.assert_array_equal(recs[r][0][0].numpy(), want.astype(np.float32))
        assert recs[r][0][1] == {"allgather": "flat", "reduce": "reduce"}[transport]


@pytest.mark.parametrize("options", BUCKETS)
def test_each_shard_owner_conserves_what_it_accumulated(options):
    """Per rank: what it sent over all steps plus its shard residual is the sum
    of its node's mean shards (error feedback loses nothing)."""
    cfg = SparsityConfig(density=0.02, min_sparse_size=1000)
    steps = 4

    def record(rank, ex, out):
        res = {
            i: la.residual[: la.numel].double().numpy().copy()
            for i, la in enumerate(ex.inner.layers)
            if la.residual is not None
        }
        return sent_values(ex.inner), res

    recs = run(cfg, normal, steps, record, **options)
    for rank in range(P):
        node, local = divmod(rank, LOCAL)
        peers = [node * LOCAL + j for j in range(LOCAL)]
        for i, (_, n) in enumerate(LAYERS):
            if i not in recs[rank][-1][1]:
                continue  # a dense layer
            m = shard_size(n, LOCAL)
            total = np.zeros(m)
            sent = np.zeros(m)
            for s in range(steps):
                mean = sum(normal(p, s)[i].double().numpy() for p in peers) / LOCAL
                padded = np.zeros(LOCAL * m)
                padded[:n] = mean
                total += padded[local * m : (local + 1) * m]
                sent += recs[rank][s][0][i]
            np.testing.assert_allclose(sent + recs[rank][-1][1][i], total, rtol=0, atol=1e-5)


def test_a_nan_on_one_rank_skips_the_step_on_every_rank():
    cfg = SparsityConfig(density=0.02, min_sparse_size=1000)

    def grads(rank, step):
        gs = normal(rank, step)
        if step == 1 and rank == P - 1:
            gs[2][7] = float("nan")
        return gs

    def record(rank, ex, out):
        res = [la.residual.clone() for la in ex.inner.layers if la.residual is not None]
        return ex.last_step_finite, res

    recs = run(cfg, grads, 3, record)
    for r in range(P):
        assert [f for f, _ in recs[r]] == [True, False, True], r
        for a, b in zip(recs[r][0][1], recs[r][1][1]):
            assert torch.equal(a, b)  # the skipped step left every residual alone


def test_each_node_link_carries_one_selection_instead_of_local_size():
    """Bytes a node sends across its link per step: its LOCAL ranks' sparse
    messages; hierarchical sends shards of k / LOCAL, at most 1.1 / LOCAL of
    flat's (the goal, a count here: the messages' sizes)."""
    cfg = SparsityConfig(density=0.01, min_sparse_size=1000)
    sizes = [200_000, 50_000, 6000]

    def sent_bytes(layer_sizes):
        plans = plan_layers(layer_sizes, cfg.density, cfg)
        names = [f"w{i}" for i in range(len(layer_sizes))]
        messages = plan_messages(plans, names, None, "dlgs", cfg.value_dtype, cfg.index_coding)
        assert all(m.sparse for m in messages)
        return sum(4 * m.layout.chunk_words for m in messages)

    flat_link = LOCAL * sent_bytes(sizes)
    hier_link = LOCAL * sent_bytes([shard_size(n, LOCAL) for n in sizes])
    assert hier_link <= 1.1 / LOCAL * flat_link, (hier_link, flat_link)


def _saved_at_step_3(rank):
    """Every rank's state after 3 steps (its own shards' residuals)."""
    cfg = SparsityConfig(density=0.02, min_sparse_size=1000)
    return run(cfg, normal, 3, lambda r, ex, out: ex.state_dict())[rank][-1]


def test_horovods_resume_recipe_every_rank_takes_rank_0s_step():
    """Rank 0 alone loads (Horovod's recipe); at the first gradient every rank
    of the job, not only rank 0's cross-node set, takes its step."""
    cfg = SparsityConfig(density=0.02, min_sparse_size=1000)
    state = _saved_at_step_3(0)

    def before(rank, ex):
        if rank == 0:
            ex.load_state_dict(state, torch.zeros(1))

    recs = run(cfg, normal, 2, lambda r, ex, out: (ex.step, flat(out)), before=before)
    assert [rec[-1][0] for rec in recs] == [5] * P
    for r in range(1, P):
        assert torch.equal(recs[r][-1][1], recs[0][-1][1])


def test_another_local_ranks_state_loads_with_its_residuals_reset(caplog):
    """Every rank loads local rank 0's file: on local rank 1 its shards are
    other slices, so its residuals start empty (with the flat exchange's
    warning), never restored into the wrong elements."""
    cfg = SparsityConfig(density=0.02, min_sparse_size=1000)
    state = _saved_at_step_3(0)
    hier = HierarchicalExchange(OPS, _SoloNode(LOCAL, rank=1), _Solo(NODES), cfg, LAYERS)
    with caplog.at_level("WARNING", logger="dlgs"):
        hier.load_state_dict(state, torch.zeros(1))
    assert any("residuals reset" in r.getMessage() for r in caplog.records)
    assert all(la.residual is None or not la.residual.any() for la in hier.inner.layers)
    own = HierarchicalExchange(OPS, _SoloNode(LOCAL), _Solo(NODES), cfg, LAYERS)
    own.load_state_dict(state, torch.zeros(1))
    assert any(la.residual is not None and la.residual.any() for la in own.inner.layers)


def test_a_checkpoint_of_another_topology_is_refused_by_name():
    cfg = SparsityConfig(density=0.02, min_sparse_size=1000)
    hier = HierarchicalExchange(OPS, _SoloNode(LOCAL), _Solo(NODES), cfg, LAYERS)
    state = hier.state_dict()
    state["topology"] = [4, 1]
    with pytest.raises(ValueError, match="ranks per node, nodes"):
        hier.load_state_dict(state, torch.zeros(1))


def test_a_hierarchical_checkpoint_in_a_flat_exchange_says_where_it_came_from():
    """Not 'version must be 1, got None', but what the state is and what to do."""
    cfg = SparsityConfig(density=0.02, min_sparse_size=1000)
    state = HierarchicalExchange(OPS, _SoloNode(LOCAL), _Solo(NODES), cfg, LAYERS).state_dict()
    from dlgs.core.exchange.exchange import SparseExchange

    flat = SparseExchange(OPS, _Solo(P), cfg, LAYERS)
    with pytest.raises(ValueError, match="saved with topology='hierarchical'.*without its 'dlgs'"):
        flat.load_state_dict(state, torch.zeros(1))


def test_a_checkpoint_of_another_model_without_residuals_is_refused_by_name():
    """Every layer dense when it was saved (no buffer to compare),
    yet another model (a hidden layer of 128 against 96) must not load."""
    dense = SparsityConfig(density=1.0)
    wide = [("w1", 128 * 32), ("b1", 128)]
    narrow = [("w1", 96 * 32), ("b1", 96)]
    state = HierarchicalExchange(OPS, _SoloNode(LOCAL), _Solo(NODES), dense, wide).state_dict()
    assert all(e["residual"] is None for e in state["exchange"]["layers"].values())
    other = HierarchicalExchange(OPS, _SoloNode(LOCAL), _Solo(NODES), dense, narrow)
    with pytest.raises(ValueError, match="'w1' was saved for 2048 elements but the parameter"):
        other.load_state_dict(state, torch.zeros(1))


class _Solo:
    """Collectives of a process set of ``size`` that no test step uses."""

    included = True

    def __init__(self, size, rank=0):
        self.size, self.rank = size, rank


class _SoloNode(_Solo):
    """Node collectives of ``size`` ranks that no test step uses."""


def test_both_exchanges_implement_the_exchange_protocol():
    """What the engine and the doors call exists on the flat and the two-level
    exchange alike (no catch-all forwarding)."""
    cfg = SparsityConfig(density=0.02, min_sparse_size=1000)
    exchanges = [
        SparseExchange(OPS, _Solo(NODES), cfg, LAYERS),
        HierarchicalExchange(OPS, _SoloNode(LOCAL), _Solo(NODES), cfg, LAYERS),
    ]
    assert "submit" in EXCHANGE_MEMBERS and "device" in EXCHANGE_MEMBERS
    for ex in exchanges:
        missing = [name for name in EXCHANGE_MEMBERS if not hasattr(ex, name)]
        assert missing == [], (type(ex).__name__, missing)
    assert not hasattr(exchanges[1], "set_plan")  # the planner plans the inner exchange


def test_a_step_dropped_halfway_leaves_nothing_behind():
    """abort_step() in the middle of a two-level step (an error in
    back-propagation): the next steps are those of a run without it."""
    cfg = SparsityConfig(density=0.02, min_sparse_size=1000)

    def before(rank, ex):
        grads = normal(rank, 99)
        for i in (0, 1):
            ex.submit(i, grads[i])
        assert ex.in_step
        ex.abort_step()
        assert not ex.in_step and ex.pending() == list(range(len(LAYERS)))

    def record(rank, ex, out):
        return flat(out)

    clean = run(cfg, normal, 3, record)
    dropped = run(cfg, normal, 3, record, before=before)
    for r in range(P):
        for a, b in zip(clean[r], dropped[r]):
            assert torch.equal(a, b)


def test_topology_probe_times_both_exchanges_and_agrees_on_every_rank():
    cfg = SparsityConfig(density=0.02, min_sparse_size=1000)
    nodes = [InProcessWorld(LOCAL, timeout=60.0) for _ in range(NODES)]
    crosses = [InProcessWorld(NODES, timeout=60.0) for _ in range(LOCAL)]
    world = InProcessWorld(P, timeout=60.0)

    def probe(rank):
        node, local = divmod(rank, LOCAL)
        return probe_topology(
            OPS,
            TorchComm(world, rank),
            TorchNodeComm(nodes[node], local),
            TorchComm(crosses[local], node),
            [n for _, n in LAYERS],
            cfg,
            torch.zeros(1),
        )

    probes = world.run(probe)
    assert all(p == probes[0] for p in probes)
    got = probes[0]
    assert got.flat > 0 and got.hierarchical > 0 and got.elements == sum(n for _, n in LAYERS)
    assert got.choice == ("hierarchical" if got.hierarchical < got.flat else "flat")
    assert got.choice in got.describe()


# -- real ranks under horovodrun: 4 ranks as 2 nodes of 2 (ranks_per_node=2) ------------


def _launch(backend, out, *cases):
    """``hier_worker.py``'s ``cases`` in one launch of 4 ranks: each rank's
    record per case. Without tensor fusion: at 4 ranks the bits of a sum
    depend on where an element falls in the fused buffer, which depends on
    timing (density 1.0 is compared bit for bit with Horovod's)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HOROVOD_FUSION_THRESHOLD", "0")
        horovodrun(
            backend, 4, [ROOT / "tests" / "parallel" / "hier_worker.py", out, *cases], timeout=240
        )
    ranks = load_ranks(out, 4)
    return {case: [r[case] for r in ranks] for case in cases}


@pytest.fixture(scope="module")
def gloo_cases(tmp_path_factory):
    """The Gloo cases, one launch (each launch of 4 ranks starts four
    processes, Horovod and Gloo's rendezvous: most of its time here)."""
    return _launch("gloo", tmp_path_factory.mktemp("hier-gloo"), "train", "dense", "auto")


@pytest.mark.parametrize(
    ("backend", "transport"),
    # A diagonal: each backend once, each transport between nodes once.
    [("gloo", "allgather"), ("mpi", "reduce")],
)
def test_real_ranks_train_with_the_same_parameters(backend, transport, request, tmp_path):
    if backend == "gloo":
        ranks = request.getfixturevalue("gloo_cases")["train"]
    else:
        ranks = _launch(backend, tmp_path, "reduce")["reduce"]
    assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
    for r in ranks[1:]:
        assert r["dlgs"] == ranks[0]["dlgs"]  # every step, bit for bit
    assert all(np.isfinite(r["losses"]).all() for r in ranks)
    assert len(set(ranks[0]["dlgs"])) == len(ranks[0]["dlgs"])  # it trained
    # Each rank exchanged its shards: half of every layer's elements, as a
    # flat chunk (allgather) or as the reduction's alltoall and allgather blocks.
    line = {
        "allgather": "sparse          584 B  2.weight",
        "reduce": "sparse         1092 B  2.weight",
    }[transport]
    assert line in ranks[0]["describe"], ranks[0]["describe"]
    # Horovod form (a) runs the same two-level exchange (its dense layers too).
    for r in ranks[1:]:
        assert r["form_a"] == ranks[0]["form_a"]
    assert len(set(ranks[0]["form_a"])) == len(ranks[0]["form_a"])  # it trained
    assert line in ranks[0]["form_a_describe"]


def test_density_one_is_horovods_allreduce_bit_for_bit(gloo_cases):
    for r in gloo_cases["dense"]:
        assert "error" not in r, r["error"]
        assert r["dlgs"] == r["horovod"]


def test_auto_topology_times_both_and_every_rank_takes_the_same(gloo_cases):
    ranks = gloo_cases["auto"]
    assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
    chose = {r["describe"].splitlines()[0] for r in ranks}
    assert len(chose) == 1 and "topology='auto' chose" in chose.pop(), ranks[0]["describe"]
    for r in ranks[1:]:
        assert r["dlgs"] == ranks[0]["dlgs"]


def test_without_dynamic_process_sets_every_rank_says_what_to_add(tmp_path):
    for r in _launch("gloo", tmp_path, "plain")["plain"]:
        assert "hvd.init(process_sets='dynamic')" in r.get("error", ""), r


def test_tensorflow_doors_run_the_two_level_exchange(tmp_path):
    """The tape (eagerly and in a tf.function), Keras' optimizer and Horovod's
    tape with dlgs.tensorflow.Compression, on 2 nodes of 2: every rank holds
    the same parameters after every step, every door the same ones (one core
    step behind them all), and density 1.0 is Horovod's mean."""
    pytest.importorskip("tensorflow")
    worker = ROOT / "tests" / "parallel" / "tf_hier_worker.py"
    horovodrun("gloo", 4, [worker, tmp_path, "two_level"], timeout=300)
    ranks = load_ranks(tmp_path, 4)
    for r, rec in enumerate(ranks):
        assert rec["two_level"]["ok"], f"rank {r}:\n{rec['two_level'].get('error')}"
    values = [rec["two_level"]["value"] for rec in ranks]
    first = values[0]
    for v in values[1:]:
        assert v == first
    for door in ("tape_function", "keras", "compression"):
        assert first[door] == first["tape"], door
    assert len(set(first["tape"])) == len(first["tape"])  # it trained
    assert {first[f"{form}_exchange"] for form in ("tape", "tape_function", "dense")} == {
        "HierarchicalExchange"
    }
    assert first["dense_max_diff"] <= 1e-6
