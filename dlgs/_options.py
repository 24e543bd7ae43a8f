"""Argument handling shared by the framework adapters (no framework import).

The adapters accept the same dlgs options and must raise the same errors; the
checks that do not depend on a framework's types live here. Horovod's op
constants are passed in by the caller, so this module imports neither torch,
TensorFlow nor Horovod.
"""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any, Dict, Optional, Sequence, Tuple

from .core._checks import check_float, check_int
from .core.config import MergeConfig, SparsityConfig
from .core.planning.online import OnlinePlanner

__all__ = [
    "build_config",
    "build_configs",
    "build_planner",
    "check_log_every",
    "check_op",
    "check_no_groups",
    "check_predivide",
    "horovod_scales",
    "warn_float64",
    "check_int",
    "check_topology",
    "TOPOLOGIES",
]


def build_config(
    config: Optional[SparsityConfig], density: Optional[float], options: Dict[str, Any]
) -> SparsityConfig:
    """One :class:`SparsityConfig` from either a ready config or keyword options.

    ``density=None`` is the entry points' default: :class:`SparsityConfig`'s
    0.01 without ``config``. Any explicit ``density`` beside ``config`` is an
    error rather than silently losing to the config's density.
    """
    if config is not None:
        if not isinstance(config, SparsityConfig):
            raise TypeError(f"config must be a dlgs.SparsityConfig, got {type(config).__name__}")
        given = sorted(options) + (["density"] if density is not None else [])
        if given:
            raise ValueError(
                f"pass either config= or density=/keyword options, not both: got {given}"
            )
        return config
    if density is not None:
        if options.get("budget") is not None:
            raise ValueError(
                f"pass density= or budget=, not both: a budget chooses the density "
                f"(got density={density!r}, budget={options['budget']!r})"
            )
        options = dict(options, density=density)
    try:
        return SparsityConfig(**options)
    except TypeError as err:
        if "unexpected keyword" in str(err):
            raise TypeError(f"unknown dlgs option: {err}") from None
        raise


def build_planner(merge: Any, **options: Any) -> OnlinePlanner:
    """The online planner for ``merge=`` (a strategy name or a
    :class:`MergeConfig`) and, with a name, the other :class:`MergeConfig`
    fields as keywords."""
    if isinstance(merge, MergeConfig):
        if options:
            raise ValueError(
                "pass either merge=MergeConfig(...) or merge options, not both: "
                f"got {sorted(options)}"
            )
        return OnlinePlanner.from_config(merge)
    if not isinstance(merge, str):
        raise TypeError(f"merge must be a str or a dlgs.MergeConfig, got {type(merge).__name__}")
    return OnlinePlanner.from_config(MergeConfig(merge, **options))


_MERGE_FIELDS = tuple(f.name for f in fields(MergeConfig) if f.name != "strategy")


def build_configs(
    config: Optional[SparsityConfig],
    density: Optional[float],
    merge: Any,
    options: Dict[str, Any],
    *,
    door: str = "",
    refused: Optional[Dict[str, str]] = None,
) -> Tuple[SparsityConfig, OnlinePlanner]:
    """What every entry point does with its dlgs options: ``options`` may hold
    any :class:`SparsityConfig` field and any :class:`MergeConfig` field but
    ``strategy`` (given as ``merge=``); each is validated once, by its config.

    ``refused``: options another door takes but ``door`` does not, each with
    the reason (a ``ValueError`` naming it, not "unknown option"). An option
    given where it has no effect is an error too, never silently ignored:
    ``reduce_width`` without ``transport="reduce"`` or ``"auto"``."""
    refused = refused or {}
    clash = sorted(set(options) & set(refused))
    if clash:
        raise ValueError(f"{clash[0]}= is not supported by {door}: {refused[clash[0]]}")
    if "reduce_width" in options and options.get("transport", "allgather") == "allgather":
        raise ValueError(
            f"reduce_width={options['reduce_width']!r} applies to transport='reduce' or "
            "'auto' only; with transport='allgather' (the default) leave it unset"
        )
    options = dict(options)
    merge_options = {k: options.pop(k) for k in _MERGE_FIELDS if k in options}
    planner = build_planner(merge, **merge_options)
    cfg = build_config(config, density, options)
    if cfg.auto and planner.strategy == "none":
        raise ValueError(
            "density='auto' is chosen from the merge planner's profile: use a profiling "
            "merge strategy (merge='dp', 'greedy', 'buckets' or 'all'), not merge='none'"
        )
    return cfg, planner


def warn_float64(kind: str, names: Sequence[str], log: logging.Logger) -> None:
    """One warning at construction naming the float64 ``kind`` (parameters or
    variables): dlgs keeps sparse layers' residuals and wire values in float32."""
    if names:
        more = f" and {len(names) - 10} more" if len(names) > 10 else ""
        log.warning(
            "dlgs: float64 %s %s%s are exchanged in float32: sparse layers' residuals and "
            "values on the wire are float32 (the reduced gradient is cast back to float64)",
            kind,
            list(names[:10]),
            more,
        )


def check_log_every(log_every: Any) -> None:
    check_int("log_every", log_every, 0)


def check_op(op: Any, average: Any, sum_: Any) -> None:
    """Only Average and Sum combine sparse gradients."""
    if op not in (average, sum_):
        raise ValueError(
            "op must be hvd.Average or hvd.Sum (Adasum cannot combine sparse gradients)"
        )


def check_no_groups(num_groups: Any, groups: Any) -> None:
    if num_groups or groups is not None:
        raise ValueError(
            "groups/num_groups are Horovod's fusion groups; dlgs packs its own messages, "
            "leave them unset"
        )


def horovod_scales(average: bool, predivide_factor: float) -> Tuple[float, float]:
    """Horovod's ``(prescale_factor, postscale_factor)`` for
    ``gradient_predivide_factor`` (it applies only to ``op=Average``)."""
    if average:
        return 1.0 / predivide_factor, predivide_factor
    return 1.0, 1.0


def check_predivide(factor: Any, op: Any, average: Any) -> None:
    check_float("gradient_predivide_factor", factor, low=0, low_open=True)
    if factor != 1.0 and op != average:
        raise ValueError("gradient_predivide_factor is only supported with op=hvd.Average")


#: Values of ``topology`` (every door).
TOPOLOGIES = ("flat", "hierarchical", "auto")


def check_topology(topology: Any, ranks_per_node: Any) -> None:
    """``ValueError``/``TypeError`` naming the option, before anything runs."""
    if topology not in TOPOLOGIES:
        raise ValueError(
            f"topology must be one of {', '.join(map(repr, TOPOLOGIES))}, got {topology!r}"
        )
    check_int("ranks_per_node", ranks_per_node, 2, none_ok=True)
    if ranks_per_node is not None and topology == "flat":
        raise ValueError(
            f"ranks_per_node={ranks_per_node!r} applies to topology='hierarchical' or 'auto' "
            "only; with topology='flat' (the default) leave it unset"
        )
