"""What both adapters' Horovod collectives share (no framework import: the
framework's Horovod module is a class attribute of the subclass)."""

from __future__ import annotations

from typing import Any, Dict

from .core.state.consistency import horovod_options

__all__ = ["HorovodSet", "methods_of"]

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
