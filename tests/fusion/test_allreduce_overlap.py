"""``allreduce_overlap``: a row-parallel matmul and its all-reduce split into token chunks.

Graphs in a fake world (which sites it rewrites, which it leaves and why, the token range it
declares, the order of the chunks' ops with ``transport="nccl"``, one op per site with the
default ``"copy_engine"``), numerics in a 2-rank gloo world (passkit's eager mode, and once
through Inductor) against the eager model, composed with ``allreduce_rmsnorm`` below its
range. The copy-engine op's CUDA path runs in ``tests/gpu/test_allreduce_overlap_gpu.py``;
whether it pays is a GPU measurement (``benchmarks/hf_tp_profile.py --variants
overlap-graph``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from passkit_fusion.model import LlamaConfig, TinyLlama, shard_dtensor, shard_functional

import passkit
from passkit import TokenConstraint
from passkit_testing import assert_close, count_ops, fake_world, gloo_world, run_passes

ALL_REDUCE = "_c10d_functional.all_reduce.default"
MM = "aten.mm.default"
FUSED = "passkit_fusion.matmul_all_reduce.default"
FUSED_NORM = "passkit_fusion.matmul_all_reduce_rmsnorm.default"
AGREED = "passkit_fusion.agreed_all_reduce.default"
SITES = 4  # TinyLlama's two layers: attention's and the MLP's output projections
OVERLAP = {"name": "allreduce_overlap", "min_tokens": 1}
NO_CACHES = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}


def _traced(
    chunks: int, seq: int = 16, sharding: str = "dtensor", transport: str = "nccl", **options: Any
) -> Any:
    with fake_world(2) as world:
        model = TinyLlama(LlamaConfig()).to(torch.bfloat16)
        if sharding == "dtensor":
            shard_dtensor(model, world.mesh)
        else:
            shard_functional(model, world.group, 0, 2)
        passes = [{**OVERLAP, "chunks": chunks, "transport": transport, **options}]
        return run_passes(model, torch.randint(0, 256, (1, seq)), passes=passes)


@pytest.mark.parametrize("sharding", ["dtensor", "functional"])
def test_by_default_each_projection_with_its_residual_add_and_rmsnorm_becomes_one_op(sharding):
    """Every site of TinyLlama is ``mm -> all_reduce -> add residual -> RMSNorm`` (the last
    one the final norm): each becomes ``matmul_all_reduce_rmsnorm``, whose outputs replace
    the norm's and the residual sum's; nothing of the old chain is left."""
    result = _traced(4, sharding=sharding, transport="copy_engine")
    before, after = result.graph_before, result.graph_after
    embedding = count_ops(before, ALL_REDUCE) - SITES
    assert count_ops(after, ALL_REDUCE) == embedding
    assert (count_ops(after, FUSED_NORM), count_ops(after, FUSED)) == (SITES, 0)
    assert count_ops(after, MM) == count_ops(before, MM) - SITES
    assert count_ops(after, "aten.rsqrt.default") == count_ops(before, "aten.rsqrt.default") - SITES
    ops = [n for n in after.graph.nodes if str(n.target) == FUSED_NORM]
    group = next(n for n in before.graph.nodes if str(n.target) == ALL_REDUCE).args[2]
    # (a, b, residual, weight, eps, weight_bias, group, chunks, lanes, max_tokens, timeout_s)
    assert {n.args[4:] for n in ops} == {(1e-6, 0.0, group, 4, 1, 0, 180.0)}
    for n in ops:
        norm_out, residual_out = n.meta["val"]
        residual = n.args[2].meta["val"]
        assert norm_out.shape == residual_out.shape == residual.shape
        assert residual.numel() == n.args[0].meta["val"].shape[0] * n.args[1].meta["val"].shape[1]
    record = result.report["allreduce_overlap"]
    assert (record.status, record.matches) == ("ran", SITES)
    assert record.notes[0].startswith(
        f"{SITES} matmul + all-reduce + residual add + RMSNorm site(s) into 4 token chunks"
    )
    assert record.notes[0].endswith("-> norm")  # the final norm is one of them
    from passkit_fusion.allreduce_overlap import AllReduceOverlapOptions

    assert AllReduceOverlapOptions().transport == "copy_engine"


@pytest.mark.parametrize("sharding", ["dtensor", "functional"])
def test_without_fuse_norm_each_output_projection_becomes_one_copy_engine_op(sharding):
    result = _traced(4, sharding=sharding, transport="copy_engine", fuse_norm=False)
    before, after = result.graph_before, result.graph_after
    embedding = count_ops(before, ALL_REDUCE) - SITES
    assert count_ops(after, ALL_REDUCE) == embedding
    assert (count_ops(after, FUSED), count_ops(after, FUSED_NORM)) == (SITES, 0)
    assert count_ops(after, MM) == count_ops(before, MM) - SITES
    ops = [n for n in after.graph.nodes if n.target is torch.ops.passkit_fusion.matmul_all_reduce.default]
    group = next(n for n in before.graph.nodes if str(n.target) == ALL_REDUCE).args[2]
    # (a, b, group, chunks, lanes, max_tokens, timeout_s): the runtime's settings fixed in the graph
    assert {n.args[2:] for n in ops} == {(group, 4, 1, 0, 180.0)}
    assert all(
        n.meta["val"].shape == n.args[0].meta["val"].shape[:1] + n.args[1].meta["val"].shape[1:] for n in ops
    )
    record = result.report["allreduce_overlap"]
    assert (record.status, record.matches) == ("ran", SITES)
    assert record.notes[0].startswith(
        f"{SITES} matmul + all-reduce site(s) split into 4 token chunks (one copy-engine op each)"
    )


@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("sharding", ["dtensor", "functional"])
def test_with_nccl_each_output_projection_is_split_into_chunks(chunks, sharding):
    result = _traced(chunks, sharding=sharding)
    before, after = result.graph_before, result.graph_after
    embedding = count_ops(before, ALL_REDUCE) - SITES  # the vocab-parallel embedding's sum
    # each site's first chunk through the all-reduce that checks the ranks' plans first
    assert count_ops(after, ALL_REDUCE) == embedding + SITES * (chunks - 1)
    assert count_ops(after, AGREED) == SITES
    assert count_ops(after, MM) == count_ops(before, MM) + SITES * (chunks - 1)
    assert count_ops(after, "aten.cat.default") == count_ops(before, "aten.cat.default") + SITES
    record = result.report["allreduce_overlap"]
    assert (record.status, record.matches) == ("ran", SITES)
    assert record.notes[0].startswith(
        f"{SITES} matmul + all-reduce site(s) split into {chunks} token chunks (NCCL"
    )
    if embedding:
        assert "its input is not a matmul's output" in record.notes[1]


def test_each_chunks_all_reduce_is_issued_before_the_next_chunks_matmul_and_waited_late():
    """The order that lets chunk i's all-reduce run during chunk i+1's matmul: per site
    mm, all_reduce, mm, all_reduce, then the waits (none between the chunks)."""
    graph = _traced(2).graph_after.graph
    ops = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    split = [i for i, op in enumerate(ops) if op in (ALL_REDUCE, AGREED)]
    for first, second in zip(split[1::2], split[2::2]):  # after the embedding's: chunk pairs
        assert ops[first] == AGREED and ops[second] == ALL_REDUCE
        between = ops[first:second]
        assert MM in between and "_c10d_functional.wait_tensor.default" not in between, between


def test_the_token_range_starts_at_min_tokens_in_multiples_of_the_chunks_with_nccl():
    from passkit_fusion.allreduce_overlap import AllReduceOverlap

    p = AllReduceOverlap(chunks=4, min_tokens=1024, max_tokens=8192, transport="nccl")
    assert p.token_constraint(None) == TokenConstraint(min_tokens=1024, max_tokens=8192, multiple_of=4)
    # the copy-engine op cuts any count itself: no multiple, no constraint when unrestricted
    p = AllReduceOverlap(chunks=4, min_tokens=1024, max_tokens=8192)
    assert p.token_constraint(None) == TokenConstraint(min_tokens=1024, max_tokens=8192)
    assert AllReduceOverlap(chunks=4, restrict_tokens=False).token_constraint(None) is None
    assert AllReduceOverlap(chunks=4, restrict_tokens=False, transport="nccl").token_constraint(
        None
    ) == TokenConstraint(multiple_of=4)
    with pytest.raises(ValueError, match="max_tokens=8 is below min_tokens=16"):
        AllReduceOverlap(min_tokens=16, max_tokens=8)
    with pytest.raises(ValueError):
        AllReduceOverlap(chunks=1)
    with pytest.raises(ValueError, match="transport"):
        AllReduceOverlap(transport="nvshmem")


def test_chunk_bounds_cover_every_row_once():
    from passkit_fusion.allreduce_overlap.runtime import chunk_bounds

    assert chunk_bounds(10, 4) == [(0, 2), (2, 4), (4, 6), (6, 10)]
    assert chunk_bounds(3, 4) == [(0, 1), (1, 2), (2, 3)]
    assert chunk_bounds(1, 2) == [(0, 1)]
    assert chunk_bounds(0, 2) == []
    for rows in range(1, 40):
        for k in (2, 3, 4, 8):
            bounds = chunk_bounds(rows, k)
            assert [r for lo, hi in bounds for r in range(lo, hi)] == list(range(rows))


def test_a_matmul_read_elsewhere_is_left_with_its_reason():
    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c10d = torch.ops._c10d_functional
        y = x @ w
        return c10d.wait_tensor(c10d.all_reduce(y, "sum", dist.group.WORLD.group_name)), y * 2

    with fake_world(2):
        result = run_passes(fn, torch.randn(8, 16), torch.randn(16, 16), passes=[OVERLAP])
    assert count_ops(result.graph_after, FUSED) == 0
    record = result.report["allreduce_overlap"]
    assert (record.status, record.matches) == ("ran", 0)
    assert "the matmul's output is also read elsewhere" in "; ".join(record.notes)


# -- numerics in a 2-rank gloo world --------------------------------------------------------


def _run(rank: int, world_size: int, mode: str, transport: str) -> dict[str, Any]:
    """``transport``: the pass's, or ``copy_engine_plain`` (copy engine, ``fuse_norm=False``)."""
    from passkit_fusion.allreduce_overlap import runtime

    torch._dynamo.reset()
    runtime.reset_stats()
    model = TinyLlama(LlamaConfig(kv_heads=4)).float().eval()
    shard_functional(model, dist.group.WORLD, rank, world_size)
    passes = [
        {
            "name": "allreduce_overlap",
            "min_tokens": 8,
            "chunks": 2,
            "transport": transport.removesuffix("_plain"),
            "fuse_norm": not transport.endswith("_plain"),
        },
        {"name": "allreduce_rmsnorm", "implementation": "reference"},
        "cleanup",
    ]
    backend = passkit.backend(passes=passes, mode=mode, verify=True, on_error="raise")
    compiled = torch.compile(model, backend=backend)
    calls = {}
    with torch.no_grad():
        for seq in (8, 12, 9, 4):
            ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
            calls[seq] = (compiled(ids), model(ids))
    records = {
        r.token_range: {rec.name: (rec.status, rec.matches) for rec in r.records} for r in backend.reports
    }
    return {"calls": calls, "records": records, "stats": runtime.stats()}


def _eager_rank(rank: int, world_size: int, transport: str) -> dict[str, Any]:
    return _run(rank, world_size, "eager", transport)


def _inductor_rank(rank: int, world_size: int, transport: str) -> dict[str, Any]:
    return _run(rank, world_size, "inductor", transport)


@pytest.fixture(scope="module", params=["nccl", "copy_engine", "copy_engine_plain"])
def eager_world(request) -> list[dict[str, Any]]:
    ranks = gloo_world(_eager_rank, 2, args=(request.param,), timeout=400, env=NO_CACHES)
    return [{**rank, "transport": request.param} for rank in ranks]


def test_matches_eager_at_every_token_count_in_a_gloo_world(eager_world):
    for rank in eager_world:
        for got, want in rank["calls"].values():
            assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_overlap_takes_its_range_and_allreduce_rmsnorm_the_rest(eager_world):
    records = eager_world[0]["records"]
    # the first call (8 tokens) compiles statically: the overlap pass, first in the pipeline, takes the sites
    static = "tokens = 8 (static shapes)"
    assert records[static]["allreduce_overlap"] == ("ran", SITES)
    assert records[static]["allreduce_rmsnorm"][0] == "skipped"
    ranged = {k: v for k, v in records.items() if k != static}
    mine = "multiples of 2" if eager_world[0]["transport"] == "nccl" else ">= 8"
    overlap = [v for k, v in ranged.items() if mine in k]
    assert overlap and all(v["allreduce_overlap"] == ("ran", SITES) for v in overlap), ranged
    rest = [v for k, v in ranged.items() if mine not in k]
    assert rest and all(v["allreduce_rmsnorm"][0] == "ran" and v["allreduce_rmsnorm"][1] > 0 for v in rest), (
        ranged
    )
    assert len({str(rank["records"]) for rank in eager_world}) == 1


def test_off_cuda_the_copy_engine_op_runs_its_functional_all_reduce_and_says_so(eager_world):
    stats = eager_world[0]["stats"]
    if eager_world[0]["transport"] == "nccl":
        assert stats == {}
    else:  # calls at 8, 12 tokens (4 sites each, first compile + its range); never silently
        assert stats["fallback"] == stats["fallback:not_cuda"] > 0 and "copy_engine" not in stats


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["nccl", "copy_engine"])
def test_through_inductor_in_a_gloo_world(transport):
    ranks = gloo_world(_inductor_rank, 2, args=(transport,), timeout=600, env=NO_CACHES)
    for rank in ranks:
        for got, want in rank["calls"].values():
            assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_norm_site_the_norm_op_cannot_take_goes_to_the_plain_op_with_its_reason():
    """A constant scale between the all-reduce and the residual add (``AR(x @ w) * 0.5 +
    r`` then an RMSNorm): the norm op would have to apply it to every partial, so the site
    takes ``matmul_all_reduce`` and the graph keeps its own scale, add and norm."""

    def fn(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c10d = torch.ops._c10d_functional
        h = c10d.wait_tensor(c10d.all_reduce(x @ w, "sum", dist.group.WORLD.group_name)) * 0.5 + r
        hs = h.float()
        return g * (hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype), h

    bf16 = torch.bfloat16
    args = (
        torch.randn(8, 16).to(bf16),
        torch.randn(16, 32).to(bf16),
        torch.randn(8, 32).to(bf16),
        torch.ones(32).to(bf16),
    )
    with fake_world(2):
        result = run_passes(fn, *args, passes=[OVERLAP])
    assert (count_ops(result.graph_after, FUSED), count_ops(result.graph_after, FUSED_NORM)) == (1, 0)
    assert count_ops(result.graph_after, "aten.rsqrt.default") == 1
    notes = "; ".join(result.report["allreduce_overlap"].notes)
    assert "norm sites left to the plain rewrite" in notes and "a scale between the all-reduce" in notes, (
        notes
    )


# ------------------------------------------------------------------ ranks that disagree on it

AGREE_TIMEOUT_S = 5.0
GLOO_TIMEOUT_S = 30.0  # the plain all-reduce of a rank without the pass: bounded by its group


def _disagreeing_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Three compiles of one model (passkit's eager mode), each on a fresh group: the pass
    on rank 0 only ("nccl", then "copy_engine"), then on both with different chunks. Each
    ends in a bounded error naming what differs, never a size-mismatched all-reduce."""
    from agreement_scenario import compile_on_a_fresh_group

    def scenario(options: dict[str, Any] | None) -> dict[str, Any]:
        return compile_on_a_fresh_group(
            rank,
            world_size,
            {**OVERLAP, **options} if options else None,
            torch.randint(0, 256, (1, 8)),
            agree_timeout_s=AGREE_TIMEOUT_S,
            group_timeout_s=GLOO_TIMEOUT_S,
            compare_eager=False,
        )

    mine = rank == 0
    return {
        "nccl_one_rank": scenario({"transport": "nccl"} if mine else None),
        "copy_engine_one_rank": scenario({"transport": "copy_engine"} if mine else None),
        "chunks_differ": scenario({"transport": "nccl", "chunks": 2 if mine else 4}),
    }


@pytest.fixture(scope="module")
def disagreeing() -> list[dict[str, Any]]:
    return gloo_world(_disagreeing_rank, 2, timeout=400, env=NO_CACHES)


@pytest.mark.parametrize("scenario", ["nccl_one_rank", "copy_engine_one_rank"])
def test_a_rank_without_the_pass_is_named_within_the_timeout(disagreeing, scenario):
    """Enabled on rank 0 only, rank 0 aborted at the first call (gloo: "Received data size
    doesn't match expected size"; NCCL: a hang or wrong sums). Now rank 0 waits at most
    collective_timeout_s for rank 1's plan, then names it; rank 1, which runs its plain
    all-reduce, ends at its group's timeout."""
    first, second = disagreeing[0][scenario], disagreeing[1][scenario]
    assert first["type"] == "RankAgreementError" and first["ranks"] == [1], first
    assert "step 'allreduce_overlap:plan'" in first["message"], first
    assert "did not answer within 5 s" in first["message"], first
    assert first["seconds"] < AGREE_TIMEOUT_S + 30, first
    assert second["type"] is not None and second["seconds"] < GLOO_TIMEOUT_S + 60, second


def test_ranks_splitting_into_different_chunks_both_name_the_difference(disagreeing):
    for rank in disagreeing:
        outcome = rank["chunks_differ"]
        assert outcome["type"] == "RankAgreementError", outcome
        assert "the ranks disagree at process group" in outcome["message"], outcome
        assert "chunks" in outcome["message"], outcome
        assert outcome["seconds"] < 60, outcome


@pytest.mark.parametrize("pass_name", ["allreduce_overlap", "async_tp"])
@pytest.mark.parametrize(
    ("value", "words"),
    [
        (1e999, "Input should be a finite number"),
        (float("nan"), "Input should be a finite number"),
        (0, "Input should be greater than 0"),
        (1e9, "Input should be less than or equal to 86400"),
    ],
)
def test_a_collective_timeout_that_never_ends_is_refused(pass_name, value, words):
    """``collective_timeout_s = 1e999`` (infinity) was accepted: a wait without an end."""
    with pytest.raises(passkit.ConfigError) as raised:
        passkit.build_pipeline(passes=[{"name": pass_name, "collective_timeout_s": value}])
    assert f"passes.{pass_name}.collective_timeout_s: {words}" in str(raised.value)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0, 1e9])
def test_the_runtime_and_the_agreement_refuse_a_timeout_that_never_ends(value):
    from passkit_fusion.allreduce_rmsnorm import runtime
    from passkit_fusion.collective import check_timeout

    with pytest.raises(ValueError, match="collective_timeout_s: "):
        runtime.configure(collective_timeout_s=value)
    with pytest.raises(ValueError, match="timeout_s: "):
        check_timeout("timeout_s", value)
    assert check_timeout("timeout_s", 180) == 180.0


def test_a_collective_timeout_variable_that_never_ends_is_refused_by_name():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "import passkit_fusion.collective"],
        env={**__import__("os").environ, "PASSKIT_FUSION_COLLECTIVE_TIMEOUT": "inf"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    assert (
        "environment variable PASSKIT_FUSION_COLLECTIVE_TIMEOUT='inf': PASSKIT_FUSION_COLLECTIVE_TIMEOUT: inf is "
        "not a finite number of seconds" in out.stderr
    ), out.stderr[-2000:]
