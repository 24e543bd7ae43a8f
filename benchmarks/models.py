"""Models defined in the project (torchvision does not import beside torch 2.13 here)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["FashionCNN", "ResNet20", "VGG16", "LSTMLM", "BertSmall", "TransformerLM"]


class FashionCNN(nn.Module):
    """A small CNN for 28x28 grey images: two 3x3 conv blocks and two linear
    layers (0.42 M parameters; 96% of them in the first linear layer)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet20(nn.Module):
    """ResNet-20 for 32x32 inputs (He et al., 2016): 0.27 M parameters in 65
    tensors, most of them small (batch-norm), a typical latency-bound model."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for b in range(3):
                layers.append(_BasicBlock(cin, cout, stride if b == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(torch.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(out, 1), 1))


# VGG-16's convolution stages for 32x32 inputs (configuration D of Simonyan &
# Zisserman, with batch-norm): (width, convs); each stage ends in a 2x2 max-pool.
_VGG16_STAGES = ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3))


class VGG16(nn.Module):
    """VGG-16 with batch-norm for 32x32 inputs (CIFAR-style): 13 3x3 conv
    layers, then a 512->512->512->classes classifier (15.25 M parameters;
    ``deep_classifier=False``: one 512->classes layer, 14.73 M). Few, large
    tensors: the bandwidth-bound counterpart of :class:`ResNet20`."""

    def __init__(self, num_classes: int = 10, deep_classifier: bool = True):
        super().__init__()
        layers: list = []
        cin = 3
        for width, convs in _VGG16_STAGES:
            for _ in range(convs):
                layers += [nn.Conv2d(cin, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
                cin = width
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        if deep_classifier:
            self.classifier = nn.Sequential(
                nn.Linear(512, 512),
                nn.ReLU(),
                nn.Linear(512, 512),
                nn.ReLU(),
                nn.Linear(512, num_classes),
            )
        else:
            self.classifier = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class LSTMLM(nn.Module):
    """Word-level LSTM language model for Penn Treebank (Zaremba et al.'s small
    configuration): embedding, two LSTM layers, linear decoder over the vocabulary.

    With the defaults (vocabulary 10000, 200 wide, untied) it has 4.65 M
    parameters, 86% of them in the embedding and the decoder: two large tensors
    whose gradients are dense (``nn.Embedding(sparse=False)``).

    Args:
        vocab: vocabulary size.
        emb: embedding width (must equal ``hidden`` when ``tied``).
        hidden: LSTM width.
        layers: LSTM layers.
        dropout: dropout on the embedding, between layers and before the decoder.
        tied: share the embedding matrix with the decoder (Press & Wolf, 2017).

    ``forward`` takes ``(batch, seq)`` token ids and returns ``(batch, seq, vocab)``
    logits; every sequence starts from a zero state (no state carried between
    batches).
    """

    def __init__(
        self,
        vocab: int = 10000,
        emb: int = 200,
        hidden: int = 200,
        layers: int = 2,
        dropout: float = 0.0,
        tied: bool = False,
    ):
        super().__init__()
        if tied and emb != hidden:
            raise ValueError(f"tied=True needs emb == hidden, got emb={emb}, hidden={hidden}")
        self.embedding = nn.Embedding(vocab, emb)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(
            emb, hidden, layers, batch_first=True, dropout=dropout if layers > 1 else 0.0
        )
        self.decoder = nn.Linear(hidden, vocab)
        if tied:
            self.decoder.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.drop(self.embedding(tokens)))
        return self.decoder(self.drop(out))


class BertSmall(nn.Module):
    """A small BERT-like encoder with a masked-LM head: token and learned
    position embeddings, ``layers`` post-norm ``nn.TransformerEncoderLayer``
    blocks (GELU), and a decoder over the vocabulary tied to the token embedding.

    The defaults (4 layers, 512 wide, 8 heads, FFN 2048, vocabulary 8000,
    sequences of 128) give 17.0 M parameters: a mid-sized, transformer-shaped
    gradient (many 0.26-1 M matrices plus one 4.1 M embedding).

    ``forward`` takes ``(batch, seq)`` token ids and returns ``(batch, seq, vocab)``
    logits.
    """

    def __init__(
        self,
        vocab: int = 8000,
        hidden: int = 512,
        layers: int = 4,
        heads: int = 8,
        ffn: int = 2048,
        max_len: int = 128,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.token = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_len, hidden)
        self.norm = nn.LayerNorm(hidden)
        block = nn.TransformerEncoderLayer(
            hidden, heads, ffn, dropout=dropout, activation="gelu", batch_first=True
        )
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.LayerNorm(hidden))
        self.decoder = nn.Linear(hidden, vocab)
        self.decoder.weight = self.token.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.norm(self.token(tokens) + self.position(pos))
        return self.decoder(self.head(self.encoder(x)))


class TransformerLM(nn.Module):
    """A small causal transformer language model for Penn Treebank: token and
    learned position embeddings, ``layers`` pre-norm ``nn.TransformerEncoderLayer``
    blocks under a causal mask, a final norm and a decoder tied to the token
    embedding.

    The defaults (vocabulary 10000, 2 layers, 128 wide, 4 heads, FFN 512,
    windows of 35) give 1.68 M parameters: one 1.28 M embedding (tied to the
    decoder) and a dozen 16-65 K matrices, the shape of a transformer's gradient
    at a size two CPU cores train in minutes.

    ``forward`` takes ``(batch, seq)`` token ids and returns ``(batch, seq, vocab)``
    logits, each position seeing only those before it.
    """

    def __init__(
        self,
        vocab: int = 10000,
        hidden: int = 128,
        layers: int = 2,
        heads: int = 4,
        ffn: int = 512,
        max_len: int = 35,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.token = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_len, hidden)
        block = nn.TransformerEncoderLayer(
            hidden,
            heads,
            ffn,
            dropout=dropout,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)
        self.decoder = nn.Linear(hidden, vocab)
        self.decoder.weight = self.token.weight
        # GPT-2's scale: at Embedding's N(0, 1) the tied decoder's logits start
        # around +-11, and the softmax's tiny probabilities turn into denormal
        # gradients that slow a CPU's matrix products some fifty-fold.
        for emb in (self.token, self.position):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        pos = torch.arange(seq, device=tokens.device)
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=tokens.device)
        x = self.blocks(self.token(tokens) + self.position(pos), mask=mask, is_causal=True)
        return self.decoder(self.norm(x))
