"""``torch.ops.passkit_fusion.token_shard``: this rank's slice of a replicated tensor;
``torch.ops.passkit_fusion.agreed_reduce_scatter``: the graph's first reduce-scatter, once the
ranks agreed on the pass's plan.

The first sequence-parallel site turns a replicated residual into this rank's rows. The
rank must not be baked into the graph (the compiled graph is the same on every rank, so
Inductor's FX graph cache can share it): the op reads it from the process group at run time.
Importing this module registers the op (the pass's rewrite imports it; a first look-up of
the op does too, through :mod:`passkit_fusion.lazy_ops`), so graphs Inductor restores from
its cache find it.
"""

from __future__ import annotations

import torch

from ..collective import agree_plan_once
from ..op_library import define

OP_NAME = "passkit_fusion::token_shard"


def _group(group_name: str):  # type: ignore[no-untyped-def]
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)  # type: ignore[arg-type]


@torch.library.custom_op(OP_NAME, mutates_args=())
def token_shard(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Rows ``rank * n / W .. (rank + 1) * n / W`` of ``x`` (``n = x.shape[0]``, ``W`` the size
    of the process group ``group_name``, ``rank`` this process's rank in it), as a new
    tensor: the rows ``reduce_scatter_tensor`` leaves on this rank. ``n`` must be a multiple
    of ``W``. Not a collective: no communication."""
    group = _group(group_name)
    world, rank = group.size(), group.rank()
    if x.shape[0] % world:
        raise ValueError(
            f"passkit_fusion.token_shard: {x.shape[0]} tokens are not a multiple of the group size {world}"
        )
    rows = x.shape[0] // world
    return x[rank * rows : (rank + 1) * rows].clone()


@token_shard.register_fake
def _fake(x: torch.Tensor, group_name: str) -> torch.Tensor:
    # the same size expression as reduce_scatter_tensor's (n // W), so shards line up
    world = _group(group_name).size()
    return x.new_empty((x.shape[0] // world, *x.shape[1:]))


STEP = "sequence_parallel:plan"
"""The agreement's step: what the ranks' plans are compared under (and a rank's last step)."""

AGREED_SCHEMA = (
    "agreed_reduce_scatter(Tensor input, str reduce_op, int group_size, str group_name, str plan, "
    "float timeout_s) -> Tensor"
)


def agreed_reduce_scatter(
    x: torch.Tensor, reduce_op: str, group_size: int, group_name: str, plan: str, timeout_s: float
) -> torch.Tensor:
    """``_c10d_functional.reduce_scatter_tensor(x, reduce_op, group_size, group_name)`` (not
    waited: the graph's ``wait_tensor`` waits) once every rank agreed on ``plan`` (a JSON
    text) through :func:`passkit_fusion.collective.agree_plan_once`: at most ``timeout_s`` at
    the first call, one set look-up after it, nothing during a CUDA-graph capture. A rank that
    runs the graph without the pass, or with another plan, is named in a
    :class:`~passkit_fusion.collective.RankAgreementError` instead of meeting a reduce-scatter
    with an all-reduce (gloo: a size mismatch; NCCL: a hang)."""
    check_plan(group_name, plan, timeout_s)
    return torch.ops._c10d_functional.reduce_scatter_tensor(x, reduce_op, group_size, group_name)


def check_plan(group_name: str, plan: str, timeout_s: float) -> None:
    """The agreement :func:`agreed_reduce_scatter` makes (``async_tp``'s fused matmul +
    reduce-scatter makes it too where it took that reduce-scatter over)."""
    describe = "sequence_parallel's reduce-scatter + all-gather of the residual stream"
    agree_plan_once(group_name, STEP, plan, timeout_s, describe)


def _fake_agreed(x, reduce_op, group_size, group_name, plan, timeout_s):  # type: ignore[no-untyped-def]
    return x.new_empty((x.shape[0] // group_size, *x.shape[1:]))  # reduce_scatter_tensor's size


define(AGREED_SCHEMA, agreed_reduce_scatter, _fake_agreed)


def agreed_reduce_scatter_op() -> torch._ops.OpOverload:
    """The plan-checked reduce-scatter's overload, as a graph node's target."""
    return torch.ops.passkit_fusion.agreed_reduce_scatter.default
