"""The PyTorch DDP methods of the training benchmark (``python -m benchmarks.train``).

The ranks Horovod's launcher (or ``benchmarks.cluster``) started also join one
``torch.distributed`` Gloo group, so DDP and the Horovod forms run side by
side in one run, interleaved in rounds, on the same links. Methods:

* ``ddp``: ``DistributedDataParallel`` with its built-in allreduce;
* ``ddp-fp16``: PyTorch's ``fp16_compress_hook``;
* ``ddp-powersgd1`` / ``ddp-powersgd4``: PyTorch's PowerSGD hook at rank 1 / 4
  (error feedback, warm start; compressed from the second step, so the warm-up
  covers the switch), with the whole model in one DDP bucket: its hook issues
  collectives from future callbacks, which on Gloo run in a different order
  on each rank when several buckets are in flight (pytorch/pytorch#58467);
* ``ddp-dlgs-none`` / ``ddp-dlgs``: ``dlgs.torch.ddp``'s hook, layer-wise / with
  the DP merge plan.

Horovod stays initialised (and idle) while a DDP method runs.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

import dlgs.torch.ddp

__all__ = [
    "SPECS",
    "build_ddp",
    "close_torch_distributed",
    "init_torch_distributed",
    "powersgd_bytes",
    "powersgd_ddp",
    "wire_bytes",
]

#: Each of ``benchmarks.report.DDP_METHODS``: the dlgs merge strategy (None:
#: not dlgs) and PowerSGD's rank (0: not PowerSGD).
SPECS: Dict[str, Tuple[Optional[str], int]] = {
    "ddp": (None, 0),
    "ddp-fp16": (None, 0),
    "ddp-powersgd1": (None, 1),
    "ddp-powersgd4": (None, 4),
    "ddp-dlgs-none": ("none", 0),
    "ddp-dlgs": ("dp", 0),
}


def init_torch_distributed(rank: int, size: int, broadcast_object: Any) -> None:
    """Join every rank to one Gloo group: on ``benchmarks.cluster`` from the
    ``MASTER_ADDR`` / ``GLOO_SOCKET_IFNAME`` it sets; under plain horovodrun
    on loopback (rank 0 picks the port and Horovod tells the others)."""
    if dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ:
        port = _free_port() if rank == 0 else None
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(broadcast_object(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)


def close_torch_distributed() -> None:
    """Leave the Gloo group together (a rank that exits first would make the
    other's Gloo threads abort)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def powersgd_ddp(model: nn.Module, rank: int) -> Tuple[DDP, Any]:
    """``model`` in DDP with PyTorch's PowerSGD hook at ``rank`` (error
    feedback, warm start, compressing from the second step) and its state.

    One bucket: PowerSGD's hook issues collectives from its futures'
    callbacks, which on Gloo run in a different order on each rank when
    several buckets are in flight (a collective mismatch, or a hang;
    pytorch/pytorch#58467). An explicit cap also sizes the first bucket."""
    megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    ddp = DDP(model, bucket_cap_mb=megabytes + 1)
    state = powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2
    )
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    return ddp, state


def powersgd_bytes(model: nn.Module, rank: int) -> int:
    """Bytes PowerSGD at ``rank`` sends per step: the P and Q factors of each
    matrix it compresses (shape ``(rows, rest)``, compressed where
    ``2 * rank * (rows + rest) < rows * rest``, its ``min_compression_rate``)
    and 4 per other parameter."""
    total = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        rows = p.shape[0] if p.dim() > 1 else p.numel()
        rest = p.numel() // rows
        small = rank * (rows + rest)
        total += 4 * (small if p.dim() > 1 and 2 * small < rows * rest else p.numel())
    return total


def build_ddp(
    method: str,
    model: nn.Module,
    density: float,
    profile_steps: int,
    lr: float,
    wire: Optional[Dict[str, str]] = None,
    bucket_mb: Optional[float] = None,
) -> Tuple[DDP, torch.optim.Optimizer, Any]:
    """``model`` in DDP (``bucket_cap_mb=bucket_mb``; None: DDP's default)
    with ``method``'s hook, plain SGD over it, and the hook's state (None for
    plain DDP and fp16)."""
    merge, rank = SPECS[method]
    state: Any = None
    if rank:
        ddp, state = powersgd_ddp(model, rank)
    else:
        ddp = DDP(model) if bucket_mb is None else DDP(model, bucket_cap_mb=bucket_mb)
    if method == "ddp-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif merge is not None:
        state = dlgs.torch.ddp.SparseState(
            ddp,
            density=density,
            merge=merge,
            profile_steps=profile_steps,
            **(wire or {}),
        )
        ddp.register_comm_hook(state, dlgs.torch.ddp.sparse_hook)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.0), state


def wire_bytes(method: str, model: nn.Module) -> int:
    """Bytes one rank contributes per step with a DDP method that is not
    dlgs's (whose exchange says: ``.dlgs.exchange.wire_bytes()``): DDP 4 per
    parameter, fp16 2, PowerSGD :func:`powersgd_bytes`."""
    rank = SPECS[method][1]
    if rank:
        return powersgd_bytes(model, rank)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (2 if method == "ddp-fp16" else 4) * params
