"""Cross-rank agreement checks (pure functions over gathered descriptions).

Horovod negotiates collectives by name: if one rank's model has a layer the
others lack, the others wait for it forever (Horovod only prints stall
warnings). Options do the same more quietly: a different ``bucket_elements``
packs different messages, a different ``drift_window`` sends one rank into a
broadcast while the other is in an allgather. dlgs therefore gathers a
description of every rank's layers and of *every* option that shapes the
exchange once, at construction, and every rank raises the same error if they
differ.

The options are collected generically (:func:`agreed_options`): the sparsity
config's ``to_dict()``, the planner's ``options()`` (all its constructor
arguments), the collectives' ``options()`` (op, scaling, compression, process
set) and the adapter's extra options, so an option added later to any of them
is checked without anyone remembering to. The one collective is passed in as a
callable (:func:`check_ranks_agree`), so this module imports no framework.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "signature",
    "describe_mismatch",
    "RankMismatchError",
    "agreed_options",
    "canonical",
    "check_ranks_agree",
    "horovod_options",
]

# The name a user passes for options recorded under another name.
_USER_NAMES = {
    "planner.strategy": "merge",
    "horovod.prescale_factor": "gradient_predivide_factor",
    "horovod.postscale_factor": "gradient_predivide_factor",
}


class RankMismatchError(ValueError):
    """Ranks were given different models or options."""

    # TensorFlow's autograph re-raises an error from traced code as its own
    # type only where that type's __init__ is Exception's (else as a
    # StagingError, which ``except dlgs.RankMismatchError`` would not
    # catch); the message is the only argument either way.
    __init__ = Exception.__init__


def signature(
    layers: Sequence[Tuple[str, Sequence[int], str]], options: Dict[str, Any]
) -> Dict[str, Any]:
    """A plain-Python, picklable description of one rank's setup.

    Args:
        layers: ``(name, shape, dtype)`` of every exchanged parameter.
        options: the sparsification options (``SparsityConfig.to_dict()``) and
            anything else every rank must agree on.
    """
    return {
        "layers": [(str(n), tuple(int(s) for s in shape), str(dt)) for n, shape, dt in layers],
        "options": canonical(dict(options)),
    }


def canonical(value: Any) -> Any:
    """``value`` as plain data that compares equal across processes.

    Numbers, strings, ``None`` and bools stay; enums become their value;
    dataclasses, mappings and sequences are converted member by member;
    classes and any other object become their qualified class name (a
    ``torch.amp.GradScaler`` or ``hvd.Compression.fp16`` is compared by kind,
    not by identity, which would differ on every rank).
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return canonical(value.value)
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return canonical(dataclasses.asdict(value))
    cls = value if isinstance(value, type) else type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def agreed_options(
    config: Any,
    planner: Any = None,
    collectives: Any = None,
    **exchange: Any,
) -> Dict[str, Any]:
    """Every option that shapes the exchange, grouped by where it was set.

    Args:
        config: the :class:`~dlgs.core.config.SparsityConfig` (``to_dict()``).
        planner: the :class:`~dlgs.core.planning.online.OnlinePlanner` (``options()``),
            or None.
        collectives: the adapter's collectives; their ``options()`` (op,
            scaling, compression, process set) if they have that method.
        **exchange: the adapter's own options (``average``, ``prefix``, the
            form, ``backward_passes_per_step``, a loss scaler, ...); objects are
            compared by class (:func:`canonical`).

    Returns:
        ``{"sparsity": ..., "planner": ..., "horovod": ..., "exchange": ...}``;
        :func:`describe_mismatch` names a differing option by its dotted path
        (``planner.bucket_elements``).
    """
    options = getattr(collectives, "options", None)
    return canonical(
        {
            "sparsity": config.to_dict(),
            "planner": planner.options() if planner is not None else None,
            "horovod": options() if callable(options) else None,
            "exchange": exchange,
        }
    )


def horovod_options(comm: Any, hvd: Any) -> Dict[str, Any]:
    """The options of a Horovod-backed collectives object that every rank
    must agree on: op, pre/postscale (``gradient_predivide_factor``), the
    user's compression (by class) and the process set's ranks.

    Args:
        comm: has ``op``, ``prescale_factor``, ``postscale_factor``,
            ``compression`` and ``process_set``.
        hvd: the Horovod framework module (``horovod.torch`` or
            ``horovod.tensorflow``), for the names of its reduction ops.
    """
    names = ("Average", "Sum", "Adasum", "Min", "Max", "Product")
    ops = {getattr(hvd, n): n for n in names if hasattr(hvd, n)}
    return {
        "op": ops.get(comm.op, repr(comm.op)),
        "prescale_factor": float(comm.prescale_factor),
        "postscale_factor": float(comm.postscale_factor),
        "compression": canonical(comm.compression),
        "process_set": sorted(comm.process_set.ranks or []),
    }


def check_ranks_agree(
    sig: Dict[str, Any],
    allgather_object: Callable[[Any], Sequence[Any]],
    *,
    size: int,
) -> None:
    """Gather every rank's :func:`signature`; raise the same
    :class:`RankMismatchError` on every rank if they differ.

    Never a hang: every rank takes part in the one ``allgather_object`` and
    judges the same gathered list. Its tensor names must not depend on
    anything that could itself differ between ranks (a ``prefix``, say), or a
    difference would hang the gather instead of being reported.

    Args:
        sig: this rank's :func:`signature`.
        allgather_object: ``obj -> [obj of each rank of the process set]``,
            a collective on the exchange's process set.
        size: ranks in the process set; with one rank there is nothing to check.
    """
    if size <= 1:
        return
    problem = describe_mismatch(list(allgather_object(sig)))
    if problem:
        raise RankMismatchError(problem)


def _flatten(options: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    flat: Dict[str, Any] = {}
    for key, value in options.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def describe_mismatch(signatures: Sequence[Dict[str, Any]]) -> Optional[str]:
    """``None`` if all ranks' signatures agree, else a readable explanation
    naming the first differing ranks, parameters and options."""
    ref = signatures[0]
    problems: List[str] = []
    ref_layers = {n: (s, d) for n, s, d in ref["layers"]}
    for rank, sig in enumerate(signatures[1:], start=1):
        if sig == ref:
            continue
        layers = {n: (s, d) for n, s, d in sig["layers"]}
        only_ref = sorted(set(ref_layers) - set(layers))
        only_here = sorted(set(layers) - set(ref_layers))
        if only_ref:
            problems.append(f"rank {rank} lacks parameters {only_ref[:5]} that rank 0 has")
        if only_here:
            problems.append(f"rank {rank} has parameters {only_here[:5]} that rank 0 lacks")
        for name in sorted(set(layers) & set(ref_layers)):
            if layers[name] != ref_layers[name]:
                problems.append(
                    f"parameter {name!r}: shape/dtype {ref_layers[name]} on rank 0, "
                    f"{layers[name]} on rank {rank}"
                )
                break
        if not (only_ref or only_here) and [n for n, _, _ in sig["layers"]] != [
            n for n, _, _ in ref["layers"]
        ]:
            problems.append(f"rank {rank} orders its parameters differently from rank 0")
        ref_options, options = _flatten(ref["options"]), _flatten(sig["options"])
        for key in sorted(set(ref_options) | set(options)):
            a, b = ref_options.get(key, "<unset>"), options.get(key, "<unset>")
            if a != b:
                user = _USER_NAMES.get(key)
                given = f" (set by {user}=)" if user else ""
                problems.append(f"option {key}={b!r} on rank {rank} but {a!r} on rank 0{given}")
        if len(problems) >= 5:
            break
    if not problems:
        return None
    return "ranks disagree on the model or dlgs options: " + "; ".join(problems)
