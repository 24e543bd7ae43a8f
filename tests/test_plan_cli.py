"""``python -m dlgs.plan``, the built-in model catalog and the ring cost models
(pure Python, fast: no framework, tiny grids)."""

from __future__ import annotations

import csv
import json
import math
import re
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from dlgs.catalog import MODELS, catalog_model, catalog_profile
from dlgs.core.config import SparsityConfig
from dlgs.core.planning.dp import plan_dp, plan_strategy, simulate
from dlgs.core.planning.netmodel import DEFAULT_LATENCY_S, TwoLevels, allgather_cost, allreduce_cost
from dlgs.core.planning.profile import Profile, build_spec, choose_density
from dlgs.plan import main, parse_bandwidth
from dlgs.simulation import CSV_FIELDS, METHODS, format_bandwidth

# Parameter counts of the reference implementations (torchvision ResNet-50 and
# VGG-16, Hugging Face BertModel, PyTorch's word_language_model LSTM 2x200,
# Hugging Face GPT2LMHeadModel "gpt2-medium" with its tied output projection).
EXPECTED = {
    "resnet50": (161, 25_557_032),
    "vgg16": (32, 138_357_544),
    "bert-base": (199, 109_482_240),
    "ptb-lstm": (11, 4_653_200),
    "gpt2-medium": (292, 354_823_168),
}


def test_modules_import_without_frameworks():
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                top = name.split(".")[0]
                if top in ("torch", "tensorflow", "horovod", "keras", "matplotlib"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import dlgs.catalog, dlgs.core.planning.netmodel, dlgs.plan
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# -- catalog ------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_catalog_sizes(model):
    tensors, params = EXPECTED[model]
    m = catalog_model(model)
    assert len(m.layers) == tensors
    assert m.numel == params
    names = [layer.name for layer in m.layers]
    assert len(set(names)) == len(names)
    assert all(layer.numel > 0 and layer.macs > 0 for layer in m.layers)


def test_catalog_headline_sizes_within_one_percent():
    for model, target in (
        ("resnet50", 25.557e6),
        ("vgg16", 138.36e6),
        ("bert-base", 109.5e6),
        ("ptb-lstm", 4.65e6),
        ("gpt2-medium", 354.8e6),
    ):
        assert abs(catalog_model(model).numel / target - 1) < 0.01, model


def test_catalog_is_in_gradient_ready_order():
    r50 = [layer.name for layer in catalog_model("resnet50").layers]
    assert r50[:3] == ["fc.bias", "fc.weight", "layer4.2.bn3.bias"]
    assert r50[-3:] == ["bn1.bias", "bn1.weight", "conv1.weight"]
    assert r50.index("layer1.0.downsample.1.bias") < r50.index("layer1.0.bn3.bias")
    bert = [layer.name for layer in catalog_model("bert-base").layers]
    assert bert[0] == "pooler.dense.bias" and bert[-1] == "embeddings.word_embeddings.weight"
    lstm = [layer.name for layer in catalog_model("ptb-lstm").layers]
    assert lstm[0] == "decoder.bias" and lstm[-1] == "encoder.weight"
    vgg = [layer.name for layer in catalog_model("vgg16").layers]
    assert vgg[0] == "classifier.6.bias" and vgg[-1] == "features.0.weight"
    assert "features.28.weight" in vgg  # torchvision's indices count ReLU and pooling


def test_catalog_compute_model():
    # ResNet-50 forward: ~4.1 GMACs per 224x224 image (parameterised layers).
    assert 4.0e9 < catalog_model("resnet50").macs < 4.2e9
    assert 15.3e9 < catalog_model("vgg16").macs < 15.6e9
    prof = catalog_profile("vgg16", world_size=4, bandwidth_bps=1e9, batch=8, compute_flops=1e12)
    fc = next(layer for layer in prof.layers if layer.name == "classifier.0.weight")
    assert fc.numel == 25088 * 4096
    assert fc.backward == pytest.approx(2 * 2 * fc.numel * 8 / 1e12)
    assert prof.world_size == 4
    assert prof.allreduce == allreduce_cost(4, 1e9, DEFAULT_LATENCY_S)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(batch=0), "batch"),
        (dict(compute_flops=0.0), "compute_flops"),
        (dict(mem_bw=-1.0), "mem_bw"),
        (dict(world_size=0), "world_size"),
        (dict(bandwidth_bps=0.0), "bandwidth_bps"),
    ],
)
def test_catalog_profile_validation(kwargs, name):
    args = dict(world_size=2, bandwidth_bps=1e9) | kwargs
    with pytest.raises(ValueError, match=name):
        catalog_profile("resnet50", **args)


def test_catalog_unknown_model():
    with pytest.raises(ValueError, match="model must be one of"):
        catalog_model("resnet18")


# -- network model --------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 8, 1024])
def test_ring_formulas(p):
    bw, a, nbytes = 10e9, 20e-6, 12_345_678
    ar = allreduce_cost(p, bw, a)
    ag = allgather_cost(p, bw, a)
    assert ar(nbytes) == pytest.approx(2 * (p - 1) * a + 2 * (p - 1) / p * nbytes * 8 / bw)
    assert ag(nbytes) == pytest.approx((p - 1) * a + (p - 1) * nbytes * 8 / bw)
    if p == 1:
        assert ar(nbytes) == 0 and ag(nbytes) == 0


def test_two_level_formulas():
    """Nodes N of L ranks: the sparse message's link term is the flat one with
    N - 1 in place of P - 1 (L rings of c / L bytes share the link); the node's
    dense reduce-scatter and allgather carry r c bytes on the fast links."""
    n, ell, bw, fast, a, a2, r, c = 16, 8, 10e9, 100e9, 20e-6, 5e-6, 50.0, 1_000_000
    net = TwoLevels(n, ell, bw, fast, a, a2)
    sparse = net.sparse_cost(r)
    assert sparse(c) == pytest.approx(
        (n - 1) * a
        + 2 * (ell - 1) * a2
        + (n - 1) * 8 * c / bw
        + 2 * (ell - 1) / ell * 8 * r * c / fast
    )
    flat = allgather_cost(n * ell, bw, a)
    # Across the node's link: (N-1)/(P-1) of flat's bytes, about 1/L.
    assert (n - 1) * 8 / bw <= 1.1 / ell * flat.beta
    dense = net.dense_cost()
    assert dense(c) == pytest.approx(
        2 * (n - 1) * a
        + 2 * (ell - 1) * a2
        + 2 * (n - 1) / n * 8 * c / bw
        + 2 * (ell - 1) / ell * 8 * c / fast
    )
    with pytest.raises(ValueError, match="dense_per_chunk_byte"):
        net.sparse_cost(0.0)
    with pytest.raises(ValueError, match="bandwidth_bps"):
        TwoLevels(n, ell, bw, 0.0, a, a2)


def test_simulate_predicts_two_levels_where_there_are_two_nodes(tmp_path):
    out = tmp_path / "sim"
    argv = ["simulate", "--models", "resnet50", "--workers", "8,16,24,64", "--bandwidths",
            "10gbit", "--ranks-per-node", "8", "--out", str(out), "--no-plot"]  # fmt: skip
    assert main(argv) == 0
    with open(out / "simulate.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    hier = {int(r["workers"]) for r in rows if r["method"] == "dp-dlgs-hier"}
    assert hier == {16, 24, 64}  # 8 workers are one node
    text = (out / "simulate.md").read_text()
    assert "## Two levels: nodes of 8 ranks" in text and "| 64 |" in text


def test_simulate_on_a_cluster_preset_prices_its_librarys_collectives(tmp_path, capsys):
    """--cluster takes the preset's collectives (NCCL's model), its
    bandwidth per node and its nodes, and reports efficiency against the
    no-communication bound, which no row exceeds."""
    out = tmp_path / "sim"
    argv = ["simulate", "--cluster", "a100-eth25", "--models", "resnet50", "--workers",
            "8,64", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    with open(out / "simulate.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["bandwidth"] for r in rows} == {"25gbit"}
    assert {int(r["workers"]) for r in rows if r["method"] == "dp-dlgs-hier"} == {64}
    for r in rows:
        assert 0 < float(r["efficiency"]) <= 1.0 + 1e-12, r
        end = float(r["predicted_iteration_s"])
        assert float(r["efficiency"]) == pytest.approx(float(r["no_comm_s"]) / end, rel=1e-3)
    assert (out / "efficiency.png").stat().st_size > 0
    text = (out / "simulate.md").read_text()
    assert "## Against the no-communication bound" in text
    assert "collectives of cluster a100-eth25" in text
    # Not the flat ring: at 64 ranks the ring's 126 latencies would dominate small messages.
    flat = tmp_path / "flat"
    argv = ["simulate", "--models", "resnet50", "--workers", "64", "--bandwidths", "25gbit",
            "--out", str(flat), "--no-plot"]  # fmt: skip
    assert main(argv) == 0
    with open(flat / "simulate.csv", newline="") as f:
        ring = {r["method"]: float(r["predicted_iteration_s"]) for r in csv.DictReader(f)}
    ours = {r["method"]: float(r["predicted_iteration_s"]) for r in rows if r["workers"] == "64"}
    assert ours["dense"] < ring["dense"]
    assert main(["show", "--model", "resnet50", "--cluster", "h100-ib400", "--workers", "16"]) == 0
    assert "cluster h100-ib400 (nccl model" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, name",
    [
        ((0, 1e9, 0.0), "world_size"),
        ((2.0, 1e9, 0.0), "world_size"),
        ((True, 1e9, 0.0), "world_size"),
        ((2, 0.0, 0.0), "bandwidth_bps"),
        ((2, -1e9, 0.0), "bandwidth_bps"),
        ((2, math.inf, 0.0), "bandwidth_bps"),
        ((2, 1e9, -1e-6), "latency_s"),
        ((2, 1e9, math.nan), "latency_s"),
    ],
)
def test_ring_validation(args, name):
    for fn in (allreduce_cost, allgather_cost):
        with pytest.raises(ValueError, match=name):
            fn(*args)


# -- bandwidth parsing --------------------------------------------------------------


@pytest.mark.parametrize(
    "text, bps",
    [
        ("1gbit", 1e9),
        ("100mbit", 1e8),
        ("25mbit", 2.5e7),
        ("10gbit", 1e10),
        ("1e9", 1e9),
        ("2.5Gbit/s", 2.5e9),
        ("10gbps", 1e10),
        (" 400 kbit ", 4e5),
    ],
)
def test_parse_bandwidth(text, bps):
    assert parse_bandwidth(text) == pytest.approx(bps)
    assert parse_bandwidth(format_bandwidth(bps)) == pytest.approx(bps)


@pytest.mark.parametrize("text", ["", "fast", "-1gbit", "0", "0gbit", "1xbit", "gbit", "1e999"])
def test_parse_bandwidth_rejects(text):
    with pytest.raises(ValueError, match="--bandwidth must be a rate > 0"):
        parse_bandwidth(text)


@pytest.mark.parametrize(
    "argv, option",
    [
        (["show", "--model", "ptb-lstm", "--bandwidth", "fast"], "--bandwidth"),
        (["show", "--model", "ptb-lstm", "--workers", "0"], "--workers"),
        (["show", "--model", "ptb-lstm", "--density", "0"], "--density"),
        (["show", "--model", "ptb-lstm", "--max-front", "1"], "--max-front"),
        (["show", "--model", "alexnet"], "--model"),
        (["simulate", "--bandwidths", "1gbit,x"], "--bandwidths"),
        (["simulate", "--workers", "2,0"], "--workers"),
        (["simulate", "--models", "ptb-lstm,alexnet"], "--models"),
        (["simulate", "--density", "auto"], "--density"),
        (["show", "--model", "vgg16", "--no-auto-layers"], "--no-auto-layers"),
        (["show", "--model", "vgg16", "--density", "auto", "--max-front", "9"], "--max-front"),
    ],
)
def test_cli_rejects_bad_options(argv, option, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


# -- show ---------------------------------------------------------------------------


def test_show_prints_plan_and_speedup(capsys):
    argv = ["show", "--model", "resnet50", "--workers", "8", "--bandwidth", "1gbit"]
    assert main(argv + ["--density", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "strategy dp:" in out and "first..last" in out
    rows = [
        line for line in out.splitlines() if re.match(r"^\s+\d+\s+\d+-\d+\s+(sparse|dense)", line)
    ]
    # Independently recomputed from the planner: the CLI adds no numbers of its own.
    prof = catalog_profile("resnet50", world_size=8, bandwidth_bps=1e9)
    spec, eligible = build_spec(prof, SparsityConfig(density=0.01), 0.01)
    # Training's rule: a layer too small to go sparse (batch norm) never joins a
    # sparse message.
    plan = plan_dp(spec, eligible=eligible)
    dense = plan_strategy(spec, "none", eligible=[False] * len(spec.layers))
    assert len(rows) == len(plan.groups)
    assert rows[0].split()[1] == f"{plan.groups[0].first}-{plan.groups[0].last}"
    m = re.search(r"speed-up over dense allreduce:\s+([0-9.]+)x layer-wise", out)
    assert m is not None
    assert float(m.group(1)) == pytest.approx(dense.end / plan.end, abs=0.006)
    assert float(m.group(1)) > 1  # 1 Gbit/s, 8 workers: communication-bound
    assert f"{plan.end * 1e3:.3f} ms" in out


@pytest.mark.parametrize("layers", [True, False])
def test_show_density_auto_prints_the_choice_and_its_plan(layers, capsys):
    argv = ["show", "--model", "vgg16", "--workers", "8", "--bandwidth", "1gbit"]
    assert main(argv + ["--density", "auto"] + ([] if layers else ["--no-auto-layers"])) == 0
    out = capsys.readouterr().out
    prof = catalog_profile("vgg16", world_size=8, bandwidth_bps=1e9)
    choice = choose_density(prof, SparsityConfig(density="auto", auto_layers=layers))
    assert f"density 'auto' (chose {choice.density:g})" in out
    assert ("layers raised above" in out) == layers == bool(choice.layers)
    assert f"predicted end {choice.plan.end * 1e3:.3f} ms" in out


@pytest.mark.parametrize("merge", ["none", "all", "buckets", "greedy"])
def test_show_baselines(merge, capsys):
    assert main(["show", "--model", "ptb-lstm", "--workers", "4", "--merge", merge]) == 0
    out = capsys.readouterr().out
    assert f"strategy {merge}:" in out
    if merge == "none":
        assert "11 messages" in out


def test_show_profile(tmp_path, capsys):
    path = tmp_path / "p.json"
    catalog_profile("ptb-lstm", world_size=2, bandwidth_bps=1e9).save(path)
    assert main(["show", "--profile", str(path)]) == 0
    out = capsys.readouterr().out
    assert "fitted collectives at 2 workers" in out and "decoder.weight" in out
    assert main(["show", "--profile", str(path), "--workers", "16", "--bandwidth", "10gbit"]) == 0
    assert "ring model: 16 workers, 10gbit" in capsys.readouterr().out


@pytest.mark.parametrize(
    "with_profile, extra, words",
    [
        (True, ["--workers", "16"], ["argument --workers", "needs --bandwidth"]),
        (False, [], ["argument --model", "required without --profile"]),
    ],
)
def test_show_rejects_conflicting_options(tmp_path, with_profile, extra, words, capsys):
    path = tmp_path / "p.json"
    catalog_profile("ptb-lstm", world_size=2, bandwidth_bps=1e9).save(path)
    profile = ["--profile", str(path)] if with_profile else []
    with pytest.raises(SystemExit) as e:
        main(["show", *profile, *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def _profile_dict():
    return catalog_profile("ptb-lstm", world_size=2, bandwidth_bps=1e9).to_dict()


def _drop(d, *keys):
    for key in keys[:-1]:
        d = d[key]
    del d[keys[-1]]


def _set(d, *keys_value):
    *keys, value = keys_value
    for key in keys[:-1]:
        d = d[key]
    d[keys[-1]] = value


# (what to do to a good profile, the field the one-line error must name)
BAD_PROFILES = [
    (lambda d: _drop(d, "world_size"), "world_size"),
    (lambda d: _set(d, "world_size", 0), "world_size"),
    (lambda d: _set(d, "world_size", "2"), "world_size"),
    (lambda d: _drop(d, "layers"), "layers"),
    (lambda d: _set(d, "layers", []), "layers"),
    (lambda d: _set(d, "layers", 0, "numel", -5), "layers[0].numel"),
    (lambda d: _set(d, "layers", 1, "numel", "10"), "layers[1].numel"),
    (lambda d: _drop(d, "layers", 2, "backward"), "layers[2].backward"),
    (lambda d: _set(d, "layers", 0, "backward", -1.0), "layers[0].backward"),
    (lambda d: _set(d, "layers", 0, "name", ""), "layers[0].name"),
    (lambda d: _set(d, "layers", 1, "name", d["layers"][0]["name"]), "name"),
    (lambda d: _set(d, "layers", 0, "size", 3), "layers[0].size"),
    (lambda d: _drop(d, "allgather", "beta"), "allgather.beta"),
    (lambda d: _set(d, "allreduce", "alpha", -1e-3), "allreduce.alpha"),
    (lambda d: _set(d, "sparsify", "beta", "fast"), "sparsify.beta"),
    (lambda d: _set(d, "pack", None), "pack"),
    (lambda d: _set(d, "allgather", {"alpha": 0, "beta": 0}), "allgather.alpha"),
    (
        lambda d: _set(d, "allreduce", {"alpha": 1e-3, "beta": 0, "batched": -1}),
        "allreduce.batched",
    ),
    (lambda d: _set(d, "version", 7), "version"),
]


def _run_cli(*argv):
    return subprocess.run(
        [sys.executable, "-m", "dlgs.plan", *argv], capture_output=True, text=True, timeout=120
    )


def _assert_one_line_error(proc, field):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and field in errors[0] and "--profile" in errors[0], proc.stderr
    assert proc.stdout == ""


def test_profile_round_trips_in_process_and_through_json(tmp_path):
    """The online planner broadcasts ``to_dict()`` (tuples) and checkpoints it;
    the validation must accept both that and the JSON file (lists)."""
    prof = catalog_profile("ptb-lstm", world_size=2, bandwidth_bps=1e9)
    assert Profile.from_dict(prof.to_dict()) == prof
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof
    # A measured latency in a batch is kept; a profile saved without one loads.
    batched = replace(prof, allgather=replace(prof.allgather, batched=2e-4))
    assert Profile.from_dict(json.loads(json.dumps(batched.to_dict()))) == batched
    d = json.loads(json.dumps(prof.to_dict()))
    for key in ("sparsify", "pack", "allgather", "allreduce"):
        del d[key]["batched"]
    assert Profile.from_dict(d) == prof


@pytest.mark.parametrize("spoil, field", BAD_PROFILES, ids=[f for _, f in BAD_PROFILES])
def test_malformed_profile_is_one_line_naming_the_field(tmp_path, spoil, field, capsys):
    d = _profile_dict()
    spoil(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=re.escape(field)):
        Profile.from_dict(json.loads(path.read_text()))
    with pytest.raises(SystemExit) as e:
        main(["show", "--profile", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and field in err.splitlines()[-1], err


@pytest.mark.parametrize("command", ["show", "simulate"])
def test_unreadable_profiles_exit_2_without_traceback(tmp_path, command):
    """Through the real ``python -m dlgs.plan``: what a user sees on stderr."""
    extra = ["--out", str(tmp_path / "out"), "--no-plot"] if command == "simulate" else []
    bad = tmp_path / "bad.json"
    d = _profile_dict()
    d["layers"][0]["numel"] = -5  # once printed a plan
    bad.write_text(json.dumps(d))
    _assert_one_line_error(_run_cli(command, "--profile", str(bad), *extra), "layers[0].numel")
    nojson = tmp_path / "p.txt"
    nojson.write_text("not json")
    _assert_one_line_error(_run_cli(command, "--profile", str(nojson), *extra), "not a JSON")
    missing = str(tmp_path / "missing.json")
    _assert_one_line_error(_run_cli(command, "--profile", missing, *extra), "missing.json")
    if command == "show":
        good = tmp_path / "good.json"
        good.write_text(json.dumps(_profile_dict()))
        proc = _run_cli("show", "--profile", str(good), "--workers", "4")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "argument --workers" in proc.stderr and "--bandwidth" in proc.stderr


# -- simulate -----------------------------------------------------------------------


def test_simulate_writes_csv(tmp_path):
    out = tmp_path / "sim"
    argv = [
        "simulate",
        "--models",
        "ptb-lstm,vgg16",
        "--workers",
        "2,16",
        "--bandwidths",
        "1gbit,100mbit",
        "--density",
        "0.01",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    with open(out / "simulate.csv") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == CSV_FIELDS
        rows = list(reader)
    assert len(rows) == 2 * 2 * 2 * len(METHODS)
    cells = {(r["model"], r["workers"], r["bandwidth"], r["method"]) for r in rows}
    assert ("vgg16", "16", "100mbit", "dp-dlgs") in cells
    assert ("ptb-lstm", "2", "1gbit", "dense-fused") in cells
    for r in rows:
        if r["method"] == "dense":
            assert float(r["speedup_vs_dense"]) == pytest.approx(1.0)
            assert int(r["messages"]) in (11, 32)
    # The CSV's numbers are the planner's: recompute one cell.
    r = next(
        r
        for r in rows
        if (r["model"], r["workers"], r["bandwidth"], r["method"])
        == ("vgg16", "16", "1gbit", "dp-dlgs")
    )
    spec, eligible = build_spec(
        catalog_profile("vgg16", world_size=16, bandwidth_bps=1e9), SparsityConfig(), 0.01
    )
    plan = plan_dp(spec, eligible=eligible)
    fused = simulate(spec, [(0, len(spec.layers) - 1, False)])
    assert float(r["predicted_iteration_s"]) == pytest.approx(plan.end, rel=1e-5)
    assert float(r["speedup_vs_dense_fused"]) == pytest.approx(fused.end / plan.end, rel=1e-3)
    assert int(r["messages"]) == len(plan.groups)
    assert (out / "simulate.png").stat().st_size > 0
    assert "python -m dlgs.plan simulate" in (out / "simulate.md").read_text()


def test_simulate_profile(tmp_path):
    path = tmp_path / "lstm.json"
    catalog_profile("ptb-lstm", world_size=2, bandwidth_bps=1e9).save(path)
    out = tmp_path / "sim"
    argv = ["simulate", "--profile", str(path), "--workers", "2,4", "--bandwidths", "1gbit"]
    assert main(argv + ["--out", str(out), "--no-plot"]) == 0
    with open(out / "simulate.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["model"] for r in rows} == {"profile:lstm"}
    assert len(rows) == 2 * len(METHODS)
    assert not (out / "simulate.png").exists()


def test_dense_dtype_halves_dlgs_dense_messages_not_the_baseline(capsys):
    argv = ["show", "--model", "resnet50", "--workers", "8", "--bandwidth", "10gbit"]
    baseline, ends, dense_bytes = [], [], []
    for dtype in ("float32", "float16"):
        assert main(argv + ["--density", "1.0", "--dense-dtype", dtype]) == 0
        out = capsys.readouterr().out
        assert f"dense {dtype}" in out
        rows = [ln.split() for ln in out.splitlines() if re.match(r"^\s+\d+\s+\d+-\d+\s+dense", ln)]
        dense_bytes.append(sum(int(r[3]) for r in rows))
        base = re.search(r"dense allreduce \(layer-wise\):\s+([0-9.]+) ms", out)
        end = re.search(r"predicted end ([0-9.]+) ms", out)
        assert base is not None and end is not None
        baseline.append(float(base.group(1)))
        ends.append(float(end.group(1)))
    # Density 1.0: every layer dense, in half the bytes; Horovod's baseline stays float32.
    assert dense_bytes[1] * 2 == dense_bytes[0]
    assert baseline[0] == baseline[1] and ends[1] < ends[0]


def test_bucketed_dense_fills_ddp_buckets_in_ready_order_and_takes_the_best_cap():
    from dlgs.simulation import BUCKET_BYTES, bucketed, buckets

    spec, _ = build_spec(
        catalog_profile("resnet50", world_size=16, bandwidth_bps=25e9), SparsityConfig(), 0.01
    )
    n = len(spec.layers)
    for cap in BUCKET_BYTES:
        parts = buckets(spec, cap)
        # Consecutive, covering every layer once, in ready order.
        assert parts[0][0] == 0 and parts[-1][1] == n - 1
        assert all(a[1] + 1 == b[0] for a, b in zip(parts, parts[1:]))
        sizes = [sum(la.dense_bytes for la in spec.layers[f : e + 1]) for f, e, _ in parts]
        # Each bucket but the last reaches the cap, and holds no layer it could do without.
        assert all(s >= cap for s in sizes[:-1])
        assert all(s - spec.layers[e].dense_bytes < cap for s, (_, e, _) in zip(sizes[:-1], parts))
    best = bucketed(spec, "dense-bucketed")
    ends = [simulate(spec, buckets(spec, cap)).end for cap in BUCKET_BYTES]
    assert best.end == min(ends) and best.strategy == "dense-bucketed"
    # ResNet-50 (102 MB in float32) at 25 Gbit/s: buckets overlap back-propagation,
    # one fused allreduce waits for its end.
    fused = simulate(spec, [(0, n - 1, False)])
    assert best.end < fused.end
