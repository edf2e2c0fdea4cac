"""The ops the ``allreduce_overlap`` pass leaves in the graph with ``transport="copy_engine"``.

``torch.ops.passkit_fusion.matmul_all_reduce(a, b, group_name, chunks, lanes, max_tokens,
timeout_s)`` is ``all_reduce_sum(a @ b)`` over ``group_name``, and
``matmul_all_reduce_rmsnorm(a, b, residual, weight, eps, weight_bias, ...)`` the same sum with
the residual add and RMSNorm that follow it (``(norm_out, residual_out)``): on CUDA with symmetric memory
the matmul in ``chunks`` row chunks with each chunk's transfer on the copy engines (``lanes``
streams at once) beside the next chunk's matmul (:mod:`.runtime`); elsewhere (gloo, CPU) a matmul and a functional
all-reduce. The runtime's settings are arguments, fixed in the graph at compile time, so that
a graph restored from Inductor's cache behaves the same.

Functional ops with a fake implementation: they trace, compile and re-propagate like ATen
ops; defined with :func:`passkit_fusion.op_library.define` (the dispatcher's own call, not
``custom_op``'s wrappers: a forward without CUDA graphs pays the host time of every call).
Importing this module registers them (the pass does when it rewrites; a first look-up does
too, through :mod:`passkit_fusion.lazy_ops`).
"""

from __future__ import annotations

import torch

from ..op_library import define
from . import runtime

OP = "passkit_fusion::matmul_all_reduce"
NORM_OP = "passkit_fusion::matmul_all_reduce_rmsnorm"


SCHEMA = (
    "matmul_all_reduce(Tensor a, Tensor b, str group_name, int chunks, int lanes, int max_tokens, "
    "float timeout_s) -> Tensor"
)
NORM_SCHEMA = (
    "matmul_all_reduce_rmsnorm(Tensor a, Tensor b, Tensor residual, Tensor weight, float eps, "
    "float weight_bias, str group_name, int chunks, int lanes, int max_tokens, float timeout_s) -> (Tensor, Tensor)"
)


def matmul_all_reduce(
    a: torch.Tensor,
    b: torch.Tensor,
    group_name: str,
    chunks: int,
    lanes: int,
    max_tokens: int,
    timeout_s: float,
) -> torch.Tensor:
    """``all_reduce_sum(a @ b)`` over ``group_name`` (``a``: ``[rows, k]``, ``b``: ``[k, n]``).
    Collective: every rank calls it with the same shapes, in the same order."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(
            f"passkit_fusion.matmul_all_reduce takes 2-d a and b, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if chunks < 1 or lanes < 1:
        raise ValueError(
            f"passkit_fusion.matmul_all_reduce: chunks and lanes must be >= 1, got {chunks}, {lanes}"
        )
    return runtime.matmul_all_reduce(a, b, group_name, chunks, lanes, max_tokens, timeout_s)


def _fake(a, b, group_name, chunks, lanes, max_tokens, timeout_s):
    return a.new_empty((a.shape[0], b.shape[1]))


def matmul_all_reduce_op() -> torch._ops.OpOverload:
    """The op's overload, as a graph node's target."""
    return torch.ops.passkit_fusion.matmul_all_reduce.default


def matmul_all_reduce_rmsnorm(
    a: torch.Tensor,
    b: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_bias: float,
    group_name: str,
    chunks: int,
    lanes: int,
    max_tokens: int,
    timeout_s: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm_out, residual_out)``: ``residual_out = all_reduce_sum(a @ b) + residual`` (the
    sum viewed as ``residual``'s shape), ``norm_out`` its RMSNorm over the last dim with
    ``weight + weight_bias``, both shaped like ``residual``. Collective, like
    :func:`matmul_all_reduce`; on CUDA the partials' sum, the residual and the norm are one
    kernel."""
    if a.dim() != 2 or b.dim() != 2 or residual.numel() != a.shape[0] * b.shape[1]:
        raise ValueError(
            "passkit_fusion.matmul_all_reduce_rmsnorm takes 2-d a and b and a residual of a @ b's size, got "
            f"{tuple(a.shape)}, {tuple(b.shape)} and {tuple(residual.shape)}"
        )
    if chunks < 1 or lanes < 1:
        raise ValueError(
            f"passkit_fusion.matmul_all_reduce_rmsnorm: chunks and lanes must be >= 1, got {chunks}, {lanes}"
        )
    return runtime.matmul_all_reduce_rmsnorm(
        a, b, residual, weight, eps, weight_bias, group_name, chunks, lanes, max_tokens, timeout_s
    )


def _fake_norm(a, b, residual, weight, eps, weight_bias, group_name, chunks, lanes, max_tokens, timeout_s):
    torch._check(weight.dim() == 1 and weight.shape[0] == b.shape[1], lambda: "weight must be [n]")
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


AGREED_SCHEMA = (
    "agreed_all_reduce(Tensor input, str reduce_op, str group_name, str plan, float timeout_s) -> Tensor"
)


def agreed_all_reduce(
    x: torch.Tensor, reduce_op: str, group_name: str, plan: str, timeout_s: float
) -> torch.Tensor:
    """``_c10d_functional.all_reduce(x, reduce_op, group_name)`` (waited by the graph's
    ``wait_tensor``) once every rank agreed on ``plan`` (:func:`.runtime.check_plan`): the
    first chunk's all-reduce of a site split with ``transport="nccl"``."""
    return runtime.agreed_all_reduce(x, reduce_op, group_name, plan, timeout_s)


def _fake_agreed(x, reduce_op, group_name, plan, timeout_s):
    return torch.empty_like(x)


define(SCHEMA, matmul_all_reduce, _fake)
define(NORM_SCHEMA, matmul_all_reduce_rmsnorm, _fake_norm)
define(AGREED_SCHEMA, agreed_all_reduce, _fake_agreed)


def agreed_all_reduce_op() -> torch._ops.OpOverload:
    """The plan-checked all-reduce's overload, as a graph node's target."""
    return torch.ops.passkit_fusion.agreed_all_reduce.default


def matmul_all_reduce_rmsnorm_op() -> torch._ops.OpOverload:
    """The norm-fused op's overload, as a graph node's target."""
    return torch.ops.passkit_fusion.matmul_all_reduce_rmsnorm.default
