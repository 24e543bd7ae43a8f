"""An exchange's checkpoint: its format, the validation of a saved state
before anything changes, and the conversions a load needs.

Functions of the saved state, the model's layers and the options (and, to
save or restore them, the exchange's :class:`~dlgs.core.exchange.records.LayerRecord`
s); the exchange (:meth:`SparseExchange.state_dict` / ``load_state_dict``)
decides what to restore. No collective here: a load is local to its rank
(:mod:`dlgs.core.state.resume` agrees across ranks at the next gradient).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Sequence, Tuple

import numpy as np

from .._checks import check_float
from ..backend import ArrayOps, host_number
from ..config import SparsityConfig

if TYPE_CHECKING:
    from ..exchange.records import LayerRecord
    from ..selection.controller import ThresholdController

__all__ = [
    "STATE_VERSION",
    "check_finite_state",
    "host_number",
    "layer_densities",
    "layer_states",
    "restore_layers",
    "restored",
    "validate",
]

#: Version of :meth:`SparseExchange.state_dict`'s format.
STATE_VERSION = 1

#: Options whose change since a checkpoint restarts the thresholds.
RESTART_KEYS = ("controller", "threshold", "density", "warmup", "warmup_steps")


def validate(
    ops: ArrayOps,
    state: Any,
    layers: Sequence[Tuple[str, int]],
    config: SparsityConfig,
    rank: int,
    size: int,
) -> Tuple[bool, List[str]]:
    """Check a saved exchange state against a model's ``(name, numel)`` layers
    and the options in force, changing nothing. Returns whether it is this
    rank's own state (saved by ``rank`` of ``size``) and the options whose
    change restarts the thresholds; raises ``TypeError``/``ValueError`` naming
    what is wrong."""
    sizes = dict(layers)
    if not isinstance(state, dict):
        raise TypeError(f"dlgs state must be a dict, got {type(state).__name__}")
    if "exchange" in state and "topology" in state:
        raise ValueError(
            f"dlgs state was saved with topology='hierarchical' ({state['topology']} ranks per "
            "node and nodes): its residuals are per shard of each layer and do not load into "
            "this exchange (topology='flat'); load it with the same topology and "
            "ranks_per_node, or load the optimizer state without its 'dlgs' entry to start "
            "the residuals afresh"
        )
    version = state.get("version")
    if version != STATE_VERSION:
        raise ValueError(f"dlgs state version must be {STATE_VERSION}, got {version!r}")
    saved = state.get("layers")
    if not isinstance(saved, dict):
        raise ValueError("dlgs state has no 'layers' dict: not a dlgs state_dict()")
    unknown = sorted(set(saved) - set(sizes))
    missing = sorted(set(sizes) - set(saved))
    if unknown or missing:
        raise ValueError(
            f"dlgs state does not match this model's parameters: unknown {unknown[:5]}, "
            f"missing {missing[:5]}"
        )
    for name, entry in saved.items():
        n = sizes[name]
        # Saved by every version that saves sizes: a state whose layers were all sent dense holds
        # no buffer to compare, so the size itself is what tells another model.
        numel = entry.get("numel") if isinstance(entry, dict) else None
        if numel is not None and numel != n:
            raise ValueError(
                f"dlgs state for parameter {name!r} was saved for {numel} elements but the "
                f"parameter has {n} (a checkpoint of another model?)"
            )
        for attr in ("residual", "velocity"):
            buf = entry.get(attr)
            # Saved buffers may be framework tensors or NumPy arrays (TF state).
            held = math.prod(int(d) for d in buf.shape) if buf is not None else n + 1
            if held != n + 1:
                raise ValueError(
                    f"dlgs state for parameter {name!r}: its {attr} holds "
                    f"{held - 1} elements but the parameter has {n} "
                    "(a checkpoint of another model?)"
                )
    check_finite_state(ops, state)
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"dlgs state step must be an int >= 0, got {step!r}")
    plan = state.get("plan")
    if plan is not None:
        flat = [i for members, _ in plan for i in members]
        if len(set(flat)) != len(flat) or any(not 0 <= i < len(sizes) for i in flat):
            raise ValueError(f"dlgs state holds a plan for another model: {plan!r:.80}")
    auto_layers = state.get("auto_layers")
    if auto_layers is not None:
        try:
            layer_densities(auto_layers, len(sizes))
        except (TypeError, ValueError) as err:
            raise ValueError(f"dlgs state auto_layers: {err}") from None
    cfg = state.get("config") or {}
    now = config.to_dict()
    restart = [
        f"{key} {cfg.get(key)!r} -> {now[key]!r}"
        for key in RESTART_KEYS
        if key in cfg and cfg[key] != now[key]
    ]
    own = state.get("rank") == rank and state.get("size") == size
    return own, restart


def layer_densities(values: Sequence[float], n: int) -> Tuple[float, ...]:
    """``values`` as one density per layer, each checked."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"layers must be a sequence of densities, got {type(values).__name__}")
    if len(values) != n:
        raise ValueError(f"layers must hold one density per layer ({n}), got {len(values)}")
    for i, d in enumerate(values):
        check_float(f"layers[{i}]", d, low=0, high=1, low_open=True)
    return tuple(float(d) for d in values)


def restored(ops: ArrayOps, fresh: Any, saved: Any, like: Any) -> Any:
    """A saved controller entry in the kind of its fresh value."""
    number = host_number(ops, saved)
    if isinstance(fresh, int):
        return int(number)
    return number if isinstance(fresh, float) else ops.scalar(number, like)


def check_finite_state(ops: ArrayOps, state: Dict[str, Any]) -> None:
    """Refuse a state whose residual, velocity or threshold state is NaN or
    infinite (a damaged checkpoint: every step after it would be non-finite),
    naming the parameter. Needs no exchange: an engine checks a state it keeps
    for later (TensorFlow restores before the first step) when it is loaded,
    on the rank that loads it, not at a step the other ranks are already in."""
    layers = state.get("layers") if isinstance(state, dict) else None
    for name, entry in (layers or {}).items():
        if not isinstance(entry, dict):
            continue
        for attr in ("residual", "velocity"):
            buf = entry.get(attr)
            if buf is not None and not _all_finite(ops, buf):
                raise ValueError(
                    f"dlgs state for parameter {name!r}: its {attr} holds NaN or "
                    "infinite values (a damaged checkpoint: every step after it would "
                    "be non-finite). Load the optimizer state without its 'dlgs' entry "
                    "to resume with empty residuals, or use an earlier checkpoint"
                )
        ctrl = entry.get("controller") or {}
        bad = [k for k, v in ctrl.items() if not math.isfinite(host_number(ops, v))]
        if bad:
            raise ValueError(
                f"dlgs state for parameter {name!r}: its threshold state {bad} is NaN or "
                "infinite (a damaged checkpoint). Load the optimizer state without its "
                "'dlgs' entry, or use an earlier checkpoint"
            )


def _all_finite(ops: ArrayOps, buf: Any) -> bool:
    """Whether a saved buffer (a framework tensor or a NumPy array) is finite
    (read on the host: checkpoints only)."""
    if isinstance(buf, (np.ndarray, np.generic)):
        return bool(np.isfinite(buf).all())
    return not bool(np.ravel(ops.to_host(ops.any_nonfinite([buf])))[0])


def layer_states(ops: ArrayOps, records: Sequence["LayerRecord"]) -> Dict[str, Any]:
    """The per-layer part of a state: residual, velocity, controller state
    (numbers: device scalars of the fixed controller read on the host) and
    the ``k`` it was planned with, by layer name."""
    return {
        layer.name: {
            "residual": layer.residual,
            "velocity": layer.velocity,
            "controller": {
                key: v if isinstance(v, int) else host_number(ops, v)
                for key, v in layer.ctrl.items()
            },
            "k": layer.plan.k if layer.plan is not None else None,
            "numel": layer.numel,
        }
        for layer in records
    }


def restore_layers(
    ops: ArrayOps,
    controller: "ThresholdController",
    records: Sequence["LayerRecord"],
    sparse: Sequence[bool],
    densities: Sequence[float],
    saved: Dict[str, Any],
    like: Any,
    *,
    own: bool,
    restart: bool,
) -> None:
    """Restore :func:`layer_states` (validated already) into an exchange's
    layer records, laid out already (``sparse``: each layer's mode now). A
    state not ``own`` (another rank's) restores no residual or velocity;
    ``restart`` (or another ``k``) starts the thresholds afresh."""
    for layer, is_sparse, density in zip(records, sparse, densities):
        entry = saved[layer.name]
        plan = layer.plan
        assert plan is not None  # set by the layout
        if not is_sparse:
            # Sent dense now: restore what it still owed (flushed next step)
            # and, with momentum correction, its velocity.
            for attr in ("residual", "velocity"):
                setattr(layer, attr, None)
                if own and entry[attr] is not None:
                    buf = ops.zeros(layer.numel + 1, "float32", like)
                    setattr(layer, attr, ops.copy_(buf, entry[attr]))
            continue
        for attr in ("residual", "velocity"):
            buf = getattr(layer, attr)
            if buf is not None:
                ops.mul_(buf, 0.0)
                if own and entry[attr] is not None:
                    ops.copy_(buf, entry[attr])
        fresh = controller.init_state(ops, like, density)
        ctrl = entry.get("controller") or {}
        if not restart and entry.get("k") == plan.k and set(ctrl) == set(fresh):
            # Each entry in the kind of its fresh value: Python numbers (the
            # dynamic controller's host state, also from checkpoints that
            # held device scalars) or device scalars (the fixed threshold).
            layer.ctrl = {key: restored(ops, fresh[key], v, like) for key, v in ctrl.items()}
        else:
            layer.ctrl = fresh
