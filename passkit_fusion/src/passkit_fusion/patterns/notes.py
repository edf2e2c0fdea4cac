"""Report notes every site-rewriting pass writes the same way: sites per layer and counted
reasons (why candidates were left)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


def counted(reasons: Iterable[str]) -> str:
    """``"reason a (x3); reason b"``: each distinct reason once, with its count when > 1."""
    return "; ".join(reason + (f" (x{n})" if n > 1 else "") for reason, n in Counter(reasons).items())


def per_layer(modules: Iterable[str]) -> str | None:
    """``"per layer: layers.0=1, layers.1=2, norm=1"`` from the sites' module paths (None if
    none is known): a site in ``layers.0.post_attention_layernorm`` counts for ``layers.0``."""
    layers = Counter(module.rpartition(".")[0] or module for module in modules if module)
    return "per layer: " + ", ".join(f"{k}={v}" for k, v in layers.items()) if layers else None


def rejected(reasons: list[str]) -> str | None:
    """``"N candidate(s) rejected: ..."``, or None when there are none."""
    return f"{len(reasons)} candidate(s) rejected: {counted(reasons)}" if reasons else None
