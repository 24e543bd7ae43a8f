"""Shared helpers: launching real ranks under horovodrun."""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

#: Where tools/install.sh puts Triton for the tests: off this process's path
#: (torch imports Triton whenever it finds it, and Triton's library beside
#: TensorFlow's crashes a process); child processes that run Triton's CPU
#: interpreter get it from :func:`triton_env`.
TRITON_PATH = Path(sys.prefix) / "triton"


def triton_env(interpret: str = "1") -> dict:
    """The environment of a child process that may import Triton: its
    directory on the path and its CPU interpreter on (Triton reads
    ``TRITON_INTERPRET`` when a kernel is defined)."""
    path = os.pathsep.join(p for p in (str(TRITON_PATH), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, TRITON_INTERPRET=interpret)


def triton_installed() -> bool:
    return (TRITON_PATH / "triton").is_dir()


ROOT = Path(__file__).resolve().parents[1]


def _share_mpi() -> None:
    """Initialise MPI once for this pytest process, before any Horovod does
    (at configuration, before a test module imports one).

    The single-process tests of both frameworks run in this one process, so two
    Horovod libraries (``horovod.torch``'s and ``horovod.tensorflow``'s) both
    initialise. Each calls ``MPI_Finalize`` at exit if it initialised MPI
    itself, and the second one's shutdown then crashes the process (a segfault
    in ``horovod_shutdown`` after every test passed). With MPI already
    initialised neither library finalises it; this process does, last.
    """
    name = ctypes.util.find_library("mpi")
    if not name:
        return
    lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    provided = ctypes.c_int()
    if lib.MPI_Init_thread(None, None, 3, ctypes.byref(provided)) == 0:  # MPI_THREAD_MULTIPLE
        atexit.register(lib.MPI_Finalize)  # registered first, so it runs after Horovod's


def pytest_configure(config):
    # Not in pytest-xdist's controller, which runs no test: MPI's singleton
    # start-up sets its variables in the process's environment, which the
    # workers would inherit and hand to every mpirun they start (which then
    # fails, silently).
    xdist_controller = getattr(config.option, "numprocesses", None) and not os.environ.get(
        "PYTEST_XDIST_WORKER"
    )
    if not xdist_controller:
        _share_mpi()


HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")


def horovodrun(
    backend: str, np: int, args, *, timeout: float, cwd=ROOT, extra_path=None, fails=False
) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` on ``np`` real ranks with ``--gloo`` or ``--mpi``.

    The launch runs in its own process group and is killed whole (horovodrun and
    every rank) after ``timeout`` seconds, failing the test: a hang is a failure,
    never a stuck CI job. Ranks get ``DLGS_TEST_HANG_S`` a little earlier, at
    which the scenario workers dump their stacks (showing where they waited).
    ``fails``: the job must end with a non-zero exit (a fault test), not zero.
    """
    cmd = [HOROVODRUN, "-np", str(np), f"--{backend}", sys.executable, *map(str, args)]
    return _launch(cmd, timeout=timeout, cwd=cwd, extra_path=extra_path, fails=fails)


def torchrun(np: int, args, *, timeout: float, cwd=ROOT) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` on ``np`` local ranks under ``torchrun`` (PyTorch's
    launcher, as a DDP user starts a job), killed whole like :func:`horovodrun`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={np}", *map(str, args)]
    return _launch(cmd, timeout=timeout, cwd=cwd, extra_path=None)


def _launch(cmd, *, timeout: float, cwd, extra_path, fails=False) -> subprocess.CompletedProcess:
    if os.environ.get("DLGS_TEST_FAST") == "1":  # make test-fast: in process only
        pytest.skip("launches real ranks (make test-fast leaves them to make test)")
    env = dict(os.environ)
    # Open MPI refuses to run as root without these (docs/design.md).
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    # An idle MPI rank yields its core rather than spin: a launch's ranks
    # (and the jobs a fault test runs at once) share this machine's two cores.
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env["DLGS_TEST_HANG_S"] = str(max(1, int(timeout) - 30))
    # When the launch began: a scenario worker records its ranks' start-up
    # (processes, imports, hvd.init) from it, for tools/run_tests.py's report.
    env["DLGS_TEST_LAUNCHED_AT"] = repr(time.time())
    paths = [str(ROOT)] + ([str(extra_path)] if extra_path else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    start, cpu = time.monotonic(), _children_cpu()
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        # Not this process's stdin: under pytest-xdist that is its channel to
        # the controller, and mpirun forwards stdin to rank 0.
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"{' '.join(cmd)} hung: killed after {timeout:.0f} s\n--- stdout ---\n"
            f"{stdout[-4000:]}\n--- stderr ---\n{stderr[-4000:]}"
        )
    _record_launch(cmd, time.monotonic() - start, _children_cpu() - cpu)
    if fails and proc.returncode == 0:
        pytest.fail(
            f"{' '.join(cmd)} exited 0, expected a failure\n{stdout[-4000:]}\n{stderr[-4000:]}"
        )
    if proc.returncode != 0 and not fails:
        pytest.fail(
            f"{' '.join(cmd)} exited {proc.returncode} after {time.monotonic() - start:.0f} s"
            f"\n--- stdout ---\n{stdout[-4000:]}\n--- stderr ---\n{stderr[-4000:]}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _children_cpu() -> float:
    """CPU seconds (user and system) of this process's ended children and
    theirs: a launch's ranks and launcher, once it is reaped. Launches that
    overlap in threads share the figure."""
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _record_launch(cmd, seconds: float, cpu: float) -> None:
    """One launch in ``_LAUNCHES``, with its CPU seconds and its ranks'
    start-up where a scenario worker wrote it (``OUT/startup{rank}.json``, OUT
    the argument after the worker script)."""
    args = [str(c) for c in cmd]
    at = next((i for i, c in enumerate(args) if c.endswith(".py")), None)
    startup = []
    if at is not None and at + 1 < len(args):
        for path in Path(args[at + 1]).glob("startup*.json"):
            try:
                startup.append(float(json.loads(path.read_text())))
            except (OSError, ValueError):
                pass
    _LAUNCHES.append(
        {
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
            "launcher": "torchrun" if "torch.distributed.run" in args else Path(args[0]).name,
            "worker": Path(args[at]).name if at is not None else "?",
            "seconds": round(seconds, 2),
            "cpu": round(cpu, 1),
            "startup": max(startup) if startup else None,
        }
    )


def load_ranks(out_dir: Path, np: int):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(np)]


def run_scenarios(backend: str, worker: str, out_dir: Path, names, timeout: float = 540) -> list:
    """Run ``tests/parallel/WORKER``'s scenarios ``names`` on 2 ranks; each rank's results."""
    horovodrun(backend, 2, [ROOT / "tests/parallel" / worker, out_dir, *names], timeout=timeout)
    return load_ranks(out_dir, 2)


#: One TensorFlow launch per backend for test_tensorflow.py and test_tf_amp.py:
#: TensorFlow's start-up is a good part of a launch's time.
_TF_LAUNCHES: dict = {}


def tf_ranks(backend: str, factory, timeout: float = 540) -> list:
    """Every rank's results of the one launch per backend of
    ``tf_amp_worker.py`` (which holds ``tf_worker.py``'s scenarios too) that
    runs ``TF_SCENARIOS[backend]`` for both TensorFlow test modules."""
    if backend not in _TF_LAUNCHES:
        out = factory.mktemp(f"tf-{backend}")
        names = TF_SCENARIOS[backend]
        _TF_LAUNCHES[backend] = run_scenarios(backend, "tf_amp_worker.py", out, names, timeout)
    return _TF_LAUNCHES[backend]


#: What the TensorFlow test modules run per backend. MPI runs the diagonal:
#: the guarantees every transport must keep (density 1.0 equal to Horovod's
#: allreduce in every form, eagerly and traced, with the ranks' digests equal
#: after every step; k-sparse exact, in the graph too; conservation). Gloo
#: runs every scenario: the rest checks logic that does not depend on the
#: transport (the reference comparison, Keras fit, mixed precision, the
#: graph's retracing, non-finite steps, checkpoints, errors), and each
#: scenario costs both ranks its seconds on this 2-core machine.
TF_SCENARIOS = {
    "gloo": [
        "dense_equivalence",
        "exact_reconstruction",
        "conservation",
        "fit_identical",
        "resume",
        "resume_recipe",
        "one_rank_load",
        "mismatch",
        "against_reference",
        "graph_exchange",
        "fault_injection",
        "scaled_conservation",
        "amp_fit",
        "door_cells",
    ],
    "mpi": ["dense_equivalence", "exact_reconstruction", "conservation"],
}


def value(ranks, name):
    """Scenario ``name``'s return value on every rank (failing the test with a
    rank's traceback if it raised there)."""
    vals = []
    for r, rec in enumerate(ranks):
        res = rec[name]
        if not res["ok"]:
            pytest.fail(f"scenario {name} failed on rank {r}:\n{res['error']}")
        vals.append(res["value"])
    return vals


def gloo_value(ranks, name):
    """:func:`value` of a scenario the Gloo launch alone runs (``TF_SCENARIOS``):
    under MPI the test skips, saying so."""
    if name not in ranks[0]:
        pytest.skip(f"{name} runs under Gloo only (MPI runs the diagonal)")
    return value(ranks, name)


def bind_horovod(framework) -> None:
    """Point Horovod's process-set handle at ``framework`` (``horovod.torch`` or
    ``horovod.tensorflow``).

    ``horovod.common.process_sets`` keeps one module-global library handle, set
    by whichever framework's Horovod was imported last. The single-process tests
    of both frameworks share one pytest process, so before a framework's
    ``hvd.init()`` (which registers the global process set through that handle)
    and before each of its tests the handle must be that framework's; otherwise
    ``init`` registers with the other library and the process dies at exit
    (``MPI_BAND ... on a NULL communicator``).
    """
    from horovod.common import process_sets

    process_sets._setup(framework.mpi_ops._basics)  # noqa: SLF001 - Horovod's one handle


@pytest.fixture(autouse=True)
def _horovod_handle_of_this_test(request):
    """Bind Horovod's process-set handle to the framework this test uses: the
    TensorFlow one for tests using a ``tf``-named fixture or modules whose
    ``hvd`` is horovod.tensorflow, else the torch one (when imported)."""
    hvd = getattr(request.module, "hvd", None)
    name = getattr(hvd, "__name__", "")
    if any(f.startswith("tf") for f in request.fixturenames):
        name = "horovod.tensorflow"
    if name in ("horovod.torch", "horovod.tensorflow") and name in sys.modules:
        bind_horovod(sys.modules[name])
    yield


def check_fault_injection(r0: dict, r1: dict, faults: dict) -> None:
    """The fault-injection scenario of either framework (``amp_worker.py``,
    ``tf_amp_worker.py``): each case's record from both ranks, ``faults`` the
    injected step -> layer. Every rank flags exactly those steps and layers, a
    skipped step leaves the state exactly as it was, the state stays finite and
    the controllers return to their targets."""
    for case, rec in r0.items():
        other = r1[case]
        bad = [s for s, ok in enumerate(rec["finite"]) if not ok]
        assert bad == sorted(faults), f"{case}: non-finite steps {bad}"
        assert rec["finite"] == other["finite"], f"{case}: ranks disagree on the verdict"
        for s, layers in enumerate(rec["nan_layers"]):
            expect = [faults[s]] if s in faults else []
            assert layers == expect, f"{case} step {s}: non-finite gradients in {layers}"
            assert other["nan_layers"][s] == layers, f"{case} step {s}: ranks differ"
        # A skipped step leaves residuals, velocities and thresholds exactly as they were.
        assert rec["unchanged_by_bad_step"] == [0.0] * len(faults), (case, rec)
        assert other["unchanged_by_bad_step"] == [0.0] * len(faults), (case, other)
        assert rec["state_finite"] and other["state_finite"], f"{case}: non-finite state"
        late = rec["ratio"][-5:]
        if case == "fixed":
            assert min(late) > 0, f"{case}: nothing selected after the faults: {late}"
        else:
            mean = sum(late) / len(late)
            assert 0.5 <= mean <= 2.0, f"{case}: selected/target {late} after the faults"
    assert r0["merged"]["messages"] < r0["dynamic"]["messages"]


def check_scaled_conservation(ranks_values) -> None:
    """sent + residual = accumulated unscaled input on every rank, one skipped step."""
    for r, v in enumerate(ranks_values):
        for case, rec in v.items():
            assert rec["skipped"] == [3], f"rank {r} {case}: skipped {rec['skipped']}"
            assert rec["sparse_layers"] >= 2
            assert rec["max_error"] <= 1e-5 * rec["scale"], f"rank {r} {case}: {rec}"


def tf_single_thread(tf) -> None:
    """One TensorFlow thread, as the multi-rank workers use. TensorFlow fixes its
    thread pools when its context starts; a module that ran earlier in the same
    pytest process may already have started it, and then this is a no-op."""
    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:  # "cannot be modified after initialization"
        pass


def check_resume_recipe(r0: dict, r1: dict, forms, steps: int) -> None:
    """Horovod's rank-0 resume recipe (``resume_recipe`` scenarios of both
    frameworks): per form, the weights after the broadcasts and after every
    later step are the same on both ranks, they trained, and the exchange
    counted ``steps`` steps on both."""
    for form in forms:
        a, b = r0[form], r1[form]
        assert a["broadcast"] == b["broadcast"], f"{form}: broadcast weights differ"
        assert a["digests"] == b["digests"], f"{form}: ranks differ after resuming"
        assert len(set(a["digests"])) == len(a["digests"]), f"{form}: no training"
        assert a["step"] == b["step"] == steps, f"{form}: steps {a['step']}, {b['step']}"


# -- measured durations and launches, for tools/run_tests.py's report ----------------------
#: Where this run's per-test seconds (setup, call and teardown) and its
#: real-rank launches are written.
LAST_RUN = ROOT / ".pytest_cache" / "dlgs-last-run.json"
_measured: dict = {}
#: This session's real-rank launches (``_launch``): the test, the launcher,
#: the worker, the seconds, the CPU seconds, and the ranks' start-up where a
#: scenario worker recorded it.
_LAUNCHES: list = []


def pytest_runtest_logreport(report):
    entry = _measured.setdefault(report.nodeid, {"seconds": 0.0, "slow": False})
    entry["seconds"] += report.duration
    entry["slow"] = entry["slow"] or "slow" in report.keywords


def pytest_sessionfinish(session):
    # Under pytest-xdist (make test-fast) the controller gets every report;
    # the workers launch nothing there.
    if not _measured or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    LAST_RUN.parent.mkdir(parents=True, exist_ok=True)
    LAST_RUN.write_text(json.dumps({"tests": _measured, "launches": _LAUNCHES}, indent=0))


def check_door_cells(per_rank) -> None:
    """The torch doors' ``door_cells`` records (tests/parallel/torch_common.py):
    every rank the same parameters after every step, training, under
    transport="auto" (not the plain allgather), density="auto" (a choice made)
    and a byte budget, one density or split between the layers (met within
    5%, under a merge plan)."""
    first = per_rank[0]
    for r, rec in enumerate(per_rank):
        for cell in first:
            assert rec[cell]["digests"] == first[cell]["digests"], f"rank {r} {cell}: ranks differ"
    for cell, rec in first.items():
        assert len(set(rec["digests"])) == len(rec["digests"]), f"{cell}: it trains"
    assert first["transport_auto"]["transport"] == "auto"
    assert first["density_auto"]["choice"] is not None
    # budget=0.1: within 5% under a tenth of the dense bytes, under a plan.
    for name in ("budget", "budget_split"):
        cell = first[name]
        assert cell["planned"], cell
        budget = 0.1 * cell["dense_bytes"]
        assert 0.95 * budget <= cell["wire_bytes"] <= budget, (name, cell)
        # budget_split="gradient": each layer its own density after step 10.
        assert cell["split"] == (name == "budget_split"), cell
