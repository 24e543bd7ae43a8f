"""dlgs.torch.ddp: the DDP communication hook on real ranks (torchrun, Gloo).

One launch runs every scenario of ``tests/parallel/ddp_worker.py`` on 2 ranks;
each test asserts on both ranks' records. The MPI backend is not in PyTorch's
CPU wheels, so the hook is tested on Gloo only (NCCL needs GPUs).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import ROOT, check_door_cells, load_ranks, torchrun, value
from test_docs import TORCHRUN, blocks

SCENARIOS = [
    "dense_equals_ddp",
    "sparse_training",
    "exact_reconstruction",
    "conservation",
    "unused_parameters",
    "empty_parameters",
    "resume",
    "one_rank_load",
    "pickled_state",
    "amp_nonfinite",
    "error_mid_step",
    "momentum_and_warmup",
    "nonfinite_step",
    "mismatch",
    "bad_input",
    "door_cells",
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    torchrun(2, [ROOT / "tests/parallel/ddp_worker.py", out, *SCENARIOS], timeout=400)
    return load_ranks(out, 2)


def test_density_one_equals_ddp_without_a_hook(ranks):
    for r, v in enumerate(value(ranks, "dense_equals_ddp")):
        for case, rec in v.items():
            assert rec["hook"] == rec["plain"], f"rank {r} {case}"
    a, b = value(ranks, "dense_equals_ddp")
    assert a == b


def test_parameters_with_no_elements_train_as_under_plain_ddp(ranks):
    a, b = value(ranks, "empty_parameters")
    assert a == b
    assert len(set(a["sparse"])) == 4  # it trains
    assert a["dense"] == a["plain"]


def test_sparse_training_keeps_ranks_bit_identical_after_every_step(ranks):
    a, b = value(ranks, "sparse_training")
    for case in a:
        assert a[case]["digests"] == b[case]["digests"], case
        assert len(set(a[case]["digests"])) == len(a[case]["digests"])  # it trains
        if case.startswith("none"):
            assert a[case]["sparse_messages"] >= 2, case
        else:
            assert a[case]["planned"], f"{case}: the dp planner settled on a plan"
        assert a[case]["step"] == 8
    assert a["none.passes1.reduce"]["transport"] != "flat"  # by the sparse reduction


def test_k_sparse_gradients_are_reconstructed_exactly(ranks):
    for r, v in enumerate(value(ranks, "exact_reconstruction")):
        for case, rec in v.items():
            assert rec["sparse_layers"] >= 2, (r, case)
            assert rec["max_diff"] == 0.0, f"rank {r} {case}: {rec}"


def test_error_feedback_conserves_the_gradient(ranks):
    for r, rec in enumerate(value(ranks, "conservation")):
        assert rec["sparse_layers"] >= 2
        assert rec["max_error"] <= 1e-5 * rec["scale"], f"rank {r}: {rec}"


def test_unused_parameters_with_find_unused_parameters(ranks):
    a, b = value(ranks, "unused_parameters")
    assert a["digests"] == b["digests"]
    assert len(set(a["digests"])) == len(a["digests"])


def test_resume_from_a_checkpoint_trains_on_identically(ranks):
    for r, rec in enumerate(value(ranks, "resume")):
        assert rec["resumed"] == rec["on"], f"rank {r}"
        assert rec["resumed_dp"] == rec["on_dp"], f"rank {r}: with a plan in force"
        assert rec["without_dlgs_state"] != rec["on"], "the comparison can fail"
    a, b = value(ranks, "resume")
    assert a["on"] == b["on"] and a["on_dp"] == b["on_dp"]


def test_a_load_on_one_rank_after_training_began_goes_on_with_ranks_identical(ranks):
    r0, r1 = value(ranks, "one_rank_load")
    assert r0 == r1 and r0["step"] == 7, (r0, r1)


def test_a_pickled_state_binds_again_and_trains_on(ranks):
    for r, rec in enumerate(value(ranks, "pickled_state")):
        assert rec["resumed"] == rec["on"], f"rank {r}"
        assert "bind(model)" in rec["unbound"]
        assert "already" in rec["errors"]["twice"]
        assert "scaler is required" in rec["errors"]["scaler"]


def test_an_error_inside_the_hook_is_raised_by_backward_on_every_rank(ranks):
    for rec in value(ranks, "error_mid_step"):
        assert "injected: gradient" in rec["message"], rec["message"]
        assert rec["pending"], "the exchange's step was reset (every layer pending again)"


def test_amp_step_non_finite_on_one_rank_is_skipped_on_both(ranks):
    a, b = value(ranks, "amp_nonfinite")
    assert a["digests"] == b["digests"]
    assert a["digests"][2] == a["digests"][1], "step 2 was skipped"
    assert a["digests"][3] != a["digests"][2]
    assert a["scales"] == b["scales"]
    assert a["scales"][2] == a["scales"][1] / 2


def test_momentum_correction_and_warmup_keep_ranks_identical(ranks):
    a, b = value(ranks, "momentum_and_warmup")
    assert a["digests"] == b["digests"]
    assert len(set(a["digests"])) == len(a["digests"])


def test_a_step_non_finite_on_one_rank_is_seen_by_both(ranks):
    a, b = value(ranks, "nonfinite_step")
    assert a["finite"] == b["finite"] == [True, True, False, True, True]
    assert a["digests"] == b["digests"]
    assert a["digests"][2] == a["digests"][1]


def test_mismatched_options_raise_on_every_rank(ranks):
    for rec in value(ranks, "mismatch"):
        assert rec["error"] == "RankMismatchError"
        assert "density" in rec["message"]


def test_bad_input_names_the_option(ranks):
    for rec in value(ranks, "bad_input"):
        assert rec["not_ddp"].startswith("TypeError")
        assert "DistributedDataParallel" in rec["not_ddp"]
        assert rec["density"].startswith("ValueError") and "density" in rec["density"]
        assert rec["scaler"].startswith("TypeError") and "scaler" in rec["scaler"]


def test_the_docs_ddp_script_runs_under_torchrun(tmp_path, monkeypatch):
    found = [code for _, harness, code in blocks("docs/ddp.md") if harness == TORCHRUN]
    assert found, "docs/ddp.md has a script for torchrun"
    monkeypatch.setenv("STEPS", "6")
    for j, code in enumerate(found):
        script = tmp_path / f"ddp_doc_{j}.py"
        script.write_text(code)
        try:
            torchrun(2, [script], timeout=240, cwd=tmp_path)
        except pytest.fail.Exception as err:
            # Rank 0 aborting as the interpreter exits, after the script's
            # work ("terminate called without an active exception"): seen in 2
            # of 4 suite runs on 2026-12-06, never alone (0 of 22). dlgs now frees
            # its process group before exit (ddp.py, _release_at_exit); until
            # that is shown to end it, such an abort gets one more run, reported.
            if "terminate called without an active exception" not in str(err):
                raise
            warnings.warn(
                f"the docs' DDP script aborted at exit; ran it again: {err}", stacklevel=1
            )
            torchrun(2, [script], timeout=240, cwd=tmp_path)
        ckpts = [torch.load(tmp_path / f"ckpt.{r}.pt", weights_only=False) for r in (0, 1)]
        for name, tensor in ckpts[0]["model"].items():
            assert torch.equal(tensor, ckpts[1]["model"][name]), f"ranks differ at {name}"
        assert ckpts[0]["dlgs"]["step"] == 6


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp4")
    torchrun(4, [ROOT / "tests/parallel/ddp_worker.py", out, "two_level"], timeout=300)
    return value(load_ranks(out, 4), "two_level")


def test_the_two_level_exchange_runs_behind_the_ddp_hook(four):
    """topology='hierarchical' on torch.distributed node and cross-node groups
    (2 nodes of 2): every rank the same parameters after every step, by the
    allgather and by the reduction between nodes; density 1.0 is DDP's mean."""
    first = four[0]
    for r, rec in enumerate(four):
        assert rec["dense"]["max_diff"] <= 1e-6, f"rank {r}: {rec['dense']['max_diff']}"
        for case in ("allgather", "reduce", "auto"):
            assert rec[case]["digests"] == first[case]["digests"], f"rank {r} {case}"
    for case in ("allgather", "reduce"):
        assert first[case]["two_level"], case
        assert first[case]["step"] == 5
        assert len(set(first[case]["digests"])) == 5, f"{case}: it trains"
    assert "topology" in first["auto"]["describe"]
    # The sparse exchange moved the parameters differently from the dense one.
    assert first["allgather"]["digests"][0] != first["dense"]["hook"][0]


def test_the_ddp_hooks_two_levels_need_the_default_group(four):
    for r in (0, 1):
        assert "default process group" in four[r]["subgroup"], four[r]["subgroup"]


def test_ddp_door_cells_train_with_ranks_identical(ranks):
    """The hook with transport="auto" (its collectives have an alltoall) and
    with density="auto" (docs/options.md's table)."""
    check_door_cells(value(ranks, "door_cells"))
