"""Exchanges kept by name for doors whose objects do not live across steps.

TensorFlow's tape and ``Compression`` are often created anew every step (or
inside a ``tf.function``, whose Python objects are gone after tracing): the
exchange, with its residuals, thresholds and plan, must outlive them. A
:class:`Registry` keeps one per name for the process.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Generic, Tuple, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Objects by name, each built once with the options (``key``) it was made with.

    Args:
        what: what a name is given to, for error messages (e.g. "the first
            DistributedGradientTape / Compression of that name").
    """

    def __init__(self, what: str):
        self._what = what
        self._found: Dict[str, Tuple[Any, T]] = {}
        self._lock = threading.Lock()

    def named(self, name: str, key: Any, make: Callable[[], T]) -> T:
        """The object kept under ``name``, built by ``make`` the first time.
        ``key`` holds its options; other options under an existing name
        raise ``ValueError`` (give another model another name)."""
        with self._lock:
            found = self._found.get(name)
            if found is not None and found[0] != key:
                raise ValueError(
                    f"a dlgs exchange named {name!r} already exists with other options or "
                    "variables; pass the same options every step, or another name= for "
                    "another model"
                )
            if found is None:
                found = self._found[name] = (key, make())
            return found[1]

    def __getitem__(self, name: str) -> T:
        """The object kept under ``name``.

        Raises:
            KeyError: nothing was kept under ``name`` in this process.
        """
        with self._lock:
            found = self._found.get(name)
            if found is None:
                raise KeyError(
                    f"no dlgs exchange named {name!r} in this process (known: "
                    f"{sorted(self._found)}); it is created with {self._what}"
                )
            return found[1]

    def clear(self) -> None:
        """Forget every object (as a new process starts)."""
        with self._lock:
            self._found.clear()
