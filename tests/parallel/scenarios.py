"""The registry and entry point shared by the multi-rank test workers
(``worker.py`` for PyTorch, ``tf_worker.py`` for TensorFlow).

A worker registers functions with :func:`scenario`; ``python WORKER OUT NAME...``
runs the named ones on every rank and writes ``OUT/rank{r}.json`` with each
one's return value or traceback, which ``tests/conftest.py`` reads back.
"""

from __future__ import annotations

import faulthandler
import json
import os
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, Sequence

SCENARIOS: Dict[str, Callable[[], object]] = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def main(argv: Sequence[str], hvd) -> None:
    """Run the scenarios named in ``argv[2:]`` with ``hvd`` (a Horovod framework module)."""
    out_dir = Path(argv[1])
    hang = int(os.environ.get("DLGS_TEST_HANG_S", "0"))
    if hang:  # the launcher kills us soon after: show where every thread waits
        faulthandler.dump_traceback_later(hang, exit=True)
    hvd.init()
    launched = os.environ.get("DLGS_TEST_LAUNCHED_AT")
    if launched:  # the launch's start-up on this rank: processes, imports, hvd.init
        startup = round(time.time() - float(launched), 2)
        (out_dir / f"startup{hvd.rank()}.json").write_text(json.dumps(startup))
    results = {}
    for name in argv[2:]:
        began = time.perf_counter()
        try:
            results[name] = {"ok": True, "value": SCENARIOS[name]()}
        except Exception:  # recorded for the pytest side, which reports it
            results[name] = {"ok": False, "error": traceback.format_exc()}
        # Where a launch's time goes (the suite's time budget).
        results[name]["seconds"] = round(time.perf_counter() - began, 2)
    (out_dir / f"rank{hvd.rank()}.json").write_text(json.dumps(results))
