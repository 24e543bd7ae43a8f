"""Count the collectives Horovod actually performed (its timeline) against the plan."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
from conftest import ROOT, horovodrun

pytestmark = pytest.mark.parallel

STEPS = 6
PLANNED_STEPS = STEPS - 2  # step 0 as is, step 1 profiled, the plan applies from step 2


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
    plan = json.loads((tmp_path / "plan.json").read_text())
    wire, fused = read_timeline(tmp_path / "timeline.json")
    for group in plan:
        op = "allgather" if group["sparse"] else "allreduce"
        count = wire[f"{op}.{group['name']}"]
        assert count >= PLANNED_STEPS, f"{group['name']}: {count} collectives in {STEPS} steps"
        assert count <= STEPS, f"{group['name']}: {count} collectives in {STEPS} steps"
    assert not any(
        n and n.startswith(("allgather.dlgs.sparse", "allreduce.dlgs.dense")) for n in fused
    ), fused
    if merge == "all":
        sparse = [g for g in plan if g["sparse"]]
        assert len(sparse) == 1 and len(sparse[0]["members"]) > 1
        # Exactly one allgather per step once the plan is in force.
        assert wire[f"allgather.{sparse[0]['name']}"] == PLANNED_STEPS
    assert os.path.getsize(tmp_path / "timeline.json") > 0
