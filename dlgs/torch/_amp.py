"""Mixed precision: reading a ``torch.amp.GradScaler``'s scale without a host sync.

A dynamic loss scaler multiplies the loss, hence every gradient, by a scale
that it halves after an overflow and doubles after a run of finite steps. dlgs
keeps residuals and velocities in unscaled units (docs/design.md, "Mixed
precision and non-finite gradients"), so it must know the scale of the step
being exchanged: it reads the scaler's live scale tensor once per step.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["check_scaler", "scale_reader"]


def check_scaler(scaler: Any) -> None:
    """``scaler`` must be None or a ``torch.amp.GradScaler``."""
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"scaler must be None or a torch.amp.GradScaler, got {type(scaler).__name__}"
        )


def scale_reader(scaler: Optional[torch.amp.GradScaler]) -> Optional[Callable[[], Any]]:
    """A function returning the scaler's current scale as a 0-d device tensor
    (None when disabled or before its first ``scale()``), or None without a scaler."""
    if scaler is None:
        return None

    def read() -> Any:
        if not scaler.is_enabled():
            return None
        # The live scale tensor: ``get_scale()`` would copy it to the host.
        scale = getattr(scaler, "_scale", None)
        return scale.reshape(()) if scale is not None else None

    return read
