"""Mixed precision and non-finite gradients with two real ranks (Gloo and MPI).

One horovodrun launch per backend runs every scenario of
``tests/parallel/amp_worker.py``; each test asserts on one scenario's numbers
from both ranks.
"""

from __future__ import annotations

import pytest
from conftest import (
    ROOT,
    check_fault_injection,
    check_scaled_conservation,
    horovodrun,
    run_scenarios,
    value,
)

pytestmark = pytest.mark.parallel

SCENARIOS = ["fault_injection", "scaled_conservation"]
# Training runs (about a minute) once, under Gloo; the collectives they use are
# the ones the fault-injection scenarios exercise under both backends.
CONVERGENCE_BACKEND = "gloo"
FAULT_STEPS = {5: "1.weight", 9: "1.weight", 13: "3.bias"}


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"amp-{request.param}")
    extra = ["amp_convergence"] if request.param == CONVERGENCE_BACKEND else []
    return run_scenarios(request.param, "amp_worker.py", out, SCENARIOS + extra)


def test_amp_training_matches_dense_horovod(ranks):
    if "amp_convergence" not in ranks[0]:
        pytest.skip(f"AMP training runs under {CONVERGENCE_BACKEND} only")
    r0, r1 = value(ranks, "amp_convergence")
    for key, run in r0.items():
        d0, d1 = run["digests"], r1[key]["digests"]
        first = next((i for i in range(len(d0)) if d0[i] != d1[i]), None)
        assert first is None, f"{key}: parameters differ across ranks from step {first}"
        assert run["finite"] and r1[key]["finite"], f"{key}: non-finite parameters"
    dense = r0["fp16/dense/horovod"]
    # The scaler starts far too high: the first steps overflow by design.
    assert dense["skipped"] >= 5, dense["skipped"]
    assert dense["accuracy"] > 75.0, f"dense baseline did not train: {dense['accuracy']}"
    for key in ("fp16/optimizer/horovod", "fp16/optimizer/plain", "fp16/compression/horovod"):
        run = r0[key]
        assert abs(run["skipped"] - dense["skipped"]) <= 2, (key, run["skipped"], dense["skipped"])
        assert run["accuracy"] >= dense["accuracy"] - 1.0, (key, run["accuracy"], dense["accuracy"])
    bf16 = r0["bf16/dense/none"]["accuracy"]
    assert r0["bf16/optimizer/none"]["accuracy"] >= bf16 - 1.0, (r0["bf16/optimizer/none"], bf16)


def test_nonfinite_gradient_on_one_rank_is_seen_and_undone_everywhere(ranks):
    check_fault_injection(*value(ranks, "fault_injection"), FAULT_STEPS)


def test_residual_holds_unscaled_gradient_across_scale_changes_and_skips(ranks):
    check_scaled_conservation(value(ranks, "scaled_conservation"))


def test_runnable_example_trains(tmp_path):
    """Launched from another folder, as a user would: it finds the repository's
    data loader itself (it once fell back to random data silently)."""
    from benchmarks.datasets import FASHION_MNIST_DIR

    kind = "fashion" if FASHION_MNIST_DIR.exists() else "random"
    proc = horovodrun(
        "gloo",
        2,
        [ROOT / "examples/torch_amp.py", "--steps", "40", "--pattern", "plain", "--data", kind],
        timeout=300,
        cwd=tmp_path,
    )
    out = proc.stderr + proc.stdout
    assert "done: 40 steps" in out
    assert f"training on {kind}: {60000 if kind == 'fashion' else 6000} images" in out
