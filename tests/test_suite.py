"""The suite's goal table (``benchmarks.suite.goals``) on hand-made rows."""

from __future__ import annotations

from benchmarks.suite import fits_in_memory, goals, merge_goals


def _rows(label, steps):
    return [
        {"label": label, "model": "m", "method": m, "median_step_s": str(t)}
        for m, t in steps.items()
    ]


def test_goals_judge_each_regime_and_the_baselines():
    rows = (
        # Communication-bound (dense 10%): dlgs at 90% meets >= 85%; DGC at 50%,
        # so dlgs must be >= 1.2x it (it is 1.8x).
        _rows("slow", {"no-comm": 1.0, "dense": 10.0, "dgc": 2.0, "dlgs": 1 / 0.9})
        # Balanced (dense 50%): dlgs 1.6x dense misses 1.8x; top-k at 80% < 85%,
        # and dlgs (80%) is only 1.0x it.
        + _rows("mid", {"no-comm": 1.0, "dense": 2.0, "topk": 1.25, "dlgs": 1.25})
        # Cheap (dense 95%): dlgs 0.99x dense meets >= 0.97x; DGC at 95% is above
        # 85%, so no 1.2x goal.
        + _rows("fast", {"no-comm": 1.0, "dense": 1 / 0.95, "dgc": 1 / 0.95, "dlgs": 1 / 0.94})
        # Between regimes (dense 75%) and a cell without dlgs (skipped).
        + _rows("between", {"no-comm": 1.0, "dense": 1 / 0.75, "dlgs": 1.0})
        + _rows("no-dlgs", {"no-comm": 1.0, "dense": 2.0})
    )
    table = goals(rows)
    cells = {line.split("|")[1].strip(): line for line in table[2:]}
    assert set(cells) == {"m, slow", "m, mid", "m, fast", "m, between"}
    assert "communication-bound" in cells["m, slow"]
    assert ">= 85% of the bound: met" in cells["m, slow"]
    assert "1.80x (>= 1.2x: met)" in cells["m, slow"]
    assert "balanced" in cells["m, mid"] and ">= 1.8x dense: **not met**" in cells["m, mid"]
    assert "topk (80%)" in cells["m, mid"] and "1.00x (>= 1.2x: **not met**)" in cells["m, mid"]
    assert ">= 0.97x dense: met" in cells["m, fast"]
    assert cells["m, fast"].rstrip(" |").endswith("0.99x")  # DGC >= 85%: no 1.2x goal
    assert "between regimes" in cells["m, between"] and "| — |" in cells["m, between"]


def _emulated(label, workers, steps, aggregate=""):
    return [
        {
            "label": label,
            "model": "resnet50",
            "compute": "emulated compute: catalog:resnet50",
            "method": m,
            "workers": str(workers),
            "median_step_s": str(t),
            "DLGS_AGGREGATE_BPS": aggregate,
        }
        for m, t in steps.items()
    ]


def test_merge_goals_judge_emulated_cells_only():
    rows = (
        # 8 workers, dense 25% efficient: dlgs must be >= 1.3x the best baseline
        # (layer-wise dlgs here): 1.5x, met.
        _emulated(
            "8w",
            8,
            {"no-comm": 1.0, "dense": 4.0, "dlgs-none": 3.0, "topk": 3.3, "dlgs": 2.0},
            "4.5e9",
        )
        # 4 workers: only >= 0.97x applies; 0.9x is not met.
        + _emulated("4w", 4, {"no-comm": 1.0, "dense": 1.2, "dgc": 1.8, "dlgs": 2.0})
        # 16 workers, dense 80% efficient: only >= 0.97x; 1.0x is met.
        + _emulated("16w", 16, {"no-comm": 1.0, "dense": 1.25, "topk-buckets": 1.5, "dlgs": 1.5})
        # Real compute: not judged here (goals() does).
        + [
            dict(r, compute="real", label="real")
            for r in _emulated("r", 8, {"dense": 2.0, "topk": 1.0, "dlgs": 1.0})
        ]
    )
    table = merge_goals(rows)
    cells = {line.split("|")[1].strip(): line for line in table[2:]}
    assert set(cells) == {"resnet50, 8w", "resnet50, 4w", "resnet50, 16w"}
    assert "| 4500 |" in cells["resnet50, 8w"] and "dlgs-none (33%)" in cells["resnet50, 8w"]
    assert "1.50x | >= 1.3x: met" in cells["resnet50, 8w"]
    assert (
        "| — |" in cells["resnet50, 4w"]
        and "0.90x | >= 0.97x: **not met**" in cells["resnet50, 4w"]
    )
    assert "1.00x | >= 0.97x: met" in cells["resnet50, 16w"]


def test_memory_check_skips_only_emulated_catalog_models_that_do_not_fit():
    assert fits_in_memory("catalog:ptb-lstm", 2) is None
    assert "GB available" in fits_in_memory("catalog:vgg16", 1000)
    assert fits_in_memory("resnet20", 1000) is None  # real compute: not checked
