"""The training benchmark with ``--framework tensorflow`` (``benchmarks/train_tf.py``)
end to end on 2 ranks, and the layering of its modules."""

from __future__ import annotations

import csv
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT, horovodrun

pytest.importorskip("tensorflow")
pytest.importorskip("horovod.tensorflow")

RESNET20_PARAMS = 272_474  # trainable, as in torch


def _bench(tmp_path, *args):
    return horovodrun(
        "gloo",
        2,
        [
            "-m",
            "benchmarks.train",
            "--framework",
            "tensorflow",
            "--model",
            "resnet20",
            "--batch",
            "8",
            "--steps",
            "2",
            "--warmup",
            "5",
            "--profile-steps",
            "1",
            "--out",
            tmp_path,
            *args,
        ],
        timeout=120,
    )


@pytest.mark.parallel
def test_tf_benchmark_writes_rows_and_appends(tmp_path):
    methods = ["no-comm", "dense", "dlgs"]
    proc = _bench(tmp_path, "--methods", ",".join(methods))
    assert "| method |" in proc.stdout
    # A second run, eager (which measures the breakdown), appended under a label.
    _bench(
        tmp_path,
        "--methods",
        "no-comm,dlgs-none",
        "--tf-mode",
        "eager",
        "--append",
        "--label",
        "eager",
    )
    with open(tmp_path / "train.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["label"], r["method"]) for r in rows] == [
        ("", "no-comm"),
        ("", "dense"),
        ("", "dlgs"),
        ("eager", "no-comm"),
        ("eager", "dlgs-none"),
    ]
    for r in rows:
        assert r["framework"] == "tensorflow" and r["model"] == "resnet20"
        assert r["workers"] == "2" and r["batch"] == "8" and r["steps"] == "2"
        assert float(r["samples_per_s"]) > 0
        assert float(r["p10"]) <= float(r["median_step_s"]) <= float(r["p90"]) < 30
    fn, eager = rows[:3], rows[3:]
    # Under tf.function only the full step is timed; eagerly the breakdown fits in it.
    assert all(r["backward_s"] == "" and r["step_wait_s"] == "" for r in fn)
    for r in eager:
        assert 0 < float(r["backward_s"]) + float(r["step_wait_s"]) <= float(r["median_step_s"])
    wire = {r["method"]: int(r["wire_bytes_per_step"]) for r in rows}
    assert wire["no-comm"] == 0
    assert wire["dense"] == 4 * RESNET20_PARAMS
    assert wire["dlgs-none"] < wire["dense"] / 4  # every large layer sparse at density 0.01
    assert wire["dlgs"] <= wire["dense"]  # the plan may send dense on loopback, never more
    assert int(rows[2]["messages"]) >= 1 and int(rows[4]["messages"]) >= 1
    assert rows[2]["guard"] in ("kept", "layer-wise")  # dlgs under tf.function: dp judged
    # dlgs' submit is timed on eager steps only (a traced step runs no Python).
    assert rows[1]["sparsify_s"] == rows[2]["sparsify_s"] == ""
    assert float(rows[4]["sparsify_s"]) > 0
    assert float(rows[0]["efficiency_vs_nocomm"]) == pytest.approx(1.0)
    assert float(rows[1]["speedup_vs_dense"]) == pytest.approx(1.0)
    md = (tmp_path / "train.md").read_text()
    assert md.count("# Training throughput: resnet20 (TensorFlow), 2 workers") == 2
    assert "TensorFlow 2." in md and "each step one tf.function" in md and "eager steps" in md
    assert (tmp_path / "train.png").stat().st_size > 0


def test_tensorflow_benchmark_never_imports_torch():
    code = textwrap.dedent(
        """
        import sys
        import benchmarks.report
        assert not {"torch", "tensorflow", "horovod"} & set(sys.modules), sorted(sys.modules)
        import benchmarks.train, benchmarks.train_tf
        assert "torch" not in sys.modules
        """
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
