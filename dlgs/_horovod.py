"""What both adapters' Horovod collectives share (no framework import: the
framework's Horovod module is a class attribute of the subclass)."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import logging
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .core.state.consistency import horovod_options
from .core.transport.topology import node_ranks, several_nodes, strays

__all__ = [
    "EXIT_BARRIER_SECONDS",
    "explain_shutdown",
    "left_ranks",
    "FAILED_EXIT_SECONDS",
    "end_a_failed_exit_after",
    "HorovodSet",
    "check_dense_dtype",
    "check_two_level_set",
    "methods_of",
    "node_and_cross_sets",
    "shutdown_explained",
    "explained",
    "two_levels",
    "watch_exit",
]

logger = logging.getLogger(__name__)

# Class attributes that are not methods to copy into a generated class.
_NOT_COPIED = {
    "__dict__",
    "__weakref__",
    "__module__",
    "__qualname__",
    "__doc__",
    "__annotations__",
}


def methods_of(*classes: type) -> Dict[str, Any]:
    """The methods and properties ``classes`` define (later ones win), for a
    class generated the way Horovod generates its optimizer and tape classes
    (a new class over the user's, with these members copied in)."""
    return {k: v for c in classes for k, v in c.__dict__.items() if k not in _NOT_COPIED}


class HorovodSet:
    """Horovod's reduction options and process-set membership.

    Subclasses set ``hvd`` (``horovod.torch`` or ``horovod.tensorflow``). On a
    rank outside ``process_set``, ``included`` is False, ``rank`` is -1 and
    nothing may be issued: the adapters skip the exchange there, as Horovod's
    optimizer and tape do.

    Args:
        op: ``hvd.Average`` or ``hvd.Sum`` (for the dense allreduces).
        prescale_factor / postscale_factor: as Horovod's allreduce.
        process_set: Horovod process set.
        compression: Horovod compression for dense layers (e.g. ``hvd.Compression.fp16``).
    """

    hvd: Any

    def __init__(self, op, prescale_factor, postscale_factor, process_set, compression):
        hvd = self.hvd
        self.op = op
        self.prescale_factor = prescale_factor
        self.postscale_factor = postscale_factor
        self.process_set = process_set
        self.compression = compression
        self._global = process_set is hvd.global_process_set
        self.included = self._global or bool(process_set.included())
        self._world = self._read_world()

    def _read_world(self):
        hvd = self.hvd
        if self._global:
            return hvd.size(), hvd.rank()
        # ProcessSet.rank() raises on a rank outside the set.
        return self.process_set.size(), (self.process_set.rank() if self.included else -1)

    def _live(self):
        """The global set's size and this rank, read from Horovod each time:
        Horovod Elastic's reset (``hvd.shutdown(); hvd.init()``) may change
        both (between the shutdown and the init, the last ones read). Another
        set's, as at construction: ``ProcessSet.size()`` asks whichever
        framework's Horovod library was imported last, and Elastic resets only
        the global set."""
        if self._global:
            try:
                self._world = self._read_world()
            except ValueError:  # Horovod not initialised (inside an elastic reset)
                pass
        return self._world

    @property
    def size(self) -> int:
        return self._live()[0]

    @property
    def rank(self) -> int:
        return self._live()[1]

    def options(self) -> Dict[str, Any]:
        """What every rank must agree on: op, scaling, compression, process set
        (device placement need not agree)."""
        return horovod_options(self, self.hvd)

    def broadcast_object(self, obj: Any) -> Any:
        """The set's first rank's ``obj`` on every rank of the set."""
        hvd = self.hvd
        root = 0 if self.process_set is hvd.global_process_set else self.process_set.ranks[0]
        return hvd.broadcast_object(
            obj, root_rank=root, name="dlgs.broadcast", process_set=self.process_set
        )


# -- the two-level exchange's process sets (every framework's Horovod) -----------------


def check_dense_dtype(config: Any, door: str) -> None:
    """Horovod 0.28.1 allreduces no bfloat16 tensor: ``dense_dtype="bfloat16"``
    is refused by name at a Horovod door (``ValueError``)."""
    if getattr(config.dense_dtype, "value", config.dense_dtype) == "bfloat16":
        raise ValueError(
            f"dense_dtype='bfloat16' is not supported by {door}: Horovod 0.28.1 cannot "
            "allreduce bfloat16 tensors. Use dense_dtype='float16' (or 'float32'), or "
            "bfloat16 through the DDP hook (dlgs.torch.ddp)"
        )


def check_two_level_set(hvd: Any, topology: str, op: Any = None, process_set: Any = None) -> None:
    """The two-level exchange averages over every rank of the job: with
    ``topology`` other than ``"flat"``, ``op`` (where the door takes one)
    must be ``hvd.Average`` and ``process_set`` the global set; ``ValueError``
    naming both otherwise."""
    if topology == "flat":
        return
    if (op is not None and op != hvd.Average) or (
        process_set is not None and process_set is not hvd.global_process_set
    ):
        raise ValueError(
            f"topology={topology!r} needs op=hvd.Average and the global process set "
            "(use topology='flat' with a process set or op=hvd.Sum)"
        )


def two_levels(
    hvd: Any,
    topology: str,
    ranks_per_node: Optional[int],
    collectives: Callable[[Any, Any], Tuple[Any, Any]],
) -> Optional[Callable[[], Tuple[Any, Any]]]:
    """The core engine's ``topology``: None (flat), or what makes the node
    and cross-node collectives (``collectives(node_set, cross_set)``, the
    framework's) on Horovod module ``hvd``; ``"auto"`` makes them where
    Horovod sees several ranks per node and several nodes (or
    ``ranks_per_node`` says so), and the engine then times both exchanges and
    keeps the faster."""
    if topology == "auto":
        several = several_nodes(hvd.size(), ranks_per_node or hvd.local_size())
        topology = "hierarchical" if several else "flat"
    watch_exit(hvd)
    if topology == "flat":
        return None

    def make():
        node, cross = node_and_cross_sets(hvd, ranks_per_node)
        watch_exit(hvd, barrier=True)
        return collectives(node, cross)

    return make


def node_and_cross_sets(hvd: Any, ranks_per_node: Optional[int]) -> Tuple[Any, Any]:
    """This rank's node and cross-node process sets, added to Horovod (a
    collective: every rank adds every set, in the same order).

    Nodes are ``ranks_per_node`` consecutive ranks, or Horovod's own
    (``hvd.local_size()``; ranks must then be laid out node by node, as
    horovodrun lays them out). Needs dynamic process sets
    (``hvd.init(process_sets="dynamic")`` or ``HOROVOD_DYNAMIC_PROCESS_SETS=1``)."""
    size, rank = hvd.size(), hvd.rank()
    local = ranks_per_node or hvd.local_size()
    nodes, crosses = node_ranks(size, local)
    if ranks_per_node is None:
        # One small gather: every rank where Horovod's node layout says it is.
        here = (hvd.local_rank(), hvd.local_size(), hvd.cross_rank())
        bad = strays(hvd.allgather_object((rank, here), name="dlgs.topology"), local)
        if bad:
            raise ValueError(
                f"topology='hierarchical': ranks {bad[:5]} are not laid out node by node "
                f"({local} per node as Horovod's local_size says); give ranks_per_node"
            )
    node_sets = [_process_set(hvd, ranks) for ranks in nodes]
    cross_sets = [_process_set(hvd, ranks) for ranks in crosses]
    return node_sets[rank // local], cross_sets[rank % local]


#: The process sets dlgs added, by their ranks: a second two-level exchange
#: (another model, or one built again) reuses them, as Horovod refuses to add
#: a set twice. Every rank builds its exchanges in the same order, so every
#: rank finds the same sets here.
_PROCESS_SETS: Dict[Tuple[int, ...], Any] = {}


def _process_set(hvd: Any, ranks: List[int]) -> Any:
    """The process set of ``ranks`` that dlgs added before and Horovod still
    holds, or a new one (a collective: every rank adds every set, in order)."""
    known = _PROCESS_SETS.get(tuple(ranks))
    if known is not None and known.process_set_id is not None:  # not removed since
        return known
    try:
        added = hvd.add_process_set(ranks)
    except ValueError as err:
        if "HOROVOD_DYNAMIC_PROCESS_SETS" in str(err):
            raise ValueError(
                "topology='hierarchical' adds a process set per node and per local rank: "
                "start Horovod with hvd.init(process_sets='dynamic') (or set "
                "HOROVOD_DYNAMIC_PROCESS_SETS=1 before hvd.init())"
            ) from None
        if "duplicate" in str(err):
            raise ValueError(
                f"topology='hierarchical' adds the process set of ranks {ranks}, which exists "
                "already (added by the script, or at hvd.init(process_sets=...)): leave "
                "dlgs's node and cross-node sets to dlgs"
            ) from None
        raise
    _PROCESS_SETS[tuple(ranks)] = added
    return added


#: The exit handler's settings: registered (once per process), whether a
#: two-level exchange needs the barrier, and the job's size (for
#: :func:`explain_shutdown`, which runs after Horovod is down).
_EXIT: Dict[str, Any] = {"registered": False, "barrier": False, "size": 1}

#: How long the exit barrier waits for the other ranks (seconds). At the
#: end of a job every rank reaches it within the last step's node collectives
#: of one another (each node finishes the step on its own; milliseconds apart,
#: as the exchange between nodes completes on every node at once), and the
#: barrier then completes at once. A rank that leaves while the others still
#: train (``sys.exit(n)``, a return from the script, a data loader with fewer
#: batches) waits this long for ranks that never come (they are in a step
#: that needs this rank), then shuts Horovod down, which ends them with an
#: error: so this bound is how long a rank that leaves early holds the job.
EXIT_BARRIER_SECONDS = 3.0

#: How long a rank that exits on an uncaught exception gives Horovod's own
#: shutdown (seconds) before it ends its process itself. Horovod's shutdown
#: of a failing rank takes a fraction of a second; where its background thread
#: is held in a Gloo operation that no peer joins, it would end only at Gloo's
#: timeout (30 s by default), and every other rank with it.
FAILED_EXIT_SECONDS = 2.0


def _failing() -> bool:
    """Whether this interpreter is exiting on an uncaught exception (Python
    sets ``sys.last_value`` before it runs the ``atexit`` handlers). A rank
    that leaves by ``sys.exit`` or by returning is not told apart here: the
    bounded barrier covers every way out."""
    return (
        getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None
    )


def watch_exit(hvd: Any, barrier: bool = False) -> None:
    """Make every way this rank can leave end the other ranks within seconds
    (an ``atexit`` handler, registered once, that runs before Horovod's own
    shutdown: handlers run last-registered first).

    ``barrier``: a two-level exchange is in use. A step's last collectives
    then run within each node, so one node can finish its last step and exit
    while another still completes its own, and Horovod would shut down under
    it ("Horovod has been shut down"). So at exit every rank waits for the
    others in one tiny object gather, for at most :data:`EXIT_BARRIER_SECONDS`
    (on a daemon thread); at the end of a job it completes at once.

    The bound is what makes every way of leaving safe. A rank that leaves
    while the others train (``sys.exit`` with any status, a return from the
    script) finds no one at the barrier: the others are blocked in a step that
    needs it. It stops waiting after the bound, says that it left, and shuts
    Horovod down, which ends every other rank with ``HorovodInternalError``
    (:func:`explain_shutdown` adds which rank left where the launcher tells).
    A rank that exits on an uncaught exception does not wait at all (the
    others are certainly blocked), and neither does one whose Horovod is down
    already. Where the barrier did not complete, this rank's own exit is
    bounded too (:func:`end_a_failed_exit_after`): its Horovod shutdown, held
    in a Gloo operation, would otherwise hold every rank until Gloo's timeout.
    Without the barrier (flat exchanges) a leaving rank shuts Horovod down at
    once. A rank ended by ``os._exit`` or a signal runs no handler: its
    closed sockets end the others' collectives, and the launcher the job."""
    try:
        _EXIT["size"] = hvd.size()
    except ValueError:  # not initialised: the constructor fails on it next
        pass
    _EXIT["barrier"] = _EXIT["barrier"] or barrier
    if _EXIT["registered"]:
        return
    _EXIT["registered"] = True

    def gather() -> None:
        try:
            hvd.allgather_object(0, name="dlgs.exit")
        except Exception:  # noqa: BLE001 - Horovod down or not initialised: nothing to wait for
            logger.debug("dlgs: no exit barrier (Horovod is shut down)")

    def at_exit() -> None:
        if _failing():
            logger.debug("dlgs: no exit barrier (this rank is exiting on an exception)")
            _announce_leaving(hvd, "an uncaught exception")
            end_a_failed_exit_after(FAILED_EXIT_SECONDS)
            return
        if not _EXIT["barrier"]:
            # Nothing tells a normal end from an early one here; the note
            # matters only if another rank's step then fails.
            _announce_leaving(hvd, "its script ended or called sys.exit")
            return
        waiting = threading.Thread(target=gather, name="dlgs-exit", daemon=True)
        waiting.start()
        waiting.join(EXIT_BARRIER_SECONDS)
        if waiting.is_alive():
            _announce_leaving(hvd, "its script ended or called sys.exit while the others train")
            logger.error(
                "dlgs: rank %s left the job while the other ranks still train (none "
                "reached exit within %.0f s): their steps end with an error",
                _rank_or_unknown(hvd),
                EXIT_BARRIER_SECONDS,
            )
            end_a_failed_exit_after(FAILED_EXIT_SECONDS)

    atexit.register(at_exit)


def end_a_failed_exit_after(seconds: float) -> None:
    """Bound the exit of a rank that fails: if the interpreter is still
    alive ``seconds`` from now (its remaining exit handlers, Horovod's
    shutdown among them, held up), print every thread's stack and end the
    process with status 1. Its sockets close, so the peers' collectives fail
    at once and ``horovodrun`` ends the job, as after any failed rank. The
    exit handlers not yet run by then are skipped (the rank is failing
    already; standard output and error are flushed): a handler registered
    before dlgs's that needs longer (an experiment tracker's upload, say) is
    cut short. A daemon thread: an exit that completes in time ends it with
    the process."""

    def end() -> None:
        time.sleep(seconds)
        try:
            logger.error(
                "dlgs: this rank failed and its exit (Horovod's shutdown) did not end "
                "within %.0f s; ending the process (stacks follow)",
                seconds,
            )
            faulthandler.dump_traceback(all_threads=True)
        finally:  # whatever the streams are, the process ends
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 - closed or replaced: nothing to keep
                    pass
            os._exit(1)

    threading.Thread(target=end, name="dlgs-failed-exit", daemon=True).start()


# -- which rank left -------------------------------------------------------------------
#
# The ranks that stay learn only that Horovod shut down. Under horovodrun's
# Gloo launcher every rank can reach the launcher's key-value store (the
# rendezvous server, ``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``_PORT``): a rank that
# leaves writes a line there before its shutdown, and the others read it when
# their step fails. Elsewhere (MPI, a launcher of one's own) the leaving
# rank's own log line says which.

_LEFT_SCOPE = "dlgs_left"
#: The store's requests are bounded: a failing job must not wait on them.
_STORE_TIMEOUT_S = 1.0
#: Entries older than this at a failure are another failure's (Horovod
#: Elastic's earlier rounds) and are not reported.
_LEFT_RECENT_S = 120.0


def _store_url(key: str) -> Optional[str]:
    addr = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    if not addr or not port:
        return None
    return f"http://{addr}:{port}/{_LEFT_SCOPE}/{key}"


def _rank_or_unknown(hvd: Any) -> str:
    try:
        return str(hvd.rank())
    except Exception:  # noqa: BLE001 - Horovod down: the rank is no longer known
        return "?"


def _announce_leaving(hvd: Any, how: str) -> None:
    """Tell the launcher's store that this rank is leaving (where there is
    one; never raises, bounded by :data:`_STORE_TIMEOUT_S`)."""
    rank = _rank_or_unknown(hvd)
    url = _store_url(f"rank{rank}")
    if url is None:
        return
    body = json.dumps({"rank": rank, "how": how, "time": time.time()}).encode()
    try:
        request = urllib.request.Request(url, data=body, method="PUT")
        urllib.request.urlopen(request, timeout=_STORE_TIMEOUT_S).close()
    except (OSError, ValueError, urllib.error.URLError):  # the launcher is gone: nothing to tell
        logger.debug("dlgs: could not record this rank's exit in the launcher's store")


def left_ranks(size: int) -> List[Tuple[int, str]]:
    """The ranks of a job of ``size`` that recorded leaving it lately (and
    how), read from the launcher's store: empty where there is none. Called
    only once a step failed; one request per rank, each bounded."""
    if _store_url("probe") is None:
        return []
    found, now, deadline = [], time.time(), time.monotonic() + 2 * _STORE_TIMEOUT_S
    for r in range(size):
        if time.monotonic() > deadline:
            break
        try:
            url = _store_url(f"rank{r}")
            with urllib.request.urlopen(url, timeout=_STORE_TIMEOUT_S) as reply:  # type: ignore[arg-type]
                entry = json.loads(reply.read().decode())
        except (OSError, ValueError, urllib.error.URLError):  # not there (404) or unreachable
            continue
        if now - float(entry.get("time", 0)) < _LEFT_RECENT_S:
            found.append((r, str(entry.get("how", "?"))))
    return found


def explain_shutdown(err: BaseException) -> BaseException:
    """``err`` (Horovod's "has been shut down" error in a step's collective)
    with a note naming the ranks that left, where the launcher's store tells
    (Python 3.11's exception notes; the type is kept, so Horovod Elastic
    still recovers from it), and logged."""
    if any(str(note).startswith("dlgs:") for note in getattr(err, "__notes__", ())):
        return err
    left = left_ranks(_EXIT["size"])
    if left:
        what = "; ".join(f"rank {r} left ({how})" for r, how in left)
        text = f"dlgs: {what}: the step this rank was in needed it"
    else:
        text = (
            "dlgs: another rank left the job or failed while this rank was in a step "
            "(its output says which: 'dlgs: rank N left the job', or its traceback)"
        )
    logger.error("%s", text)
    if hasattr(err, "add_note"):
        err.add_note(text)
    return err


@contextlib.contextmanager
def shutdown_explained() -> Iterator[None]:
    """Around a wait on a step's collective: Horovod's "has been shut down"
    error goes on with :func:`explain_shutdown`'s note (same type)."""
    try:
        yield
    except Exception as err:
        if "shut down" in str(err):
            explain_shutdown(err)
        raise


def explained(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a collective's start or wait) under
    :func:`shutdown_explained`: a rank between steps when another left meets
    Horovod's shutdown at its next start, not in a wait."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with shutdown_explained():
            return method(*args, **kwargs)

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    wrapper.__qualname__ = method.__qualname__
    return wrapper
