"""A target for ``passkit explain`` in the CLI tests."""

import torch


def make():
    def f(x):
        return torch.relu(x.view(2, 8).view(16)) * 3.0

    return f, (torch.randn(16),)


def not_a_pair():
    return 42
