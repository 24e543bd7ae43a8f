"""The exchange protocol: what every door and the engine call on an exchange,
whichever way its bytes move.

:class:`~dlgs.core.exchange.exchange.SparseExchange` (the flat allgather, the
sparse reduction and ``transport="auto"``, by its transport) and
:class:`~dlgs.core.transport.hierarchical.HierarchicalExchange` (two levels)
implement it; the engine and the adapters use nothing else. A test checks
that both do (``tests/test_core.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

__all__ = ["Exchange", "EXCHANGE_MEMBERS"]


class Exchange(Protocol):
    """One model's gradient exchange, step after step.

    A step: :meth:`submit` each layer's gradient as it is ready, then
    :meth:`wait` for every layer's reduced gradient; an error inside a step
    is followed by :meth:`abort_step`. Between steps: :meth:`state_dict`,
    :meth:`load_state_dict` (no collective: Horovod's recipes call them on one
    rank) and :meth:`resync` (every rank)."""

    comm: Any
    config: Any
    prefix: str
    step_hooks: List[Any]
    #: Steps on the device alone (:class:`~dlgs.core.exchange.device.DeviceSteps`),
    #: or None where the exchange has none.
    device: Any
    #: :meth:`submit` hands dense layers back for the caller to reduce
    #: (Horovod form (a)), which then ends the step with ``finish``; False
    #: where the exchange reduces every layer itself and ends its own steps.
    dense_external: bool
    #: The loss scaler's reader, or None (settable: a TF tape hands in its
    #: scaler every step).
    loss_scale: Optional[Callable[[], Any]]

    # -- a step -----------------------------------------------------------------
    def submit(self, i: int, grad: Any) -> Any: ...
    def pending(self) -> List[int]: ...
    def wait(self, finish: bool = True) -> Dict[int, Any]: ...
    def abort_step(self) -> None: ...
    @property
    def in_step(self) -> bool: ...
    @property
    def last_step_finite(self) -> bool: ...
    @property
    def nonfinite_steps(self) -> int: ...

    # -- what it shows ---------------------------------------------------------
    @property
    def step(self) -> int: ...
    @property
    def layers(self) -> Tuple[Any, ...]: ...
    @property
    def groups(self) -> Tuple[Any, ...]: ...
    @property
    def density(self) -> float: ...
    @property
    def densities(self) -> Tuple[float, ...]: ...
    @property
    def auto_layers(self) -> Optional[Tuple[float, ...]]: ...
    @property
    def last_step(self) -> Any: ...
    def stats(self) -> List[Dict[str, Any]]: ...
    def message_bytes(self, message: Any) -> int: ...
    def wire_bytes(self) -> int: ...
    def dense_bytes(self) -> int: ...

    # -- between steps ---------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]: ...
    def load_state_dict(self, state: Dict[str, Any], like: Any) -> None: ...
    def check_state_dict(self, state: Any) -> Tuple[bool, Sequence[str]]: ...
    def resync(self) -> None: ...
    def request_host_step(self) -> None: ...


#: The protocol's members (for the test that every exchange has them).
EXCHANGE_MEMBERS = tuple(
    name
    for name in list(Exchange.__dict__) + list(Exchange.__annotations__)
    if not name.startswith("_")
)
