"""Process groups: by name, their collective device and their key-value store."""

from __future__ import annotations

import torch
import torch.distributed as dist


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under ``group_name`` (as graphs and ops name groups)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(group_name)  # type: ignore[arg-type]  # GroupName is a str
    except Exception as exc:
        raise RuntimeError(
            f"passkit_fusion: no process group named {group_name!r} "
            f"(is torch.distributed initialised?): {exc}"
        ) from exc


def backend_name(group: dist.ProcessGroup) -> str:
    return str(dist.get_backend(group)).lower()


def is_fake_group(group: dist.ProcessGroup) -> bool:
    """A ``fake`` backend group (one process standing for many, for tracing): no peers exist."""
    return "fake" in backend_name(group)


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where tensors for this group's collectives must live."""
    if "nccl" in backend_name(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_store(group: dist.ProcessGroup) -> dist.Store:
    """The key-value store the group was created with (every rank of the group reaches it)."""
    from torch.distributed.distributed_c10d import _get_process_group_store

    return _get_process_group_store(group)
