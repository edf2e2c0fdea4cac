"""Bounded-wait agreement between the ranks of a process group.

Before a collective step (the first call of a fused op on a group, creating a workspace,
setting up symmetric memory) every rank must arrive, and with the same plan, or the
collective hangs. :func:`agree` checks both through the group's key-value store (the
TCPStore every process group is created with), not through the collective backend: it
works the same with NCCL and gloo, never queues GPU work, and waits at most ``timeout_s``.
Every rank either gets the list of all ranks' plans, or raises :class:`RankAgreementError`
naming the group, the step and the ranks that did not answer, failed or differ.

Keys live under ``passkit/<step>/<n>/<rank>`` where ``n`` counts this step's agreements
on the group in this process; each rank deletes its key of call ``n - 1`` once call ``n``
has completed (by then every rank has read it), so the store does not grow.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from passkit import PasskitError

from ..timeouts import check_timeout
from .groups import group_store, is_fake_group


def _env_timeout(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return check_timeout(name, float(raw))
    except ValueError as exc:
        raise PasskitError(f"environment variable {name}={raw!r}: {exc}") from None


DEFAULT_TIMEOUT_S = _env_timeout("PASSKIT_FUSION_COLLECTIVE_TIMEOUT", 180.0)
"""How long :func:`agree` waits for the other ranks (``PASSKIT_FUSION_COLLECTIVE_TIMEOUT``)."""

_PREFIX = "passkit"
_calls: Counter[tuple[str, str]] = Counter()


class RankAgreementError(PasskitError, RuntimeError):
    """The ranks of a group did not all arrive at a collective step, or arrived with
    different plans. Raised on every rank that reached the step."""

    def __init__(self, message: str, *, group: str, step: str, ranks: Sequence[int]):
        super().__init__(message)
        self.group, self.step, self.ranks = group, step, list(ranks)


def agree(
    group: dist.ProcessGroup,
    step: str,
    plan: Mapping[str, Any],
    *,
    timeout_s: float | None = None,
    describe: str = "",
) -> list[dict[str, Any]]:
    """Exchange ``plan`` (JSON-serialisable) with every rank of ``group``; return all plans
    in rank order when they are identical.

    Raises :class:`RankAgreementError` on every rank when a rank has not arrived within
    ``timeout_s`` (naming the ranks missing and the last step each of them did reach),
    when a rank reported a failure (:func:`report_failure`), or when the plans differ
    (naming the first field that differs and which ranks hold which value). ``describe``
    is added to the messages (e.g. ``"hidden=4096, dtype=bfloat16"``).
    """
    plans = exchange(group, step, plan, timeout_s=timeout_s, describe=describe)
    name = group.group_name
    where = f"process group {name!r}, step {step!r}" + (f" ({describe})" if describe else "")
    difference = compare_plans(plans)
    if difference:
        differing = [r for r, p in enumerate(plans) if p != plans[0]]
        raise RankAgreementError(
            f"passkit_fusion: the ranks disagree at {where}: {difference}. Every rank must use "
            f"the same passkit-fusion and flashinfer versions, tables and settings; otherwise "
            f"the collective would hang.",
            group=name,
            step=step,
            ranks=differing,
        )
    return plans


def exchange(
    group: dist.ProcessGroup,
    step: str,
    value: Mapping[str, Any],
    *,
    timeout_s: float | None = None,
    describe: str = "",
) -> list[dict[str, Any]]:
    """Every rank's ``value`` (JSON-serialisable), in rank order of ``group``: the same list
    on every rank, so a decision taken from it is the same on every rank. The wait, the
    failures and the errors are :func:`agree`'s; the values may differ (a rank's host).
    Only the ranks of ``group`` take part: other groups' ranks are never waited for."""
    value = dict(value)
    if is_fake_group(group) or dist.get_world_size(group) == 1:
        return [value]
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else check_timeout("timeout_s", timeout_s)
    store, rank, world = group_store(group), dist.get_rank(group), dist.get_world_size(group)
    name = group.group_name
    _calls[(name, step)] += 1
    call = _calls[(name, step)]
    keys = [f"{_PREFIX}/{step}/{call}/{r}" for r in range(world)]
    store.set(keys[rank], json.dumps({"plan": value}, sort_keys=True, default=str))
    store.set(f"{_PREFIX}/last/{rank}", f"{step} #{call}")
    where = f"process group {name!r}, step {step!r}" + (f" ({describe})" if describe else "")
    _wait(store, keys, timeout_s, where, name, step)
    answers = [json.loads(v) for v in store.multi_get(keys)]
    if call > 1:
        store.delete_key(f"{_PREFIX}/{step}/{call - 1}/{rank}")
    failed = {r: a["error"] for r, a in enumerate(answers) if "error" in a}
    if failed:
        listed = "; ".join(f"rank {r}: {msg}" for r, msg in failed.items())
        raise RankAgreementError(
            f"passkit_fusion: {where}: {listed}", group=name, step=step, ranks=list(failed)
        )
    return [a["plan"] for a in answers]


_agreed_plans: set[tuple[str, str, str]] = set()
"""The (group, step, plan JSON) triples the ranks agreed on in this process."""


def agree_plan_once(group_name: str, step: str, plan: str, timeout_s: float, describe: str = "") -> bool:
    """:func:`agree` on ``plan`` (a JSON text) with every rank of the group ``group_name``,
    once per (group, step, plan) in this process: a later call costs one set look-up (a
    compiled graph's hot path). Not during a CUDA-graph capture (the first eager call, or the
    warm-up before the capture, agrees). Returns whether the plan is agreed (False while
    capturing before any agreement). Raises :class:`RankAgreementError` like :func:`agree`."""
    key = (group_name, step, plan)
    if key in _agreed_plans:
        return True
    from .groups import resolve_group
    from .resources import capturing

    if capturing():
        return False
    agree(resolve_group(group_name), step, json.loads(plan), timeout_s=timeout_s, describe=describe)
    _agreed_plans.add(key)
    return True


def report_failure(group: dist.ProcessGroup, reason: str) -> None:
    """Tell the other ranks that this one failed before a collective step it will never
    reach: their pending and later :func:`agree` calls on ``group`` raise at once, naming
    this rank and ``reason``, instead of waiting for their timeout. Never raises."""
    if is_fake_group(group) or dist.get_world_size(group) == 1:
        return
    try:
        group_store(group).set(f"{_PREFIX}/failed/{dist.get_rank(group)}", reason)
    except Exception:  # the store may be gone too; the peers' timeout still bounds them
        pass


def _wait(store: dist.Store, keys: list[str], timeout_s: float, where: str, name: str, step: str) -> None:
    """Poll until every key exists; raise naming the missing or failed ranks."""
    failed_keys = [f"{_PREFIX}/failed/{r}" for r in range(len(keys))]
    deadline = time.monotonic() + timeout_s
    pause = 0.0005
    while not store.check(keys):
        failed = [r for r, key in enumerate(failed_keys) if store.check([key])]
        if failed:
            reasons = "; ".join(f"rank {r}: {store.get(failed_keys[r]).decode()}" for r in failed)
            raise RankAgreementError(
                f"passkit_fusion: {where}: rank(s) {failed} failed before reaching it ({reasons})",
                group=name,
                step=step,
                ranks=failed,
            )
        if time.monotonic() > deadline:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            last = {r: _last_step(store, r) for r in missing}
            seen = "; ".join(f"rank {r}: {last[r]}" for r in missing)
            raise RankAgreementError(
                f"passkit_fusion: {where}: rank(s) {missing} did not answer within {timeout_s:g} s "
                f"(last step they reached: {seen}). A rank that died, hangs elsewhere, or took "
                f"another path (e.g. different token counts or configuration) never arrives.",
                group=name,
                step=step,
                ranks=missing,
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _last_step(store: dist.Store, rank: int) -> str:
    key = f"{_PREFIX}/last/{rank}"
    return store.get(key).decode() if store.check([key]) else "none"


def plan_fingerprint(plan: Mapping[str, Any]) -> int:
    """A stable non-negative 63-bit hash of a plan (a JSON-serialisable mapping)."""
    payload = json.dumps(plan, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little") & (2**63 - 1)


def compare_plans(plans: Sequence[Mapping[str, Any]]) -> str | None:
    """Describe the first field on which the plans (one per rank) differ, or return None."""
    if not plans:
        return None
    fields = list(plans[0]) + sorted({f for p in plans[1:] for f in p} - set(plans[0]))
    for field in fields:
        values = [plan.get(field, "<missing>") for plan in plans]
        if any(value != values[0] for value in values[1:]):
            ranks_by_value: dict[str, list[int]] = {}
            for rank, value in enumerate(values):
                ranks_by_value.setdefault(repr(value), []).append(rank)
            parts = "; ".join(
                f"{value} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                for value, ranks in ranks_by_value.items()
            )
            return f"field {field!r} differs: {parts}"
    return None
