"""The CUDA runtime behind ``torch.ops.passkit_fusion.allreduce_add_layernorm`` (``impl="symm_mem"``).

For ``x`` of shape ``[..., hidden]`` on every rank of a process group,
:func:`allreduce_add_layernorm_cuda` returns ``(norm_out, residual_out)``::

    residual_out = all_reduce_sum(x) + residual        # residual may be None
    norm_out     = layer_norm(residual_out, weight, bias, eps)

The all-reduce is torch's symmetric-memory one-shot all-reduce
(``torch.ops.symm_mem.one_shot_all_reduce_copy_out``: the kernel copies ``x`` into this
rank's symmetric buffer, then every rank reads every peer's buffer and sums: point-to-point
loads over NVLink, never NVLink multicast) into a persistent buffer per (group, dtype),
followed by residual add + LayerNorm in one Triton kernel (:mod:`.triton_kernel`,
``norm_kernel="triton"``) or in torch ops (``"torch"``: ``torch.add`` + ``F.layer_norm``).

The plain path (NCCL's all-reduce through the functional collective, then add + LayerNorm in
torch) runs instead, identically on every rank, when

* the message is larger than ``max_bytes`` (the buffer's size): decided from the shape;
* symmetric memory is not available for the group (no CUDA, no NCCL, a torch without the
  op, or the buffer could not be set up: the ranks agree on that first);
* the buffer does not exist yet and the call is being captured into a CUDA graph (nothing is
  allocated during capture; call :func:`prepare` before capturing, or run one eager step).

The buffer is created at the first call on a (group, dtype) (or by :func:`prepare`), after
the ranks agree through :func:`passkit_fusion.collective.agree` (bounded), outside any
CUDA-graph memory pool (:func:`passkit_fusion.collective.resources.outside_graph_pools`),
and freed by :func:`destroy_buffers`, which passkit's ordered teardown runs before the
process group is destroyed. Process-wide state, not thread-safe. Imports without CUDA.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from ..collective import agree, resolve_group
from ..collective.resources import at_exit, outside_graph_pools, release
from ..collective.resources import capturing as _capturing
from ..reference import all_reduce_sum, layer_norm

__all__ = [
    "FALLBACK",
    "FUSED",
    "allreduce_add_layernorm_cuda",
    "destroy_buffers",
    "prepare",
    "reset_stats",
    "stats",
    "unavailable_reason",
]

FUSED = "symm_mem"
FALLBACK = "fallback"
STEP = "allreduce_layernorm:symm_mem"
TIMEOUT_S = float(os.environ.get("PASSKIT_FUSION_COLLECTIVE_TIMEOUT", "180"))
TEARDOWN_TIMEOUT_S = 10.0

_buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
"""The symmetric buffer per (group name, dtype), flat, of ``max_bytes`` bytes."""
_failed: dict[tuple[str, torch.dtype], str] = {}
"""Why a buffer could not be set up (agreed on every rank): calls take the plain path."""
_stats: Counter[str] = Counter()


def stats() -> dict[str, int]:
    """Calls per path (``symm_mem``, ``fallback``, ``fallback:<reason>``) since the last reset.
    Calls replayed from a CUDA graph are not seen (the capture counts once)."""
    return dict(_stats)


def reset_stats() -> None:
    _stats.clear()


def _record(path: str, reason: str = "") -> None:
    _stats[path] += 1
    if reason:
        _stats[f"{path}:{reason}"] += 1


def unavailable_reason() -> str | None:
    """Why the symmetric-memory path cannot run in this process, or None."""
    if not torch.cuda.is_available():
        return "no_cuda"
    if not dist.is_nccl_available():
        return "no_nccl"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return "no_symm_mem_op"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return "no_symm_mem"
    return None


def allreduce_add_layernorm_cuda(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    group_name: str,
    norm_kernel: str = "triton",
    max_bytes: int = 4 * 2**20,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. Collective: every rank calls it with the same shapes."""
    reason = _why_plain(x, group_name, max_bytes)
    if reason:
        _record(FALLBACK, reason)
        reduced = all_reduce_sum(x, group_name)
    else:
        _record(FUSED)
        reduced = one_shot_all_reduce(x, group_name, max_bytes)
    return add_layernorm(reduced, residual, weight, bias, eps, norm_kernel)


def _why_plain(x: torch.Tensor, group_name: str, max_bytes: int) -> str:
    if not x.is_cuda:
        return "not_cuda"
    if (problem := unavailable_reason()) is not None:
        return problem
    if x.numel() * x.element_size() > max_bytes:
        return "above_max_bytes"
    key = (group_name, x.dtype)
    if key in _failed:
        return "no_buffer"
    buffer = _buffers.get(key)
    if buffer is None or buffer.numel() * buffer.element_size() < max_bytes:
        if _capturing():
            return "buffer_not_ready_in_capture"
        if not prepare(group_name, x.dtype, max_bytes, device=x.device):
            return "no_buffer"
    return ""


def one_shot_all_reduce(x: torch.Tensor, group_name: str, max_bytes: int) -> torch.Tensor:
    """``x`` summed over the group with the symmetric-memory one-shot kernel (the buffer of
    (group, dtype) must exist: :func:`prepare`)."""
    buffer = _buffers[(group_name, x.dtype)]
    x = x.contiguous()
    view = buffer[: x.numel()].view_as(x)
    out = torch.empty_like(x)
    torch.ops.symm_mem.one_shot_all_reduce_copy_out(view, x, "sum", group_name, out)
    return out


def add_layernorm(
    reduced: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    norm_kernel: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm_out, residual_out)`` from the reduced sum: Triton (one kernel, ``residual_out``
    written over ``reduced``, a fresh tensor) or torch ops."""
    if norm_kernel == "triton" and reduced.is_cuda:
        from .triton_kernel import add_layernorm as triton_add_layernorm

        return triton_add_layernorm(reduced, residual, weight, bias, eps, residual_out=reduced)
    total = reduced if residual is None else torch.add(reduced, residual)
    return layer_norm(total, weight, bias, eps), total


def prepare(group_name: str, dtype: torch.dtype, max_bytes: int, device: Any = None) -> bool:
    """Create the symmetric buffer of (group, dtype) with ``max_bytes`` bytes now (e.g. before
    CUDA-graph capture); True when it exists. Collective: every rank of the group calls it
    with the same arguments. A failure to set it up (agreed across ranks) makes every later
    call on (group, dtype) take the plain path and is returned as False."""
    if _capturing():
        raise RuntimeError(
            "passkit_fusion allreduce_layernorm: prepare() is collective and allocates symmetric "
            "memory: call it before CUDA graph capture, not during it"
        )
    key = (group_name, dtype)
    existing = _buffers.get(key)
    if existing is not None and existing.numel() * existing.element_size() >= max_bytes:
        return True
    if key in _failed:
        return False
    group = resolve_group(group_name)
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    numel = -(-max_bytes // dtype.itemsize)
    agree(
        group,
        STEP,
        {
            "bytes": numel * dtype.itemsize,
            "dtype": str(dtype),
            "torch": torch.__version__,
            "multicast_disabled": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", ""),
        },
        timeout_s=TIMEOUT_S,
        describe=f"symmetric-memory buffer of {numel * dtype.itemsize} bytes on {dist.get_world_size(group)} ranks",
    )
    error = ""
    try:
        buffer = outside_graph_pools(
            lambda: _allocate(group_name, numel, dtype, device),
            "symmetric-memory buffer (allreduce_layernorm)",
        )
    except Exception as exc:  # this torch/driver/group cannot: the plain path, on every rank
        buffer, error = None, f"{type(exc).__name__}: {exc}"
    # every rank takes the same path: one rank's failure is every rank's
    ok = torch.tensor([0 if error else 1], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if not int(ok.item()):
        _failed[key] = error or "a peer could not set up its buffer"
        warnings.warn(
            f"passkit_fusion allreduce_layernorm: no symmetric memory for group {group_name!r} "
            f"({_failed[key]}): the op runs NCCL's all-reduce",
            stacklevel=2,
        )
        return False
    _buffers[key] = buffer  # type: ignore[assignment]
    at_exit(destroy_buffers, "passkit-fusion's symmetric-memory buffers (allreduce_layernorm)")
    return True


def _allocate(group_name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat symmetric tensor of ``numel`` elements, rendezvoused on the group (collective)."""
    from torch.distributed import _symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # deprecated in 2.13 (FutureWarning), required by 2.11's rendezvous
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(group_name)
    buffer = symm_mem.empty(numel, dtype=dtype, device=device)
    symm_mem.rendezvous(buffer, group_name)  # type: ignore[arg-type]
    return buffer


def destroy_buffers() -> None:
    """Free every symmetric buffer once the GPU is done with it (bounded; what cannot be freed
    safely is left to the process's exit). Call it only when no CUDA graph that uses a buffer
    will replay again; passkit's teardown runs it before the process group is destroyed."""
    buffers = list(_buffers.items())
    _buffers.clear()
    _failed.clear()
    for (group_name, dtype), buffer in buffers:
        release(
            buffer,
            lambda: None,  # dropping the last reference frees it (the GPU is idle by now)
            timeout_s=TEARDOWN_TIMEOUT_S,
            what=f"symmetric-memory buffer of group {group_name!r} ({dtype})",
        )
