"""Which host each rank of a process group runs on, agreed by the group's ranks.

flashinfer's IPC workspaces (``allreduce_rmsnorm``) and symmetric memory (``async_tp``) map
peer GPUs' memory, which works only between GPUs of one host. A tensor-parallel group whose
ranks are on several hosts must keep NCCL. Each rank knows only its own host, and a pass
that declined on some ranks but fused on others would hang the collective, so the ranks of
the group exchange their host identities through :func:`~.agreement.exchange` (the group's
store, a bounded wait, only the ranks of that group: with pipeline parallelism no stage
waits for another) and decide from the same list on every rank.

A host is identified by ``PASSKIT_FUSION_HOST_ID`` when set (tests, or launchers that know
better), else the kernel's boot id (the same for every process and container of one
machine), else the host name.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch.distributed as dist

from .agreement import exchange
from .groups import resolve_group

HOST_ID_ENV = "PASSKIT_FUSION_HOST_ID"
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def default_host_id() -> str:
    """``PASSKIT_FUSION_HOST_ID``, else the boot id, else the host name."""
    explicit = os.environ.get(HOST_ID_ENV, "").strip()
    if explicit:
        return explicit
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
        if boot:
            return f"boot:{boot}"
    except OSError:
        pass
    return f"host:{socket.gethostname()}"


host_id: Callable[[], str] = default_host_id
"""The function that names this process's host (replace it to inject another identity)."""


def hosts_of(group_name: str, *, timeout_s: float | None = None) -> list[str] | None:
    """The host of every rank of the group, in group-rank order, identical on every rank of
    the group (exchanged through its store); ``None`` when torch.distributed is not
    initialised (nothing to exchange with). Every rank of the group must call it (at the
    same point: the pass's compile of the same graph), or the others raise
    :class:`~.agreement.RankAgreementError` after ``timeout_s``."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = resolve_group(group_name)
    answers = exchange(
        group, "hosts", {"host": host_id()}, timeout_s=timeout_s, describe="which host each rank is on"
    )
    return [str(a["host"]) for a in answers]


def spans_hosts(group_name: str, needs: str, *, timeout_s: float | None = None) -> str | None:
    """Why a fusion that needs ``needs`` (``"flashinfer's IPC workspaces"``) must not run on
    the group: ``"TP group '1' spans 2 hosts (ranks [0, 2] | [1, 3]): ..."``; ``None`` when
    its ranks are on one host. The same answer on every rank of the group."""
    hosts = hosts_of(group_name, timeout_s=timeout_s)
    if hosts is None or len(set(hosts)) <= 1:
        return None
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    layout = " | ".join(str(ranks) for ranks in by_host.values())
    return (
        f"TP group {group_name!r} spans {len(by_host)} hosts (group ranks per host: {layout}): "
        f"{needs} work only within one host; the graph keeps NCCL"
    )
