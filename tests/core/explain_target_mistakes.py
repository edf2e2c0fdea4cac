"""Targets whose own code is the mistake (``passkit explain`` names each in one line)."""

import sys

import torch


def exits():
    """A factory that ends the program (a script's ``main`` given as the target)."""
    sys.exit(0)


class Raises(torch.nn.Module):
    def forward(self, x):
        if x.shape[-1] != 8:
            raise ValueError(f"expected 8 features, got {x.shape[-1]}")
        return x


def forward_raises():
    """A model whose forward raises on the example it is given."""
    return Raises(), (torch.randn(2, 4),)


def wrong_signature(rank):
    """A ``tune-model`` factory missing ``world_size`` and ``device``."""
    raise AssertionError("never called: the signature is checked before any rank starts")
