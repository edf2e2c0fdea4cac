"""Report notes every site-rewriting pass writes the same way: sites per layer and counted
reasons (why candidates were left); and the one line a user reads when the host's own
fusion left a pass nothing to do (:func:`say_host_fused`)."""

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


_said_host_fused: set[tuple[str, str]] = set()


def say_host_fused(pass_name: str, note: str) -> None:
    """Warn once per process (and log on passkit's logger) that the host fused every site of
    a graph itself (``note``: :func:`.sites.host_fusion_note`'s): the pass found none left, so
    it did nothing there, never a second fusion."""
    key = (pass_name, note)
    if key in _said_host_fused:
        return
    _said_host_fused.add(key)
    import warnings

    from passkit import logs

    message = (
        f"passkit: {pass_name} found no site left in a graph: {note}; the host's own fusion does "
        f"this work (disable {pass_name}, or the host's fusion, to run one of them)"
    )
    logs.log.warning("%s", message)
    warnings.warn(message, UserWarning, stacklevel=3)
