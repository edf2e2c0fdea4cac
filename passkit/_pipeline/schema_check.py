"""A cheap structural check after each pass, on by default (``verify`` off or on).

A pass that calls an ATen op with arguments its schema does not accept (``relu(x, x)``, a
keyword the op does not have, a missing argument, a number where a tensor must go) leaves a
graph that Inductor rejects much later, in lowering, with a message that names no pass.
:func:`check` runs right after the pass instead, on the nodes it added or changed only (found
by comparing with the snapshot the pipeline takes anyway): each ``call_function`` node whose
target is an ATen/custom op overload must bind to its op's schema. The cost is one pass over
the graph comparing targets and arguments, plus one ``inspect.Signature.bind`` per changed
node; the full fake-tensor re-propagation stays behind ``verify = true``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.fx

from ..errors import VerificationError, cut
from . import graph_diff

_MAX_LISTED = 5
_TENSOR_LIKE = (
    torch.fx.Node,
    torch.Tensor,
    int,
    float,
    bool,
    complex,
    torch.SymInt,
    torch.SymFloat,
    torch.SymBool,
)
"""What a ``Tensor`` argument may hold in a graph (ATen wraps numbers into tensors)."""


def changed_nodes(graph: torch.fx.Graph, before: torch.fx.Graph) -> list[torch.fx.Node]:
    """The ``call_function`` nodes of ``graph`` that are new since ``before`` (a snapshot of
    it, same node names) or whose target or arguments changed."""
    return graph_diff.diff(graph, before).changed


def problem(node: torch.fx.Node) -> str | None:
    """Why ``node``'s arguments do not fit its op's schema, or None (also None for targets
    that have no schema: Python functions, higher-order ops)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        overloads = [getattr(target, name) for name in target.overloads()]
        found = [_mismatch(o, node.args, node.kwargs) for o in overloads]
        if overloads and all(found):
            return f"{_call(node)}: no overload of {target} accepts these arguments ({found[0]})"
        return None
    if not isinstance(target, torch._ops.OpOverload):
        return None
    why = _mismatch(target, node.args, node.kwargs)
    return f"{_call(node)}: {why} (schema {target._schema})" if why else None


_CPU_KEYS = (
    "CPU",
    "CompositeExplicitAutograd",
    "CompositeImplicitAutograd",
    "CompositeExplicitAutogradNonFunctional",
)


def no_kernel(node: torch.fx.Node) -> str | None:
    """Why ``node``'s op cannot run where the graph's tensors are: an op without a CPU
    kernel (one for CUDA only, or a fake implementation only) called on CPU tensors, which
    compiles and then fails at the first call, naming no pass. None when the op has one, or
    the tensors are not (known to be) on the CPU."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload):
        return None
    values = [a.meta.get("val") for a in node.all_input_nodes] + [node.meta.get("val")]
    devices = {v.device.type for v in values if isinstance(v, torch.Tensor)}
    if devices != {"cpu"}:
        return None
    name = op.name()
    try:
        has = [torch._C._dispatch_has_kernel_for_dispatch_key(name, key) for key in _CPU_KEYS]
    except RuntimeError:  # not a dispatcher op after all
        return None
    python = {str(key) for key in getattr(op, "py_kernels", {})}
    if any(has) or any(key.rpartition(".")[2] in _CPU_KEYS for key in python):
        return None
    return f"{_call(node)}: {op} has no CPU kernel, and the graph's tensors are on the CPU (it would fail at the first call)"


def check(
    graph: torch.fx.Graph,
    before: torch.fx.Graph,
    pass_name: str,
    changed: list[torch.fx.Node] | None = None,
) -> None:
    """Raise :class:`VerificationError` naming ``pass_name`` and the nodes when a node it
    added or changed (``changed``, else found by comparing with ``before``) does not bind to
    its op's schema."""
    if changed is None:
        changed = changed_nodes(graph, before)
    problems = [why for node in changed if (why := problem(node) or no_kernel(node))]
    if not problems:
        return
    more = (
        f" (and {len(problems) - 1} more: " + "; ".join(problems[1:_MAX_LISTED]) + ")"
        if len(problems) > 1
        else ""
    )
    raise VerificationError(f"after pass {pass_name!r}: {problems[0]}{more}")


def _mismatch(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    signature = _signature(op)
    if signature is None:
        return None
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        return str(exc)
    for argument, name in zip(op._schema.arguments, signature.parameters):
        if name in bound.arguments and _wants_tensor(argument.type):
            value = bound.arguments[name]
            if not isinstance(value, _TENSOR_LIKE):
                return f"argument {argument.name!r} must be a Tensor, got {cut(repr(value), 80)}"
    return None


def _wants_tensor(schema_type: Any) -> bool:
    return isinstance(schema_type, torch._C.TensorType)


@functools.cache
def _signature(op: torch._ops.OpOverload) -> inspect.Signature | None:
    try:
        from torch.fx.operator_schemas import _torchscript_schema_to_signature

        return _torchscript_schema_to_signature(op._schema)
    except Exception:  # a schema torch cannot express as a signature: no check
        return None


def _call(node: torch.fx.Node) -> str:
    args = [str(a) for a in node.args] + [f"{k}={v}" for k, v in node.kwargs.items()]
    return f"{node.name} = {node.target}({', '.join(args)})"


__all__ = ["changed_nodes", "check", "no_kernel", "problem"]
