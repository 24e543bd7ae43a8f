"""Every public entry point refuses bad input by name.

One process, real Horovod at size 1, both frameworks. Each case asserts the
exception type (``TypeError`` for a wrong type, ``ValueError`` for a value out
of range, NaN and infinities included) and that the message names the
parameter and the accepted range. The plan CLI's cases are in
``tests/test_plan_cli.py``.
"""

from __future__ import annotations

import logging

import horovod.torch as hvd
import pytest
import torch
from conftest import bind_horovod, tf_single_thread

import dlgs
import dlgs.torch
from dlgs.core.planning.online import OnlinePlanner

NAN, INF = float("nan"), float("inf")
FLOAT_IN_UNIT = "a finite float in (0, 1]"
POSITIVE = "a finite float > 0"

# (keyword options, exception, words the message must contain): options every
# entry point shares (SparsityConfig fields and the planner's).
SHARED = [
    (dict(warmup=0.25, warmup_steps=10), TypeError, ["warmup", "sequence", "(0, 1]"]),
    (dict(warmup="0.25", warmup_steps=10), TypeError, ["warmup", "sequence"]),
    (dict(warmup=(0.25, NAN), warmup_steps=10), ValueError, ["warmup[1]", FLOAT_IN_UNIT]),
    (dict(density=NAN), ValueError, ["density", FLOAT_IN_UNIT]),
    (dict(density=INF), ValueError, ["density", FLOAT_IN_UNIT]),
    (dict(density=True), TypeError, ["density", FLOAT_IN_UNIT]),
    (dict(density="0.01"), TypeError, ["density", FLOAT_IN_UNIT]),
    (dict(controller="fixed", threshold=True), TypeError, ["threshold", POSITIVE]),
    (dict(controller="fixed", threshold=INF), ValueError, ["threshold", POSITIVE]),
    (dict(controller="fixed", threshold=NAN), ValueError, ["threshold", POSITIVE]),
    (dict(controller="fixed", threshold=0.0), ValueError, ["threshold", POSITIVE]),
    (dict(controller="fixed", threshold="1e-3"), TypeError, ["threshold", POSITIVE]),
    (dict(max_ratio=INF), ValueError, ["max_ratio", "[1.0, 16.0]"]),
    (dict(max_ratio=NAN), ValueError, ["max_ratio", "[1.0, 16.0]"]),
    (dict(max_ratio=True), TypeError, ["max_ratio", "[1.0, 16.0]"]),
    (dict(sample_ratio=NAN), ValueError, ["sample_ratio", FLOAT_IN_UNIT]),
    (dict(sample_ratio=False), TypeError, ["sample_ratio", FLOAT_IN_UNIT]),
    (dict(momentum=NAN), ValueError, ["momentum", "[0, 1)"]),
    (dict(momentum=1.0), ValueError, ["momentum", "[0, 1)"]),
    (dict(momentum=True), TypeError, ["momentum", "[0, 1)"]),
    (dict(anchor_every=1.5), TypeError, ["anchor_every", "an int >= 0"]),
    (dict(min_sparse_size=True), TypeError, ["min_sparse_size", "an int >= 1"]),
    (dict(warmup_steps=-1), ValueError, ["warmup_steps", "an int >= 0"]),
    (dict(drift_tolerance=INF), ValueError, ["drift_tolerance", POSITIVE]),
    (dict(drift_tolerance=NAN), ValueError, ["drift_tolerance", POSITIVE]),
    (dict(drift_tolerance=True), TypeError, ["drift_tolerance", POSITIVE]),
    (dict(drift_window=2.0), TypeError, ["drift_window", "an int >= 0"]),
    (dict(profile_budget=0.0), ValueError, ["profile_budget", "(0, 1]"]),
    (dict(profile_budget=NAN), ValueError, ["profile_budget", "(0, 1]"]),
    (dict(profile_budget="1%"), TypeError, ["profile_budget", "(0, 1]"]),
    (dict(link_bandwidth=0.0), ValueError, ["link_bandwidth", POSITIVE]),
    (dict(link_bandwidth=INF), ValueError, ["link_bandwidth", POSITIVE]),
    (dict(link_bandwidth="1gbit"), TypeError, ["link_bandwidth", POSITIVE]),
    (dict(calibration_file=3), TypeError, ["calibration_file", "a path"]),
    (dict(calibration_file=""), ValueError, ["calibration_file", "name a file"]),
    (dict(budget=0.1, budget_split="global"), ValueError, ["budget_split", "'gradient'"]),
    (dict(budget_split="gradient"), ValueError, ["budget_split='gradient'", "budget="]),
    (dict(profile_steps=5.0), TypeError, ["profile_steps", "an int >= 1"]),
    (dict(profile_steps=0), ValueError, ["profile_steps", "an int >= 1"]),
    (dict(bucket_elements=True), TypeError, ["bucket_elements", "an int >= 1"]),
    (dict(max_group=2.5), TypeError, ["max_group", "None or an int >= 1"]),
    (dict(max_group=0), ValueError, ["max_group", "None or an int >= 1"]),
    (dict(log_every=1.0), TypeError, ["log_every", "an int >= 0"]),
    (dict(log_every=-1), ValueError, ["log_every", "an int >= 0"]),
    (
        dict(config=dlgs.SparsityConfig(density=0.5), density=0.01),
        ValueError,
        ["config=", "density"],
    ),
    (dict(config=dlgs.SparsityConfig(), momentum=0.9), ValueError, ["config=", "momentum"]),
]

# Options of the Horovod-shaped optimizer only.
OPTIMIZER_ONLY = [
    (dict(gradient_predivide_factor=NAN), ValueError, ["gradient_predivide_factor", POSITIVE]),
    (dict(gradient_predivide_factor=True), TypeError, ["gradient_predivide_factor", POSITIVE]),
    (dict(backward_passes_per_step=1.0), TypeError, ["backward_passes_per_step", ">= 1"]),
    (dict(backward_passes_per_step=0), ValueError, ["backward_passes_per_step", ">= 1"]),
]
# The two-level exchange's options, at torch's Horovod forms (a) and (b).
TOPOLOGY = [
    (dict(topology="ring"), ValueError, ["topology", "'hierarchical'"]),
    (dict(topology="hierarchical", ranks_per_node=1), ValueError, ["ranks_per_node", ">= 2"]),
    (dict(topology="auto", ranks_per_node=True), TypeError, ["ranks_per_node", ">= 2"]),
    (dict(topology="auto", ranks_per_node=2.0), TypeError, ["ranks_per_node", "an int >= 2"]),
    # An option with no effect is an error, never silently ignored.
    (dict(ranks_per_node=2), ValueError, ["ranks_per_node", "topology='hierarchical'"]),
]
# torch's DistributedOptimizer only (form (a) follows the optimizer's op).
TORCH_OPTIMIZER_ONLY = TOPOLOGY + [
    (dict(topology="hierarchical", op=hvd.Sum), ValueError, ["topology", "op=hvd.Average"]),
]

_PLANNER_KEYS = {"merge", "profile_steps", "bucket_elements", "max_group"}
_PLANNER_KEYS |= {"drift_tolerance", "drift_window", "profile_budget", "link_bandwidth"}
_PLANNER_KEYS |= {"calibration_file"}
_ADAPTER_KEYS = {"config", "log_every"}


def _ids(cases):
    return [",".join(f"{k}={v!r}"[:40] for k, v in kw.items()) for kw, _, _ in cases]


def _assert_names(info, words):
    msg = str(info.value)
    for w in words:
        assert w in msg, msg


@pytest.fixture(scope="module", autouse=True)
def horovod():
    bind_horovod(hvd)
    hvd.init()
    yield


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)).to(dtype)


# -- the framework-free core: the checks every adapter goes through ---------------


CORE = [case for case in SHARED if not set(case[0]) & _ADAPTER_KEYS]


@pytest.mark.parametrize("kwargs, exc, words", CORE, ids=_ids(CORE))
def test_core_refuses_by_name(kwargs, exc, words):
    planner = {k: v for k, v in kwargs.items() if k in _PLANNER_KEYS}
    build = OnlinePlanner if planner else dlgs.SparsityConfig
    with pytest.raises(exc) as info:
        build(**kwargs)
    _assert_names(info, words)


# -- torch ------------------------------------------------------------------------


def _torch_optimizer(**kw):
    m = _model()
    return dlgs.torch.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(), **kw
    )


def _torch_compression(**kw):
    return dlgs.torch.Compression(_model().named_parameters(), **kw)


TORCH = [
    ("torch.DistributedOptimizer", _torch_optimizer),
    ("torch.Compression", _torch_compression),
]
# Checked by every door (a SparsityConfig built directly may hold it: the simulator's).
DOORS = [
    (dict(reduce_width=2.0), ValueError, ["reduce_width", "transport='reduce'"]),
    (dict(density=0.01, budget=1000), ValueError, ["density= or budget=", "not both"]),
]
# Horovod 0.28.1 allreduces no bfloat16 tensor (the DDP hook takes it).
HOROVOD_DOORS = [
    (dict(dense_dtype="bfloat16"), ValueError, ["dense_dtype='bfloat16'", "Horovod 0.28.1"]),
    (dict(dense_dtype="int8"), ValueError, ["dense_dtype", "'float16'"]),
]


def _ddp_state(**kw):
    # Options are checked before the model or torch.distributed are looked at.
    from dlgs.torch.ddp import SparseState

    return SparseState(None, **kw)


TORCH_CASES = [(name, build, *case) for name, build in TORCH for case in SHARED] + [
    ("torch.DistributedOptimizer", _torch_optimizer, *case)
    for case in OPTIMIZER_ONLY + TORCH_OPTIMIZER_ONLY
]
TORCH_CASES += [
    ("torch.Compression", _torch_compression, *c) for c in TOPOLOGY + DOORS + HOROVOD_DOORS
]
TORCH_CASES += [("torch.DistributedOptimizer", _torch_optimizer, *c) for c in DOORS + HOROVOD_DOORS]
TORCH_CASES += [("torch.ddp.SparseState", _ddp_state, *c) for c in TOPOLOGY + DOORS]


@pytest.mark.parametrize(
    "entry, build, kwargs, exc, words",
    TORCH_CASES,
    ids=[f"{c[0]}:{i}" for c, i in zip(TORCH_CASES, _ids([c[2:] for c in TORCH_CASES]))],
)
def test_torch_entry_points_refuse_by_name(entry, build, kwargs, exc, words):
    with pytest.raises(exc) as info:
        build(**kwargs)
    _assert_names(info, words)


@pytest.mark.parametrize("form", ["optimizer", "compression"])
def test_torch_complex_parameter_is_refused_by_name(form):
    m = _model()
    m[1].weight = torch.nn.Parameter(torch.randn(2, 16, dtype=torch.complex64))
    with pytest.raises(TypeError) as info:
        if form == "optimizer":
            dlgs.torch.DistributedOptimizer(
                torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters()
            )
        else:
            dlgs.torch.Compression(m.named_parameters())
    _assert_names(info, ["'1.weight'", "complex64", "real floating-point"])


def _float64_warnings(caplog):
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "float64" in r.getMessage()
    ]


def test_torch_float64_parameters_warn_once_and_still_train(caplog):
    m = _model(torch.float64)
    with caplog.at_level(logging.WARNING, logger="dlgs.torch"):
        opt = dlgs.torch.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1),
            named_parameters=m.named_parameters(),
            density=0.5,
            min_sparse_size=1,
            merge="none",
        )
        for _ in range(2):
            opt.zero_grad()
            m(torch.randn(4, 8, dtype=torch.float64)).sum().backward()
            opt.step()
    warnings = _float64_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "'0.weight'" in warnings[0] and "'1.bias'" in warnings[0]
    assert "float32" in warnings[0] and "residuals" in warnings[0]
    assert all(p.dtype == torch.float64 for p in m.parameters())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dlgs.torch"):
        dlgs.torch.Compression(_model(torch.float64).named_parameters())
    assert len(_float64_warnings(caplog)) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dlgs.torch"):
        _torch_optimizer()
    assert _float64_warnings(caplog) == []


# -- TensorFlow / Keras 3 -----------------------------------------------------------


@pytest.fixture(scope="module")
def tfmods():
    tf = pytest.importorskip("tensorflow")
    hvd_tf = pytest.importorskip("horovod.tensorflow")
    keras = pytest.importorskip("keras")
    # As tests/test_tensorflow.py: these can only be set before TF initialises,
    # and setting the same values again later is allowed.
    tf_single_thread(tf)
    bind_horovod(hvd_tf)
    hvd_tf.init()
    pytest.importorskip("dlgs.tensorflow.keras")  # imports dlgs.tensorflow too
    return tf, keras


def _tf_build(entry, tf, keras, kw):
    if entry == "tf.DistributedGradientTape":
        with tf.GradientTape() as tape:
            pass
        return dlgs.tensorflow.DistributedGradientTape(tape, name="bad-input", **kw)
    if entry == "keras.DistributedOptimizer":
        return dlgs.tensorflow.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), **kw)
    return dlgs.tensorflow.Compression([tf.Variable(tf.zeros([4]), name="v")], **kw)


TF_ENTRIES = ["tf.DistributedGradientTape", "keras.DistributedOptimizer", "tf.Compression"]
TF_ONLY = (
    TOPOLOGY
    + DOORS
    + HOROVOD_DOORS
    + [
        # At construction, not inside TensorFlow's error at the first step.
        (dict(kernels="triton"), ValueError, ["kernels='triton'", "PyTorch"]),
    ]
)
TF_CASES = [(entry, *case) for entry in TF_ENTRIES for case in SHARED + TF_ONLY] + [
    (entry, *case)
    for entry in TF_ENTRIES[:2]
    for case in OPTIMIZER_ONLY + TORCH_OPTIMIZER_ONLY[len(TOPOLOGY) :]
    if "backward_passes_per_step" not in case[0] or entry == "keras.DistributedOptimizer"
]


@pytest.mark.parametrize(
    "entry, kwargs, exc, words",
    TF_CASES,
    ids=[f"{c[0]}:{i}" for c, i in zip(TF_CASES, _ids([c[1:] for c in TF_CASES]))],
)
def test_tf_entry_points_refuse_by_name(tfmods, entry, kwargs, exc, words):
    tf, keras = tfmods
    with pytest.raises(exc) as info:
        _tf_build(entry, tf, keras, kwargs)
    _assert_names(info, words)


def test_tf_complex_variable_refused_and_float64_warns_once(tfmods, caplog):
    tf, _ = tfmods
    z = tf.Variable(tf.zeros([4], tf.complex64), name="z")
    with pytest.raises(TypeError) as info:
        dlgs.tensorflow.Compression([z], name="bad-input.c")
    _assert_names(info, ["'z", "complex64"])
    wide = tf.Variable(tf.zeros([4], tf.float64), name="wide")
    with caplog.at_level(logging.WARNING, logger="dlgs.tensorflow"):
        dlgs.tensorflow.Compression([wide, tf.Variable(tf.zeros([4]), name="narrow")])
    warnings = _float64_warnings(caplog)
    assert len(warnings) == 1 and "'wide" in warnings[0] and "narrow" not in warnings[0]
    assert "float32" in warnings[0] and "residuals" in warnings[0]
