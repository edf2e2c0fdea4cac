"""What may sit between an all-reduce's sum and the residual add / RMSNorm without changing
the fused math: the *lead* of a site.

Models rarely add the all-reduce's sum to the residual directly:

* the MoE blocks of Mixtral, Qwen3-MoE, DeepSeek... compute on ``[tokens, hidden]`` and
  reshape the result back to ``[batch, seq, hidden]`` after the all-reduce (``view``,
  ``reshape``, ``_unsafe_view``, ``flatten`` / ``unflatten`` / ``(un)squeeze`` of the leading
  dims), or a copy of it (``clone``, ``.contiguous()``): a view that keeps the last (hidden)
  dimension is the same rows in the same order;
* Granite scales each block's output by ``residual_multiplier`` (and the embedding by
  ``embedding_multiplier``), Gemma the embedding by ``sqrt(hidden)``: a multiplication (or
  division) by a Python number or a 0-d constant tensor. The all-reduce is linear, so the
  scale can move onto its input: ``sum_r(c * x_r) = c * sum_r(x_r)``, exact up to rounding.

:func:`walk_lead` collects such nodes after the sum (each but the last used only by the
next); :func:`replay_lead` applies them to the all-reduce's *input* when a rewrite moves
them before the collective; :func:`describe_chain` formats a chain of nodes for a
rejection reason (``all_reduce -> wait_tensor -> mul(·, 0.22) -> add``).

A 0-d tensor scale must be a constant the same on every rank: a ``get_attr`` constant, a
graph input (a lifted buffer such as Gemma 3's ``embed_scale``; a 0-d tensor cannot be
sharded by tensor parallelism), a factory op (``full``, ``scalar_tensor``) or a dtype
conversion / view of one of those. Anything computed from the activations (a router
weight) is not a scale and stops the walk.
"""

from __future__ import annotations

import numbers
from collections.abc import Collection, Iterable, Sequence

import torch
import torch.fx as fx

from .graph import same_shape, sole_user

__all__ = [
    "describe_chain",
    "is_lead_op",
    "is_sum",
    "is_view",
    "mixes_rows",
    "node_label",
    "reads_own_input",
    "replay_lead",
    "walk_lead",
]

aten = torch.ops.aten

_VIEWS = frozenset(
    {
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.flatten.using_ints,
        aten.unflatten.int,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.clone.default,  # a copy (``.contiguous()``): the same values
        aten.alias.default,
    }
)
_SUMS = frozenset({aten.sum.dim_IntList})
_SCALES = frozenset({aten.mul.Tensor, aten.mul.Scalar})
_DIVISIONS = frozenset({aten.div.Tensor, aten.div.Scalar})
_CONSTANT_FACTORIES = frozenset(
    {aten.full.default, aten.scalar_tensor.default, aten.lift_fresh_copy.default, aten.clone.default}
)
_CONSTANT_MAX_DEPTH = 4


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` is a view op of the lead (one that keeps the last dimension when
    :func:`walk_lead` took it)."""
    return node.op == "call_function" and node.target in _VIEWS


def is_sum(node: fx.Node) -> bool:
    """Whether ``node`` is a sum over leading dims (Llama-4's top-k sum of expert outputs,
    ``y.view(k, T, H).sum(0)``): linear, so it commutes with the all-reduce, but it mixes rows
    (a rewrite that shards tokens applies it before the collective)."""
    return node.op == "call_function" and node.target in _SUMS


def reads_own_input(node: fx.Node) -> bool:
    """A view or a sum of the lead: it reads its own first argument (a scale reads the node
    before it)."""
    return is_view(node) or is_sum(node)


def mixes_rows(nodes: Iterable[fx.Node]) -> bool:
    """Whether a lead sums rows (then sharding tokens after the collective would be wrong)."""
    return any(is_sum(n) for n in nodes)


def walk_lead(result: fx.Node) -> tuple[fx.Node, ...]:
    """The views and scales after ``result`` (the all-reduce's sum), in order: each node's
    only user is the next one (the last may have any users). Empty when ``result`` is read
    by several nodes or by anything else."""
    lead: list[fx.Node] = []
    node = result
    while (user := sole_user(node)) is not None and is_lead_op(user, node):
        lead.append(user)
        node = user
    return tuple(lead)


def is_lead_op(node: fx.Node, prev: fx.Node) -> bool:
    """Whether ``node`` (reading ``prev``) is a view keeping the hidden dim or a constant
    scale that keeps shape and dtype."""
    if node.op != "call_function" or not node.args or node.kwargs.keys() - {"rounding_mode", "memory_format"}:
        return False
    before, after = prev.meta.get("val"), node.meta.get("val")
    if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return False
    if after.dtype != before.dtype or after.dim() == 0 or before.dim() == 0:
        return False
    if node.target in _VIEWS:
        if node.target is aten.clone.default and node.kwargs.keys() - {"memory_format"}:
            return False
        return node.args[0] is prev and same_shape(after.shape[-1:], before.shape[-1:])
    if node.target in _SUMS:
        dims = node.args[1] if len(node.args) > 1 else None
        if node.args[0] is not prev or not isinstance(dims, (list, tuple)) or not dims:
            return False
        last = before.dim() - 1
        if any(not isinstance(d, int) or d % before.dim() == last for d in dims):
            return False
        return same_shape(after.shape[-1:], before.shape[-1:])
    if not same_shape(after.shape, before.shape):
        return False
    if node.target in _SCALES:
        a, b = node.args[:2]
        other = b if a is prev else a if b is prev else None
        return other is not None and other is not prev and _is_scale(other)
    if node.target in _DIVISIONS and node.kwargs.get("rounding_mode") is None:
        return node.args[0] is prev and _is_scale(node.args[1])
    return False


def _is_scale(operand: object) -> bool:
    if isinstance(operand, numbers.Real) and not isinstance(operand, bool):
        return True
    if not isinstance(operand, fx.Node):
        return False
    value = operand.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dim() == 0 and _is_constant(operand, 0)


def _is_constant(node: fx.Node, depth: int) -> bool:
    """``node`` is the same on every rank: a constant, a graph input (a lifted buffer or
    parameter), a factory op, or a cast / view of one (see the module docstring)."""
    if node.op in ("get_attr", "placeholder"):
        return True
    if node.op != "call_function" or depth >= _CONSTANT_MAX_DEPTH:
        return False
    from .rmsnorm import cast_dtype

    inputs = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
    if node.target in _CONSTANT_FACTORIES or cast_dtype(node) is not None or node.target in _VIEWS:
        return all(_is_constant(a, depth + 1) for a in inputs)
    return False


def replay_lead(
    graph: fx.Graph, lead: Sequence[fx.Node], start: fx.Node, x: fx.Node, identity: Collection[fx.Node] = ()
) -> fx.Node:
    """Copy the ``lead`` nodes (read from ``start``) onto ``x`` at the graph's insertion
    point, with fake values; returns the last copy (``x`` itself for an empty lead). A view
    reads its own first argument (so views that followed other ops in the graph, e.g. after
    a shared term's add, apply too); a scale reads the node before it in ``lead``. Views
    become ``reshape`` where ``x`` is not contiguous (an all-reduce's sum always is).
    ``identity``: nodes of ``lead`` not copied (what read them reads ``x``'s copy so far: a
    row-parallel bias add, whose bias is added after the all-reduce instead)."""
    from torch._guards import detect_fake_mode
    from torch.fx.node import map_arg

    current = x
    previous = start
    for node in lead:
        if node in identity:
            previous = node
            continue
        source = node.args[0] if reads_own_input(node) else previous
        copy = graph.node_copy(node, lambda a, prev=source, cur=current: cur if a is prev else a)
        copy.meta = {k: v for k, v in node.meta.items() if k != "val"}
        source = current.meta["val"]
        if copy.target in (aten.view.default, aten._unsafe_view.default) and not source.is_contiguous():
            copy.target = aten.reshape.default
        args, kwargs = map_arg((copy.args, copy.kwargs), lambda a: a.meta["val"])
        fake_mode = detect_fake_mode([source])
        if fake_mode is None:
            raise RuntimeError("the graph's tensors carry no fake values")
        with fake_mode:
            copy.meta["val"] = copy.target(*args, **kwargs)  # type: ignore[operator]
        previous, current = node, copy
    return current


def node_label(node: fx.Node) -> str:
    """A short, graph-independent label: the op's name, with its number arguments
    (``mul(·, 0.22)``; node arguments are ``·``)."""
    if node.op != "call_function":
        return node.op
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet, "__name__", None) or getattr(target, "__name__", str(target))
    numbers_ = [a for a in node.args if isinstance(a, numbers.Real) and not isinstance(a, bool)]
    if target in _SCALES or target in _DIVISIONS:
        shown = ["·" if isinstance(a, fx.Node) else _number(a) for a in node.args[:2]]
        return f"{name}({', '.join(shown)})"
    if numbers_ and name in ("add", "sub"):
        return f"{name}(·, {_number(numbers_[0])})"
    return str(name)


def _number(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def describe_chain(nodes: Iterable[fx.Node], next_users: Iterable[fx.Node] = ()) -> str:
    """``"all_reduce -> wait_tensor -> mul(·, 0.22) -> add"``, then ``-> {a, b}`` for the
    users of the last node where the match stopped (one user: ``-> a``)."""
    labels = [node_label(n) for n in nodes]
    users = sorted({node_label(u) for u in next_users})
    if len(users) == 1:
        labels.append(users[0])
    elif users:
        labels.append("{" + ", ".join(users) + "}")
    return " -> ".join(labels)
