"""GPU tests of the FP8 variant of ``allreduce_rmsnorm``: 2 ranks, NCCL, flashinfer.
Skipped without 2 GPUs and flashinfer.

One NCCL world (``passkit_testing.nccl_world``) runs three scenarios on every rank and
returns numbers; the tests check them:

* ``accuracy``: ``fused_allreduce_rmsnorm_fp8_cuda`` fused (forced one-shot and two-shot)
  vs forced unfused vs a float64 reference, after dequantization (``q * scale``): the
  fused relative L2 error must be no worse than the unfused path's x1.25; ``residual_out``
  equals the unfused sum; with ``need_norm_out`` the norm output is checked too.
* ``cuda_graph``: ``prepare`` then capture the op; replays with new inputs and a new value
  in the scale buffer (copied in place) match eager fused calls bit for bit.
* ``dynamic``: a decoder-like function compiled with passkit (``allreduce_rmsnorm``,
  flashinfer) with a dynamic token dimension, run at 1, 5, 64 and 300 tokens, against the
  uncompiled function (dequantized, within the FP8 tolerance).

Run (2x H200): ``python -m pytest -q tests/gpu/test_fp8_gpu.py``
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)
if importlib.util.find_spec("flashinfer") is None:
    pytest.skip("needs flashinfer", allow_module_level=True)

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from passkit_fusion.allreduce_rmsnorm import runtime
from passkit_fusion.tuning import tables

from passkit_testing import nccl_world

pytestmark = pytest.mark.gpu

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
EPS = 1e-6
ONESHOT, TWOSHOT = tables.Decision(True, True), tables.Decision(True, False)
ERROR_RATIO_LIMIT = 1.25
HIDDEN = 4096
TOKENS = (1, 7, 128, 1024, 2048)


def _inputs(tokens: int, hidden: int, seed: int = 0):
    """This rank's x, the shared residual, weight and scale, and every rank's x."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def randn(shape, s):
        return torch.randn(shape, generator=torch.Generator(device="cuda").manual_seed(s), device="cuda")

    xs = [randn((tokens, hidden), 1000 * seed + r).to(BF16) for r in range(world)]
    residual = randn((tokens, hidden), 1000 * seed + 999).to(BF16)
    weight = (1.0 + 0.1 * randn((hidden,), 1000 * seed + 998)).to(BF16)
    # a static scale as calibration would give it: amax of the reference norm / 448, x1.1
    return xs[rank], residual, weight, xs


def _reference(xs, residual, weight):
    total = torch.stack([x.double() for x in xs]).sum(0) + residual.double()
    norm = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    return norm, total


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def _op(x, residual, weight, scale, need_norm_out, decision=None):
    with runtime.forced(decision):
        out = runtime.fused_allreduce_rmsnorm_fp8_cuda(
            x, residual, weight, EPS, 0.0, scale, dist.group.WORLD.group_name, need_norm_out
        )
    return out, runtime.last_decision()


def _accuracy() -> list[dict[str, Any]]:
    rows = []
    runtime.prepare(dist.group.WORLD.group_name, HIDDEN, BF16, max_tokens=max(TOKENS))
    for tokens in TOKENS:
        x, residual, weight, xs = _inputs(tokens, HIDDEN, seed=tokens)
        norm_ref, _ = _reference(xs, residual, weight)
        scale = (norm_ref.abs().max() / 448 * 1.1).float().reshape(())
        (q_u, n_u, t_u), _ = _op(x, residual, weight, scale, True, tables.UNFUSED)
        for decision in (ONESHOT, TWOSHOT):
            for need_norm_out in (False, True):
                (q, n, t), record = _op(x, residual, weight, scale, need_norm_out, decision)
                rows.append(
                    {
                        "tokens": tokens,
                        "path": record.path,
                        "need_norm_out": need_norm_out,
                        "err_fused": _rel(q.float() * scale, norm_ref),
                        "err_unfused": _rel(q_u.float() * scale, norm_ref),
                        "norm_err_fused": _rel(n, norm_ref) if need_norm_out else None,
                        "norm_err_unfused": _rel(n_u, norm_ref),
                        "residual_equal": bool(torch.equal(t, t_u)),
                        "quant_dtype": str(q.dtype),
                        "fp8_steps_differing": float(
                            (q.view(torch.uint8) != q_u.view(torch.uint8)).float().mean()
                        ),
                    }
                )
    return rows


def _cuda_graph() -> dict[str, Any]:
    tokens = 64
    assert runtime.prepare(dist.group.WORLD.group_name, HIDDEN, BF16, max_tokens=256) >= 256
    x, residual, weight, _ = _inputs(tokens, HIDDEN, seed=1)
    scale = torch.tensor(0.02, device="cuda")
    static = [x.clone(), residual.clone(), weight.clone(), scale.clone()]

    def step():
        return _op(*static, False, ONESHOT)[0]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    same = []
    for seed, new_scale in ((2, 0.02), (3, 0.035)):
        x, residual, weight, _ = _inputs(tokens, HIDDEN, seed=seed)
        for buffer, value in zip(static, (x, residual, weight, torch.tensor(new_scale, device="cuda"))):
            buffer.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        eager = _op(x, residual, weight, torch.tensor(new_scale, device="cuda"), False, ONESHOT)[0]
        same.append(all(torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a,
                                    b.view(torch.uint8) if b.dtype == E4M3 else b)
                        for a, b in zip((outputs[0], outputs[2]), (eager[0], eager[2]))))  # fmt: skip
    del graph
    return {"replays_match_eager": same}


def _decoder(x, residual, weight, scale):
    h = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
    hf = h.float()
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype) * weight
    return (y / scale).clamp(-448, 448).to(E4M3), h


def _dynamic() -> dict[str, Any]:
    import passkit

    backend = passkit.backend(
        passes=[
            {"name": "allreduce_rmsnorm", "implementation": "flashinfer", "restrict_tokens": False},
            "cleanup",
        ]
    )
    # the token dimension marked dynamic, as serving stacks do (``dynamic=True`` would also
    # turn the module-level EPS into a graph input, which no RMSNorm matcher can fuse)
    compiled = torch.compile(_decoder, backend=backend)
    out = {}
    for tokens in (5, 64, 300, 1):  # 1: torch.compile specializes size 1 (a second, static compile)
        x, residual, weight, _ = _inputs(tokens, HIDDEN, seed=10 + tokens)
        if tokens > 1:
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(residual, 0)
        scale = torch.tensor(0.02, device="cuda")
        q, h = compiled(x, residual, weight, scale)
        q_e, h_e = _decoder(x, residual, weight, scale)
        a, b = q.float(), q_e.float()
        step = torch.where(b.abs() < 2**-6, torch.full_like(b, 2.0**-9), b.abs() * 2**-3)
        out[tokens] = {
            "within_one_step": bool(((a - b).abs() <= step).all()),
            "differing": float((a != b).float().mean()),
            "residual_equal": bool(torch.equal(h, h_e)),
        }
    reports = [r["allreduce_rmsnorm"] for r in backend.reports]
    out["matches"] = [r.matches for r in reports]
    out["notes"] = [n for r in reports for n in r.notes]
    return out


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    try:
        return {"accuracy": _accuracy(), "cuda_graph": _cuda_graph(), "dynamic": _dynamic()}
    finally:
        torch._dynamo.reset()
        runtime.destroy_workspaces()


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return nccl_world(_rank, 2, timeout=420)


def test_fp8_accuracy_fused_vs_unfused_vs_fp64(world):
    for rank in world:
        for row in rank["accuracy"]:
            print(row)
            assert row["path"] in ("fused_oneshot", "fused_twoshot"), row
            assert row["quant_dtype"] == "torch.float8_e4m3fn"
            assert row["err_fused"] <= ERROR_RATIO_LIMIT * row["err_unfused"] + 1e-4, row
            assert row["residual_equal"], row
            if row["need_norm_out"]:
                assert row["norm_err_fused"] <= ERROR_RATIO_LIMIT * row["norm_err_unfused"] + 1e-5, row


def test_fp8_cuda_graph_replays(world):
    for rank in world:
        assert rank["cuda_graph"]["replays_match_eager"] == [True, True]


def test_fp8_dynamic_tokens_compiled(world):
    for rank in world:
        dynamic = rank["dynamic"]
        print(dynamic["notes"])
        assert dynamic["matches"] and all(m == 1 for m in dynamic["matches"])
        assert any("1 with FP8 quant" in n for n in dynamic["notes"])
        for tokens in (1, 5, 64, 300):
            assert dynamic[tokens]["within_one_step"], (tokens, dynamic[tokens])
            assert dynamic[tokens]["residual_equal"], tokens
