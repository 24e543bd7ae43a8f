"""dlgs: dynamic layer-wise gradient sparsification for Horovod.

The framework adapters are imported explicitly (``import dlgs.torch``) so that
the core stays importable without torch, TensorFlow or Horovod.
"""

from .core import (
    Controller,
    IndexCoding,
    MergeConfig,
    RankMismatchError,
    SparsityConfig,
    ValueDType,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "Controller",
    "IndexCoding",
    "MergeConfig",
    "RankMismatchError",
    "SparsityConfig",
    "ValueDType",
    "__version__",
]
