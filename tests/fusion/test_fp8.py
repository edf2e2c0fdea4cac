"""``allreduce_rmsnorm`` with the FP8 quantization tail (``fuse_fp8_quant``), on the CPU.

* Matching, on graphs traced in a fake world: every form of a static per-tensor
  ``float8_e4m3fn`` quantization the pass must take over (plain torch ``/ scale``, an
  inverse scale, ``* reciprocal(scale)``, torchao's fp32 form, a scale held in a buffer
  and consumed by ``torch._scaled_mm``), and every form it must leave to Inductor, the
  all-reduce + RMSNorm still fused and the reason in the report.
* Numerics in a 2-rank gloo world, against eager: the reference op's FP8 output equals
  eager's bit for bit with a power-of-two scale and is within one FP8 step elsewhere; the
  norm output and ``residual_out`` are the unquantized op's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from passkit_testing import fake_world, gloo_world, run_passes

REFERENCE = {"name": "allreduce_rmsnorm", "implementation": "reference"}
FUSED = "passkit_fusion.allreduce_rmsnorm.default"
FUSED_FP8 = "passkit_fusion.allreduce_rmsnorm_fp8.default"
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
E4M3 = torch.float8_e4m3fn


def ar(x: torch.Tensor) -> torch.Tensor:
    return funcol.all_reduce(x, "sum", dist.group.WORLD)


def llama_norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    dtype = h.dtype
    h = h.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * h.to(dtype)


def quant_div(y: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (y / s).clamp(-448, 448).to(E4M3)


def quant_torchao(y: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """torchao's ``_quantize_affine_float8`` for a per-tensor scale: upcast, divide, clamp
    to the dtype's finite range, cast (what its Float8Tensor static-scale inference runs)."""
    scaled = y.to(torch.float32) / s
    limit = torch.finfo(E4M3).max
    return scaled.clamp(min=-limit, max=limit).to(E4M3)


# ---------------------------------------------------------------------------------------
# the forms: f(x, r, w, s) -> outputs; s is the dequantization scale


def div_scale(x, r, w, s):
    h = ar(x) + r
    return quant_div(llama_norm(h, w), s), h


def inverse_scale(x, r, w, s):
    h = ar(x) + r
    inv = 1.0 / s  # precomputed in the checkpoint loader, here in the graph (a reciprocal)
    return (llama_norm(h, w) * inv).clamp(-448, 448).to(E4M3), h


def inverse_scale_input(x, r, w, s):
    """The inverse scale is itself the graph input: the pass computes 1 / it for the kernel."""
    h = ar(x) + r
    return (llama_norm(h, w) * s).clamp(min=-448.0, max=448.0).to(E4M3), h


def torchao_form(x, r, w, s):
    h = ar(x) + r
    return quant_torchao(llama_norm(h, w), s), h


def f_rms_norm_div(x, r, w, s):
    """``F.rms_norm`` is the reference's own computation: the quantization is bit-exact."""
    h = ar(x) + r
    return quant_div(torch.nn.functional.rms_norm(h, (h.shape[-1],), w, 1e-6), s), h


def reshaped_and_scaled(x, r, w, s):
    """An MoE block's sum reshaped back to [B, S, H] and scaled (Granite-MoE) before the add."""
    h = ar(x.reshape(-1, x.shape[-1])).view(r.shape) * 0.5 + r
    return quant_div(llama_norm(h, w), s), h


def norm_also_used(x, r, w, s):
    h = ar(x) + r
    y = llama_norm(h, w)
    return quant_div(y, s), y, h  # y read elsewhere: the kernel also writes norm_out


def no_residual(x, r, w, s):
    return (quant_div(llama_norm(ar(x), w), s),)


def no_weight_div(x, r, w, s):
    """nanochat's norm, without a weight: the op reads a ones weight."""
    h = ar(x) + r
    out = h.float()
    y = (out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(h)
    return quant_div(y, s), h


def two_layers(x, r, w, s):
    h = ar(x) + r
    y = llama_norm(h, w)
    q1 = quant_div(y, s)
    h = h + ar(y * 0.5)
    return q1, quant_torchao(llama_norm(h, w), s), h


class FP8Block(torch.nn.Module):
    """A norm followed by an FP8 linear layer: static activation scale in a buffer, FP8
    weight, ``torch._scaled_mm``."""

    def __init__(self, hidden: int, out: int, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.norm_weight = torch.nn.Parameter((1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype))
        weight = torch.randn(out, hidden, generator=gen) * 0.05
        w_scale = weight.abs().max() / 448
        self.register_buffer("weight_fp8", (weight / w_scale).to(E4M3))
        self.register_buffer("weight_scale", w_scale.reshape(()))
        self.register_buffer("act_scale", torch.tensor(0.02))
        self.dtype = dtype

    def forward(self, x, r):
        h = ar(x) + r
        q = quant_div(llama_norm(h, self.norm_weight), self.act_scale)
        q2 = q.reshape(-1, q.shape[-1])
        out = torch._scaled_mm(
            q2, self.weight_fp8.t(), scale_a=self.act_scale, scale_b=self.weight_scale, out_dtype=self.dtype
        )
        return out.reshape(*x.shape[:-1], -1), h


# negative forms: the all-reduce + norm fuse, the quantization stays


def dynamic_scale(x, r, w, s):
    h = ar(x) + r
    y = llama_norm(h, w)
    scale = y.abs().amax().float() / 448
    return quant_div(y, scale), h


def dynamic_row_scale(x, r, w, s):
    h = ar(x) + r
    y = llama_norm(h, w)
    scale = y.abs().amax(-1, keepdim=True).float() / 448
    return quant_div(y, scale), h


def row_scale_input(x, r, w, s):
    h = ar(x) + r
    return quant_div(llama_norm(h, w), s.expand(x.shape[0], 1)), h


def e5m2(x, r, w, s):
    h = ar(x) + r
    return (llama_norm(h, w) / s).clamp(-57344, 57344).to(torch.float8_e5m2), h


def clamp_mismatch(x, r, w, s):
    h = ar(x) + r
    return (llama_norm(h, w) / s).clamp(-240, 240).to(E4M3), h


def no_clamp(x, r, w, s):
    h = ar(x) + r
    return (llama_norm(h, w) / s).to(E4M3), h


def scaled_value_used(x, r, w, s):
    h = ar(x) + r
    scaled = llama_norm(h, w) / s
    return scaled.clamp(-448, 448).to(E4M3), scaled, h


def python_scale(x, r, w, s):
    h = ar(x) + r
    return (llama_norm(h, w) / 0.5).clamp(-448, 448).to(E4M3), h


@dataclasses.dataclass(frozen=True)
class Case:
    fn: Callable[..., Any]
    dtype: torch.dtype = bf16
    shape: tuple[int, ...] = (4, 64)
    scale_shape: tuple[int, ...] = ()
    sites: int = 1
    quantized: int = 1
    need_norm_out: bool = False
    reason: str = ""
    """For negatives: the start of the report's reason."""

    def inputs(self, rank: int = 0, scale: float = 0.25) -> tuple[torch.Tensor, ...]:
        replicated = torch.Generator().manual_seed(0)
        r = torch.randn(self.shape, generator=replicated).to(self.dtype)
        w = (1.0 + 0.1 * torch.randn(self.shape[-1], generator=replicated)).to(self.dtype)
        x = torch.randn(self.shape, generator=torch.Generator().manual_seed(1 + rank)).to(self.dtype)
        return x, r, w, torch.full(self.scale_shape, scale)


FORMS = {
    "div-bf16": Case(div_scale),
    "div-fp16-3d-scale[1]": Case(div_scale, dtype=fp16, shape=(2, 3, 64), scale_shape=(1,)),
    "div-fp32": Case(div_scale, dtype=fp32),
    "f_rms_norm-div": Case(f_rms_norm_div),
    "inverse-reciprocal": Case(inverse_scale),
    "inverse-input": Case(inverse_scale_input, scale_shape=(1, 1)),
    "torchao-bf16": Case(torchao_form),
    "torchao-fp16-3d": Case(torchao_form, dtype=fp16, shape=(2, 3, 64)),
    "reshaped-and-scaled-3d": Case(reshaped_and_scaled, shape=(2, 3, 64)),
    "norm-also-used": Case(norm_also_used, need_norm_out=True),
    "no-residual": Case(no_residual),
    "no-weight-div": Case(no_weight_div),
    "no-weight-div-fp32": Case(no_weight_div, dtype=fp32),
    "two-layers": Case(two_layers, sites=2, quantized=2, need_norm_out=True),
}

NEGATIVES = {
    "dynamic-scale": Case(dynamic_scale, quantized=0, reason="dynamic scale"),
    "dynamic-row-scale": Case(
        dynamic_row_scale, quantized=0, reason="scale of shape [4, 1] is not per-tensor"
    ),
    "row-scale-input": Case(row_scale_input, scale_shape=(1, 1), quantized=0, reason="scale of shape [4, 1]"),
    "e5m2": Case(e5m2, quantized=0, reason="quantization to float8_e5m2"),
    "clamp-mismatch": Case(clamp_mismatch, quantized=0, reason="clamp range [-240, 240]"),
    "no-clamp": Case(no_clamp, quantized=0, reason="no clamp before the float8_e4m3fn conversion"),
    "scaled-value-used": Case(scaled_value_used, quantized=0, reason="div, inside the FP8 quantization"),
    "python-scale": Case(python_scale, quantized=0, reason="scale is a Python number"),
}


def _fuse(case: Case, passes: list[Any] | None = None):
    with fake_world(2):
        return run_passes(case.fn, *case.inputs(), passes=passes or [REFERENCE])


def _nodes(gm: torch.fx.GraphModule, name: str) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == name]


@pytest.mark.parametrize("name", list(FORMS))
def test_fuses_fp8_form(name: str):
    case = FORMS[name]
    result = _fuse(case)
    after = result.graph_after
    fp8 = _nodes(after, FUSED_FP8)
    assert len(fp8) == case.quantized
    assert len(_nodes(after, FUSED)) == case.sites - case.quantized
    targets = {str(n.target) for n in after.graph.nodes if n.op == "call_function"}
    assert "prims.convert_element_type.default" not in targets or name == "two-layers"  # y * 0.5 stays
    assert not targets & {"aten.clamp_min.default", "aten.clamp_max.default", "aten.div.Tensor"}
    for node in fp8:
        scale, group, impl, need_norm_out = node.args[5:9]
        assert (group, impl) == ("0", "reference")
        assert need_norm_out is case.need_norm_out or name == "two-layers"
        if name == "inverse-input":  # the kernel takes the scale: 1 / the input
            assert str(scale.target) == "aten.reciprocal.default" and scale.args[0].op == "placeholder"
        else:
            assert scale.op == "placeholder"
    note = result.report["allreduce_rmsnorm"].notes[0]
    assert f"{case.quantized} with FP8 quant" in note, note


def test_scaled_mm_block_with_buffers():
    block = FP8Block(64, 32, bf16)
    x = torch.randn(2, 3, 64, dtype=bf16)
    with fake_world(2):
        result = run_passes(block, x, x, passes=[REFERENCE])
    after = result.graph_after
    (node,) = _nodes(after, FUSED_FP8)
    assert node.args[8] is False  # only the quantization reads the norm output
    (mm,) = [n for n in after.graph.nodes if n.target is torch.ops.aten._scaled_mm.default]
    assert node.args[5] is mm.args[2]  # the same static scale (a lifted buffer) for both
    assert "1 with FP8 quant (div=1)" in result.report["allreduce_rmsnorm"].notes[0]


@pytest.mark.parametrize("name", list(NEGATIVES))
def test_leaves_fp8_form_to_inductor(name: str):
    case = NEGATIVES[name]
    result = _fuse(case)
    after = result.graph_after
    assert not _nodes(after, FUSED_FP8)
    assert len(_nodes(after, FUSED)) == 1  # the all-reduce + norm still fused
    notes = result.report["allreduce_rmsnorm"].notes
    skipped = [n for n in notes if n.startswith("FP8 quantization left unfused at 1 site(s): ")]
    assert skipped and case.reason in skipped[0], notes


def test_option_off_keeps_the_unquantized_fusion():
    result = _fuse(FORMS["div-bf16"], passes=[{**REFERENCE, "fuse_fp8_quant": False}])
    assert not _nodes(result.graph_after, FUSED_FP8)
    assert len(_nodes(result.graph_after, FUSED)) == 1
    assert all("FP8" not in n for n in result.report["allreduce_rmsnorm"].notes)


def test_plan_fingerprint_distinguishes_the_quantized_variant():
    on = _fuse(FORMS["div-bf16"]).report["allreduce_rmsnorm"].notes[0]
    off = _fuse(FORMS["div-bf16"], passes=[{**REFERENCE, "fuse_fp8_quant": False}])
    assert on.rsplit("plan ", 1)[1] != off.report["allreduce_rmsnorm"].notes[0].rsplit("plan ", 1)[1]


# ---------------------------------------------------------------------------------------
# numerics in a 2-rank gloo world

#: The forms run for numerics. The scale 0.25 is a power of two: eager's ``y / s`` and the
#: kernel's ``y * (1 / s)`` are then the same number, so where the norm output is eager's
#: (F.rms_norm, fp32) the FP8 output is bit-identical; Llama's norm rounds once more than
#: the kernel (see reference.py), which moves an FP8 value by at most one step.
NUMERIC_FORMS = ["div-bf16", "div-fp16-3d-scale[1]", "div-fp32", "f_rms_norm-div", "inverse-reciprocal",
                 "inverse-input", "torchao-bf16", "norm-also-used", "no-residual", "two-layers", "no-weight-div"]  # fmt: skip
EXACT = {"div-fp32", "f_rms_norm-div"}
ODD_SCALE = 0.0371  # not a power of two: roundings may differ by one FP8 step


def _compile(fn: Callable[..., Any]):
    import passkit

    torch._dynamo.reset()
    backend = passkit.backend(passes=[REFERENCE], mode="eager", verify=True, on_error="raise")
    return torch.compile(fn, backend=backend, fullgraph=True), backend


def _numerics_rank(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with torch.no_grad():
        for name in NUMERIC_FORMS + list(NEGATIVES):
            case = FORMS.get(name) or NEGATIVES[name]
            compiled, backend = _compile(case.fn)
            inputs = case.inputs(rank)
            out[name] = {
                "eager": case.fn(*inputs),
                "compiled": compiled(*inputs),
                "notes": backend.reports[0]["allreduce_rmsnorm"].notes,
            }
        case = FORMS["torchao-bf16"]
        compiled, _ = _compile(case.fn)
        inputs = case.inputs(rank, scale=ODD_SCALE)
        out["odd-scale"] = {"eager": case.fn(*inputs), "compiled": compiled(*inputs)}
        block = FP8Block(64, 32, bf16)
        compiled, _ = _compile(block)
        x, r, *_ = Case(div_scale, shape=(2, 3, 64)).inputs(rank)
        out["scaled_mm"] = {"eager": block(x, r), "compiled": compiled(x, r)}
        op = torch.ops.passkit_fusion.allreduce_rmsnorm_fp8
        x, r, w, s = FORMS["div-bf16"].inputs(rank)
        out["op"] = {
            "fp8": op(x, r, w, 1e-6, 0.0, s, dist.group.WORLD.group_name, "reference", False),
            "plain": torch.ops.passkit_fusion.allreduce_rmsnorm(x, r, w, 1e-6, 0.0, dist.group.WORLD.group_name, "reference"),
            "scale": s,
        }  # fmt: skip
    # FP8 tensors do not unpickle in the parent: hand their bits back as uint8
    return torch.utils._pytree.tree_map(lambda t: _bits(t).clone() if isinstance(t, torch.Tensor) else t, out)


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return gloo_world(_numerics_rank, 2, timeout=300)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor's bits (uint8); other tensors unchanged."""
    return t.view(torch.uint8) if t.dtype in (E4M3, torch.float8_e5m2) else t


def _fp8(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(E4M3)


def _assert_fp8_close(got: torch.Tensor, want: torch.Tensor, exact: bool, dtype=E4M3) -> None:
    """FP8 bits equal (``exact``), or at most one FP8 step apart, for at most 5% of them."""
    if exact:
        assert torch.equal(got, want)
        return
    a, b = got.view(dtype).float(), want.view(dtype).float()
    step = torch.where(b.abs() < 2**-6, torch.tensor(2.0**-9), b.abs() * 2**-3)  # >= one e4m3 step
    assert ((a - b).abs() <= step).all()
    assert (got != want).float().mean() <= 0.05


@pytest.mark.parametrize("name", NUMERIC_FORMS + list(NEGATIVES))
def test_fp8_form_matches_eager(ranks, name):
    for rank in ranks:
        result = rank[name]
        for got, want in zip(result["compiled"], result["eager"], strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            if got.dtype == torch.uint8:  # FP8 bits
                fmt = torch.float8_e5m2 if name == "e5m2" else E4M3
                _assert_fp8_close(got, want, name in EXACT, fmt)
            elif got.dtype == fp32 and name in EXACT:
                torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
            else:  # a norm output (one rounding apart) or a sum (exact unless it adds a norm output)
                torch.testing.assert_close(got, want)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0][name]["compiled"], ranks[1][name]["compiled"]))


def test_fp8_within_one_step_with_any_scale(ranks):
    for rank in ranks:
        (q, h), (q_eager, h_eager) = rank["odd-scale"]["compiled"], rank["odd-scale"]["eager"]
        assert torch.equal(h, h_eager)
        _assert_fp8_close(q, q_eager, exact=False)


def test_scaled_mm_block_matches_eager(ranks):
    for rank in ranks:
        (out, h), (out_eager, h_eager) = rank["scaled_mm"]["compiled"], rank["scaled_mm"]["eager"]
        assert torch.equal(h, h_eager)
        torch.testing.assert_close(out, out_eager, rtol=0.05, atol=0.05)  # a few inputs one FP8 step apart


def test_op_called_directly(ranks):
    from passkit_fusion.reference import fp8_quantize

    for rank in ranks:
        (q, norm, total), (norm_ref, total_ref) = rank["op"]["fp8"], rank["op"]["plain"]
        assert norm.shape == (0,)
        assert torch.equal(total, total_ref)
        assert torch.equal(q, _bits(fp8_quantize(norm_ref, rank["op"]["scale"])))
        assert torch.equal(q, _bits((norm_ref / 0.25).clamp(-448, 448).to(E4M3)))
