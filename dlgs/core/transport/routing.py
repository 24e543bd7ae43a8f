"""``transport="auto"``: each sparse message by allgather or by the sparse
reduction, whichever is predicted faster.

A :class:`RoutingTransport` holds a :class:`~dlgs.core.transport.flat.FlatTransport`
and a :class:`~dlgs.core.transport.reduction.ReducingTransport` and hands each message
to one of them. A message's route is the plan's where the merge planner chose
it (``GroupLayout.transport``, set from the DP's per-message choice, which
priced both with the job's measured allgather), else the rule
:func:`~dlgs.core.planning.dp.sparse_transport` on the message's flat chunk bytes
with a default link model (:data:`DEFAULT_LINK`: ring collectives at 10
Gbit/s and the catalog's ring-step latency): the reduction for large messages
from three ranks on, the allgather for small ones and two ranks. Every input
of the choice is a size, an option or the agreed plan, so every rank routes
alike without a handshake. The route is in the layout's fingerprint, which the
allgather checks; the reduction does not check fingerprints yet, so a plan set
differently on different ranks (``set_plan`` by hand) is not reported there.

The step's count words and non-finite flags come back in message order as
the exchange expects: the two transports' own orders are put back with one
gather (flags) and one host permutation (count words, already on the host).
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy as np

from ..backend import ArrayOps
from ..planning.dp import sparse_transport
from ..planning.netmodel import DEFAULT_LATENCY_S, allgather_cost, reduction_cost
from ..wire import GroupLayout

__all__ = ["DEFAULT_LINK_BPS", "RoutingTransport", "default_route"]

#: The link rate the default rule assumes where no plan chose (bit/s).
DEFAULT_LINK_BPS = 10e9


def default_route(layout: GroupLayout, parts: int, width: float) -> str:
    """The route of a message no plan chose: :func:`sparse_transport` with
    ring collectives at :data:`DEFAULT_LINK_BPS` and the catalog's latency."""
    if parts < 3:  # the reduction's blocks are no smaller than the allgather's
        return "allgather"
    link = allgather_cost(parts, DEFAULT_LINK_BPS, DEFAULT_LATENCY_S)
    return sparse_transport(link, reduction_cost(link, parts, width), 4 * layout.chunk_words)


class RoutingTransport:
    """A :class:`~dlgs.core.transport.flat.Transport` that sends each sparse
    message through ``flat`` or ``reducing`` (see the module's docstring)."""

    name = "auto"

    def __init__(self, ops: ArrayOps, comm: Any, flat: Any, reducing: Any, width: float):
        self.ops, self.comm, self.width = ops, comm, width
        self.subs = (flat, reducing)
        #: Per message: which transport (0 flat, 1 reducing) and its index there.
        self.routes: List[Tuple[int, int]] = []
        self.counts: Any = None
        self.bad: Any = None
        self._order: Any = None  # device: the flags' message order in (flat, reducing) order
        self._words: List[np.ndarray] = []  # host: the same for one rank's count words
        self._members: Tuple[int, int] = (0, 0)

    def route(self, layout: GroupLayout) -> int:
        """0 (allgather) or 1 (reduction) for a message of ``layout``."""
        choice = layout.transport or default_route(layout, self.comm.size, self.width)
        return int(choice == "reduce")

    def layout(self, layouts: Sequence[GroupLayout], like: Any) -> List[List[Any]]:
        ops = self.ops
        split: Tuple[List[GroupLayout], List[GroupLayout]] = ([], [])
        self.routes = []
        for layout in layouts:
            sub = self.route(layout)
            self.routes.append((sub, len(split[sub])))
            split[sub].append(layout)
        outs = [sub.layout(part, like) for sub, part in zip(self.subs, split)]
        self._members = (sum(la.members for la in split[0]), sum(la.members for la in split[1]))
        # Member m of the message order sits at position order[m] of the
        # flat transport's members followed by the reducing one's.
        starts: List[List[int]] = [[], []]
        for sub, part in enumerate(split):
            at = sum(self._members[:sub])
            for lay in part:
                starts[sub].append(at)
                at += lay.members
        order: List[int] = []
        for (sub, k), layout in zip(self.routes, layouts):
            order += range(starts[sub][k], starts[sub][k] + layout.members)
        self._order = ops.index_vector(order, like) if order else None
        self._words = [np.asarray(order, np.int64)]
        self.counts = self.bad = None
        return [outs[sub][k] for sub, k in self.routes]

    def start(self, message: int, chunk: Any, name: str) -> Any:
        sub, k = self.routes[message]
        return self.subs[sub].start(k, chunk, name)

    def finish(self, handles: Sequence[Any], verify: Sequence[bool], scale: Any) -> Any:
        ops = self.ops
        parts: Tuple[List[Any], List[Any]] = ([], [])
        checks: Tuple[List[bool], List[bool]] = ([], [])
        for (sub, _), handle, full in zip(self.routes, handles, verify):
            parts[sub].append(handle)
            checks[sub].append(full)
        flags, words = [], []
        for sub, transport in enumerate(self.subs):
            if parts[sub]:
                flags.append(transport.finish(parts[sub], checks[sub], scale))
                words.append(transport.counts)
        both = flags[0] if len(flags) == 1 else ops.concat(flags)
        self.bad = ops.take(both, self._order)
        self.counts = words[0] if len(words) == 1 else ops.concat(words)
        return self.bad

    def own_counts(self, words: Any, rank: int, size: int) -> Any:
        """This rank's count words, in message order: the allgather's are
        every rank's (rank-major), the reduction's this rank's."""
        words = np.asarray(words)
        flat, reduced = self._members
        mine = []
        if flat:
            mine.append(np.asarray(self.subs[0].own_counts(words[: size * flat], rank, size)))
        if reduced:
            mine.append(np.asarray(self.subs[1].own_counts(words[size * flat :], rank, size)))
        both = np.concatenate(mine) if len(mine) > 1 else mine[0]
        return both[self._words[0]]

    def message_bytes(self, layout: GroupLayout) -> int:
        return int(self.subs[self.route(layout)].message_bytes(layout))

    def returned(self) -> List[List[Any]]:
        back = self.subs[1].returned()
        if not any(sub for sub, _ in self.routes):
            return []  # everything went by allgather, which delivers it all
        return [back[k] if sub else [] for sub, k in self.routes]

    def state(self) -> Any:
        return self.subs[1].state()

    def load_state(self, state: Any) -> None:
        self.subs[1].load_state(state)
