"""What a pass changed, measured, not declared.

A pass's own ``PassResult.modified`` is a claim; :func:`measure` is the measurement. The
pipeline recompiles, blames Inductor failures and decides "did it change this graph" from
:attr:`GraphDiff.modified`, never from the flag.

The measurement is a fingerprint taken before the pass (:func:`fingerprint`): the graph's
node objects in order and, per node, its target, its ``args`` and ``kwargs`` tuples and its
recorded ``meta["val"]``, held by reference. torch.fx gives a node new argument tuples
whenever its arguments change (``update_arg``, ``replace_all_uses_with``, ``node.args =``),
so after the pass the same objects in the same order mean "unchanged", compared by identity
in C (``map(operator.is_not, ...)``): no Python loop over the nodes unless the pass added,
removed or moved some. The pipeline keeps a fingerprint (and the snapshot taken with it) from
one pass to the next while the graph does not change (:mod:`passkit._pipeline.baseline`), so a pass
costs one measurement, not two. :func:`diff` compares with a snapshot by node names instead (slower:
for tools that have no fingerprint).
"""

from __future__ import annotations

import dataclasses
import operator
from itertools import chain, compress, repeat
from typing import Any

import torch.fx

_TARGET = operator.attrgetter("target")
_ARGS = operator.attrgetter("_args")  # the ``args`` property costs twice as much
_KWARGS = operator.attrgetter("_kwargs")
_META = operator.attrgetter("meta")
_INPUTS = operator.attrgetter("_input_nodes")

CALLS = frozenset({"call_function", "call_method", "call_module"})
"""The node kinds that compute something (what a rewrite's checks re-run): a pre-grad graph
calls tensor methods (``x.narrow(0, 0, 4)``) and modules as well as functions."""


@dataclasses.dataclass
class GraphDiff:
    modified: bool
    """Whether anything changed: a node added, removed, reordered, retargeted, rewired, or its
    recorded value replaced."""
    changed: list[torch.fx.Node]
    """The call nodes (:data:`CALLS`: functions, methods, modules) that are new or whose target
    or arguments changed."""
    removed: list[str]
    """Names of the snapshot's nodes that are gone (only filled when the graph changed)."""
    dangling: list[str] = dataclasses.field(default_factory=list)
    """``"user -> erased"`` for nodes of the graph that use a node no longer in it."""
    prior: dict[torch.fx.Node, torch.fx.Node] = dataclasses.field(default_factory=dict)
    """For the changed nodes that existed before the pass: their copy in the snapshot (in a
    graph a pass installed in place of the one it got, the snapshot's node of the same name)."""


@dataclasses.dataclass
class Fingerprint:
    """The graph before a pass (see the module docstring); references, no copies."""

    nodes: list[torch.fx.Node]
    fields: tuple[list[Any], ...]
    """Per field (target, args, kwargs, recorded value): the nodes' objects, in node order."""


def fingerprint(graph: torch.fx.Graph) -> Fingerprint:
    nodes = list(graph.nodes)
    return Fingerprint(nodes, _fields(nodes))


def _fields(nodes: list[torch.fx.Node]) -> tuple[list[Any], ...]:
    return (
        list(map(_TARGET, nodes)),
        list(map(_ARGS, nodes)),
        list(map(_KWARGS, nodes)),
        list(map(dict.get, map(_META, nodes), repeat("val"))),
    )


def measure(graph: torch.fx.Graph, before: Fingerprint, saved: torch.fx.Graph) -> GraphDiff:
    """What changed in ``graph`` since ``before`` was taken; ``saved``: the snapshot taken
    with it (same nodes, same order), whose copies are the changed nodes' :attr:`GraphDiff.prior`.
    Every step is a C-level map over the nodes; Python loops only over what changed."""
    nodes = list(graph.nodes)
    same_nodes = nodes == before.nodes  # identity per node
    if (
        same_nodes
        and all(
            all(map(operator.is_, map(get, nodes), old))
            for get, old in zip((_TARGET, _ARGS, _KWARGS), before.fields)
        )
        and all(map(operator.is_, map(dict.get, map(_META, nodes), repeat("val")), before.fields[3]))
    ):
        return GraphDiff(False, [], [])
    old_index: list[int] | None = None  # per kept node, its index in ``before`` (None: the same)
    if same_nodes:
        kept, added = nodes, []
    else:
        position = dict(zip(before.nodes, range(len(before.nodes))))
        found = list(map(position.get, nodes))
        is_new = list(map(operator.is_, found, repeat(None)))
        kept, added = list(compress(nodes, map(operator.not_, is_new))), list(compress(nodes, is_new))
        if kept != before.nodes:  # nodes removed or moved (not only added)
            old_index = [j for j in found if j is not None]
    wiring = (_TARGET, _ARGS, _KWARGS)  # not the value: a new value is no rewiring
    rewired_set: set[int] = set()
    for get, old in zip(wiring, before.fields):
        if old_index is not None:
            old = list(map(old.__getitem__, old_index))
        rewired_set.update(compress(range(len(kept)), map(operator.is_not, map(get, kept), old)))
    rewired = sorted(rewired_set)
    old_nodes = list(saved.nodes)
    prior = {kept[k]: old_nodes[k if old_index is None else old_index[k]] for k in rewired}
    if added and not kept:  # a new graph object (``gm.graph = new``): its nodes' priors by name
        by_name = {n.name: n for n in old_nodes}
        prior.update((n, old) for n in added if (old := by_name.get(n.name)) is not None and old.op == n.op)
    changed_set = {*prior, *added}
    in_order = compress(nodes, map(changed_set.__contains__, nodes)) if changed_set else ()
    changed = [n for n in in_order if n.op in CALLS]
    removed: list[str] = []
    dangling: list[str] = []
    if not same_nodes:
        present = set(nodes)
        gone = list(compress(before.nodes, map(operator.not_, map(present.__contains__, before.nodes))))
        removed = [n.name for n in gone]
        used = chain.from_iterable(map(_INPUTS, nodes))
        if gone and any(map(set(gone).__contains__, used)):
            dangling = [
                f"{node.name} -> {inp.name}"
                for node in nodes
                for inp in node._input_nodes
                if inp not in present
            ]
    return GraphDiff(True, changed, removed, dangling, prior)


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
            if node.op in CALLS:
                changed.append(node)
            continue
        if (
            (
                prior.target is not node.target
                and not (isinstance(node.target, str) and prior.target == node.target)
            )
            or not same(prior.args, node.args)
            or (bool(prior.kwargs or node.kwargs) and not same(prior.kwargs, node.kwargs))
        ):
            modified = True
            if node.op in CALLS:
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


__all__ = ["CALLS", "Fingerprint", "GraphDiff", "diff", "fingerprint", "measure", "same"]
