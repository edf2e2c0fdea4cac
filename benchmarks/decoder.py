"""A decoder-like stack for compile-time benchmarks (small widths, many layers)."""

from __future__ import annotations

import torch
from torch import nn

from passkit.demo import TinyBlock


def decoder_stack(layers: int, hidden: int = 64) -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(*[TinyBlock(hidden) for _ in range(layers)]).eval()
    return model, torch.randn(1, 16, hidden)
