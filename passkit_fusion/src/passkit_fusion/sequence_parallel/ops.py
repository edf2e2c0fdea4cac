"""``torch.ops.passkit_fusion.token_shard``: this rank's slice of a replicated tensor.

The first sequence-parallel site turns a replicated residual into this rank's rows. The
rank must not be baked into the graph (the compiled graph is the same on every rank, so
Inductor's FX graph cache can share it): the op reads it from the process group at run time.
Importing this module registers the op (the pass's rewrite imports it; a first look-up of
the op does too, through :mod:`passkit_fusion.lazy_ops`), so graphs Inductor restores from
its cache find it.
"""

from __future__ import annotations

import torch

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
