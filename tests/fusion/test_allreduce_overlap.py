"""``allreduce_overlap``: a row-parallel matmul and its all-reduce split into token chunks.

Graphs in a fake world (which sites it splits, which it leaves and why, the token range it
declares, the order of the chunks' ops), numerics in a 2-rank gloo world (passkit's eager
mode, and once through Inductor) against the eager model, composed with
``allreduce_rmsnorm`` below its range. Whether it pays is a GPU measurement
(``benchmarks/hf_tp_profile.py --variants overlap-graph``)."""

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
SITES = 4  # TinyLlama's two layers: attention's and the MLP's output projections
OVERLAP = {"name": "allreduce_overlap", "min_tokens": 1}
NO_CACHES = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}


def _traced(chunks: int, seq: int = 16, sharding: str = "dtensor") -> Any:
    with fake_world(2) as world:
        model = TinyLlama(LlamaConfig()).to(torch.bfloat16)
        if sharding == "dtensor":
            shard_dtensor(model, world.mesh)
        else:
            shard_functional(model, world.group, 0, 2)
        return run_passes(model, torch.randint(0, 256, (1, seq)), passes=[{**OVERLAP, "chunks": chunks}])


@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("sharding", ["dtensor", "functional"])
def test_each_output_projection_is_split_into_chunks(chunks, sharding):
    result = _traced(chunks, sharding=sharding)
    before, after = result.graph_before, result.graph_after
    embedding = count_ops(before, ALL_REDUCE) - SITES  # the vocab-parallel embedding's sum
    assert count_ops(after, ALL_REDUCE) == embedding + SITES * chunks
    assert count_ops(after, MM) == count_ops(before, MM) + SITES * (chunks - 1)
    assert count_ops(after, "aten.cat.default") == count_ops(before, "aten.cat.default") + SITES
    record = result.report["allreduce_overlap"]
    assert (record.status, record.matches) == ("ran", SITES)
    assert record.notes[0].startswith(f"{SITES} matmul + all-reduce site(s) split into {chunks} token chunks")
    if embedding:
        assert "its input is not a matmul's output" in record.notes[1]


def test_each_chunks_all_reduce_is_issued_before_the_next_chunks_matmul_and_waited_late():
    """The order that lets chunk i's all-reduce run during chunk i+1's matmul: per site
    mm, all_reduce, mm, all_reduce, then the waits (none between the chunks)."""
    graph = _traced(2).graph_after.graph
    ops = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    split = [i for i, op in enumerate(ops) if op == ALL_REDUCE]
    for first, second in zip(split[1::2], split[2::2]):  # after the embedding's: chunk pairs
        between = ops[first:second]
        assert MM in between and "_c10d_functional.wait_tensor.default" not in between, between


def test_the_token_range_is_multiples_of_the_chunks_from_min_tokens():
    from passkit_fusion.allreduce_overlap import AllReduceOverlap

    p = AllReduceOverlap(chunks=4, min_tokens=1024, max_tokens=8192)
    assert p.token_constraint(None) == TokenConstraint(min_tokens=1024, max_tokens=8192, multiple_of=4)
    with pytest.raises(ValueError, match="max_tokens=8 is below min_tokens=16"):
        AllReduceOverlap(min_tokens=16, max_tokens=8)
    with pytest.raises(ValueError):
        AllReduceOverlap(chunks=1)


def test_a_matmul_read_elsewhere_is_left_with_its_reason():
    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c10d = torch.ops._c10d_functional
        y = x @ w
        return c10d.wait_tensor(c10d.all_reduce(y, "sum", dist.group.WORLD.group_name)), y * 2

    with fake_world(2):
        result = run_passes(fn, torch.randn(8, 16), torch.randn(16, 16), passes=[OVERLAP])
    record = result.report["allreduce_overlap"]
    assert (record.status, record.matches) == ("ran", 0)
    assert "the matmul's output is also read elsewhere" in "; ".join(record.notes)


# -- numerics in a 2-rank gloo world --------------------------------------------------------


def _run(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    torch._dynamo.reset()
    model = TinyLlama(LlamaConfig(kv_heads=4)).float().eval()
    shard_functional(model, dist.group.WORLD, rank, world_size)
    passes = [
        {"name": "allreduce_overlap", "min_tokens": 8, "chunks": 2},
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
    return {"calls": calls, "records": records}


def _eager_rank(rank: int, world_size: int) -> dict[str, Any]:
    return _run(rank, world_size, "eager")


def _inductor_rank(rank: int, world_size: int) -> dict[str, Any]:
    return _run(rank, world_size, "inductor")


@pytest.fixture(scope="module")
def eager_world() -> list[dict[str, Any]]:
    return gloo_world(_eager_rank, 2, timeout=400, env=NO_CACHES)


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
    overlap = [v for k, v in ranged.items() if "multiples of 2" in k]
    assert overlap and all(v["allreduce_overlap"] == ("ran", SITES) for v in overlap), ranged
    rest = [v for k, v in ranged.items() if "multiples of 2" not in k]
    assert rest and all(v["allreduce_rmsnorm"][0] == "ran" and v["allreduce_rmsnorm"][1] > 0 for v in rest), (
        ranged
    )
    assert len({str(rank["records"]) for rank in eager_world}) == 1


@pytest.mark.slow
def test_through_inductor_in_a_gloo_world():
    ranks = gloo_world(_inductor_rank, 2, timeout=600, env=NO_CACHES)
    for rank in ranks:
        for got, want in rank["calls"].values():
            assert_close(got, want, rtol=1e-4, atol=1e-4)
