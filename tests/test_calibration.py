"""Collectives saved by one job and planned from by the next
(``calibration_file``, ``dlgs/core/planning/calibration.py``): ranks as threads
whose collectives cost what a 100 Mbit/s link charges (test_probe_fit's)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from local_world import OPS, LocalWorld
from test_probe_fit import LINK, SIZES, _Clock, _SlowLink

from dlgs.core import MergeConfig, SparseExchange, SparsityConfig
from dlgs.core.planning.calibration import Calibration
from dlgs.core.planning.online import OnlinePlanner


def _job(path, world=2, steps=12, link=None):
    """One training job of ``steps`` steps on ``world`` ranks with
    ``calibration_file=path``: per rank, the probes it issued, its profile's
    collectives and the plan's groups."""

    def body(rank, comm):
        clock = _Clock()
        comm = _SlowLink(comm.world, rank, clock)
        cfg = SparsityConfig(density=0.01, min_sparse_size=1024)
        ex = SparseExchange(OPS, comm, cfg, SIZES, clock=clock)
        planner = OnlinePlanner(
            "dp", profile_steps=2, refine=False, calibration_file=str(path), link_bandwidth=link
        )
        ex.step_hooks.append(planner)
        rng = np.random.default_rng(rank)
        for _ in range(steps):
            for i, layer in enumerate(ex.layers):
                ex.submit(i, rng.standard_normal(layer.numel).astype(np.float32))
            ex.wait()
        p = planner.profile
        groups = [(list(g.members), g.sparse) for g in ex.groups]
        costs = (p.pack, p.allgather, p.allreduce)
        return planner.cost["probes"], costs, groups, p.priced_by, planner.collectives_from

    return LocalWorld(world).run(body)


def test_a_second_job_plans_from_the_first_jobs_collectives_without_probing(tmp_path, caplog):
    path = tmp_path / "cluster.json"
    with caplog.at_level(logging.INFO, logger="dlgs"):
        first = _job(path)
    assert "no calibration in" in caplog.text
    probes, costs, groups, priced_by, source = first[0]
    assert source is None  # this job's probes
    assert probes > 0 and all(r[0] == probes for r in first)
    saved = Calibration.load(path)
    # Rank 0's fitted collectives, the ones every rank planned from.
    assert saved.world_size == 2 and (saved.pack, saved.allgather, saved.allreduce) == costs
    assert saved.allgather.beta == pytest.approx(LINK, rel=0.05)
    assert saved.priced_by == priced_by == ("bound", "bound")  # the slow small probe
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dlgs"):
        second = _job(path)
    assert "no probes" in caplog.text
    for probes2, costs2, groups2, _, source2 in second:
        assert probes2 == 0 and source2 == str(path)
        assert costs2 == (saved.pack, saved.allgather, saved.allreduce)
        assert groups2 == groups  # the same collectives and the same timings: the same plan


def test_a_file_from_another_world_size_or_unreadable_is_set_aside_and_written_anew(
    tmp_path, caplog
):
    path = tmp_path / "cluster.json"
    _job(path)
    four = Calibration.load(path)
    path.write_text(json.dumps({**four.to_dict(), "world_size": 4}))
    with caplog.at_level(logging.WARNING, logger="dlgs"):
        runs = _job(path)
    assert "was written at 4 ranks, this job has 2" in caplog.text
    assert all(r[0] > 0 for r in runs) and Calibration.load(path).world_size == 2
    path.write_text("{not json")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dlgs"):
        runs = _job(path)
    assert "set aside (not a JSON file" in caplog.text and all(r[0] > 0 for r in runs)
    assert Calibration.load(path).world_size == 2


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(world_size=0), "world_size"),
        (dict(allgather={"alpha": 0.0, "beta": 0.0}), "allgather.alpha and allgather.beta"),
        (dict(allreduce={"alpha": -1.0, "beta": 0.0}), "allreduce.alpha"),
        (dict(priced_by=["probes", "guess"]), "priced_by"),
        (dict(version=2), "version"),
        (dict(extra=1), "unknown field calibration.extra"),
    ],
)
def test_a_malformed_calibration_names_its_field(tmp_path, change, words):
    path = tmp_path / "cluster.json"
    _job(path, steps=6)
    data = {**Calibration.load(path).to_dict(), **change}
    with pytest.raises(ValueError, match=words):
        Calibration.from_dict(data)


def test_calibration_file_takes_a_path_and_names_itself_otherwise(tmp_path):
    assert MergeConfig(calibration_file=tmp_path / "c.json").calibration_file == str(
        tmp_path / "c.json"
    )
    with pytest.raises(TypeError, match="calibration_file must be None or a path"):
        MergeConfig(calibration_file=3)


def test_a_file_written_under_another_link_bandwidth_is_set_aside(tmp_path, caplog):
    path = tmp_path / "cluster.json"
    _job(path)
    with caplog.at_level(logging.WARNING, logger="dlgs"):
        runs = _job(path, link=1e8)
    assert "written with link_bandwidth=None, this job has 100000000.0" in caplog.text
    assert all(r[0] > 0 for r in runs)
    saved = Calibration.load(path)
    assert saved.link_bandwidth == 1e8 and saved.priced_by == ("link_bandwidth",) * 2


def test_a_failed_save_says_why_and_leaves_nothing_behind(tmp_path):
    path = tmp_path / "cluster.json"
    _job(path, steps=6)
    saved = Calibration.load(path)
    target = tmp_path / "a directory"
    target.mkdir()
    problem = saved.save(target)
    assert problem is not None and "could not write calibration_file" in problem
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a directory", "cluster.json"]


def test_the_costs_line_says_where_the_collectives_came_from_and_what_priced_them():
    from dlgs.core.engine import _costs_line
    from dlgs.core.planning.dp import CostModel
    from dlgs.core.planning.profile import LayerProfile, Profile

    line = CostModel(1e-4, 8e-9)
    profile = Profile(
        2, (LayerProfile("w", 10, 0.0),), line, line, line, line,
        priced_by=("link_bandwidth", "probes"),
    )  # fmt: skip
    assert Profile.from_dict(profile.to_dict()) == profile  # priced_by is kept
    text = _costs_line(profile)
    assert "this job's probes" in text and "8.000 ns/B (bytes not seen by the probes: the " in text
    assert text.count("link_bandwidth given") == 1
    assert "the calibration_file /c.json" in _costs_line(profile, "/c.json")
