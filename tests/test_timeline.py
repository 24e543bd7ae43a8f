"""Count the collectives Horovod actually performed (its timeline) against the plan."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
from conftest import ROOT, horovodrun

pytestmark = pytest.mark.parallel

STEPS = 6


def read_timeline(path):
    text = path.read_text().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e.get("args", {})
    }
    wire = Counter()
    for e in events:
        if e.get("ph") == "B" and e.get("name") in ("GLOO_ALLGATHER", "GLOO_ALLREDUCE"):
            wire[names.get(e["pid"], "?")] += 1
    fused = {names.get(e["pid"]) for e in events if e.get("name") == "MEMCPY_IN_FUSION_BUFFER"}
    return wire, fused


@pytest.mark.parametrize("merge", ["all", "none"])
def test_one_collective_per_planned_message(merge, tmp_path, monkeypatch):
    monkeypatch.setenv("HOROVOD_TIMELINE", str(tmp_path / "timeline.json"))
    # Horovod must not fuse the plan's messages with each other.
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")
    horovodrun(
        "gloo",
        2,
        [ROOT / "tests/parallel/timeline.py", tmp_path, merge, STEPS],
        timeout=300,
        extra_path=ROOT / "tests/parallel",
    )
    record = json.loads((tmp_path / "plan.json").read_text())
    plan = record["final"]
    # Steps each message was in force (the plan applies from step 2, after one
    # skipped and one profiled step; the refined plan two steps later).
    in_force = Counter(
        f"{'allgather' if sparse else 'allreduce'}.{name}"
        for groups in record["history"]
        for name, sparse in groups
    )
    wire, fused = read_timeline(tmp_path / "timeline.json")
    for group in plan:
        key = f"{'allgather' if group['sparse'] else 'allreduce'}.{group['name']}"
        assert in_force[key] >= 2, f"{key}: the final plan was in force for under 2 steps"
        # Horovod's timeline writer can drop one step's events at start-up or
        # shutdown (seen in CI: 5 of 6); more than that, or any extra, is a failure.
        got, want = wire[key], in_force[key]
        assert want - 1 <= got <= want, f"{key}: {got} collectives in {want} steps"
    assert not any(
        n and n.startswith(("allgather.dlgs.sparse", "allreduce.dlgs.dense")) for n in fused
    ), fused
    if merge == "all":
        sparse = [g for g in plan if g["sparse"]]
        assert len(sparse) == 1 and len(sparse[0]["members"]) > 1
    assert os.path.getsize(tmp_path / "timeline.json") > 0
