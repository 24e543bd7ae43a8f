"""Glue between torch parameters, Horovod's collectives and the core exchange.

Shared by both drop-in forms (:class:`dlgs.torch.Compression` and
:func:`dlgs.torch.DistributedOptimizer`).
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import horovod.torch as hvd
import torch

from .._horovod import HorovodSet
from .._options import warn_float64
from ..core.config import SparsityConfig
from ..core.engine import Engine, check_unique_names
from ..core.profiler import OnlinePlanner
from ._amp import scale_reader
from ._ops import OPS

__all__ = ["HorovodCollectives", "build_engine", "named_trainable"]

logger = logging.getLogger("dlgs.torch")

# Horovod's allreduce rejects these dtypes (docs/design.md, Horovod facts); they travel as float32.
_WIRE_UNSUPPORTED = (torch.bfloat16,)


class HorovodCollectives(HorovodSet):
    """:class:`dlgs.core.exchange.Collectives` on ``horovod.torch``, on
    ``process_set`` (see :class:`dlgs._horovod.HorovodSet`), including the
    object collectives (Horovod 0.28.1's torch ``allgather_object`` has no
    ``process_set``, so :meth:`allgather_object` is built from two allgathers).
    """

    hvd = hvd

    def __init__(
        self,
        op=hvd.Average,
        prescale_factor=1.0,
        postscale_factor=1.0,
        process_set=hvd.global_process_set,
        compression=hvd.Compression.none,
    ):
        super().__init__(op, prescale_factor, postscale_factor, process_set, compression)

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every rank's ``obj`` (picklable), in the set's rank order."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=4)), dtype=torch.uint8)
        sizes = hvd.allgather(
            torch.tensor([data.numel()], dtype=torch.int32),
            name=f"{name}.sz",
            process_set=self.process_set,
        )
        gathered = hvd.allgather(data, name=f"{name}.t", process_set=self.process_set).numpy()
        out, start = [], 0
        for n in sizes.tolist():
            out.append(pickle.loads(gathered[start : start + n].tobytes()))
            start += n
        return out

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
    check_unique_names("parameter", [n for n, _ in pairs])
    for name, p in pairs:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"named_parameters[{name!r}] is a {type(p).__name__}, not a tensor")
    trainable = [(n, p) for n, p in pairs if p.requires_grad]
    for name, p in trainable:
        # Refused here, by name: a complex gradient would fail deep inside the
        # selection kernels with no hint of which parameter it was (issue 10).
        if not p.is_floating_point():
            raise TypeError(
                f"parameter {name!r} has dtype {p.dtype}: dlgs exchanges real floating-point "
                "gradients only (float32, float16, bfloat16 or float64)"
            )
    warn_float64("parameters", [n for n, p in trainable if p.dtype == torch.float64], logger)
    return trainable


def build_engine(
    params: Sequence[Tuple[str, torch.Tensor]],
    config: SparsityConfig,
    planner: Optional[OnlinePlanner],
    comm: HorovodCollectives,
    *,
    average: bool,
    prefix: str,
    dense_external: bool = False,
    extra_options: Optional[Dict[str, Any]] = None,
    log_every: int = 0,
    scaler: Any = None,
) -> Engine:
    """The core :class:`~dlgs.core.engine.Engine` over ``params`` (trainable,
    in registration order), built: every rank's parameters and options checked."""
    engine = Engine(
        OPS,
        comm,
        config,
        planner,
        average=average,
        prefix=prefix,
        dense_external=dense_external,
        extra_options=extra_options,
        log_every=log_every,
        loss_scale=scale_reader(scaler),
        logger=logger,
    )
    device = params[0][1].device if params else torch.device("cpu")
    engine.build(
        [(n, p.shape, str(p.dtype)) for n, p in params],
        like=params[-1][1] if params else None,
        clock=_clock(device),
    )
    return engine


def _clock(device: torch.device):
    """Seconds, after the current stream has finished its queued work (profiling
    only). The current stream, not the device: a device-wide synchronisation
    would also wait for Horovod's NCCL stream and count collectives in flight
    as back-propagation time."""
    if device.type == "cuda":

        def clock() -> float:
            torch.cuda.current_stream(device).synchronize()
            return time.perf_counter()

        return clock
    return time.perf_counter
