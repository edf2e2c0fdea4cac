"""``sequence_parallel`` in real 2- and 4-rank gloo worlds: a tensor-parallel TinyLlama
compiled with the pass matches eager at token counts that are multiples of the world size
(the pass's specialization) and at others (compiled without it, through the token range);
composition with ``allreduce_rmsnorm`` in both configured orders.

Passkit's eager mode runs the passes without code generation (fast on two CPU cores); one
world goes through Inductor once, so the rewritten graph is also lowered and run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from passkit_fusion.model import LlamaConfig, TinyLlama, shard_functional

import passkit
from passkit_testing import assert_close, fake_world, gloo_world

SITES = LlamaConfig().sites()
MIN = 8
SP = {"name": "sequence_parallel", "min_tokens": MIN}
ARR = {"name": "allreduce_rmsnorm", "implementation": "reference", "max_tokens": MIN}
NO_CACHES = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
STATIC = f"tokens = {MIN} (static shapes)"
"""The report of the first call's compile (static shapes, {MIN} tokens: in the passes' range)."""


def _model(rank: int, world_size: int, dtype: torch.dtype) -> TinyLlama:
    model = TinyLlama(LlamaConfig(kv_heads=4)).to(dtype).eval()
    return shard_functional(model, dist.group.WORLD, rank, world_size)


def _ids(seq: int) -> torch.Tensor:
    return torch.randint(0, LlamaConfig().vocab, (1, seq), generator=torch.Generator().manual_seed(seq))


def _records(backend: passkit.Backend) -> dict[str | None, dict[str, tuple[str, int, list[str]]]]:
    return {
        r.token_range: {rec.name: (rec.status, rec.matches, rec.notes) for rec in r.records}
        for r in backend.reports
    }


def _run(
    rank: int, world_size: int, passes: list[Any], seqs: tuple[int, ...], mode: str, dtype: torch.dtype
) -> dict[str, Any]:
    torch._dynamo.reset()
    model = _model(rank, world_size, dtype)
    backend = passkit.backend(passes=passes, mode=mode, verify=True, on_error="raise")
    compiled = torch.compile(model, backend=backend)
    out: dict[str, Any] = {"calls": {}}
    with torch.no_grad():
        for seq in seqs:
            got = compiled(_ids(seq))
            dispatcher = backend.last_dispatcher
            spec = dispatcher.index_for(seq) if dispatcher is not None else None
            label = dispatcher.plan.specializations[spec].label if spec is not None else None
            out["calls"][seq] = {"compiled": got, "eager": model(_ids(seq)), "range": label}
    out["records"] = _records(backend)
    out["compiles"] = len(backend.reports)
    return out


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    out = {"sp": _run(rank, world_size, [SP, "cleanup"], (MIN, 12, 10, 7), "eager", torch.float32)}
    if world_size == 2:
        out["sp_bf16"] = _run(rank, world_size, [SP], (MIN,), "eager", torch.bfloat16)
    return out


def _inductor_rank(rank: int, world_size: int) -> dict[str, Any]:
    return _run(rank, world_size, [SP, "cleanup"], (MIN, 12, 9), "inductor", torch.float32)


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["tp2", "tp4"])
def world(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, gloo_world(_rank, request.param, timeout=400, env=NO_CACHES)


@pytest.fixture(scope="module")
def inductor_world() -> list[dict[str, Any]]:
    return gloo_world(_inductor_rank, 2, timeout=400, env=NO_CACHES)


def _check_calls(result: dict[str, Any], world_size: int, dtype_tol: float = 1e-5) -> None:
    for seq, call in result["calls"].items():
        assert_close(call["compiled"], call["eager"], rtol=dtype_tol, atol=dtype_tol)
        if call["range"] is not None:  # dynamic compiles: the range says whether the pass ran
            assert ("multiples of" in call["range"]) == (seq % world_size == 0 and seq >= MIN), (seq, call)


def test_matches_eager_at_every_token_count(world):
    world_size, ranks = world
    for rank in ranks:
        _check_calls(rank["sp"], world_size)
        if "sp_bf16" in rank:
            _check_calls(rank["sp_bf16"], world_size, dtype_tol=0.05)


def test_the_pass_runs_only_on_multiples_of_the_world_size(world):
    world_size, ranks = world
    for rank in ranks:
        records = rank["sp"]["records"]
        # the first call compiles statically (8 tokens: rewritten); then one dynamic compile
        assert records[STATIC]["sequence_parallel"][:2] == ("ran", SITES)
        with_pass = f"tokens >= {MIN}, multiples of {world_size}"
        assert records[with_pass]["sequence_parallel"][:2] == ("ran", SITES)
        assert (
            "0 residual(s) sliced (first), 4 already sharded (middle), 1 without residual"
            in (records[with_pass]["sequence_parallel"][2][0])
        )
        without = [k for k in records if k not in (STATIC, with_pass)]
        assert without and all(records[k]["sequence_parallel"][0] == "skipped" for k in without)
    # every rank took the same decisions
    assert len({str(rank["sp"]["records"]) for rank in ranks}) == 1


@pytest.mark.slow
def test_through_inductor(inductor_world):
    """The rewritten graphs lowered by Inductor (static, and the symbolic specialization
    with its re-labelled gathers), run, match eager."""
    for rank in inductor_world:
        _check_calls(rank, 2)
        assert rank["records"][STATIC]["sequence_parallel"][:2] == ("ran", SITES)
        assert rank["records"]["tokens >= 8, multiples of 2"]["sequence_parallel"][:2] == ("ran", SITES)


@pytest.mark.parametrize("order", ["sp_then_arr", "arr_then_sp"])
def test_composes_with_allreduce_rmsnorm(order: str):
    """Both passes enabled with ranges that overlap at 8 tokens: there the configured order
    decides (the passes share their sites), the other is left out of that range with the
    reason, and the first call's static compile (4 tokens) runs the one whose range holds 4
    (fake world: reports only)."""
    first, second = ("sequence_parallel", "allreduce_rmsnorm")
    if order == "arr_then_sp":
        first, second = second, first
    passes = [SP, ARR] if order == "sp_then_arr" else [ARR, SP]
    with fake_world(2) as world:
        torch._dynamo.reset()
        model = shard_functional(TinyLlama(LlamaConfig()).eval(), world.group, 0, 2)
        # every range compiled at the first dynamic call, so that each has a report
        backend = passkit.backend(
            passes=passes, mode="eager", verify=True, on_error="raise", compile_at="upfront"
        )
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            for seq in (4, MIN):
                compiled(_ids(seq))
        records = _records(backend)
        reasons = {r.token_range: {rec.name: rec.reason for rec in r.records} for r in backend.reports}
    sp_range = "tokens >= 8, multiples of 2" if order == "sp_then_arr" else "tokens >= 9, multiples of 2"
    assert set(records) == {"tokens = 4 (static shapes)", "tokens 1..8", sp_range, "tokens >= 9"}
    assert records["tokens 1..8"]["allreduce_rmsnorm"][:2] == ("ran", SITES)
    assert records["tokens 1..8"]["sequence_parallel"][0] == "skipped"
    assert records[sp_range]["sequence_parallel"][:2] == ("ran", SITES)
    assert records[sp_range]["allreduce_rmsnorm"][0] == "skipped"
    assert all(rec[0] == "skipped" for rec in records["tokens >= 9"].values())
    # at 8 tokens (even) both apply: the first configured takes the sites
    overlap = sp_range if order == "sp_then_arr" else "tokens 1..8"
    assert f"its sites are taken by {first}, which runs first here" in reasons[overlap][second]
    # the first (static) compile at 4 tokens: only allreduce_rmsnorm's range holds 4
    assert records["tokens = 4 (static shapes)"]["allreduce_rmsnorm"][:2] == ("ran", SITES)
    assert reasons["tokens = 4 (static shapes)"]["sequence_parallel"] == (
        "static tokens 4 outside its range tokens >= 8, multiples of 2"
    )


ATP = {"name": "async_tp", "implementation": "test_mode", "min_tokens": MIN}


def _with_async_tp_rank(rank: int, world_size: int) -> dict[str, Any]:
    return _run(rank, world_size, [SP, ATP, "cleanup"], (MIN, 12, 10, 7, 4), "eager", torch.float32)


def test_with_async_tp_matches_eager_and_fuses_both_halves():
    """``sequence_parallel`` then ``async_tp`` (test mode: the fused ops compute with
    functional collectives, on gloo): eager's results at token counts inside the passes'
    range (8 static, then 12 and 10 in the dynamic specialization for multiples of 2) and
    outside (7, 4: compiled without them); in range, every column-parallel matmul is fused
    with its all-gather and every row-parallel one with its reduce-scatter."""
    ranks = gloo_world(_with_async_tp_rank, 2, timeout=300, env=NO_CACHES)
    for rank in ranks:
        _check_calls(rank, 2)
        records = rank["records"]
        for key in (STATIC, "tokens >= 8, multiples of 2"):  # static 8 tokens; symbolic T
            status, matches, notes = records[key]["async_tp"]
            assert (status, matches) == ("ran", 8), (key, notes)
            assert notes[0].startswith("4 all_gather -> matmul fused")
            assert notes[1].startswith("4 matmul -> reduce_scatter fused")
        # elsewhere (1..7; odd counts from 9: no sequence_parallel) nothing to fuse
        elsewhere = [rec for k, rec in records.items() if k != STATIC and "multiples" not in k]
        assert all(rec["async_tp"][1] == 0 for rec in elsewhere)
        assert {call["range"] for call in rank["calls"].values()} >= {"tokens >= 8, multiples of 2"}
        # one static and one dynamic compile (2 ranges: async_tp acts on sequence_parallel's
        # rewrite, so the odd counts compile with neither): no guard on T % 2, no recompile at 7
        assert rank["compiles"] == 3, records
    assert len({str(rank["records"]) for rank in ranks}) == 1


def _with_async_tp_inductor_rank(rank: int, world_size: int) -> dict[str, Any]:
    return _run(rank, world_size, [SP, ATP, "cleanup"], (MIN, 12, 9), "inductor", torch.float32)


@pytest.mark.slow
def test_with_async_tp_through_inductor():
    """The composed graphs (the fused ops, the re-labelling after them) lowered by Inductor,
    static and symbolic, run, match eager."""
    for rank in gloo_world(_with_async_tp_inductor_rank, 2, timeout=400, env=NO_CACHES):
        _check_calls(rank, 2)
        for key in (STATIC, "tokens >= 8, multiples of 2"):
            assert rank["records"][key]["async_tp"][:2] == ("ran", 8)
        assert rank["compiles"] == 3


# ------------------------------------------------------------------ ranks that disagree on it

AGREE_TIMEOUT_S = 3.0
GLOO_TIMEOUT_S = 10.0  # the plain all-reduce of a rank without the pass: bounded by its group


def _disagreeing_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Compiles of one model (passkit's eager mode), each on a fresh group: both ranks with
    the pass and one plan (it runs), with different plans, then the pass on rank 0 only. Each
    disagreement ends in a bounded RankAgreementError, never a reduce-scatter meeting an
    all-reduce (gloo: a size mismatch or a hang; NCCL: a hang)."""
    from agreement_scenario import compile_on_a_fresh_group

    def scenario(options: dict[str, Any] | None) -> dict[str, Any]:
        return compile_on_a_fresh_group(
            rank,
            world_size,
            {**SP, **options} if options is not None else None,
            _ids(MIN),
            agree_timeout_s=AGREE_TIMEOUT_S,
            group_timeout_s=GLOO_TIMEOUT_S,
            compare_eager=True,
        )

    mine = rank == 0
    return {
        "same_plan": scenario({}),
        "plans_differ": scenario({} if mine else {"restrict_tokens": False}),
        "one_rank": scenario({} if mine else None),
    }


@pytest.fixture(scope="module")
def disagreeing() -> list[dict[str, Any]]:
    return gloo_world(_disagreeing_rank, 2, timeout=300, env=NO_CACHES)


def test_ranks_with_one_plan_agree_and_run(disagreeing):
    for rank in disagreeing:
        assert rank["same_plan"]["type"] is None and rank["same_plan"]["matches_eager"], rank["same_plan"]


def test_ranks_with_different_plans_both_name_the_difference(disagreeing):
    for rank in disagreeing:
        outcome = rank["plans_differ"]
        assert outcome["type"] == "RankAgreementError", outcome
        assert "the ranks disagree at process group" in outcome["message"], outcome
        assert "step 'sequence_parallel:plan'" in outcome["message"], outcome
        assert "field 'restrict_tokens' differs" in outcome["message"], outcome
        assert outcome["ranks"] == [1] and outcome["seconds"] < AGREE_TIMEOUT_S + 30, outcome


def test_a_rank_without_the_pass_is_named_within_the_timeout(disagreeing):
    """Enabled on rank 0 only, rank 0's reduce-scatter met rank 1's all-reduce. Now rank 0
    waits at most collective_timeout_s for rank 1's plan, then names it; rank 1, which runs
    its plain all-reduce, ends at its group's timeout."""
    first, second = disagreeing[0]["one_rank"], disagreeing[1]["one_rank"]
    assert first["type"] == "RankAgreementError" and first["ranks"] == [1], first
    assert "step 'sequence_parallel:plan'" in first["message"], first
    assert f"did not answer within {AGREE_TIMEOUT_S:g} s" in first["message"], first
    assert first["seconds"] < AGREE_TIMEOUT_S + 30, first
    assert second["type"] is not None and second["seconds"] < GLOO_TIMEOUT_S + 60, second
