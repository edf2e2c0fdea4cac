"""``allreduce_rmsnorm`` end to end through Inductor, in 2-rank gloo worlds.

The Llama-style model, sharded with functional collectives and with DTensor, is compiled
with ``torch.compile(backend="passkit")``, the pass enabled by name in a config file (as a
user would). Checks: every site fused (report), the generated code calls the fused op once
per site, the output matches eager. Then fresh processes compile the same model again and
hit Inductor's cache: the pass does not run, yet the cached code finds the op and computes
the same output.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from passkit_fusion.model import LlamaConfig, TinyLlama, shard_dtensor, shard_functional

import passkit
from passkit_fusion import reference
from passkit_testing import assert_close, assert_no_worse_than, gloo_world

CONFIG = """
passes = [{ name = "allreduce_rmsnorm", implementation = "reference" }, "cleanup"]
verify = true
on_error = "raise"
"""
SITES = LlamaConfig().sites()


def _count_op_calls() -> list[int]:
    """Count calls of the fused op's reference implementation from now on."""
    calls = [0]
    original = reference.allreduce_rmsnorm

    @functools.wraps(original)
    def counted(*args: Any) -> Any:
        calls[0] += 1
        return original(*args)

    reference.allreduce_rmsnorm = counted
    return calls


def _model(sharding: str, dtype: torch.dtype, rank: int, world_size: int) -> TinyLlama:
    model = TinyLlama(LlamaConfig()).to(dtype).eval()
    if sharding == "functional":
        return shard_functional(model, dist.group.WORLD, rank, world_size)
    from torch.distributed.device_mesh import init_device_mesh

    return shard_dtensor(model, init_device_mesh("cpu", (world_size,)))


def _compile_and_run(rank: int, world_size: int, shardings: tuple[str, ...]) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    ids = torch.randint(0, LlamaConfig().vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    calls = _count_op_calls()
    out: dict[str, Any] = {
        "ops_defined_before_compile": "passkit_fusion.allreduce_rmsnorm.ops" in sys.modules
    }
    with torch.no_grad():
        for sharding in shardings:
            torch._dynamo.reset()
            counters.clear()
            model = _model(sharding, torch.bfloat16, rank, world_size)
            before = len(passkit._pipeline.run.RECENT_REPORTS)
            calls[0] = 0
            compiled = torch.compile(model, backend="passkit")(ids)
            reports = list(passkit._pipeline.run.RECENT_REPORTS)[before:]
            out[sharding] = {
                "compiled": compiled,
                "eager": model(ids),
                "fp32": _model(sharding, torch.float32, rank, world_size)(ids),
                "op_calls": calls[0],
                "records": [r["allreduce_rmsnorm"] for r in reports if not r.cache_hit],
                "cache_hit_reports": sum(r.cache_hit for r in reports),
                "cache_hits": counters["inductor"]["fxgraph_cache_hit"]
                + counters["aot_autograd"]["autograd_cache_hit"],
            }
    return out


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The first world compiles (into a fresh Inductor cache); the second, fresh processes,
    compiles the functionally sharded model again from that cache."""
    folder = tmp_path_factory.mktemp("fusion_compile")
    config = folder / "passkit.toml"
    config.write_text(CONFIG)
    env = {"PASSKIT_CONFIG": str(config), "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")}
    first = gloo_world(_compile_and_run, 2, args=(("functional", "dtensor"),), timeout=400, env=env)
    again = gloo_world(_compile_and_run, 2, args=(("functional",),), timeout=300, env=env)
    return first, again


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["functional", "dtensor"])
def test_inductor_fuses_every_site_and_matches_eager(worlds, sharding: str):
    first, _ = worlds
    for rank in first:
        result = rank[sharding]
        (record,) = result["records"]
        assert (record.status, record.matches) == ("ran", SITES)
        assert record.notes[:2] == [record.notes[0], "per layer: layers.0=2, layers.1=2, norm=1"]
        assert result["op_calls"] == SITES  # the generated code calls the fused op per site
        assert_no_worse_than(result["compiled"], result["eager"], result["fp32"], factor=1.25)
        assert_close(result["compiled"], result["eager"], rtol=0.1, atol=0.1)
    assert first[0][sharding]["records"][0].notes[0] == first[1][sharding]["records"][0].notes[0]


@pytest.mark.slow
def test_cache_hit_runs_the_fused_op_without_the_pass(worlds):
    first, again = worlds
    for rank, before in zip(again, first):
        result = rank["functional"]
        assert not rank["ops_defined_before_compile"]  # loading the plugin does not define them
        assert result["cache_hits"] >= 1
        assert result["records"] == []  # the pass did not run in these processes...
        assert result["cache_hit_reports"] == 1  # (and the report says why)
        assert result["op_calls"] == SITES  # ...and the cached code still calls the op
        torch.testing.assert_close(result["compiled"], before["functional"]["compiled"], rtol=0, atol=0)


def test_named_backend_reads_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The config the worlds use is valid and enables the pass with its options."""
    (tmp_path / "passkit.toml").write_text(CONFIG)
    for name in [n for n in os.environ if n.startswith("PASSKIT_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    pipeline = passkit.build_pipeline()
    (fusion,) = [p for p in pipeline.passes if p.name == "allreduce_rmsnorm"]
    assert fusion.options.implementation == "reference"
    assert pipeline.names() == ["allreduce_rmsnorm", "cleanup"]
