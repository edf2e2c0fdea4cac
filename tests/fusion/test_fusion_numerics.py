"""``allreduce_rmsnorm`` numerics in a real 2-rank gloo world, against eager.

Each rank holds a different partial sum ``x`` (the residual and the weight are replicated, as
in tensor parallelism). Every form is compiled in passkit's eager mode with the reference op
and compared with the uncompiled function: ``residual_out`` must equal the unfused sum
exactly, the norm output must be within the dtype's tolerances. One world runs every case;
each case is its own test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from passkit_fusion.model import LlamaConfig, TinyLlama, shard_dtensor, shard_functional

import passkit
from passkit_testing import assert_close, assert_no_worse_than, gloo_world

REFERENCE = {"name": "allreduce_rmsnorm", "implementation": "reference"}
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


def ar(x: torch.Tensor) -> torch.Tensor:
    return funcol.all_reduce(x, "sum", dist.group.WORLD)


def llama(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    dtype = h.dtype
    h = h.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * h.to(dtype)


def gemma(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = h.float()
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (out * (1.0 + w.float())).type_as(h)


def gemma3n(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Gemma-3n's and Gemma-4's norm: ``pow(mean + eps, -0.5)`` for ``rsqrt``."""
    out = h.float()
    out = out * torch.pow(out.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5)
    return (out * w.float()).type_as(h)


def f_rms_norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(h, (h.shape[-1],), w, 1e-5)


def nanochat(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """nanochat's norm: no weight (``w`` unused); the fused op reads a ones weight."""
    out = h.float()
    return (out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(h)


def f_rms_norm_no_weight(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(h, (h.shape[-1],), None, 1e-5)


def nanochat_layer(x, r, w):
    """The weightless norm's output read by several users (nanochat's q, k, v projections)."""
    h = ar(x) + r
    y = nanochat(h, w)
    return y @ torch.outer(w, w), torch.tanh(y), h


def nanochat_two_layers(x, r, w):
    """nanochat's first norm (on the embedding's sum): its output is the residual stream."""
    y = nanochat(ar(x), w)
    h = y + ar(torch.tanh(nanochat(y, w)) * 0.5 + x)
    return nanochat(h, w), h


def with_residual(norm: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    def fn(x, r, w):
        h = ar(x) + r
        return norm(h, w), h  # the sum is used later: residual_out

    return fn


def without_residual(norm: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    def fn(x, r, w):
        y = ar(x)
        return norm(y, w), y  # the all-reduce result is used later: residual_out

    return fn


def in_place(x, r, w):
    y = x.clone()
    dist.all_reduce(y)  # traced as all_reduce + wait_tensor + copy
    h = y + r
    return llama(h, w), h


def two_layers(x, r, w):
    """Two sites, the second one's residual being the first one's ``residual_out``."""
    h = ar(x) + r
    y = llama(h, w)
    h = h + ar(y * 0.5 + x)
    return llama(h, w), h


def moe_reshape(x, r, w):
    """An MoE block's sum on [tokens, hidden], reshaped back to [B, S, H] before the add."""
    h = ar(x.reshape(-1, x.shape[-1])).view(r.shape) + r
    return llama(h, w), h


def scaled_residual(x, r, w):
    """Granite: the block output times ``residual_multiplier`` (moved before the all-reduce)."""
    h = r + ar(x) * 0.22
    return llama(h, w), h


def scaled_embedding(x, r, w):
    """Gemma: the (vocab-parallel) embedding times sqrt(hidden), then the first norm."""
    h = ar(x) * (x.shape[-1] ** 0.5)
    return llama(h, w), h


def shared_expert(x, r, w):
    """``norm(AR(routed) + shared + residual)``: the shared term joins the residual."""
    h = ar(x) + torch.tanh(r) + r
    return llama(h, w), h


def shared_then_reshape(x, r, w):
    """Qwen2-MoE: routed + shared on [tokens, hidden], reshaped to [B, S, H], + residual."""
    shared = torch.tanh(r.reshape(-1, r.shape[-1]))  # the same on every rank
    h = (ar(x.reshape(-1, x.shape[-1])) + shared).view(r.shape) + r
    return llama(h, w), h


CASES: dict[str, tuple[Callable[..., Any], torch.dtype, tuple[int, ...]]] = {
    "shared-then-reshape-bf16-3d": (shared_then_reshape, bf16, (2, 5, 64)),
    "moe-reshape-bf16-3d": (moe_reshape, bf16, (2, 5, 64)),
    "scaled-residual-bf16-2d": (scaled_residual, bf16, (7, 64)),
    "scaled-residual-fp32-3d": (scaled_residual, fp32, (2, 5, 64)),
    "scaled-embedding-fp16-3d": (scaled_embedding, fp16, (2, 5, 64)),
    "shared-expert-bf16-2d": (shared_expert, bf16, (7, 64)),
    "llama-residual-bf16-3d": (with_residual(llama), bf16, (2, 5, 128)),
    "llama-residual-fp16-2d": (with_residual(llama), fp16, (7, 64)),
    "llama-residual-fp32-2d": (with_residual(llama), fp32, (7, 64)),
    "llama-no-residual-bf16-2d": (without_residual(llama), bf16, (7, 64)),
    "f_rms_norm-residual-bf16-2d": (with_residual(f_rms_norm), bf16, (7, 256)),
    "f_rms_norm-no-residual-fp16-3d": (without_residual(f_rms_norm), fp16, (2, 5, 64)),
    "gemma-residual-bf16-3d": (with_residual(gemma), bf16, (2, 5, 64)),
    "gemma-residual-fp16-2d": (with_residual(gemma), fp16, (7, 64)),
    "gemma3n-pow-residual-bf16-3d": (with_residual(gemma3n), bf16, (2, 5, 64)),
    "in-place-all-reduce-bf16-2d": (in_place, bf16, (7, 64)),
    "two-chained-sites-bf16": (two_layers, bf16, (7, 64)),
    "nanochat-no-weight-residual-bf16-3d": (with_residual(nanochat), bf16, (2, 5, 64)),
    "nanochat-no-weight-residual-fp32-2d": (with_residual(nanochat), fp32, (7, 64)),
    "nanochat-no-weight-no-residual-fp32-3d": (without_residual(nanochat), fp32, (2, 5, 64)),
    "f_rms_norm-no-weight-residual-fp16-2d": (with_residual(f_rms_norm_no_weight), fp16, (7, 64)),
    "two-layers-nanochat-no-weight-fp32-2d": (nanochat_two_layers, fp32, (7, 64)),
}

SP = {"name": "sequence_parallel", "min_tokens": 1}
SP_CASES: dict[str, tuple[Callable[..., Any], torch.dtype, tuple[int, ...]]] = {
    "nanochat-no-weight-layer-fp32-3d": (nanochat_layer, fp32, (2, 4, 64)),
    "nanochat-no-weight-layer-bf16-2d": (nanochat_layer, bf16, (8, 64)),
    "nanochat-no-weight-no-residual-fp32-2d": (without_residual(nanochat), fp32, (8, 64)),
    "nanochat-no-weight-two-layers-fp32-3d": (nanochat_two_layers, fp32, (2, 4, 64)),
    "nanochat-no-weight-two-layers-bf16-2d": (nanochat_two_layers, bf16, (8, 64)),
}
"""Norms without a weight through ``sequence_parallel`` (its rewrite copies the norm's own
nodes onto the shard: no weight needed)."""


def _inputs(rank: int, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    replicated = torch.Generator().manual_seed(0)
    r = torch.randn(shape, generator=replicated).to(dtype)
    w = (1.0 + 0.1 * torch.randn(shape[-1], generator=replicated)).to(dtype)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1 + rank)).to(dtype)
    return x, r, w


def _compile(
    fn: Callable[..., Any], passes: list[Any] | None = None
) -> tuple[Callable[..., Any], passkit.Backend]:
    torch._dynamo.reset()
    backend = passkit.backend(passes=passes or [REFERENCE], mode="eager", verify=True, on_error="raise")
    return torch.compile(fn, backend=backend, fullgraph=True), backend


def _sequence_parallel_forms(rank: int) -> dict[str, Any]:
    out = {}
    for name, (fn, dtype, shape) in SP_CASES.items():
        inputs = _inputs(rank, dtype, shape)
        compiled, backend = _compile(fn, [SP])
        out[name] = {
            "eager": fn(*inputs),
            "compiled": compiled(*inputs),
            "matches": backend.reports[0]["sequence_parallel"].matches,
        }
    return out


def _forms(rank: int) -> dict[str, Any]:
    out = {}
    for name, (fn, dtype, shape) in CASES.items():
        inputs = _inputs(rank, dtype, shape)
        compiled, backend = _compile(fn)
        out[name] = {
            "eager": fn(*inputs),
            "compiled": compiled(*inputs),
            "matches": backend.reports[0]["allreduce_rmsnorm"].matches,
        }
    return out


def _op_called_directly(rank: int) -> dict[str, Any]:
    x, r, w = _inputs(rank, bf16, (3, 64))
    group = dist.group.WORLD.group_name
    op = torch.ops.passkit_fusion.allreduce_rmsnorm
    reduced = x.clone()
    dist.all_reduce(reduced)

    def expected(total: torch.Tensor, bias: float) -> tuple[torch.Tensor, torch.Tensor]:
        h = total.float()
        norm = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (w.float() + bias)
        return norm.to(total.dtype), total

    return {
        "with_residual": op(x, r, w, 1e-6, 0.5, group, "reference"),
        "without_residual": op(x, None, w, 1e-6, 0.0, group, "reference"),
        "expected_with": expected(reduced + r, 0.5),
        "expected_without": expected(reduced, 0.0),
        "inputs_untouched": torch.equal(x, _inputs(rank, bf16, (3, 64))[0]),
    }


DTENSOR_EMBEDDING_BUG = (
    "torch 2.10's DTensor fails the vocabulary-parallel embedding in eager "
    "(_MaskPartial._reduce_value: mask_buffer empty after the async redistribute of a second "
    "sharded model); torch 2.11 and later run it"
)


def _models(rank: int, world_size: int) -> dict[str, Any]:
    cfg = LlamaConfig()
    ids = torch.randint(0, cfg.vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    out = {}
    for sharding in ("functional", "dtensor"):
        if sharding == "dtensor" and torch.__version__ < "2.11":
            out[sharding] = {"skipped": DTENSOR_EMBEDDING_BUG}
            continue
        models = [TinyLlama(cfg).to(dtype) for dtype in (bf16, fp32)]
        if sharding == "functional":
            models = [shard_functional(m, dist.group.WORLD, rank, world_size) for m in models]
        else:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world_size,))
            models = [shard_dtensor(m, mesh) for m in models]
        model, fp32_model = models
        compiled, backend = _compile(model)
        out[sharding] = {
            "eager": model(ids),
            "fp32": fp32_model(ids),
            "compiled": compiled(ids),
            "matches": backend.reports[0]["allreduce_rmsnorm"].matches,
        }
    return out


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    with torch.no_grad():
        return {
            "forms": _forms(rank),
            "sp_forms": _sequence_parallel_forms(rank),
            "op": _op_called_directly(rank),
            "models": _models(rank, world_size),
        }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return gloo_world(_rank, 2, timeout=300)


@pytest.mark.parametrize("case", list(CASES))
def test_form_matches_eager(ranks: list[dict[str, Any]], case: str):
    for rank in ranks:
        result = rank["forms"][case]
        assert result["matches"] == (2 if case.startswith("two") else 1)
        (norm, total), (eager_norm, eager_total) = result["compiled"], result["eager"]
        assert_close(norm, eager_norm)
        if case.startswith(("two", "scaled-residual", "shared")):
            # the second sum adds the first norm output; a scale moved before the all-reduce,
            # a shared term added to the residual first: the same sum, rounded elsewhere
            assert_close(total, eager_total)
        else:
            assert torch.equal(total, eager_total), "residual_out must be the unfused sum, exactly"
    torch.testing.assert_close(
        ranks[0]["forms"][case]["compiled"], ranks[1]["forms"][case]["compiled"], rtol=0, atol=0
    )


@pytest.mark.parametrize("case", list(SP_CASES))
def test_sequence_parallel_without_weight_matches_eager(ranks: list[dict[str, Any]], case: str):
    for rank in ranks:
        result = rank["sp_forms"][case]
        assert result["matches"] == (2 if "two-layers" in case else 1)
        for got, want in zip(result["compiled"], result["eager"], strict=True):
            assert_close(got, want)
    torch.testing.assert_close(
        ranks[0]["sp_forms"][case]["compiled"], ranks[1]["sp_forms"][case]["compiled"], rtol=0, atol=0
    )


def test_op_called_directly(ranks: list[dict[str, Any]]):
    for rank in ranks:
        op = rank["op"]
        assert op["inputs_untouched"]
        for got, expected in (
            (op["with_residual"], op["expected_with"]),
            (op["without_residual"], op["expected_without"]),
        ):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("sharding", ["functional", "dtensor"])
def test_tensor_parallel_llama_matches_eager(ranks: list[dict[str, Any]], sharding: str):
    for rank in ranks:
        result = rank["models"][sharding]
        if "skipped" in result:
            pytest.skip(result["skipped"])
        assert result["matches"] == LlamaConfig().sites()
        # bf16 through two layers: as accurate as eager bf16 is, measured against fp32
        assert_no_worse_than(result["compiled"], result["eager"], result["fp32"], factor=1.25)
        assert_close(result["compiled"], result["eager"], rtol=0.1, atol=0.1)
