"""Ranks as threads of one process: collectives without a network (pure Python).

:class:`InProcessWorld` runs one function per rank, each in its own thread (as
each rank runs in its own process under horovodrun), and lets them meet in
collectives by name: :meth:`InProcessWorld.meet` posts a rank's part and
returns a combination of every rank's parts, in rank order. A collective that
not every rank reaches fails after a timeout, naming the missing ranks,
instead of hanging. It knows nothing of arrays: an adapter's collectives
(the self-check's torch ones, the tests' NumPy ones) pass in how to combine.

Used by ``python -m dlgs.selfcheck`` (torch, no Horovod) and the core's tests.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Sequence

import numpy as np

__all__ = ["InProcessWorld", "sent_values"]


class _Meeting:
    """One collective: every rank posts its part, everyone gets the result."""

    def __init__(self):
        self.name = ""
        self.parts: Dict[int, Any] = {}
        self.result: Any = None
        self.done = threading.Event()


class InProcessWorld:
    """``size`` ranks in one process; :meth:`run` runs a function on each, in threads.

    Args:
        size: number of ranks.
        timeout: seconds a collective waits for the other ranks before failing.
    """

    def __init__(self, size: int, timeout: float = 10.0):
        self.size = size
        self.timeout = timeout
        self._lock = threading.Lock()
        self._meetings: Dict[str, _Meeting] = {}
        self._counts: Dict[tuple, int] = {}

    def meet(self, rank: int, name: str, part: Any, combine: Callable[[List[Any]], Any]) -> Any:
        """Post ``part`` under ``name`` and return ``combine(parts in rank order)``
        (computed once, by the last rank to arrive)."""
        return self.collect(self.post(rank, name, part, combine))

    def post(self, rank: int, name: str, part: Any, combine: Callable[[List[Any]], Any]) -> Any:
        """:meth:`meet`'s first half, never blocking: post ``part`` and return
        the meeting, for :meth:`collect` (and :meth:`done`)."""
        with self._lock:
            # The n-th use of a name by a rank meets the n-th use by the others.
            n = self._counts.get((rank, name), 0)
            self._counts[(rank, name)] = n + 1
            key = f"{name}#{n}"
            meeting = self._meetings.setdefault(key, _Meeting())
            meeting.name = key
            meeting.parts[rank] = part
            if len(meeting.parts) == self.size:
                meeting.result = combine([meeting.parts[r] for r in range(self.size)])
                meeting.done.set()
                del self._meetings[key]  # every rank holds the meeting already
        return meeting

    @staticmethod
    def done(meeting: Any) -> bool:
        """Whether every rank has posted to ``meeting``."""
        return meeting.done.is_set()

    def collect(self, meeting: Any) -> Any:
        """Wait for every rank's part of a :meth:`post`; the combined result."""
        if not meeting.done.wait(self.timeout):
            missing = sorted(set(range(self.size)) - set(meeting.parts))
            raise TimeoutError(
                f"collective {meeting.name!r}: ranks {missing} never joined (a hang)"
            )
        return meeting.result

    def run(self, fn: Callable[[int], Any]) -> List[Any]:
        """``fn(rank)`` on every rank concurrently; each rank's result (an
        exception raised on a rank is re-raised here, naming the rank)."""
        results: List[Any] = [None] * self.size
        errors: List[Any] = [None] * self.size

        def body(r):
            try:
                results[r] = fn(r)
            except BaseException as err:  # reported below, naming the rank
                errors[r] = err

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r, err in enumerate(errors):
            if err is not None:
                raise RuntimeError(f"rank {r} raised {type(err).__name__}: {err}") from err
        return results

    def run_steps(
        self,
        make: Callable[[int], Any],
        grads: Callable[[int, int], Sequence[Any]],
        steps: int,
        record: Callable[[int, Any, Dict[int, Any]], Any],
    ) -> List[List[Any]]:
        """On every rank: an exchange from ``make(rank)``, ``steps`` steps
        submitting ``grads(rank, step)`` (one flat tensor per layer, in layer
        order), and ``record(rank, exchange, outputs)`` after each wait. Each
        rank's records."""

        def body(rank):
            ex = make(rank)
            out = []
            for s in range(steps):
                for i, g in enumerate(grads(rank, s)):
                    ex.submit(i, g)
                out.append(record(rank, ex, ex.wait()))
            return out

        return InProcessWorld.run(self, body)  # not a subclass's run(fn(rank, comm))


def sent_values(ex: Any) -> Dict[int, np.ndarray]:
    """What this rank of exchange ``ex`` sent in its last step, per sparse
    layer (float64, the layer's size), decoded from its own send buffers by the
    reference decoder on the host: what error feedback must account for (sent
    + residual = accumulated input). For checks, not the hot path."""
    sent = {}
    for group in ex.groups:
        if group.sparse:
            lay = group.layout
            dense = np.zeros(lay.dense_size, np.float64)
            vals, idx, _ = lay.decode(np.asarray(ex.ops.to_host(group.chunk), np.int32))
            np.add.at(dense, idx, vals)
            for m, i in enumerate(group.members):
                start = lay.dense_offset(m)
                sent[i] = dense[start : start + lay.sizes[m]]
    return sent
