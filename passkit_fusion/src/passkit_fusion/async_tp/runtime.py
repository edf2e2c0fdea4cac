"""What runs behind ``torch.ops.passkit_fusion.async_tp_*``: symmetric memory set up lazily,
boundedly and identically on every rank, then PyTorch's own fused op.

torch's fused ops (``torch.ops.symm_mem.fused_all_gather_matmul`` /
``fused_matmul_reduce_scatter``) stage their shards in one symmetric-memory workspace per
process group, allocated (and grown) by ``get_symm_mem_workspace`` at the call that needs it:
a collective that exchanges memory handles through the group's store, waits on every peer
without a bound, and raises when it would have to grow during CUDA-graph capture. This module
does that step itself, at the first call on a group and whenever a call needs more room:

1. never during CUDA-graph capture: a call captured before the workspace is large enough runs
   the unfused computation (NCCL all-gather + mm, mm + reduce-scatter) instead, which is
   capturable. The choice depends only on the call's shape and the workspace size, which is the
   same on every rank (every rank grew it at the same calls), so every rank takes the same path;
2. first :func:`passkit_fusion.collective.agree` on the group (the store, a bounded wait of
   ``timeout_s``): a rank that does not arrive, or arrives with another size, torch or
   passkit-fusion version, raises :class:`~passkit_fusion.collective.RankAgreementError` on
   every rank, naming the group, the step (``async_tp:symm_mem``) and the ranks;
3. then enable symmetric memory for the group (local) and grow the workspace (collective;
   every rank is known to be there). Sizes are rounded up to a power of two and, with
   ``max_tokens``, reserved at once for that many tokens, so growth is rare and a CUDA graph
   captured later for any size up to ``max_tokens`` finds the room it needs.

NVLink multicast is never needed: the paths used are the pipelined copy-engine ones
(``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` keeps torch off its multimem path; leave
``TORCH_SYMM_MEM_ENABLE_NATIVE_ASYNC_TP`` unset).

Process-wide state, not thread-safe. Imports without CUDA.
"""

from __future__ import annotations

import math
import os
from collections import Counter

import torch
import torch.distributed as dist

from ..collective import agree, resolve_group
from ..collective.resources import capturing as _capturing
from ..collective.resources import outside_graph_pools
from . import torch_api

FUSED = "fused"
FALLBACK = "fallback"
STEP = "async_tp:symm_mem"
MIN_WORKSPACE_BYTES = 1 << 20

_reserved: dict[str, int] = {}
"""Bytes of symmetric-memory workspace agreed and allocated per group name."""
_stats: Counter[str] = Counter()


def stats() -> dict[str, int]:
    """Calls per path (``fused``, ``fallback``, ``fallback:<reason>``) since the last reset.
    Calls replayed from a CUDA graph are not seen (its capture counts once)."""
    return dict(_stats)


def reset_stats() -> None:
    _stats.clear()


def reserved_bytes(group_name: str) -> int:
    """The workspace size agreed for ``group_name`` so far (0: not set up)."""
    return _reserved.get(group_name, 0)


def _record(path: str, reason: str = "") -> None:
    _stats[path] += 1
    if reason:
        _stats[f"{path}:{reason}"] += 1


# ------------------------------------------------------------------------------ sizing --


def all_gather_need(a_shard: torch.Tensor, gather_dim: int, world: int) -> tuple[int, int]:
    """``(workspace bytes, tokens)`` of one fused all-gather + matmul call: torch stages the
    shard; tokens are the gathered rows (all dims but the last, after the gather)."""
    rows = math.prod(a_shard.shape[:-1])
    if gather_dim not in (a_shard.dim() - 1, -1):
        rows *= world
    return a_shard.numel() * a_shard.element_size(), rows


def reduce_scatter_need(a: torch.Tensor, b: torch.Tensor, world: int) -> tuple[int, int]:
    """``(workspace bytes, tokens)`` of one fused matmul + reduce-scatter call: torch stages
    two output chunks (1/world of ``a @ b`` each)."""
    rows = math.prod(a.shape[:-1])
    chunk = rows * b.shape[-1] // world
    return 2 * chunk * a.element_size(), rows


def target_bytes(need: int, tokens: int, max_tokens: int) -> int:
    """What to allocate for a call needing ``need`` bytes at ``tokens`` tokens: room for
    ``max_tokens`` tokens when given (sizes scale with tokens), rounded up to a power of two."""
    want = need
    if max_tokens > tokens > 0:
        want = -(-need * max_tokens // tokens)
    return max(MIN_WORKSPACE_BYTES, 1 << max(want - 1, 1).bit_length())


# ------------------------------------------------------------------------------ set-up --


def ensure_workspace(group_name: str, need: int, tokens: int, max_tokens: int, timeout_s: float) -> str:
    """Make sure ``group_name`` has symmetric memory with ``need`` bytes of workspace.

    Returns ``""`` when the fused op may run, else why not (the call then runs unfused).
    Collective when it grows the workspace: every rank calls it in the same order with the
    same shapes (what a tensor-parallel graph does)."""
    if need <= _reserved.get(group_name, 0):
        return ""
    if _capturing():
        return "workspace_not_ready_in_capture"
    size = target_bytes(need, tokens, max_tokens)
    agree_on_symmetric_memory(group_name, STEP, size, timeout_s, "symmetric-memory workspace")
    torch_api.enable_group(group_name)
    # outside any CUDA-graph pool (a first call inside Inductor's CUDA-graph warm-up)
    outside_graph_pools(lambda: torch_api.reserve_workspace(group_name, size), "symmetric-memory workspace")
    _reserved[group_name] = size
    return ""


def agree_on_symmetric_memory(group_name: str, step: str, size: int, timeout_s: float, what: str) -> None:
    """:func:`~passkit_fusion.collective.agree` on ``group_name`` before allocating ``size``
    bytes of symmetric memory: every rank the same size, torch and passkit-fusion versions and
    multicast setting, within ``timeout_s`` (else :class:`RankAgreementError` on every rank)."""
    group = resolve_group(group_name)
    agree(
        group,
        step,
        {
            "bytes": size,
            "torch": torch.__version__,
            "passkit_fusion": _version(),
            "multicast_disabled": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", ""),
        },
        timeout_s=timeout_s,
        describe=f"{what} of {size} bytes on {dist.get_world_size(group)} ranks",
    )


def _version() -> str:
    from .. import __version__

    return __version__


# -------------------------------------------------------------------------------- calls --


def all_gather_matmul(
    a_shard: torch.Tensor,
    bs: list[torch.Tensor],
    gather_dim: int,
    group_name: str,
    return_a: bool,
    mode: str,
    max_tokens: int,
    timeout_s: float,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    world = dist.get_world_size(resolve_group(group_name))
    reason = _why_unfused(mode, a_shard)
    if not reason:
        need, tokens = all_gather_need(a_shard, gather_dim, world)
        reason = ensure_workspace(group_name, need, tokens, max_tokens, timeout_s)
    if reason:
        _record(FALLBACK, reason)
        return unfused_all_gather_matmul(a_shard, bs, gather_dim, group_name, return_a)
    _record(FUSED)
    fused, _ = torch_api.fused_ops()
    return fused(a_shard, bs, gather_dim, group_name, return_A=return_a)


def matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    reduce_op: str,
    scatter_dim: int,
    group_name: str,
    mode: str,
    max_tokens: int,
    timeout_s: float,
) -> torch.Tensor:
    world = dist.get_world_size(resolve_group(group_name))
    reason = _why_unfused(mode, a)
    if not reason:
        need, tokens = reduce_scatter_need(a, b, world)
        reason = ensure_workspace(group_name, need, tokens, max_tokens, timeout_s)
    if reason:
        _record(FALLBACK, reason)
        return unfused_matmul_reduce_scatter(a, b, reduce_op, scatter_dim, group_name)
    _record(FUSED)
    _, fused = torch_api.fused_ops()
    return fused(a, b, reduce_op, scatter_dim, group_name)


def _why_unfused(mode: str, t: torch.Tensor) -> str:
    if mode == "test_mode":
        return "test_mode"
    if t.device.type != "cuda":
        return "not_cuda"
    return ""


# ------------------------------------------------------------------- unfused reference --


def unfused_all_gather_matmul(
    a_shard: torch.Tensor, bs: list[torch.Tensor], gather_dim: int, group_name: str, return_a: bool
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """``all_gather(a_shard, gather_dim) @ b`` for each ``b`` with functional collectives
    (what torch's op computes; also its fake implementation)."""
    c10d = torch.ops._c10d_functional
    world = dist.get_world_size(resolve_group(group_name))
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(a_shard.contiguous(), world, group_name))
    if gather_dim in (a_shard.dim() - 1, -1):
        a = torch.cat(gathered.chunk(world), dim=-1)
    else:
        a = gathered.view(world, *a_shard.shape).movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)
    return (a if return_a else None), [torch.matmul(a, b) for b in bs]


def unfused_matmul_reduce_scatter(
    a: torch.Tensor, b: torch.Tensor, reduce_op: str, scatter_dim: int, group_name: str
) -> torch.Tensor:
    """``reduce_scatter(a @ b, reduce_op, scatter_dim)`` with functional collectives."""
    import warnings

    import torch.distributed._functional_collectives as funcol

    with warnings.catch_warnings():  # reduce_scatter_tensor: deprecated name in 2.13, kept for 2.11
        warnings.simplefilter("ignore", FutureWarning)
        out = funcol.reduce_scatter_tensor(torch.matmul(a, b), reduce_op, scatter_dim, group_name)
    return funcol.wait_tensor(out)
