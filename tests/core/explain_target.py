"""A target for ``passkit explain`` in the CLI tests."""

import torch


def make():
    def f(x):
        return torch.relu(x.view(2, 8).view(16)) * 3.0

    return f, (torch.randn(16),)


def not_a_pair():
    return 42


def make_tokens():
    """A model whose first dimension (tokens) may vary: ``--dynamic`` keeps it symbolic."""

    def f(x):
        return torch.relu(x) * 3.0

    return f, (torch.randn(16, 8),)


def _check_sizes(n):
    raise ValueError(f"size {n} is not a multiple of 8")


def boom():
    """A factory that raises: ``passkit explain`` names it in one line, with these frames."""
    return _check_sizes(12)
