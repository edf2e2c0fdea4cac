"""The ``vllm`` dialect: vLLM 0.33.0's collectives and RMSNorm as its compiled graphs carry them.

* All-reduce: ``vllm.all_reduce(x, group_name)``, out-of-place (what ``GroupCoordinator``
  emits where ``use_custom_op_call`` is set: CUDA and TPU platforms).
* All-gather / reduce-scatter: ``vllm.all_gather(x, dim, world_size, group_name)``,
  ``vllm.reduce_scatter(x, dim, world_size, group_name)`` (dim 0 is rewritten for async TP).
* RMSNorm: vLLM IR ops, which vLLM lowers only after the passes added through
  ``post_grad_custom_post_pass`` ran: ``vllm_ir.rms_norm(x, weight, epsilon,
  variance_size)`` and ``vllm_ir.fused_add_rms_norm(x, x_residual, weight, epsilon,
  variance_size) -> (out, x + x_residual)``. Its ``maybe_inplace`` overload (same
  arguments, ``x`` and ``x_residual`` marked mutable: an implementation may write them) is
  what vLLM's ``RMSNorm`` calls with a residual; in a graph no vLLM pass manager lowered (vLLM's
  CPU platform compiles with plain Inductor) it stays ``auto_functionalized(maybe_inplace,
  x=..., ...)``, read here too: the rewrite takes the arguments' new values as the arguments
  unchanged (what the native implementation leaves). Their native decomposition (no IR) is
  matched like any graph's.
* Groups: vLLM's name (``GroupCoordinator.unique_name``, e.g. ``"tp:0"``) ->
  ``vllm.distributed.parallel_state._groups[name]().device_group``. Where vLLM's registry
  does not know the name (stand-in ops in tests) the name is read as torch's.
* vLLM's own AR+RMSNorm fusion (``PassConfig.fuse_allreduce_rms``) runs before a custom
  post pass: its ops are :attr:`HOST_FUSIONS`, named in the report.
"""

from __future__ import annotations

import importlib
import importlib.util
import operator
import sys
from collections.abc import Iterator
from typing import Any, ClassVar

import torch.distributed as dist
import torch.fx as fx

from .base import AllReduce, Collective, Declined, Dialect, HostNorm, arg, dtype_str, node_op, val
from .schemas import supported_versions

_ALL_REDUCE = "vllm::all_reduce"
_ALL_GATHER = "vllm::all_gather"
_REDUCE_SCATTER = "vllm::reduce_scatter"
_RMS_NORM = "vllm_ir::rms_norm"
_FUSED_ADD = "vllm_ir::fused_add_rms_norm"
_FUSED_ADD_INPLACE = "vllm_ir::fused_add_rms_norm.maybe_inplace"


class VllmDialect(Dialect):
    """vLLM 0.33.0: ``torch.ops.vllm.*`` collectives, ``torch.ops.vllm_ir.*`` norms."""

    name = "vllm"
    host = "vLLM 0.33.0"
    NAMESPACES = ("vllm", "vllm_ir")
    PACKAGE = "vllm"
    VERSIONS = supported_versions("vllm")
    HOST_MODULES = ("vllm.distributed.parallel_state", "vllm.ir.ops")
    ALL_REDUCE_OPS = (_ALL_REDUCE,)
    SCHEMAS: ClassVar[dict[str, str]] = {
        _ALL_REDUCE: "vllm::all_reduce(Tensor tensor, str group_name) -> Tensor",
        _REDUCE_SCATTER: "vllm::reduce_scatter(Tensor tensor, SymInt dim, SymInt world_size, str group_name) -> Tensor",
        _ALL_GATHER: "vllm::all_gather(Tensor tensor, SymInt dim, SymInt world_size, str group_name) -> Tensor",
        _RMS_NORM: "vllm_ir::rms_norm(Tensor x, Tensor? weight, float epsilon, SymInt? variance_size=None) -> Tensor",
        _FUSED_ADD: "vllm_ir::fused_add_rms_norm(Tensor x, Tensor x_residual, Tensor? weight, float epsilon, SymInt? variance_size=None) -> (Tensor, Tensor)",
        _FUSED_ADD_INPLACE: "vllm_ir::fused_add_rms_norm.maybe_inplace(Tensor(a0!) x, Tensor(a1!) x_residual, Tensor? weight, float epsilon, SymInt? variance_size=None) -> (Tensor, Tensor)",
    }  # fmt: skip
    HOST_FUSIONS: ClassVar[dict[str, str]] = {
        "vllm::flashinfer_trtllm_fused_allreduce_norm": "vLLM's fuse_allreduce_rms (AllReduceFusionPass, flashinfer)",
        "vllm::rocm_aiter_fused_allreduce_rmsnorm": "vLLM's fuse_allreduce_rms (RocmAiterAllReduceFusionPass)",
        "vllm::rocm_aiter_fused_allreduce_rmsnorm_quant_per_group": "vLLM's fuse_allreduce_rms (RocmAiterAllReduceFusionPass)",
        "vllm::rocm_aiter_fused_allreduce_rmsnorm_quant_per_group_with_bf16_norm": "vLLM's fuse_allreduce_rms (RocmAiterAllReduceFusionPass)",
    }  # fmt: skip
    MODULE = "vllm.distributed.parallel_state"
    """Where the host keeps ``_groups`` (name -> weakref to its ``GroupCoordinator``)."""

    def all_reduces(self, graph: fx.Graph) -> Iterator[AllReduce | tuple[fx.Node, str]]:
        for node, _, _ in self.ops_in(graph, (_ALL_REDUCE,)):
            x, group = arg(node, 0, "tensor"), arg(node, 1, "group_name")
            if not isinstance(x, fx.Node) or not isinstance(group, str):
                yield node, "vllm.all_reduce arguments not understood"
                continue
            yield AllReduce(node, x, group, node, (node,))

    def collectives(self, graph: fx.Graph) -> Iterator[Collective | tuple[fx.Node, str]]:
        kinds = {_ALL_GATHER: "all_gather", _REDUCE_SCATTER: "reduce_scatter"}
        for node, op, _ in self.ops_in(graph, kinds):
            x, dim, size, group = (
                arg(node, i, n) for i, n in enumerate(("tensor", "dim", "world_size", "group_name"))
            )
            if not isinstance(x, fx.Node) or not isinstance(group, str) or not isinstance(dim, int):
                yield node, f"{op_name_short(op)} arguments not understood"
                continue
            if dim % val(x).dim() != 0:
                yield node, f"{op_name_short(op)} along dim {dim} (only dim 0 is rewritten)"
                continue
            kind = kinds[str(op._schema.name)]
            yield Collective(kind, node, x, group, size if isinstance(size, int) else None, node, (node,))  # type: ignore[arg-type]

    def match_norm(self, total: fx.Node) -> HostNorm | None:
        for user in total.users:
            _, qualified, wrapped = node_op(user)
            if qualified == _RMS_NORM and arg(user, 0, "x") is total:
                weight, eps = self._weight_eps(user, 1, 2, 3, total)
                return HostNorm("rms_norm", user, weight, eps, 0.0, user, (user,))
            if qualified == _FUSED_ADD:
                if wrapped:  # auto_functionalized(_v2)(maybe_inplace, x=..., x_residual=..., ...)
                    (a, new_a), (b, new_b) = (_mutated(user, n) for n in ("x", "x_residual"))
                else:
                    a, b = arg(user, 0, "x"), arg(user, 1, "x_residual")
                if total not in (a, b) or a is b:
                    continue
                if len(total.users) != 1:  # the op outputs the sum with the residual only
                    raise Declined("all-reduce result is also used outside the residual add")
                weight, eps = self._weight_eps(user, 2, 3, 4, total)
                outs = {u.args[1]: u for u in user.users if u.target is operator.getitem}
                if len(outs) != len(user.users) or 0 not in outs:
                    raise Declined("vllm_ir.fused_add_rms_norm's outputs are not read through getitem")
                residual = b if a is total else a
                if val(residual).dtype != val(total).dtype:
                    raise Declined(
                        f"residual is {dtype_str(val(residual).dtype)} but the all-reduce is {dtype_str(val(total).dtype)}"
                    )
                rebind = []
                if wrapped:  # the residual's new value is the sum, as an in-place op leaves it
                    for index, source in ((new_a, a), (new_b, b)):
                        if index in outs and source is total:
                            raise Declined(
                                f"{_FUSED_ADD_INPLACE}'s new value of the all-reduce result is read"
                            )
                        if index in outs:
                            rebind.append(outs[index])
                nodes = (user, *outs.values())
                return HostNorm(
                    "fused_add", user, weight, eps, 0.0, outs[0], nodes,
                    residual=residual, total=outs.get(1), rebind=tuple(rebind),
                )  # fmt: skip
        return None

    @staticmethod
    def _weight_eps(node: fx.Node, w: int, e: int, v: int, total: fx.Node) -> tuple[fx.Node, float]:
        weight, eps = arg(node, w, "weight"), arg(node, e, "epsilon")
        if arg(node, v, "variance_size") is not None:
            raise Declined("RMSNorm over part of the hidden dim (variance_size)")
        if not isinstance(weight, fx.Node):
            raise Declined("RMSNorm without a weight")
        if not isinstance(eps, (int, float)):
            raise Declined("the norm's epsilon is not a constant")
        if val(weight).dtype != val(total).dtype:
            raise Declined(
                f"norm weight is {dtype_str(val(weight).dtype)} but activations are {dtype_str(val(total).dtype)} "
                "(the kernel reads the weight in the activation dtype)"
            )
        return weight, float(eps)

    def resolve_group(self, group: str) -> dist.ProcessGroup:
        coordinator = host_coordinator(self.MODULE, group, host_package="vllm")
        if coordinator is not None:
            return coordinator.device_group
        return super().resolve_group(group)


def _mutated(node: fx.Node, name: str) -> tuple[Any, int]:
    """``(argument, output index of its new value)`` of the mutated argument ``name`` of an
    ``auto_functionalized`` (v1: the argument by name, new values after the op's 2 returns
    in argument order) or ``auto_functionalized_v2`` node (``_all_bases[_name_base_index]``,
    new value at ``2 + base index``) wrapping ``fused_add_rms_norm.maybe_inplace``."""
    if "_all_bases" not in node.kwargs:
        return node.kwargs.get(name), 2 + ("x", "x_residual").index(name)
    index = node.kwargs.get(f"_{name}_base_index")
    view_keys = ("size", "stride", "storage_offset", "slice_dim", "slice_start", "slice_end", "alias")
    views = [k for k in view_keys if f"_{name}_{k}" in node.kwargs]
    if views or not isinstance(index, int):
        raise Declined(f"{_FUSED_ADD_INPLACE} mutates a view of its base tensor ({name})")
    return node.kwargs["_all_bases"][index], 2 + index


def op_name_short(op: Any) -> str:
    return str(op._schema.name).replace("::", ".")


def host_coordinator(module: str, group: str, *, host_package: str) -> Any:
    """The host's ``GroupCoordinator`` registered as ``group`` in ``module._groups``, or None
    when the host is not installed or does not know the name. Imports ``module`` only if
    the host package is already imported (its ops are in the graph) or installed."""
    mod = sys.modules.get(module)
    if mod is None:
        if host_package not in sys.modules and importlib.util.find_spec(host_package) is None:
            return None
        try:
            mod = importlib.import_module(module)
        except Exception:
            return None
    groups = getattr(mod, "_groups", {})
    ref = groups.get(group)
    coordinator = ref() if ref is not None else None
    return coordinator
