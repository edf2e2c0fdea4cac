"""Measured fuse decisions on 2 GPUs (NCCL, CUDA-graph replay timing): every rank takes
and stores the same decision, and a later compile uses it. Skipped without 2 GPUs.

The numbers are not checked (the benchmark, benchmarks/tuned_e2e.py, compares them):
this checks the plumbing on the real timer, NCCL and the passes' CUDA implementations."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from passkit_testing import nccl_world, requires_gpus

pytestmark = [pytest.mark.gpu, requires_gpus(2)]

TOKENS = [1, 16, 256]


def _tune_and_compile(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from passkit_fusion.model import LlamaConfig, TinyLlama, shard_functional
    from passkit_fusion.tuning import decisions, measure

    import passkit
    from passkit import compiling

    cfg = LlamaConfig(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512)
    model = TinyLlama(cfg).to("cuda", torch.bfloat16).eval()
    model = shard_functional(model, dist.group.WORLD, rank, world_size)

    def inputs(t: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, cfg.vocab, (1, t), generator=torch.Generator().manual_seed(t)).cuda(),)

    def mark(args) -> None:
        torch._dynamo.mark_dynamic(args[0], 1)

    passes = [{"name": "sequence_parallel"}, {"name": "async_tp"}, {"name": "allreduce_rmsnorm"}]
    result = measure.tune_model(
        model, inputs, passes, token_counts=TOKENS, budget_s=240, mark_dynamic=mark, progress=rank == 0
    )
    decisions._measured.clear()  # as in a new process: from the file
    torch._dynamo.reset()
    backend = passkit.backend(passes=passes)
    compiled = torch.compile(model, backend=compiling.scoped(backend))
    args = inputs(16)
    mark(args)
    with torch.no_grad():
        out = compiled(*args).float()
        ref = model(*args).float()
    return {
        "ranges": [(r.lo, r.hi, r.passes) for r in result.decision.ranges],
        "medians": {t: {decisions.label(c): v for c, v in m.items()} for t, m in result.medians_us.items()},
        "unmeasured": result.unmeasured,
        "device": result.decision.key.device,
        "gpu": torch.cuda.get_device_name(),
        "file": result.paths[0].exists(),
        "notes": [
            note
            for r in backend.reports
            for rec in r.records
            for note in rec.notes + ([rec.reason] if rec.reason else [])
            if "decision" in note
        ],
        "decisions": {rec.decision for r in backend.reports for rec in r.records if rec.decision},
        "rel_diff": ((out - ref).norm() / ref.norm()).item(),
    }


def test_two_gpus_tune_store_and_use_the_same_decision(tmp_path):
    ranks = nccl_world(_tune_and_compile, 2, timeout=900, env={"PASSKIT_CACHE_DIR": str(tmp_path)})
    assert ranks[0]["ranges"] == ranks[1]["ranges"]
    assert ranks[0]["medians"] == ranks[1]["medians"]  # the slowest rank's, agreed
    for rank in ranks:
        assert rank["file"] and rank["device"] == rank["gpu"]
        assert rank["unmeasured"] == [], rank["unmeasured"]
        assert all(m["inductor"] > 0 for m in rank["medians"].values())
        assert set(rank["medians"]) == set(TOKENS)
        assert any(
            n.startswith("fuse decision: stored (") or "(stored decision)" in n for n in rank["notes"]
        ), rank
        assert rank["decisions"] == {"stored"}, rank  # every record of the three passes, ran or skipped
        assert rank["rel_diff"] < 0.05
