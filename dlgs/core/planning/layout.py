"""A step's messages from the layers' plans and the merge plan: which layers
travel together, dense or sparse, under which name, and where each member
sits in its message. Pure: sizes and options in, the same answer on every
rank (no handshake), nothing allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..config import IndexCoding, ValueDType
from ..transport.flat import MAX_MESSAGE_ELEMENTS
from ..wire import GroupLayout, LayerPlan

__all__ = ["TRANSPORT_MODES", "MessageSpec", "plan_messages", "split_oversized"]

#: A requested merge plan: groups of layer indices, each with its mode (True
#: sparse, False dense, None: sparse if every member's plan is, or a
#: transport of :data:`TRANSPORT_MODES`: sparse, travelling by it, where
#: ``transport="auto"`` lets the plan choose).
Plan = Sequence[Tuple[Sequence[int], Union[None, bool, str]]]

#: Modes that make a message sparse and name its transport.
TRANSPORT_MODES = ("allgather", "reduce")


@dataclass(frozen=True)
class MessageSpec:
    """One message of a step."""

    #: Layer indices, in the order they sit in the message.
    members: Tuple[int, ...]
    sparse: bool
    #: The collective's name (the same on every rank).
    name: str
    #: Sparse: the packed layout of the members' selections.
    layout: Optional[GroupLayout]
    #: Dense: each member's offset in the merged buffer (elements).
    offsets: Tuple[int, ...]

    @property
    def size(self) -> int:
        """Dense: elements of the merged buffer."""
        return self.offsets[-1] if self.offsets else 0


def plan_messages(
    plans: Sequence[LayerPlan],
    names: Sequence[str],
    requested: Optional[Plan],
    prefix: str,
    value_dtype: ValueDType,
    index_coding: IndexCoding,
    dense_alone: bool = False,
    budgeted: bool = False,
) -> List[MessageSpec]:
    """The messages of a step, ordered by their first layer.

    ``requested`` groups (the merge plan) come first, each dense or sparse as
    asked; layers it leaves out go alone, sparse where their plan says. With
    ``dense_alone`` (the caller reduces dense layers itself) dense groups are
    split into single layers. Sparse groups whose indices would overflow
    int32 are split (:func:`split_oversized`). With ``budgeted`` (a byte
    budget) a sparse group that would send more bytes than its members alone
    (one index coding for all: a small layer at a high density, bitmap-coded
    alone, pays a big layer's block16) goes as single messages
    (:func:`split_costlier`): the bytes never exceed the layer-wise layout's,
    which the budget priced."""
    groups: List[Tuple[List[int], bool]] = []
    placed: set = set()
    routes: Dict[int, str] = {}  # a plan's transport, by the message's first layer
    for members, sparse in requested or []:
        mode = all(plans[i].sparse for i in members) if sparse is None else bool(sparse)
        if not mode and dense_alone:
            groups += [([i], False) for i in members]
        else:
            groups.append((list(members), mode))
            if mode and sparse in TRANSPORT_MODES:
                routes[min(members)] = str(sparse)
        placed.update(members)
    groups += [([i], plans[i].sparse) for i in range(len(plans)) if i not in placed]
    groups = split_oversized(groups, plans)
    if budgeted:
        groups = split_costlier(groups, plans, value_dtype, index_coding)
    groups = sorted(groups, key=lambda g: min(g[0]))
    out = []
    for gi, (members, mode) in enumerate(groups):
        kind = "sparse" if mode else "dense"
        if len(members) == 1:
            name = f"{prefix}.{kind}.{names[members[0]]}"
        else:
            name = f"{prefix}.{kind}.g{gi}.{len(members)}"
        layout = None
        offsets: Tuple[int, ...] = ()
        if mode:
            layout = GroupLayout(
                tuple(plans[i].numel for i in members),
                tuple(plans[i].capacity for i in members),
                value_dtype,
                index_coding,
                routes.get(min(members), ""),
            )
        else:
            ends = [0]
            for i in members:
                ends.append(ends[-1] + plans[i].numel)
            offsets = tuple(ends)
        out.append(MessageSpec(tuple(members), mode, name, layout, offsets))
    return out


def split_costlier(
    groups: List[Tuple[List[int], bool]],
    plans: Sequence[LayerPlan],
    value_dtype: ValueDType,
    index_coding: IndexCoding,
) -> List[Tuple[List[int], bool]]:
    """Sparse groups that send more bytes merged than their members alone
    split into single messages (sizes and capacities only: the same on every
    rank)."""

    def chunk(members: Sequence[int]) -> int:
        return GroupLayout(
            tuple(plans[i].numel for i in members),
            tuple(plans[i].capacity for i in members),
            value_dtype,
            index_coding,
        ).chunk_bytes

    out: List[Tuple[List[int], bool]] = []
    for members, sparse in groups:
        if sparse and len(members) > 1 and chunk(members) > sum(chunk([i]) for i in members):
            out += [([i], True) for i in members]
        else:
            out.append((members, sparse))
    return out


def split_oversized(
    groups: List[Tuple[List[int], bool]], plans: Sequence[LayerPlan]
) -> List[Tuple[List[int], bool]]:
    """Split sparse groups whose indices would not fit int32 into consecutive
    parts that do (the same split on every rank: it depends on sizes only)."""
    out: List[Tuple[List[int], bool]] = []
    for members, sparse in groups:
        if not sparse:
            out.append((members, sparse))
            continue
        part: List[int] = []
        size = 0
        for i in members:
            n = plans[i].numel + 1
            if part and size + n > MAX_MESSAGE_ELEMENTS:
                out.append((part, True))
                part, size = [], 0
            part.append(i)
            size += n
        out.append((part, True))
    return out
