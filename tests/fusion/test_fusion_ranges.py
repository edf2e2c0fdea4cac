"""``allreduce_rmsnorm`` with token ranges: it fuses only up to its bound, and sizes above
compile without it (2-rank gloo world, reference op); where its bound comes from."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from passkit_fusion.allreduce_rmsnorm import AllReduceRMSNorm
from passkit_fusion.model import LlamaConfig, TinyLlama, shard_functional
from passkit_fusion.tuning import tables

import passkit
from passkit import TokenConstraint
from passkit_testing import assert_close, gloo_world

SITES = LlamaConfig().sites()
BOUND = 8


def _run(rank: int, world_size: int) -> dict[str, Any]:
    from test_fusion_compile import _count_op_calls

    calls = _count_op_calls()
    model = shard_functional(TinyLlama(LlamaConfig()).eval(), dist.group.WORLD, rank, world_size)
    backend = passkit.backend(
        passes=[{"name": "allreduce_rmsnorm", "implementation": "reference", "max_tokens": BOUND}, "cleanup"]
    )
    # the token dim dynamic (dynamic=True would also lift the norms' float eps to inputs)
    compiled = torch.compile(model, backend=backend)
    out: dict[str, Any] = {}
    with torch.no_grad():
        for seq in (4, BOUND, BOUND + 1, 24):
            ids = torch.randint(
                0, LlamaConfig().vocab, (1, seq), generator=torch.Generator().manual_seed(seq)
            )
            calls[0] = 0
            out[seq] = {"compiled": compiled(ids), "eager": model(ids), "op_calls": calls[0]}
    # Dynamo compiles the first call statically (one compile for its 4 tokens: the pass
    # runs, 4 is in its range); the next size recompiles with a dynamic token dimension: the
    # ranges
    out["static_notes"] = [r.notes for r in backend.reports if (r.token_range or "").startswith("tokens = ")]
    # compile_at="first_use": the recompile (8 tokens) compiles 1..8 inside Dynamo's compile,
    # the call with 9 compiles the other range on both ranks at the same call
    out["late_compiles"] = backend.last_dispatcher.late_compiles
    out["reports"] = {
        r.token_range: (
            r["allreduce_rmsnorm"].status,
            r["allreduce_rmsnorm"].matches,
            r["allreduce_rmsnorm"].reason,
        )
        for r in backend.reports
        if r.token_range is not None
    }
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    no_caches = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    return gloo_world(_run, 2, timeout=300, env=no_caches)


@pytest.mark.slow  # its world compiles every range with Inductor on 2 ranks: about 75 s on 2 cores
def test_the_pass_fuses_up_to_its_bound_and_larger_sizes_compile_without_it(world):
    for rank in world:
        assert rank["reports"] == {
            "tokens = 4 (static shapes)": ("ran", SITES, None),
            f"tokens 1..{BOUND}": ("ran", SITES, None),
            f"tokens >= {BOUND + 1}": (
                "skipped",
                0,
                f"applies to tokens 1..{BOUND}; this compile serves tokens >= {BOUND + 1}",
            ),
        }
        assert rank["late_compiles"] == 1
        (notes,) = rank["static_notes"]
        assert "it serves tokens = 4 (static shapes) (token count from input" in notes[0]
        for seq in (4, BOUND, BOUND + 1, 24):
            result = rank[seq]
            assert result["op_calls"] == (SITES if seq <= BOUND else 0), seq
            assert_close(result["compiled"], result["eager"], rtol=0.05, atol=0.05)


def _flashinfer_pass(**options: Any) -> AllReduceRMSNorm:
    return AllReduceRMSNorm(implementation="flashinfer", **options)


CUDA_CTX = passkit.CompileContext(device="cuda", dtype=torch.bfloat16, world_size=2)


def test_the_bound_comes_from_the_tuned_table(monkeypatch):
    key = tables.TableKey("Fancy GPU", 2, 4096, "bfloat16")
    other = tables.TableKey("Fancy GPU", 2, 8192, "bfloat16")
    shipped = tables.Table(
        {
            key: tables.Entry((tables.Rule(512, tables.Decision(True, True)),)),
            other: tables.Entry(
                (
                    tables.Rule(64, tables.Decision(True, True)),
                    tables.Rule(2048, tables.Decision(True, False)),
                )
            ),
        }
    )
    monkeypatch.setattr(tables, "default_table", lambda: shipped)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fancy GPU")
    assert _flashinfer_pass().token_constraint(CUDA_CTX) == TokenConstraint(max_tokens=2048)
    assert _flashinfer_pass(max_tokens=300).token_constraint(CUDA_CTX) == TokenConstraint(max_tokens=300)
    assert _flashinfer_pass(restrict_tokens=False).token_constraint(CUDA_CTX) is None
    # no entry for this world size: no range (the pass leaves such sites alone anyway)
    ctx4 = passkit.CompileContext(device="cuda", dtype=torch.bfloat16, world_size=4)
    assert _flashinfer_pass().token_constraint(ctx4) is None
    # a GPU the table does not hold (an H100), world size 2: the op fuses by the conservative
    # rule (8 MiB of activations: 1024 tokens at hidden 4096) and would fall back above it,
    # slower than Inductor's code: those sizes compile without the pass
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Other GPU")
    assert _flashinfer_pass().token_constraint(CUDA_CTX) == TokenConstraint(max_tokens=1024)
    # the reference op on the CPU: only an explicit max_tokens bounds it
    assert AllReduceRMSNorm(implementation="reference").token_constraint(passkit.CompileContext()) is None


def test_the_shipped_tables_bound_h200():
    table = tables.default_table()
    assert table.largest_fused("NVIDIA H200", 2, "bfloat16") == 4096  # capped from end-to-end runs
    assert table.largest_fused("NVIDIA H200", 4, "bfloat16") == 2048
    assert table.largest_fused("NVIDIA H200", 3, "bfloat16") is None
