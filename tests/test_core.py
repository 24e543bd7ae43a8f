"""Framework-free tests of dlgs.core: config validation, wire layout, plans,
cross-rank signatures, and the layering rule (the core imports no framework)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

import dlgs.core
from dlgs.core import (
    GroupLayout,
    SparsityConfig,
    ValueDType,
    describe_mismatch,
    plan_layers,
    signature,
)
from dlgs.core.config import MASKING_MAX_DENSITY


def test_core_imports_without_any_framework():
    # numpy is allowed (the planner vectorises with it); frameworks are not.
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "tensorflow", "horovod", "keras"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import importlib, pkgutil
        import dlgs, dlgs.core
        # Every module of the core, not only those its __init__ imports.
        for mod in pkgutil.walk_packages(dlgs.core.__path__, "dlgs.core."):
            importlib.import_module(mod.name)
        import dlgs._options, dlgs._horovod  # the adapters' framework-free helpers
        import dlgs.catalog, dlgs.inprocess  # the simulator's presets, thread-ranks
        from dlgs.core import SparsityConfig, GroupLayout, plan_layers
        cfg = SparsityConfig(density=0.01)
        plan_layers([10, 100000], 0.01, cfg)
        GroupLayout((100000,), (1000,)).chunk_words
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize(
    "kwargs, param, exc",
    [
        (dict(density=0.0), "density", ValueError),
        (dict(density=1.5), "density", ValueError),
        (dict(density=-0.1), "density", ValueError),
        (dict(density="0.1"), "density", TypeError),
        (dict(controller="sorting"), "controller", ValueError),
        (dict(value_dtype="int8"), "value_dtype", ValueError),
        (dict(index_coding="int16"), "index_coding", ValueError),
        (dict(momentum_masking=1), "momentum_masking", TypeError),
        (dict(warmup="dgc4", warmup_steps=3), "warmup", TypeError),
        (dict(max_ratio=0.5), "max_ratio", ValueError),
        (dict(min_sparse_size=0), "min_sparse_size", ValueError),
        (dict(anchor_every=-1), "anchor_every", ValueError),
        (dict(controller="fixed"), "threshold", ValueError),
        (dict(threshold=0.1), "threshold", ValueError),
        (dict(sample_ratio=0.0), "sample_ratio", ValueError),
        (dict(momentum=1.0), "momentum", ValueError),
        (dict(warmup=(0.5, 2.0), warmup_steps=1), "warmup[1]", ValueError),
        (dict(warmup=(0.5,)), "warmup_steps", ValueError),
    ],
)
def test_bad_config_names_parameter_and_range(kwargs, param, exc):
    with pytest.raises(exc) as info:
        SparsityConfig(**kwargs)
    assert param in str(info.value)


def test_config_is_frozen_and_schedules_warmup():
    cfg = SparsityConfig(density=0.001, warmup=(0.25, 0.063, 0.015), warmup_steps=10)
    with pytest.raises(Exception):
        cfg.density = 0.5  # type: ignore[misc]
    assert [cfg.density_at(s) for s in (0, 9, 10, 25, 29, 30, 10_000)] == [
        0.25,
        0.25,
        0.063,
        0.015,
        0.015,
        0.001,
        0.001,
    ]
    assert cfg.to_dict()["controller"] == "dynamic"


def test_momentum_masking_defaults_to_off_with_warmup_and_else_by_each_layers_density():
    default = SparsityConfig(momentum=0.9)
    assert default.momentum_masking is None
    # Masked where a layer sends at most MASKING_MAX_DENSITY of its entries.
    n = 10_000
    at = math.ceil(MASKING_MAX_DENSITY * n)
    assert default.masks(at, n) and default.masks(1, n) and not default.masks(at + 1, n)
    assert SparsityConfig(momentum=0.9, warmup="dgc", warmup_steps=3).momentum_masking is False
    explicit = SparsityConfig(momentum=0.9, warmup="dgc", warmup_steps=3, momentum_masking=True)
    assert explicit.momentum_masking is True and explicit.masks(n, n)
    assert not SparsityConfig(momentum_masking=False).masks(1, n)
    no_stages = SparsityConfig(density=0.5, warmup="dgc")  # no stages: the density's rule
    assert no_stages.momentum_masking is None and not no_stages.masks(5000, n)


def test_dgc_warmup_is_dgc_schedule_scaled_to_the_density():
    dgc = SparsityConfig(density=0.001, warmup="dgc", warmup_steps=5)
    # DGC's published stages for 0.001: 0.25, 0.0625, 0.015625, 0.004.
    assert np.allclose(dgc.warmup, (0.25, 0.0625, 0.015625, 0.004), rtol=0.02)
    ratios = np.array(dgc.warmup[1:] + (0.001,)) / np.array(dgc.warmup)
    assert np.allclose(ratios, ratios[0])  # equal factors, ending at the density
    assert dgc.to_dict()["warmup"] == list(dgc.warmup)
    assert len(SparsityConfig(density=0.01, warmup="dgc", warmup_steps=5).warmup) == 4
    assert SparsityConfig(density=0.5, warmup="dgc").warmup == ()
    with pytest.raises(ValueError, match="warmup_steps"):
        SparsityConfig(density=0.001, warmup="dgc")


def test_plan_layers_sends_small_and_dense_enough_layers_dense():
    cfg = SparsityConfig(density=0.01, min_sparse_size=1024)
    small, big = plan_layers([1000, 100_000], 0.01, cfg)
    assert not small.sparse and big.sparse
    # count word, 1000 float32 values, 1000 16-bit indices, 1 block count
    assert big.k == 1000 and big.capacity == 1000 and big.wire_bytes == 4 + 4000 + 2000 + 4
    wide = SparsityConfig(density=0.01, index_coding="int32")
    assert plan_layers([100_000], 0.01, wide)[0].wire_bytes == 4 + 4000 + 4000
    # values + int32 indices cost 8 bytes per element: sparse pays only below density 0.5
    half = SparsityConfig(density=0.5, index_coding="int32")
    assert not plan_layers([100_000], 0.5, half)[0].sparse
    assert plan_layers([100_000], 0.49, SparsityConfig(density=0.49, index_coding="int32"))[
        0
    ].sparse
    # ... 6 with 16-bit indices: below density 2/3
    block16 = dict(index_coding="block16")
    assert plan_layers([100_000], 0.66, SparsityConfig(density=0.66, **block16))[0].sparse
    assert not plan_layers([100_000], 0.67, SparsityConfig(density=0.67, **block16))[0].sparse
    # ... and 4 + (1 + 1 / density) / 8 with a bitmap (auto): below about 0.94
    assert plan_layers([100_000], 0.93, SparsityConfig(density=0.93))[0].sparse
    assert not plan_layers([100_000], 0.95, SparsityConfig(density=0.95))[0].sparse
    capped = plan_layers([100_000], 0.01, SparsityConfig(density=0.01, max_ratio=1.5))[0]
    assert capped.capacity == 1500


def test_group_layout_offsets():
    lay = GroupLayout((10, 20, 30), (2, 3, 4))
    assert lay.header_words == 4 and lay.total_capacity == 9
    assert lay.chunk_words == 4 + 9 + 9
    assert [lay.value_offset(i) for i in range(3)] == [0, 2, 5]
    assert [lay.dense_offset(i) for i in range(3)] == [0, 11, 32]
    assert lay.dense_size == 63
    half = GroupLayout((10, 20, 30), (2, 3, 4), ValueDType.FLOAT16)
    assert half.value_words == 5 and half.chunk_words == 4 + 5 + 9
    assert half.fingerprint != lay.fingerprint
    assert GroupLayout((10, 20, 30), (2, 3, 4)).fingerprint == lay.fingerprint
    assert 0 <= lay.fingerprint < 2**24
    with pytest.raises(ValueError, match="capacity"):
        GroupLayout((10,), (11,))
    # 16-bit indices: half a word each, plus one block count per 65,536 elements.
    short = GroupLayout((10, 70000, 30), (2, 3, 4), index_coding="block16")
    assert short.count_words == 1 and short.header_words == 5
    assert short.index_words == 5 and short.chunk_words == 5 + 9 + 5
    assert short.counts_offset(1) == 4 and short.counts_offset(2) == 5
    assert short.fingerprint != GroupLayout((10, 70000, 30), (2, 3, 4)).fingerprint


def test_describe_mismatch():
    a = signature([("w", (3, 4), "float32"), ("b", (4,), "float32")], {"density": 0.01})
    assert describe_mismatch([a, a]) is None
    b = signature([("w", (3, 5), "float32"), ("b", (4,), "float32")], {"density": 0.01})
    assert "'w'" in describe_mismatch([a, b])
    c = signature([("w", (3, 4), "float32")], {"density": 0.01})
    assert "lacks parameters ['b']" in describe_mismatch([a, c])
    d = signature([("w", (3, 4), "float32"), ("b", (4,), "float32")], {"density": 0.02})
    assert "density" in describe_mismatch([a, d])
    e = signature([("b", (4,), "float32"), ("w", (3, 4), "float32")], {"density": 0.01})
    assert "orders" in describe_mismatch([a, e])


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(strategy="fastest"), "merge"),
        (dict(profile_steps=0), "profile_steps"),
        (dict(max_group=0), "max_group"),
        (dict(drift_tolerance=0), "drift_tolerance"),
        (dict(drift_window=-1), "drift_window"),
        (dict(refine="yes"), "refine"),
        (dict(guard=1), "guard"),
    ],
)
def test_online_planner_rejects_bad_options(kwargs, param):
    from dlgs.core.planning.online import OnlinePlanner

    with pytest.raises(ValueError, match=param):
        OnlinePlanner(**kwargs)


# -- MergeConfig and the shared option handling -----------------------------------


def test_merge_config_validates_once_naming_the_option():
    from dlgs import MergeConfig

    cfg = MergeConfig()
    assert (cfg.strategy, cfg.profile_steps, cfg.drift_window) == ("dp", 8, 50)
    assert cfg.profile_budget == 0.01
    with pytest.raises(ValueError, match="merge must be one of"):
        MergeConfig("fastest")
    with pytest.raises(ValueError, match="profile_steps must be an int >= 1"):
        MergeConfig(profile_steps=0)
    with pytest.raises(TypeError, match="bucket_elements"):
        MergeConfig(bucket_elements=8192.0)
    with pytest.raises(ValueError, match="drift_tolerance must be a finite float > 0"):
        MergeConfig(drift_tolerance=float("inf"))
    for bad in (0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"profile_budget must be a finite float in \(0, 1\]"):
            MergeConfig(profile_budget=bad)
    with pytest.raises(Exception):
        cfg.strategy = "none"  # frozen


def test_entry_point_options_split_between_the_two_configs():
    from dlgs import MergeConfig
    from dlgs._options import build_configs

    cfg, planner = build_configs(
        None, None, "buckets", {"bucket_elements": 2048, "controller": "topk", "drift_window": 0}
    )
    assert cfg.controller.value == "topk" and cfg.density == 0.01
    assert planner.config == MergeConfig("buckets", bucket_elements=2048, drift_window=0)
    assert planner.bucket_elements == 2048 and planner.drift_window == 0
    _, planner = build_configs(None, 0.05, MergeConfig("none"), {})
    assert planner.strategy == "none"
    with pytest.raises(ValueError, match="not both"):
        build_configs(None, None, MergeConfig(), {"profile_steps": 3})
    with pytest.raises(TypeError, match="unknown dlgs option"):
        build_configs(None, None, "dp", {"profile_step": 3})
    with pytest.raises(TypeError, match="merge must be a str or a dlgs.MergeConfig"):
        build_configs(None, None, 3, {})


def test_an_anchor_step_uses_the_exact_kth_largest():
    """On an anchor step the dynamic controller's threshold is the exact k-th
    largest |a|: recomputed as (exact / scale) * scale it can round up by an
    ulp and drop the k-th element (seen on real ranks with <= k non-zeros)."""
    from local_world import OPS

    from dlgs.core import make_controller

    ctrl = make_controller(SparsityConfig(density=0.05, anchor_every=1))
    rng = np.random.default_rng(3)
    for trial in range(200):
        absx = np.abs(rng.standard_normal(512).astype(np.float32) * rng.uniform(1e-3, 1e3))
        state = ctrl.init_state(OPS, absx, 0.05)
        for step in range(2):
            theta = ctrl.threshold(OPS, state, absx, 26, step, OPS.total(absx))
            assert theta == OPS.kth_largest(absx, 26), (trial, step)
            ctrl.update(OPS, state, theta, int(np.count_nonzero(absx >= theta)), 26)


def test_design_module_map_lists_every_module():
    """docs/design.md's module map names every module of the package, each
    under its sub-package, and nothing that does not exist."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("```", 2)[1]
    listed, stack = set(), []
    for line in block.splitlines():
        m = re.match(r"( *)(\S+)", line)
        if not m or not (m.group(2).endswith("/") or m.group(2).endswith(".py")):
            continue
        depth = len(m.group(1)) // 2
        stack = stack[:depth] + [m.group(2).rstrip("/")]
        if m.group(2).endswith(".py"):
            listed.add("/".join(stack))
    modules = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "dlgs").rglob("*.py")
        if p.name != "__init__.py" and "tensorflow" not in p.parts
    }
    assert modules - listed == set(), "modules missing from docs/design.md's map"
    assert listed - modules == set(), "docs/design.md's map names modules that do not exist"


def _core_imports():
    """Every relative import inside dlgs/core, module to module, wherever it
    stands (module level, a function, ``if TYPE_CHECKING``)."""
    import ast

    root = Path(dlgs.core.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    edges = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    whole = f"{target}.{alias.name}"
                    if whole in modules or target in modules:
                        found.add(whole if whole in modules else target)
        edges[name] = found - {name}
    return edges


def test_the_core_imports_form_no_circle():
    """The core's modules import one another one way only: a module that
    needs its owner names it by a protocol (exchange.internals, protocol)."""
    edges = _core_imports()
    assert "core.exchange.exchange" in edges and edges["core.exchange.exchange"]
    state = dict.fromkeys(edges, 0)  # 0 unseen, 1 on the path, 2 done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state[nxt] == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if state[nxt] == 0:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if state[node] == 0:
            visit(node, [node])
