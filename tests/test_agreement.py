"""Rank agreement and process sets with two real ranks (Gloo and MPI).

Every option that shapes the exchange, given differently to the two ranks, is a
``RankMismatchError`` on both ranks naming it; split process sets train and
then meet again on the global set. One horovodrun launch per backend (and one
for TensorFlow) runs every scenario; a launch that hangs is killed after
``LAUNCH_TIMEOUT`` seconds and fails its tests (``conftest.horovodrun``; the
workers dump their stacks a little earlier, so the failure shows where they waited).
"""

from __future__ import annotations

import inspect

import pytest
from conftest import run_scenarios, value

from dlgs.core.config import SparsityConfig
from dlgs.core.planning.online import OnlinePlanner
from dlgs.core.state.consistency import (
    RankMismatchError,
    agreed_options,
    canonical,
    check_ranks_agree,
    describe_mismatch,
    horovod_options,
    signature,
)

parallel = pytest.mark.parallel

LAUNCH_TIMEOUT = 240  # seconds; well under pytest's 600

TORCH = ["option_mismatch", "process_sets", "resume_mismatch"]
TF = ["tf_option_mismatch", "tf_process_sets"]


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"agree-{request.param}")
    return run_scenarios(request.param, "agree_worker.py", out, TORCH, timeout=LAUNCH_TIMEOUT)


@pytest.fixture(scope="module")
def tf_ranks(tmp_path_factory):
    pytest.importorskip("tensorflow")
    out = tmp_path_factory.mktemp("agree-tf")
    return run_scenarios("gloo", "agree_tf_worker.py", out, TF, timeout=LAUNCH_TIMEOUT)


def _check_mismatches(records, cases) -> None:
    """Each case raised on both ranks, naming the option and both values."""
    for r, rec in enumerate(records):
        for case, (name, values) in cases.items():
            msg = rec[case]
            assert msg is not None, f"rank {r}: {case} differing across ranks was not an error"
            assert name in msg, f"rank {r} {case}: {msg!r} does not name {name!r}"
            for v in values:
                assert str(v) in msg, f"rank {r} {case}: {msg!r} does not show {v!r}"


@parallel
def test_every_exchange_option_must_agree(ranks):
    recs = value(ranks, "option_mismatch")
    cases = {
        "bucket_elements": ("bucket_elements", (1024, 2048)),
        "drift_window": ("drift_window", (50, 8)),
        "max_group": ("max_group", (None, 2)),
        "drift_tolerance": ("drift_tolerance", (0.25, 0.5)),
        "profile_budget": ("profile_budget", (0.01, 0.05)),
        "profile_steps": ("profile_steps", (5, 3)),
        "merge": ("merge", ("dp", "greedy")),
        "gradient_predivide_factor": ("gradient_predivide_factor", (0.5, 1.0)),
        "op": ("op", ("Average", "Sum")),
        "compression": ("compression", ("NoneCompressor", "FP16Compressor")),
        "backward_passes_per_step": ("backward_passes_per_step", (1, 2)),
        "density": ("density", (0.01, 0.02)),
        "scaler": ("loss_scaler", (False, True)),
        "compression_form/bucket_elements": ("bucket_elements", (1024, 2048)),
        "form": ("prefix", ()),
        "planner/skip_steps": ("skip_steps", (1, 2)),
        "planner/probe_reps": ("probe_reps", (3, 4)),
        "planner/refine": ("refine", (True, False)),
        "planner/guard": ("guard", (True, False)),
        "planner/record": ("record", (False, True)),
        "planner/profile": ("profile", ()),
        "extra/loss_scale": ("loss_scale", (1024.0, 2048.0)),
    }
    _check_mismatches(recs, cases)
    assert [rec["control"] for rec in recs] == [None, None]
    # Every case in the worker is checked here.
    assert set(recs[0]) == set(cases) | {"control"}


@parallel
def test_split_process_sets_train_and_meet_again(ranks):
    r0, r1 = value(ranks, "process_sets")
    for rec in (r0, r1):
        for form in ("optimizer", "compression"):
            split = rec[f"split/{form}"]
            assert split["finite"] and len(set(split["digests"])) == 12, form
            outside = rec[f"outside/{form}"]["digests"]
            assert len(set(outside)) == 8, f"{form}: a rank outside the set did not train"
        # Profiled, planned and refined on its one-rank set (probes and broadcasts).
        assert rec["split/optimizer"]["plans_made"] >= 2, rec["split/optimizer"]
    # One-rank sets: each rank trained its own copy on its own data.
    assert r0["split/optimizer"]["digests"] != r1["split/optimizer"]["digests"]
    for form in ("optimizer", "compression"):
        assert r0[f"global/{form}"] == r1[f"global/{form}"], f"{form}: ranks differ globally"
    assert r0["final"] == r1["final"]
    for rec in (r0, r1):
        msg = rec["attach_other_set"]
        assert msg and "process_set: the optimizer reduces on ranks [0]" in msg, msg


@parallel
def test_tf_options_must_agree(tf_ranks):
    cases = {
        "bucket_elements": ("bucket_elements", (1024, 2048)),
        "drift_window": ("drift_window", (50, 8)),
        "max_group": ("max_group", (None, 2)),
        "gradient_predivide_factor": ("gradient_predivide_factor", (0.5, 1.0)),
        "op": ("op", ("Average", "Sum")),
        "compression": ("compression", ("NoneCompressor", "FP16Compressor")),
    }
    _check_mismatches(value(tf_ranks, "tf_option_mismatch"), cases)


@parallel
def test_tf_split_process_sets_train_and_meet_again(tf_ranks):
    r0, r1 = value(tf_ranks, "tf_process_sets")
    for rec in (r0, r1):
        assert rec["split"]["finite"] and len(set(rec["split"]["digests"])) == 12
        assert len(set(rec["outside"]["digests"])) == 8
    assert r0["split"]["digests"] != r1["split"]["digests"]
    assert r0["global"] == r1["global"] and r0["final"] == r1["final"]


# -- without ranks ---------------------------------------------------------------


def test_planner_options_cover_every_constructor_argument():
    names = set(inspect.signature(OnlinePlanner.__init__).parameters) - {"self"}
    opts = OnlinePlanner("buckets", bucket_elements=4096, max_group=3).options()
    assert set(opts) == names
    assert opts["strategy"] == "buckets" and opts["bucket_elements"] == 4096
    assert opts["max_group"] == 3 and opts["profile"] == {"given": False, "sha256": None}


class _Comm:
    op, prescale_factor, postscale_factor = 1, 0.5, 2.0

    class compression:  # a compressor class, as hvd.Compression.fp16
        pass

    class process_set:
        ranks = [1, 0]

    def options(self):
        class hvd:
            Average, Sum = 0, 1

        return horovod_options(self, hvd)


def test_agreed_options_are_plain_data_and_mismatches_name_the_option():
    class Scaler:
        pass

    opts = agreed_options(
        SparsityConfig(), OnlinePlanner("dp"), _Comm(), average=True, scaler=Scaler()
    )
    assert opts["horovod"]["op"] == "Sum" and opts["horovod"]["process_set"] == [0, 1]
    assert opts["horovod"]["compression"].endswith("_Comm.compression")
    assert opts["exchange"]["scaler"].endswith("Scaler")  # by class, not identity
    assert canonical(opts) == opts
    other = agreed_options(SparsityConfig(), OnlinePlanner("greedy"), _Comm(), average=True)
    msg = describe_mismatch([signature([], opts), signature([], other)])
    assert "planner.strategy='greedy' on rank 1 but 'dp' on rank 0 (set by merge=)" in msg
    assert "exchange.scaler" in msg


def test_check_ranks_agree_gathers_once_and_raises_the_same_error():
    a = signature([("w", (2,), "float32")], {"x": 1})
    b = signature([("w", (2,), "float32")], {"x": 2})
    calls = []
    check_ranks_agree(a, lambda s: calls.append(s) or [a, a], size=2)
    check_ranks_agree(a, lambda s: calls.append(s) or [a, b], size=1)  # nothing to check
    assert len(calls) == 1
    with pytest.raises(RankMismatchError, match="option x=2 on rank 1 but 1 on rank 0"):
        check_ranks_agree(a, lambda s: [a, b], size=2)


@parallel
def test_loads_after_training_began_are_each_ranks_own_and_train_on(ranks):
    recs = value(ranks, "resume_mismatch")
    for r, rec in enumerate(recs):
        assert rec["same_step"] is None, f"rank {r}: {rec['same_step']}"
        assert rec["other_step"] is None, f"rank {r}: {rec['other_step']}"
    assert recs[0]["step"] == recs[1]["step"] == 6  # the agreed step goes on
    assert recs[0]["params"] == recs[1]["params"]


class _Gather:
    """A one-rank stand-in for the agreement's collectives: its gather blocks
    (the other ranks never come) or answers at once."""

    size, rank = 2, 1

    def __init__(self, blocks: bool):
        self.blocks = blocks

    def allgather_object(self, obj, name):
        if self.blocks:
            import threading

            threading.Event().wait(30)  # a daemon thread: ends with the test process
        return [obj, obj]


def test_an_agreement_that_resync_asked_for_waits_a_bounded_time(monkeypatch):
    """resync() on one rank alone: its agreement raises RankMismatchError
    naming the call after RESYNC_WAIT_SECONDS, instead of waiting forever for
    ranks that are in their step; a construction's or a load's agreement is
    not bounded (a rank may start late), and one that completes is unchanged."""
    import time

    from dlgs.core.state import resume

    monkeypatch.setattr(resume, "RESYNC_WAIT_SECONDS", 0.3)
    agreement = resume.Agreement(_Gather(blocks=True), "dlgs.agree")
    agreement.due(bounded=True)
    began = time.monotonic()
    with pytest.raises(RankMismatchError, match=r"resync\(\) or reprofile\(\) on rank 1"):
        agreement.run(lambda: {"step": 3})
    assert time.monotonic() - began < 5
    assert not agreement.bounded and not agreement.pending
    answered = resume.Agreement(_Gather(blocks=False), "dlgs.agree")
    answered.due(bounded=True)
    assert answered.run(lambda: {"step": 3}) is None  # every rank the same: nothing to adopt
    later = resume.Agreement(_Gather(blocks=False), "dlgs.agree")
    later.due(loaded=True)
    assert not later.bounded
