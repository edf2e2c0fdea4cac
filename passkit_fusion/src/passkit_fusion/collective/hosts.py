"""Which host each rank of a process group runs on, agreed by the group's ranks.

flashinfer's IPC workspaces (``allreduce_rmsnorm``) and symmetric memory (``async_tp``) map
peer GPUs' memory, which works only between GPUs of one host. A tensor-parallel group whose
ranks are on several hosts must keep NCCL. Each rank knows only its own host, and a pass
that declined on some ranks but fused on others would hang the collective, so the ranks of
the group read each other's host identity from the default store and decide from the same
list on every rank. Each process writes its own once (:func:`publish`, no wait) when a
compile begins: the passes' ``skip_reason`` runs at backend entry on every rank, also where
Inductor's cache serves the graph and no pass runs, so a rank reading the list (a bounded
wait, only for the ranks of its own group: with pipeline parallelism no stage waits for
another) never waits on a peer's compile.

A host is identified by ``PASSKIT_FUSION_HOST_ID`` when set (tests, or launchers that know
better), else the kernel's boot id (the same for every process and container of one
machine), else the host name.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable

import torch.distributed as dist

from .agreement import DEFAULT_TIMEOUT_S, RankAgreementError
from .groups import is_fake_group, resolve_group

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


_KEY = "passkit_fusion/host/{rank}"
_published: set[int] = set()
"""The default stores (by id) this process wrote its host to."""


def _default_store() -> dist.Store:
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def publish() -> None:
    """Write this process's host under its global rank in the default store (once per
    process and store; no wait, never raises). Called when a compile begins."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        store = _default_store()
        if id(store) not in _published:
            store.set(_KEY.format(rank=dist.get_rank()), host_id())
            _published.add(id(store))
    except Exception:  # a store that cannot be written: hosts_of reports the missing rank
        pass


def forget() -> None:
    """Publish again at the next compile (tests that change ``PASSKIT_FUSION_HOST_ID``)."""
    _published.clear()


def hosts_of(group_name: str, *, timeout_s: float | None = None) -> list[str] | None:
    """The host of every rank of the group, in group-rank order, identical on every rank of
    the group (read from what each rank :func:`publish`-ed); ``None`` when torch.distributed
    is not initialised. A rank that has not published within ``timeout_s`` raises
    :class:`~.agreement.RankAgreementError` naming it."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = resolve_group(group_name)
    if is_fake_group(group) or dist.get_world_size(group) == 1:
        return [host_id()]
    publish()
    ranks = dist.get_process_group_ranks(group)
    keys = [_KEY.format(rank=r) for r in ranks]
    store = _default_store()
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception:
        missing = [r for r, key in zip(ranks, keys) if not store.check([key])]
        raise RankAgreementError(
            f"passkit_fusion: process group {group.group_name!r}: rank(s) {missing} did not say which "
            f"host they are on within {timeout_s:.0f} s (they never began a compile through passkit)",
            group=group.group_name,
            step="hosts",
            ranks=missing,
        ) from None
    return [store.get(key).decode() for key in keys]


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
