"""Glue between torch parameters, Horovod's collectives and the core exchange.

Shared by both drop-in forms (:class:`dlgs.torch.Compression` and
:func:`dlgs.torch.DistributedOptimizer`).
"""

from __future__ import annotations

import logging
import pickle
from typing import Any, List, Optional, Sequence, Tuple

import horovod.torch as hvd
import torch

from .._horovod import HorovodSet, explained, two_levels
from ..core.config import SparsityConfig
from ..core.engine import Engine
from ..core.planning.online import OnlinePlanner
from ._common import build_flat_or_two_level, named_trainable

__all__ = [
    "HorovodCollectives",
    "HorovodNodeCollectives",
    "build_engine",
    "named_trainable",
]

logger = logging.getLogger(__name__)

# Horovod's allreduce rejects these dtypes (docs/design.md, Horovod facts); they travel as float32.
_WIRE_UNSUPPORTED = (torch.bfloat16,)


class HorovodCollectives(HorovodSet):
    """:class:`dlgs.core.exchange.exchange.Collectives` on ``horovod.torch``, on
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

    @explained
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

    @explained
    def allgather_async(self, chunk, name):
        return hvd.allgather_async(chunk, name=name, process_set=self.process_set)

    @explained
    def alltoall_async(self, tensor, name):
        """Equal blocks of a 1-D tensor to every rank (``transport="reduce"``)."""
        return _AllToAll(hvd.alltoall_async(tensor, name=name, process_set=self.process_set))

    @explained
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

    @explained
    def synchronize(self, handle):
        if isinstance(handle, _AllToAll):
            return hvd.synchronize(handle.handle)[0]  # (output, received splits)
        if isinstance(handle, tuple):
            handle, ctx = handle
            return self.compression.decompress(hvd.synchronize(handle), ctx)
        return hvd.synchronize(handle)


class _AllToAll:
    """An alltoall's Horovod handle (its result is a pair)."""

    __slots__ = ("handle",)

    def __init__(self, handle):
        self.handle = handle


class HorovodNodeCollectives:
    """:class:`dlgs.core.transport.hierarchical.NodeCollectives` on ``horovod.torch``:
    the reduce-scatter (average) and allgather among one node's ranks."""

    def __init__(self, process_set):
        self.process_set = process_set
        self.size = process_set.size()
        self.rank = process_set.rank()

    @explained
    def reducescatter_async(self, tensor, name):
        return hvd.reducescatter_async(
            tensor, name=name, op=hvd.Average, process_set=self.process_set
        )

    @explained
    def allgather_async(self, tensor, name):
        return hvd.allgather_async(tensor, name=name, process_set=self.process_set)

    @explained
    def allreduce_async(self, tensor, name):
        return hvd.allreduce_async(tensor, name=name, op=hvd.Average, process_set=self.process_set)

    @explained
    def synchronize(self, handle):
        return hvd.synchronize(handle)

    def poll(self, handle):
        return hvd.poll(handle)


def build_engine(
    params: Sequence[Tuple[str, torch.Tensor]],
    config: SparsityConfig,
    planner: Optional[OnlinePlanner],
    comm: HorovodCollectives,
    *,
    topology: str = "flat",
    ranks_per_node: Optional[int] = None,
    **kwargs: Any,
) -> Engine:
    """:func:`dlgs.torch._common.build_flat_or_two_level` on Horovod: ``topology`` and
    ``ranks_per_node`` as the forms take them."""
    return build_flat_or_two_level(
        params,
        config,
        planner,
        comm,
        topology=two_levels(hvd, topology, ranks_per_node, _node_and_cross),
        choose_topology=topology == "auto",
        **kwargs,
    )


def _node_and_cross(node, cross):
    """The two-level exchange's collectives on its Horovod process sets."""
    return HorovodNodeCollectives(node), HorovodCollectives(process_set=cross)
