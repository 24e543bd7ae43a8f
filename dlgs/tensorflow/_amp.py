"""Mixed precision: reading a Keras 3 ``LossScaleOptimizer``'s loss scale.

A dynamic loss scaler multiplies the loss, hence every gradient, by a scale
that it halves after an overflow (and skips that step) and doubles after a run
of finite steps. dlgs keeps residuals and velocities in unscaled units
(docs/design.md, "Mixed precision and non-finite gradients"), so it must know
the scale of the step being exchanged: it reads the optimizer's live
``dynamic_scale`` variable once per step (the value ``scale_loss`` multiplied
the loss by, since the optimizer changes it only after the exchange).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import keras
import numpy as np
import tensorflow as tf

from ._ops import _maybe_host

__all__ = ["check_scaler", "scale_reader"]


def check_scaler(scaler: Any) -> None:
    """``scaler`` must be None or a ``keras.optimizers.LossScaleOptimizer``."""
    if scaler is not None and not isinstance(scaler, keras.optimizers.LossScaleOptimizer):
        raise TypeError(
            "scaler must be None or the keras.optimizers.LossScaleOptimizer whose "
            f"scale_loss() scaled the loss, got {type(scaler).__name__}"
        )


def scale_reader(scaler: Any) -> Optional[Callable[[], Any]]:
    """A function returning ``scaler``'s current loss scale as a 0-d float32
    (a NumPy scalar on the CPU, where TensorFlow values live in host memory
    anyway; a device tensor on a GPU), or None without a scaler."""
    if scaler is None:
        return None

    def read() -> Any:
        scale = getattr(scaler, "dynamic_scale", None) if scaler.built else None
        if scale is None:
            # Not built yet: scale_loss() used initial_scale, and apply() builds
            # the variable with that value after the exchange.
            return np.float32(scaler.initial_scale)
        value = tf.convert_to_tensor(scale)
        return _maybe_host(value, value)

    return read
