"""A job's fitted collectives, saved for the next job on the same cluster.

The planner's probes cost bytes and wait until sparse sending has saved them,
and on a slow link their fit moves with the noise. A job given
``calibration_file=PATH`` writes, on rank 0 after it probed, what the probes
fitted (the copy cost and the two collectives, what priced their bytes, the
world size) to ``PATH``; a later job given the same file at the same world
size plans from it without probing, so it plans as soon as its steps are
profiled and from the same collectives as the job that wrote it. The file is
read on rank 0 and broadcast, so every rank plans from the same one; a file
written at another world size, or one that does not parse, is set aside with
a log line and the job probes (and writes it anew).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

from .._checks import check_int
from .dp import CostModel
from .profile import Profile, costs_from_dict, priced_by_from, read_json

__all__ = ["CALIBRATION_VERSION", "Calibration"]

CALIBRATION_VERSION = 1

_FIELDS = ("version", "world_size", "pack", "allgather", "allreduce", "priced_by")


@dataclass(frozen=True)
class Calibration:
    """The collectives a job's probes fitted (see the module).

    Attributes:
        world_size: ranks they were measured with.
        pack: seconds to copy a layer into a shared buffer vs elements.
        allgather: seconds vs bytes of one rank's chunk.
        allreduce: seconds vs bytes of the buffer.
        priced_by: what priced each one's bytes (``Profile.priced_by``).
    """

    world_size: int
    pack: CostModel
    allgather: CostModel
    allreduce: CostModel
    priced_by: Tuple[str, str] = ("probes", "probes")

    @classmethod
    def of(cls, profile: Profile) -> "Calibration":
        """The collectives of ``profile``."""
        return cls(
            profile.world_size,
            profile.pack,
            profile.allgather,
            profile.allreduce,
            profile.priced_by,
        )

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["version"] = CALIBRATION_VERSION
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "Calibration":
        """The calibration saved by :meth:`to_dict`, validated field by field.

        Raises:
            ValueError: a missing, unknown or malformed field, named.
        """
        if not isinstance(d, dict):
            raise ValueError(f"a calibration must be a JSON object, got {type(d).__name__}")
        if d.get("version") != CALIBRATION_VERSION:
            raise ValueError(
                f"calibration version must be {CALIBRATION_VERSION}, got {d.get('version')!r}"
            )
        missing = [f for f in _FIELDS if f not in d]
        if missing:
            raise ValueError(f"calibration field {missing[0]} is missing")
        unknown = sorted(set(d) - set(_FIELDS))
        if unknown:
            raise ValueError(f"unknown calibration field {unknown[0]}")
        try:
            check_int("world_size", d["world_size"], 1)
        except TypeError as err:
            raise ValueError(str(err)) from None
        costs = costs_from_dict(d, ("pack", "allgather", "allreduce"))
        return cls(
            d["world_size"],
            costs["pack"],
            costs["allgather"],
            costs["allreduce"],
            priced_by_from(d["priced_by"]),
        )

    def save(self, path: Union[str, Path]) -> Optional[str]:
        """Write it to ``path`` whole or not at all (a temporary file renamed);
        what went wrong, or None. Training goes on either way: the next job
        probes."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.to_dict(), indent=1))
            os.replace(tmp, path)
        except OSError as err:
            return f"could not write calibration_file {path} ({err})"
        return None

    @classmethod
    def recall(
        cls, path: Union[str, Path], world_size: int
    ) -> Tuple[Optional["Calibration"], str, int]:
        """The calibration saved at ``path`` if it was written at
        ``world_size`` ranks, else None; and why not, with the log level
        that deserves (a file not written yet is expected)."""
        if not os.path.exists(path):
            return None, f"no calibration in {path} yet (this job saves one)", logging.INFO
        try:
            saved = cls.load(path)
        except (OSError, ValueError) as err:
            return None, f"calibration_file {path} set aside ({err})", logging.WARNING
        if saved.world_size != world_size:
            why = (
                f"calibration_file {path} was written at {saved.world_size} ranks, this job "
                f"has {world_size}"
            )
            return None, why, logging.WARNING
        return saved, "", logging.INFO

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Calibration":
        """Read a calibration saved by :meth:`save`.

        Raises:
            OSError: the file cannot be read.
            ValueError: it is not JSON, or a field is missing or malformed.
        """
        return cls.from_dict(read_json(path))
