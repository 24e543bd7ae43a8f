"""Models defined in the project (torchvision does not import beside torch 2.13 here)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["FashionCNN"]


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
