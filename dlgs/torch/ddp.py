"""``dlgs.torch.ddp``: the same sparse exchange as a communication hook of
``torch.nn.parallel.DistributedDataParallel``, on ``torch.distributed`` (no
Horovod). One changed line after DDP is built::

    model = DDP(model)
    model.register_comm_hook(dlgs.torch.ddp.SparseState(model, density=0.01),
                             dlgs.torch.ddp.sparse_hook)

Every parameter is one layer of the core's exchange, whatever DDP's buckets
hold: each bucket's hook hands its parameters' gradients to the exchange (which
selects, packs and starts each planned message as soon as its members are in),
and the last bucket's hook completes the step and resolves every bucket's
future. State is kept by parameter, never by bucket index, so DDP's rebuilt
buckets after the first iteration change nothing. See docs/ddp.md.
"""

# No ``from __future__ import annotations``: DDP compares the hook's
# annotations with the real classes (``dist.GradBucket``, ``Future[Tensor]``).
import atexit
import gc
import logging
import os
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .._options import build_configs, check_log_every, check_topology
from ..core.config import SparsityConfig
from ..core.engine import Engine
from ..core.transport.topology import node_ranks, several_nodes, strays
from ._amp import check_scaler
from ._common import build_flat_or_two_level, copy_back, named_trainable

__all__ = ["ProcessGroupCollectives", "ProcessGroupNodeCollectives", "SparseState", "sparse_hook"]

logger = logging.getLogger(__name__)


#: ``all_gather_single`` where PyTorch has it (``all_gather_into_tensor``, its
#: older name, warns there as deprecated).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Work:
    """A started collective: its work handle, its output and how to finish it."""

    __slots__ = ("work", "out", "into")

    def __init__(self, work: Any, out: torch.Tensor, into: Any = None):
        self.work, self.out, self.into = work, out, into


class ProcessGroupCollectives:
    """:class:`dlgs.core.exchange.exchange.Collectives` on a ``torch.distributed``
    process group (Gloo on CPU, NCCL on GPU). Dense allreduces average (a
    division by the group's size, then a sum: what DDP itself computes).
    ``torch.distributed`` matches collectives by the order they are issued,
    not by name: every rank issues the same ones in the same order (the core
    does), and ``name`` only labels them."""

    def __init__(self, group: Any = None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.included = self.rank >= 0

    def allgather_async(self, chunk: torch.Tensor, name: str) -> _Work:
        chunk = chunk.contiguous()
        out = chunk.new_empty(self.size * chunk.numel())
        work = _ALL_GATHER(out, chunk, group=self.group, async_op=True)
        return _Work(work, out)

    def alltoall_async(self, tensor: torch.Tensor, name: str) -> _Work:
        """Equal blocks of a 1-D tensor to every rank (``transport="reduce"``)."""
        tensor = tensor.contiguous()
        out = torch.empty_like(tensor)
        work = dist.all_to_all_single(out, tensor, group=self.group, async_op=True)
        return _Work(work, out)

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> _Work:
        # Divided first, then summed: what DDP computes (bit for bit), and no
        # overflow of half-precision sums; in place, as Horovod's allreduce.
        wire = tensor if tensor.is_contiguous() else tensor.contiguous()
        wire.div_(self.size)
        work = dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return _Work(work, wire, into=tensor if wire is not tensor else None)

    def synchronize(self, handle: _Work) -> torch.Tensor:
        handle.work.wait()
        out = handle.out
        if handle.into is not None:
            handle.into.copy_(out)
            return handle.into
        return out

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        out: List[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def options(self) -> Dict[str, Any]:
        """What every rank must agree on: the backend and the group's ranks."""
        return {
            "backend": str(dist.get_backend(self.group)),
            "ranks": list(dist.get_process_group_ranks(self.group or dist.group.WORLD)),
            "op": "Average",
        }


class ProcessGroupNodeCollectives(ProcessGroupCollectives):
    """:class:`dlgs.core.transport.hierarchical.NodeCollectives` on one node's
    ``torch.distributed`` group: the reduce-scatter averages as the allreduce
    does (divided first, then summed), dividing its input in place (the
    two-level exchange's bucket, rewritten every step)."""

    def reducescatter_async(self, tensor: torch.Tensor, name: str) -> _Work:
        wire = tensor if tensor.is_contiguous() else tensor.contiguous()
        wire.div_(self.size)
        out = wire.new_empty(wire.numel() // self.size)
        work = dist.reduce_scatter_tensor(
            out, wire, op=dist.ReduceOp.SUM, group=self.group, async_op=True
        )
        return _Work(work, out)

    def poll(self, handle: _Work) -> bool:
        return bool(handle.work.is_completed())


def _two_levels(
    comm: ProcessGroupCollectives, topology: str, ranks_per_node: Optional[int]
) -> Optional[Callable[[], Tuple[Any, Any]]]:
    """The engine's ``topology`` for the DDP hook: None (flat), or what makes
    the node and cross-node groups (every rank makes every group, in order).
    Nodes are ``ranks_per_node`` consecutive ranks, or torchrun's
    (``LOCAL_WORLD_SIZE``; ranks laid out node by node, as torchrun does)."""
    if topology == "flat":
        return None
    size = comm.size
    if comm.options()["ranks"] != list(range(dist.get_world_size())):
        raise ValueError(
            f"topology={topology!r} exchanges among every rank of the job: use DDP's "
            "default process group (or topology='flat' with a process_group)"
        )
    local = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if topology == "auto" and not several_nodes(size, local):
        return None  # one node, or the nodes unknown: flat
    if not local:
        raise ValueError(
            "topology='hierarchical': give ranks_per_node (LOCAL_WORLD_SIZE is not set: "
            "not launched by torchrun)"
        )

    def make() -> Tuple[Any, Any]:
        nodes, crosses = node_ranks(size, local)
        if ranks_per_node is None:
            here = tuple(
                int(os.environ.get(k, "-1"))
                for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
            )
            bad = strays(comm.allgather_object((comm.rank, here), "dlgs.topology"), local)
            if bad:
                raise ValueError(
                    f"topology='hierarchical': ranks {bad[:5]} are not laid out node by node "
                    f"({local} per node as torchrun's LOCAL_WORLD_SIZE says); give ranks_per_node"
                )
        backend = dist.get_backend(comm.group)
        node = [dist.new_group(r, backend=backend) for r in nodes][comm.rank // local]
        cross = [dist.new_group(r, backend=backend) for r in crosses][comm.rank % local]
        return ProcessGroupNodeCollectives(node), ProcessGroupCollectives(cross)

    return make


def _ddp_parameters(model: Any) -> List[Tuple[str, torch.nn.Parameter]]:
    """DDP's own list: the wrapped module's parameters that require grad and
    that DDP does not ignore, in registration order."""
    ignored = set(getattr(model, "parameters_to_ignore", ()) or ())
    return named_trainable((n, p) for n, p in model.module.named_parameters() if n not in ignored)


class SparseState:
    """The state of :func:`sparse_hook` for one DDP model: the core engine
    (residuals, controllers, plan) over the model's parameters.

    Build it on every rank after the model is wrapped (a collective: every
    rank's parameters and options are checked, and dlgs makes its own process
    group, so that its collectives never interleave with DDP's own).

    Args:
        model: the ``DistributedDataParallel`` module.
        density / config / merge / log_every / **options: as
            :func:`dlgs.torch.DistributedOptimizer` (see :class:`dlgs.SparsityConfig`
            and :class:`dlgs.MergeConfig` for what each trades).
        scaler: the ``torch.amp.GradScaler`` of a mixed-precision loop, so that
            residuals stay in unscaled units; a step non-finite on some rank
            reads NaN on every rank, so ``scaler.step`` skips it everywhere.
        process_group: the ranks to exchange among (None: DDP's, i.e. the
            default group); dlgs issues its collectives on a new group of the
            same ranks.
        topology / ranks_per_node: as :func:`dlgs.torch.DistributedOptimizer`,
            on ``torch.distributed`` groups that dlgs makes (one per node and one
            per local rank); nodes are torchrun's (``LOCAL_WORLD_SIZE``) unless
            ``ranks_per_node`` says. Needs DDP's default process group.

    Raises:
        ValueError / TypeError: bad options, naming the option and the
            accepted range, or a model that is not DDP.
        RuntimeError: ``torch.distributed`` is not initialised.
        dlgs.RankMismatchError: ranks have different parameters or options.

    Checkpoints: :meth:`state_dict` is this rank's (residuals are rank-local:
    save one per rank, as with the Horovod forms); :meth:`load_state_dict`
    issues no collective. Pickling (DDP pickles its hooks' states, as
    PowerSGD's) keeps the options and the checkpoint and drops the model, the
    group and the engine: after unpickling, :meth:`bind` the state to the
    model again (a collective), then register the hook.
    """

    def __init__(
        self,
        model: Any,
        density: Optional[Union[float, str]] = None,
        *,
        config: Optional[SparsityConfig] = None,
        merge: Any = "dp",
        log_every: int = 0,
        scaler: Optional[Any] = None,
        process_group: Any = None,
        topology: str = "flat",
        ranks_per_node: Optional[int] = None,
        **options: Any,
    ):
        check_log_every(log_every)
        check_scaler(scaler)
        check_topology(topology, ranks_per_node)
        # Every option checked before anything.
        build_configs(config, density, merge, options, door="the DDP hook")
        self._kwargs: Dict[str, Any] = dict(
            density=density, config=config, merge=merge, log_every=log_every, **options
        )
        self._topology = (topology, ranks_per_node)
        self._scaler = scaler
        self._had_scaler = False
        self._saved: Optional[Dict[str, Any]] = None
        self._unbind()
        self.bind(model, process_group)

    def _unbind(self) -> None:
        self.engine: Optional[Engine] = None
        self._index: Dict[int, int] = {}
        self._pending: List[Tuple[torch.futures.Future, torch.Tensor, List[Tuple[int, Any]]]] = []

    def bind(self, model: Any, process_group: Any = None, scaler: Any = None) -> "SparseState":
        """Build the engine over ``model``'s parameters (a collective: every
        rank, same order), loading what an unpickled state carried. Once per
        state; an unpickled state that had a ``scaler`` needs it again."""
        if self.engine is not None:
            raise RuntimeError(
                "this SparseState is bound to a model already: build a new one for another"
            )
        if scaler is not None:
            check_scaler(scaler)
            self._scaler = scaler
        if self._had_scaler and self._scaler is None:
            raise ValueError(
                "scaler is required: this state was saved from a loop with a GradScaler "
                "(residuals are kept in unscaled units); bind(model, scaler=scaler)"
            )
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(
                f"model must be a torch.nn.parallel.DistributedDataParallel, got "
                f"{type(model).__name__} (wrap the model in DDP first)"
            )
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call dist.init_process_group() "
                "(torchrun sets up its environment) before building the SparseState"
            )
        group = process_group if process_group is not None else model.process_group
        ranks = dist.get_process_group_ranks(group)
        # Only the group's ranks make it (a subgroup, or several DDP groups).
        own = dist.new_group(ranks, backend=dist.get_backend(group), use_local_synchronization=True)
        kwargs = dict(self._kwargs)
        log_every = kwargs.pop("log_every")
        config, planner = build_configs(
            kwargs.pop("config"), kwargs.pop("density"), kwargs.pop("merge"), kwargs
        )
        params = _ddp_parameters(model)
        comm = ProcessGroupCollectives(own)
        topology, ranks_per_node = self._topology
        self.engine = build_flat_or_two_level(
            params,
            config,
            planner,
            comm,
            average=True,
            prefix="dlgs.ddp",
            extra_options={"form": "ddp", "topology": [topology, ranks_per_node]},
            log_every=log_every,
            scaler=self._scaler,
            topology=_two_levels(comm, topology, ranks_per_node),
            choose_topology=topology == "auto",
        )
        exchange = self.engine.exchange
        assert exchange is not None
        by_name = dict(params)
        self._index = {id(by_name[layer.name]): i for i, layer in enumerate(exchange.layers)}
        if self._saved is not None:
            self.engine.load_state_dict(self._saved)
            self._saved = None
        _release_at_exit(self)
        return self

    def _release(self) -> None:
        """Drop the engine and with it dlgs' process group (at interpreter exit)."""
        self.engine, self._index, self._pending = None, {}, []

    @property
    def dlgs(self) -> Engine:
        """dlgs' side of the hook: ``stats()``, ``planner``, ``reprofile()``,
        ``describe()``, ``last_step_finite`` (:class:`dlgs.core.engine.Engine`)."""
        if self.engine is None:
            raise RuntimeError("this SparseState was unpickled: bind(model) it first")
        return self.engine

    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals, controllers, step and plan (no collective)."""
        if self.engine is None:
            return dict(self._saved or {})
        return self.engine.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (no collective: safe on one rank; the
        ranks agree on the step and plan at the next step)."""
        if self.engine is None:
            self._saved = dict(state)
            return
        self.engine.load_state_dict(state)

    def __getstate__(self) -> Dict[str, Any]:
        return {
            "kwargs": self._kwargs,
            "saved": self.state_dict(),
            "had_scaler": self._scaler is not None,
            "topology": self._topology,
        }

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self._kwargs = state["kwargs"]
        self._saved = state["saved"] or None
        self._scaler = None
        self._had_scaler = bool(state.get("had_scaler"))
        self._topology = tuple(state.get("topology", ("flat", None)))
        self._unbind()

    # -- the hook ---------------------------------------------------------------------
    def bucket(self, bucket: Any) -> torch.futures.Future:
        """One DDP bucket (what :func:`sparse_hook` calls): its gradients go
        into the exchange; the last bucket of the step completes it."""
        if self.engine is None:
            raise RuntimeError("this SparseState was unpickled: bind(model) it before training")
        if isinstance(bucket, tuple):
            raise RuntimeError("dlgs' DDP hook needs DDP's C++ reducer, not the Python one")
        exchange = self.engine.exchange
        assert exchange is not None
        buffer = bucket.buffer()
        if buffer.is_sparse:
            raise RuntimeError("dlgs' DDP hook does not take sparse gradients (sparse=True)")
        devices = [buffer.device] if buffer.is_cuda else None
        future: torch.futures.Future = torch.futures.Future(devices=devices)
        entries = []
        self._pending.append((future, buffer, entries))
        try:
            for p, grad in zip(bucket.parameters(), bucket.gradients()):
                i = self._index.get(id(p))
                if i is None:
                    raise RuntimeError(
                        f"DDP's bucket holds a parameter of shape {tuple(p.shape)} that this "
                        "SparseState was not built over: build it from this DDP model"
                    )
                exchange.submit(i, grad)
                entries.append((i, grad))
            if bucket.is_last():
                self._finish()
        except BaseException as err:
            # This rank's step is over: every bucket's future fails (DDP
            # raises it from backward) and the exchange starts the next step clean.
            pending, self._pending = self._pending, []
            for waiting, _, _ in pending:
                if not waiting.done():
                    waiting.set_exception(err)
            exchange.abort_step()
            raise
        return future

    def _finish(self) -> None:
        exchange = self.engine.exchange  # type: ignore[union-attr]
        assert exchange is not None
        missing = exchange.pending()
        if missing:
            names = [exchange.layers[i].name for i in missing[:5]]
            raise RuntimeError(f"DDP's buckets did not hold every parameter: {names}")
        reduced = self.engine.complete(None)  # type: ignore[union-attr]
        for future, buffer, entries in self._pending:
            for i, grad in entries:
                copy_back(grad, reduced[i])
            future.set_result(buffer)
        self._pending.clear()
        self.engine.step_done()  # type: ignore[union-attr]


def _release_at_exit(state: SparseState) -> None:
    """Free ``state``'s engine while the interpreter is still whole. dlgs'
    process group would otherwise be destroyed during interpreter
    finalization, with the DDP model that holds the state, where Gloo's worker
    threads may still hold work whose tensors need the GIL, and the process
    aborts ("terminate called without an active exception"; pytorch/pytorch
    PR 179291 describes it)."""
    ref = weakref.ref(state)

    def release() -> None:
        found = ref()
        if found is not None:
            found._release()  # noqa: SLF001 - this module's own state
            gc.collect()  # the engine's cycles, so the group goes now

    atexit.register(release)


def sparse_hook(state: SparseState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: ``model.register_comm_hook(state, sparse_hook)``."""
    return state.bucket(bucket)
