"""``dlgs.torch.Compression``: sparse exchange through stock Horovod's
``compression=`` argument.

Horovod's compressor interface is ``compress(t) -> (t_c, ctx)`` and
``decompress(t_c, ctx) -> t`` around an in-place allreduce of ``t_c``. A
compressor cannot change the collective, so this one runs the real sparse
exchange beside it (docs/design.md, Horovod facts): ``compress`` hands the gradient to the core
exchange, which starts the allgather of values and indices from inside
Horovod's gradient hook, and returns a one-element tensor holding ``1.0`` for
Horovod to allreduce. ``synchronize()`` calls every ``compress`` before any
``decompress``; the first ``decompress`` of a step waits for the exchange, and
each returns its layer's reduced gradient multiplied by the allreduced dummy,
which is ``1`` under ``op=hvd.Average`` and the number of ranks under
``op=hvd.Sum``: the compressor follows the optimizer's op without being told.

Layers that the exchange sends dense go through Horovod's own allreduce
unchanged (``compress`` returns the gradient itself).
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Dict, List, Optional, Union

import horovod.torch as hvd
import torch

from .._horovod import check_dense_dtype, check_two_level_set
from .._options import build_configs, check_log_every, check_topology
from ..core.config import SparsityConfig
from ..core.engine import Engine
from ._amp import check_scaler
from ._engine import HorovodCollectives, build_engine, named_trainable

__all__ = ["Compression"]

logger = logging.getLogger(__name__)


class Compression:
    """A Horovod compressor that exchanges each layer's gradient sparsely.

    Args:
        named_parameters: the model's ``named_parameters()``; the same
            parameters the optimizer updates.
        density: fraction of each sparsified layer sent per step, in (0, 1]
            (default 0.01; give either ``density`` or ``config``), or ``"auto"``:
            chosen by the merge planner (:class:`dlgs.SparsityConfig`).
        config: a ready :class:`dlgs.SparsityConfig` instead of keyword options.
        merge: the merge plan, as in :func:`dlgs.torch.DistributedOptimizer`
            (its options are keyword options); in this form layers that
            go dense are allreduced by Horovod one by one (its fusion merges
            them), so only sparse messages follow the plan.
        process_set: the Horovod process set the optimizer uses (``attach`` refuses an
            optimizer on another set: its other ranks would never call ``compress``).
        topology, ranks_per_node: the two-level exchange, as in
            :func:`dlgs.torch.DistributedOptimizer`. With it every layer, dense
            ones too, goes through dlgs' exchange (Horovod allreduces only the
            one-element placeholders), since a dense layer is reduced inside
            the node and between nodes like the others.
        log_every: log per-layer statistics every this many steps (0: never).
        **options: other :class:`dlgs.SparsityConfig` and :class:`dlgs.MergeConfig`
            fields.

    Use with ``op=hvd.Average`` or ``hvd.Sum``; Horovod's ``groups=`` also works.
    """

    def __init__(
        self,
        named_parameters,
        density: Optional[Union[float, str]] = None,
        *,
        config: Optional[SparsityConfig] = None,
        merge: Any = "dp",
        process_set=hvd.global_process_set,
        log_every: int = 0,
        scaler: Optional[Any] = None,
        topology: str = "flat",
        ranks_per_node: Optional[int] = None,
        **options: Any,
    ):
        check_log_every(log_every)
        check_scaler(scaler)
        check_topology(topology, ranks_per_node)
        check_two_level_set(hvd, topology, process_set=process_set)  # op: the optimizer's
        cfg, planner = build_configs(config, density, merge, options, door="dlgs.torch.Compression")
        check_dense_dtype(cfg, "dlgs.torch.Compression")
        self._half = cfg.dense_dtype.value == "float16"
        params = named_trainable(named_parameters)
        if not params:
            raise ValueError("named_parameters contains no parameter that requires grad")
        self._engine = build_engine(
            params,
            cfg,
            planner,
            HorovodCollectives(process_set=process_set),
            average=True,
            prefix="dlgs.c",
            dense_external=True,
            log_every=log_every,
            scaler=scaler,
            topology=topology,
            ranks_per_node=ranks_per_node,
        )
        self._exchange = self._engine.exchange
        by_name = dict(params)
        self._params = [by_name[layer.name] for layer in self._exchange.layers]
        self._dummies = [torch.ones(1, device=p.device) for p in self._params]
        self._results: Optional[Dict[int, Any]] = None
        self._next = 0  # predicted index of the next gradient (backward order)
        # Dense layers' reduced tensors of this step (checked for non-finite
        # values before the exchange keeps its new state) and how many
        # decompress() calls are still to come.
        self._external: List[Any] = []
        self._left = 0
        # Whether the residuals reach a checkpoint: attach()ed to the optimizer,
        # or state_dict() called by the user; else one warning at the first step.
        self._saved_somehow = False
        self._set_checked = False  # the optimizer's process set is this one's

    @property
    def dlgs(self) -> Engine:
        """dlgs' side of this compressor: ``stats()``, ``planner``,
        ``reprofile()``, ``last_step_finite``, ``exchange``
        (:class:`dlgs.core.engine.Engine`); save :meth:`state_dict` beside the
        optimizer's."""
        return self._engine

    def _lookup(self, tensor: torch.Tensor) -> int:
        """Which parameter ``tensor`` is the gradient of: Horovod passes ``p.grad``
        itself. Gradients usually arrive in the same order every step, so the
        predicted one is checked first (O(1)); otherwise all are scanned."""
        n = len(self._params)
        guess = self._next % n
        if self._params[guess].grad is tensor:
            self._next = guess + 1
            return guess
        for i, p in enumerate(self._params):
            if p.grad is tensor:
                self._next = i + 1
                return i
        if not tensor.is_sparse:
            # sparse_as_dense=True: Horovod hands in p.grad.to_dense(), a new tensor.
            for i, p in enumerate(self._params):
                g = p.grad
                if g is not None and g.is_sparse and g.shape == tensor.shape:
                    self._next = i + 1
                    return i
        raise ValueError(
            "dlgs.torch.Compression was asked to compress a tensor that is not the .grad of any "
            "parameter it was given: pass the same named_parameters to it as to the optimizer "
            "(and do not use sparse_as_dense)"
        )

    def attach(self, optimizer: torch.optim.Optimizer) -> "Compression":
        """Fold this compressor's state into ``optimizer``'s checkpoints: from
        now on ``optimizer.state_dict()["dlgs"]`` holds the residuals,
        thresholds, step and plan, and ``optimizer.load_state_dict()`` restores
        them (no collective: safe on one rank, as in Horovod's resume recipe;
        the ranks agree at the next gradient). Call it once, with the
        ``hvd.DistributedOptimizer`` built with ``compression=self``; returns
        self."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self._check_process_set(optimizer)

        pending: List[Any] = []

        def save(opt, state):
            state["dlgs"] = self._engine.state_dict()
            return state

        def check(opt, state):
            # As the optimizer form: validate dlgs' part before anything loads,
            # apply it after the optimizer's own state has loaded.
            self._drop_failed_step()
            state, dlgs_state = self._engine.split_checkpoint(state)
            if dlgs_state is not None:
                pending.append(dlgs_state)
            return state

        def load(opt):
            while pending:
                self.load_state_dict(pending.pop())

        optimizer.register_state_dict_post_hook(save)
        optimizer.register_load_state_dict_pre_hook(check)
        optimizer.register_load_state_dict_post_hook(load)
        self._saved_somehow = True
        return self

    def _check_process_set(self, optimizer: Any) -> None:
        """The optimizer's ranks outside this compressor's set never call
        compress(): this compressor's collectives would wait for them forever.
        Refused on every rank that builds or steps such a pair, naming the
        argument to add."""
        theirs = getattr(optimizer, "process_set", None)
        mine = self._engine.comm.process_set
        if theirs is not None and _ranks(theirs) != _ranks(mine):
            raise ValueError(
                f"process_set: the optimizer reduces on ranks {_ranks(theirs)} but this "
                f"Compression on ranks {_ranks(mine)}; pass the optimizer's process_set to "
                "dlgs.torch.Compression(..., process_set=...) too"
            )
        self._set_checked = True

    def compress(self, tensor: torch.Tensor):
        if not self._set_checked:
            # Not attach()ed: the optimizer that calls us is found once, by
            # what holds this compressor (Horovod's keeps it as _compression),
            # so that a process set given to the optimizer alone is an error,
            # not a collective that the set's outsiders never join.
            for optimizer in _holders(self):
                self._check_process_set(optimizer)
            self._set_checked = True
        if not self._saved_somehow:
            self._saved_somehow = True
            log = logger.warning if self._engine.comm.rank <= 0 else logger.debug
            log(
                "dlgs.torch.Compression: the optimizer's state_dict() does not hold dlgs' "
                "residuals and thresholds, so a checkpoint of it alone resumes with them "
                "lost. Call compression.attach(optimizer) once to fold them in, or save "
                "compression.state_dict() beside it (one per rank)"
            )
        if self._results is not None:
            self._results = None  # a new step has begun
            self._finish()
        i = self._lookup(tensor)
        sent = self._exchange.submit(i, tensor)
        if sent is not None:
            # Dense layer: Horovod allreduces it (with any flushed residual
            # added): float16 with dense_dtype="float16", else bfloat16 as
            # float32 (Horovod has no bfloat16); decompress() casts it back.
            wire = sent
            if self._half and sent.dtype != torch.float16:
                wire = sent.half()
            elif sent.dtype == torch.bfloat16:
                wire = sent.float()
            return wire, ("dense", i, tensor)
        dummy = self._dummies[i].fill_(1.0)
        return dummy, ("sparse", i, tensor)

    def decompress(self, tensor: torch.Tensor, ctx):
        if ctx is None:
            return tensor
        if self._results is None:
            # First decompress of the step: every compress has run (Horovod's
            # synchronize() starts all before waiting on any).
            # Dense layers Horovod reduced end the step in _finish; an
            # exchange that reduces them itself ends its own.
            finish = not self._exchange.dense_external
            self._results = self._engine.complete(self._pending_grad, finish=finish)
            self._left = len(self._params)
            self._engine.step_done()
        _, i, grad = ctx
        if ctx[0] == "dense":
            factor = self._exchange.external_scale()
            # With momentum correction the reduced tensor is the layer's send
            # buffer, not its velocity, so p.grad may alias it.
            out = tensor * factor if factor is not None else tensor
            self._external.append((i, out))
        else:
            out = self._results[i] * tensor  # tensor is 1 (Average) or size (Sum)
        self._left -= 1
        if self._left == 0:
            self._finish()
        return out.reshape(grad.shape).to(grad.dtype)

    def _pending_grad(self, j: int) -> torch.Tensor:
        """A gradient Horovod did not hand to compress() (no gradient, or a
        sparse one, which Horovod reduces itself)."""
        p = self._params[j]
        if p.grad is None:
            return torch.zeros_like(p)
        if p.grad.is_sparse:
            raise ValueError(
                f"parameter {self._exchange.layers[j].name!r} has a sparse gradient, "
                "which Horovod reduces itself without calling compression=: pass "
                "sparse_as_dense=True to hvd.DistributedOptimizer, or use "
                "dlgs.torch.DistributedOptimizer"
            )
        return p.grad

    def _finish(self) -> None:
        """End the exchange's step once Horovod has handed back every tensor."""
        if self._exchange.in_step:
            self._exchange.finish(self._external)
        self._external = []
        self._left = 0

    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals and controller states (see ``docs/design.md``,
        "Checkpoints and residuals"); save it beside the optimizer's, or
        :meth:`attach` to the optimizer instead."""
        self._saved_somehow = True
        return self._engine.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` between steps. No collective: safe on one
        rank (see :meth:`dlgs.core.SparseExchange.load_state_dict`)."""
        self._drop_failed_step()
        self._engine.load_state_dict(state)
        self._results = None
        self._external = []
        self._left = 0

    def _drop_failed_step(self) -> None:
        """Under Horovod Elastic a load inside a step is the restore after a
        failure (Horovod's optimizer raised from its synchronize, between our
        compress and decompress calls): that step is dropped. Elsewhere a load
        inside a step stays an error."""
        if self._engine.elastic and self._exchange.in_step:
            self._exchange.abort_step()
            self._results, self._external, self._left = None, [], 0


def _holders(compression: Compression) -> List[torch.optim.Optimizer]:
    """The optimizers that hold ``compression`` as Horovod's optimizer holds its
    compressor (its ``_compression`` attribute), through the garbage
    collector's referrers: one scan, at the first step of an un-attached
    compressor."""
    found = []
    for holder in gc.get_referrers(compression):
        # Python 3.11 keeps an instance's attributes inline (the referrer is
        # the optimizer) until its __dict__ is asked for (then that dict).
        owners = [holder]
        if isinstance(holder, dict):
            owners = [o for o in gc.get_referrers(holder) if getattr(o, "__dict__", None) is holder]
        for owner in owners:
            if isinstance(owner, torch.optim.Optimizer):
                if getattr(owner, "_compression", None) is compression and owner not in found:
                    found.append(owner)
    return found


def _ranks(process_set) -> List[int]:
    """A Horovod process set's ranks (the global set's too)."""
    ranks = process_set.ranks
    return sorted(ranks) if ranks is not None else list(range(hvd.size()))
