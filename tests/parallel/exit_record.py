"""The fault workers' exit record (fault_worker.py, leave_worker.py): import
it before Horovod, so that its handler runs after Horovod's shutdown (exit
handlers run last-registered first); :func:`set_rank` once the rank is known.
It writes ``OUT/exit{rank}.json`` with the time the interpreter reached it."""

import atexit
import json
import time

_where = {}


def set_rank(out, rank: int) -> None:
    _where.update(out=out, rank=rank)


def _record_exit():
    if _where:
        with open(f"{_where['out']}/exit{_where['rank']}.json", "w") as f:
            json.dump({"time": time.time()}, f)


atexit.register(_record_exit)
