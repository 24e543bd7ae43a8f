"""``dlgs.tensorflow.Compression``: the sparse exchange through Horovod's own
``hvd.DistributedGradientTape(compression=...)``, where that path allows it.

What Horovod's TF path does with a compressor (``horovod/tensorflow/__init__.py``):

* ``_make_allreduce_grads_fn`` wraps the gradient reduction in a
  ``tf.function`` (also eagerly), so ``compress``/``decompress`` run once, at
  trace time, on symbolic tensors. Anything per-step must be a graph op: here
  one ``tf.py_function`` per layer that hands the gradient to the dlgs exchange
  (``compress``) and one that returns the layer's reduced gradient
  (``decompress``). The compressor never sees a variable; layers are matched by
  position in the gradient list (checked against the variables' shapes).
* Without ``groups``, every gradient is reduced on its own:
  ``compress(g1) -> allreduce -> decompress(g1) -> compress(g2) ...`` with no
  dependency between layers, so ``decompress(g1)`` may run before ``g2`` has
  been compressed, and the exchange (which merges layers into messages and
  finishes a step only when every layer is in) cannot finish. This is
  structural, so that case raises an error at trace time. With
  ``num_groups=1`` (or ``groups=1``) Horovod compresses every gradient, runs
  one grouped allreduce of the outputs, then decompresses, which is exactly
  the order the exchange needs: the form works there.
* Whether a layer goes sparse or dense is decided at run time (warm-up,
  merge plans), but a traced graph has fixed shapes, so every layer returns a
  one-element dummy to Horovod's allreduce and the exchange sends dense layers
  itself; Horovod's own ``compression`` of dense layers is therefore not
  available in this form (use ``dlgs.tensorflow.DistributedGradientTape(...,
  compression=hvd.Compression.fp16)``).
* Compression is not applied to ``tf.IndexedSlices`` by Horovod; pass
  ``sparse_as_dense=True`` for embeddings.
* Horovod's tape needs ``tf.Variable`` sources (``v.ref()``): with Keras 3,
  pass ``[v.value for v in model.trainable_variables]``.

The dummy is ``1.0``; Horovod's allreduce makes it ``1`` under
``op=hvd.Average`` and the number of ranks under ``op=hvd.Sum``, and the
reduced gradient is multiplied by it, so the compressor follows the tape's op.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence, Union

import horovod.tensorflow as hvd
import tensorflow as tf

from .. import _options
from ..core.config import SparsityConfig
from ._amp import check_scaler, scale_reader
from ._engine import (
    ENGINES,
    Engine,
    HorovodCollectives,
    _shape,
    build_tf_configs,
    topology_options,
    variable_name,
)

__all__ = ["Compression"]


class Compression:
    """A Horovod TF compressor that exchanges each layer's gradient sparsely.

    Use with ``hvd.DistributedGradientTape(tape, compression=..., num_groups=1)``
    and the same variables, in the same order, as ``tape.gradient``'s sources.

    Args:
        variables: the variables whose gradients Horovod reduces (Keras 3
            variables or ``tf.Variable``), in the order of the tape's sources.
        density, config, merge, log_every, **options: as
            :func:`dlgs.tensorflow.DistributedGradientTape`.
        process_set: the Horovod process set the tape uses.
        name: the exchange this compressor continues and the prefix of its
            Horovod tensor names: compressors created with one name (say,
            anew every step) share one exchange, so residuals, thresholds and
            the plan persist, as with the tape's ``name``; other options or
            variables under an existing name raise ``ValueError``.
        scaler: with a loss-scaled loss, the ``keras.optimizers.LossScaleOptimizer``
            that scaled it (as :func:`dlgs.tensorflow.DistributedGradientTape`'s
            ``scaler``). Every layer, dense ones included, goes through the
            exchange's own collectives here, so a step whose gradient is
            non-finite on any rank, in any layer, comes back non-finite on every
            rank and leaves residuals and thresholds untouched.
    """

    def __init__(
        self,
        variables: Sequence[Any],
        density: Optional[Union[float, str]] = None,
        *,
        config: Optional[SparsityConfig] = None,
        merge: Any = "dp",
        process_set=hvd.global_process_set,
        log_every: int = 0,
        name: str = "dlgs.c",
        scaler: Optional[Any] = None,
        **options: Any,
    ):
        _options.check_log_every(log_every)
        check_scaler(scaler)
        cfg, planner, topology = build_tf_configs(
            config, density, merge, options, door="dlgs.tensorflow.Compression"
        )
        two_level = topology_options(topology, process_set=process_set)
        if isinstance(variables, (str, bytes)) or not hasattr(variables, "__iter__"):
            raise TypeError("variables must be a list of variables, e.g. model.trainable_variables")
        self._variables = list(variables)
        if not self._variables:
            raise ValueError("variables is empty: pass the variables the tape differentiates")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        key = (
            "compression",
            topology,
            cfg,
            planner.config,
            id(process_set),
            log_every,
            scaler is not None,
            tuple(variable_name(v) for v in self._variables),
        )
        self._engine = ENGINES.named(
            name,
            key,
            lambda: Engine(
                cfg,
                planner,
                HorovodCollectives(process_set=process_set),
                average=True,
                prefix=name,
                log_every=log_every,
                loss_scale=scale_reader(scaler),
                **two_level,
            ),
        )
        if scaler is not None:
            self._engine.loss_scale = scale_reader(scaler)  # this object's scaler
        with tf.init_scope():
            self._engine.specs(self._variables)
        self._shapes = [_shape(v) for v in self._variables]
        self._dtypes = [tf.as_dtype(v.dtype) for v in self._variables]
        # Trace-time bookkeeping: position in the gradient list, per graph.
        self._graph: Any = None
        self._traced: List[tf.Tensor] = []
        self._last_out: Optional[tf.Tensor] = None
        # Run-time state of the current step.
        self._grads: List[Any] = [None] * len(self._variables)
        self._results: Optional[List[Any]] = None
        self._lock = threading.Lock()

    # -- trace time ------------------------------------------------------------------
    def _graph_of(self):
        return tf.compat.v1.get_default_graph()

    def compress(self, tensor):
        if isinstance(tensor, tf.IndexedSlices):
            raise TypeError("Horovod does not compress IndexedSlices: pass sparse_as_dense=True")
        graph = self._graph_of()
        if graph is not self._graph:
            self._graph, self._traced, self._last_out = graph, [], None
        pos = len(self._traced)
        if pos >= len(self._variables):
            raise ValueError(
                f"dlgs.tensorflow.Compression was given {len(self._variables)} variables but "
                "Horovod compresses more gradients: pass the tape's sources, in order"
            )
        self._check_shape(pos, tensor)
        deps = [] if self._traced == [] else [self._traced[-1]]
        with tf.control_dependencies(deps):  # one order on every rank
            dummy = tf.py_function(
                self._submit_py, [tf.constant(pos, tf.int32), tensor], Tout=tf.float32
            )
        dummy = tf.reshape(dummy, [1])
        self._traced.append(dummy)
        return dummy, (pos, tensor.dtype)

    def decompress(self, tensor, ctx):
        if ctx is None:
            return tensor
        pos, dtype = ctx
        if len(self._traced) != len(self._variables):
            raise ValueError(
                "dlgs.tensorflow.Compression needs every gradient compressed before any is "
                f"decompressed ({len(self._traced)} of {len(self._variables)} were): pass "
                "num_groups=1 (or groups=1) to hvd.DistributedGradientTape, give every "
                "variable a gradient, or use dlgs.tensorflow.DistributedGradientTape"
            )
        deps = [] if self._last_out is None else [self._last_out]
        with tf.control_dependencies(deps):
            out = tf.py_function(self._result_py, [tf.constant(pos, tf.int32), tensor], Tout=dtype)
        out.set_shape(self._shapes[pos])
        self._last_out = out
        return out

    def _check_shape(self, pos: int, tensor) -> None:
        got = tuple(tensor.shape.as_list()) if tensor.shape.rank is not None else None
        if got is not None and None not in got and got != self._shapes[pos]:
            raise ValueError(
                f"gradient {pos} has shape {got} but variable {self._engine.names[pos]!r} has "
                f"{self._shapes[pos]}: pass the same variables, in the same order, as the "
                "tape's sources (and give every one a gradient)"
            )

    # -- run time -----------------------------------------------------------------
    def _submit_py(self, pos, grad):
        pos = int(pos)
        with self._lock:
            if pos == 0:
                self._results = None
                self._grads = [None] * len(self._variables)
            self._grads[pos] = grad
        return tf.ones([1], tf.float32)

    def _result_py(self, pos, reduced_dummy):
        pos = int(pos)
        with self._lock:
            if self._results is None:
                grads = [
                    g if g is not None else tf.zeros(s, d)
                    for g, s, d in zip(self._grads, self._shapes, self._dtypes)
                ]
                self._results = self._engine.run_eager(*grads)
                self._grads = [None] * len(self._variables)
            out = self._results[pos]
        # 1 under op=Average, the number of ranks under op=Sum.
        return out * tf.cast(tf.reshape(reduced_dummy, []), out.dtype)

    # -- state -----------------------------------------------------------------------
    @property
    def dlgs(self) -> Engine:
        """dlgs' side of this compressor: ``stats()``, ``planner``,
        ``reprofile()``, ``last_step_finite``, ``exchange``, and ``trackable``
        for ``tf.train.Checkpoint(dlgs=compression.dlgs.trackable)``."""
        return self._engine

    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals, controller states, step and plan, as NumPy."""
        return self._engine.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` between steps. No collective: safe on one
        rank (see :meth:`dlgs.core.SparseExchange.load_state_dict`)."""
        self._engine.load_state_dict(state)
        self._results = None
