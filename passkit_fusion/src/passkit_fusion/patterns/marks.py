"""Marks a fusion pass leaves on the nodes it wrote, so that a later pass looking for the
same all-reduce sites can say they were taken rather than "no match"."""

from __future__ import annotations

from collections import Counter

import torch.fx as fx

TAKEN_BY = "passkit_fusion_taken_by"
"""``node.meta`` key: ``(pass name, site index)`` on the nodes that replaced a site."""


def mark(node: fx.Node, pass_name: str, site: int) -> None:
    node.meta[TAKEN_BY] = (pass_name, site)


def taken_sites(graph: fx.Graph) -> Counter[str]:
    """How many sites each pass took in ``graph`` (by the marks on its nodes)."""
    seen = {n.meta[TAKEN_BY] for n in graph.nodes if isinstance(n.meta.get(TAKEN_BY), tuple)}
    return Counter(name for name, _ in seen)


def taken_note(graph: fx.Graph) -> str | None:
    """``"no all-reduce left: 5 site(s) taken by sequence_parallel"``, or None."""
    taken = taken_sites(graph)
    if not taken:
        return None
    return "no all-reduce left: " + ", ".join(f"{n} site(s) taken by {name}" for name, n in taken.items())
