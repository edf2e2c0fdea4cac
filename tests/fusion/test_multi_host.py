"""Tensor-parallel groups that span hosts: the passes that map peer GPUs' memory
(``allreduce_rmsnorm``: flashinfer's IPC workspaces; ``async_tp``: symmetric memory) decline
with the same reason on every rank, decided from the hosts the group's ranks exchange, and
the graph keeps its NCCL collectives. gloo ranks get host identities through
``PASSKIT_FUSION_HOST_ID``; with pipeline parallelism (one TP group per stage) the exchange
stays inside each TP group, so no stage waits for another."""

from __future__ import annotations

import datetime
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from passkit_fusion.allreduce_rmsnorm import AllReduceRMSNorm
from passkit_fusion.async_tp import AsyncTP
from passkit_fusion.collective import HOST_ID_ENV, hosts_of, spans_hosts
from torch.fx.experimental.proxy_tensor import make_fx

from passkit import CompileContext
from passkit_testing import fake_world, gloo_world

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # funcol's deprecated names

H = 64
ENV = {"PASSKIT_FUSION_COLLECTIVE_TIMEOUT": "30"}


def _norm_site(group: Any):
    def f(x, r, w):
        h = (funcol.all_reduce(x, "sum", group) + r).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * h.to(x.dtype)

    x = torch.randn(8, H)
    return make_fx(f, tracing_mode="fake")(x, x.clone(), torch.ones(H))


def _mlp(group: Any):
    def f(x, w1, w2):
        h = torch.relu(funcol.all_gather_tensor(x, 0, group) @ w1)
        return funcol.reduce_scatter_tensor(h @ w2, "sum", 0, group)

    return make_fx(f, tracing_mode="fake")(torch.randn(8, H), torch.randn(H, 2 * H), torch.randn(2 * H, H))


def _ops(gm) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def _decide(group: Any, world_size: int) -> dict[str, Any]:
    """Both passes on a graph of ``group``: what each did and which collectives are left."""
    ctx = CompileContext(world_size=world_size)
    norm = _norm_site(group)
    ar = AllReduceRMSNorm(implementation="reference").run(norm, ctx)
    mlp = _mlp(group)
    tp = AsyncTP(implementation="test_mode", min_tokens=1).run(mlp, ctx)
    return {
        "allreduce_rmsnorm": (ar.matches, ar.notes),
        "async_tp": (tp.matches, tp.notes),
        "kept_all_reduce": "_c10d_functional.all_reduce.default" in _ops(norm),
        "kept_all_gather": "_c10d_functional.all_gather_into_tensor.default" in _ops(mlp),
    }


# ------------------------------------------------------------------------ one TP group --


def _republish(group: Any) -> None:
    """A new host identity for this process (a new layout in the same world): once the
    group's ranks are done with the last one, publish it and wait until they all have."""
    from passkit_fusion.collective import hosts

    dist.barrier(group=group)  # every rank is done reading the last layout
    hosts.forget()
    hosts.publish()
    dist.barrier(group=group)


def _two_ranks(rank: int, world: int) -> dict[str, Any]:
    group = dist.group.WORLD
    out = {}
    for layout, hosts in (("across", ["node-a", "node-b"]), ("one_host", ["node-a", "node-a"])):
        os.environ[HOST_ID_ENV] = hosts[rank]
        _republish(group)
        out[layout] = {"hosts": hosts_of(group.group_name), **_decide(group, world)}
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return gloo_world(_two_ranks, 2, timeout=300, env=ENV)


def test_tp_group_on_two_hosts_keeps_nccl_with_the_same_reason_on_every_rank(two_ranks):
    results = [r["across"] for r in two_ranks]
    assert results[0] == results[1]  # decided from the exchanged list: identical on every rank
    res = results[0]
    assert res["hosts"] == ["node-a", "node-b"]
    matches, notes = res["allreduce_rmsnorm"]
    assert matches == 0 and res["kept_all_reduce"]
    reason = "TP group '0' spans 2 hosts (group ranks per host: [0] | [1])"
    assert any(reason in n and "flashinfer's IPC workspaces" in n and "keeps NCCL" in n for n in notes), notes
    matches, notes = res["async_tp"]
    assert matches == 0 and res["kept_all_gather"]
    assert notes == [
        "TP group '0' spans 2 hosts (group ranks per host: [0] | [1]): symmetric memory (async_tp) "
        "work only within one host; the graph keeps NCCL"
    ]


def test_tp_group_on_one_host_fuses(two_ranks):
    results = [r["one_host"] for r in two_ranks]
    assert results[0] == results[1] and results[0]["hosts"] == ["node-a", "node-a"]
    assert results[0]["allreduce_rmsnorm"][0] == 1 and not results[0]["kept_all_reduce"]
    assert results[0]["async_tp"][0] == 2 and not results[0]["kept_all_gather"]


def test_fake_and_single_process_groups_are_one_host():
    with fake_world(4) as world:
        assert spans_hosts(world.group_name, "x") is None
        assert _decide(world.group, 4)["allreduce_rmsnorm"][0] == 1


def test_default_host_identity(monkeypatch):
    from passkit_fusion.collective import hosts

    monkeypatch.delenv(HOST_ID_ENV, raising=False)
    found = hosts.default_host_id()
    assert found.startswith(("boot:", "host:")) and found == hosts.default_host_id()
    monkeypatch.setenv(HOST_ID_ENV, "rack3-node7")
    assert hosts.default_host_id() == "rack3-node7"


# --------------------------------------------------- pipeline parallelism: PP=2 x TP=2 --


def _pp_tp(rank: int, world: int) -> dict[str, Any]:
    """Stage ``rank // 2`` owns TP group [2s, 2s+1]. Stage 1 starts only after both stage-0
    ranks finished: had stage 0 waited for a stage-1 rank, it would time out instead. Two
    host layouts: each TP group on its own host, then every TP group across two hosts."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    stage = rank // 2
    store = dist.distributed_c10d._get_default_store()
    out = {}
    for layout in ("tp_per_host", "tp_across_hosts"):
        host = rank // 2 if layout == "tp_per_host" else rank % 2
        os.environ[HOST_ID_ENV] = f"node-{host}"
        _republish(groups[stage])  # within the TP group only
        if stage == 1:
            store.wait([f"{layout}/stage0-done/0", f"{layout}/stage0-done/1"], datetime.timedelta(seconds=60))
        decided = _decide(groups[stage], world)  # a wait for stage 1 here: RankAgreementError
        if stage == 0:
            store.set(f"{layout}/stage0-done/{rank}", "1")
        out[layout] = {"stage": stage, **decided}
    return out


@pytest.mark.slow  # a 4-rank world: ~30 s on 2 CPU cores
def test_pipeline_stages_agree_only_within_their_tp_group():
    worlds = gloo_world(_pp_tp, 4, timeout=300, env=ENV)
    for layout in ("tp_per_host", "tp_across_hosts"):
        results = [w[layout] for w in worlds]
        for stage in (0, 1):
            a, b = results[2 * stage : 2 * stage + 2]
            assert a == b  # the two ranks of a TP group took the same decision
        for r in results:
            group = "1" if r["stage"] == 0 else "2"
            if layout == "tp_per_host":
                assert r["allreduce_rmsnorm"][0] == 1 and r["async_tp"][0] == 2
            else:
                assert r["allreduce_rmsnorm"][0] == 0 and r["kept_all_reduce"] and r["kept_all_gather"]
                assert f"TP group {group!r} spans 2 hosts" in r["async_tp"][1][0]
