"""``sequence_parallel`` on traced graphs in a fake world: the forms it rewrites (first,
middle and last sites, every RMSNorm form, 2-D/3-D, dtypes), the ones it leaves alone
with a reason, its options, token constraint and skips.

Graphs come from ``torch.compile`` in passkit's eager mode with the fake process group (no
communication; numerics: ``test_sequence_parallel_numerics.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from passkit_fusion.model import LlamaConfig, TinyLlama, shard_dtensor, shard_functional
from passkit_fusion.sequence_parallel import SequenceParallel
from report_notes import pass_notes
from sp_counts import reduce_scatters
from test_matcher import (
    Form,
    bias_in_activation_dtype,
    f_rms_norm,
    f_rms_norm_no_weight,
    gemma,
    in_place_all_reduce,
    llama_norm,
    llama_residual,
    llama_weight_right,
    no_residual,
    no_residual_result_used_later,
    no_weight,
    no_weight_many_users,
    no_weight_no_residual,
    no_weight_residual_stream,
    no_weight_then_next_norm,
    norm_over_dim0,
    reduce_max,
    residual_first,
    residual_sum_used_later,
    square_as_mul,
    two_chained_sites,
)

import passkit
from passkit import CompileContext, TokenConstraint, TokenRange
from passkit._pipeline import verify
from passkit_testing import check_pass, copy_graph_module, count_ops, fake_world, resolve_passes, run_passes

SP = {"name": "sequence_parallel", "min_tokens": 1}
ALL_REDUCE = "_c10d_functional.all_reduce.default"
REDUCE_SCATTER = "_c10d_functional.reduce_scatter_tensor.default"
ALL_GATHER = "_c10d_functional.all_gather_into_tensor.default"
TOKEN_SHARD = "passkit_fusion.token_shard.default"
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


def rewrite(fn: Any, *inputs: Any, world_size: int = 2, passes: list[Any] | None = None, **kwargs: Any):
    with fake_world(world_size):
        return run_passes(fn, *inputs, passes=passes or [SP], **kwargs)


def norm_args(graph: torch.fx.GraphModule) -> list[tuple[tuple[Any, ...], Any]]:
    """(shape, dtype) of every rsqrt: the norms run on the shards."""
    return [
        (tuple(n.meta["val"].shape), n.meta["val"].dtype)
        for n in graph.graph.nodes
        if n.target is torch.ops.aten.rsqrt.default
    ]


# (form, sites, residual shards sliced, gathers of the sum for other users)
FORMS = [
    (Form(llama_residual, shape=(8, 64)), 1, 1, 0),
    (Form(llama_residual, dtype=fp16, shape=(2, 4, 64)), 1, 1, 0),
    (Form(llama_residual, dtype=fp32, shape=(2, 4, 64)), 1, 1, 0),
    (Form(llama_weight_right, shape=(2, 4, 128)), 1, 1, 0),
    (Form(residual_first, dtype=fp16, shape=(8, 64)), 1, 1, 0),
    (Form(square_as_mul, shape=(8, 64)), 1, 1, 0),
    (Form(f_rms_norm, shape=(2, 4, 64)), 1, 1, 0),
    (Form(gemma, shape=(2, 4, 64)), 1, 1, 0),
    (Form(gemma, dtype=fp16, shape=(8, 64)), 1, 1, 0),
    (Form(bias_in_activation_dtype, shape=(8, 64)), 1, 1, 0),
    (Form(in_place_all_reduce, shape=(2, 4, 64)), 1, 1, 0),
    (Form(no_residual, shape=(8, 64)), 1, 0, 0),
    (Form(no_residual_result_used_later, dtype=fp16, shape=(2, 4, 64)), 1, 0, 1),
    (Form(residual_sum_used_later, shape=(8, 64)), 1, 1, 1),
    (Form(two_chained_sites, shape=(2, 4, 64)), 2, 1, 0),
    (Form(llama_residual, shape=(8, 36)), 1, 1, 0),  # hidden sizes the fused kernel refuses
    # without a weight (nanochat): the norm's own nodes copied, its output read by many users
    (Form(no_weight, shape=(8, 64)), 1, 1, 0),
    (Form(no_weight_many_users, shape=(2, 4, 64)), 1, 1, 1),
    (Form(no_weight_many_users, dtype=fp32, shape=(2, 4, 64)), 1, 1, 1),
    (Form(no_weight_no_residual, dtype=fp32, shape=(8, 64)), 1, 0, 0),
    (Form(f_rms_norm_no_weight, shape=(2, 4, 64)), 1, 1, 0),
]


def _id(case: tuple[Form, int, int, int]) -> str:
    form = case[0]
    return f"{form.fn.__name__}-{str(form.dtype).removeprefix('torch.')}-{len(form.shape)}d-h{form.shape[-1]}"


@pytest.mark.parametrize(("form", "sites", "sliced", "gathered"), FORMS, ids=[_id(c) for c in FORMS])
def test_rewrites_form(form: Form, sites: int, sliced: int, gathered: int):
    result = rewrite(form.fn, *form.inputs())
    after = result.graph_after
    result.assert_matches("sequence_parallel", sites)
    assert count_ops(after, ALL_REDUCE) == 0
    assert reduce_scatters(after) == sites
    assert count_ops(after, ALL_GATHER) == sites + gathered
    assert count_ops(after, TOKEN_SHARD) == sliced
    tokens = form.shape[0] * (form.shape[1] if len(form.shape) == 3 else 1)
    assert norm_args(after) == [((tokens // 2, 1), fp32)] * sites  # the norm on this rank's half
    note = result.report["sequence_parallel"].notes[0]
    assert note.startswith(f"{sites} site(s) -> reduce-scatter + RMSNorm on 1/2 of the tokens")
    assert f"{sliced} residual(s) sliced (first)" in note and f"{gathered} sum(s) gathered" in note


def test_a_norm_without_weight_read_by_the_next_norm():
    """nanochat's first norm (fp32, no weight): the next norm's ``mul(y, rsqrt)`` on its
    output is one of its users, not a weight multiply."""
    form = Form(no_weight_then_next_norm, dtype=fp32, shape=(8, 64))
    result = rewrite(form.fn, *form.inputs())
    result.assert_matches("sequence_parallel", 1)
    after = result.graph_after
    assert count_ops(after, ALL_REDUCE) == 0 and reduce_scatters(after) == 1
    assert norm_args(after) == [((4, 1), fp32), ((8, 1), fp32)]  # the site's on the shard, the next


@pytest.mark.parametrize("dtype", [bf16, fp32])
def test_a_norm_output_that_is_the_next_residual_stays_sharded(dtype: torch.dtype):
    """nanochat: the first norm's output (no weight) is the next site's residual: that site
    adds its reduce-scatter to the norm output's shard, not to a slice of its gather."""
    form = Form(no_weight_residual_stream, dtype=dtype, shape=(2, 4, 64))
    result = rewrite(form.fn, *form.inputs())
    result.assert_matches("sequence_parallel", 2)
    after = result.graph_after
    assert count_ops(after, ALL_REDUCE) == 0 and count_ops(after, TOKEN_SHARD) == 0
    assert reduce_scatters(after) == 2 and count_ops(after, ALL_GATHER) == 2
    note = result.report["sequence_parallel"].notes[0]
    assert "0 residual(s) sliced (first), 1 already sharded (middle), 1 without residual" in note
    adds = [n for n in after.graph.nodes if n.target is torch.ops.aten.add.Tensor and n.args[1] is not None]
    assert [tuple(n.meta["val"].shape) for n in adds if n.meta["val"].shape[-1] == 64] == [(4, 64)]


def test_middle_sites_keep_the_residual_sharded():
    result = rewrite(two_chained_sites, *Form(two_chained_sites, shape=(8, 64)).inputs())
    note = result.report["sequence_parallel"].notes[0]
    assert "1 residual(s) sliced (first), 1 already sharded (middle)" in note
    # the second add reads the first site's sharded sum: both adds are on [4, 64]
    adds = [n for n in result.graph_after.graph.nodes if n.target is torch.ops.aten.add.Tensor]
    assert [tuple(n.meta["val"].shape) for n in adds if n.meta["val"].shape[-1] == 64] == [(4, 64)] * 2


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("sharding", ["functional", "dtensor"])
def test_tensor_parallel_llama_first_middle_last(sharding: str, world_size: int):
    cfg = LlamaConfig(kv_heads=4)
    ids = torch.randint(0, cfg.vocab, (2, 8))
    with fake_world(world_size) as world:
        model = TinyLlama(cfg).to(bf16)
        if sharding == "functional":
            shard_functional(model, world.group, 0, world_size)
        else:
            shard_dtensor(model, world.mesh)
        result = run_passes(model, ids, passes=[SP])
    after = result.graph_after
    assert count_ops(after, ALL_REDUCE) == 0
    assert reduce_scatters(after) == count_ops(after, ALL_GATHER) == cfg.sites() == 5
    assert count_ops(after, TOKEN_SHARD) == 0  # the embedding's sum is the first residual
    notes = result.report["sequence_parallel"].notes
    assert notes[0].startswith(
        f"5 site(s) -> reduce-scatter + RMSNorm on 1/{world_size} of the tokens + all-gather: "
        "0 residual(s) sliced (first), 4 already sharded (middle), 1 without residual; "
        "0 sum(s) gathered for other users (last)"
    )
    assert notes[1] == "per layer: layers.0=2, layers.1=2, norm=1"
    assert norm_args(after) == [((16 // world_size, 1), fp32)] * 5


def test_last_site_gathers_the_residual_for_other_users():
    def fn(x, r, w):
        h = funcol.all_reduce(x, "sum", dist.group.WORLD) + r
        y = llama_norm(h, w)
        h2 = h + funcol.all_reduce(y * 2, "sum", dist.group.WORLD)
        return llama_norm(h2, w), h2 * 3  # the final sum is also an output

    result = rewrite(fn, *Form(fn, shape=(8, 64)).inputs())
    result.assert_matches("sequence_parallel", 2)
    assert count_ops(result.graph_after, ALL_GATHER) == 3
    assert "1 already sharded (middle)" in result.report["sequence_parallel"].notes[0]
    assert "1 sum(s) gathered for other users (last)" in result.report["sequence_parallel"].notes[0]


NEGATIVES = [
    (Form(reduce_max, shape=(8, 64)), "reduce op 'max'", 2),
    (
        Form(norm_over_dim0, shape=(8, 64)),
        "all_reduce -> wait_tensor -> add -> convert_element_type: RMSNorm over dims [0], not the last (hidden) dim",
        2,
    ),
    # (1, 7, 64): the backend reads no static token count from it (which dim?), the pass runs
    (Form(llama_residual, shape=(1, 7, 64)), "7 tokens: not a multiple of the group size 2", 2),
    (Form(llama_residual, shape=(2, 3, 64)), "6 tokens: not a multiple of the group size 4", 4),
    (Form(llama_residual, shape=(2, 5, 64)), "10 tokens: not a multiple of the group size 4", 4),
]


@pytest.mark.parametrize(("form", "reason", "world_size"), NEGATIVES, ids=[c[1][-40:] for c in NEGATIVES])
def test_rejects_with_reason(form: Form, reason: str, world_size: int):
    result = rewrite(form.fn, *form.inputs(), world_size=world_size)
    result.assert_matches("sequence_parallel", 0)
    assert reduce_scatters(result.graph_after) == 0
    assert count_ops(result.graph_after, ALL_REDUCE) == 1
    note, *lost = pass_notes(result.report["sequence_parallel"])
    assert note == f"1 candidate(s) rejected: {reason}"
    # a norm the matcher did not take follows: a lost site, its note with the reason (a reduce
    # op the dialect reads as no site at all, and the token counts, the pass's own choice, are not)
    expect_lost = "RMSNorm over dims" in reason
    assert len(lost) == expect_lost and all(n.startswith("1 site(s) lost") and reason in n for n in lost), (
        lost
    )


def test_static_token_counts_outside_the_range_are_left_alone():
    """A (tokens, hidden) graph with static shapes serves its token count: the backend skips
    the pass where its range does not hold it; a graph whose inputs do not say their token
    count (1, 8, 64) runs the pass, which checks each site's count itself."""
    form = Form(llama_residual, shape=(8, 64))
    result = rewrite(form.fn, *form.inputs(), passes=[{"name": "sequence_parallel"}])  # min 4096
    record = result.report["sequence_parallel"]
    assert (record.status, record.reason) == (
        "skipped",
        "static tokens 8 outside its range tokens >= 4096, multiples of 2",
    )
    odd = Form(llama_residual, shape=(7, 64))
    record = rewrite(odd.fn, *odd.inputs()).report["sequence_parallel"]  # min 1
    assert record.reason == "static tokens 7 is not a multiple of 2 (its range: tokens >= 1, multiples of 2)"
    unclear = Form(llama_residual, shape=(1, 8, 64))
    result = rewrite(unclear.fn, *unclear.inputs(), passes=[{"name": "sequence_parallel"}])
    result.assert_matches("sequence_parallel", 0)
    assert pass_notes(result.report["sequence_parallel"]) == [
        "1 candidate(s) rejected: 8 tokens: outside min_tokens..max_tokens (4096..)"
    ]
    unrestricted = {"name": "sequence_parallel", "restrict_tokens": False}
    rewrite(form.fn, *form.inputs(), passes=[unrestricted]).assert_matches("sequence_parallel", 1)


class _Capture(passkit.GraphPass):
    """Keeps a copy of the post-grad graph it sees."""

    name = "capture"
    graphs: list[torch.fx.GraphModule] = []

    def run(self, gm, ctx):
        self.graphs.append(copy_graph_module(gm))
        return passkit.PassResult()


def _symbolic_graph(shape: tuple[int, ...]) -> torch.fx.GraphModule:
    """The post-grad graph of ``llama_residual`` with a dynamic token dim (dim 0)."""
    _Capture.graphs = []
    pipeline = passkit.Pipeline(passkit.Config(), passkit.get_plugins(), [_Capture()])
    backend = passkit.Backend(mode="eager", pipeline=pipeline)
    x, r, w = Form(llama_residual, shape=shape).inputs()
    torch._dynamo.reset()
    for t in (x, r):
        torch._dynamo.mark_dynamic(t, 0)
    torch.compile(llama_residual, backend=backend, fullgraph=True)(x, r, w)
    (gm,) = _Capture.graphs
    return gm


@pytest.mark.parametrize(
    ("shape", "relabels"),
    [((8, 64), 1), ((8, 3, 64), 1), ((8, 2, 64), 0)],  # T = s, 3*s: relabel; 2*s: 2*(2*s//2) == 2*s
    ids=["2d", "3d", "3d-even"],
)
def test_symbolic_token_count_needs_a_range_of_multiples(shape: tuple[int, ...], relabels: int):
    sp = SequenceParallel(min_tokens=1)
    with fake_world(2):
        for token_range, matches, reason in [
            (None, 0, "no token range"),
            (TokenRange(1, None, 1), 0, "this compile serves tokens >= 1"),
            (TokenRange(4, None, 2), 1, None),
        ]:
            gm = _symbolic_graph(shape)
            result = sp.run(gm, CompileContext(world_size=2, token_range=token_range))
            assert result.matches == matches, result.notes
            if reason:
                assert reason in result.notes[0] and "symbolic token count" in result.notes[0]
                continue
            # the gathered rows are re-labelled [T, H] without a guard, and the graph re-propagates
            assert count_ops(gm, "aten.as_strided") == relabels
            assert verify.repropagate(gm) == []
            gm.graph.lint()


def test_skips_at_world_size_one(clean_env):
    backend = passkit.backend(passes=[SP], mode="eager")
    torch.compile(lambda x, r, w: llama_norm(x + r, w), backend=backend)(*Form(llama_residual).inputs())
    record = backend.last_report["sequence_parallel"]
    assert (record.status, record.reason) == ("skipped", "needs world size >= 2 (got 1)")


def test_token_constraint():
    ctx = CompileContext(world_size=4)
    assert SequenceParallel().token_constraint(ctx) == TokenConstraint(min_tokens=4096, multiple_of=4)
    assert SequenceParallel(min_tokens=8, max_tokens=64).token_constraint(ctx) == TokenConstraint(8, 64, 4)
    assert SequenceParallel(restrict_tokens=False).token_constraint(ctx) == TokenConstraint(multiple_of=4)
    assert SequenceParallel().token_constraint(CompileContext(world_size=1)) is None
    assert (
        SequenceParallel(min_tokens=5, max_tokens=7).skip_reason(ctx)
        == "no multiple of the world size 4 in 5..7"
    )
    assert TokenConstraint(8, 64, 4).holds_for(TokenRange(8, 64, 4))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_tokens": 0}, "passes.sequence_parallel.min_tokens"),
        ({"min_tokens": 64, "max_tokens": 32}, "max_tokens=32 is below min_tokens=64"),
        (
            {"min_token": 4},
            "unknown option (known options: min_tokens, max_tokens, restrict_tokens, collective_timeout_s)",
        ),
    ],
)
def test_rejects_bad_options(clean_env, options: dict[str, Any], message: str):
    with pytest.raises(passkit.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        passkit.backend(passes=[{"name": "sequence_parallel", **options}])


def test_registered_through_the_entry_point():
    info = passkit.get_plugins().passes["sequence_parallel"]
    assert (info.plugin.name, info.plugin.distribution) == ("fusion", "passkit-fusion")
    assert info.cls.before == ("async_tp",) and info.cls.stage is passkit.Stage.POST


def test_the_graph_is_the_same_on_every_rank():
    """No rank in the graph: ranks 0 and 1 trace the same code (the FX cache can share it)."""
    codes = []
    for rank in (0, 1):
        with fake_world(2, rank=rank):
            form = Form(llama_residual, shape=(8, 64))
            codes.append(run_passes(form.fn, *form.inputs(), passes=[SP]).graph_after.code)
    assert codes[0] == codes[1]


def test_conformance():
    with fake_world(2):
        check_pass(
            "sequence_parallel",
            options_variants=[{"min_tokens": 1}, {"min_tokens": 2, "max_tokens": 4096}],
            sample=(llama_residual, Form(llama_residual, shape=(8, 64)).inputs()),
        )


# ------------------------------------------------ composed with async_tp (test_mode) --

ASYNC_TP = {"name": "async_tp", "implementation": "test_mode", "min_tokens": 1}
AG_MM = "passkit_fusion.async_tp_all_gather_matmul.default"
MM_RS = "passkit_fusion.async_tp_matmul_reduce_scatter.default"


class _CaptureAfterAsyncTP(passkit.GraphPass):
    """Keeps a copy of each specialization's graph after ``async_tp``, with its range."""

    name = "capture_after_async_tp"
    stage = passkit.Stage.POST
    after = ("async_tp",)
    graphs: list[tuple[Any, torch.fx.GraphModule]] = []

    def run(self, gm, ctx):
        self.graphs.append((ctx.token_range, copy_graph_module(gm)))
        return passkit.PassResult()


def _stack(group_name: str) -> torch.nn.Module:
    """benchmarks/fusion_e2e.py's 2-D stack at its --cpu dims."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "fusion_e2e.py"
    spec = importlib.util.spec_from_file_location("fusion_e2e", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    torch.manual_seed(0)
    model = module.Stack(2, 2, group_name, hidden=64, heads=4, kv_heads=2, inter=128, context=8)
    model.causal_mask = module.causal_mask
    return model.eval()


def _sp_then_async_tp(model: str, dynamic: bool) -> torch.fx.GraphModule:
    """The graph after ``sequence_parallel, async_tp`` (test mode): the static compile of 16
    tokens, or the specialization of a dynamic compile for multiples of 2. The pipeline lints
    and re-propagates fake values after each pass (``verify``)."""
    _CaptureAfterAsyncTP.graphs = []
    passes = [*resolve_passes([{**SP, "min_tokens": 8}, ASYNC_TP]), _CaptureAfterAsyncTP()]
    pipeline = passkit.Pipeline(passkit.Config(on_error="raise", verify=True), passkit.get_plugins(), passes)
    backend = passkit.Backend(mode="eager", pipeline=pipeline)
    torch._dynamo.reset()
    with fake_world(2) as world:
        if model == "llama":  # 3-D: [1, S, H]
            module = shard_functional(TinyLlama(LlamaConfig(kv_heads=4)).eval(), world.group, 0, 2)
            inputs: tuple[Any, ...] = (torch.randint(0, 256, (1, 16)),)
            dims = [[1]]
        else:  # 2-D: [T, H], and a [T, context + T] mask
            module = _stack(world.group_name)
            inputs = (torch.randn(16, 64), module.causal_mask(16, 8, torch.device("cpu")))
            dims = [[0], [0, 1]]
        if dynamic:
            for t, ds in zip(inputs, dims):
                for d in ds:
                    torch._dynamo.mark_dynamic(t, d)
        with torch.no_grad():
            torch.compile(module, backend=backend, fullgraph=True)(*inputs)
    graphs = dict(_CaptureAfterAsyncTP.graphs)
    if not dynamic:
        return graphs[TokenRange(16, 16, 16)]  # static shapes: it serves 16 tokens only
    (key,) = [k for k in graphs if k is not None and k.multiple_of == 2]
    return graphs[key]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("model", ["llama", "stack"])
def test_async_tp_fuses_both_halves_after_sequence_parallel(model: str, dynamic: bool):
    """Every column-parallel matmul (q/k/v, gate/up) fused with the all-gather before it,
    every row-parallel one (o, down) with the reduce-scatter after it, with a static and with
    a symbolic token count, 2-D (the e2e benchmark's stack) and 3-D (TinyLlama) alike."""
    gm = _sp_then_async_tp(model, dynamic)
    layers = 2
    # TinyLlama: the embedding's reduce-scatter has no matmul before it; the e2e stack: the
    # first layer's q/k/v read a norm of the (replicated) input, no gather. The last gather
    # (final norm) is the output.
    gathers = 2 * layers if model == "llama" else 2 * layers - 1
    assert count_ops(gm, AG_MM) == gathers
    assert count_ops(gm, MM_RS) == 2 * layers
    assert count_ops(gm, ALL_GATHER) == 1
    assert reduce_scatters(gm) == (1 if model == "llama" else 0)
    # the first reduce-scatter agrees on sequence_parallel's plan: the embedding's unfused one
    # (llama) or the fused matmul + reduce-scatter that took it over (the stack), only that one
    plans = [n.args[8] if len(n.args) > 8 else "" for n in gm.graph.nodes if n.target is _op(MM_RS)]
    assert plans[1:] == [""] * (len(plans) - 1) and bool(plans[0]) == (model == "stack"), plans
    assert count_ops(gm, "aten.mm") == (0 if model == "llama" else 1)
    if model == "llama":  # q, k, v in one op; gate, up in another
        assert sorted(len(n.args[1]) for n in gm.graph.nodes if n.target is _op(AG_MM)) == [2, 2, 3, 3]
    # symbolic: the re-labelling sits after the fused matmuls (and on the output's gather)
    assert count_ops(gm, "aten.as_strided") == (
        0 if not dynamic else (3 * layers + 2 * layers if model == "llama" else 2 * layers - 1) + 1
    )


def _op(name: str) -> Any:
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def test_matmul_on_the_symbolic_gather_reads_it_directly():
    """``sequence_parallel`` alone: with a symbolic T the column-parallel matmul reads the
    all-gather (``[2 * (T // 2), H]``) and its result is re-labelled ``[T, N]``; the norm's
    other users still read the re-labelled gather."""

    def fn(x, r, w, up):
        h = funcol.all_reduce(x, "sum", dist.group.WORLD) + r
        y = llama_norm(h, w)
        return y @ up, y * 2

    x, r, w = Form(llama_residual, shape=(8, 3, 64)).inputs()
    up = torch.randn(64, 32, dtype=x.dtype)
    _Capture.graphs = []
    pipeline = passkit.Pipeline(passkit.Config(), passkit.get_plugins(), [_Capture()])
    torch._dynamo.reset()
    for t in (x, r):
        torch._dynamo.mark_dynamic(t, 0)
    with fake_world(2):
        torch.compile(fn, backend=passkit.Backend(mode="eager", pipeline=pipeline), fullgraph=True)(
            x, r, w, up
        )
        (gm,) = _Capture.graphs
        result = SequenceParallel(min_tokens=1).run(
            gm, CompileContext(world_size=2, token_range=TokenRange(4, None, 2))
        )
        assert verify.repropagate(gm) == []
    assert result.matches == 1 and "1 matmul(s) re-routed to read the all-gather" in result.notes[0]
    (gather,) = [n for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.wait_tensor.default][1:]
    (mm,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert mm.args[0] is gather  # all_gather -> mm
    assert [u.target for u in mm.users] == [torch.ops.aten.as_strided.default]
    assert {u.target for u in gather.users} == {torch.ops.aten.mm.default, torch.ops.aten.as_strided.default}
    assert count_ops(gm, "aten.sym_size") == 0  # sizes come from the graph's inputs
    gm.graph.lint()
