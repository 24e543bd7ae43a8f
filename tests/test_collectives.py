"""The collective cost model as the libraries choose: NCCL's
tuning model, MPI's and Gloo's algorithm choice, piecewise costs through the
planner, and the published figures it is checked against."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import numpy as np
import pytest
from test_planner import brute_force, random_spec

from dlgs.clusters import (
    FIGURES,
    PRESETS,
    Figure,
    calibrate,
    check_published,
    cluster,
    compute_of,
)
from dlgs.core.planning.collectives import (
    COLLECTIVES,
    Cluster,
    two_level_costs,
)
from dlgs.core.planning.dp import CostModel, PlanSpec, add_costs, plan_dp, scale_cost
from dlgs.core.planning.netmodel import reduction_cost
from dlgs.core.planning.profile import PROFILE_VERSION, Profile

H100 = Cluster("test", local=8, intra_busbw=370e9, inter_bps=8 * 400e9)
SIZES = np.array([0.0, 4.0, 1e3, 6.5e4, 1e6, 1.6e7, 1.3e8, 1e9, 8e9])


def test_nccl_latencies_are_ncclTopoTuneModel_s():
    """Against tuning.cc's formulas worked by hand (v2.27.7-1 tables, Intel CPU)."""
    one = H100.lines("allreduce", 8)
    assert one["ring/ll"][0] == pytest.approx((6.6 + 14 * 0.6) * 1e-6)  # 15.0 us
    assert one["tree/ll"][0] == pytest.approx((6.8 + 2 * 7 * 0.6) * 1e-6)  # 15.2 us
    sixteen = H100.lines("allreduce", 128)  # 16 nodes of 8
    # 2(P-1) - 2(N-1) = 224 intra steps at max(0.6, 1.0 net overhead), 30 at 2.7.
    assert sixteen["ring/ll"][0] == pytest.approx((6.6 + 224 * 1.0 + 30 * 2.7) * 1e-6)
    assert sixteen["tree/ll"][0] == pytest.approx((6.8 + 2 * (7 * 0.6 + 4 * 5.0)) * 1e-6)
    # The allgather has only the ring: P-1 steps, N-1 of them between nodes.
    gather = H100.lines("allgather", 128)
    assert set(gather) == {"ring/ll", "ring/ll128", "ring/simple"}
    # (Simple: intra steps at max(3.4, 3 x 1.0 us of network overhead).)
    assert gather["ring/simple"][0] == pytest.approx((8.4 + 112 * 3.4 + 15 * 14.0) * 1e-6)


def test_bandwidths_follow_nccl_tests_busbw():
    """At large sizes the ring's time is nccl-tests' busbw definition:
    allreduce 2(P-1)/P * S / busbw, allgather (P-1) * chunk / busbw."""
    s = 8 * 2**30
    for p in (8, 64):
        bus = H100.busbw(p)
        t = H100.time("allreduce", p, s, "ring/simple")
        assert 2 * (p - 1) / p * s / t == pytest.approx(bus, rel=0.02)
        t = H100.time("allgather", p, s / p, "ring/simple")
        assert (p - 1) * (s / p) / t == pytest.approx(bus, rel=0.02)
    # Across nodes, the least of the node's ring and its NICs (at 96% of line rate).
    assert H100.busbw(64) == 370e9  # 8 x 400 Gbit/s: 384 GB/s
    assert replace(H100, inter_bps=8 * 200e9).busbw(64) == pytest.approx(1.6e12 / 8 * 0.96)


@pytest.mark.parametrize("library", ["nccl", "mpi", "gloo"])
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_the_collective_takes_its_fastest_algorithm_at_every_size(library, collective):
    c = replace(H100, library=library)
    for p in (2, 8, 16, 1024):
        lines = c.lines(collective, p)
        model = c.cost(collective, p)
        best = np.min([a + b * SIZES for a, b in lines.values()], axis=0)
        np.testing.assert_allclose(model(SIZES), best, rtol=1e-12)
        assert model.least_alpha == min(a for a, _ in lines.values())


def test_at_scale_the_tree_beats_the_ring_for_small_allreduces_not_large_ones():
    lines = H100.lines("allreduce", 1024)
    best_small = min(lines, key=lambda k: lines[k][0] + lines[k][1] * 1e3)
    # (At 1,024 ranks the ring's 2(P-1) latencies outweigh the tree's lower
    # bandwidth up to tens of GB; at 64 ranks from about 1 GB.)
    lines = H100.lines("allreduce", 64)
    best_large = min(lines, key=lambda k: lines[k][0] + lines[k][1] * 8e9)
    assert best_small.startswith("tree")
    assert best_large.startswith("ring")
    # MPI: recursive doubling's log2(P) latencies for small buffers.
    mpi = replace(H100, library="mpi").lines("allreduce", 1024)
    assert mpi["recursive_doubling"][0] == pytest.approx(10 * H100.latency_s)
    assert mpi["ring"][0] == pytest.approx(2 * 1023 * H100.latency_s)


def test_sums_and_scalings_of_piecewise_costs_are_pointwise():
    rng = random.Random(3)
    for _ in range(50):
        a = CostModel(rng.random(), rng.random(), others=((rng.random(), rng.random() / 3),))
        b = CostModel(rng.random(), rng.random(), others=((rng.random() / 2, rng.random()),))
        k = rng.uniform(0.1, 3)
        xs = np.array([rng.uniform(0, 10) for _ in range(20)])
        np.testing.assert_allclose(add_costs(a, b, k)(xs), a(xs) + b(k * xs), rtol=1e-12)
        want = np.min([2.0 * al + k * be * xs for al, be in a.lines], axis=0)
        np.testing.assert_allclose(scale_cost(a, 2.0, k)(xs), want, rtol=1e-12)
    # The reduction is derived line by line from the allgather it replaces.
    gather = H100.cost("allgather", 64)
    red = reduction_cost(gather, 64, 1.25)
    want = np.min([2 * al + 2 * 1.25 / 64 * be * SIZES for al, be in gather.lines], axis=0)
    np.testing.assert_allclose(red(SIZES), want, rtol=1e-12)


def test_the_two_level_exchange_is_its_collectives_in_turn():
    p, r = 32, 2.5
    sparse, dense = two_level_costs(H100, p, r)
    node = replace(H100, local=8)
    cross = replace(H100, local=1, inter_bps=H100.inter_bps / 8)
    for c in (1e3, 1e6, 1e8):
        in_node = node.time("reducescatter", 8, r * c) + node.time("allgather", 8, r * c / 8)
        assert sparse(c) == pytest.approx(in_node + cross.time("allgather", 4, c / 8))
        b = c
        dense_want = (
            node.time("reducescatter", 8, b)
            + cross.time("allreduce", 4, b / 8)
            + node.time("allgather", 8, b / 8)
        )
        assert dense(b) == pytest.approx(dense_want)
    # With the reduction between nodes: the same node part, the reduction's
    # cost (from the cross-node allgather) in place of the allgather.
    reduced, _ = two_level_costs(H100, p, r, 1.25)
    between = reduction_cost(cross.cost("allgather", 4), 4, 1.25)
    for c in (1e3, 1e6, 1e8):
        in_node = node.time("reducescatter", 8, r * c) + node.time("allgather", 8, r * c / 8)
        assert reduced(c) == pytest.approx(in_node + between(c / 8))
    with pytest.raises(ValueError, match="world_size"):
        two_level_costs(H100, 8, r)


def test_the_dp_stays_optimal_with_piecewise_costs():
    """The brute-force check of the DP with collectives that switch algorithm by size."""
    rng = random.Random(44)
    for trial in range(80):
        base = random_spec(rng, rng.randint(1, 9))

        def piecewise(c: CostModel) -> CostModel:
            # A second algorithm: less latency, more per byte.
            return CostModel(c.alpha, c.beta, others=((c.alpha / 10, c.beta * 4),))

        spec = PlanSpec(base.layers, piecewise(base.allgather), piecewise(base.allreduce))
        plan = plan_dp(spec)
        assert math.isclose(plan.end, brute_force(spec), rel_tol=1e-12, abs_tol=1e-15), trial


def test_a_profile_with_several_algorithms_round_trips():
    layers = random_spec(random.Random(1), 3)
    ag, ar = H100.cost("allgather", 64), H100.cost("allreduce", 64)
    prof = Profile.from_dict(
        {
            "world_size": 64,
            "layers": [{"name": la.name, "numel": 10, "backward": 1e-3} for la in layers.layers],
            "sparsify": {"alpha": 1e-5, "beta": 1e-9},
            "pack": {"alpha": 1e-5, "beta": 1e-9},
            "allgather": {
                "alpha": ag.alpha,
                "beta": ag.beta,
                "others": [list(x) for x in ag.others],
            },
            "allreduce": {
                "alpha": ar.alpha,
                "beta": ar.beta,
                "others": [list(x) for x in ar.others],
            },
            "version": PROFILE_VERSION,
        }
    )
    assert prof.allgather == ag and prof.allreduce == ar
    assert Profile.from_dict(prof.to_dict()) == prof
    bad = prof.to_dict()
    bad["allreduce"]["others"] = [[1.0]]
    with pytest.raises(ValueError, match=r"allreduce.others\[0\]"):
        Profile.from_dict(bad)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(local=0), "local must be an int >= 1"),
        (dict(intra_busbw=0.0), "intra_busbw must be a finite float > 0"),
        (dict(inter_bps=-1.0), "inter_bps must be a finite float > 0"),
        (dict(library="ucx"), "library must be one of"),
        (dict(nic_efficiency=1.5), r"nic_efficiency must be in \(0, 1\]"),
        (dict(overhead_s=math.inf), "overhead_s must be a finite float >= 0"),
        (dict(ramp_s=-1e-6), "ramp_s must be a finite float >= 0"),
        (dict(ramp_efficiency=0.0), r"ramp_efficiency must be in \(0, 1\]"),
        (dict(ramp_efficiency=1.5), r"ramp_efficiency must be in \(0, 1\]"),
    ],
)
def test_bad_clusters_name_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        replace(H100, **kwargs)


def test_bad_calls_name_the_parameter():
    with pytest.raises(ValueError, match="collective must be one of"):
        H100.cost("broadcast", 8)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        H100.cost("allreduce", 0)
    with pytest.raises(ValueError, match="cluster must be one of"):
        cluster("dgx-z")
    with pytest.raises(ValueError, match="algorithm 'tree' has no line for allgather"):
        H100.time("allgather", 8, 1e6, "tree")


def test_every_published_figure_is_priced_and_calibrations_are_met():
    """docs/netmodel.md's table: every figure has a preset and an algorithm
    the model knows; the large-message calibrations (which set the bus
    bandwidths) are met within 2%; every collective is checked."""
    checked = check_published()
    assert len(checked) == len(FIGURES) >= 40
    for c in checked:
        assert c.figure.preset in PRESETS
        assert math.isfinite(c.deviation)
        if c.figure.calibration and c.figure.nbytes >= 2**31:
            assert abs(c.deviation) < 0.02, c
    checks = {c.figure.collective for c in checked if not c.figure.calibration}
    assert checks == {"allreduce", "allgather", "reducescatter"}


@pytest.mark.parametrize("gpu", ["hopper", "ampere"])
def test_the_presets_ramp_is_what_calibrate_finds_on_their_calibration_figures(gpu):
    """The presets' overhead and ramp are fitted, not typed: calibrate() on
    the calibration figures of the GPU's presets gives them back."""
    presets = {name for name, c in PRESETS.items() if c.gpu == gpu}
    figures = [f for f in FIGURES if f.calibration and f.preset in presets]
    assert figures and not any(
        f.calibration for f in FIGURES if f.preset not in presets and PRESETS[f.preset].gpu == gpu
    )
    base = PRESETS[figures[0].preset]
    fitted = calibrate(base, figures)
    for c in (PRESETS[name] for name in presets):
        assert (c.overhead_s, c.ramp_efficiency, c.ramp_s) == pytest.approx(
            (fitted.overhead_s, fitted.ramp_efficiency, fitted.ramp_s)
        )


def test_calibrate_recovers_a_known_overhead_and_ramp():
    """Figures priced by a cluster with a known overhead and ramp, fitted
    from the same cluster without them: the grid point that made them."""
    truth = replace(H100, overhead_s=12e-6, ramp_efficiency=0.6, ramp_s=80e-6)
    sizes = [2.0**k for k in range(10, 34, 2)]
    figures = [
        Figure("synthetic", "h100-ib400", p, kind, s, "time", truth.time(kind, p, chunk))
        for p in (8, 16)
        for kind in ("allreduce", "allgather")
        for s in sizes
        for chunk in [s / p if kind == "allgather" else s]
    ]
    fitted = calibrate(H100, figures)
    assert (fitted.overhead_s, fitted.ramp_efficiency, fitted.ramp_s) == pytest.approx(
        (12e-6, 0.6, 80e-6)
    )
    with pytest.raises(ValueError, match="figures must hold at least one figure"):
        calibrate(H100, [])


def test_the_ramp_lowers_small_messages_bandwidth_and_adds_latency_to_full_speed():
    """Each algorithm becomes its ramping line (its latency, bandwidth x
    ramp_efficiency) and its full-speed line (ramp_s more latency); the
    collective's bandwidth grows with size and reaches the plain model's."""
    ramped = replace(H100, overhead_s=10e-6, ramp_efficiency=0.5, ramp_s=100e-6)
    plain, lines = H100.lines("allreduce", 8), ramped.lines("allreduce", 8)
    assert set(lines) == set(plain) | {f"{k}/ramp" for k in plain}
    for k, (a, b) in plain.items():
        assert lines[k] == pytest.approx((a + 110e-6, b))
        assert lines[f"{k}/ramp"] == pytest.approx((a + 10e-6, 2 * b))
    sizes = np.array([2.0**k for k in range(10, 36)])
    busbw = sizes / ramped.cost("allreduce", 8)(sizes)
    assert np.all(np.diff(busbw) > 0)
    big = 2.0**40
    assert ramped.time("allreduce", 8, big) == pytest.approx(H100.time("allreduce", 8, big), 1e-3)
    # The default is no ramp: the plain lines only.
    assert set(replace(H100, ramp_s=1.0).lines("allreduce", 8)) == set(plain)


def test_presets_carry_their_gpus_published_compute_per_model():
    """compute_of: the GPU's published throughput on the model, as FLOP/s of
    the catalog's compute model (6 MACs per sample) and that run's batch;
    the GPU's median where it has no figure; given values win."""
    from dlgs.catalog import DEFAULT_COMPUTE_FLOPS, catalog_model

    a100 = compute_of("a100-eth25", "resnet50")
    macs = sum(layer.macs for layer in catalog_model("resnet50").layers)
    assert a100.flops == pytest.approx(6 * macs * 2470) and a100.batch == 256
    assert 50e12 < a100.flops < 70e12  # about a fifth of an A100's 312 TFLOP/s peak
    h100 = compute_of("h100-ib400", "resnet50")
    assert h100.flops > 2.5 * a100.flops and h100.batch == 400
    assert compute_of("h100-ib400", "vgg16").flops == pytest.approx(h100.flops)
    assert "median" in compute_of("a100-eth25", "vgg16").source
    given = compute_of("a100-eth25", "resnet50", 150e12, 32)
    assert (given.flops, given.batch) == (150e12, 32)
    assert compute_of(None, "resnet50").flops == DEFAULT_COMPUTE_FLOPS
    with pytest.raises(ValueError, match="cluster must be one of"):
        compute_of("dgx-z", "resnet50")


def test_the_docs_table_of_published_figures_is_current():
    from conftest import ROOT

    from dlgs.clusters import figures_table

    text = (ROOT / "docs" / "netmodel.md").read_text()
    table = text.split("<!-- figures-table -->\n")[1].split("\n<!-- /figures-table -->")[0]
    assert table == figures_table()
