"""Keras 3 versions of the benchmark models in ``benchmarks/models.py``, with
their synthetic batches, for ``benchmarks/train_tf.py``.

Each builder seeds Keras (``keras.utils.set_random_seed``) and names every
layer explicitly, so every rank builds the same weights under the same variable
paths (dlgs keys its per-layer state by ``v.path``; Keras would otherwise number
automatic names per process). The training benchmark still broadcasts rank 0's
weights, as the torch one does.

Shapes follow the torch models except for the layout: images are NHWC (Keras'
default, the fast layout for TensorFlow on CPUs) instead of NCHW. Parameter
counts: ResNet-20 272,474 and VGG-16 15,253,578 trainable, as in torch; the
LSTM LM 4,651,600, 1,600 fewer than torch's 4,653,200 because a Keras LSTM layer
has one bias vector per gate where ``torch.nn.LSTM`` has two.
"""

from __future__ import annotations

import os
from typing import Tuple

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers  # noqa: E402

__all__ = ["images", "lstm_lm", "ptb_tokens", "resnet20", "vgg16"]

# torch.nn.BatchNorm2d's defaults (Keras': momentum 0.99, epsilon 1e-3).
_BN = dict(momentum=0.9, epsilon=1e-5)


def _block(x, cin: int, cout: int, stride: int, name: str):
    """ResNet basic block: two 3x3 convs, a 1x1 projection when the shape changes."""
    out = layers.Conv2D(cout, 3, stride, padding="same", use_bias=False, name=f"{name}_conv1")(x)
    out = layers.ReLU(name=f"{name}_relu1")(
        layers.BatchNormalization(**_BN, name=f"{name}_bn1")(out)
    )
    out = layers.Conv2D(cout, 3, 1, padding="same", use_bias=False, name=f"{name}_conv2")(out)
    out = layers.BatchNormalization(**_BN, name=f"{name}_bn2")(out)
    if stride != 1 or cin != cout:
        x = layers.Conv2D(cout, 1, stride, use_bias=False, name=f"{name}_short")(x)
        x = layers.BatchNormalization(**_BN, name=f"{name}_short_bn")(x)
    return layers.ReLU(name=f"{name}_relu2")(layers.Add(name=f"{name}_add")([out, x]))


def resnet20(seed: int = 0, num_classes: int = 10) -> keras.Model:
    """ResNet-20 for 32x32x3 inputs (as ``models.ResNet20``): 272,474 trainable
    parameters in 65 tensors; returns logits."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((32, 32, 3), name="image")
    x = layers.Conv2D(16, 3, 1, padding="same", use_bias=False, name="conv")(inputs)
    x = layers.ReLU(name="relu")(layers.BatchNormalization(**_BN, name="bn")(x))
    cin = 16
    for stage, (cout, stride) in enumerate(((16, 1), (32, 2), (64, 2))):
        for b in range(3):
            x = _block(x, cin, cout, stride if b == 0 else 1, f"s{stage}b{b}")
            cin = cout
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(inputs, layers.Dense(num_classes, name="fc")(x), name="resnet20")


# VGG-16's convolution stages (configuration D with batch-norm), as in models.py.
_VGG16_STAGES = ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3))


def vgg16(seed: int = 0, num_classes: int = 10) -> keras.Model:
    """VGG-16 with batch-norm for 32x32x3 inputs and the 512-512-512-classes
    classifier (as ``models.VGG16``): 15,253,578 trainable parameters."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((32, 32, 3), name="image")
    x = inputs
    for s, (width, convs) in enumerate(_VGG16_STAGES):
        for c in range(convs):
            x = layers.Conv2D(width, 3, padding="same", name=f"s{s}c{c}")(x)
            x = layers.ReLU(name=f"s{s}c{c}_relu")(
                layers.BatchNormalization(**_BN, name=f"s{s}c{c}_bn")(x)
            )
        x = layers.MaxPooling2D(2, name=f"s{s}_pool")(x)
    x = layers.Flatten(name="flatten")(x)
    x = layers.Dense(512, activation="relu", name="fc1")(x)
    x = layers.Dense(512, activation="relu", name="fc2")(x)
    return keras.Model(inputs, layers.Dense(num_classes, name="fc3")(x), name="vgg16")


def lstm_lm(
    seed: int = 0, vocab: int = 10000, emb: int = 200, hidden: int = 200, depth: int = 2
) -> keras.Model:
    """The PTB word-level LSTM LM (as ``models.LSTMLM``, untied, no dropout):
    ``(batch, seq)`` token ids to ``(batch, seq, vocab)`` logits, every sequence
    from a zero state. 4,651,600 parameters, 86% in the embedding and decoder.

    The embedding's gradient is a ``tf.IndexedSlices`` (the rows the batch
    touched); the benchmark densifies it, as ``nn.Embedding(sparse=False)`` is
    dense in torch.
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((None,), dtype="int32", name="tokens")
    x = layers.Embedding(vocab, emb, name="embedding")(inputs)
    for i in range(depth):
        x = layers.LSTM(hidden, return_sequences=True, name=f"lstm{i}")(x)
    return keras.Model(inputs, layers.Dense(vocab, name="decoder")(x), name="lstm_lm")


def images(batch: int, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
    """Random 32x32x3 float32 images (standard normal) and labels in 0..9."""
    x = rng.standard_normal((batch, 32, 32, 3), dtype=np.float32)
    return x, rng.integers(0, 10, batch).astype(np.int32)


def ptb_tokens(batch: int, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
    """35-token windows of random ids in 0..9999; the target is the next token."""
    seq = rng.integers(0, 10000, (batch, 36)).astype(np.int32)
    return seq[:, :-1].copy(), seq[:, 1:].copy()
