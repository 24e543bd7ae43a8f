"""A job's fitted collectives, saved for the next job on the same cluster.

The planner's probes cost bytes and wait until sparse sending has saved them,
and on a slow link their fit moves with the noise. A job given
``calibration_file=PATH`` writes, on rank 0 after it probed, what the probes
fitted (the copy cost and the two collectives, what priced their bytes, the
world size and ``link_bandwidth``) to ``PATH``; a later job given the same
file at the same world size and ``link_bandwidth`` plans from it without
probing, so it plans as soon as its steps are
profiled and from the same collectives as the job that wrote it. The file is
read on rank 0 and broadcast, so every rank plans from the same one; a file
written at another world size or ``link_bandwidth``, or one that does not
parse, is set aside with a log line and the job probes (and writes it anew).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

from .._checks import check_float, check_int
from .dp import CostModel
from .profile import costs_from_dict, known_fields, priced_by_from, read_json, valid_field

__all__ = ["CALIBRATION_VERSION", "Calibration"]

CALIBRATION_VERSION = 1

_FIELDS = (
    "version",
    "world_size",
    "pack",
    "allgather",
    "allreduce",
    "priced_by",
    "link_bandwidth",
)


@dataclass(frozen=True)
class Calibration:
    """The collectives a job's probes fitted (see the module).

    Attributes:
        world_size: ranks they were measured with.
        pack: seconds to copy a layer into a shared buffer vs elements.
        allgather: seconds vs bytes of one rank's chunk.
        allreduce: seconds vs bytes of the buffer.
        priced_by: what priced each one's bytes (``Profile.priced_by``).
        link_bandwidth: the job's ``link_bandwidth`` (bit/s) or None: what
            priced bytes the probes could not see.
    """

    world_size: int
    pack: CostModel
    allgather: CostModel
    allreduce: CostModel
    priced_by: Tuple[str, str] = ("probes", "probes")
    link_bandwidth: Optional[float] = None

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
        known_fields("calibration", d, _FIELDS, optional=())
        if d["version"] != CALIBRATION_VERSION:
            raise ValueError(
                f"calibration version must be {CALIBRATION_VERSION}, got {d['version']!r}"
            )
        valid_field(check_int, "world_size", d["world_size"], 1)
        link = d["link_bandwidth"]
        if link is not None:
            valid_field(check_float, "link_bandwidth", link, low=0, low_open=True)
        costs = costs_from_dict(d, ("pack", "allgather", "allreduce"))
        return cls(
            d["world_size"],
            costs["pack"],
            costs["allgather"],
            costs["allreduce"],
            priced_by_from(d["priced_by"]),
            None if link is None else float(link),
        )

    def save(self, path: Union[str, Path]) -> Optional[str]:
        """Write it to ``path`` whole or not at all (a temporary file renamed);
        what went wrong, or None. Training goes on either way (the next job
        probes): this runs on rank 0 alone, between collectives every rank
        issues, so it must not raise."""
        tmp = None
        try:
            path = Path(path)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.to_dict(), indent=1))
            os.replace(tmp, path)
        except (OSError, ValueError) as err:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            return f"could not write calibration_file {path} ({err})"
        return None

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Calibration":
        """Read a calibration saved by :meth:`save`.

        Raises:
            OSError: the file cannot be read.
            ValueError: it is not JSON, or a field is missing or malformed.
        """
        return cls.from_dict(read_json(path))

    @classmethod
    def recall(
        cls, path: Union[str, Path], world_size: int, link_bandwidth: Optional[float]
    ) -> Tuple[Optional["Calibration"], str, int]:
        """The calibration saved at ``path`` if it was written at
        ``world_size`` ranks and ``link_bandwidth``, else None; and why not,
        with the log level that deserves (a file not written yet is
        expected). Never raises: rank 0 alone reads it, before a broadcast
        every rank waits in."""
        try:
            if not os.path.exists(path):
                return None, f"no calibration in {path} yet (this job saves one)", logging.INFO
            saved = cls.load(path)
        except Exception as err:  # any reason at all: this rank must reach the broadcast
            return None, f"calibration_file {path} set aside ({err})", logging.WARNING
        if saved.world_size != world_size:
            why = (
                f"calibration_file {path} was written at {saved.world_size} ranks, this job "
                f"has {world_size}"
            )
            return None, why, logging.WARNING
        if saved.link_bandwidth != link_bandwidth:
            why = (
                f"calibration_file {path} was written with link_bandwidth="
                f"{saved.link_bandwidth}, this job has {link_bandwidth}"
            )
            return None, why, logging.WARNING
        return saved, "", logging.INFO
