"""What the torch forms share that needs torch only (no Horovod): the
validated parameters, the engine's construction and the profiling clock.
Horovod's forms (``_engine``) and the DDP hook (``ddp``) build on it."""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .._options import warn_float64
from ..core.config import SparsityConfig
from ..core.engine import Engine, check_unique_names
from ..core.planning.online import OnlinePlanner
from ._amp import scale_reader
from ._ops import OPS

__all__ = ["build_flat_or_two_level", "named_trainable"]

logger = logging.getLogger(__name__)


def copy_back(grad: torch.Tensor, out: torch.Tensor) -> None:
    """A layer's reduced gradient (flat) into the framework's gradient
    ``grad``, unless it is already there (the exchange reduced in place)."""
    if grad.is_sparse:
        grad.zero_().add_(out.reshape(grad.shape).to(grad.dtype).to_sparse())
    elif out.data_ptr() != grad.data_ptr() or out.dtype != grad.dtype:
        grad.copy_(out.reshape(grad.shape))


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
        # selection kernels with no hint of which parameter it was.
        if not p.is_floating_point():
            raise TypeError(
                f"parameter {name!r} has dtype {p.dtype}: dlgs exchanges real floating-point "
                "gradients only (float32, float16, bfloat16 or float64)"
            )
    warn_float64("parameters", [n for n, p in trainable if p.dtype == torch.float64], logger)
    return trainable


def build_flat_or_two_level(
    params: Sequence[Tuple[str, torch.Tensor]],
    config: SparsityConfig,
    planner: Optional[OnlinePlanner],
    comm: Any,
    *,
    average: bool,
    prefix: str,
    dense_external: bool = False,
    extra_options: Optional[Dict[str, Any]] = None,
    log_every: int = 0,
    scaler: Any = None,
    topology: Any = None,
    choose_topology: bool = False,
) -> Engine:
    """The core :class:`~dlgs.core.engine.Engine` over ``params`` (trainable,
    in registration order) on the collectives ``comm``, built: every rank's
    parameters and options checked (a collective). ``topology``: the engine's
    (None: flat; or what makes the node and cross-node collectives)."""
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
        topology=topology,
        choose_topology=choose_topology,
        # Set by horovodrun for hvd.elastic jobs.
        elastic=os.environ.get("HOROVOD_ELASTIC") == "1",
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
