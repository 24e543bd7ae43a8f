"""Real data that works offline on this machine (no download at run time).

Fashion-MNIST comes from Debian's ``dataset-fashion-mnist`` (MIT licence),
installed by ``make install``.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Tuple

import numpy as np

__all__ = ["fashion_mnist", "FASHION_MNIST_DIR"]

FASHION_MNIST_DIR = Path(os.environ.get("DLGS_FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def fashion_mnist(split: str = "train") -> Tuple[np.ndarray, np.ndarray]:
    """Images as float32 in [0, 1] with shape (N, 1, 28, 28), labels as int64.

    Args:
        split: ``"train"`` (60,000) or ``"test"`` (10,000).
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    prefix = "train" if split == "train" else "t10k"
    images = FASHION_MNIST_DIR / f"{prefix}-images-idx3-ubyte.gz"
    labels = FASHION_MNIST_DIR / f"{prefix}-labels-idx1-ubyte.gz"
    if not images.exists():
        raise FileNotFoundError(
            f"{images} not found: install Debian's dataset-fashion-mnist (make install does) "
            "or set DLGS_FASHION_MNIST to a directory with the four idx .gz files"
        )
    x = _read_idx(images).astype(np.float32)[:, None] / 255.0
    y = _read_idx(labels).astype(np.int64)
    return x, y
