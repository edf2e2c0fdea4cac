"""A pass must not make the graph write to its inputs (checked after every pass).

The graph's inputs are the caller's tensors (the pre-grad stage's placeholders are the very
tensors the user passed, and the model's parameters): a node a pass adds that writes to one
(``x.add_(100)`` after the last use of ``x``, ``aten.add_``, ``x[0] = 1``, ``out=x``)
leaves every output right and changes the caller's tensor behind its back, or, in training,
breaks autograd's version check with a message that names no pass. :func:`check` looks at
the nodes the pass added or changed only: each that writes to a tensor is followed back
through views to the input it writes to, and an input the graph did not write to before the
pass (functionalized graphs keep an input mutation as a ``copy_`` at the end) is a
:class:`~passkit.errors.VerificationError` naming the pass, the input and the node.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ..errors import VerificationError

_INPLACE_OPERATORS = frozenset(
    {
        "iadd",
        "isub",
        "imul",
        "itruediv",
        "ifloordiv",
        "imod",
        "ipow",
        "iand",
        "ior",
        "ixor",
        "ilshift",
        "irshift",
        "imatmul",
        "setitem",
    }
)
_VIEW_NAMES = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "transpose",
        "permute",
        "t",
        "T",
        "mT",
        "unsqueeze",
        "squeeze",
        "expand",
        "expand_as",
        "narrow",
        "select",
        "getitem",
        "__getitem__",
        "flatten",
        "unflatten",
        "as_strided",
        "detach",
        "split",
        "chunk",
        "unbind",
        "diagonal",
        "swapaxes",
        "movedim",
        "contiguous",
        "unfold",
        "view_as_real",
        "view_as_complex",
    }
)


def _name(target: Any) -> str:
    return target if isinstance(target, str) else str(getattr(target, "__name__", ""))


def written(node: torch.fx.Node) -> list[Any]:
    """The arguments ``node`` writes to (nodes or values), by its schema (ATen and custom
    ops), else by Python's conventions (a trailing ``_``, ``operator.iadd``, ``out=``,
    ``inplace=True``)."""
    if node.op not in ("call_function", "call_method"):
        return []
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        out: list[Any] = []
        for i, argument in enumerate(target._schema.arguments):
            info = argument.alias_info
            if info is None or not info.is_write:
                continue
            if argument.kwarg_only or i >= len(node.args):
                if argument.name in node.kwargs:
                    out.append(node.kwargs[argument.name])
            else:
                out.append(node.args[i])
        return out
    name = _name(target)
    if isinstance(target, torch._ops.OpOverloadPacket):
        name = str(target._qualified_op_name).rpartition("::")[2]
    out = []
    if node.args and (
        (name.endswith("_") and not name.startswith("_"))
        or (
            name.startswith("__i")
            and name.endswith("__")
            and name[3:-2] in {n[1:] for n in _INPLACE_OPERATORS}
        )
        or name in ("__setitem__",)
        or (node.op == "call_function" and name in _INPLACE_OPERATORS)
        or node.kwargs.get("inplace") is True
    ):
        out.append(node.args[0])
    if "out" in node.kwargs:
        value = node.kwargs["out"]
        out.extend(value if isinstance(value, (tuple, list)) else [value])
    return out


def _is_view(node: torch.fx.Node) -> bool:
    if node.op not in ("call_function", "call_method") or not node.args:
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        returns = target._schema.returns
        return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
    return _name(target) in _VIEW_NAMES


def root_input(value: Any) -> torch.fx.Node | None:
    """The placeholder ``value`` is (or is a view of), else None."""
    seen = 0
    while isinstance(value, torch.fx.Node) and seen < 10_000:
        if value.op == "placeholder":
            return value
        if not _is_view(value):
            return None
        value = value.args[0]
        seen += 1
    return None


def writes(nodes: Any) -> dict[str, torch.fx.Node]:
    """Per input (placeholder name) the first of ``nodes`` that writes to it."""
    found: dict[str, torch.fx.Node] = {}
    for node in nodes:
        for arg in written(node):
            root = root_input(arg)
            if root is not None:
                found.setdefault(root.name, node)
    return found


def check(
    graph: torch.fx.Graph, before: torch.fx.Graph, changed: list[torch.fx.Node], pass_name: str
) -> None:
    """Raise :class:`VerificationError` naming ``pass_name`` when a node it added or changed
    (``changed``) writes to an input of ``graph`` that ``before`` (the graph before the pass)
    did not write to."""
    new = writes(changed)
    if not new:
        return
    already = writes(before.nodes)
    fresh = {name: node for name, node in new.items() if name not in already}
    if not fresh:
        return
    name, node = next(iter(fresh.items()))
    raise VerificationError(
        f"after pass {pass_name!r}: {node.name} = {_name(node.target) or node.target}(...) writes "
        f"to the graph's input {name!r}, which the graph did not write to before the pass (the "
        "caller's tensor would change; a pass must not mutate the graph's inputs)"
    )


__all__ = ["check", "root_input", "writes", "written"]
