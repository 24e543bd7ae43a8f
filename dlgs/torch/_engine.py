"""Glue between torch parameters, Horovod's collectives and the core exchange.

Shared by both drop-in forms (:class:`dlgs.torch.Compression` and
:func:`dlgs.torch.DistributedOptimizer`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import horovod.torch as hvd
import torch

from .._options import build_config, build_planner
from ..core.config import SparsityConfig
from ..core.consistency import RankMismatchError, describe_mismatch, signature
from ..core.exchange import SparseExchange
from ..core.exchange import log_stats as core_log_stats
from ..core.profiler import OnlinePlanner
from ._ops import OPS

__all__ = [
    "HorovodCollectives",
    "build_config",
    "build_exchange",
    "build_planner",
    "named_trainable",
]

logger = logging.getLogger("dlgs.torch")

# Horovod's allreduce rejects these dtypes (DESIGN.md §2); they travel as float32.
_WIRE_UNSUPPORTED = (torch.bfloat16,)


class HorovodCollectives:
    """:class:`dlgs.core.exchange.Collectives` on ``horovod.torch``.

    Args:
        op: ``hvd.Average`` or ``hvd.Sum`` (for the dense allreduces).
        prescale_factor / postscale_factor: as Horovod's allreduce.
        process_set: Horovod process set.
        compression: Horovod compression for dense layers (e.g. ``hvd.Compression.fp16``).
    """

    def __init__(
        self,
        op=hvd.Average,
        prescale_factor=1.0,
        postscale_factor=1.0,
        process_set=hvd.global_process_set,
        compression=hvd.Compression.none,
    ):
        self.op = op
        self.prescale_factor = prescale_factor
        self.postscale_factor = postscale_factor
        self.process_set = process_set
        self.compression = compression
        self.size = process_set.size() if process_set is not hvd.global_process_set else hvd.size()
        self.rank = process_set.rank() if process_set is not hvd.global_process_set else hvd.rank()

    def allgather_async(self, chunk, name):
        return hvd.allgather_async(chunk, name=name, process_set=self.process_set)

    def allreduce_async(self, tensor, name):
        wire = tensor.float() if tensor.dtype in _WIRE_UNSUPPORTED else tensor
        wire, ctx = self.compression.compress(wire)
        handle = hvd.allreduce_async_(
            wire,
            name=name,
            op=self.op,
            prescale_factor=self.prescale_factor,
            postscale_factor=self.postscale_factor,
            process_set=self.process_set,
        )
        return handle, ctx

    def broadcast_object(self, obj):
        root = 0 if self.process_set is hvd.global_process_set else self.process_set.ranks[0]
        return hvd.broadcast_object(
            obj, root_rank=root, name="dlgs.broadcast", process_set=self.process_set
        )

    def synchronize(self, handle):
        if isinstance(handle, tuple):
            handle, ctx = handle
            return self.compression.decompress(hvd.synchronize(handle), ctx)
        return hvd.synchronize(handle)


def named_trainable(
    named_parameters: Iterable[Tuple[str, torch.Tensor]],
) -> List[Tuple[str, torch.Tensor]]:
    """Validated ``(name, parameter)`` pairs that require grad, in the given order."""
    if named_parameters is None:
        raise ValueError("named_parameters is required: pass model.named_parameters()")
    pairs = list(named_parameters)
    if any(not (isinstance(p, tuple) and len(p) == 2) for p in pairs):
        raise ValueError(
            "named_parameters should be a sequence of (name, parameter) tuples, "
            "usually produced by model.named_parameters()"
        )
    names = [n for n, _ in pairs]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"parameter names in named_parameters must be unique, duplicates: {dups}")
    for name, p in pairs:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"named_parameters[{name!r}] is a {type(p).__name__}, not a tensor")
    return [(n, p) for n, p in pairs if p.requires_grad]


def check_ranks_agree(comm: HorovodCollectives, sig: Dict[str, Any]) -> None:
    """Gather every rank's signature and raise the same error on all of them if
    they differ (never a hang: every rank takes part in the one allgather)."""
    if comm.size <= 1:
        return
    if comm.process_set is hvd.global_process_set:
        problem = describe_mismatch(hvd.allgather_object(sig, name="dlgs.signature"))
    else:
        # allgather_object has no process_set in Horovod 0.28.1: compare with the
        # set's first rank, then agree on the verdict so every member raises.
        root = comm.process_set.ranks[0]
        ref = hvd.broadcast_object(
            sig, root_rank=root, name="dlgs.signature", process_set=comm.process_set
        )
        problem = describe_mismatch([ref, sig])
        flag = torch.tensor([1 if problem else 0], dtype=torch.int32)
        if (
            hvd.allreduce(
                flag, op=hvd.Sum, name="dlgs.signature.flag", process_set=comm.process_set
            ).item()
            and not problem
        ):
            problem = "another rank of the process set has a different model or dlgs options"
    if problem:
        raise RankMismatchError(problem)


def build_exchange(
    params: Sequence[Tuple[str, torch.Tensor]],
    config: SparsityConfig,
    comm: HorovodCollectives,
    *,
    average: bool,
    prefix: str,
    dense_external: bool = False,
    merge: Optional[OnlinePlanner] = None,
    extra_options: Optional[Dict[str, Any]] = None,
) -> SparseExchange:
    """A :class:`SparseExchange` over ``params`` (already filtered to trainable),
    in backward order (reverse of registration), after checking every rank
    agrees; ``merge`` (an :class:`OnlinePlanner`) profiles and plans messages."""
    ordered = list(reversed(params))
    options = dict(config.to_dict(), average=average, **(extra_options or {}))
    if merge is not None:
        options.update(merge=merge.strategy, profile_steps=merge.profile_steps)
    check_ranks_agree(comm, signature([(n, p.shape, str(p.dtype)) for n, p in ordered], options))
    device = ordered[0][1].device if ordered else torch.device("cpu")
    exchange = SparseExchange(
        OPS,
        comm,
        config,
        [(n, p.numel()) for n, p in ordered],
        average=average,
        prefix=prefix,
        dense_external=dense_external,
        clock=_clock(device),
    )
    if merge is not None:
        exchange.step_hooks.append(merge)
    return exchange


def _clock(device: torch.device):
    """Seconds, after the device has finished its queued work (profiling only)."""
    if device.type == "cuda":

        def clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return clock
    return time.perf_counter


def log_stats(exchange: SparseExchange, level: int = logging.INFO) -> List[Dict[str, Any]]:
    """Per-layer statistics of the last step, also written to the ``dlgs.torch`` logger."""
    return core_log_stats(exchange, logger, level)
