"""``dlgs.tensorflow.keras.DistributedOptimizer``: a Keras 3 optimizer that
exchanges gradients sparsely before applying them, under ``model.fit`` too.

Horovod 0.28.1's ``horovod.tensorflow.keras.DistributedOptimizer`` overrides
Keras 2 hooks that Keras 3 no longer calls: ``fit`` runs without error and the
ranks silently diverge (docs/design.md, Horovod facts). Keras 3's ``fit`` (TensorFlow backend,
``keras/src/backend/tensorflow/trainer.py``) computes the gradients with a
``tf.GradientTape`` and calls ``optimizer.apply_gradients(zip(grads, vars))``,
which calls ``optimizer.apply(grads, vars)``; custom loops call either. This
wrapper builds, as Horovod does, a class deriving from the user's optimizer
class whose ``apply`` first exchanges the gradients through the dlgs core and
then calls the original ``apply``.

Inside ``fit``'s compiled train function the exchange runs as graph ops on
steps that need no host work, and through one ``tf.py_function`` on those that
do (profiling, planning, anchors, a new layout; docs/tensorflow.md); compile
with ``jit_compile=False`` (XLA cannot compile a ``py_function``; Keras only
picks XLA by itself on GPUs).
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Union

import horovod.tensorflow as hvd
import keras

from .. import _options
from ..core.config import SparsityConfig
from ._amp import scale_reader
from ._engine import (
    DlgsAccessors,
    Engine,
    HorovodCollectives,
    build_tf_configs,
    topology_options,
)
from .tape import _check_compression

__all__ = ["DistributedOptimizer"]

_LSO = keras.optimizers.LossScaleOptimizer

_WRAP_THE_SCALER = (
    "dlgs.tensorflow.keras.DistributedOptimizer must wrap the LossScaleOptimizer, not be "
    "wrapped by it: a LossScaleOptimizer checks each rank's own gradients for overflow and "
    "skips its inner optimizer's apply(), so a rank that overflowed would skip the exchange "
    "while the others wait for it. Write\n"
    "    opt = dlgs.tensorflow.keras.DistributedOptimizer(\n"
    "        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(...)), density=...)\n"
    "(model.compile() under the 'mixed_float16' policy wraps a plain optimizer in a "
    "LossScaleOptimizer by itself: pass it one that is already wrapped as above)"
)


class _SparseApply(DlgsAccessors):
    """Mixed in before the user's optimizer class."""

    def build(self, variables):
        # A LossScaleOptimizer builds its inner optimizer before any step, on
        # every rank (model.fit's symbolic build, or its first apply()), which
        # makes this the place to refuse being wrapped by one, before a step
        # can hang. Keras passes no reference to the outer optimizer, so look
        # for it among the callers (LossScaleOptimizer.build calls this directly).
        frame = sys._getframe(1)  # noqa: SLF001 - a stack walk, to go
        for _ in range(4):
            if frame is None:
                break
            caller = frame.f_locals.get("self")
            if isinstance(caller, _LSO) and caller is not self:
                if getattr(caller, "inner_optimizer", None) is self:
                    raise ValueError(_WRAP_THE_SCALER)
            frame = frame.f_back
        return super().build(variables)

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        variables = (
            list(trainable_variables)
            if trainable_variables is not None
            else list(getattr(self, "_trainable_variables", []))
        )
        if grads and variables:
            grads = self._dlgs_engine.exchange_gradients(grads, variables)
        return super().apply(grads, trainable_variables)


def DistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    name: Optional[str] = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression=hvd.Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op=hvd.Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups=None,
    process_set=hvd.global_process_set,
    scale_local_gradients: bool = True,
    *,
    density: Optional[Union[float, str]] = None,
    config: Optional[SparsityConfig] = None,
    merge: Any = "dp",
    log_every: int = 0,
    **options: Any,
) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so gradients are exchanged sparsely across ranks.

    The positional arguments are :func:`horovod.tensorflow.keras.DistributedOptimizer`'s.
    ``name`` is the prefix of the Horovod tensor names (default ``"dlgs.keras"``);
    ``compression`` applies to the layers sent dense. ``backward_passes_per_step``
    must be 1 (use Keras' own ``gradient_accumulation_steps``; the exchange then
    runs every micro-step), ``groups`` / ``num_groups`` are rejected (dlgs packs
    its own messages). ``scale_local_gradients`` has no effect (there are no
    local variables in this form).

    Mixed precision: wrap the ``keras.optimizers.LossScaleOptimizer``,
    ``DistributedOptimizer(keras.optimizers.LossScaleOptimizer(SGD(...)))``.
    The result is a ``LossScaleOptimizer`` (so ``model.compile`` under the
    ``"mixed_float16"`` policy does not wrap it again) whose ``apply`` exchanges
    the scaled gradients on every rank before the loss scaler's overflow check,
    with residuals kept in unscaled units; a step that overflowed on any rank is
    non-finite on every rank, so every rank skips it and dlgs' state is left as
    before it. The reverse nesting (which ``compile`` builds from a plain
    optimizer under ``"mixed_float16"``) raises ``ValueError`` at the first
    ``fit`` / ``apply``, saying what to write instead.

    Args:
        density, config, merge, log_every, **options: as
            :func:`dlgs.tensorflow.DistributedGradientTape`.

    Returns:
        A new optimizer of a class derived from ``optimizer``'s, built from its
        config (as Horovod does); its ``get_config()`` is the original's, and
        a saved model loads with the plain optimizer class.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"optimizer must be a keras.optimizers.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, _LSO) and isinstance(optimizer.inner_optimizer, _SparseApply):
        raise ValueError(_WRAP_THE_SCALER)
    _options.check_op(op, hvd.Average, hvd.Sum)
    _options.check_no_groups(num_groups, groups)
    _options.check_predivide(gradient_predivide_factor, op, hvd.Average)
    _options.check_log_every(log_every)
    _check_compression(compression)
    _options.check_int("backward_passes_per_step", backward_passes_per_step, 1)
    if backward_passes_per_step != 1:
        raise ValueError(
            "backward_passes_per_step must be 1 with Keras 3: use the optimizer's "
            "gradient_accumulation_steps instead"
        )
    prefix = "dlgs.keras" if name is None else name
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"name must be None or a non-empty str, got {name!r}")
    cfg, planner, topology = build_tf_configs(
        config, density, merge, options, door="dlgs.tensorflow.keras"
    )
    two_level = topology_options(topology, op, process_set)
    average = op == hvd.Average
    pre, post = _options.horovod_scales(average, gradient_predivide_factor)
    comm = HorovodCollectives(op, pre, post, process_set, compression, device_dense, device_sparse)
    base = optimizer.__class__
    # Same name and module as the user's class: get_config()/saving see the
    # plain optimizer, so a saved model loads without dlgs.
    cls = type(base.__name__, (_SparseApply, base), {"__module__": base.__module__})
    wrapped = cls.from_config(optimizer.get_config())
    # The factory initialises the instance it made (as Horovod's does).
    wrapped._dlgs_engine = Engine(  # noqa: SLF001
        cfg,
        planner,
        comm,
        average=average,
        prefix=prefix,
        log_every=log_every,
        loss_scale=scale_reader(wrapped) if isinstance(wrapped, _LSO) else None,
        **two_level,
    )
    return wrapped
