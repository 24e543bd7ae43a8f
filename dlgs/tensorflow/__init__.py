"""TensorFlow 2 / Keras 3 adapter, on the same core as ``dlgs.torch``.

Three forms, each mirroring a Horovod factory::

    # (a) custom loops: Horovod's tape signature plus dlgs options
    tape = dlgs.tensorflow.DistributedGradientTape(tape, density=0.01)

    # (b) Keras 3 model.fit (which Horovod's own Keras wrapper never synchronises)
    opt = dlgs.tensorflow.keras.DistributedOptimizer(keras.optimizers.SGD(0.05), density=0.01)

    # (c) stock Horovod's tape, one changed argument (needs num_groups=1)
    tape = hvd.DistributedGradientTape(tape, num_groups=1,
            compression=dlgs.tensorflow.Compression(variables, density=0.01))

See docs/tensorflow.md for eager vs ``tf.function`` vs ``model.fit``.
"""

from . import keras
from ._engine import exchange
from ._graph import function
from .compression import Compression
from .tape import DistributedGradientTape

__all__ = ["Compression", "DistributedGradientTape", "exchange", "function", "keras"]
