"""The ``sglang`` dialect: SGLang 0.5.23's collectives as its compiled graphs carry them.

* All-reduce: ``sglang.outplace_all_reduce(x, group_name, outplace_all_reduce_method)``
  and ``sglang.flashinfer_allreduce(x, group_name)`` (out-of-place), and
  ``sglang.inplace_all_reduce(x, group_name)`` (in place: in a functional graph it comes
  wrapped by ``auto_functionalized`` / ``auto_functionalized_v2``, the sum being the
  wrapper's new value of ``x``).
* All-gather / reduce-scatter: ``sglang.reg_all_gather_into_tensor(output, input,
  group_name)`` and ``sglang.reg_reduce_scatter_tensor(output, input, group_name)``
  (dim 0 into a preallocated ``output``; functionalized like the in-place all-reduce).
* RMSNorm: under ``torch.compile`` SGLang's ``RMSNorm`` runs ``forward_native``: the
  native decomposition, matched like any graph's (the residual added in fp32 included).
* Groups: SGLang's name (``GroupCoordinator.unique_name``) ->
  ``sglang.srt.distributed.parallel_state._groups[name]().device_group``; where SGLang's
  registry does not know the name (stand-ins in tests) it is read as torch's.
* SGLang's own AR+residual+RMSNorm fusion (``flashinfer_allreduce_residual_rmsnorm``,
  called from its layer communicator) is a :attr:`HOST_FUSIONS` op, named in the report.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import torch.distributed as dist
import torch.fx as fx

from .base import AllReduce, Collective, Declined, Dialect, arg, functionalized
from .schemas import supported_versions
from .vllm import host_coordinator

_OUTPLACE = "sglang::outplace_all_reduce"
_INPLACE = "sglang::inplace_all_reduce"
_FLASHINFER = "sglang::flashinfer_allreduce"
_ALL_GATHER = "sglang::reg_all_gather_into_tensor"
_REDUCE_SCATTER = "sglang::reg_reduce_scatter_tensor"


class SGLangDialect(Dialect):
    """SGLang 0.5.23: ``torch.ops.sglang.*`` collectives, native RMSNorm."""

    name = "sglang"
    host = "SGLang 0.5.23"
    NAMESPACES = ("sglang",)
    PACKAGE = "sglang"
    VERSIONS = supported_versions("sglang")
    HOST_MODULES = ("sglang.srt.distributed.parallel_state",)
    ALL_REDUCE_OPS = (_OUTPLACE, _INPLACE, _FLASHINFER)
    SCHEMAS: ClassVar[dict[str, str]] = {
        _OUTPLACE: "sglang::outplace_all_reduce(Tensor tensor, str group_name, str outplace_all_reduce_method) -> Tensor",
        _INPLACE: "sglang::inplace_all_reduce(Tensor(a0!) tensor, str group_name) -> ()",
        _FLASHINFER: "sglang::flashinfer_allreduce(Tensor tensor, str group_name) -> Tensor",
        _ALL_GATHER: "sglang::reg_all_gather_into_tensor(Tensor(a0!) output, Tensor input, str group_name) -> ()",
        _REDUCE_SCATTER: "sglang::reg_reduce_scatter_tensor(Tensor(a0!) output, Tensor input, str group_name) -> ()",
    }  # fmt: skip
    HOST_FUSIONS: ClassVar[dict[str, str]] = {
        "sglang::flashinfer_allreduce_residual_rmsnorm": "SGLang's flashinfer AR+residual+RMSNorm fusion (layer communicator)",
    }  # fmt: skip
    MODULE = "sglang.srt.distributed.parallel_state"

    def all_reduces(self, graph: fx.Graph) -> Iterator[AllReduce | tuple[fx.Node, str]]:
        for node, op, wrapped in self.ops_in(graph, (_OUTPLACE, _FLASHINFER, _INPLACE)):
            label = str(op._schema.name).replace("::", ".")
            try:
                if wrapped:
                    x, result = functionalized(node, "tensor")
                    group = node.kwargs.get("group_name")
                    nodes: tuple[fx.Node, ...] = (node, result)
                else:
                    x, group, result, nodes = (
                        arg(node, 0, "tensor"),
                        arg(node, 1, "group_name"),
                        node,
                        (node,),
                    )
            except Declined as exc:
                yield node, str(exc)
                continue
            if not isinstance(x, fx.Node) or not isinstance(group, str):
                yield node, f"{label} arguments not understood"
                continue
            yield AllReduce(node, x, group, result, nodes)

    def collectives(self, graph: fx.Graph) -> Iterator[Collective | tuple[fx.Node, str]]:
        kinds = {_ALL_GATHER: "all_gather", _REDUCE_SCATTER: "reduce_scatter"}
        for node, op, wrapped in self.ops_in(graph, kinds):
            label = str(op._schema.name).replace("::", ".")
            if not wrapped:
                yield node, f"{label} not functionalized"
                continue
            try:
                buffer, result = functionalized(node, "output")
            except Declined as exc:
                yield node, str(exc)
                continue
            x, group = node.kwargs.get("input"), node.kwargs.get("group_name")
            if not isinstance(x, fx.Node) or not isinstance(group, str):
                yield node, f"{label} arguments not understood"
                continue
            dead = (
                node,
                result,
                *((buffer,) if len(buffer.users) == 1 and buffer.op == "call_function" else ()),
            )
            yield Collective(kinds[str(op._schema.name)], node, x, group, None, result, dead)  # type: ignore[arg-type]

    def resolve_group(self, group: str) -> dist.ProcessGroup:
        coordinator = host_coordinator(self.MODULE, group, host_package="sglang")
        if coordinator is not None:
            return coordinator.device_group
        return super().resolve_group(group)
