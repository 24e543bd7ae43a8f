"""PyTorch adapter: the two drop-in forms.

(a) stock Horovod, one changed argument::

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
            compression=dlgs.torch.Compression(model.named_parameters(), density=0.01))

(b) Horovod's signature plus dlgs options::

    opt = dlgs.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                          density=0.01)
"""

from .compression import Compression
from .optimizer import DistributedOptimizer

__all__ = ["Compression", "DistributedOptimizer"]
