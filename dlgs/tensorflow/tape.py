"""``dlgs.tensorflow.DistributedGradientTape``: Horovod's tape, sparse inside.

Mirrors :func:`horovod.tensorflow.DistributedGradientTape` (same positional
arguments and defaults) and adds the dlgs options as keywords::

    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = dlgs.tensorflow.DistributedGradientTape(tape, density=0.01)
    grads = tape.gradient(loss, model.trainable_variables)

Unlike Horovod's tape it accepts Keras 3 variables (keyed by ``v.path``) as
well as ``tf.Variable`` (keyed by ``v.name``).

A tape is usually created anew every step, but residuals, thresholds and the
merge plan must persist: they live in an exchange kept per ``name=`` for the
process (one per model; give two models trained side by side two names). A
tape created with the same name and options continues the same exchange;
other options under the same name raise ``ValueError``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import horovod.tensorflow as hvd
import tensorflow as tf

from .. import _options
from .._horovod import methods_of
from ..core.config import SparsityConfig
from ._amp import check_scaler, scale_reader
from ._engine import (
    ENGINES,
    DlgsAccessors,
    Engine,
    HorovodCollectives,
    build_tf_configs,
    topology_options,
    variable_name,
)

__all__ = ["DistributedGradientTape"]


class _SparseTape:
    """Methods of the generated tape class (copied over the user's tape class)."""

    def gradient(
        self,
        target,
        sources,
        output_gradients=None,
        unconnected_gradients=tf.UnconnectedGradients.NONE,
        use_generic_names=False,
    ):
        flat = tf.nest.flatten(sources)
        # The user's tape class (Horovod does the same; the generated class is
        # not meant to be subclassed).
        grads = super(type(self), self).gradient(
            target, flat, output_gradients, unconnected_gradients
        )
        grads = list(grads)
        glob = [i for i, v in enumerate(flat) if variable_name(v) not in self._dlgs_local]
        if glob:
            reduced = self._dlgs_engine.exchange_gradients(
                [grads[i] for i in glob], [flat[i] for i in glob]
            )
            for i, g in zip(glob, reduced):
                grads[i] = g
        if self._dlgs_local and self._dlgs_scale_local:
            size = self._dlgs_engine.comm.size
            for i, v in enumerate(flat):
                if variable_name(v) in self._dlgs_local and grads[i] is not None:
                    g = grads[i]
                    grads[i] = (
                        tf.IndexedSlices(g.values / size, g.indices, g.dense_shape)
                        if isinstance(g, tf.IndexedSlices)
                        else g / size
                    )
        return tf.nest.pack_sequence_as(sources, grads)

    def register_local_source(self, source):
        """Keep ``source``'s gradient rank-local (not exchanged), as Horovod's
        tape does; it is divided by the number of ranks when
        ``scale_local_gradients`` is set."""
        self._dlgs_local.add(variable_name(source))


def DistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression=hvd.Compression.none,
    sparse_as_dense: bool = False,
    op=hvd.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups=None,
    process_set=hvd.global_process_set,
    scale_local_gradients: bool = True,
    *,
    density: Optional[Union[float, str]] = None,
    config: Optional[SparsityConfig] = None,
    merge: Any = "dp",
    log_every: int = 0,
    name: str = "dlgs.tape",
    scaler: Optional[Any] = None,
    **options: Any,
) -> tf.GradientTape:
    """Wrap ``gradtape`` so ``gradient()`` exchanges gradients sparsely across ranks.

    The positional arguments are :func:`horovod.tensorflow.DistributedGradientTape`'s.
    ``compression`` (e.g. ``hvd.Compression.fp16``) applies to the layers sent
    dense; ``device_dense`` / ``device_sparse`` place the allreduces /
    allgathers; ``sparse_as_dense`` is accepted (``IndexedSlices`` are always
    densified first); ``groups`` / ``num_groups`` are rejected because dlgs
    packs its own messages.

    Works eagerly and inside ``tf.function``; there the exchange runs as graph
    ops on steps that need no host work and through one ``tf.py_function`` on
    the others (docs/tensorflow.md).

    Args:
        density: fraction of each sparsified layer sent per step, in (0, 1]
            (default 0.01; give either ``density`` or ``config``), or ``"auto"``:
            chosen by the merge planner (:class:`dlgs.SparsityConfig`).
        config: a ready :class:`dlgs.SparsityConfig` instead of keyword options.
        merge: the merge plan, a strategy name or a :class:`dlgs.MergeConfig`,
            as in :func:`dlgs.torch.DistributedOptimizer` (docs/options.md).
        log_every: log per-layer statistics to the ``dlgs.tensorflow`` logger
            every this many steps (0: never).
        name: the exchange this tape continues (residuals and plan persist
            across the per-step tapes under one name) and the prefix of its
            Horovod tensor names.
        scaler: with a loss-scaled loss (mixed precision), the
            ``keras.optimizers.LossScaleOptimizer`` whose ``scale_loss()``
            scaled it. dlgs reads its scale every step so that residuals stay
            in unscaled units; the reduced gradients come back scaled (the
            optimizer unscales them) and, when any rank's gradient overflowed,
            non-finite on every rank, so the optimizer skips the same steps
            everywhere and the skipped step leaves dlgs' state untouched.
            Without it, a scaled loss mixes scales in the residuals.
        **options: any other :class:`dlgs.SparsityConfig` field, any
            :class:`dlgs.MergeConfig` field but ``strategy``, and ``topology``
            / ``ranks_per_node``: the two-level exchange, as in
            :func:`dlgs.torch.DistributedOptimizer` (``op=hvd.Average``, the
            global process set, ``hvd.init(process_sets="dynamic")``; inside
            a ``tf.function`` its steps run on the host path).

    Raises:
        ValueError / TypeError: bad options (naming the option and the accepted
            range), an unsupported ``op``, Horovod's ``groups``, or other
            options under an existing ``name``.
        dlgs.RankMismatchError: ranks have different variables or options
            (raised by the first ``gradient()``).
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"gradtape must be a tf.GradientTape, got {type(gradtape).__name__}")
    _options.check_op(op, hvd.Average, hvd.Sum)
    _options.check_no_groups(num_groups, groups)
    _options.check_predivide(gradient_predivide_factor, op, hvd.Average)
    _options.check_log_every(log_every)
    _check_compression(compression)
    check_scaler(scaler)
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    cfg, planner, topology = build_tf_configs(
        config, density, merge, options, door="dlgs.tensorflow.DistributedGradientTape"
    )
    two_level = topology_options(topology, op, process_set)
    key = (
        topology,
        cfg,
        planner.config,
        op,
        float(gradient_predivide_factor),
        id(process_set),
        compression,
        device_dense,
        device_sparse,
        log_every,
        scaler is not None,
    )
    average = op == hvd.Average
    pre, post = _options.horovod_scales(average, gradient_predivide_factor)

    def make() -> Engine:
        comm = HorovodCollectives(
            op, pre, post, process_set, compression, device_dense, device_sparse
        )
        return Engine(
            cfg,
            planner,
            comm,
            average=average,
            prefix=name,
            extra_options={"scale_local_gradients": bool(scale_local_gradients)},
            log_every=log_every,
            loss_scale=scale_reader(scaler),
            **two_level,
        )

    engine = ENGINES.named(name, ("tape", key), make)
    if scaler is not None:
        engine.loss_scale = scale_reader(scaler)  # the scaler of this step
    # DlgsAccessors' own members and the deprecated names it inherits.
    methods = methods_of(DlgsAccessors, _SparseTape)
    cls = type(gradtape.__class__.__name__, (gradtape.__class__,), methods)
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)  # shares the recorded tape
    # The factory initialises the instance it made (as Horovod's does).
    tape._dlgs_engine = engine  # noqa: SLF001
    tape._dlgs_local = set()  # noqa: SLF001
    tape._dlgs_scale_local = bool(scale_local_gradients)  # noqa: SLF001
    return tape


def _check_compression(compression: Any) -> None:
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(
            "compression must be a Horovod compressor (hvd.Compression.none or .fp16), "
            f"got {type(compression).__name__}"
        )
    from .compression import Compression

    if isinstance(compression, Compression):
        raise TypeError(
            "dlgs.tensorflow.Compression is for Horovod's own tape; "
            "dlgs.tensorflow.DistributedGradientTape sparsifies already (pass density=)"
        )
