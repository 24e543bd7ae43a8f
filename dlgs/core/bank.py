"""What the sparse layers' threshold controllers learn, kept together on the host.

A controller's learning state (:attr:`ThresholdController.vector_keys`) lives
in one NumPy vector per key over every sparse layer, so that a finite step
updates all layers in one vectorised pass (:meth:`ThresholdController.update_many`)
from the count words it gathered, with no device operation. Each layer's
state dict then holds plain floats copied from the vectors: nothing aliases
them, so a copy of a state dict is a snapshot and a checkpoint reads numbers.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .backend import ArrayOps
from .checkpoint import host_number
from .controller import ThresholdController

__all__ = ["ControllerBank"]


class ControllerBank:
    """The learning state of ``states`` (one controller state dict per sparse
    layer, in the order their count words arrive), targets ``ks``."""

    def __init__(
        self,
        ops: ArrayOps,
        controller: ThresholdController,
        states: Sequence[Dict[str, Any]],
        ks: Sequence[int],
    ):
        self.controller = controller
        self.states: List[Dict[str, Any]] = list(states)
        self.keys = controller.vector_keys
        self.vectors = {
            key: np.array([host_number(ops, state[key]) for state in self.states], np.float64)
            for key in self.keys
        }
        self.k1 = np.asarray(ks, np.float64) + 1.0

    @classmethod
    def of(
        cls,
        ops: ArrayOps,
        controller: ThresholdController,
        states: Sequence[Dict[str, Any]],
        ks: Sequence[int],
    ) -> Optional["ControllerBank"]:
        """A bank, or None where the controller learns nothing or no layer is sparse."""
        if not controller.vector_keys or not states:
            return None
        return cls(ops, controller, states, ks)

    def update(self, ops: ArrayOps, counts: np.ndarray) -> None:
        """Learn from this rank's selected ``counts`` (one per layer) after a
        finite step; layers that anchored this step hand in their anchors (one
        host read for all of them). Every state dict is refreshed in place."""
        anchored = [(j, s.pop("anchor")) for j, s in enumerate(self.states) if "anchor" in s]
        anchors: Dict[int, float] = {}
        if anchored:
            values = ops.to_host(ops.stack([a for _, a in anchored]))
            anchors = {j: float(v) for (j, _), v in zip(anchored, np.ravel(values))}
        self.controller.update_many(self.vectors, counts, self.k1, anchors)
        columns = [(key, self.vectors[key].tolist()) for key in self.keys]
        for j, state in enumerate(self.states):
            for key, values in columns:
                state[key] = values[j]
