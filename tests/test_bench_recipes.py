"""The convergence benchmark's method grammar and the wire-bytes report
(benchmarks/convergence.py, benchmarks/wire_bytes.py)."""

from __future__ import annotations

import pytest

from benchmarks.wire_bytes import FORMATS, model_sizes, wire_row


def test_sixteen_bit_values_and_indices_cost_about_4_bytes_per_element():
    sizes = model_sizes("catalog:resnet50")
    before = wire_row(sizes, 0.01, "int32", "float32")
    after = wire_row(sizes, 0.01, "auto", "float16")
    assert 8.0 <= before["bytes_per_element"] < 8.05
    assert 4.0 <= after["bytes_per_element"] < 4.05
    assert after["selected"] == before["selected"] and after["block16_layers"] > 0
    assert [f[0] for f in FORMATS][0].startswith("int32")
    # At density 0.1 a bit per element (and per slot) beats 2 bytes per index.
    dense = wire_row(sizes, 0.1, "auto", "float16")
    assert dense["bitmap_layers"] == dense["sparse_layers"]
    assert 2 + 1.375 <= dense["bytes_per_element"] < 3.5


def test_convergence_methods_parse_to_dlgs_options():
    convergence = pytest.importorskip("benchmarks.convergence")
    parse = convergence.method_options
    assert parse("dense", 0.9, 10) is None
    kwargs, outer = parse("dlgs-0.001+warmup+nomask+f16", 0.9, 117)
    assert kwargs == dict(
        density=0.001,
        min_sparse_size=256,
        merge="none",
        momentum_masking=False,
        value_dtype="float16",
        warmup="dgc",
        warmup_steps=117,
        momentum=0.9,
    )
    assert outer == 0.0
    kwargs, outer = parse("dlgs-0.01+outer", 0.9, 1)
    assert kwargs["momentum"] == 0.0 and outer == 0.9
    for bad in ("dlgs-x", "dlgs-0.01+fast", "sparse-0.01", "ddp-powersgd-0", "ddp-dlgs-y"):
        with pytest.raises(ValueError, match="dlgs-DENSITY"):
            parse(bad, 0.9, 1)
    # The DDP forms: plain DDP and PowerSGD take no dlgs options; dlgs's hook the same.
    assert parse("ddp", 0.9, 1) is None and parse("ddp-powersgd-4", 0.9, 1) is None
    assert parse("ddp-dlgs-0.01+outer", 0.9, 1) == parse("dlgs-0.01+outer", 0.9, 1)
    # A budget keeps one density unless +split (dlgs's default splits): the
    # committed results' method names keep their meaning.
    assert parse("dlgs-@0.05", 0.9, 1)[0]["budget_split"] == "uniform"
    assert parse("dlgs-@powersgd-1+split", 0.9, 1)[0]["budget_split"] == "gradient"
    assert "budget_split" not in parse("dlgs-0.01", 0.9, 1)[0]


def test_engines_pick_their_methods():
    from benchmarks.report import DDP_METHODS, ENGINES, parse_args

    assert parse_args([]).methods == list(ENGINES["horovod"])
    both = parse_args(["--engine", "both"]).methods
    assert set(DDP_METHODS) <= set(both) and "dlgs" in both
    with pytest.raises(SystemExit):
        parse_args(["--framework", "tensorflow", "--engine", "ddp"])


def test_train_methods_take_their_own_density():
    from benchmarks.report import _methods, is_merging, parse_args, sparse_options

    args = parse_args(["--methods", "no-comm,dlgs@0.001,dlgs@auto,dgc@0.05", "--density", "0.01"])
    assert args.methods == ["no-comm", "dlgs@0.001", "dlgs@auto", "dgc@0.05"]
    assert sparse_options("no-comm", 0.01) is None
    assert sparse_options("dlgs", 0.01) == dict(density=0.01, controller="dynamic", merge="dp")
    assert sparse_options("dlgs@0.001", 0.01)["density"] == 0.001
    assert sparse_options("dlgs@auto", 0.01)["density"] == "auto"
    assert sparse_options("dgc@0.05", 0.01) == dict(density=0.05, controller="dgc", merge="none")
    assert is_merging("dlgs@auto") and not is_merging("dgc@0.05")
    for bad, why in [
        ("dense@0.01", "only the sparse methods"),
        ("dlgs-none@auto", "needs the dp merge plan"),
        ("dlgs@2", r"must be in \(0, 1\]"),
        ("dlgs@x", "expected a number"),
        ("dlgs@0.01,dlgs@0.01", "listed twice"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(["--methods", bad])
        with pytest.raises(Exception, match=why):
            _methods(bad)


def test_auto_reports_each_rounds_density_and_warms_up_for_its_check():
    from benchmarks.report import (
        MethodTimes,
        accumulate,
        method_cell,
        settle_steps,
        warmup_steps,
    )

    mine = {}
    for density in (1.0, 0.01, 0.01):
        accumulate(mine, MethodTimes("dlgs@auto", iteration=[0.1], density=density), 0, 0)
    pooled = mine["dlgs@auto"]
    assert pooled.round_densities == [1.0, 0.01, 0.01] and pooled.density == 0.01
    row = {"method": "dlgs@auto", "density": 0.01, "round_densities": "1/0.01/0.01"}
    assert method_cell(row) == "dlgs@auto (chose 1, 0.01, 0.01 by round)"
    assert method_cell({**row, "round_densities": "0.01/0.01"}) == "dlgs@auto (chose 0.01)"
    # Room for one return from the choice: profile_steps and a first step more.
    assert settle_steps(3, auto=True) == settle_steps(3) + 4 == 13
    assert warmup_steps("dlgs@auto", 3, 3) == 13 and warmup_steps("dlgs@0.01", 3, 3) == 9


def test_a_budget_with_warmup_passes_the_density_and_values_it_priced():
    """Warm-up refuses ``budget=``, so the harness passes the density the
    budget gives, with the values' dtype it was priced at (float16 under
    ``value_dtype="auto"``, float32 with ``+f32``), and that layout fits."""
    convergence = pytest.importorskip("benchmarks.convergence")
    import torch

    from dlgs.core.config import SparsityConfig
    from dlgs.core.wire import layout_bytes

    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    sizes = [p.numel() for p in model.parameters()]
    densities = {}
    for spec, dtype in (("dlgs-@0.05+warmup", "float16"), ("dlgs-@0.05+warmup+f32", "float32")):
        kwargs, _ = convergence.method_options(spec, 0.9, 10)
        target = convergence.resolve_budget(kwargs, model)
        assert "budget" not in kwargs and kwargs["value_dtype"] == dtype, kwargs
        cfg = SparsityConfig(density=kwargs["density"], min_sparse_size=256, value_dtype=dtype)
        assert 0.95 * target <= layout_bytes(sizes, cfg.density, cfg) <= target
        densities[dtype] = kwargs["density"]
    assert densities["float16"] > 1.4 * densities["float32"]
