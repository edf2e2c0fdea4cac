"""Targets for ``passkit bisect`` in the tests: N = 9 sites of each kind, in a chain."""

import os

import torch

SCALES = [1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5, 9.5]


def make():
    def f(x):
        for c in SCALES:
            x = torch.neg(torch.relu(x) * c) * 0.25 + 1.0
        return (x,)

    return f, (torch.randn(8),)


class Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        for c in SCALES:
            x = torch.tanh(x * self.w) * c
        return x


def make_training():
    return Chain(), (torch.randn(4, 8),)


def make_unseeded():
    """Weights drawn from the operating system's entropy: another process, other weights."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    chain = Chain()
    with torch.no_grad():
        chain.w.copy_(torch.randn(8, generator=gen))
    return chain, (torch.randn(4, 8),)
