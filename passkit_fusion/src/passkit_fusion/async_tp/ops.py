"""The two ops the ``async_tp`` pass leaves in the graph, wrapping PyTorch's fused ops.

``torch.ops.passkit_fusion.async_tp_all_gather_matmul`` and
``torch.ops.passkit_fusion.async_tp_matmul_reduce_scatter`` take the arguments of
``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter`` plus what
passkit's runtime needs (``mode``, ``max_tokens``, ``timeout_s``, fixed in the graph at compile
time, so that a graph restored from Inductor's cache behaves the same). On CUDA they set up
symmetric memory on first use (:mod:`.runtime`) and call torch's op; with ``mode="test_mode"``,
or off CUDA, they compute the same result with functional collectives (any backend: gloo too).

Functional custom ops with fake implementations: they trace, compile and re-propagate like
ATen ops. Importing this module registers them (the pass does when it runs; a first
look-up of an op does too, through :mod:`passkit_fusion.lazy_ops`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..collective import resolve_group
from . import runtime

AG_OP = "passkit_fusion::async_tp_all_gather_matmul"
RS_OP = "passkit_fusion::async_tp_matmul_reduce_scatter"
MODES = ("auto", "test_mode")


@torch.library.custom_op(
    AG_OP,
    mutates_args=(),
    schema=(
        "(Tensor A_shard, Tensor[] Bs, int gather_dim, str group_name, bool return_A, str mode, "
        "int max_tokens, float timeout_s) -> (Tensor?, Tensor[])"
    ),
)
def async_tp_all_gather_matmul(
    A_shard: torch.Tensor,
    Bs: list[torch.Tensor],
    gather_dim: int,
    group_name: str,
    return_A: bool,
    mode: str,
    max_tokens: int,
    timeout_s: float,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """``all_gather(A_shard, gather_dim) @ B`` for each ``B``; returns ``(A or None, [A @ B, ...])``.
    Collective on ``group_name``: every rank calls it with the same shapes, in the same order."""
    _check_mode(mode)
    return runtime.all_gather_matmul(
        A_shard, Bs, gather_dim, group_name, return_A, mode, max_tokens, timeout_s
    )


@async_tp_all_gather_matmul.register_fake
def _ag_fake(A_shard, Bs, gather_dim, group_name, return_A, mode, max_tokens, timeout_s):
    return runtime.unfused_all_gather_matmul(A_shard, Bs, gather_dim, group_name, return_A)


@torch.library.custom_op(
    RS_OP,
    mutates_args=(),
    schema=(
        "(Tensor A, Tensor B, str reduce_op, int scatter_dim, str group_name, str mode, "
        'int max_tokens, float timeout_s, str plan="") -> Tensor'
    ),
)
def async_tp_matmul_reduce_scatter(
    A: torch.Tensor,
    B: torch.Tensor,
    reduce_op: str,
    scatter_dim: int,
    group_name: str,
    mode: str,
    max_tokens: int,
    timeout_s: float,
    plan: str = "",
) -> torch.Tensor:
    """``reduce_scatter(A @ B, reduce_op, scatter_dim)`` over ``group_name``. Collective.
    ``plan``: the ``sequence_parallel`` plan of the group's first reduce-scatter, which this
    op took over (agreed first, within ``timeout_s``, like ``agreed_reduce_scatter``)."""
    _check_mode(mode)
    if plan:
        from ..sequence_parallel.ops import check_plan

        check_plan(group_name, plan, timeout_s)
    return runtime.matmul_reduce_scatter(
        A, B, reduce_op, scatter_dim, group_name, mode, max_tokens, timeout_s
    )


@async_tp_matmul_reduce_scatter.register_fake
def _rs_fake(A, B, reduce_op, scatter_dim, group_name, mode, max_tokens, timeout_s, plan=""):
    # The shape only, as the functional reduce_scatter_tensor's own meta computes it
    # (size // W along the scatter dim). Not through funcol.reduce_scatter_tensor: its
    # ``assert size % W == 0`` would put a guard ``Mod(T, W) == 0`` on a symbolic token count,
    # constraining every specialization of the compile (odd counts would recompile).
    out = torch.matmul(A, B)
    world = dist.get_world_size(resolve_group(group_name))
    dim = scatter_dim % out.dim()
    return out.new_empty((*out.shape[:dim], out.shape[dim] // world, *out.shape[dim + 1 :]))


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"passkit_fusion async_tp op: mode must be one of {MODES}, got {mode!r}")
