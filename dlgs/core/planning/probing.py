"""The planner's probes: timed copies and collectives on the running job,
fitted into the costs it plans with (:mod:`~dlgs.core.planning.probefit`).

Every rank runs the same probes in the same order (each collective named by
its size), between steps, when :func:`~dlgs.core.planning.phases.decide` asks
for them (:class:`~dlgs.core.planning.phases.Probe`). What they cost (calls,
bytes, seconds) is added to the planner's ledger.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Dict, Optional, Sequence, Tuple

from .dp import CostModel
from .netmodel import allgather_cost, allreduce_cost
from .phases import BATCH, Probed, fit_or_flat
from .probefit import fit_probe, fit_warning

__all__ = ["Prober", "log_first_rank"]

# The planner's logger: what the probes log is the planner's to say.
logger = logging.getLogger("dlgs.core.planning.online")


def log_first_rank(ex: Any, msg: str, *args: Any, level: int = logging.INFO) -> None:
    """Log on the process set's first rank; the others log at DEBUG (every
    rank plans the same, so one line per job is enough)."""
    logger.log(level if ex.comm.rank <= 0 else logging.DEBUG, msg, *args)


class Prober:
    """Runs the probes of one planner.

    Args:
        probe_reps: timed repetitions of each probe (after one that negotiates).
        link_bandwidth: bit/s of the link the user named, or None: the prior
            of bytes the probes could not see.
        cost: the planner's ledger (``probes``, ``bytes``, ``probe_bytes``,
            ``probe_seconds``), added to in place.
    """

    def __init__(self, probe_reps: int, link_bandwidth: Optional[float], cost: Dict[str, Any]):
        self.probe_reps = probe_reps
        self.link_bandwidth = link_bandwidth
        self.cost = cost

    def probe(self, ex: Any, sizes: Sequence[int]) -> Probed:
        """Time copies and probe collectives of ``sizes`` bytes and fit them."""
        pack = self._probe_copy(ex)
        allgather, gather_by = self._probe(ex, "allgather", sizes)
        allreduce, reduce_by = self._probe(ex, "allreduce", sizes)
        return Probed(pack, allgather, allreduce, (gather_by, reduce_by))

    def _prior(self, kind: str, world_size: int) -> Optional[CostModel]:
        """A ring ``kind`` over the link the user named (``link_bandwidth``), or None."""
        if self.link_bandwidth is None or world_size < 2:
            return None
        cost = allgather_cost if kind == "allgather" else allreduce_cost
        return cost(world_size, self.link_bandwidth, 0.0)

    def _probe(self, ex: Any, kind: str, probes: Sequence[int]) -> Tuple[CostModel, str]:
        """The fitted cost of ``kind``, and what priced its bytes (``ProbeFit.priced_by``)."""
        ops, comm, clock = ex.ops, ex.comm, ex.clock
        like = ex.like
        sizes, repeats = [], []
        start = time.perf_counter()
        for nbytes in probes:
            words = nbytes // 4
            buf = ops.zeros(words, "int32" if kind == "allgather" else "float32", like)
            name = f"{ex.prefix}.probe.{kind}.{nbytes}"
            samples = []
            for _ in range(self.probe_reps + 1):  # the first one negotiates
                t0 = clock()
                if kind == "allgather":
                    comm.synchronize(comm.allgather_async(buf, name))
                else:
                    comm.synchronize(comm.allreduce_async(buf, name))
                samples.append(clock() - t0)
            self.cost["probes"] += self.probe_reps + 1
            self.cost["bytes"] += (self.probe_reps + 1) * words * 4
            self.cost["probe_bytes"] += (self.probe_reps + 1) * words * 4
            sizes.append(float(nbytes))
            repeats.append(samples[1:])
        fit = fit_probe(sizes, repeats, self._prior(kind, comm.size))
        times = [min(r) for r in repeats]
        batched = self._probe_batch(ex, kind, probes[0], times[0], fit.model)
        model = replace(fit.model, batched=batched)
        self.cost["probe_seconds"] += time.perf_counter() - start
        warning = fit_warning(kind, sizes, times, fit)
        if warning is not None:
            # The link the user named priced the bytes: as asked, no warning.
            level = logging.INFO if fit.priced_by == "link_bandwidth" else logging.WARNING
            log_first_rank(ex, "%s", warning, level=level)
        return model, fit.priced_by

    def _probe_batch(self, ex: Any, kind: str, nbytes: int, lone: float, model: CostModel) -> float:
        """The latency of a collective that joins a batch (``CostModel.batched``):
        :data:`BATCH` collectives of ``nbytes`` started at once take ``lone +
        (BATCH - 1) * (batched + beta * nbytes)``, where ``lone`` is one alone.
        Clipped to ``[0, alpha]``."""
        ops, comm, clock = ex.ops, ex.comm, ex.clock
        words = nbytes // 4
        dtype = "int32" if kind == "allgather" else "float32"
        bufs = [ops.zeros(words, dtype, ex.like) for _ in range(BATCH)]
        names = [f"{ex.prefix}.probe.{kind}.batch{j}.{nbytes}" for j in range(BATCH)]
        issue = comm.allgather_async if kind == "allgather" else comm.allreduce_async
        samples = []
        for _ in range(self.probe_reps + 1):  # the first one negotiates
            t0 = clock()
            for handle in [issue(buf, name) for buf, name in zip(bufs, names)]:
                comm.synchronize(handle)
            samples.append(clock() - t0)
        self.cost["probes"] += (self.probe_reps + 1) * BATCH
        self.cost["bytes"] += (self.probe_reps + 1) * BATCH * words * 4
        self.cost["probe_bytes"] += (self.probe_reps + 1) * BATCH * words * 4
        each = (min(samples[1:]) - lone) / (BATCH - 1) - model.beta * nbytes
        return min(model.alpha, max(0.0, each))

    def _probe_copy(self, ex: Any) -> CostModel:
        ops, clock = ex.ops, ex.clock
        biggest = max(layer.numel for layer in ex.layers)
        src = ops.zeros(biggest, "float32", ex.like)
        dst = ops.zeros(biggest, "float32", ex.like)
        sizes, times = [], []
        for n in sorted({max(1, biggest // 16), max(1, biggest // 4), biggest}):
            samples = []
            for _ in range(3):
                t0 = clock()
                ops.copy_(ops.narrow(dst, 0, 0, n), ops.narrow(src, 0, 0, n))
                samples.append(clock() - t0)
            sizes.append(float(n))
            times.append(min(samples))
        return fit_or_flat(sizes, times)
