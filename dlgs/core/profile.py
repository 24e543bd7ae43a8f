"""Measured costs of one job, and the planner input built from them.

A :class:`Profile` is what the online profiler measures (per-layer backward
times, the sparsify and pack cost per element, the fitted collectives at the
job's real world size) in a form that can be saved as JSON, broadcast to every
rank, and turned into a :class:`~dlgs.core.planner.PlanSpec` for any density.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple, Union

from .config import SparsityConfig, ValueDType
from .exchange import plan_layers
from .planner import CostModel, LayerCost, PlanSpec

__all__ = ["LayerProfile", "Profile", "build_spec", "PROFILE_VERSION"]

PROFILE_VERSION = 1


@dataclass(frozen=True)
class LayerProfile:
    """One layer in gradient-ready order: its size and backward seconds."""

    name: str
    numel: int
    backward: float


@dataclass(frozen=True)
class Profile:
    """Costs of one job on its real ranks and network.

    Attributes:
        world_size: ranks the collectives were measured with.
        layers: in gradient-ready order.
        sparsify: seconds to select and pack a layer vs its element count.
        pack: seconds to copy a layer into a shared dense buffer vs elements.
        allgather: seconds vs bytes of one rank's chunk.
        allreduce: seconds vs bytes of the buffer.
    """

    world_size: int
    layers: Tuple[LayerProfile, ...]
    sparsify: CostModel
    pack: CostModel
    allgather: CostModel
    allreduce: CostModel

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["version"] = PROFILE_VERSION
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Profile":
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version must be {PROFILE_VERSION}, got {d.get('version')!r}")
        return cls(
            world_size=int(d["world_size"]),
            layers=tuple(LayerProfile(**layer) for layer in d["layers"]),
            sparsify=CostModel(**d["sparsify"]),
            pack=CostModel(**d["pack"]),
            allgather=CostModel(**d["allgather"]),
            allreduce=CostModel(**d["allreduce"]),
        )

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Profile":
        return cls.from_dict(json.loads(Path(path).read_text()))


def build_spec(
    profile: Profile, config: SparsityConfig, density: float
) -> Tuple[PlanSpec, List[bool]]:
    """The planner's input at ``density``, and which layers the per-layer rule
    (``min_sparse_size``, sparse smaller than dense) would send sparse."""
    vbytes = 2 if config.value_dtype is ValueDType.FLOAT16 else 4
    plans = plan_layers([layer.numel for layer in profile.layers], density, config)
    layers = []
    for layer, plan in zip(profile.layers, plans):
        value_bytes = 4 * math.ceil(plan.capacity * vbytes / 4)
        layers.append(
            LayerCost(
                name=layer.name,
                backward=layer.backward,
                sparse_bytes=4 + value_bytes + 4 * plan.capacity,
                dense_bytes=4 * layer.numel,
                sparsify=profile.sparsify(layer.numel),
                pack=profile.pack(layer.numel),
            )
        )
    spec = PlanSpec(tuple(layers), profile.allgather, profile.allreduce)
    return spec, [p.sparse for p in plans]


def layer_profiles(names: Sequence[str], numels: Sequence[int], backward: Sequence[float]):
    """Convenience: zip three sequences into :class:`LayerProfile` records."""
    return tuple(LayerProfile(n, int(m), float(b)) for n, m, b in zip(names, numels, backward))
