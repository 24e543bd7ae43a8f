"""One training step of a :class:`~dlgs.core.exchange.exchange.SparseExchange`: begun at
its first gradient, fed every layer's, completed, then kept or dropped.

:class:`StepState` is what a step holds between its first gradient and its
end; :meth:`StepState.drop` is the one way a step ends, whether it finished
(its new state kept or not) or was abandoned (an error inside it, a failed
trace, Horovod Elastic's reset). :func:`verdict` is the one test of whether a
step was finite on every rank, for a step run on the host and one traced onto
the device alike.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..backend import ArrayOps
from .records import LayerRecord, StepTrace

__all__ = ["StepState", "nonfinite_names", "verdict"]


class StepState:
    """The step under way: what was submitted, what its collectives returned
    to be checked, its loss scale and its timing. Reused from step to step."""

    def __init__(self) -> None:
        #: Layer indices submitted this step.
        self.submitted: set = set()
        #: The transports' per-member non-finite flags (device bools).
        self.flags: List[Any] = []
        #: Dense messages' reduced outputs, by first member, to be checked.
        self.dense_out: Dict[int, Any] = {}
        #: The next step is timed layer by layer (``trace_next_step()``).
        self.timed_next = False
        self.drop()

    def check(self, i: int, name: str, numel: int, expected: int) -> None:
        """Layer ``i`` (``name``, ``expected`` elements) may be submitted with
        ``numel`` elements now, or this raises."""
        if numel != expected:
            raise ValueError(f"gradient of {name!r} has {numel} elements, expected {expected}")
        if i in self.submitted:
            raise RuntimeError(f"gradient of {name!r} submitted twice in one step")

    def drop(self) -> None:
        """End the step: nothing of it stays (its kept state was kept by then)."""
        #: A step has begun (a gradient was submitted) and not ended.
        self.open = False
        self.submitted.clear()
        self.flags.clear()
        self.dense_out.clear()
        #: This step's loss scale (0-d) or None, and its reciprocal.
        self.scale: Any = None
        self.inv_scale: Any = None
        #: What sparse outputs are multiplied by: scale / world.
        self.out_scale: Any = 1.0
        #: ``time.perf_counter()`` at the first submit, host seconds in submit.
        self.started: Optional[float] = None
        self.submit_seconds = 0.0
        self.trace: Optional[StepTrace] = None

    def begin(self, ops: ArrayOps, scale: Any, world: int, average: bool) -> None:
        """At the first gradient: the step's loss scale (``None`` for 1) and
        output factor; timed layer by layer if :attr:`timed_next` asked."""
        self.open = True
        self.started = time.perf_counter()
        self.trace = StepTrace() if self.timed_next else None
        self.timed_next = False
        base = 1.0 / world if average else 1.0
        self.scale = scale
        if scale is None:
            self.inv_scale, self.out_scale = None, base
        else:
            self.inv_scale = ops.reciprocal(scale)
            self.out_scale = ops.mul(scale, base) if base != 1.0 else scale


def verdict(
    ops: ArrayOps, counts: Any, dense: Sequence[Any], on_device: bool
) -> Tuple[Any, Optional[np.ndarray]]:
    """Whether a step was finite on every rank: no count word is negative (a
    sparse member non-finite on some rank carries -1, and every rank sees
    every rank's words) and no dense output is NaN or infinite.

    ``counts``: the step's count words (None without sparse members);
    ``dense``: the dense outputs to check. ``on_device``: the verdict as a 0-d
    device bool, nothing read. Else one host read, the step's only one, of
    the verdict and the count words (which the controllers learn from):
    ``(finite, host words or None)``."""
    dense_flag = ops.any_nonfinite(list(dense)) if dense else None
    if on_device:
        flags = [] if counts is None else [ops.any_negative_rows(counts, 1)]
        flags += [] if dense_flag is None else [dense_flag]
        return ops.none_true(flags), None
    if counts is None:
        return dense_flag is None or not ops.to_host(dense_flag), None
    if dense_flag is None:
        host = np.asarray(ops.to_host(counts)).reshape(-1)
        return bool(host.min() >= 0), host
    flag = ops.cast(ops.reshape(dense_flag, (1,)), "int32")
    host = np.asarray(ops.to_host(ops.concat([flag, counts]))).reshape(-1)
    return bool(host[0] == 0 and host[1:].min() >= 0), host[1:]


def nonfinite_names(
    ops: ArrayOps,
    laid: Any,
    records: Sequence[LayerRecord],
    bad: Any,
    dense_out: Dict[int, Any],
    external: Sequence[Tuple[int, Any]],
) -> List[str]:
    """The layers whose reduced gradient is non-finite in a step under way
    (before its end), laid out as ``laid`` (the step's
    :class:`~dlgs.core.exchange.messages.Messages`): the sparse members the transport
    flagged (``bad``, or None), each member of a merged dense message
    (``dense_out``: its first layer's index to the reduced tensor) checked on
    its own; ``external``: ``(layer index, tensor)`` the caller reduced. One
    host read per layer: for reports only."""
    names = []
    if laid.sparse_members and bad is not None:
        flags = ops.to_host(bad)
        names += [records[i].name for i, b in zip(laid.sparse_members, flags) if b]
    parts = list(external)
    for first, t in dense_out.items():
        parts += laid.members_of(ops, laid.records[records[first].group], t, records)
    for i, t in parts:
        if ops.to_host(ops.any_nonfinite([t])):
            names.append(records[i].name)
    return names
