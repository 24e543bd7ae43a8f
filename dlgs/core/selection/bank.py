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

from ..backend import ArrayOps, host_number
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
        self._refresh()

    def _refresh(self) -> None:
        columns = [(key, self.vectors[key].tolist()) for key in self.keys]
        for j, state in enumerate(self.states):
            for key, values in columns:
                state[key] = values[j]

    # -- a copy on the device, for steps with no host read --------------------------
    def to_device(self, ops: ArrayOps, like: Any) -> Dict[str, Any]:
        """Device float64 vectors of every key and of ``k1`` (set-up)."""
        n = len(self.states)
        out = {key: ops.zeros(n, "float64", like) for key in (*self.keys, "k1")}
        self.push(ops, out)
        return out

    def push(self, ops: ArrayOps, device: Dict[str, Any]) -> None:
        """The host's vectors into ``device``'s (after a host step)."""
        for key in self.keys:
            ops.copy_(device[key], self.vectors[key])
        ops.copy_(device["k1"], self.k1)

    def pull(self, ops: ArrayOps, device: Dict[str, Any], finite_steps: int) -> None:
        """``device``'s vectors back into the host's after steps that ran
        there, ``finite_steps`` of them finite (each advanced every layer's
        steps since its anchor, as a host step does)."""
        for key in self.keys:
            self.vectors[key][...] = np.asarray(ops.to_host(device[key]), np.float64)
        self._refresh()
        for state in self.states:
            if state.get("since_anchor", -1) >= 0:
                state["since_anchor"] += finite_steps

    def steps_before_anchor(self) -> int:
        """Steps that may run before some layer anchors (on the host); -1: any."""
        each = [self.controller.steps_before_anchor(s) for s in self.states]
        limited = [n for n in each if n >= 0]
        return min(limited) if limited else -1
