"""Fault injection for passkit_fusion's runtime: gloo worlds of 2 and 4 CPU processes.

Every fault must end as a clear error on every surviving rank within its timeout, never as
a hang, and leave no process behind. One world per size runs the scenarios in order, each
on a process group of its own (so that a failure one scenario leaves in a group's store or
connections cannot leak into the next); the last rank (``world - 1``) is the faulty one:

* ``differ``: the ranks agree on different plans -> RankAgreementError on every rank.
* ``missing``: the faulty rank never arrives -> the others name it, and the step it last
  reached, after ``collective_timeout_s``.
* ``reported``: the faulty rank fails and says so (``report_failure``) -> the others raise
  at once with its reason.
* ``op_raises_first``: the faulty rank's first op call raises (bad weight) before the
  collective -> the others' plan check names it.
* ``tokens_differ``: with ``check_calls``, the faulty rank calls with more tokens -> every
  rank raises naming the field ``tokens`` and the values per rank.
* ``op_raises_later``: after a few good calls the faulty rank raises; the others' fallback
  all-reduce times out with the group's timeout -> CollectiveError naming the group.
* ``killed``: the faulty rank dies (``os._exit``) between calls -> CollectiveError on the
  others; the world reports its exit code and no process outlives the test.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from passkit_fusion.allreduce_rmsnorm import runtime
from passkit_fusion.allreduce_rmsnorm.runtime import CollectiveError
from passkit_fusion.collective import RankAgreementError, agree, collective_device, report_failure
from passkit_testing.worlds import run_in_gloo_world

TIMEOUT_S = 3.0  # collective_timeout_s of the scenarios
GROUP_TIMEOUT_S = 4.0  # gloo timeout of the op_raises_later group
SLACK_S = 30.0
"""Scheduling on a loaded 2-core machine running several ranks: a hang limit. Each bound below
tells a step that ended at its own timeout from one that waited for the next timeout up
(the 60 s of ``reported``'s collective timeout, gloo's 30 minutes otherwise)."""
HIDDEN, EPS = 64, 1e-6


def _call(group: dist.ProcessGroup, tokens: int, weight_len: int = HIDDEN):
    device = collective_device(group)
    x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device=device)
    weight = torch.ones(weight_len, dtype=torch.bfloat16, device=device)
    return runtime.fused_allreduce_rmsnorm_cuda(x, None, weight, EPS, 0.0, group.group_name)


def _outcome(fn) -> dict[str, Any]:
    """Run ``fn``; return how it ended and how long it took."""
    start = time.monotonic()
    try:
        fn()
        error: BaseException | None = None
    except Exception as exc:
        error = exc
    out: dict[str, Any] = {"seconds": time.monotonic() - start, "type": None, "message": None}
    if error is not None:
        out["type"], out["message"] = type(error).__name__, str(error)
        if isinstance(error, RankAgreementError):
            out["ranks"], out["step"], out["group"] = error.ranks, error.step, error.group
    return out


def _scenarios(rank: int, world: int, backend_faults: bool = True) -> dict[str, Any]:
    """Every scenario in order; ``backend_faults=False`` stops before the two whose error
    comes from the backend's own failure detection (gloo's; NCCL's watchdog differs)."""
    faulty = rank == world - 1
    runtime.configure(collective_timeout_s=TIMEOUT_S)
    # what a rank's first plan computes once (importing flashinfer takes seconds on a GPU
    # machine): done here, so that it cannot delay a rank past the scenarios' timeout
    runtime.unavailable_reason(), runtime.flashinfer_version()
    out: dict[str, Any] = {}

    group = dist.new_group()
    out["differ"] = _outcome(lambda: agree(group, "test:differ", {"value": rank % 2}, timeout_s=TIMEOUT_S))
    dist.barrier()

    group = dist.new_group()
    if faulty:
        time.sleep(TIMEOUT_S + 1)  # busy elsewhere: never reaches the step in time
        out["missing"] = None
    else:
        out["missing"] = _outcome(lambda: agree(group, "test:missing", {}, timeout_s=TIMEOUT_S))
    dist.barrier()

    group = dist.new_group()
    if faulty:
        report_failure(group, "ValueError: weights failed to load")
        out["reported"] = None
    else:
        out["reported"] = _outcome(lambda: agree(group, "test:reported", {}, timeout_s=60))
    dist.barrier()

    group = dist.new_group()
    out["op_raises_first"] = _outcome(lambda: _call(group, 4, weight_len=HIDDEN + (8 if faulty else 0)))
    dist.barrier()

    group = dist.new_group()
    runtime.configure(check_calls=True)
    _call(group, 4)  # agreed plan and first call
    out["tokens_differ"] = _outcome(lambda: _call(group, 8 if faulty else 4))
    runtime.configure(check_calls=False)
    dist.barrier()
    if not backend_faults:
        return out

    group = dist.new_group(timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    calls_before = 3

    def raises_later() -> None:
        for i in range(calls_before + 1):
            if faulty and i == calls_before:
                raise ValueError("the faulty rank's model raised")
            _call(group, 4)

    out["op_raises_later"] = _outcome(raises_later)
    dist.barrier()

    group = dist.new_group()

    def killed() -> None:
        for i in range(5):
            if faulty and i == 2:
                os._exit(3)
            _call(group, 4)

    out["killed"] = _outcome(killed)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def faults(request) -> tuple[int, list[Any], float]:
    world = request.param
    start = time.monotonic()
    results = run_in_gloo_world(_scenarios, world, timeout=600)
    elapsed = time.monotonic() - start
    assert multiprocessing.active_children() == [], "a rank process outlived its world"
    return world, results, elapsed


def _survivors(faults) -> list[dict[str, Any]]:
    _world, results, _ = faults
    survivors = results[:-1]
    for result in survivors:
        assert result.ok, result.describe()
    return [r.value for r in survivors]


def test_the_killed_rank_is_reported_and_the_world_ends_early(faults):
    _world, results, _elapsed = faults
    assert results[-1].error == "exited with code 3 without reporting a result"
    # every scenario ended at its own timeout: no survivor was stopped at the world's (a hang
    # limit); how long that took is the machine's load, not the test's concern
    assert not [r.describe() for r in results[:-1] if not r.ok], "a survivor hung or failed"


def test_differing_plans_raise_on_every_rank(faults):
    world, _results, _ = faults
    survivors = _survivors(faults)
    for out in survivors:
        differ = out["differ"]
        assert differ["type"] == "RankAgreementError"
        assert differ["step"] == "test:differ"
        assert "field 'value' differs: 0 on rank" in differ["message"]
        assert differ["ranks"] == [r for r in range(world) if r % 2]


def test_a_missing_rank_is_named_after_the_timeout(faults):
    world, _, _ = faults
    for out in _survivors(faults):
        missing = out["missing"]
        assert missing["type"] == "RankAgreementError"
        assert missing["ranks"] == [world - 1]
        assert "step 'test:missing'" in missing["message"]
        assert f"rank(s) [{world - 1}] did not answer within {TIMEOUT_S:g} s" in missing["message"]
        assert "last step they reached" in missing["message"]
        assert TIMEOUT_S <= missing["seconds"] < TIMEOUT_S + SLACK_S


def test_a_reported_failure_is_seen_at_once(faults):
    world, _, _ = faults
    for out in _survivors(faults):
        reported = out["reported"]
        assert reported["type"] == "RankAgreementError"
        assert reported["ranks"] == [world - 1]
        assert f"rank {world - 1}: ValueError: weights failed to load" in reported["message"]
        assert reported["seconds"] < 2 + SLACK_S  # not the 60 s timeout


def test_a_rank_raising_before_the_collective_is_named_by_the_others(faults):
    world, _results, _ = faults
    for out in _survivors(faults):
        first = out["op_raises_first"]
        assert first["type"] == "RankAgreementError"
        assert first["step"] == "allreduce_rmsnorm:plan"
        assert first["ranks"] == [world - 1]
        assert "hidden=64, dtype=bfloat16" in first["message"]
        assert first["seconds"] < TIMEOUT_S + SLACK_S


def test_mismatched_token_counts_raise_with_check_calls(faults):
    world, _, _ = faults
    for out in _survivors(faults):
        tokens = out["tokens_differ"]
        assert tokens["type"] == "RankAgreementError"
        assert tokens["step"] == "allreduce_rmsnorm:call"
        others = ", ".join(map(str, range(world - 1)))
        assert (
            f"field 'tokens' differs: 4 on rank{'s' if world > 2 else ''} {others}; 8 on rank {world - 1}"
            in (tokens["message"])
        )


def test_an_op_raising_later_becomes_a_collective_error_within_the_group_timeout(faults):
    for out in _survivors(faults):
        later = out["op_raises_later"]
        assert later["type"] == "CollectiveError", later
        assert (
            "the all-reduce of the unfused all-reduce + RMSNorm path failed on process group"
            in (later["message"])
        )
        assert later["seconds"] < GROUP_TIMEOUT_S + SLACK_S


def test_a_killed_rank_becomes_a_collective_error(faults):
    for out in _survivors(faults):
        killed = out["killed"]
        assert killed["type"] == "CollectiveError", killed
        assert "A peer rank died" in killed["message"]
        assert killed["seconds"] < TIMEOUT_S + SLACK_S


def test_collective_error_is_a_runtime_error():
    assert issubclass(CollectiveError, RuntimeError)
    assert issubclass(RankAgreementError, RuntimeError)
