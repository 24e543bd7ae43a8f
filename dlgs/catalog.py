"""Built-in models for planning without a measured profile.

Each model is a list of its parameter tensors, ``(name, numel, macs)``, in
gradient-ready order (the reverse of forward registration order: the last
layer's gradient is ready first), generated from the architecture's definition
rather than typed out:

* ``resnet50``: torchvision's ResNet-50 v1.5 on 224x224 ImageNet images
  (161 tensors with every BatchNorm weight and bias, 25,557,032 parameters);
* ``vgg16``: torchvision's VGG-16 without BatchNorm, 224x224 images
  (32 tensors, 138,357,544 parameters);
* ``bert-base``: Hugging Face's ``BertModel`` (uncased vocabulary of 30,522,
  sequences of 128 tokens; embeddings, 12 encoder layers with query / key /
  value / output projections, LayerNorms and feed-forward, pooler; 199
  tensors, 109,482,240 parameters);
* ``gpt2-medium``: Hugging Face's ``GPT2LMHeadModel`` at GPT-2 medium's shape, a
  decoder-only transformer (vocabulary 50,257 tied to the output projection, 1,024
  positions, 24 blocks of width 1,024, sequences of 1,024 tokens; 292 tensors,
  354,823,168 parameters);
* ``ptb-lstm``: PyTorch's ``word_language_model`` on Penn Treebank (vocabulary
  10,000, embedding and 2 LSTM layers of 200 units, untied decoder, 35 time
  steps; 11 tensors, 4,653,200 parameters).

**Compute model (an approximation).** ``macs`` is the forward
multiply-accumulates per sample attributed to the tensor: its parameter count
times how often each parameter is reused in one sample -- the output's spatial
positions for a convolution or BatchNorm, the tokens of a sequence for
BERT's linear layers and LayerNorms, the time steps for the LSTM and its
decoder, once for a classifier. An embedding table costs one multiply-add per
looked-up element (tokens x width), not per table entry. Then::

    backward seconds = 2 * (2 * macs * batch) / compute_flops

(a forward MAC is 2 FLOPs and back-propagation costs about twice the
forward: one product for the input's gradient, one for the weight's).
Parameter-free work (activations, pooling, attention scores, the LSTM's
gates) is ignored, and every layer is assumed to run at the same rate, so the
times are only as good as the planning they feed: measured per-layer times
(a :class:`~dlgs.core.planning.profile.Profile` from the online profiler) replace them
whenever a job can run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from .core.planning.dp import CostModel
from .core.planning.netmodel import (
    DEFAULT_LATENCY_S,
    allgather_cost,
    allreduce_cost,
    check_network,
)
from .core.planning.profile import LayerProfile, Profile

__all__ = [
    "CatalogLayer",
    "CatalogModel",
    "MODELS",
    "DEFAULT_COMPUTE_FLOPS",
    "DEFAULT_MEM_BW",
    "DEFAULT_KERNEL_S",
    "bert_layers",
    "catalog_model",
    "catalog_profile",
    "sparsify_cost",
    "pack_cost",
]

#: Sustained FLOP/s of one worker: about what a V100 sustains training
#: ResNet-50 in float32 (~380 images/s x ~24.6 GFLOP per image).
DEFAULT_COMPUTE_FLOPS = 10e12
#: Sustained memory bandwidth of one worker in bytes/s (V100 HBM2: 900 GB/s peak).
DEFAULT_MEM_BW = 800e9
#: Fixed cost of one device kernel in seconds (launch and tail).
DEFAULT_KERNEL_S = 5e-6

# Selection is four memory-bound passes over the float32 accumulator (|a|,
# compare, count, compaction; see docs/design.md), each reading 4 bytes per
# element; packing a dense buffer is one copy (read 4, write 4).
_SPARSIFY_BYTES_PER_ELEMENT = 16
_SPARSIFY_KERNELS = 5
_PACK_BYTES_PER_ELEMENT = 8


@dataclass(frozen=True)
class CatalogLayer:
    """One parameter tensor of a built-in model.

    Attributes:
        name: the parameter's name in the reference implementation.
        numel: number of elements.
        macs: forward multiply-accumulates per sample attributed to it.
    """

    name: str
    numel: int
    macs: int


@dataclass(frozen=True)
class CatalogModel:
    """A built-in model: its tensors in gradient-ready order and its batch.

    Attributes:
        name: the catalog key (``resnet50``, ``vgg16``, ``bert-base``, ``ptb-lstm``).
        layers: the tensors, last layer's first.
        batch: default samples per worker and step.
        sample: what one sample is, for messages.
    """

    name: str
    layers: Tuple[CatalogLayer, ...]
    batch: int
    sample: str

    @property
    def numel(self) -> int:
        """Total parameters."""
        return sum(layer.numel for layer in self.layers)

    @property
    def macs(self) -> int:
        """Forward multiply-accumulates per sample (parameterised layers only)."""
        return sum(layer.macs for layer in self.layers)


class _Builder:
    """Collects tensors in forward registration order."""

    def __init__(self) -> None:
        self.forward: List[CatalogLayer] = []

    def add(self, name: str, numel: int, reuse: int) -> None:
        self.forward.append(CatalogLayer(name, numel, numel * reuse))

    def conv(self, name: str, cout: int, cin: int, k: int, hw: int, bias: bool = False) -> None:
        """A ``k x k`` convolution with an ``hw x hw`` output."""
        self.add(f"{name}.weight", cout * cin * k * k, hw * hw)
        if bias:
            self.add(f"{name}.bias", cout, hw * hw)

    def norm(self, name: str, channels: int, reuse: int) -> None:
        """A BatchNorm / LayerNorm's weight and bias."""
        self.add(f"{name}.weight", channels, reuse)
        self.add(f"{name}.bias", channels, reuse)

    def linear(self, name: str, cout: int, cin: int, reuse: int) -> None:
        self.add(f"{name}.weight", cout * cin, reuse)
        self.add(f"{name}.bias", cout, reuse)

    def embedding(self, name: str, rows: int, width: int, lookups: int) -> None:
        self.forward.append(CatalogLayer(f"{name}.weight", rows * width, lookups * width))

    def ready_order(self) -> Tuple[CatalogLayer, ...]:
        return tuple(reversed(self.forward))


def _resnet50() -> Tuple[CatalogLayer, ...]:
    b = _Builder()
    b.conv("conv1", 64, 3, 7, 112)
    b.norm("bn1", 64, 112 * 112)
    inplanes, hw = 64, 56  # after the stride-2 max-pool
    stages = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))
    for s, (width, blocks, stride) in enumerate(stages, start=1):
        for i in range(blocks):
            p = f"layer{s}.{i}"
            out_hw = hw // (stride if i == 0 else 1)  # v1.5: the 3x3 conv strides
            b.conv(f"{p}.conv1", width, inplanes, 1, hw)
            b.norm(f"{p}.bn1", width, hw * hw)
            b.conv(f"{p}.conv2", width, width, 3, out_hw)
            b.norm(f"{p}.bn2", width, out_hw * out_hw)
            b.conv(f"{p}.conv3", 4 * width, width, 1, out_hw)
            b.norm(f"{p}.bn3", 4 * width, out_hw * out_hw)
            if i == 0:
                b.conv(f"{p}.downsample.0", 4 * width, inplanes, 1, out_hw)
                b.norm(f"{p}.downsample.1", 4 * width, out_hw * out_hw)
            inplanes, hw = 4 * width, out_hw
    b.linear("fc", 1000, 2048, 1)
    return b.ready_order()


def _vgg16() -> Tuple[CatalogLayer, ...]:
    b = _Builder()
    stages = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))
    idx, cin, hw = 0, 3, 224
    for widths in stages:
        for cout in widths:
            b.conv(f"features.{idx}", cout, cin, 3, hw, bias=True)
            idx += 2  # Conv2d and ReLU
            cin = cout
        hw //= 2
        idx += 1  # the stage's MaxPool2d
    dims = (512 * 7 * 7, 4096, 4096, 1000)
    for n, (cin_fc, cout) in enumerate(zip(dims[:-1], dims[1:])):
        b.linear(f"classifier.{3 * n}", cout, cin_fc, 1)  # Linear, ReLU, Dropout
    return b.ready_order()


def _bert_base(seq: int = 128) -> Tuple[CatalogLayer, ...]:
    return bert_layers(768, 3072, 12, seq)


def bert_layers(hidden: int, ffn: int, depth: int, seq: int) -> Tuple[CatalogLayer, ...]:
    """A BERT encoder's tensors (``bert-base`` is ``bert_layers(768, 3072, 12,
    128)``, BERT-large ``(1024, 4096, 24, seq)``), in gradient-ready order."""
    b = _Builder()
    vocab, positions, types = 30522, 512, 2
    b.embedding("embeddings.word_embeddings", vocab, hidden, seq)
    b.embedding("embeddings.position_embeddings", positions, hidden, seq)
    b.embedding("embeddings.token_type_embeddings", types, hidden, seq)
    b.norm("embeddings.LayerNorm", hidden, seq)
    for i in range(depth):
        p = f"encoder.layer.{i}"
        for proj in ("query", "key", "value"):
            b.linear(f"{p}.attention.self.{proj}", hidden, hidden, seq)
        b.linear(f"{p}.attention.output.dense", hidden, hidden, seq)
        b.norm(f"{p}.attention.output.LayerNorm", hidden, seq)
        b.linear(f"{p}.intermediate.dense", ffn, hidden, seq)
        b.linear(f"{p}.output.dense", hidden, ffn, seq)
        b.norm(f"{p}.output.LayerNorm", hidden, seq)
    b.linear("pooler.dense", hidden, hidden, 1)  # the [CLS] token only
    return b.ready_order()


def _gpt2_medium(seq: int = 1024) -> Tuple[CatalogLayer, ...]:
    b = _Builder()
    vocab, width, depth = 50257, 1024, 24
    # The token embedding is tied to the output projection: one tensor, whose
    # gradient comes from both (the projection: every token against every row).
    b.forward.append(CatalogLayer("wte.weight", vocab * width, seq * width + seq * vocab * width))
    b.embedding("wpe", 1024, width, seq)
    for i in range(depth):
        p = f"h.{i}"
        b.norm(f"{p}.ln_1", width, seq)
        b.linear(f"{p}.attn.c_attn", 3 * width, width, seq)
        b.linear(f"{p}.attn.c_proj", width, width, seq)
        b.norm(f"{p}.ln_2", width, seq)
        b.linear(f"{p}.mlp.c_fc", 4 * width, width, seq)
        b.linear(f"{p}.mlp.c_proj", width, 4 * width, seq)
    b.norm("ln_f", width, seq)
    return b.ready_order()


def _ptb_lstm(steps: int = 35) -> Tuple[CatalogLayer, ...]:
    b = _Builder()
    vocab, width, depth = 10000, 200, 2
    b.embedding("encoder", vocab, width, steps)
    for i in range(depth):
        b.add(f"rnn.weight_ih_l{i}", 4 * width * width, steps)
        b.add(f"rnn.weight_hh_l{i}", 4 * width * width, steps)
        b.add(f"rnn.bias_ih_l{i}", 4 * width, steps)
        b.add(f"rnn.bias_hh_l{i}", 4 * width, steps)
    b.linear("decoder", vocab, width, steps)
    return b.ready_order()


_BUILDERS: Dict[str, Tuple[Callable[[], Tuple[CatalogLayer, ...]], int, str]] = {
    "resnet50": (_resnet50, 32, "224x224 image"),
    "vgg16": (_vgg16, 32, "224x224 image"),
    "bert-base": (_bert_base, 32, "sequence of 128 tokens"),
    "ptb-lstm": (_ptb_lstm, 20, "sequence of 35 tokens"),
    "gpt2-medium": (_gpt2_medium, 8, "sequence of 1,024 tokens"),
}

#: Names of the built-in models.
MODELS: Tuple[str, ...] = tuple(_BUILDERS)


def catalog_model(model: str) -> CatalogModel:
    """The built-in model ``model`` (one of :data:`MODELS`).

    Raises:
        ValueError: unknown name.
    """
    if model not in _BUILDERS:
        names = ", ".join(repr(m) for m in MODELS)
        raise ValueError(f"model must be one of {names}, got {model!r}")
    build, batch, sample = _BUILDERS[model]
    return CatalogModel(model, build(), batch, sample)


def sparsify_cost(mem_bw: float = DEFAULT_MEM_BW, kernel_s: float = DEFAULT_KERNEL_S) -> CostModel:
    """Seconds to select and pack one layer vs its element count: four
    memory-bound passes over float32 plus a few kernels' fixed cost."""
    _check_positive("mem_bw", mem_bw)
    return CostModel(_SPARSIFY_KERNELS * kernel_s, _SPARSIFY_BYTES_PER_ELEMENT / mem_bw)


def pack_cost(mem_bw: float = DEFAULT_MEM_BW, kernel_s: float = DEFAULT_KERNEL_S) -> CostModel:
    """Seconds to copy one layer into a shared dense buffer: one copy kernel."""
    _check_positive("mem_bw", mem_bw)
    return CostModel(kernel_s, _PACK_BYTES_PER_ELEMENT / mem_bw)


def catalog_profile(
    model: str,
    *,
    world_size: int,
    bandwidth_bps: float,
    latency_s: float = DEFAULT_LATENCY_S,
    batch: Optional[int] = None,
    compute_flops: float = DEFAULT_COMPUTE_FLOPS,
    mem_bw: float = DEFAULT_MEM_BW,
    kernel_s: float = DEFAULT_KERNEL_S,
) -> Profile:
    """A predicted :class:`Profile` of a built-in model on an assumed cluster.

    Backward times come from the compute model in this module's docstring,
    the collectives from the ring models of :mod:`dlgs.core.planning.netmodel`, the
    sparsify and pack costs from ``mem_bw`` (:func:`sparsify_cost`,
    :func:`pack_cost`). Every number is a model, not a measurement.

    Args:
        model: one of :data:`MODELS`.
        world_size: ranks ``P`` (int >= 1).
        bandwidth_bps: link bandwidth in bit/s (> 0).
        latency_s: latency of one ring step in seconds (>= 0).
        batch: samples per worker and step (int >= 1); ``None`` takes the
            model's default (32 images or sequences; 20 for ``ptb-lstm``).
        compute_flops: sustained FLOP/s of one worker (> 0). Faster compute
            leaves less back-propagation to hide communication behind.
        mem_bw: sustained memory bandwidth of one worker in bytes/s (> 0).
        kernel_s: fixed cost of one device kernel in seconds (>= 0).

    Raises:
        ValueError: an argument out of range (the message names it).
    """
    check_network(world_size, bandwidth_bps, latency_s)
    spec = catalog_model(model)
    if batch is None:
        batch = spec.batch
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    _check_positive("compute_flops", compute_flops)
    if not isinstance(kernel_s, (int, float)) or not 0 <= kernel_s < float("inf"):
        raise ValueError(f"kernel_s must be a finite float >= 0 (seconds), got {kernel_s!r}")
    layers = tuple(
        LayerProfile(layer.name, layer.numel, 2 * (2 * layer.macs * batch) / compute_flops)
        for layer in spec.layers
    )
    return Profile(
        world_size=world_size,
        layers=layers,
        sparsify=sparsify_cost(mem_bw, kernel_s),
        pack=pack_cost(mem_bw, kernel_s),
        allgather=allgather_cost(world_size, bandwidth_bps, latency_s),
        allreduce=allreduce_cost(world_size, bandwidth_bps, latency_s),
    )


def _check_positive(name: str, value: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (0 < value < float("inf"))
    ):
        raise ValueError(f"{name} must be a finite float > 0, got {value!r}")
