"""Nothing hangs when a rank fails (issue 42): real ranks under horovodrun,
one of which raises; every rank must end within seconds, the job must fail,
and the failing rank's error must be in the output. A hang is killed by the
launcher and fails the test."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, horovodrun

#: The goal: every rank ends within this many seconds of the fault.
ENDS_WITHIN_S = 5.0


def _run_fault(tmp_path, fault, topology="flat", transport="allgather", np=4, backend="gloo"):
    proc = horovodrun(
        backend,
        np,
        [ROOT / "tests" / "parallel" / "fault_worker.py", tmp_path, fault, topology, transport],
        timeout=120,
        fails=True,
    )
    at = json.loads((tmp_path / "fault.json").read_text())["time"]
    ends = {}
    for r in range(np):
        path = tmp_path / f"exit{r}.json"
        ends[r] = json.loads(path.read_text())["time"] - at if path.exists() else None
    return proc, ends


@pytest.mark.parametrize(("fault", "transport"), [("step", "allgather"), ("construct", "reduce")])
def test_an_exception_on_one_rank_ends_every_rank_of_the_two_level_exchange(
    tmp_path, fault, transport
):
    proc, ends = _run_fault(tmp_path, fault, "hierarchical", transport)
    assert "injected fault" in proc.stdout + proc.stderr
    # A rank killed by the launcher never writes its exit record.
    assert all(t is not None and t < ENDS_WITHIN_S for t in ends.values()), ends


def test_a_damaged_checkpoint_on_rank_0_ends_every_rank_of_the_two_level_exchange(tmp_path):
    proc, ends = _run_fault(tmp_path, "load", "hierarchical")
    assert "NaN" in proc.stdout + proc.stderr or "nan" in proc.stdout + proc.stderr
    assert all(t is not None and t < ENDS_WITHIN_S for t in ends.values()), ends


def test_form_a_on_a_process_set_without_the_compressor_told_names_the_argument(tmp_path):
    """Horovod's test_optimizer_process_sets in form (a), the compressor on the
    global set: an error naming process_set on the optimizer's ranks, not a
    collective that the set's outsiders never join."""
    proc, ends = _run_fault(tmp_path, "form-a-set", np=2)
    assert "process_set: the optimizer reduces on ranks [0]" in proc.stdout + proc.stderr
    assert all(t is not None and t < ENDS_WITHIN_S for t in ends.values()), ends
