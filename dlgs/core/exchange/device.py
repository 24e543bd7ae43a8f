"""Steps that run on the device alone: traced once into a graph (TensorFlow's
``tf.function``) and run many times with no host read.

Such a step submits and waits as a host step does, then ends with
:meth:`DeviceSteps.finish`: every layer keeps its new state where the step was
finite on every rank (:func:`dlgs.core.exchange.step.verdict`, on the device), and the
controllers learn from a copy of their bank on the device. The host's side of
a step (its count, the controllers' bank on the host, the step hooks) does not
run; the adapter counts such steps and hands them to
:meth:`DeviceSteps.account`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

from .._checks import check_int
from .step import verdict

if TYPE_CHECKING:
    from .internals import ExchangeInternals

__all__ = ["DeviceSteps"]


class DeviceSteps:
    """One exchange's steps on the device (its
    :attr:`~dlgs.core.exchange.exchange.SparseExchange.device`)."""

    def __init__(self, exchange: "ExchangeInternals"):
        self.exchange = exchange
        # The bank's vectors on the device (prepare()), the layout they are
        # for, and each sparse layer's position in them.
        self._bank: Optional[Dict[str, Any]] = None
        self._version = -1
        self._pos: Dict[int, int] = {}
        self._saved: Any = None  # begin()'s

    @property
    def active(self) -> bool:
        """A step of this kind is being traced (between :meth:`begin` and its end)."""
        return self._saved is not None

    def _current(self) -> bool:
        laid = self.exchange.messages
        return self._bank is not None and laid is not None and self._version == laid.version

    def ready(self, now: bool = True) -> Optional[str]:
        """None when the next step can run with device operations alone, else
        why not. Needs: the layout of the density in force made and verified,
        no agreement, timed step or relayout pending, a controller that learns
        nothing on the host, the allgather transport, and no dense layer still
        owing a residual. ``now=False``: whether such a step can be traced now,
        for later steps (an anchor due next is no obstacle; an agreement or a
        timed step due is: a submit would run it while tracing)."""
        ex = self.exchange
        laid = ex.messages
        if ex.in_step:
            return "a step is under way"
        if laid is None or ex.layout_due:
            return "the messages are laid out anew at the next step"
        if ex.agreement.pending:
            return "the ranks agree on the step and plan at the next step"
        if ex.current.timed_next:
            return "the next step is timed layer by layer"
        if laid.bank is not None:
            name = ex.config.controller.value
            if getattr(ex.ops, "vector_math", None) is None or ex.sender.kernels is not None:
                return f"the {name!r} controller learns on the host with these array ops"
            if now and laid.bank.steps_before_anchor() == 0:
                return "the next step anchors thresholds (on the host)"
            if not self._current():
                return "the controllers' state is not on the device (prepare_device_steps)"
        if ex.dense_external:
            return "dense layers are reduced by the caller"
        if ex.transport.name != "flat":
            return f"transport {ex.config.transport!r}"
        if any(not m.verified for m in laid.records if m.sparse):
            return "a message's layout is not verified across ranks yet"
        if any(la.residual is not None and not laid.sparse(la) for la in ex.records):
            return "a dense layer still owes its residual"
        return None

    def keep_buffers(self) -> None:
        """A step is traced with the layers' state buffers in force: from now
        on a host step copies its new state into them instead of swapping
        buffers (one copy per sparse layer per host step)."""
        self.exchange.sender.stable_buffers = True

    def budget(self) -> int:
        """How many steps may run on the device from here before one needs the
        host for the controllers (a threshold's anchor); -1: any."""
        laid = self.exchange.messages
        bank = laid.bank if laid is not None else None
        return -1 if bank is None else bank.steps_before_anchor()

    def prepare(self) -> None:
        """After a host step, before steps on the device: the controllers'
        learning state copied to the device (allocated once per layout; needs
        ``ops.vector_math``). No-op where no controller learns."""
        ex = self.exchange
        laid = ex.messages
        if laid is None or laid.bank is None or getattr(ex.ops, "vector_math", None) is None:
            return
        if not self._current():
            self._bank = laid.bank.to_device(ex.ops, ex.like)
            self._version = laid.version
            self._pos = {i: j for j, i in enumerate(laid.sparse_members)}
        else:
            self.push()

    def push(self) -> None:
        """The host bank's values into the device's copy in force (after a
        load), if there is one."""
        laid = self.exchange.messages
        if self._current() and laid is not None and laid.bank is not None:
            assert self._bank is not None
            laid.bank.push(self.exchange.ops, self._bank)

    def pull(self, finite_steps: int) -> None:
        """What ``finite_steps`` device steps taught the controllers, back
        into the host bank (the device's copy in force only)."""
        laid = self.exchange.messages
        if self._current() and laid is not None and laid.bank is not None:
            assert self._bank is not None
            laid.bank.pull(self.exchange.ops, self._bank, finite_steps)

    def threshold(self, i: int) -> Optional[Callable[[Any, Any], Any]]:
        """Inside :meth:`begin`'s step: layer ``i``'s threshold from the
        device bank's factor; None in a host step."""
        if self._saved is None or self._bank is None:
            return None
        ex = self.exchange
        ops, numel = ex.ops, ex.records[i].numel
        factor = ops.narrow(self._bank["factor"], 0, self._pos[i], 1)

        def threshold(absx: Any, total: Any) -> Any:
            return ex.controller.device_threshold(ops, factor, total, numel)

        return threshold

    def begin(self) -> None:
        """Before the submits of a step that ends with :meth:`finish`: what
        the last host step left for ``stats()`` and the verdict (each layer's
        count and threshold, the transport's count words) is kept and put
        back at its end, so that a step traced into a graph leaves none of
        the graph's tensors behind."""
        ex = self.exchange
        self._saved = (
            [(layer.count, layer.theta) for layer in ex.records],
            ex.transport.counts,
            ex.transport.bad,
        )

    def finish(self) -> Any:
        """End a step of :meth:`ready`'s kind (after ``wait(finish=False)``)
        with device operations alone: every sparse layer keeps its new
        residual (and every layer its new velocity, with momentum correction)
        where the step was finite on every rank, the old one otherwise.
        Returns that verdict (0-d bool)."""
        if self._saved is None:
            raise RuntimeError("device.finish() needs device.begin() before the step")
        ex = self.exchange
        ops, laid, step = ex.ops, ex.messages, ex.current
        assert laid is not None
        counts = ex.transport.counts if laid.sparse_members else None
        ok, _ = verdict(ops, counts, list(step.dense_out.values()), on_device=True)
        math, bank, dev = getattr(ops, "vector_math", None), laid.bank, self._bank
        if bank is not None and dev is not None and math is not None and counts is not None:
            # The controllers learn from this rank's counts, kept where finite.
            n = len(laid.sparse_members)
            own = ops.cast(ops.narrow(counts, 0, ex.comm.rank * n, n), "float64")
            vectors = {key: ops.cast(dev[key], "float64") for key in bank.keys}
            k1 = ops.cast(dev["k1"], "float64")
            for key, value in ex.controller.device_update(math, vectors, own, k1).items():
                ops.select_(dev[key], ok, value)
        for i in sorted(step.submitted):
            layer = ex.records[i]
            ex.sender.settle(layer, laid.sparse(layer), ok)
        ex.abort_step()  # the step's host bookkeeping, as before it
        return ok

    def account(self, steps: int, nonfinite: int = 0, last_finite: bool = True) -> None:
        """``steps`` steps ran on the device alone (:meth:`finish`),
        ``nonfinite`` of them not finite on some rank, the last one finite or
        not: count them into the exchange (and report the non-finite ones, as
        a host step would), and pull what the controllers learnt."""
        check_int("steps", steps, 0)
        check_int("nonfinite", nonfinite, 0)
        if nonfinite > steps:
            raise ValueError(f"nonfinite must be at most steps ({steps}), got {nonfinite}")
        if not steps:
            return
        ex = self.exchange
        ex.step += steps
        self.pull(steps - nonfinite)
        ex.verdicts.device_steps(ex.step - 1, steps, nonfinite, bool(last_finite))

    def restore(self) -> None:
        """Put back what :meth:`begin` kept (an aborted or finished device step)."""
        saved, self._saved = self._saved, None
        if saved is not None:
            ex = self.exchange
            for layer, (count, theta) in zip(ex.records, saved[0]):
                layer.count, layer.theta = count, theta
            ex.transport.counts, ex.transport.bad = saved[1], saved[2]
