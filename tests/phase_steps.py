"""Driving the planner's decisions (:mod:`dlgs.core.planning.phases`) without ranks.

:func:`settle` plays the driver's part with one rank: a broadcast returns
the value itself (rank 0's), a probe the models given, a vote the words
given, and a density set shows in the next view.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, List, Optional, Sequence, Tuple

from dlgs.core.exchange.records import StepRecord, StepTrace
from dlgs.core.planning.phases import (
    Broadcast,
    Probe,
    Probed,
    ReadVote,
    SetDensity,
    Shared,
    Snapshot,
    SnapshotLayer,
    Voted,
    decide,
)


def settle(
    options,
    state,
    view: Snapshot,
    event,
    *,
    probed: Optional[Probed] = None,
    votes: Sequence[int] = (0, 0),
) -> Tuple[Any, Snapshot, List[Any]]:
    """Decide on ``event`` and answer every result asked for, until none is:
    the final state, the view with the densities set, and every action."""
    actions: List[Any] = []
    while event is not None:
        state, acts = decide(options, state, view, event)
        actions.extend(acts)
        event = None
        for action in acts:
            if isinstance(action, SetDensity):
                view = replace(view, density=action.density, auto_layers=action.layers)
            elif isinstance(action, Broadcast):
                event = Shared(action.value)
            elif isinstance(action, Probe):
                assert probed is not None, "a probe was asked for"
                event = probed
            elif isinstance(action, ReadVote):
                event = Voted(tuple(votes))
    return state, view, actions


def snapshot(sizes, config, *, step=1, density=None, sparse_from=1024, **kw) -> Snapshot:
    """A view of an exchange of ``sizes`` [(name, numel)] (sparse from
    ``sparse_from`` elements)."""
    layers = tuple(SnapshotLayer(name, n, n >= sparse_from) for name, n in sizes)
    dense = sum(n for _, n in sizes) * 4
    if density is None:
        density = config.density if isinstance(config.density, float) else 0.01
    kw.setdefault("dense_bytes", dense)
    kw.setdefault("wire_bytes", dense // 10)
    return Snapshot(step=step, config=config, layers=layers, density=density, **kw)


def traced(step, n_layers, end, *, gap=0.001, seconds=None) -> StepRecord:
    """A step whose layers arrived ``gap`` apart (last index first) and whose
    wait ended at ``end`` seconds after the first gradient."""
    arrive = {i: (n_layers - 1 - i) * gap for i in range(n_layers)}
    done = {i: t + gap / 2 for i, t in arrive.items()}
    trace = StepTrace(arrive=arrive, done=done, waited=end)
    return StepRecord(step, end if seconds is None else seconds, 0.0, (True,) * n_layers, trace)


def untraced(step, n_layers, seconds) -> StepRecord:
    return StepRecord(step, seconds, 0.0, (True,) * n_layers, None)
