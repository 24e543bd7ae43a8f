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
    for bad in ("dlgs-x", "dlgs-0.01+fast", "sparse-0.01"):
        with pytest.raises(ValueError, match="dlgs-DENSITY"):
            parse(bad, 0.9, 1)
