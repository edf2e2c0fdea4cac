"""``allreduce_layernorm`` on traced graphs in a fake world: the LayerNorm sites it fuses (HF-style
decoder blocks with and without bias, ``F.layer_norm``, the sum used later), the ones it
leaves with a reason, RMSNorm sites left to ``allreduce_rmsnorm`` and LayerNorm sites that
``allreduce_rmsnorm`` leaves naming ``allreduce_layernorm``; options, registration, opt-in.
Numerics on gloo: ``test_layernorm_numerics.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from layernorm_models import ar, make_decoder

import passkit
from passkit_testing import check_pass, count_ops, fake_world, op_counts, run_passes

LN_REFERENCE = {"name": "allreduce_layernorm", "implementation": "reference"}
RMS_REFERENCE = {"name": "allreduce_rmsnorm", "implementation": "reference"}
ALL_REDUCE = "_c10d_functional.all_reduce.default"
FUSED = "passkit_fusion.allreduce_add_layernorm.default"
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


def fuse(fn, *inputs, passes=(LN_REFERENCE,), world_size: int = 2):
    with fake_world(world_size):
        return run_passes(fn, *inputs, passes=list(passes))


def ln_residual(x, r, w, b):
    h = ar(x) + r
    return F.layer_norm(h, (h.shape[-1],), w, b, 1e-5), h


def ln_residual_first_no_bias(x, r, w, b):
    h = r + ar(x)
    return F.layer_norm(h, (h.shape[-1],), w, None, 1e-6)


def ln_no_residual(x, r, w, b):
    y = ar(x)
    return F.layer_norm(y, (y.shape[-1],), w, b, 1e-5), y * 2


def ln_two_dims(x, r, w, b):
    h = ar(x) + r
    return F.layer_norm(h, h.shape[-2:], None, None, 1e-5)


def ln_no_weight(x, r, w, b):
    h = ar(x) + r
    return F.layer_norm(h, (h.shape[-1],), None, None, 1e-5)


def rms(x, r, w, b):
    h = ar(x) + r
    return F.rms_norm(h, (h.shape[-1],), w, 1e-5)


def inputs(shape=(4, 64), dtype=bf16, weight_dtype=None):
    t = lambda *s, d=dtype: torch.randn(*s, dtype=d)  # noqa: E731
    return t(*shape), t(*shape), t(shape[-1], d=weight_dtype or dtype), t(shape[-1], d=weight_dtype or dtype)


@pytest.mark.parametrize(
    ("fn", "dtype", "shape", "residuals", "bias", "eps"),
    [
        (ln_residual, bf16, (4, 64), 1, True, 1e-5),
        (ln_residual, fp16, (2, 3, 64), 1, True, 1e-5),
        (ln_residual, fp32, (2, 3, 128), 1, True, 1e-5),
        (ln_residual_first_no_bias, bf16, (4, 64), 1, False, 1e-6),
        (ln_no_residual, bf16, (4, 64), 0, True, 1e-5),
        (ln_no_weight, fp32, (4, 64), 1, False, 1e-5),
        (ln_no_weight, bf16, (2, 3, 64), 1, False, 1e-5),
    ],
    ids=[
        "bf16-2d",
        "fp16-3d",
        "fp32-3d",
        "residual-first-no-bias",
        "no-residual",
        "no-weight-fp32",
        "no-weight-bf16",
    ],
)
def test_fuses_layernorm_form(fn, dtype, shape, residuals, bias, eps):
    result = fuse(fn, *inputs(shape, dtype))
    assert op_counts(result.graph_before)[ALL_REDUCE] == 1
    assert count_ops(result.graph_after, ALL_REDUCE) == 0
    assert count_ops(result.graph_after, "aten.var_mean") == 0
    result.assert_matches("allreduce_layernorm", 1)
    (node,) = [
        n
        for n in result.graph_after.graph.nodes
        if n.target is torch.ops.passkit_fusion.allreduce_add_layernorm.default
    ]
    _, res, w, b, got_eps, group, impl, kernel, max_bytes = node.args
    assert (res is not None) == bool(residuals) and (b is not None) == bias
    assert (w is None) == (fn is ln_no_weight) and got_eps == pytest.approx(eps)
    assert w is None or w.meta["val"].shape == (shape[-1],)
    assert (group, impl, kernel, max_bytes) == ("0", "reference", "triton", 4 * 2**20)
    note = result.report["allreduce_layernorm"].notes[0]
    assert note.startswith(f"1 LayerNorm site(s) -> reference op: {residuals} with residual")


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [bf16, fp32])
def test_fuses_every_site_of_a_layernorm_decoder(bias: bool, dtype: torch.dtype):
    x = torch.randn(2, 5, 64, dtype=dtype)
    with fake_world(2):
        model = make_decoder(bias, dtype, rank=0)
        result = run_passes(model, x, passes=[LN_REFERENCE])
    assert op_counts(result.graph_before)[ALL_REDUCE] == 4
    assert count_ops(result.graph_after, ALL_REDUCE) == 0  # every all-reduce fused
    assert count_ops(result.graph_after, FUSED) == 4
    notes = result.report["allreduce_layernorm"].notes
    assert notes[0].startswith(
        f"4 LayerNorm site(s) -> reference op: 4 with residual, 0 without; {4 if bias else 0} with bias"
    )
    assert notes[1] == "per layer: layers.0=1, layers.1=2, norm=1", notes


def test_fuses_the_norms_of_a_non_contiguous_input():
    """A transposed input: each norm reads ``x.contiguous()`` of the residual stream, a copy the
    site takes with the norm (issue 45: 0 of 4 fused, with a reason that saw no LayerNorm)."""
    x = torch.randn(5, 2, 64, dtype=bf16).transpose(0, 1)
    assert not x.is_contiguous()
    with fake_world(2):
        model = make_decoder(True, bf16, rank=0)
        result = run_passes(model, x, passes=[LN_REFERENCE])
    assert count_ops(result.graph_before, torch.ops.aten.clone.default) > 0  # the copies are there
    assert (count_ops(result.graph_after, ALL_REDUCE), count_ops(result.graph_after, FUSED)) == (0, 4)
    assert result.report["allreduce_layernorm"].matches == 4


def test_parallel_residual_block_reports_what_it_takes():
    """GPT-NeoX's parallel residual (``x + AR(attn) + AR(mlp)``, both norms of the next layer
    reading the sum): the count of all-reduces left matches the report."""
    x = torch.randn(2, 5, 64, dtype=bf16)
    with fake_world(2):
        model = make_decoder(True, bf16, rank=0, parallel=True)
        result = run_passes(model, x, passes=[LN_REFERENCE])
    before = op_counts(result.graph_before)[ALL_REDUCE]
    after = count_ops(result.graph_after, ALL_REDUCE)
    record = result.report["allreduce_layernorm"]
    merged = sum(int(n.split("; ")[-1].split(" ")[0]) for n in record.notes if "merged into a site" in n)
    assert before == 4 and record.matches >= 1
    assert before - after == record.matches + merged


def test_parallel_residual_with_row_parallel_biases_is_one_all_reduce_per_block():
    """GPT-NeoX's and Phi's parallel block, ``(AR(mlp) + b_mlp) + (AR(attn) + b_attn) + x``:
    the two all-reduces merge into one site, ``AR(attn + mlp) + (b_attn + b_mlp + x)`` (the
    biases join the residual after the all-reduce, never summed over the ranks): one fused op
    per block, no all-reduce left, the report counting both."""
    x = torch.randn(2, 5, 64, dtype=bf16)
    with fake_world(2):
        model = make_decoder(True, bf16, rank=0, parallel="biased")
        result = run_passes(model, x, passes=[LN_REFERENCE])
    assert op_counts(result.graph_before)[ALL_REDUCE] == 4
    assert count_ops(result.graph_after, ALL_REDUCE) == 0
    assert count_ops(result.graph_after, FUSED) == 2
    record = result.report["allreduce_layernorm"]
    assert record.matches == 2 and any("2 all-reduce(s) merged into a site's" in n for n in record.notes), (
        record
    )
    biases = {n.name for n in result.graph_after.graph.nodes if n.op == "placeholder" and "_bias" in n.name}
    for node in result.graph_after.graph.nodes:  # a bias is added after the all-reduce only
        if node.target is torch.ops.passkit_fusion.allreduce_add_layernorm.default:
            x_input = node.args[0]
            assert not (biases & {a.name for a in x_input.all_input_nodes}), x_input


@pytest.mark.parametrize(
    ("fn", "weight_dtype", "reason"),
    [
        (ln_two_dims, None, "LayerNorm over dims"),
        (ln_residual, fp32, "LayerNorm weight is float32 but activations are bfloat16"),
        (rms, None, "an RMSNorm follows (allreduce_rmsnorm's site, not allreduce_layernorm's)"),
    ],
    ids=["two-dims", "fp32-weight", "rmsnorm"],
)
def test_rejects_with_reason(fn, weight_dtype, reason):
    result = fuse(fn, *inputs(weight_dtype=weight_dtype))
    assert count_ops(result.graph_after, ALL_REDUCE) == 1
    result.assert_matches("allreduce_layernorm", 0)
    note, *lost = result.report["allreduce_layernorm"].notes
    assert note.startswith("1 candidate(s) rejected: ") and reason in note, note
    # a LayerNorm follows but was not taken: a lost site (warned about), its note with the reason;
    # an RMSNorm is allreduce_rmsnorm's site, not lost
    expect_lost = "allreduce_rmsnorm's site" not in reason
    assert len(lost) == expect_lost and all(n.startswith("1 site(s) lost") and reason in n for n in lost), (
        lost
    )


def test_allreduce_rmsnorm_leaves_layernorm_sites_naming_allreduce_layernorm():
    x = torch.randn(2, 5, 64, dtype=bf16)
    with fake_world(2):
        result = run_passes(make_decoder(True, bf16, rank=0), x, passes=[RMS_REFERENCE])
    assert count_ops(result.graph_after, ALL_REDUCE) == 4
    (note,) = result.report["allreduce_rmsnorm"].notes
    assert note.startswith("4 candidate(s) rejected: ")
    reason = "a LayerNorm follows (allreduce_layernorm's site: enable that pass to fuse it)"
    assert note.count(reason) == 2 and f"{reason} (x3)" in note, note  # 3 reach a next add, 1 the final norm


def test_both_passes_together_take_their_own_sites():
    def fn(x, r, w, b):
        h = ar(x) + r
        n = F.layer_norm(h, (h.shape[-1],), w, b, 1e-5)
        h2 = h + ar(n)
        return F.rms_norm(h2, (h2.shape[-1],), w, 1e-5), h2

    result = fuse(fn, *inputs(), passes=(RMS_REFERENCE, LN_REFERENCE))
    assert count_ops(result.graph_after, ALL_REDUCE) == 0
    result.assert_matches("allreduce_rmsnorm", 1)
    result.assert_matches("allreduce_layernorm", 1)


def test_registered_enabled_by_name_and_options():
    plugins = passkit.get_plugins()
    info = plugins.passes["allreduce_layernorm"]
    assert (info.plugin.name, info.plugin.distribution) == ("fusion", "passkit-fusion")
    assert info.cls.stage is passkit.Stage.POST
    module = __import__(info.cls.__module__, fromlist=["AllReduceLayerNorm"])
    assert "1.05x" in (info.cls.__doc__ or "") and "1.05x" in (module.__doc__ or "")  # the gate it passed
    assert "allreduce_layernorm" not in str(passkit.Config().passes)  # in no default pass set
    with pytest.raises(passkit.ConfigError, match=r"passes\.allreduce_layernorm\.norm_kernel"):
        passkit.backend(passes=[{"name": "allreduce_layernorm", "norm_kernel": "cuda"}])
    with pytest.raises(passkit.ConfigError, match=r"passes\.allreduce_layernorm\.max_bytes"):
        passkit.backend(passes=[{"name": "allreduce_layernorm", "max_bytes": 0}])


def test_auto_on_cpu_writes_the_reference_op_and_symm_mem_skips(clean_env):
    """``auto`` writes the op a CPU graph runs (the reference op); ``symm_mem``, pinned,
    skips there with the reason and the fix."""
    records = {}
    for implementation in ("auto", "symm_mem"):
        backend = passkit.backend(
            passes=[{"name": "allreduce_layernorm", "implementation": implementation}], mode="eager"
        )
        with fake_world(2):
            torch.compile(ln_residual, backend=backend)(*inputs())
        records[implementation] = backend.last_report["allreduce_layernorm"]
        torch._dynamo.reset()
    assert (records["auto"].status, records["auto"].matches) == ("ran", 1)
    assert records["auto"].notes[0].startswith("1 LayerNorm site(s) -> reference op"), records["auto"].notes
    assert records["symm_mem"].status == "skipped"
    assert records["symm_mem"].reason.startswith(
        "the symmetric-memory all-reduce needs CUDA tensors (graph is on cpu)"
    )


def test_conformance():
    with fake_world(2):
        check_pass(
            "allreduce_layernorm",
            options_variants=[
                {"implementation": "reference"},
                {"implementation": "reference", "norm_kernel": "torch"},
            ],
            sample=(ln_residual, inputs()),
        )


def _graph_input(fn, *inputs, **kwargs):  # type: ignore[no-untyped-def]
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, tracing_mode="fake", **kwargs)(*inputs)
    return next(n for n in gm.graph.nodes if n.op == "placeholder"), gm


@pytest.mark.parametrize("pre_dispatch", [False, True], ids=["native_layer_norm", "layer_norm"])
def test_matches_the_layernorm_ops_where_a_graph_keeps_them(pre_dispatch: bool):
    """``native_layer_norm(h, [H], w, b, eps)[0]`` and ``layer_norm(...)``: the op forms."""
    from passkit_fusion.patterns.layernorm import match_layernorm

    def fn(h, w, b):
        return F.layer_norm(h, (h.shape[-1],), w, b, 1e-6)

    h, _ = _graph_input(fn, *inputs()[:1], *inputs()[2:], pre_dispatch=pre_dispatch)
    found = match_layernorm(h)
    assert (found.weight.name, found.bias.name, found.eps) == ("w_1", "b_1", 1e-6)
    assert found.out.users and next(iter(found.out.users)).op == "output"


def test_matches_cohere_hand_written_layernorm():
    from passkit_fusion.patterns.layernorm import match_layernorm

    def cohere(h, w):  # CohereLayerNorm.forward
        x = h.to(torch.float32)
        mean = x.mean(-1, keepdim=True)
        variance = (x - mean).pow(2).mean(-1, keepdim=True)
        x = (x - mean) * torch.rsqrt(variance + 1e-5)
        return (w.to(torch.float32) * x).to(h.dtype)

    x, _, w, _ = inputs()
    h, _ = _graph_input(cohere, x, w)
    found = match_layernorm(h)
    assert (found.weight.name, found.bias, found.eps) == ("w_1", None, 1e-5)


def test_rejects_an_op_form_weight_in_another_dtype():
    from passkit_fusion.patterns.graph import Mismatch
    from passkit_fusion.patterns.layernorm import match_layernorm

    def fn(h, w, b):
        return F.layer_norm(h.float(), (h.shape[-1],), w, b, 1e-6).to(h.dtype)

    x, _, w, b = inputs(weight_dtype=fp32)
    h, _ = _graph_input(fn, x, w, b)
    with pytest.raises(Mismatch, match="LayerNorm on the fp32 upcast of its input"):
        match_layernorm(h)
