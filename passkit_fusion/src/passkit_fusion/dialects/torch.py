"""The ``torch`` dialect: PyTorch's functional collectives, as ``torch.compile`` traces
``torch.distributed._functional_collectives``, DTensor and in-place ``dist.all_reduce``.

An all-reduce is ``wait_tensor(all_reduce(x, "sum", group_name))`` (the reduce op a string, or
on torch 2.15 a ``dist.ReduceOp``: :func:`reduce_op_name`), followed by
``aten.copy`` into the buffer for an in-place ``dist.all_reduce(buffer)`` when that copy is
the result's only use. Groups are torch's own names. All-gathers and reduce-scatters are
already what PyTorch's async-TP matcher reads: :meth:`collectives` has nothing to rewrite.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import torch
import torch.fx as fx

from .base import AllReduce, Dialect, sole_user, val
from .schemas import supported_versions

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


class TorchDialect(Dialect):
    """PyTorch's functional collectives (``_c10d_functional``) and DTensor."""

    name = "torch"
    host = "PyTorch functional collectives (torch 2.13)"
    PACKAGE = "torch"
    VERSIONS = supported_versions("torch")
    VERSION_PARTS = 2
    HOST_MODULES = ("torch.distributed._functional_collectives",)
    NAMESPACES = ("_c10d_functional",)
    ALL_REDUCE_OPS = ("_c10d_functional::all_reduce",)
    # what the code below reads (torch 2.13's text); torch 2.10-2.12 write ``str group_name``
    # where 2.13 writes ``Any``, torch 2.15 writes ``Any reduce_op``: read alike
    # (schemas.schema_difference; reduce_op_name reads either spelling of the op)
    SCHEMAS: ClassVar[dict[str, str]] = {
        "_c10d_functional::all_reduce": "_c10d_functional::all_reduce(Tensor input, str reduce_op, Any group_name) -> Tensor",
        "_c10d_functional::wait_tensor": "_c10d_functional::wait_tensor(Tensor tensor) -> Tensor",
        "_c10d_functional::reduce_scatter_tensor": "_c10d_functional::reduce_scatter_tensor(Tensor input, str reduce_op, int group_size, Any group_name) -> Tensor",
        "_c10d_functional::all_gather_into_tensor": "_c10d_functional::all_gather_into_tensor(Tensor input, int group_size, Any group_name) -> Tensor",
    }  # fmt: skip

    def all_reduces(self, graph: fx.Graph) -> Iterator[AllReduce | tuple[fx.Node, str]]:
        for node in list(graph.find_nodes(op="call_function", target=c10d.all_reduce.default)):
            x, reduce_op, group = node.args[:3]
            op = reduce_op_name(reduce_op)
            if op != "sum":
                yield node, f"reduce op {op!r}" if op else f"reduce op {reduce_op!r} not understood"
                continue
            if not isinstance(x, fx.Node) or not isinstance(group, str):
                yield node, "all-reduce arguments not understood"
                continue
            wait = sole_user(node)
            if wait is None or wait.target is not c10d.wait_tensor.default:
                yield node, "all-reduce result not awaited by exactly one wait_tensor"
                continue
            copy = _in_place_copy(wait)
            result = copy or wait
            yield AllReduce(node, x, group, result, (node, wait, *((copy,) if copy else ())))


def reduce_op_name(reduce_op: object) -> str | None:
    """The all-reduce's reduce op, lower case (``"sum"``, ``"max"``, ``"avg"``...), in either
    spelling torch's graphs carry it: a string (every torch; ``funcol.all_reduce(x, "sum",
    group)``) or, where the schema reads ``Any reduce_op`` (torch 2.15), a ``dist.ReduceOp``
    member (``RedOpType.SUM``) or a ``dist.ReduceOp`` object (its ``op``; ``PREMUL_SUM``
    with its factor reads ``"premul_sum"``). None for anything else."""
    if isinstance(reduce_op, str):
        return reduce_op.lower()
    import torch.distributed as dist

    if not dist.is_available():
        return None
    if not isinstance(reduce_op, dist.ReduceOp.RedOpType) and isinstance(reduce_op, dist.ReduceOp):
        reduce_op = reduce_op.op  # (a RedOpType member also passes isinstance(.., ReduceOp))
    if isinstance(reduce_op, dist.ReduceOp.RedOpType):
        return str(reduce_op.name).lower()
    return None


def _in_place_copy(wait: fx.Node) -> fx.Node | None:
    """``copy(buffer, result)``, the functional form of an in-place ``dist.all_reduce(buffer)``
    when it is the result's only use: the copy then holds the all-reduce result."""
    copy = sole_user(wait)
    if copy is None or copy.target is not aten.copy.default or copy.args[1] is not wait:
        return None
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    a, b = val(copy), val(wait)
    same = a.dtype == b.dtype and a.dim() == b.dim()
    same = same and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))
    return copy if same else None
