"""pytest plugin: Horovod's own tests with dlgs in place of ``hvd.DistributedOptimizer``.

Loaded by ``tools/horovod_tests.py`` (``pytest -p horovod_substitute``) into
each rank's pytest run of Horovod's ``test/parallel/test_torch.py``.
``DLGS_SUBSTITUTE`` chooses what ``horovod.torch.DistributedOptimizer`` becomes:

* ``stock``: Horovod's own (the reference outcome on this machine);
* ``b``: ``dlgs.torch.DistributedOptimizer`` with the same arguments;
* ``a``: Horovod's optimizer with ``compression=dlgs.torch.Compression(...)``,
  attached (README, form (a)).

``DLGS_SUBSTITUTE_DENSITY`` (default 0.01) is dlgs' density;
``DLGS_SUBSTITUTE_HIDE_MUON=1`` leaves torch's Muon optimizer out of the tests
that loop over every torch optimizer (see :func:`pytest_configure`). Each rank writes
its tests' outcomes to ``$DLGS_SUBSTITUTE_OUT.rank<R>.json``.
"""

from __future__ import annotations

import json
import os

import pytest

_OUTCOMES: dict = {}


def _substitute(form: str, density: float):
    import horovod.torch as hvd

    import dlgs.torch

    stock = hvd.DistributedOptimizer

    def form_b(optimizer, named_parameters=None, *args, **kwargs):
        return dlgs.torch.DistributedOptimizer(
            optimizer, named_parameters, *args, density=density, **kwargs
        )

    def form_a(optimizer, named_parameters=None, *args, **kwargs):
        # What a user of form (a) writes: the compressor gets the optimizer's
        # parameters and process set. Without names, Horovod's own default names.
        kwargs.pop("compression", None)
        if named_parameters is not None:
            named = list(named_parameters)
        else:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            named = [(f"allreduce.noname.{i}", p) for i, p in enumerate(params)]
        process_set = kwargs.get("process_set", hvd.global_process_set)
        comp = dlgs.torch.Compression(named, density=density, process_set=process_set)
        opt = stock(optimizer, named_parameters and named, *args, compression=comp, **kwargs)
        comp.attach(opt)
        return opt

    return {"stock": stock, "b": form_b, "a": form_a}[form]


def pytest_configure(config):
    form = os.environ.get("DLGS_SUBSTITUTE", "stock")
    if form not in ("stock", "a", "b"):
        raise pytest.UsageError(f"DLGS_SUBSTITUTE must be stock, a or b, got {form!r}")
    import horovod.torch as hvd

    density = float(os.environ.get("DLGS_SUBSTITUTE_DENSITY", "0.01"))
    hvd.DistributedOptimizer = _substitute(form, density)
    if os.environ.get("DLGS_SUBSTITUTE_HIDE_MUON") == "1":
        import torch

        # Horovod 0.28.1's test_broadcast_state* iterate over every optimizer class
        # in torch.optim; torch 2.13's Muon (2-D parameters only) fails them with stock
        # Horovod too and stops them before NAdam .. SGD. Its test filters on
        # __module__; this moves Muon out of it, so the remaining optimizers run.
        muon = getattr(torch.optim, "Muon", None)
        if muon is not None:
            muon.__module__ = "hidden_by_horovod_substitute"


def pytest_runtest_logreport(report):
    name = report.nodeid.split("::")[-1]
    if report.when == "call" or report.outcome != "passed":
        message = ""
        if report.failed:
            lines = str(report.longrepr).strip().splitlines()
            errors = [ln for ln in lines if ln.startswith("E ")]
            message = (errors[0] if errors else lines[-1] if lines else "")[:300]
        if name not in _OUTCOMES or _OUTCOMES[name]["outcome"] == "passed":
            _OUTCOMES[name] = {"outcome": report.outcome, "when": report.when, "message": message}


def pytest_collectreport(report):
    if report.failed:
        lines = str(report.longrepr).strip().splitlines()
        errors = [ln for ln in lines if ln.startswith("E ")]
        message = (errors[-1] if errors else lines[-1] if lines else "")[:300]
        _OUTCOMES["<collection>"] = {"outcome": "error", "when": "collect", "message": message}


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("DLGS_SUBSTITUTE_OUT")
    if out:
        rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump(_OUTCOMES, f, indent=1)
