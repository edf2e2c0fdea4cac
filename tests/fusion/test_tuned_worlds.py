"""Measured fuse decisions in real gloo worlds: the ranks time differently (an injected
timer), agree on the slowest rank's medians, and all take and store the same decision;
a later compile on every rank uses it. Every rank compiles each candidate (eager mode):
5-15 s per world on an idle 2-core machine (several times that on a loaded one); the 4-rank
Llama world and the command are slow-marked."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.distributed as dist
from passkit_fusion.model import LlamaConfig, TinyLlama, shard_functional
from passkit_fusion.tuning import decisions, measure

import passkit
from passkit_testing import gloo_world

AR = ("allreduce_rmsnorm",)
PASSES = [{"name": "allreduce_rmsnorm", "implementation": "reference"}, "cleanup"]


def rank_timer(step, trial: measure.Trial) -> float:
    """Inductor 10 us per token everywhere; allreduce_rmsnorm half that up to 4 tokens on
    every rank, and at 16 tokens faster on rank 0 only (slower on the others): rank 0 alone
    would fuse at 16 tokens, the agreed (slowest rank's) medians do not."""
    step()
    base = 10.0 * trial.tokens * (1 + 0.01 * trial.rank)
    if trial.candidate != AR:
        return base
    if trial.tokens <= 4:
        return base * 0.5
    return base * (0.8 if trial.rank == 0 else 1.1 + 0.1 * trial.rank)


def _tune(rank: int, world_size: int) -> dict[str, Any]:
    cfg = LlamaConfig(layers=1, kv_heads=4)
    model = shard_functional(TinyLlama(cfg).eval(), dist.group.WORLD, rank, world_size)

    def inputs(t: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, cfg.vocab, (1, t), generator=torch.Generator().manual_seed(t)),)

    def mark(args) -> None:
        torch._dynamo.mark_dynamic(args[0], 1)

    result = measure.tune_model(
        model, inputs, PASSES, token_counts=[2, 4, 16], timer=rank_timer, mark_dynamic=mark, mode="eager",
        progress=False,
    )  # fmt: skip
    out: dict[str, Any] = {
        "summary": result.decision.summary(),
        "medians": {t: {decisions.label(c): v for c, v in m.items()} for t, m in result.medians_us.items()},
        "paths": [str(p) for p in result.paths],
        "file": result.paths[0].read_text(),
    }
    if world_size == 2:  # a later compile on every rank, from the stored file
        decisions._measured.clear()
        torch._dynamo.reset()
        backend = passkit.backend(passes=PASSES, mode="eager", compile_at="upfront")  # every range's report
        fn = torch.compile(model, backend=backend)
        args = inputs(8)
        mark(args)
        with torch.no_grad():
            fn(*args)
        out["ranges"] = {
            r.token_range: (r["allreduce_rmsnorm"].status, r["allreduce_rmsnorm"].matches)
            for r in backend.reports
        }
        out["note"] = backend.reports[0]["allreduce_rmsnorm"].notes[-1]
        out["decisions"] = {r.token_range: r["allreduce_rmsnorm"].decision for r in backend.reports}
    return out


def _tune_small(rank: int, world_size: int) -> dict[str, Any]:
    """The same agreement on a model without collectives (a quick compile)."""

    def model(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x * 2, (x.shape[-1],))

    result = measure.tune_model(
        model, lambda t: (torch.randn(t, 8),), PASSES, token_counts=[2, 4, 16], timer=rank_timer,
        mode="eager", progress=False,
    )  # fmt: skip
    return {
        "summary": result.decision.summary(),
        "medians": {t: {decisions.label(c): v for c, v in m.items()} for t, m in result.medians_us.items()},
        "paths": [str(p) for p in result.paths],
        "file": result.paths[0].read_text(),
    }


def _check(results: list[dict[str, Any]], world_size: int) -> None:
    slowest = 1 + 0.01 * (world_size - 1)
    for r in results:
        assert r["summary"] == "tokens 1..4: allreduce_rmsnorm; tokens >= 5: inductor"
        assert r["medians"][16] == pytest.approx(
            {"inductor": 160 * slowest, "allreduce_rmsnorm": 160 * slowest * (1.1 + 0.1 * (world_size - 1))}
        )
        assert r["medians"][2] == pytest.approx({"inductor": 20 * slowest, "allreduce_rmsnorm": 10 * slowest})
    # the sharded model's graphs differ per rank (its rank-dependent embedding offsets), so
    # do the files' keys; their ranges, medians and everything else are the same
    files = [json.loads(r["file"]) for r in results]
    for f in files:
        f["key"].pop("graph")
    assert all(f == files[0] for f in files)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_timing_differently_agree_on_the_slowest_ranks_medians(tmp_path, world_size):
    results = gloo_world(_tune_small, world_size, timeout=300, env={"PASSKIT_CACHE_DIR": str(tmp_path)})
    _check(results, world_size)
    assert len({r["file"] for r in results}) == 1  # one graph: the very same file on every rank
    (path,) = {tuple(r["paths"]) for r in results}
    assert [p.name for p in tmp_path.joinpath("fusion-decisions").iterdir()] == [path[0].split("/")[-1]]


def test_two_ranks_timing_differently_take_the_same_decision_and_use_it(tmp_path):
    results = gloo_world(_tune, 2, timeout=300, env={"PASSKIT_CACHE_DIR": str(tmp_path)})
    _check(results, 2)
    for r in results:
        assert r["ranges"] == {"tokens 1..4": ("ran", 3), "tokens >= 5": ("skipped", 0)}
        assert r["note"].startswith("fuse decision: stored (")
        assert r["decisions"] == {"tokens 1..4": "stored", "tokens >= 5": "stored"}  # ran, skipped


@pytest.mark.slow
def test_four_ranks_timing_differently_take_the_same_decision(tmp_path):
    results = gloo_world(_tune, 4, timeout=600, env={"PASSKIT_CACHE_DIR": str(tmp_path)})
    _check(results, 4)


@pytest.mark.slow
def test_the_tune_model_command_runs_gloo_ranks_and_stores_the_decision(tmp_path):
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable, "-c", "import sys; from passkit.cli import main; sys.exit(main())",
            "tune-model", "passkit_fusion.model:tuning_target", "--cpu", "--world-size", "2",
            "--tokens", "2", "16", "--mode", "eager", "--candidates", "allreduce_rmsnorm", "--budget", "300",
        ],
        env={**os.environ, "PASSKIT_CACHE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| tokens | inductor | allreduce_rmsnorm | decision |" in out.stdout
    # the sharded model's graph differs per rank (embedding offsets): one file per rank's
    # graph, the same decision in both; rank 0 says where it wrote its own
    files = sorted(tmp_path.joinpath("fusion-decisions").iterdir())
    assert len(files) == 2
    assert sum(f"passkit tune: wrote {f}" in out.stderr for f in files) == 1
    stored = files[0]
    assert decisions.load(files[1]).ranges == decisions.load(stored).ranges
    assert "passkit tune [  1/6]" in out.stderr  # the progress lines, rank 0 only
    assert out.stderr.count("compiled inductor in") == 1
    decision = decisions.load(stored)
    assert decision.key.world_size == 2 and decision.key.device == "cpu"
    assert [p["name"] for p in decision.key.passes] == [
        "sequence_parallel", "async_tp", "allreduce_rmsnorm", "cleanup",
    ]  # fmt: skip
