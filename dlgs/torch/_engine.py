"""Glue between torch parameters, Horovod's collectives and the core exchange.

Shared by both drop-in forms (:class:`dlgs.torch.Compression` and
:func:`dlgs.torch.DistributedOptimizer`).
"""

from __future__ import annotations

import atexit
import logging
import pickle
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import horovod.torch as hvd
import torch

from .._horovod import HorovodSet
from ..core._checks import check_int
from ..core.config import SparsityConfig
from ..core.engine import Engine
from ..core.planning.online import OnlinePlanner
from ._common import build_flat_or_two_level, named_trainable

__all__ = [
    "HorovodCollectives",
    "HorovodNodeCollectives",
    "build_engine",
    "check_topology",
    "named_trainable",
    "node_and_cross_sets",
]

#: Values of ``topology``.
TOPOLOGIES = ("flat", "hierarchical", "auto")

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

    def alltoall_async(self, tensor, name):
        """Equal blocks of a 1-D tensor to every rank (``transport="reduce"``)."""
        return _AllToAll(hvd.alltoall_async(tensor, name=name, process_set=self.process_set))

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

    def reducescatter_async(self, tensor, name):
        return hvd.reducescatter_async(
            tensor, name=name, op=hvd.Average, process_set=self.process_set
        )

    def allgather_async(self, tensor, name):
        return hvd.allgather_async(tensor, name=name, process_set=self.process_set)

    def allreduce_async(self, tensor, name):
        return hvd.allreduce_async(tensor, name=name, op=hvd.Average, process_set=self.process_set)

    def synchronize(self, handle):
        return hvd.synchronize(handle)

    def poll(self, handle):
        return hvd.poll(handle)


def check_topology(topology: Any, ranks_per_node: Any) -> None:
    """``ValueError``/``TypeError`` naming the option, before anything runs."""
    if topology not in TOPOLOGIES:
        raise ValueError(
            f"topology must be one of {', '.join(map(repr, TOPOLOGIES))}, got {topology!r}"
        )
    check_int("ranks_per_node", ranks_per_node, 2, none_ok=True)
    if ranks_per_node is not None and topology == "flat":
        raise ValueError(
            f"ranks_per_node={ranks_per_node!r} applies to topology='hierarchical' or 'auto' "
            "only; with topology='flat' (the default) leave it unset"
        )


def node_and_cross_sets(ranks_per_node: Optional[int]) -> Tuple[Any, Any]:
    """This rank's node and cross-node process sets, added to Horovod (a
    collective: every rank adds every set, in the same order).

    Nodes are ``ranks_per_node`` consecutive ranks, or Horovod's own
    (``hvd.local_size()``; ranks must then be laid out node by node, as
    horovodrun lays them out). Needs dynamic process sets
    (``hvd.init(process_sets="dynamic")`` or ``HOROVOD_DYNAMIC_PROCESS_SETS=1``)."""
    size, rank = hvd.size(), hvd.rank()
    local = ranks_per_node or hvd.local_size()
    if local < 2 or size % local or size // local < 2:
        raise ValueError(
            f"topology='hierarchical' needs at least 2 nodes of at least 2 ranks each, "
            f"the same number on every node: {size} ranks with {local} per node "
            "(give ranks_per_node, or use topology='flat')"
        )
    if ranks_per_node is None:
        # One small gather: every rank where Horovod's node layout says it is.
        here = (hvd.local_rank(), hvd.local_size(), hvd.cross_rank())
        laid = hvd.allgather_object((rank, here), name="dlgs.topology")
        bad = [r for r, (lr, ls, cr) in laid if ls != local or r != cr * local + lr]
        if bad:
            raise ValueError(
                f"topology='hierarchical': ranks {bad[:5]} are not laid out node by node "
                f"({local} per node as Horovod's local_size says); give ranks_per_node"
            )
    nodes = [list(range(n * local, (n + 1) * local)) for n in range(size // local)]
    crosses = [list(range(j, size, local)) for j in range(local)]
    node_sets = [_process_set(ranks) for ranks in nodes]
    cross_sets = [_process_set(ranks) for ranks in crosses]
    return node_sets[rank // local], cross_sets[rank % local]


#: The process sets dlgs added, by their ranks: a second two-level optimizer
#: (another model, or one built again) reuses them, as Horovod refuses to add
#: a set twice. Every rank builds its optimizers in the same order, so every
#: rank finds the same sets here.
_PROCESS_SETS: Dict[Tuple[int, ...], Any] = {}


def _process_set(ranks: List[int]) -> Any:
    """The process set of ``ranks`` that dlgs added before and Horovod still
    holds, or a new one (a collective: every rank adds every set, in order)."""
    known = _PROCESS_SETS.get(tuple(ranks))
    if known is not None and known.process_set_id is not None:  # not removed since
        return known
    try:
        added = hvd.add_process_set(ranks)
    except ValueError as err:
        if "HOROVOD_DYNAMIC_PROCESS_SETS" in str(err):
            raise ValueError(
                "topology='hierarchical' adds a process set per node and per local rank: "
                "start Horovod with hvd.init(process_sets='dynamic') (or set "
                "HOROVOD_DYNAMIC_PROCESS_SETS=1 before hvd.init())"
            ) from None
        if "duplicate" in str(err):
            raise ValueError(
                f"topology='hierarchical' adds the process set of ranks {ranks}, which exists "
                "already (added by the script, or at hvd.init(process_sets=...)): leave "
                "dlgs's node and cross-node sets to dlgs"
            ) from None
        raise
    _PROCESS_SETS[tuple(ranks)] = added
    return added


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
        topology=_two_levels(topology, ranks_per_node),
        choose_topology=topology == "auto",
        **kwargs,
    )


def _two_levels(topology: str, ranks_per_node: Optional[int]):
    """The engine's ``topology``: None (flat), or what makes the node and
    cross-node collectives; ``"auto"`` makes them where Horovod sees several
    ranks per node and several nodes (or ``ranks_per_node`` says so), and the
    engine then times both exchanges and keeps the faster."""
    if topology == "auto":
        local = ranks_per_node or hvd.local_size()
        several = local >= 2 and hvd.size() % local == 0 and hvd.size() // local >= 2
        topology = "hierarchical" if several else "flat"
    if topology == "flat":
        return None

    def make():
        node, cross = node_and_cross_sets(ranks_per_node)
        _wait_for_every_rank_at_exit()
        return HorovodNodeCollectives(node), HorovodCollectives(process_set=cross)

    return make


_EXIT_BARRIER: List[bool] = []

#: How long the exit barrier waits for the other ranks (seconds): longer than
#: any one step's last node collectives, so a normal exit never cuts it short.
EXIT_BARRIER_SECONDS = 120.0


def _failing() -> bool:
    """Whether this interpreter is exiting on an uncaught exception (Python
    sets ``sys.last_value`` before it runs the ``atexit`` handlers)."""
    return (
        getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None
    )


def _wait_for_every_rank_at_exit() -> None:
    """A step's last collectives run within each node, so one node can finish
    its last step and exit while another still completes its own; Horovod
    then shuts down under it ("Horovod has been shut down"). At a normal
    exit, before Horovod's own shutdown (atexit runs last-registered first),
    every rank waits for the others in one tiny allreduce.

    A rank that exits on an uncaught exception must not wait: the others are
    blocked in a collective it will never join, and only its Horovod shutting
    down ends them (with ``HorovodInternalError``, within a fraction of a
    second; issue 42). Where Horovod is down already (a rank failed, or the
    script shut it down) there is nothing to wait for; and the wait is bounded
    (:data:`EXIT_BARRIER_SECONDS`) for a rank that ends with ``sys.exit(1)``
    while another never comes."""
    if _EXIT_BARRIER:
        return
    _EXIT_BARRIER.append(True)

    def barrier() -> None:
        if _failing():
            logger.debug("dlgs: no exit barrier (this rank is exiting on an exception)")
            return
        try:
            handle = hvd.allreduce_async(torch.zeros(1), name="dlgs.exit", op=hvd.Sum)
            deadline = time.monotonic() + EXIT_BARRIER_SECONDS
            while not hvd.poll(handle):
                if time.monotonic() > deadline:
                    logger.warning(
                        "dlgs: the other ranks did not reach exit within %.0f s; exiting",
                        EXIT_BARRIER_SECONDS,
                    )
                    return
                time.sleep(0.005)
            hvd.synchronize(handle)
        except Exception:  # noqa: BLE001 - Horovod down or not initialised: nothing to wait for
            logger.debug("dlgs: no exit barrier (Horovod is shut down)")

    atexit.register(barrier)
