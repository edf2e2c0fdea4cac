"""Counting and finding ops in ``torch.fx`` graphs, and asserting on what a pass changed.

An *op* is the target of a ``call_function`` node (the only kind of computing node in the
ATen graphs that passes see). It can be given as

* an ``OpOverload`` (``torch.ops.aten.add.Tensor``): that overload only;
* an ``OpOverloadPacket`` (``torch.ops.aten.add``): all its overloads;
* a string naming either through ``torch.ops`` (``"aten.add.Tensor"``, ``"aten.add"``,
  ``"_c10d_functional.all_reduce"``, optionally prefixed ``"torch.ops."``); unknown names
  raise ``ValueError``, so that a typo cannot make a count assertion pass vacuously;
* any other callable (``operator.getitem``, a higher-order operator).

Ops are matched by their readable name (:func:`op_name`): ``"aten.add.Tensor"``,
``"_c10d_functional.wait_tensor.default"``, ``"operator.getitem"``. Since passes rewrite graphs
in place, "before" counts can be kept as an :func:`op_counts` ``Counter`` instead of a copy of
the graph::

    before = op_counts(gm)
    MyFusion().run(gm, ctx)
    assert_replaced(before, gm, "aten.mm.default", "mylib.fused_mm.default", n=2)
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

__all__ = [
    "GraphLike",
    "OpLike",
    "assert_op_count",
    "assert_replaced",
    "count_ops",
    "find_ops",
    "op_counts",
    "op_name",
]

OpLike = torch._ops.OpOverload | torch._ops.OpOverloadPacket | str | Callable[..., Any]
"""What the helpers accept as an op (see the module docstring)."""

GraphLike = torch.fx.Graph | torch.fx.GraphModule | collections.Counter[str]
"""A graph, a graph module, or op counts taken earlier with :func:`op_counts`."""


def op_name(op: Any) -> str:
    """The readable name of an op: ``"aten.add.Tensor"``, ``"aten.add"``, ``"operator.getitem"``."""
    if isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(op)
    if isinstance(op, torch._ops.HigherOrderOperator):
        return f"higher_order.{op.name()}"
    return _callable_name(op)


def op_counts(graph: GraphLike) -> collections.Counter[str]:
    """How many ``call_function`` nodes call each op, by :func:`op_name`."""
    if isinstance(graph, collections.Counter):
        return collections.Counter(graph)
    return collections.Counter(op_name(node.target) for node in _calls(graph))


def find_ops(graph: torch.fx.Graph | torch.fx.GraphModule, op: OpLike) -> list[torch.fx.Node]:
    """The ``call_function`` nodes of ``graph`` that call ``op``, in graph order."""
    matches = _matcher(op)
    return [node for node in _calls(graph) if matches(op_name(node.target))]


def count_ops(graph: GraphLike, op: OpLike) -> int:
    """How many ``call_function`` nodes of ``graph`` call ``op``."""
    matches = _matcher(op)
    return sum(count for name, count in op_counts(graph).items() if matches(name))


def check_count(n: object, helper: str, what: str = "n") -> None:
    """Raise :class:`TypeError` unless ``n`` is an int (not a bool): ``"2"`` would otherwise
    fail as "expected 2, found 2"."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{helper}: {what} must be an int (a count), got {type(n).__name__} {n!r}")


def assert_op_count(graph: GraphLike, op: OpLike, n: int) -> None:
    """Assert that ``graph`` calls ``op`` exactly ``n`` times.

    Raises:
        AssertionError: with the expected and actual counts and all op counts of ``graph``.
    """
    check_count(n, "assert_op_count")
    found = count_ops(graph, op)
    if found != n:
        raise AssertionError(
            f"expected {n} call(s) of {_describe(op)}, found {found}\n"
            f"op counts:\n{_format_counts(op_counts(graph))}"
        )


def assert_replaced(before: GraphLike, after: GraphLike, old_op: OpLike, new_op: OpLike, n: int) -> None:
    """Assert that exactly ``n`` calls of ``old_op`` were replaced by calls of ``new_op``.

    Precisely: ``after`` has exactly ``n`` fewer calls of ``old_op`` than ``before``, and
    exactly ``n`` more calls of ``new_op``. Other ops are not checked: a fusion of
    ``mm`` + ``add`` into ``addmm`` is asserted with ``assert_replaced(before, after, mm,
    addmm, n)`` plus an :func:`assert_op_count` (or a second ``assert_replaced``) for ``add``.
    ``n=0`` asserts that neither count changed.

    Raises:
        ValueError: if ``n < 0`` or ``old_op`` and ``new_op`` name the same op.
        AssertionError: with the expected and actual changes and the op counts of both graphs.
    """
    check_count(n, "assert_replaced")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if _describe(old_op) == _describe(new_op):
        raise ValueError(f"old_op and new_op are the same op ({_describe(old_op)})")
    counts_before, counts_after = op_counts(before), op_counts(after)
    old = (count_ops(counts_before, old_op), count_ops(counts_after, old_op))
    new = (count_ops(counts_before, new_op), count_ops(counts_after, new_op))
    if old[0] - old[1] != n or new[1] - new[0] != n:
        raise AssertionError(
            f"expected {n} call(s) of {_describe(old_op)} replaced by {_describe(new_op)}, but "
            f"{_describe(old_op)} went {old[0]} -> {old[1]} and {_describe(new_op)} went {new[0]} -> {new[1]}\n"
            f"op counts (before -> after):\n{_format_diff(counts_before, counts_after)}"
        )


# --------------------------------------------------------------------------- internals


def _callable_name(fn: Any) -> str:
    """The readable ``module.name`` of a Python callable.

    The name is the one its module exposes it under (``torch.relu``, not
    ``torch._VariableFunctionsClass.relu``), else its qualified name.
    """
    name = getattr(fn, "__name__", None)
    if name is None:
        return repr(fn)
    module = getattr(fn, "__module__", None) or ""
    if getattr(sys.modules.get(module), name, None) is not fn:
        name = getattr(fn, "__qualname__", name)
    module = "operator" if module == "_operator" else module
    return f"{module}.{name}" if module else name


def _calls(graph: torch.fx.Graph | torch.fx.GraphModule) -> list[torch.fx.Node]:
    if isinstance(graph, torch.fx.GraphModule):
        graph = graph.graph
    if not isinstance(graph, torch.fx.Graph):
        raise TypeError(f"expected a torch.fx.Graph or GraphModule, got {type(graph).__name__}")
    return [node for node in graph.nodes if node.op == "call_function"]


def _resolve(op: OpLike) -> Any:
    """``op`` itself, or the ``torch.ops`` object that the string ``op`` names."""
    if not isinstance(op, str):
        if not callable(op):
            raise TypeError(f"expected an op (OpOverload, OpOverloadPacket, name or callable), got {op!r}")
        return op
    parts = op.removeprefix("torch.ops.").split(".")
    if len(parts) not in (2, 3):
        raise ValueError(f"op names look like 'namespace.op' or 'namespace.op.overload', got {op!r}")
    resolved: Any = torch.ops
    try:
        for part in parts:
            resolved = getattr(resolved, part)
    except (AttributeError, RuntimeError) as exc:
        raise ValueError(
            f"unknown op {op!r}: not found in torch.ops ({exc}); pass Python callables "
            "(operator.getitem, ...) as objects, not names"
        ) from exc
    return resolved


def _matcher(op: OpLike) -> Callable[[str], bool]:
    """A predicate on :func:`op_name` values that is true for the names of ``op``."""
    resolved = _resolve(op)
    name = op_name(resolved)
    if isinstance(resolved, torch._ops.OpOverloadPacket):
        return lambda candidate: candidate == name or candidate.rpartition(".")[0] == name
    return lambda candidate: candidate == name


def _describe(op: OpLike) -> str:
    return op_name(_resolve(op))


def _format_counts(counts: collections.Counter[str]) -> str:
    if not counts:
        return "  (no call_function nodes)"
    width = max(map(len, counts))
    return "\n".join(f"  {name:<{width}}  {count}" for name, count in sorted(counts.items()))


def _format_diff(before: collections.Counter[str], after: collections.Counter[str]) -> str:
    names = sorted(before.keys() | after.keys())
    if not names:
        return "  (no call_function nodes)"
    width = max(map(len, names))
    lines = []
    for name in names:
        change = after[name] - before[name]
        note = f"  ({change:+d})" if change else ""
        lines.append(f"  {name:<{width}}  {before[name]} -> {after[name]}{note}")
    return "\n".join(lines)
