"""``allreduce_rmsnorm`` on traced graphs in a fake world: every form it must fuse, every
form it must leave alone (with the reason in the report), and how it skips.

Graphs come from ``torch.compile`` in passkit's eager mode (post-grad ATen graphs, no code
generation); the fake process group makes collectives trace without communicating, so only
the graphs are checked here (numerics: ``test_fusion_numerics.py``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import operator
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from passkit_fusion.model import LlamaConfig, TinyLlama, shard_dtensor, shard_functional
from passkit_fusion.patterns.sites import find_sites
from report_notes import pass_notes, version_notes

import passkit
from passkit import CompileContext
from passkit_testing import check_pass, count_ops, fake_world, op_counts, run_passes

REFERENCE = {"name": "allreduce_rmsnorm", "implementation": "reference"}
ALL_REDUCE = "_c10d_functional.all_reduce.default"
FUSED = "passkit_fusion.allreduce_rmsnorm.default"
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


# ---------------------------------------------------------------------------------------
# the forms, as model code writes them (w: norm weight, r: residual)


def ar(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    return funcol.all_reduce(x, op, dist.group.WORLD)


def llama_norm(
    h: torch.Tensor, w: torch.Tensor, eps: float = 1e-6, weight_right: bool = False
) -> torch.Tensor:
    dtype = h.dtype
    h = h.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(dtype) * w if weight_right else w * h.to(dtype)


def gemma_norm(h: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    out = h.float()
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + w.float())).type_as(h)


def llama_residual(x, r, w):
    return llama_norm(ar(x) + r, w)


def llama_weight_right(x, r, w):
    return llama_norm(ar(x) + r, w, eps=1e-5, weight_right=True)


def residual_first(x, r, w):
    return llama_norm(r + ar(x), w)


def square_as_mul(x, r, w):
    h = (ar(x) + r).float()
    h = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-6)
    return w * h.to(x.dtype)


def f_rms_norm(x, r, w):
    h = ar(x) + r
    return F.rms_norm(h, (h.shape[-1],), w, 1e-5)


def f_rms_norm_default_eps(x, r, w):
    h = ar(x) + r
    return F.rms_norm(h, (h.shape[-1],), w)


def f_rms_norm_weight_upcast(x, r, w):
    h = ar(x) + r
    return F.rms_norm(h.float(), (h.shape[-1],), w.float(), 1e-6).to(x.dtype)  # exact upcast


def gemma(x, r, w):
    return gemma_norm(ar(x) + r, w)


def pow_minus_half(x, r, w):
    """Gemma-3n's and Gemma-4's norm: ``torch.pow(mean + eps, -0.5)`` rather than ``rsqrt``."""
    h = (ar(x) + r).float()
    out = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5)
    return (out * w.float()).type_as(x)


def bias_in_activation_dtype(x, r, w):
    h = (ar(x) + r).float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (1.0 + w) * h.to(x.dtype)


def in_place_all_reduce(x, r, w):
    y = x.clone()
    dist.all_reduce(y)  # traced as all_reduce + wait_tensor + copy
    return llama_norm(y + r, w)


def no_residual(x, r, w):
    return llama_norm(ar(x), w, eps=0.1234)


def no_residual_result_used_later(x, r, w):
    y = ar(x)
    return llama_norm(y, w), y * 2  # y * 2 reads residual_out (= the all-reduce result)


def residual_sum_used_later(x, r, w):
    h = ar(x) + r
    return llama_norm(h, w), h


def weight_computed_late(x, r, w):
    h = ar(x) + r
    early = h * 3  # reads residual_out, which is defined with the weight, after this
    return llama_norm(h, w * 2), early


def two_chained_sites(x, r, w):
    h = ar(x) + r
    y = llama_norm(h, w)
    h = h + ar(y * 0.5)  # the first site's residual_out is the second's residual
    return llama_norm(h, w)


# between the all-reduce and the add: views keeping the hidden dim, constant scales, shared terms


def moe_reshape(x, r, w):
    """Mixtral's MoE block: experts on [tokens, hidden], the sum reshaped back to [B, S, H]."""
    return llama_norm(ar(x.reshape(-1, x.shape[-1])).view(r.shape) + r, w)


def unflatten_then_flatten(x, r, w):
    y = ar(x.flatten(0, -2)).unflatten(0, x.shape[:-1]).unsqueeze(0).squeeze(0)
    return llama_norm(y + r, w)


def in_place_then_view_and_clone(x, r, w):
    """Phi-3's tensor-parallel plan: an in-place all-reduce, views, then a copy."""
    y = x.clone()
    dist.all_reduce(y)
    return llama_norm(y.view(-1, y.shape[-1]).view(r.shape).clone() + r, w)


def granite_residual_multiplier(x, r, w):
    return llama_norm(r + ar(x) * 0.22, w)


def scale_is_a_0d_constant(x, r, w):
    return llama_norm(ar(x) * torch.tensor(0.5, dtype=x.dtype) + r, w)


def divided_by_a_number(x, r, w):
    return llama_norm(ar(x) / 4.0 + r, w)


def gemma_embedding_scale(x, r, w):
    h = ar(x) * (x.shape[-1] ** 0.5)  # vocab-parallel embedding, then * sqrt(hidden)
    return llama_norm(h, w), h  # h is the residual stream: reads residual_out


def shared_expert(x, r, w):
    shared = torch.tanh(r) * 0.5  # the shared expert: the same on every rank
    return llama_norm(ar(x) + shared + r, w)


def shared_expert_then_reshape(x, r, w):
    """Qwen2-MoE: routed + shared on [tokens, hidden], reshaped to [B, S, H], + residual."""
    tokens = x.reshape(-1, x.shape[-1])
    return llama_norm((ar(tokens) + torch.tanh(tokens)).view(r.shape) + r, w)


def reshape_scale_and_shared_expert(x, r, w):
    shared = torch.tanh(r)
    y = ar(x.reshape(-1, x.shape[-1])).view(r.shape) * 0.25
    return llama_norm(y + shared + r, w)


# without a weight (nanochat's NanoChatRMSNorm, F.rms_norm(x, (d,))): the op reads ones


def nanochat_norm(h: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    out = h.float()
    return (out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)).type_as(h)


def no_weight(x, r, w):
    h = (ar(x) + r).float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def no_weight_many_users(x, r, w):
    """nanochat's layers: the norm output (the normalised product, or its downcast) is
    read by several users (the q, k and v projections)."""
    h = ar(x) + r
    y = nanochat_norm(h)
    return torch.tanh(y), y.sum(-1), y[..., :8] * 2, h


def no_weight_no_residual(x, r, w):
    """nanochat's first norm, on the (vocab-parallel) embedding: no residual."""
    y = nanochat_norm(ar(x))
    return y + torch.tanh(y)


def no_weight_then_next_norm(x, r, w):
    """nanochat's first norm, on the embedding, in fp32: its output is the residual stream
    and the next norm's input, which multiplies it by its ``[..., 1]`` rsqrt (not a weight)."""
    y = nanochat_norm(ar(x))
    return nanochat_norm(y) * 2 + y


def no_weight_residual_stream(x, r, w):
    """nanochat: the first norm's output (on the embedding's sum) is the residual stream, the
    next site's residual; the layer reads it through its own norm."""
    y = nanochat_norm(ar(x))
    h = y + ar(torch.tanh(nanochat_norm(y)))
    return nanochat_norm(h)


def f_rms_norm_no_weight(x, r, w):
    h = ar(x) + r
    return F.rms_norm(h, (h.shape[-1],), None, 1e-5)


# negative forms


def no_weight_normed_also_used(x, r, w):
    h = (ar(x) + r).float()
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return n.to(x.dtype), n.sum()  # the fp32 product: an intermediate when the output is rounded


def no_weight_variance_also_used(x, r, w):
    h = ar(x) + r
    var = h.float().pow(2).mean(-1, keepdim=True)
    return (h.float() * torch.rsqrt(var + 1e-6)).type_as(h), var


def weighted_product_also_used(x, r, w):
    h = (ar(x) + r).float()
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * n, n * 2  # fp32: the weight multiply is the output, the product inside


def router_weighted(x, r, w):
    return llama_norm(ar(x) * torch.sigmoid(x[..., :1]) + r, w)  # not a constant: not linear


def view_splits_hidden(x, r, w):
    return gemma_norm(
        ar(x).view(*x.shape[:-1], 2, -1).sum(-2) + r[..., : x.shape[-1] // 2], w[: x.shape[-1] // 2]
    )


def scale_then_relu(x, r, w):
    return torch.relu(ar(x) * 0.22 + r) * w


def reduce_max(x, r, w):
    return llama_norm(ar(x, "max") + r, w)


def norm_over_dim0(x, r, w):
    h = (ar(x) + r).float()
    h = h * torch.rsqrt(h.pow(2).mean(0, keepdim=True) + 1e-6)
    return w * h.to(x.dtype)


def result_also_used(x, r, w):
    y = ar(x)
    return llama_norm(y + r, w), y * 2  # the kernel does not output y alone


def post_norm_embedding(x, r, w):
    h = ar(x)  # a post-norm model's embedding: read by the first layer and its residual add
    return torch.relu(h + llama_norm(torch.tanh(h), w))  # the norm is on the block output, not on h


def upcast_also_used(x, r, w):
    h = (ar(x) + r).float()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * out.to(x.dtype), h.sum()


def variance_also_used(x, r, w):
    h = (ar(x) + r).float()
    var = h.pow(2).mean(-1, keepdim=True)
    return w * (h * torch.rsqrt(var + 1e-6)).to(x.dtype), var


def residual_broadcasts(x, r, w):
    return llama_norm(ar(x) + w, w)  # a bias, not a residual


def residual_fp32(x, r, w):
    return llama_norm(ar(x) + r.float(), w)  # a residual stream kept in fp32


def no_norm(x, r, w):
    return torch.relu(ar(x) + r) * w


# ---------------------------------------------------------------------------------------
# the tables


@dataclasses.dataclass(frozen=True)
class Form:
    fn: Callable[..., Any]
    dtype: torch.dtype = bf16
    shape: tuple[int, ...] = (4, 64)
    weight_dtype: torch.dtype | None = None
    """The stored norm weight's dtype (default: ``dtype``)."""
    sites: int = 1
    residuals: int = 1
    eps: float = 1e-6
    weight_bias: float = 0.0

    def inputs(self) -> tuple[torch.Tensor, ...]:
        x, r = torch.randn(self.shape, dtype=self.dtype), torch.randn(self.shape, dtype=self.dtype)
        return x, r, torch.randn(self.shape[-1], dtype=self.weight_dtype or self.dtype)


def as_fp32(value: float) -> float:
    return float(torch.tensor(value, dtype=fp32))


FORMS = [
    Form(llama_residual),
    Form(llama_residual, dtype=fp16, shape=(2, 3, 64)),
    Form(llama_residual, dtype=fp32, shape=(2, 3, 64)),
    Form(llama_weight_right, shape=(2, 3, 128), eps=1e-5),
    Form(residual_first, dtype=fp16),
    Form(square_as_mul),
    Form(f_rms_norm, shape=(2, 3, 64), eps=as_fp32(1e-5)),  # F.rms_norm rounds eps to fp32
    Form(f_rms_norm_default_eps, dtype=fp16, eps=torch.finfo(fp32).eps),  # it computes in fp32
    Form(f_rms_norm_weight_upcast, dtype=fp16, eps=as_fp32(1e-6)),
    Form(gemma, shape=(2, 3, 64), weight_bias=1.0),
    Form(gemma, dtype=fp16, weight_bias=1.0),
    Form(bias_in_activation_dtype, weight_bias=1.0),
    Form(pow_minus_half, shape=(2, 3, 64)),
    Form(in_place_all_reduce, shape=(2, 3, 64)),
    Form(no_residual, residuals=0, eps=0.1234),
    Form(no_residual_result_used_later, dtype=fp16, shape=(2, 3, 64), residuals=0),
    Form(residual_sum_used_later),
    Form(weight_computed_late),
    Form(two_chained_sites, shape=(2, 3, 64), sites=2, residuals=2),
    Form(moe_reshape, shape=(2, 3, 64)),
    Form(moe_reshape, dtype=fp32, shape=(2, 3, 64)),
    Form(unflatten_then_flatten, shape=(2, 3, 64)),
    Form(in_place_then_view_and_clone, shape=(2, 3, 64)),
    Form(granite_residual_multiplier),
    Form(granite_residual_multiplier, dtype=fp32, shape=(2, 3, 64)),
    Form(scale_is_a_0d_constant, dtype=fp16),
    Form(divided_by_a_number),
    Form(gemma_embedding_scale, shape=(2, 3, 64), residuals=0),
    Form(shared_expert),
    Form(reshape_scale_and_shared_expert, shape=(2, 3, 64)),
    Form(shared_expert_then_reshape, shape=(2, 3, 64)),
    Form(no_weight),
    Form(no_weight, dtype=fp32, shape=(2, 3, 64)),
    Form(no_weight_many_users, shape=(2, 3, 64)),
    Form(no_weight_many_users, dtype=fp32, shape=(2, 3, 64)),
    Form(no_weight_no_residual, dtype=fp16, residuals=0),
    Form(no_weight_no_residual, dtype=fp32, residuals=0),
    Form(f_rms_norm_no_weight, shape=(2, 3, 64), eps=as_fp32(1e-5)),
]

NEGATIVES = [
    # (form, reason in the report, world size)
    (Form(reduce_max), "reduce op 'max'", 2),
    (Form(norm_over_dim0), "RMSNorm over dims [0], not the last (hidden) dim", 2),
    (
        Form(llama_residual, weight_dtype=fp32),
        "norm weight is float32: the weight multiply promotes the bfloat16 norm output to float32",
        2,
    ),
    pytest.param(
        Form(f_rms_norm, weight_dtype=fp32),
        "norm weight is float32 but activations are bfloat16",
        2,
        marks=pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight"),
    ),
    (Form(gemma, dtype=fp16, weight_dtype=fp32), "norm weight is float32 but activations are float16", 2),
    (Form(result_also_used), "all-reduce result is also used outside the residual add", 2),
    (Form(post_norm_embedding), "no norm follows (no RMSNorm reads the sum or its residual add)", 2),
    (Form(upcast_also_used), "fp32 upcast", 2),
    (Form(variance_also_used), "inside the RMSNorm, is also used outside it", 2),
    (Form(residual_broadcasts), "residual add broadcasts ([4, 64] + [64])", 2),
    (Form(residual_fp32, weight_dtype=fp32), "residual is float32 but the all-reduce is bfloat16", 2),
    (Form(no_weight_normed_also_used), "mul, inside the RMSNorm, is also used outside it", 2),
    (Form(no_weight_variance_also_used, dtype=fp32), "inside the RMSNorm, is also used outside it", 2),
    (Form(no_weight_variance_also_used), "inside the RMSNorm, is also used outside it", 2),
    (
        Form(weighted_product_also_used, dtype=fp32, shape=(2, 3, 64)),
        "mul, inside the RMSNorm, is also used outside it",
        2,
    ),
    (Form(no_norm), "all_reduce -> wait_tensor -> add -> relu: no RMSNorm after the all-reduce", 2),
    (Form(router_weighted), "all_reduce -> wait_tensor -> mul(·, ·): no RMSNorm after the all-reduce", 2),
    (
        Form(scale_then_relu),
        "all_reduce -> wait_tensor -> mul(·, 0.22) -> add -> relu: no RMSNorm after the all-reduce",
        2,
    ),
    (Form(view_splits_hidden, dtype=fp32), "all_reduce -> wait_tensor -> view: no RMSNorm", 2),
    (Form(llama_residual, shape=(4, 36)), "hidden size 36 is not a multiple of 8", 2),
    (Form(llama_residual, shape=(2, 16392)), "hidden size 16392 is above 16384", 2),
    (Form(llama_residual), "world size 3 not supported by the fused kernel", 3),
    (Form(llama_residual), "world size 6 not supported by the fused kernel", 6),
]


def _id(form: Form) -> str:
    weight = f"-w{str(form.weight_dtype).removeprefix('torch.')}" if form.weight_dtype else ""
    return f"{form.fn.__name__}-{str(form.dtype).removeprefix('torch.')}-{len(form.shape)}d{weight}"


def fuse(fn: Callable[..., Any], *inputs: Any, world_size: int = 2, **kwargs: Any):
    with fake_world(world_size):
        return run_passes(fn, *inputs, passes=[REFERENCE], **kwargs)


# ---------------------------------------------------------------------------------------
# positive forms


@pytest.mark.parametrize("form", FORMS, ids=_id)
def test_fuses_form(form: Form):
    result = fuse(form.fn, *form.inputs())
    before, after = op_counts(result.graph_before), result.graph_after
    assert before[ALL_REDUCE] == form.sites
    assert count_ops(after, ALL_REDUCE) == 0
    assert count_ops(after, "_c10d_functional.wait_tensor") == 0
    assert count_ops(after, "aten.rsqrt") == 0
    result.assert_matches("allreduce_rmsnorm", form.sites)
    fused = [n for n in after.graph.nodes if n.target is torch.ops.passkit_fusion.allreduce_rmsnorm.default]
    assert len(fused) == form.sites
    assert sum(n.args[1] is not None for n in fused) == form.residuals
    for node in fused:
        weight, eps, weight_bias, group, impl = node.args[2:7]
        assert weight.meta["val"].shape == (form.shape[-1],) and weight.meta["val"].dtype == form.dtype
        assert eps == form.eps and weight_bias == form.weight_bias
        assert impl == "reference" and group == "0"
    note = result.report["allreduce_rmsnorm"].notes[0]
    assert note.startswith(f"{form.sites} site(s) -> reference op: {form.residuals} with residual")


def test_fuses_with_a_dynamic_token_count(clean_env):
    form = Form(llama_residual, shape=(6, 64))
    backend = passkit.backend(passes=[REFERENCE], mode="eager", verify=True, on_error="raise")
    with fake_world(2):
        compiled = torch.compile(form.fn, backend=backend)
        for tokens in (6, 9):
            x, r, w = Form(llama_residual, shape=(tokens, 64)).inputs()
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(r, 0)
            assert compiled(x, r, w).shape == (tokens, 64)
    assert len(backend.reports) == 1  # one graph, symbolic in the token count
    assert backend.reports[0]["allreduce_rmsnorm"].matches == 1


def test_rejects_an_epsilon_that_is_a_graph_input():
    result = fuse(llama_residual, *Form(llama_residual).inputs(), dynamic=True)  # floats become inputs
    result.assert_matches("allreduce_rmsnorm", 0)
    note = result.report["allreduce_rmsnorm"].notes[0]
    if torch.__version__ < "2.12":  # dynamic=True makes the hidden size symbolic too: rejected first
        assert re.search(r"hidden size s\d+ is symbolic", note), note
    else:
        assert "the norm's epsilon is not a constant" in note


@pytest.mark.parametrize("world_size", [4, 8, 16])
def test_fuses_at_every_supported_world_size(world_size: int):
    result = fuse(llama_residual, *Form(llama_residual).inputs(), world_size=world_size)
    result.assert_matches("allreduce_rmsnorm", 1)


def test_fuses_on_a_tensor_parallel_subgroup():
    """TP=2 inside a world of 4: the kernel's world is the all-reduce's group, not the world."""

    def fn(x, r, w):
        return llama_norm(funcol.all_reduce(x, "sum", tp_group) + r, w)

    with fake_world(4):
        tp_group = dist.new_group([0, 1])
        result = run_passes(fn, *Form(fn).inputs(), passes=[REFERENCE])
    result.assert_matches("allreduce_rmsnorm", 1)
    (fused,) = [n for n in result.graph_after.graph.nodes if "allreduce_rmsnorm" in str(n.target)]
    assert fused.args[5] == tp_group.group_name != "0"


@pytest.mark.parametrize("sharding", ["functional", "dtensor"])
def test_fuses_every_site_of_a_tensor_parallel_llama(sharding: str):
    cfg = LlamaConfig()
    ids = torch.randint(0, cfg.vocab, (2, 5))
    with fake_world(2) as world:
        model = TinyLlama(cfg).to(bf16)
        if sharding == "functional":
            shard_functional(model, world.group, 0, 2)
        else:
            shard_dtensor(model, world.mesh)
        result = run_passes(model, ids, passes=[REFERENCE])
    assert op_counts(result.graph_before)[ALL_REDUCE] == cfg.sites() == 5
    assert count_ops(result.graph_after, ALL_REDUCE) == 0
    assert count_ops(result.graph_after, FUSED) == 5
    notes = result.report["allreduce_rmsnorm"].notes
    assert notes[0].startswith("5 site(s) -> reference op: 4 with residual, 1 without")
    assert notes[1] == "per layer: layers.0=2, layers.1=2, norm=1"


# ---------------------------------------------------------------------------------------
# negative forms


def _negative_id(case: Any) -> str:
    form, _, world_size = case.values if hasattr(case, "values") else case
    return f"{_id(form)}-ws{world_size}"


@pytest.mark.parametrize(
    ("form", "reason", "world_size"), NEGATIVES, ids=[_negative_id(c) for c in NEGATIVES]
)
def test_rejects_with_reason(form: Form, reason: str, world_size: int):
    result = fuse(form.fn, *form.inputs(), world_size=world_size)
    assert count_ops(result.graph_after, FUSED) == 0
    assert op_counts(result.graph_after)[ALL_REDUCE] == op_counts(result.graph_before)[ALL_REDUCE] == 1
    result.assert_matches("allreduce_rmsnorm", 0)
    note, *lost = pass_notes(result.report["allreduce_rmsnorm"])
    assert note.startswith("1 candidate(s) rejected: ")
    assert reason in note, note
    # where a norm follows anyway, the site is lost (warned about): its note gives the reason
    assert all(n.startswith("1 site(s) lost") and reason in n for n in lost), lost


def test_rejections_are_counted_per_reason():
    def fn(x, r, w):
        return llama_norm(ar(x) + r, w), ar(x, "max") * 1, ar(r, "max") * 1

    result = fuse(fn, *Form(fn).inputs())
    notes = pass_notes(result.report["allreduce_rmsnorm"])
    # the numeric check says it could not compare (collectives in one process): its own note
    notes = [n for n in notes if not n.startswith("numeric: not run:")]
    assert notes == [
        "1 site(s) -> reference op: 1 with residual, 0 without; plan " + notes[0].rsplit(" ", 1)[1],
        "2 candidate(s) rejected: reduce op 'max' (x2)",
    ]


ANY_REDUCE_OP = pytest.mark.skipif(
    "Any reduce_op" not in str(torch.ops._c10d_functional.all_reduce.default._schema),
    reason=f"torch {torch.__version__} registers all_reduce(..., str reduce_op, ...): no graph carries a ReduceOp",
)


@ANY_REDUCE_OP
@pytest.mark.parametrize(
    ("op", "reason"),
    [
        (dist.ReduceOp.SUM, None),
        (dist.ReduceOp.MAX, "reduce op 'max'"),
        (dist.ReduceOp.AVG, "reduce op 'avg'"),
    ],
    ids=["sum", "max", "avg"],
)
def test_an_all_reduce_carrying_a_reduce_op_is_read(op: Any, reason: str | None):
    """A graph whose all-reduce carries a ``dist.ReduceOp`` member (torch 2.15 registers
    ``all_reduce(Tensor input, Any reduce_op, Any group_name)``) fuses for ``SUM``, as the
    string ``"sum"`` does, and rejects any other op by its name.

    The graph is the traced one with the op's argument respelled: on torch 2.15.0 Dynamo does
    not trace ``funcol.all_reduce(x, dist.ReduceOp.SUM, group)`` (a graph break: the
    all-reduce runs eagerly, outside every graph passkit sees), and FX cannot print a
    ``RedOpType`` into a module's code, so such a graph reaches a pass only as a graph
    (``gm.graph``), never through ``recompile``: the SUM site's rewrite takes the op out."""
    from passkit_fusion import AllReduceRMSNorm

    form = Form(llama_residual)
    with fake_world(2):
        gm = run_passes(form.fn, *form.inputs(), passes=[REFERENCE]).graph_before
        (node,) = gm.graph.find_nodes(
            op="call_function", target=torch.ops._c10d_functional.all_reduce.default
        )
        node.args = (node.args[0], op, *node.args[2:])
        sites, rejected = find_sites(gm.graph)
        result = AllReduceRMSNorm(implementation="reference").run(gm, CompileContext(world_size=2))
    notes = [n for n in result.notes if n not in version_notes()]
    if reason is None:
        assert len(sites) == 1 and not rejected and sites[0].all_reduce is node
        assert result.matches == 1 and notes[0].startswith("1 site(s) -> reference op: 1 with residual"), (
            notes
        )
        assert count_ops(gm, FUSED) == 1 and count_ops(gm, ALL_REDUCE) == 0
        gm.recompile()  # no ReduceOp left in the graph
    else:
        assert not sites and [r.reason for r in rejected] == [reason]
        assert result.matches == 0 and notes == [f"1 candidate(s) rejected: {reason}"], notes
        assert count_ops(gm, FUSED) == 0 and count_ops(gm, ALL_REDUCE) == 1


def test_reduce_op_names_in_either_spelling():
    from passkit_fusion.dialects.torch import reduce_op_name

    assert [reduce_op_name(op) for op in ("sum", "SUM", "max", "avg")] == ["sum", "sum", "max", "avg"]
    assert reduce_op_name(dist.ReduceOp.SUM) == "sum" and reduce_op_name(dist.ReduceOp.AVG) == "avg"
    assert reduce_op_name(dist.ReduceOp(dist.ReduceOp.MAX)) == "max"  # a ReduceOp object: its op
    assert reduce_op_name(dist._make_nccl_premul_sum(2.0)) == "premul_sum"
    assert reduce_op_name(0) is None and reduce_op_name(None) is None


def test_version_notes_are_stripped_exactly(monkeypatch):
    """On a torch whose schemas are not recorded every fusion report carries the torch
    dialect's version note; ``pass_notes`` (what the tests above compare) takes out that
    note and nothing else."""
    from passkit_fusion.dialects.torch import TorchDialect

    minor = torch.__version__.split(".")[:2]
    others = tuple(v for v in TorchDialect.VERSIONS if v.split(".")[:2] != minor)
    monkeypatch.setattr(TorchDialect, "VERSIONS", others)

    def fn(x, r, w):
        return llama_norm(ar(x) + r, w), ar(x, "max") * 1

    record = fuse(fn, *Form(fn).inputs()).report["allreduce_rmsnorm"]
    (note,) = version_notes()
    assert (
        note.startswith("torch dialect: schemas recorded for torch ")
        and f"running {torch.__version__}" in note
    )
    assert record.notes.count(note) == 1
    assert pass_notes(record) == [n for n in record.notes if n != note]
    assert any(n.startswith("1 candidate(s) rejected: reduce op 'max'") for n in pass_notes(record))


def test_find_sites_leaves_the_graph_alone():
    with fake_world(2):
        result = run_passes(two_chained_sites, *Form(two_chained_sites).inputs(), passes=[REFERENCE])
        before = result.graph_before
        code = before.code
        sites, rejected = find_sites(before.graph)
    assert before.code == code and not rejected
    assert [s.residual is not None for s in sites] == [True, True]
    assert sites[1].residual is sites[0].total  # the second site reads the first one's sum


@pytest.mark.parametrize("dtype", [bf16, fp32])
def test_a_norm_without_weight_reads_a_ones_weight(dtype: torch.dtype):
    form = Form(no_weight_many_users, dtype=dtype, shape=(2, 3, 64))
    with fake_world(2):
        result = run_passes(form.fn, *form.inputs(), passes=[REFERENCE])
        sites, rejected = find_sites(result.graph_before.graph)
    (site,) = sites
    assert not rejected and site.weight is None and site.weight_bias == 0.0
    assert len(site.out.users) == 3  # the norm's output, read by three users
    assert site.out.target is (aten_mul if dtype == fp32 else torch.ops.prims.convert_element_type.default)
    (fused,) = [
        n
        for n in result.graph_after.graph.nodes
        if n.target is torch.ops.passkit_fusion.allreduce_rmsnorm.default
    ]
    weight = fused.args[2]
    assert weight.target is torch.ops.aten.ones.default and weight.args == ([64],)
    assert weight.kwargs["dtype"] == dtype and weight.kwargs["device"] == torch.device("cpu")
    assert weight.meta["val"].shape == (64,) and weight.meta["val"].dtype == dtype
    assert len(list(fused.users)) == 2  # norm_out (three users) and residual_out
    note = result.report["allreduce_rmsnorm"].notes[0]
    assert ", 1 RMSNorm(s) without weight (a ones weight);" in note, note


aten_mul = torch.ops.aten.mul.Tensor


@pytest.mark.parametrize("dtype", [bf16, fp32])
def test_a_norm_without_weight_read_by_the_next_norm(dtype: torch.dtype):
    """The next norm's ``mul(y, rsqrt(...))`` on the output is not a weight multiply."""
    form = Form(no_weight_then_next_norm, dtype=dtype, shape=(2, 3, 64), residuals=0)
    result = fuse(form.fn, *form.inputs())
    result.assert_matches("allreduce_rmsnorm", 1)
    assert count_ops(result.graph_after, ALL_REDUCE) == 0 and count_ops(result.graph_after, FUSED) == 1
    assert count_ops(result.graph_after, "aten.rsqrt") == 1  # the second norm's, unfused


@pytest.mark.parametrize("dtype", [bf16, fp32])
def test_a_norm_without_weight_whose_output_is_the_next_residual(dtype: torch.dtype):
    form = Form(no_weight_residual_stream, dtype=dtype, shape=(2, 3, 64))
    result = fuse(form.fn, *form.inputs())
    result.assert_matches("allreduce_rmsnorm", 2)
    fused = [n for n in result.graph_after.graph.nodes if str(n.target) == FUSED]
    assert len(fused) == 2 and fused[0].args[1] is None
    residual = fused[1].args[1]  # the first op's norm_out
    assert residual.target is operator.getitem and residual.args == (fused[0], 0)


# ---------------------------------------------------------------------------------------
# when the pass runs at all


def compile_report(passes: list[Any], world_size: int | None = 2) -> passkit.PassRecord:
    form = Form(llama_residual)
    backend = passkit.backend(passes=passes, mode="eager")
    if world_size is None:
        torch.compile(lambda x, r, w: llama_norm(x + r, w), backend=backend)(*form.inputs())
    else:
        with fake_world(world_size):
            torch.compile(form.fn, backend=backend)(*form.inputs())
    report = backend.last_report
    assert report is not None
    return report["allreduce_rmsnorm"]


def test_auto_on_a_cpu_graph_fuses_with_the_reference_op_and_says_so(clean_env, caplog):
    """``auto`` writes the op the graph's device runs: on a CPU graph the reference op (the
    pass the user named runs), and one WARNING-level line says which op was chosen."""
    from passkit_fusion import implementation

    implementation._said.clear()
    with caplog.at_level("WARNING", logger="passkit"):
        record = compile_report([{"name": "allreduce_rmsnorm"}])
        compile_report([{"name": "allreduce_rmsnorm"}])  # a second graph: said once
    assert (record.status, record.matches) == ("ran", 1)
    assert record.notes[0].startswith("1 site(s) -> reference op")
    chosen = [r.getMessage() for r in caplog.records if "writes the reference op" in r.getMessage()]
    assert chosen == [
        "passkit: allreduce_rmsnorm (implementation='auto') writes the reference op into this cpu graph: "
        "flashinfer's kernel needs CUDA; the reference op computes the same values with "
        "torch.distributed's all-reduce (the sites fuse, nothing gets faster). Set "
        "implementation='reference' to choose it without this line"
    ]


def test_flashinfer_pinned_on_a_cpu_graph_skips_with_one_warning(clean_env):
    from passkit._pipeline import declined

    declined.reset_declined_warnings()
    with pytest.warns(passkit.PassSkippedWarning) as caught:
        record = compile_report([{"name": "allreduce_rmsnorm", "implementation": "flashinfer"}])
        compile_report([{"name": "allreduce_rmsnorm", "implementation": "flashinfer"}])
    reason = (
        "flashinfer's fused kernel needs CUDA tensors (graph is on cpu) — "
        "set implementation='reference' to run the reference op"
    )
    assert (record.status, record.reason) == ("skipped", reason)
    skipped = [str(w.message) for w in caught if issubclass(w.category, passkit.PassSkippedWarning)]
    assert len(skipped) == 1 and skipped[0].endswith(f"is enabled but does not run: {reason}"), skipped


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed")
@pytest.mark.parametrize("implementation", ["auto", "flashinfer"])
def test_a_cuda_graph_without_flashinfer_skips_naming_the_fix(clean_env, implementation: str):
    backend = passkit.backend(passes=[{"name": "allreduce_rmsnorm", "implementation": implementation}])
    (p,) = backend.pipeline.passes
    with fake_world(2):
        reason = p.skip_reason(CompileContext(device="cuda", world_size=2, dtype=bf16))
    assert reason == (
        "flashinfer is not installed (pip install passkit-fusion[flashinfer]) — "
        "set implementation='reference' to run the reference op"
    )


def test_skips_without_a_process_group(clean_env):
    record = compile_report([REFERENCE], world_size=None)
    assert (record.status, record.reason) == ("skipped", "needs world size >= 2 (got 1)")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"implementation": "nccl"}, "passes.allreduce_rmsnorm.implementation"),
        ({"max_tokens": 0}, "passes.allreduce_rmsnorm.max_tokens"),
        (
            {"max_token": 4096},
            "unknown option (known options: implementation, max_tokens, restrict_tokens, check_rank_consistency, fuse_fp8_quant)",
        ),
    ],
)
def test_rejects_bad_options(clean_env, options: dict[str, Any], message: str):
    with pytest.raises(passkit.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        passkit.backend(passes=[{"name": "allreduce_rmsnorm", **options}])


def test_runtime_options_travel_in_the_graph():
    form = Form(llama_residual)
    options = {**REFERENCE, "max_tokens": 4096, "check_rank_consistency": False}
    with fake_world(2):
        result = run_passes(form.fn, *form.inputs(), passes=[options])
    (fused,) = [n for n in result.graph_after.graph.nodes if "allreduce_rmsnorm" in str(n.target)]
    assert fused.args[7:] == (4096, False)


def test_registered_through_the_entry_point_with_its_demo():
    plugins = passkit.get_plugins()
    info = plugins.passes["allreduce_rmsnorm"]
    assert (info.plugin.name, info.plugin.distribution) == ("fusion", "passkit-fusion")
    assert info.cls.stage is passkit.Stage.POST
    demos = {name for found in plugins.hook.passkit_demos() for name in (found or {})}
    assert "allreduce_rmsnorm" in demos


def test_conformance():
    """passkit-testing's checks every pass must pass (cache identity, options, idempotence,
    lint, plugin validity, importable without CUDA)."""
    variants = [{"implementation": "reference"}, {"implementation": "reference", "max_tokens": 4096}]
    with fake_world(2):
        check_pass(
            "allreduce_rmsnorm",
            options_variants=variants,
            sample=(llama_residual, Form(llama_residual).inputs()),
        )


def broken_before_the_norm(x, r, w):
    h = ar(x) + r
    torch._dynamo.graph_break()  # the all-reduce ends the first graph, its norm starts the next
    return llama_norm(h, w)


def test_an_all_reduce_that_ends_its_graph_is_reported_and_warned_once(clean_env):
    import warnings

    from passkit_fusion.patterns import sites

    sites._WARNED_GRAPH_END = False
    form = Form(broken_before_the_norm)
    records = []
    with fake_world(2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            torch._dynamo.reset()
            backend = passkit.backend(passes=[REFERENCE], mode="eager")
            torch.compile(form.fn, backend=backend)(*form.inputs())
            records += [report["allreduce_rmsnorm"] for report in backend.reports]
    first = records[0]
    assert first.matches == 0
    rejected = next(n for n in first.notes if "rejected" in n)
    assert (
        "ends its graph" in rejected
        and "Dynamo's graph break: Call to `torch._dynamo.graph_break()`" in rejected
    )
    assert any(
        n.startswith("1 all-reduce(s) end their graph") and "transformers 5.23.0" in n for n in first.notes
    )
    warned = [w for w in caught if "end their graph" in str(w.message)]
    assert len(warned) == 1, [str(w.message) for w in caught]


_DEFAULT_LOGS = """
import torch, torch.distributed as dist, torch.distributed._functional_collectives as funcol
import passkit
from passkit_testing import fake_world

def block(x, r, w):
    h = funcol.all_reduce(x, "sum", dist.group.WORLD) + r
    h32 = h.float()
    return w * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)

backend = passkit.backend(mode="eager")  # passes from PASSKIT_PASSES, as a server reads them
with fake_world(2):
    for n in (4, 8):  # two graphs: each line once per process
        torch._dynamo.reset()
        torch.compile(block, backend=backend)(torch.randn(n, 64), torch.randn(n, 64), torch.ones(64))
print(backend.last_report["allreduce_rmsnorm"].status)
"""


@pytest.mark.parametrize(
    ("passes", "status", "line"),
    [
        ("allreduce_rmsnorm", "ran", "writes the reference op into this cpu graph"),
        ("allreduce_rmsnorm:implementation=flashinfer", "skipped", "is enabled but does not run"),
    ],
    ids=["auto", "flashinfer"],
)
def test_at_default_log_settings_a_fresh_process_says_once_what_auto_chose_or_why_it_skipped(
    tmp_path, passes, status, line
):
    """No TORCH_LOGS, no logging set up: the first line a user reads says which op ``auto``
    chose on a CPU, or why a pinned ``flashinfer`` does nothing, once for two graphs."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS" and not k.startswith("PASSKIT_")}
    env["PASSKIT_PASSES"] = passes
    done = subprocess.run(
        [sys.executable, "-c", _DEFAULT_LOGS],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == status
    said = [x for x in done.stderr.splitlines() if line in x]
    # the log line, and the warning's (a PassSkippedWarning prints its message too)
    assert 1 <= len(said) <= 2 and len({x[x.index("passkit:") :] for x in said}) == 1, done.stderr
