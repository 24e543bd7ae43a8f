"""The mutable records a :class:`~dlgs.core.exchange.exchange.SparseExchange` keeps per
layer and per message, and what a finished step hands its step hooks.

Only the exchange writes the records; everyone else reads them through
:mod:`dlgs.core.exchange.views`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, Sequence, Tuple

from ..backend import ArrayOps
from ..transport.flat import MAX_MESSAGE_ELEMENTS
from ..wire import GroupLayout, LayerPlan, MemberViews

if TYPE_CHECKING:
    from .protocol import Exchange

__all__ = ["check_layers", "LayerRecord", "MessageRecord", "StepHook", "StepRecord", "StepTrace"]


def check_layers(layers: Sequence[Tuple[str, int]]) -> None:
    """``(name, numel)`` of an exchange's layers: unique names, each small
    enough to be indexed in a message with int32."""
    names = [name for name, _ in layers]
    if len(set(names)) != len(names):
        dups = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"layer names must be unique, duplicates: {dups}")
    too_big = [(name, int(n)) for name, n in layers if int(n) + 1 > MAX_MESSAGE_ELEMENTS]
    if too_big:
        name, n = too_big[0]
        raise ValueError(
            f"parameter {name!r} has {n} elements; dlgs indexes a message with int32, "
            f"so a layer may have at most {MAX_MESSAGE_ELEMENTS - 1} elements (split the "
            "parameter, or leave it out of named_parameters and reduce it yourself)"
        )


class LayerRecord:
    """Mutable per-layer state: residual, optional velocity, controller state.

    Residual and velocity are double-buffered: a step writes its new state into
    the ``*_next`` buffers and the exchange's ``finish()`` swaps them in only if
    the step was finite on every rank, so a skipped step is undone exactly and
    at no cost (no copy, no extra pass).
    """

    __slots__ = (
        "name",
        "numel",
        "plan",
        "residual",
        "residual_next",
        "velocity",
        "velocity_next",
        "send",
        "ctrl",
        "ctrl_prev",
        "flush",
        "count",
        "theta",
        "group",
        "member",
        "views",
        "work",
    )

    def __init__(self, name: str, numel: int):
        self.name = name
        self.numel = numel
        self.plan: Optional[LayerPlan] = None
        # n + 1 float32, in unscaled gradient units: the last slot is the padding slot.
        self.residual: Any = None
        self.residual_next: Any = None
        self.velocity: Any = None
        self.velocity_next: Any = None
        # A dense layer's send buffer under momentum correction (n float32):
        # its velocity stays this rank's own, whatever the reduction does in place.
        self.send: Any = None
        self.ctrl: Dict[str, Any] = {}
        self.ctrl_prev: Optional[Dict[str, Any]] = None
        self.flush = False  # a dense layer sent what its residual owed this step
        self.count: Any = None
        self.theta: Any = None
        self.group = -1
        self.member = -1
        # Views reused every step (each new view is an operation): buffer id ->
        # (buffer, view of its first ``numel`` elements). Holding the buffer
        # keeps its id from being reused while the entry exists.
        self.views: Dict[int, Tuple[Any, Any]] = {}
        # The fused selection's scratch for this layer (FusedSelection.workspace).
        self.work: Any = None

    def head(self, ops: ArrayOps, buf: Any) -> Any:
        """The first ``numel`` elements of ``buf`` (a cached view)."""
        hit = self.views.get(id(buf))
        if hit is not None and hit[0] is buf:
            return hit[1]
        view = ops.narrow(buf, 0, 0, self.numel)
        self.views[id(buf)] = (buf, view)
        return view


class MessageRecord:
    """One message: sparse (allgather of a packed chunk) or dense (allreduce)."""

    __slots__ = (
        "members",
        "sparse",
        "layout",
        "chunk",
        "dense",
        "wire",
        "ready",
        "handle",
        "verified",
        "name",
        "member_views",
        "outputs",
        "position",
    )

    def __init__(self, members: List[int], sparse: bool, name: str):
        self.members = members
        self.sparse = sparse
        self.name = name
        self.layout: Optional[GroupLayout] = None
        self.chunk: Any = None  # sparse: int32 send buffer
        self.dense: Any = None  # dense with > 1 member: the send buffer
        # dense in a 16-bit dense_dtype: the send buffer (``dense`` then
        # receives the float32 result, for one member too).
        self.wire: Any = None
        self.ready = 0
        self.handle: Any = None
        self.verified = False
        # sparse: per member, its views of ``chunk`` (GroupLayout.member_views).
        self.member_views: List[MemberViews] = []
        # sparse: each member's view of the step's receive buffer (FlatTransport.dense).
        self.outputs: List[Any] = []
        # sparse: the message's position among the layout's sparse ones (the transport's).
        self.position = -1


@dataclass
class StepTrace:
    """Host times (``clock()``, after the device finished) of one timed step
    (:meth:`~dlgs.core.exchange.exchange.SparseExchange.trace_next_step`)."""

    #: Layer index -> when its gradient was submitted.
    arrive: Dict[int, float] = field(default_factory=dict)
    #: Layer index -> when its selection and packing (or dense send) returned.
    done: Dict[int, float] = field(default_factory=dict)
    #: When the step's wait() ended.
    waited: Optional[float] = None

    @property
    def end(self) -> Optional[float]:
        """Seconds from the first gradient to the end of the wait."""
        if self.waited is None or not self.arrive:
            return None
        return self.waited - min(self.arrive.values())


@dataclass(frozen=True)
class StepRecord:
    """What a finished step hands its step hooks (and leaves in
    :attr:`~dlgs.core.exchange.exchange.SparseExchange.last_step`)."""

    #: The step's index (``exchange.step`` was this during it).
    step: int
    #: Host seconds from the first submit to the end of the wait (no device sync).
    seconds: Optional[float]
    #: Host seconds inside submit(): selection, packing, starting collectives.
    submit_seconds: float
    #: Per layer (exchange order), whether it was sent sparse.
    layers_sparse: Tuple[bool, ...]
    #: Layer-by-layer times, if ``trace_next_step()`` asked for them.
    trace: Optional[StepTrace] = None


class StepHook(Protocol):
    """What an exchange's ``step_hooks`` hold (e.g. the online planner).

    Called with the exchange and the step's :class:`StepRecord` after every
    step. Optional members: ``on_density(ex, density)`` returning a plan for a
    new density (applied in that layout) or None; ``state_dict()`` /
    ``load_state_dict(state, ex)``, saved in the exchange's state under
    ``state_key`` (default: the class name).
    """

    def __call__(self, exchange: "Exchange", record: StepRecord) -> None: ...
