"""Bundled example models with synthetic data (for the example job, tests and benchmarks).

Each entry of ``MODELS`` builds a model and a batch maker. ``wide_mlp`` is communication-bound on
purpose: many parameters, little compute per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Example", "TinyTransformer", "get_example"]


class TinyTransformer(nn.Module):
    """A small encoder-only transformer classifier (uses nn.MultiheadAttention)."""

    def __init__(self, vocab: int = 1000, dim: int = 128, heads: int = 4, layers: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=0.1, batch_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.encoder:
            x = layer(x)
        return self.head(self.norm(x).mean(dim=1))


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _convnet() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, 10),
    )


@dataclass(frozen=True)
class Example:
    """A bundled model: how to build it and how to make a synthetic batch of ``batch_size``."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    batch_size: int


def _images(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def _tokens(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 1000, (n, 32), generator=g), torch.randint(0, 10, (n,), generator=g)


def _vectors(width: int) -> Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    def make(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, width, generator=g), torch.randint(0, 10, (n,), generator=g)

    return make


MODELS: dict[str, Example] = {
    "mlp": Example("mlp", lambda: _mlp([256, 512, 512, 256, 10]), _vectors(256), 64),
    "convnet": Example("convnet", _convnet, _images, 32),
    "transformer": Example("transformer", TinyTransformer, _tokens, 16),
    "wide_mlp": Example("wide_mlp", lambda: _mlp([1024, 2048, 2048, 2048, 10]), _vectors(1024), 4),
}


def get_example(name: str) -> Example:
    """The bundled model called ``name`` (one of ``MODELS``)."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown example model {name!r}; choose one of {', '.join(MODELS)}") from None
