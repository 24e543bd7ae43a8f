"""PyTorch adapter: the two drop-in forms.

(a) stock Horovod, one changed argument::

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
            compression=dlgs.torch.Compression(model.named_parameters(), density=0.01))

(b) Horovod's signature plus dlgs options::

    opt = dlgs.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                          density=0.01)

(c) PyTorch DDP without Horovod, a communication hook (``dlgs.torch.ddp``)::

    model.register_comm_hook(dlgs.torch.ddp.SparseState(model, density=0.01),
                             dlgs.torch.ddp.sparse_hook)

The torch backend (``dlgs.torch._ops``: the core's array operations on torch
tensors) needs torch only: the two forms, which need Horovod, are imported on
first use, so the backend also serves where Horovod is not installed (a GPU
self-check, another adapter).
"""

import importlib
from typing import Any

__all__ = ["Compression", "DistributedOptimizer", "ddp"]


def __getattr__(name: str) -> Any:
    # PEP 562: import the Horovod-facing forms when first asked for.
    if name == "Compression":
        from .compression import Compression

        return Compression
    if name == "DistributedOptimizer":
        from .optimizer import DistributedOptimizer

        return DistributedOptimizer
    if name == "ddp":  # the DDP communication hook: torch.distributed, no Horovod
        return importlib.import_module(".ddp", __name__)
    raise AttributeError(f"module 'dlgs.torch' has no attribute {name!r}")
