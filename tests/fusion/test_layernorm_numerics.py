"""``allreduce_layernorm`` numerics in a real 2-rank gloo world, against eager.

Each rank holds a different partial sum (row-parallel projections of its own shard); norms
and the residual stream are replicated. Every case is compiled in passkit's eager mode with
the reference op (``verify=True``: the graph is linted and re-propagated after the pass) and
compared with the uncompiled model: the sites rewritten (no all-reduce left in the graph),
``residual_out`` equal to the unfused sum exactly, the norm output within the dtype's
tolerance (the reference op runs ``F.layer_norm``, what ``nn.LayerNorm`` runs in eager).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from layernorm_models import ar, make_decoder

from passkit_testing import assert_close, count_ops, gloo_world, run_passes

LN_REFERENCE = {"name": "allreduce_layernorm", "implementation": "reference"}
ALL_REDUCE = "_c10d_functional.all_reduce.default"
FUSED = "passkit_fusion.allreduce_add_layernorm.default"
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


def ln_residual(x, r, w, b):
    h = ar(x) + r
    return F.layer_norm(h, (h.shape[-1],), w, b, 1e-5), h


def ln_no_residual(x, r, w, b):
    y = ar(x)
    return F.layer_norm(y, (y.shape[-1],), w, None, 1e-6), y


def ln_no_affine(x, r, w, b):
    """OLMo's LayerNorm: no weight, no bias."""
    h = ar(x) + r
    return F.layer_norm(h, (h.shape[-1],), None, None, 1e-5), h


FORMS = {
    "no-affine-bf16-3d": (ln_no_affine, bf16, (2, 5, 64)),
    "residual-bias-bf16-2d": (ln_residual, bf16, (7, 64)),
    "residual-bias-fp16-3d": (ln_residual, fp16, (2, 5, 64)),
    "residual-bias-fp32-3d": (ln_residual, fp32, (2, 5, 128)),
    "no-residual-no-bias-bf16": (ln_no_residual, bf16, (7, 64)),
}
DECODERS = {
    f"{'bias' if b else 'no-bias'}-{str(d)[6:]}": (b, d, False) for b in (True, False) for d in (bf16, fp32)
}
DECODERS |= {f"parallel-biased-{str(d)[6:]}": (True, d, "biased") for d in (bf16, fp32)}
DECODERS |= {"non-contiguous-input-bfloat16": (True, bf16, False)}
"""Pre-norm decoders (4 sites), and GPT-NeoX's parallel block with row-parallel biases (2 sites,
each with the other all-reduce merged into it); one fed a transposed (non-contiguous) input,
whose norms read a contiguous copy of the residual stream (issue 45: 0 of 4 fused before)."""


def _inputs(rank: int, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    rep = torch.Generator().manual_seed(0)
    r = torch.randn(shape, generator=rep).to(dtype)
    w = (1.0 + 0.1 * torch.randn(shape[-1], generator=rep)).to(dtype)
    b = (0.1 * torch.randn(shape[-1], generator=rep)).to(dtype)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1 + rank)).to(dtype)
    return x, r, w, b


def _summary(result: Any) -> dict[str, Any]:
    return {
        "compiled": result.outputs,
        "eager": result.eager_outputs,
        "left": count_ops(result.graph_after, ALL_REDUCE),
        "fused": count_ops(result.graph_after, FUSED),
        "matches": result.report["allreduce_layernorm"].matches,
        "notes": result.report["allreduce_layernorm"].notes,
    }


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"forms": {}, "decoders": {}}
    with torch.no_grad():
        for name, (fn, dtype, shape) in FORMS.items():
            torch._dynamo.reset()
            result = run_passes(fn, *_inputs(rank, dtype, shape), passes=[LN_REFERENCE], verify=True)
            out["forms"][name] = _summary(result)
        for name, (bias, dtype, parallel) in DECODERS.items():
            torch._dynamo.reset()
            model = make_decoder(bias, dtype, rank, parallel=parallel)
            x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(7)).to(dtype)
            if name.startswith("non-contiguous"):
                x = x.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, strides (64, 128, 1)
            result = run_passes(model, x, passes=[LN_REFERENCE], verify=True)
            out["decoders"][name] = _summary(result)
        out["op"] = _op_called_directly(rank)
    return out


def _op_called_directly(rank: int) -> dict[str, Any]:
    from passkit_fusion.allreduce_layernorm import ops, runtime

    x, r, w, b = _inputs(rank, bf16, (3, 64))
    group = dist.group.WORLD.group_name
    reduced = x.clone()
    dist.all_reduce(reduced)
    op = torch.ops.passkit_fusion.allreduce_add_layernorm
    total = reduced + r
    return {
        "with": op(x, r, w, b, 1e-5, group, "reference"),
        "without": op(x, None, w, None, 1e-5, group, "reference"),
        "expected_with": (F.layer_norm(total, (64,), w, b, 1e-5), total),
        "expected_without": (F.layer_norm(reduced, (64,), w, None, 1e-5), reduced),
        "torch_kernel": runtime.add_layernorm(reduced.clone(), r, w, b, 1e-5, "torch"),
        "inputs_untouched": torch.equal(x, _inputs(rank, bf16, (3, 64))[0]),
        "max_bytes_default": ops.DEFAULT_MAX_BYTES,
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return gloo_world(_rank, 2, timeout=600)


@pytest.mark.parametrize("case", list(FORMS))
def test_form_matches_eager(ranks: list[dict[str, Any]], case: str):
    for rank in ranks:
        result = rank["forms"][case]
        assert (result["matches"], result["left"], result["fused"]) == (1, 0, 1), result["notes"]
        (norm, total), (eager_norm, eager_total) = result["compiled"], result["eager"]
        assert torch.equal(total, eager_total), "residual_out must be the unfused sum, exactly"
        assert_close(norm, eager_norm)
    torch.testing.assert_close(
        ranks[0]["forms"][case]["compiled"], ranks[1]["forms"][case]["compiled"], rtol=0, atol=0
    )


@pytest.mark.parametrize("case", list(DECODERS))
def test_layernorm_decoder_matches_eager(ranks: list[dict[str, Any]], case: str):
    """Two LayerNorm blocks + final norm: 4 all-reduces, none left: 4 sites (pre-norm) or 2
    with the other all-reduce of each block merged in (GPT-NeoX's parallel block with biases)."""
    sites = 2 if case.startswith("parallel") else 4
    for rank in ranks:
        result = rank["decoders"][case]
        assert (result["matches"], result["left"], result["fused"]) == (sites, 0, sites), result["notes"]
        if case.endswith("float32"):
            torch.testing.assert_close(result["compiled"], result["eager"], rtol=1e-5, atol=1e-5)
        else:  # bf16 through two blocks: LayerNorm's decomposition in the unfused graph vs eager's kernel
            assert_close(result["compiled"], result["eager"], rtol=0.05, atol=0.05)
    torch.testing.assert_close(
        ranks[0]["decoders"][case]["compiled"], ranks[1]["decoders"][case]["compiled"], rtol=0, atol=0
    )


def test_op_called_directly(ranks: list[dict[str, Any]]):
    for rank in ranks:
        op = rank["op"]
        assert op["inputs_untouched"]
        torch.testing.assert_close(op["with"], op["expected_with"], rtol=0, atol=0)
        torch.testing.assert_close(op["without"], op["expected_without"], rtol=0, atol=0)
        torch.testing.assert_close(op["torch_kernel"], op["expected_with"], rtol=0, atol=0)
