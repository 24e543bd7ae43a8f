"""What an exchange's collaborators see of it.

:class:`~dlgs.core.exchange.device.DeviceSteps` (steps on the device alone)
and :class:`~dlgs.core.state.persist.ExchangeCheckpoints` (checkpoints and
their agreement) act on the exchange they belong to. They name it by this
protocol, the members they use, not by its class: so that neither imports
:mod:`~dlgs.core.exchange.exchange`, which imports them, and the core's
imports run one way (a test checks that they form no circle).
"""

from __future__ import annotations

from typing import Any, List, Optional, Protocol, Tuple

from ..backend import ArrayOps
from ..config import SparsityConfig
from .messages import Messages
from .nonfinite import NonFiniteLog
from .records import LayerRecord
from .sending import LayerSender
from .step import StepState

__all__ = ["ExchangeInternals"]


class ExchangeInternals(Protocol):
    """The members of :class:`~dlgs.core.exchange.exchange.SparseExchange`
    that its device steps and checkpoints use (see their docstrings there)."""

    ops: ArrayOps
    comm: Any
    config: SparsityConfig
    records: List[LayerRecord]
    messages: Optional[Messages]
    #: How sparse messages travel (:mod:`dlgs.core.transport`).
    transport: Any
    #: The ranks' agreement on step and plan (:mod:`dlgs.core.state.resume`).
    agreement: Any
    #: What every rank holds alike (:class:`~dlgs.core.state.persist.SharedState`).
    shared: Any
    controller: Any
    sender: LayerSender
    current: StepState
    verdicts: NonFiniteLog
    step_hooks: List[Any]
    #: Steps on the device alone (:class:`~dlgs.core.exchange.device.DeviceSteps`).
    device: Any
    dense_external: bool
    like: Any
    step: int

    @property
    def in_step(self) -> bool: ...
    @property
    def layout_due(self) -> bool: ...
    @property
    def densities(self) -> Tuple[float, ...]: ...
    def abort_step(self) -> None: ...
    def request_host_step(self) -> None: ...
    def relayout(self, like: Any) -> None: ...
    def relayout_next(self) -> None: ...
