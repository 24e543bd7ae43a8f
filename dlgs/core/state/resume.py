"""Agreeing on a resumed state at a step every rank reaches: the verdict (pure
functions) and the one gather that feeds it (:func:`agree_shared`).

Horovod's resume recipe loads a checkpoint on rank 0 only and hands it to the
other ranks with ``hvd.broadcast_parameters`` and
``hvd.broadcast_optimizer_state``: ``load_state_dict`` then runs on one rank
and ``state_dict`` on every rank, each from inside Horovod's own code. A
collective in either would hang the job, so neither issues one.
What every rank must agree on after a load (the step, the merge plan, the
planner's profile and ``density="auto"``'s choice: everything that names or
shapes a message) is agreed instead at the first gradient of the next step,
which every rank reaches: one gather of each rank's :func:`shared` state and
whether it loaded one (:class:`SyncRecord`), judged here the same way on every
rank (:func:`resolve`). The same agreement runs after a Horovod Elastic reset
(every rank of the new world) and after ``resync()``; a load after training
began runs none (the other ranks would not join it).

* Every rank holds the same shared state: nothing to do (each rank loaded its
  own file of the same step, or none did).
* Some ranks loaded a checkpoint and agree with each other, the others did not
  load one (Horovod's recipe): the others take the lowest loading rank's shared
  state. Their residuals (what they had not sent yet) stay as they were, empty
  in a fresh job, and their thresholds restart from the density; the parameters
  and the wrapped optimizer's state come from Horovod's broadcasts.
* Ranks that loaded disagree, or no rank loaded and yet they differ: a
  :class:`~dlgs.core.state.consistency.RankMismatchError` on every rank, never a
  hang.
"""

from __future__ import annotations

import logging
import threading
import zlib
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple

from .consistency import RankMismatchError

__all__ = [
    "RESYNC_WAIT_SECONDS",
    "GROUP_KEYS",
    "SHARED_KEYS",
    "Agreement",
    "Resolution",
    "SyncRecord",
    "agree_shared",
    "digest",
    "resolve",
    "shared",
]

#: How long the agreement that ``resync()`` asks for waits for the other
#: ranks (seconds). ``resync()`` is a collective: every rank calls it between
#: the same two steps, and the ranks meet at the next step's first gradient,
#: each as soon as it gets there (so this is also how far behind the slowest
#: rank may arrive). A rank that called it alone would wait for ranks that are
#: in their step's collectives, waiting for it: after this long it raises
#: :class:`~dlgs.core.state.consistency.RankMismatchError` instead, and its
#: exit ends the others.
RESYNC_WAIT_SECONDS = 60.0

logger = logging.getLogger(__name__)

#: The keys of an exchange's ``state_dict()`` that every rank must agree on.
SHARED_KEYS = ("step", "plan", "hooks", "auto_density", "auto_layers", "regions")
#: Of those, the ones agreed only among the ranks that move bytes together
#: where the agreement spans several such groups (a two-level exchange's
#: cross-node sets each keep their own reduction regions, and each splits a
#: byte budget between its own shards).
GROUP_KEYS = ("regions", "auto_layers")


def shared(state: Dict[str, Any]) -> Dict[str, Any]:
    """The part of an exchange state every rank must agree on (plain data)."""
    return {key: state.get(key) for key in SHARED_KEYS}


def digest(part: Dict[str, Any]) -> int:
    """A checksum of a :func:`shared` state, equal on ranks holding equal ones
    (the ``repr`` of plain Python data: unlike a pickle it does not depend on
    which equal objects happen to be one object, and NaN equals NaN)."""
    return zlib.crc32(repr(part).encode())


class SyncRecord(NamedTuple):
    """What one rank contributes to the agreement."""

    #: This rank loaded a state since the last agreement (any state: one that
    #: equals the state in force too, so that a rank whose file is current is
    #: never rolled back to another rank's stale one).
    loaded: bool
    #: :func:`shared` of this rank's state now.
    shared: Dict[str, Any]


class Resolution(NamedTuple):
    """:func:`resolve`'s verdict, the same on every rank."""

    #: The rank whose shared state the others take, or None: all agree.
    root: Optional[int]
    #: The ranks that take it (did not load a checkpoint).
    adopters: List[int]


def resolve(records: Sequence[SyncRecord]) -> Resolution:
    """Judge every rank's :class:`SyncRecord` (in rank order).

    Raises:
        RankMismatchError: ranks that loaded a checkpoint hold different
            shared states (files of different steps or jobs), or ranks differ
            without any of them having loaded one.
    """
    digests = [digest(r.shared) for r in records]
    if len(set(digests)) <= 1:
        return Resolution(None, [])
    loaded = [rank for rank, r in enumerate(records) if r.loaded]
    if not loaded:
        raise RankMismatchError(
            "ranks hold different dlgs states without a checkpoint loaded: "
            + _differences(records, 0, range(1, len(records)))
        )
    root = loaded[0]
    disagree = [rank for rank in loaded if digests[rank] != digests[root]]
    if disagree:
        raise RankMismatchError(
            "ranks loaded dlgs states that disagree (load each rank's own checkpoint of the "
            "same step, or load on one rank and let the others receive it): "
            + _differences(records, root, disagree)
        )
    return Resolution(root, [rank for rank in range(len(records)) if not records[rank].loaded])


def _differences(records: Sequence[SyncRecord], root: int, others) -> str:
    """Which shared keys differ between ``root`` and each of ``others``."""
    ref = records[root].shared
    problems = []
    for rank in others:
        for key in SHARED_KEYS:
            a, b = ref.get(key), records[rank].shared.get(key)
            if a != b:
                if key == "hooks":  # the planner's profile: long, name it by checksum
                    a, b = (f"crc {zlib.crc32(repr(x).encode())}" for x in (a, b))
                problems.append(f"{key} {b!r:.60} on rank {rank} but {a!r:.60} on rank {root}")
    return "; ".join(problems[:4]) or "their states differ"


class _Gather(Protocol):
    rank: int
    size: int

    def allgather_object(self, obj: Any, name: str) -> List[Any]: ...


def agree_shared(
    comm: _Gather, loaded: bool, mine: Dict[str, Any], name: str, group: Optional[int] = None
) -> Optional[Dict[str, Any]]:
    """The agreement at the first gradient after construction or a load: one
    gather of every rank's :class:`SyncRecord` (``loaded``, its :func:`shared`
    state ``mine``) on ``comm``, judged alike on every rank by
    :func:`resolve` (a :class:`~dlgs.core.state.consistency.RankMismatchError`
    where ranks that loaded disagree). With ``group`` (which of several sets
    moving bytes apart this rank is in), :data:`GROUP_KEYS` are judged among
    the ranks of each group alone. Returns the shared state this rank must
    put in force, or None (logged on rank 0 when some rank adopts one)."""
    if comm.size <= 1:
        return None
    gathered = comm.allgather_object((loaded, mine, group), name)
    keys = SHARED_KEYS if group is None else tuple(k for k in SHARED_KEYS if k not in GROUP_KEYS)
    verdict = resolve([SyncRecord(lo, _keys(part, keys)) for lo, part, _ in gathered])
    adopt = _adopted(comm, gathered, verdict, keys)
    if group is None:
        return adopt
    members = [r for r, (_, _, g) in enumerate(gathered) if g == group]
    inside = resolve(
        [SyncRecord(gathered[r][0], _keys(gathered[r][1], GROUP_KEYS)) for r in members]
    )
    if inside.root is not None and members.index(comm.rank) in inside.adopters:
        theirs = _keys(gathered[members[inside.root]][1], GROUP_KEYS)
        return dict(adopt if adopt is not None else mine, **theirs)
    return None if adopt is None else dict(adopt, **_keys(mine, GROUP_KEYS))


def _keys(state: Dict[str, Any], keys: Sequence[str]) -> Dict[str, Any]:
    return {key: state.get(key) for key in keys}


def _adopted(comm: _Gather, gathered, verdict: Resolution, keys) -> Optional[Dict[str, Any]]:
    """``keys`` of the root's shared state where this rank adopts it (logged
    on rank 0 when some rank does), else None."""
    if verdict.root is None:
        return None
    part = _keys(gathered[verdict.root][1], keys)
    logger.log(
        logging.WARNING if comm.rank == 0 else logging.DEBUG,
        "dlgs: rank %d resumed from a checkpoint of step %d and rank(s) %s did not load "
        "one: they take its step, merge plan, profile and density; their residuals "
        "(what they had not sent yet) are not in the checkpoint and their thresholds "
        "start afresh. To resume every rank's residuals, save and load one dlgs state "
        "per rank (docs/design.md, 'Checkpoints and residuals')",
        verdict.root,
        part["step"],
        ", ".join(map(str, verdict.adopters)),
    )
    return part if comm.rank in verdict.adopters else None


class Agreement:
    """When an exchange's ranks agree, and the agreement itself.

    Due after construction, a load, Horovod Elastic's reset to another world
    and ``resync()``; run by :meth:`run` at the next step's first gradient,
    which every rank reaches.

    Args:
        comm: where the ranks agree (the process set; a two-level exchange:
            every rank of the job).
        name: the gather's collective name.
        group: see :func:`agree_shared`.
    """

    def __init__(self, comm: _Gather, name: str, group: Optional[int] = None):
        self.comm = comm
        self.name = name
        #: Which group of ranks moving bytes together this rank is in, where
        #: ``comm`` spans several (:func:`agree_shared`); None: one.
        self.group = group
        #: The next step's first gradient agrees first.
        self.pending = True
        #: A state was loaded since the last agreement (it takes part as one).
        self.loaded = False
        #: (size, rank) at the last agreement, None before the first.
        self.world: Optional[Tuple[int, int]] = None
        #: A state loaded while training: its shared part, for the next agreement.
        self.stashed: Optional[Dict[str, Any]] = None
        #: The next agreement was asked for by ``resync()``, which a rank may
        #: call alone by mistake: it waits at most :data:`RESYNC_WAIT_SECONDS`.
        self.bounded = False
        #: Under Horovod Elastic: the check that every rank has the same
        #: layers and options, run at each agreement (every rank) instead of
        #: at construction; None elsewhere.
        self.elastic_check: Optional[Callable[[], None]] = None

    def world_changed(self) -> Optional[Tuple[int, int, int, int]]:
        """At a step's first gradient: ``(rank, size, old rank, old size)``
        when the job is now another world than at the last agreement (Horovod
        Elastic's reset), else None."""
        world = (self.comm.size, self.comm.rank)
        if self.world is None or world == self.world:
            return None
        return (world[1], world[0], self.world[1], self.world[0])

    @property
    def training(self) -> bool:
        """The ranks agreed and no agreement is due: a load now is this rank's
        alone (the others learn nothing of it)."""
        # Under Horovod Elastic a load is the restore every surviving rank
        # runs before the reset, after which every rank agrees. On one rank
        # there is no one to tell: a load takes the whole state.
        world, elastic = self.world, self.elastic_check is not None
        return world is not None and world[0] > 1 and not self.pending and not elastic

    def due(
        self, loaded: bool = False, holds_state: bool = False, bounded: bool = False
    ) -> Optional[Dict[str, Any]]:
        """Agree at the next gradient. ``loaded``: a state was just loaded;
        ``holds_state``: what this rank holds counts as a loaded state (an
        Elastic reset: a worker that joined takes it). Returns the state
        stashed by a load while training, whose shared part the caller puts
        in force first (it then takes part as a load), or None."""
        self.bounded = self.bounded or bounded
        stashed, self.stashed = (None, self.stashed) if loaded else (self.stashed, None)
        self.loaded = self.loaded or loaded or holds_state or stashed is not None
        self.pending = True
        return stashed

    def run(self, mine: Callable[[], Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """The agreement: :func:`agree_shared` of ``mine()`` (this rank's
        shared state), after the Elastic check. Returns the shared state to
        put in force, or None."""
        self.pending, self.stashed = False, None
        loaded, self.loaded = self.loaded, False
        bounded, self.bounded = self.bounded, False
        self.world = (self.comm.size, self.comm.rank)
        if self.comm.size <= 1:
            return None
        if self.elastic_check is not None:
            self.elastic_check()
        comm = _Bounded(self.comm, RESYNC_WAIT_SECONDS) if bounded else self.comm
        return agree_shared(comm, loaded, mine(), self.name, self.group)


class _Bounded:
    """``comm``'s gather, waited for at most ``seconds`` (on a daemon thread;
    one left waiting is ended by the exit that follows the error)."""

    def __init__(self, comm: Any, seconds: float):
        self.comm, self.seconds = comm, seconds
        self.size, self.rank = comm.size, comm.rank

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        result: Dict[str, Any] = {}

        def gather() -> None:
            try:
                result["value"] = self.comm.allgather_object(obj, name)
            except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread
                result["error"] = err

        waiting = threading.Thread(target=gather, name="dlgs-resync", daemon=True)
        waiting.start()
        waiting.join(self.seconds)
        if "error" in result:
            raise result["error"]
        if "value" not in result:
            raise RankMismatchError(
                f"resync() or reprofile() on rank {self.rank}: the other ranks did not reach "
                f"the agreement it asked for within {self.seconds:.0f} s. Both are collective "
                "here: call them on every rank between the same two steps (a checkpoint "
                "loaded on one rank alone needs no resync())"
            )
        return result["value"]
