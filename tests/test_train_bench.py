"""The training throughput benchmark (``benchmarks/train.py``) end to end on 2 ranks."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
from conftest import ROOT, horovodrun

pytestmark = pytest.mark.parallel


def _train(tmp_path, *args, timeout):
    """``benchmarks.train ARGS --out tmp_path`` on 2 Gloo ranks: the process
    and the CSV's rows by method."""
    proc = horovodrun(
        "gloo", 2, ["-m", "benchmarks.train", *args, "--out", tmp_path], timeout=timeout
    )
    with open(tmp_path / "train.csv", newline="") as f:
        return proc, {r["method"]: r for r in csv.DictReader(f)}


def test_train_benchmark_writes_rows(tmp_path):
    # --warmup 1: dlgs must still warm up until its refined plan is in force
    # (2 x --profile-steps + 3 steps), or run_method raises.
    methods = ["dense", "dlgs-none", "dlgs", "no-comm"]
    proc, rows = _train(
        tmp_path,
        "--model",
        "resnet20",
        "--methods",
        ",".join(methods),
        "--steps",
        "3",
        "--warmup",
        "1",
        "--profile-steps",
        "1",
        "--batch",
        "8",
        timeout=120,
    )
    assert list(rows) == methods
    for r in rows.values():
        assert r["model"] == "resnet20" and r["workers"] == "2" and r["batch"] == "8"
        assert r["framework"] == "torch"
        assert float(r["samples_per_s"]) > 0
        assert float(r["p10"]) <= float(r["median_step_s"]) <= float(r["p90"])
    wire = {m: int(r["wire_bytes_per_step"]) for m, r in rows.items()}
    params = 272_474  # ResNet-20's trainable parameters
    assert wire["dense"] == 4 * params
    assert wire["no-comm"] == 0
    # Layer-wise dlgs sends every large layer sparse; the DP plan may choose
    # dense messages where the network is fast (loopback), never more bytes.
    assert wire["dlgs-none"] < wire["dense"] / 4
    assert wire["dlgs"] <= wire["dense"]
    # The dp guard judged dlgs's first plan; layer-wise dlgs has no plan to judge.
    assert rows["dlgs"]["guard"] in ("kept", "layer-wise") and rows["dlgs-none"]["guard"] == ""
    # Sparsify is timed for the dlgs-based methods only, and is part of backward.
    assert 0 < float(rows["dlgs-none"]["sparsify_s"]) < float(rows["dlgs-none"]["backward_s"])
    assert rows["dense"]["sparsify_s"] == ""
    assert float(rows["no-comm"]["efficiency_vs_nocomm"]) == pytest.approx(1.0)
    # The dlgs method's planner predicts every method's step from its profile:
    # the no-comm bound plus a communication tail >= 0.
    for m in ("dense", "dlgs-none", "dlgs"):
        predicted = float(rows[m]["predicted_step_s"])
        assert predicted >= float(rows["no-comm"]["median_step_s"])
        assert float(rows[m]["prediction_error"]) == pytest.approx(
            predicted / float(rows[m]["median_step_s"]) - 1
        )
    assert rows["no-comm"]["predicted_step_s"] == ""
    assert float(rows["dense"]["speedup_vs_dense"]) == pytest.approx(1.0)
    md = (tmp_path / "train.md").read_text()
    assert md.count("| dlgs |") == 1
    assert "# Training throughput: resnet20, 2 workers" in md and "torch 2." in md
    assert (tmp_path / "train.png").stat().st_size > 0
    assert "| method |" in proc.stdout


def test_emulated_compute_runs_the_real_exchange_and_says_so(tmp_path):
    # The PTB LSTM's catalog structure (11 tensors, 4.65 M parameters) on a
    # device 100x faster than the default: a few ms per step of waits.
    methods = ["no-comm", "dense", "dlgs-none"]
    _, rows = _train(
        tmp_path,
        "--emulate",
        "catalog:ptb-lstm",
        "--emulate-speed",
        "100",
        "--methods",
        ",".join(methods),
        "--steps",
        "3",
        "--warmup",
        "2",
        timeout=180,
    )
    assert list(rows) == methods
    for r in rows.values():
        assert r["model"] == "ptb-lstm" and r["batch"] == "20"
        assert r["compute"].startswith("emulated compute: catalog:ptb-lstm at 10 TFLOP/s / 100")
    assert int(rows["dense"]["wire_bytes_per_step"]) == 4 * 4_653_200
    # dlgs selected from the drawn gradients: its layers went sparse.
    assert int(rows["dlgs-none"]["wire_bytes_per_step"]) < 4 * 4_653_200 / 10
    assert float(rows["dlgs-none"]["sparsify_s"]) > 0
    md = (tmp_path / "train.md").read_text()
    assert "# Training throughput: ptb-lstm (emulated compute), 2 workers" in md
    assert "**Emulated compute**" in md


@pytest.mark.parametrize(
    "args, option",
    [
        (["--model", "resnet50"], "--model"),
        (["--methods", "dense,sparse"], "--methods"),
        (["--warmup", "0"], "--warmup"),
        (["--framework", "tensorflow", "--model", "bert-small"], "--model"),
        (["--framework", "jax"], "--framework"),
        (["--tf-mode", "eager"], "--tf-mode"),
        (["--emulate-speed", "2"], "--emulate-speed"),
        (["--emulate", "catalog:vgg16", "--emulate-speed", "0"], "--emulate-speed"),
        (["--emulate", "measured", "--emulate-flops", "1e12"], "--emulate-flops"),
        (["--emulate", "catalog:vgg16", "--framework", "tensorflow"], "--emulate"),
    ],
)
def test_bad_arguments_name_the_option(args, option):
    # argparse fails before hvd.init(), so no horovodrun is needed.
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.train", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert f"argument {option}" in proc.stderr


def test_a_method_faster_than_the_bound_beyond_its_spread_is_called_noise():
    """make bench once printed dlgs at 110% of the no-comm bound as a result."""
    from benchmarks.report import MethodTimes, format_markdown, summarise

    times = [
        MethodTimes("no-comm", iteration=[0.40, 0.42, 0.44, 0.50, 0.52]),  # p10 0.408
        MethodTimes("dlgs", iteration=[0.35, 0.37, 0.39, 0.40, 0.41]),  # median 0.39
        MethodTimes("dense", iteration=[0.38, 0.41, 0.43, 0.45, 0.60]),  # median 0.43: within
    ]
    rows = summarise([times], model="m", batch=1, density=0.01, label="")
    verdict = {r["method"]: r["bound_noise"] for r in rows}
    assert verdict == {"no-comm": "", "dlgs": "noise", "dense": ""}
    text = format_markdown(rows, "cmd", versions="v", threads="t", sample="s", timing="")
    assert "| 113% (noise) |" in text and "Noise, not a result:** dlgs measured" in text
    assert "(noise)" not in text.split("| dense |")[1].split("\n")[0]
