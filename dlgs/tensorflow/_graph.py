"""The exchange as graph ops inside the user's ``tf.function``.

Inside a traced training step, :class:`GraphSteps` puts the exchange into the
graph as a ``tf.cond`` of two branches:

* the **device** branch: the exchange's own per-step code (residual add,
  threshold and selection, packing, Horovod's graph collectives per planned
  message, unpacking, the residual kept only where the step was finite on
  every rank), traced once through the core's ``ArrayOps`` on TensorFlow ops
  (:class:`~dlgs.core.exchange.device.DeviceSteps`). No Python runs
  when it executes;
* the **host** branch: the eager step in one ``tf.py_function``, as before,
  for every step that needs the host (the first steps, profiling and
  planning, a warm-up stage or a new plan, a timed step, a log line, a
  controller that learns on the host).

Which branch runs is read from variables the host sets after each host step
(every rank computes the same values from agreed state, so every rank takes
the same branch): the layout version the graph was traced for, and how many
steps may run on the device before the host needs one. Steps that ran on the
device are counted into the exchange (``device.account``) at the next
host step or accessor.

A graph is for one layout: after a new plan the device branch is stale and
the host branch runs until the step is traced again. ``model.fit`` is traced
again by itself (its ``make_train_function(force=True)``); a custom loop
traced with :func:`dlgs.tensorflow.function` too; a plain ``tf.function``
keeps the host branch after a layout change (logged once).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, List, Optional

import tensorflow as tf

from ..core.exchange.schedule import DeviceSchedule
from ._ops import _read, as_input

__all__ = ["GraphSteps", "function"]

logger = logging.getLogger(__name__)

_LOCAL = threading.local()  # the dlgs.tensorflow.function being traced


class GraphSteps:
    """The device branch of one engine's exchange (see the module). When it
    may run is the core's :class:`~dlgs.core.exchange.schedule.DeviceSchedule`
    (:attr:`schedule`); this class holds the variables the branches read and
    the traced ops.

    Attributes:
        traces: how many times the device branch was traced.
        host_steps: steps that ran on the host (eagerly or in the host branch).
        device_steps: steps that ran on the device, counted so far.
    """

    def __init__(self, engine: Any):
        self._engine = weakref.proxy(engine)
        self.schedule = DeviceSchedule(self._engine)
        self.traces = 0
        self.host_steps = 0
        self.device_steps = 0
        self._vars: Optional[dict] = None
        self._listening = False
        self._pulling = False

    # -- the variables ------------------------------------------------------------
    def _variables(self) -> dict:
        if self._vars is None:
            with tf.init_scope():
                self._vars = {
                    "steps": tf.Variable(0, dtype=tf.int64, trainable=False),
                    "bad": tf.Variable(0, dtype=tf.int64, trainable=False),
                    "last_ok": tf.Variable(True, trainable=False),
                    "budget": tf.Variable(0, dtype=tf.int64, trainable=False),
                    "version": tf.Variable(-1, dtype=tf.int64, trainable=False),
                }
        return self._vars

    # -- tracing -------------------------------------------------------------------
    def step(self, grads: List[tf.Tensor], host: Callable[[], List[tf.Tensor]]) -> List[tf.Tensor]:
        """The traced step's reduced gradients: the ``tf.cond`` of the device
        branch and ``host`` (the ``py_function``), or ``host`` alone when the
        device branch cannot be traced (the core's ``DeviceSchedule.trace``)."""
        self.schedule.on_layout = _retrace_callback() or self.schedule.on_layout
        version = self.schedule.trace()
        if version is None:
            return host()
        v = self._variables()
        ex = self._engine.exchange
        self._listen(ex)
        use = tf.logical_and(tf.equal(v["version"], version), tf.not_equal(v["budget"], 0))
        self.traces += 1
        ex.device.keep_buffers()
        return tf.cond(use, lambda: self._device(grads), host)

    def _device(self, grads: List[tf.Tensor]) -> List[tf.Tensor]:
        engine = self._engine
        ex = engine.exchange
        ex.device.begin()
        try:
            reduced = engine.complete(lambda i: as_input(grads[engine.order[i]]), finish=False)
            ok = ex.device.finish()
        except BaseException:
            ex.abort_step()
            raise
        v = self._variables()
        bump = [
            v["steps"].assign_add(1),
            v["bad"].assign_add(tf.cast(tf.logical_not(ok), tf.int64)),
            v["last_ok"].assign(ok),
            v["budget"].assign(tf.where(v["budget"] > 0, v["budget"] - 1, v["budget"])),
        ]
        out = []
        with tf.control_dependencies(bump):
            for i, pos in enumerate(engine.order):
                g = grads[pos]
                t = tf.cast(tf.reshape(_read(reduced[i]), tf.shape(g)), g.dtype)
                t.set_shape(g.shape)
                out.append((pos, t))
        result: List[Any] = [None] * len(grads)
        for pos, t in out:
            result[pos] = t
        return result

    def _listen(self, ex: Any) -> None:
        if self._listening:
            return
        self._listening = True
        ref = weakref.ref(self)

        def host_next() -> None:  # a plan, density or timed step asked between steps
            me = ref()
            # This object, reached through a weak reference.
            variables = me._vars if me is not None else None  # noqa: SLF001
            if variables is not None and tf.executing_eagerly():
                variables["budget"].assign(0)

        ex.listeners.append(host_next)

    # -- the host's side ------------------------------------------------------------
    def pull(self) -> None:
        """Count the steps that ran on the device into the exchange (eager only)."""
        v = self._vars
        if v is None or self._pulling or not tf.executing_eagerly():
            return
        n = int(v["steps"].numpy())
        if not n:
            return
        self._pulling = True
        try:
            bad = int(v["bad"].numpy())
            self._engine.exchange.device.account(n, bad, bool(v["last_ok"].numpy()))
            self.device_steps += n
            v["steps"].assign(0)
            v["bad"].assign(0)
        finally:
            self._pulling = False

    def after_host_step(self) -> None:
        """After a host step: set what the core's schedule decided (eager only)."""
        self.host_steps += 1
        decided = self.schedule.after_host_step()
        if decided is None:
            return  # (not traced yet, or the two-level exchange: no device steps)
        if decided.traceable:
            self._variables()  # eagerly: a trace that creates variables is traced twice
        if self._vars is not None:
            self._vars["version"].assign(decided.version)
            self._vars["budget"].assign(decided.budget)


def _retrace_callback() -> Optional[Callable[[], None]]:
    """What traces the step being traced again: the :func:`function` being
    traced, or ``model.fit``'s ``make_train_function(force=True)``; None for a
    plain ``tf.function``."""
    target = getattr(_LOCAL, "retrace", None)
    if target is not None:
        return target
    model = _keras_model()
    if model is None:
        return None
    ref = weakref.ref(model)

    def retrace() -> None:
        found = ref()
        if found is not None:
            found.make_train_function(force=True)

    return retrace


def _keras_model() -> Any:
    """The Keras model whose train step is being traced, if any (found among
    the callers: Keras passes the optimizer no reference to it)."""
    import sys

    try:
        import keras
    except ImportError:  # pragma: no cover - keras comes with the TF adapter
        return None
    frame = sys._getframe(3)  # noqa: SLF001 - a stack walk (Keras passes no model)
    for _ in range(24):
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if isinstance(caller, keras.Model) and frame.f_code.co_name == "train_step":
            return caller
        frame = frame.f_back
    return None


def function(fn: Optional[Callable] = None, **kwargs: Any) -> Any:
    """``tf.function(fn, **kwargs)`` that is traced again when a dlgs
    exchange inside it settles a new layout, so that the exchange runs in the
    graph (see the module). Use it in place of ``tf.function`` on a custom
    training step with ``dlgs.tensorflow.DistributedGradientTape``::

        @dlgs.tensorflow.function
        def train_step(x, y):
            ...
    """
    if fn is None:
        return lambda f: function(f, **kwargs)
    return _Retraced(fn, kwargs)


class _Retraced:
    """What :func:`function` returns: a ``tf.function`` made anew on request."""

    def __init__(self, fn: Callable, kwargs: dict):
        self._fn = fn
        self._kwargs = kwargs
        self._made: Any = None
        self.retraces = 0

    def _retrace(self) -> None:
        self._made = None
        self.retraces += 1

    def _traced(self, *args: Any, **kw: Any) -> Any:
        previous = getattr(_LOCAL, "retrace", None)
        _LOCAL.retrace = self._retrace
        try:
            return self._fn(*args, **kw)
        finally:
            _LOCAL.retrace = previous

    def __call__(self, *args: Any, **kw: Any) -> Any:
        if self._made is None:
            self._made = tf.function(self._traced, **self._kwargs)
        return self._made(*args, **kw)

    @property
    def traced(self) -> Any:
        """The ``tf.function`` in force (None before the first call or after a retrace)."""
        return self._made

    def experimental_get_tracing_count(self) -> int:
        return 0 if self._made is None else self._made.experimental_get_tracing_count()
