"""What a pass changed, measured: one loop over the graph against the snapshot the pipeline
takes before each pass.

A pass's own ``PassResult.modified`` is a claim; :func:`diff` is the measurement. The
pipeline recompiles, blames Inductor failures and decides "did it change this graph" from
:attr:`GraphDiff.modified`, never from the flag. The loop compares each node with the
snapshot's node at the same position (name, op, target, arguments by name, and the identity
of its recorded ``meta["val"]``: the snapshot shares meta values, so an unchanged node has
the very same object), so its cost is one comparison per node.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx


@dataclasses.dataclass
class GraphDiff:
    modified: bool
    """Whether anything changed: a node added, removed, reordered, retargeted, rewired, or its
    recorded value replaced."""
    changed: list[torch.fx.Node]
    """The ``call_function`` nodes that are new or whose target or arguments changed."""
    removed: list[str]
    """Names of the snapshot's nodes that are gone (only filled when the graph changed)."""
    dangling: list[str] = dataclasses.field(default_factory=list)
    """``"user -> erased"`` for nodes of the graph that use a node no longer in it."""


def diff(graph: torch.fx.Graph, before: torch.fx.Graph) -> GraphDiff:
    """Compare ``graph`` with ``before`` (a :func:`passkit.graph_utils.snapshot` of it)."""
    old = list(before.nodes)
    modified = len(graph.nodes) != len(old)
    by_name: dict[str, torch.fx.Node] | None = None
    changed: list[torch.fx.Node] = []
    for i, node in enumerate(graph.nodes):
        prior = old[i] if i < len(old) else None
        if prior is None or prior.name != node.name:
            modified = True
            if by_name is None:
                by_name = {n.name: n for n in old}
            prior = by_name.get(node.name)
        if prior is None or prior.op != node.op:
            modified = True
            if node.op == "call_function":
                changed.append(node)
            continue
        if (
            prior.target is not node.target
            and not (isinstance(node.target, str) and prior.target == node.target)
        ) or not same(prior.args, node.args) or (
            bool(prior.kwargs or node.kwargs) and not same(prior.kwargs, node.kwargs)
        ):
            modified = True
            if node.op == "call_function":
                changed.append(node)
        elif prior.meta.get("val") is not node.meta.get("val"):
            modified = True
    removed: list[str] = []
    if modified:
        names = {n.name for n in graph.nodes}
        removed = [n.name for n in old if n.name not in names]
    dangling: list[str] = []
    if removed or len(graph.nodes) != len(old):
        present = set(graph.nodes)
        for node in graph.nodes:
            for used in node._input_nodes:
                if used not in present:
                    dangling.append(f"{node.name} -> {used.name}")
    return GraphDiff(modified, changed, removed, dangling)


def same(old: Any, new: Any) -> bool:
    """Whether two node arguments are equal, nodes compared by name (the snapshot's nodes
    are copies); a flat loop over the tuples of nodes and numbers most nodes have."""
    if isinstance(old, (tuple, list)):
        if not isinstance(new, (tuple, list)) or len(old) != len(new):
            return False
        for a, b in zip(old, new):
            if a is b:
                continue
            if isinstance(a, torch.fx.Node):
                if not (isinstance(b, torch.fx.Node) and a.name == b.name):
                    return False
            elif not same(a, b):
                return False
        return True
    if isinstance(old, torch.fx.Node):
        return isinstance(new, torch.fx.Node) and old.name == new.name
    if isinstance(old, dict):
        return (
            isinstance(new, dict)
            and old.keys() == new.keys()
            and same(list(old.values()), list(new.values()))
        )
    if old is new:
        return True
    try:
        return type(old) is type(new) and bool(old == new)
    except Exception:  # a value whose == gives no bool (a tensor constant)
        return False


__all__ = ["GraphDiff", "diff", "same"]
