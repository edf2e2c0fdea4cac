"""flashinfer's IPC workspaces of the fused all-reduce + RMSNorm: creating and freeing one.

A :class:`Workspace` is one flashinfer workspace (its API adapter, handle and token
capacity) for one ``(process group, hidden size, dtype)``. :func:`create` makes one (a
collective step: every rank of the group calls it, after agreeing on the plan; the runtime
does that) and :func:`destroy` frees one through :func:`passkit_fusion.collective.resources.release`:
only once the GPU is idle, each step bounded, leaking it rather than hanging. Which sites
hold which workspace, and when they are created, is :mod:`.runtime`'s business.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist

from ..collective.resources import release
from ..tuning.tables import dtype_name
from .flashinfer_api import FlashinferApi

__all__ = ["Workspace", "create", "destroy"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Workspace:
    api: FlashinferApi
    handle: Any
    max_tokens: int


def create(
    api: FlashinferApi,
    *,
    group: dist.ProcessGroup,
    group_name: str,
    rank: int,
    world_size: int,
    hidden: int,
    dtype: torch.dtype,
    max_tokens: int,
) -> Workspace:
    """Create a workspace for ``max_tokens`` tokens (collective over ``group``)."""
    handle = api.create(
        group=group,
        rank=rank,
        world_size=world_size,
        max_tokens=max_tokens,
        hidden=hidden,
        dtype=dtype,
    )
    logger.info(
        "passkit_fusion: created a flashinfer %s workspace for group %r, hidden %d, %s, %d tokens",
        api.name,
        group_name,
        hidden,
        dtype_name(dtype),
        max_tokens,
    )
    return Workspace(api, handle, max_tokens)


def destroy(workspace: Workspace, *, timeout_s: float, what: str) -> bool:
    """Free ``workspace`` once the GPU is done with it, within ``timeout_s`` per step.

    Freeing memory a running kernel (or a peer's, through IPC) still uses is undefined, and
    a fused kernel whose peer died never finishes: when the device does not go idle within
    ``timeout_s`` the workspace is left allocated (the process's exit frees it)."""
    return release(workspace, lambda: workspace.api.destroy(workspace.handle), timeout_s=timeout_s, what=what)
