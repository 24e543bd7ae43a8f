"""``dlgs.torch.DistributedOptimizer``: Horovod's optimizer, sparse inside.

Mirrors :func:`horovod.torch.DistributedOptimizer` (same positional arguments
and defaults) and adds the dlgs options as keywords, so switching is one line::

    opt = dlgs.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                          density=0.01)

The class is built like Horovod builds its own: a new class deriving from the
user's optimizer class whose dict is Horovod's ``_DistributedOptimizer`` dict
with a few methods replaced (subclassing Horovod's result would recurse through
its ``super(self.__class__, self)`` calls). Every gradient hook hands the
gradient to the core exchange, which sparsifies it and starts the merge group's
allgather while back-propagation continues.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional, Union

import horovod.torch as hvd
import torch
from horovod.torch.optimizer import _DistributedOptimizer
from torch.autograd import Variable

from .._horovod import check_dense_dtype, check_two_level_set, methods_of
from .._options import (
    build_configs,
    check_int,
    check_log_every,
    check_no_groups,
    check_op,
    check_predivide,
    check_topology,
    horovod_scales,
)
from ..core.config import SparsityConfig
from ..core.engine import Engine
from ._amp import check_scaler
from ._common import copy_back
from ._engine import HorovodCollectives, build_engine, named_trainable

__all__ = ["DistributedOptimizer"]

logger = logging.getLogger(__name__)

# Horovod's own warning, word for word (its tests match on it).
_STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your "
    "code."
)


class _SparseOverrides:
    """Methods that replace Horovod's in the generated optimizer class."""

    def __init__(
        self,
        params,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        sparse_as_dense,
        process_set,
        dlgs_config,
        log_every,
        planner,
        scaler,
        topology="flat",
        ranks_per_node=None,
    ):
        self._dlgs_config = dlgs_config
        self._dlgs_topology = (topology, ranks_per_node)
        self._dlgs_planner = planner
        self._dlgs_log_every = log_every
        self._dlgs_scaler = scaler
        self._dlgs = None
        self._dlgs_open = False  # a step's first gradient has been submitted
        # The exchange was completed at the end of backward (scaler given):
        # synchronize() and step() do not exchange again until the next backward.
        self._dlgs_synced = False
        _DistributedOptimizer.__init__(
            self,
            params,
            named_parameters,
            compression,
            backward_passes_per_step,
            op,
            gradient_predivide_factor,
            None,
            sparse_as_dense,
            process_set,
        )
        if self._dlgs is None:  # size 1: Horovod registers no hooks
            self._dlgs_build()

    def _dlgs_build(self) -> None:
        params = named_trainable(
            (self._parameter_names[p], p) for group in self.param_groups for p in group["params"]
        )
        average = self.op == hvd.Average
        prescale, postscale = horovod_scales(average, self.gradient_predivide_factor)
        comm = HorovodCollectives(self.op, prescale, postscale, self.process_set, self._compression)
        self._dlgs_engine = build_engine(
            params,
            self._dlgs_config,
            self._dlgs_planner,
            comm,
            average=average,
            prefix="dlgs",
            extra_options={
                "backward_passes_per_step": self.backward_passes_per_step,
                "topology": list(self._dlgs_topology),
            },
            log_every=self._dlgs_log_every,
            scaler=self._dlgs_scaler,
            topology=self._dlgs_topology[0],
            ranks_per_node=self._dlgs_topology[1],
        )
        self._dlgs = self._dlgs_engine.exchange
        by_name = dict(params)
        self._dlgs_params = [by_name[layer.name] for layer in self._dlgs.layers]
        self._dlgs_index = {p: i for i, p in enumerate(self._dlgs_params)}

    def _register_hooks(self):
        self._dlgs_build()
        for p in self._dlgs_params:
            self._requires_update.add(p)
            grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
            grad_acc.register_hook(self._make_hook(p))
            self._grad_accs.append(grad_acc)

    def _make_hook(self, p):
        index = self._dlgs_index[p]

        def hook(*_):
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate "
                    "gradients locally."
                )
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                if not self._dlgs_open:
                    self._dlgs_open = True
                    self._dlgs_synced = False
                    # A new backward: whatever synchronize() completed before
                    # (even a step the loop skipped) no longer stands for it.
                    self._synchronized = False
                    if self._dlgs_scaler is not None:
                        # With a loss scaler the exchange completes when
                        # back-propagation ends, so that the scaler's own
                        # inf check (plain ``scaler.step(opt)``) reads the
                        # averaged gradients and decides the same on every rank.
                        # autograd's end-of-backward callback, as DDP's reducer uses it.
                        engine = Variable._execution_engine  # noqa: SLF001
                        engine.queue_callback(self._dlgs_backward_done)
                try:
                    self._dlgs.submit(index, _grad(p))
                except BaseException:
                    self._dlgs_abort()
                    raise
                self._handles[p] = index

        return hook

    def synchronize(self):
        # The collectives' own flag: ProcessSet.included() asks whichever
        # Horovod framework library was imported last (horovod.common.process_sets
        # keeps one module-global handle), wrong when horovod.tensorflow is
        # imported beside horovod.torch; the global set always includes us.
        if not self._dlgs.comm.included:
            self._synchronized = True
            return
        if self._dlgs_synced:
            return  # completed at the end of backward (with a loss scaler)
        try:
            reduced = self._dlgs_engine.complete(self._dlgs_grad)
        except BaseException:
            # A rank failed (HorovodInternalError) or the step was refused: the
            # step is dropped (Horovod Elastic's restore starts clean).
            self._dlgs_abort()
            raise
        for i, out in reduced.items():
            copy_back(self._dlgs_params[i].grad, out)
        self._dlgs_end_step()
        self._synchronized = True
        self._dlgs_engine.step_done()

    def _dlgs_grad(self, i: int) -> torch.Tensor:
        return _grad(self._dlgs_params[i])

    def _dlgs_end_step(self) -> None:
        """This optimizer's part of a step, ended (completed or dropped)."""
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._handles.clear()
        self._dlgs_open = False

    def _dlgs_abort(self) -> None:
        """Drop the step under way (the exchange's and this optimizer's part)."""
        self._dlgs.abort_step()
        self._dlgs_end_step()
        self._dlgs_synced = False

    def _dlgs_backward_done(self) -> None:
        self.synchronize()
        self._dlgs_synced = True

    def step(self, closure=None):
        # Horovod's step() synchronises again after a manual synchronize(),
        # with a warning; dlgs gives the same warning but exchanges once per
        # step (a second sparse exchange of the averaged gradients would not
        # be idempotent). With a loss scaler the exchange completed at the end
        # of backward: the plain ``scaler.step(opt)`` is the documented pattern.
        if self._should_synchronize:
            if self._dlgs_open or not self._synchronized:
                self.synchronize()
            elif not self._dlgs_synced:
                warnings.warn(_STEP_AFTER_SYNCHRONIZE, stacklevel=2)
        self._synchronized = False
        self._dlgs_synced = False
        return super(self.__class__, self).step(closure)

    @property
    def dlgs(self) -> Engine:
        """dlgs' side of this optimizer: ``stats()``, ``planner``,
        ``reprofile()``, ``last_step_finite``, ``exchange``
        (:class:`dlgs.core.engine.Engine`); its state is saved in
        ``state_dict()["dlgs"]``."""
        return self._dlgs_engine

    def state_dict(self):
        state = super(self.__class__, self).state_dict()
        state["dlgs"] = self._dlgs_engine.state_dict()
        return state

    def load_state_dict(self, state_dict):
        # dlgs' part is validated before anything is loaded.
        state, dlgs_state = self._dlgs_engine.split_checkpoint(state_dict)
        _DistributedOptimizer.load_state_dict(self, state)
        if dlgs_state is not None:
            self._dlgs_engine.load_state_dict(dlgs_state)


def _grad(p: torch.Tensor) -> torch.Tensor:
    if p.grad is None:
        # Another rank may have a gradient here (dynamic graphs): take part
        # with zeros, as Horovod does.
        p.grad = torch.zeros_like(p)
    return p.grad.to_dense() if p.grad.is_sparse else p.grad


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters=None,
    compression=hvd.Compression.none,
    backward_passes_per_step: int = 1,
    op=hvd.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups=None,
    sparse_as_dense: bool = False,
    process_set=hvd.global_process_set,
    *,
    density: Optional[Union[float, str]] = None,
    config: Optional[SparsityConfig] = None,
    merge: Any = "dp",
    log_every: int = 0,
    scaler: Optional[Any] = None,
    topology: str = "flat",
    ranks_per_node: Optional[int] = None,
    **options: Any,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so gradients are exchanged sparsely across Horovod ranks.

    The positional arguments are :func:`horovod.torch.DistributedOptimizer`'s.
    ``compression`` applies to the layers sent dense (e.g. ``hvd.Compression.fp16``).

    Args:
        density: fraction of each sparsified layer sent per step, in (0, 1]
            (default 0.01; give either ``density`` or ``config``), or ``"auto"``:
            chosen by the merge planner (:class:`dlgs.SparsityConfig`).
            See :class:`dlgs.SparsityConfig` for what it trades.
        config: a ready :class:`dlgs.SparsityConfig` instead of keyword options.
        merge: how layers are merged into messages: ``"dp"`` (default: time a
            few steps, then the plan that minimises the predicted iteration end,
            each message sparse or dense), ``"none"`` (layer-wise, no
            profiling), ``"all"``, ``"buckets"`` or ``"greedy"``; or a ready
            :class:`dlgs.MergeConfig`. Its other fields (``profile_steps``,
            ``bucket_elements``, ``max_group``, ``drift_tolerance``,
            ``drift_window``, ``refine``, ``guard``, ``profile_budget``) are keyword options,
            documented once in :class:`dlgs.MergeConfig`. See docs/planning.md.
        log_every: log per-layer statistics to the ``dlgs.torch`` logger every
            this many steps (0: never). Each log synchronises the device once.
        scaler: the ``torch.amp.GradScaler`` of a mixed-precision loop (None:
            no loss scaling). dlgs reads its scale each step so that residuals
            stay in unscaled units, and completes the exchange at the end of
            backward, so both Horovod's AMP pattern (``opt.synchronize();
            scaler.unscale_(opt); with opt.skip_synchronize(): scaler.step(opt)``)
            and the plain ``scaler.step(opt)`` skip the same steps on every rank.
            Without it, a loss-scaled loop mixes scales in the residuals.
        topology: ``"flat"`` (default): every rank allgathers every other
            rank's selection. ``"hierarchical"``: a dense reduce-scatter inside
            each node, the sparse exchange of each rank's shard between nodes,
            a dense allgather inside the node: each node's link carries one
            selection instead of one per rank, at the price of two dense
            collectives on the fast links (per 16 MiB bucket of layers).
            Needs Horovod's dynamic process sets
            (``hvd.init(process_sets="dynamic")``), ``op=hvd.Average`` and the
            global process set. ``"auto"``: where Horovod sees several ranks
            per node and several nodes, both exchanges' collectives for this
            model are timed once at construction and the faster is kept
            (``.dlgs.describe()`` says which and why). At ``density=1.0``
            every layer is dense and goes through Horovod's own allreduce
            (flat) whatever this says. See docs/design.md, "Topology".
        ranks_per_node: with ``topology``: ranks per node (consecutive ranks
            form a node); None: Horovod's ``local_size()``.
        **options: any :class:`dlgs.MergeConfig` field but ``strategy``, and any
            other :class:`dlgs.SparsityConfig` field (``controller``,
            ``max_ratio``, ``min_sparse_size``, ``anchor_every``, ``momentum``,
            ``warmup``, ``warmup_steps``, ``value_dtype``, ...).

    Raises:
        ValueError / TypeError: bad options (naming the option and the accepted
            range), an unsupported ``op``, or Horovod's ``groups``.
        dlgs.RankMismatchError: ranks have different parameters or options.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    check_op(op, hvd.Average, hvd.Sum)
    check_no_groups(num_groups, groups)
    check_int("backward_passes_per_step", backward_passes_per_step, 1)
    check_predivide(gradient_predivide_factor, op, hvd.Average)
    check_log_every(log_every)
    check_scaler(scaler)
    check_topology(topology, ranks_per_node)
    check_two_level_set(hvd, topology, op, process_set)
    cfg, planner = build_configs(config, density, merge, options)
    check_dense_dtype(cfg, "dlgs.torch.DistributedOptimizer")
    if not cfg.auto and cfg.density == 1.0 and not cfg.warmup:
        topology = "flat"  # every layer dense: Horovod's own allreduce, bit for bit
    methods = methods_of(_SparseOverrides)
    cls = type(
        optimizer.__class__.__name__,
        (optimizer.__class__,),
        {**_DistributedOptimizer.__dict__, **methods},
    )
    named = list(named_parameters) if named_parameters is not None else None
    return cls(
        optimizer.param_groups,
        named,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        sparse_as_dense,
        process_set,
        cfg,
        log_every,
        planner,
        scaler,
        topology,
        ranks_per_node,
    )
