"""The ``async_tp`` pass on CPU: torch's micro-pipeline TP rewrite forced by its test mode on
traced graphs of a fake world, the decisions and declarations around it, and the bounded
symmetric-memory set-up of its runtime in 2- and 3-rank gloo worlds (the fused ops themselves
need CUDA: tests/gpu/test_async_tp_gpu.py)."""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from passkit_fusion.async_tp import AsyncTP, AsyncTPOptions, runtime, torch_api
from passkit_fusion.collective import RankAgreementError
from torch.fx.experimental.proxy_tensor import make_fx

import passkit
from passkit import CompileContext, ConfigError, TokenConstraint
from passkit_testing import count_ops, fake_world, gloo_world, run_passes

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # funcol's deprecated names

AG = "passkit_fusion.async_tp_all_gather_matmul"
RS = "passkit_fusion.async_tp_matmul_reduce_scatter"
TEST = {"name": "async_tp", "implementation": "test_mode", "min_tokens": 1}
H, F = 64, 128


def mlp(x, w1, w2, group, gather_dim=0, scatter_dim=0):
    """Column- then row-parallel MLP, sequence-parallel: tokens sharded in and out."""
    a = funcol.all_gather_tensor(x, gather_dim, group)
    h = torch.relu(a @ w1)
    return funcol.reduce_scatter_tensor(h @ w2, "sum", scatter_dim, group)


def traced(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def run_pass(gm, **options):
    p = AsyncTP(**{"implementation": "test_mode", "min_tokens": 1, **options})
    ctx = CompileContext.from_graph(gm)
    assert p.skip_reason(ctx) is None
    return p.run(gm, ctx)


# ----------------------------------------------------------------------- the rewrite --


@pytest.mark.parametrize("shape", [(8, H), (2, 4, H)], ids=["2d", "3d"])
def test_mlp_gets_both_fused_ops(shape):
    with fake_world(2) as world:
        gm = traced(
            lambda x, w1, w2: mlp(x, w1, w2, world.group_name),
            torch.randn(shape),
            torch.randn(H, F),
            torch.randn(F, H),
        )
        assert count_ops(gm, "_c10d_functional.all_gather_into_tensor") == 1
        result = run_pass(gm)
        gm.graph.lint()
    assert count_ops(gm, AG) == 1 and count_ops(gm, RS) == 1
    assert count_ops(gm, "_c10d_functional.all_gather_into_tensor") == 0
    assert count_ops(gm, "_c10d_functional.reduce_scatter_tensor") == 0
    assert count_ops(gm, "aten.mm") == 0
    assert result.matches == 2 and result.modified
    notes = "\n".join(result.notes)
    assert "1 all_gather -> matmul fused: all_gather_into_tensor(dim 0) -> mm" in notes
    assert "1 matmul -> reduce_scatter fused: reduce_scatter_tensor(dim 0) -> mm_1" in notes
    assert "(test_mode)" in notes
    for node in gm.graph.nodes:  # the rewrite leaves fake values for re-propagation
        if node.op == "call_function":
            assert "val" in node.meta, node


def test_gather_of_two_matmuls_is_one_fused_op():
    """q/k/v-style: one gathered input, several matmuls -> one op with several Bs."""
    with fake_world(2) as world:

        def f(x, wa, wb):
            a = funcol.all_gather_tensor(x, 0, world.group_name)
            return a @ wa, a @ wb

        gm = traced(f, torch.randn(8, H), torch.randn(H, F), torch.randn(H, F))
        result = run_pass(gm)
    (node,) = [n for n in gm.graph.nodes if str(n.target).startswith(AG)]
    assert len(node.args[1]) == 2
    assert "-> mm+mm_1" in result.notes[0]


def test_runtime_settings_travel_in_the_graph():
    with fake_world(2) as world:
        gm = traced(
            lambda x, w1, w2: mlp(x, w1, w2, world.group_name),
            torch.randn(8, H),
            torch.randn(H, F),
            torch.randn(F, H),
        )
        run_pass(gm, max_tokens=4096, collective_timeout_s=7.0)
    (rs,) = [n for n in gm.graph.nodes if str(n.target).startswith(RS)]
    assert rs.args[-3:] == ("test_mode", 4096, 7.0)


def test_last_dim_gather_of_a_narrow_shard_is_left_with_torchs_reason():
    with fake_world(2) as world:
        gm = traced(
            lambda x, w1, w2: mlp(x, w1, w2, world.group_name, gather_dim=1),
            torch.randn(8, H // 2),
            torch.randn(H, F),
            torch.randn(F, H),
        )
        result = run_pass(gm)
    assert count_ops(gm, AG) == 0 and count_ops(gm, RS) == 1
    assert result.matches == 1
    left = next(n for n in result.notes if "candidate(s) left" in n)
    assert "gathered along the last dim with a shard only 32 wide (< 1024" in left


def test_reduce_scatter_of_a_shared_matmul_is_left():
    with fake_world(2) as world:

        def f(x, w):
            y = x @ w
            return funcol.reduce_scatter_tensor(y, "sum", 0, world.group_name), y.sum()

        gm = traced(f, torch.randn(8, H), torch.randn(H, H))
        result = run_pass(gm)
    assert count_ops(gm, RS) == 0 and result.matches == 0 and not result.modified
    assert "the matmul's result has other users" in "\n".join(result.notes)


def test_graph_without_sites_says_so():
    with fake_world(2) as world:
        gm = traced(lambda x: funcol.all_reduce(x, "sum", world.group_name) * 2, torch.randn(8, H))
        result = run_pass(gm)
    assert result.matches == 0
    assert result.notes == [
        "no all_gather -> matmul or matmul -> reduce_scatter in the graph (run sequence_parallel first?)"
    ]


def test_graph_without_sites_leaves_torchs_pass_silent(caplog):
    """torch's matcher, run on a graph with nothing to fuse, logs "async TP found no
    matching all-gather/reduce-scatter patterns" (once per rank in ``passkit demo``, next to
    graphs passkit fused): the pass does not run it there; its note says it per graph."""
    with fake_world(2) as world:
        gm = traced(lambda x: funcol.all_reduce(x, "sum", world.group_name) * 2, torch.randn(8, H))
        with caplog.at_level("WARNING", logger="torch._inductor.fx_passes.micro_pipeline_tp"):
            run_pass(gm)
            torch_api.run_torch_pass(gm.graph)  # the message this is about, from torch itself
    assert caplog.text.count("async TP found no matching all-gather/reduce-scatter patterns") == 1


def test_through_passkit_compile_with_report():
    with fake_world(2) as world:
        w1, w2 = torch.randn(H, F), torch.randn(F, H)
        res = run_passes(lambda x: mlp(x, w1, w2, world.group_name), torch.randn(8, H), passes=[TEST])
    res.assert_matches("async_tp", 2)
    after = res.graphs["async_tp"].after
    assert count_ops(after, AG) == 1 and count_ops(after, RS) == 1


# ------------------------------------------------------------------------ skip reasons --


def _record(world_size, options, monkeypatch=None):
    with fake_world(world_size) as world:
        w1, w2 = torch.randn(H, F), torch.randn(F, H)
        res = run_passes(
            lambda x: mlp(x, w1, w2, world.group_name), torch.randn(8, H), passes=[{**TEST, **options}]
        )
    return res.report["async_tp"]


def test_auto_on_cpu_skips_with_reason():
    record = _record(2, {"implementation": "auto"})
    assert record.status == "skipped"
    assert "needs CUDA tensors (graph is on cpu)" in record.reason
    assert "implementation='test_mode'" in record.reason


def test_world_size_one_skips():
    record = _record(1, {})
    assert record.status == "skipped" and record.reason == "needs world size >= 2 (got 1)"


def test_torch_without_the_apis_skips(monkeypatch):
    monkeypatch.setattr(torch_api, "missing", lambda: "torch 2.4 lacks X (async TP needs torch >= 2.11)")
    assert AsyncTP().skip_reason(CompileContext(device="cuda", world_size=2)) == (
        "torch 2.4 lacks X (async TP needs torch >= 2.11)"
    )


def test_no_symmetric_memory_skips(monkeypatch):
    monkeypatch.setattr(torch_api, "symm_mem_unavailable", lambda: "no NCCL")
    why = AsyncTP().skip_reason(CompileContext(device="cuda", world_size=2))
    assert why is not None and why.startswith("no NCCL — ")
    assert (
        AsyncTP(implementation="test_mode").skip_reason(CompileContext(device="cuda", world_size=2)) is None
    )


def test_this_torch_has_every_api():
    assert torch_api.missing() is None and torch_api.has_matchers()


# ------------------------------------------------------------ declarations, options --


def test_declared_after_sequence_parallel():
    assert AsyncTP.after == ("sequence_parallel",)

    class SequenceParallel(passkit.GraphPass):  # stand-in for the real pass
        name = "sequence_parallel"

    ordered = passkit._pipeline.build.order_passes([SequenceParallel(), AsyncTP()])
    assert [p.name for p in ordered] == ["sequence_parallel", "async_tp"]
    with pytest.raises(passkit.errors.OrderError, match="async_tp declares after=\\['sequence_parallel'\\]"):
        passkit._pipeline.build.order_passes([AsyncTP(), SequenceParallel()])


@pytest.mark.parametrize(
    "options, expected",
    [
        ({}, TokenConstraint(min_tokens=4096)),
        ({"min_tokens": 256, "max_tokens": 8192}, TokenConstraint(256, 8192)),
        ({"restrict_tokens": False}, None),
    ],
)
def test_token_range(options, expected):
    ctx = CompileContext(device="cuda", world_size=2)
    assert AsyncTP(**options).checked_token_constraint(ctx) == expected


def test_default_options():
    o = AsyncTPOptions()
    assert (o.implementation, o.min_tokens, o.max_tokens, o.restrict_tokens, o.collective_timeout_s) == (
        "auto",
        4096,
        None,
        True,
        180.0,
    )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"min_tokens": 0}, "passes.async_tp.min_tokens: Input should be greater than or equal to 1"),
        ({"max_tokens": 512}, "max_tokens (512) must be >= min_tokens (4096)"),
        ({"implementation": "nccl"}, "passes.async_tp.implementation: Input should be 'auto' or 'test_mode'"),
        ({"collective_timeout_s": 0}, "passes.async_tp.collective_timeout_s: Input should be greater than 0"),
        ({"max_token": 4}, "passes.async_tp.max_token: unknown option (known options: implementation"),
    ],
)
def test_invalid_options_name_the_field(options, message):
    with pytest.raises(ConfigError) as info:
        AsyncTP(**options)
    assert message in str(info.value)


def test_registered_through_the_entry_point():
    from passkit_fusion import AsyncTP as lazy
    from passkit_fusion import plugin

    assert lazy is AsyncTP and AsyncTP in plugin.passkit_register_passes()


def test_a_group_torch_reports_unusable_is_named_per_candidate(monkeypatch):
    """Outside test mode, a group whose symmetric memory torch reports unusable
    (``is_symm_mem_enabled_for_group`` False: on torch 2.15 no symmetric-memory backend for
    the accelerator, whatever passkit registered) leaves its candidates with that reason, not
    with a restatement of torch's matching rules. torch's own verdict is the one made False
    (its pass asks it too: on a CUDA build of torch <= 2.14 the registration alone would let it
    fuse, as passkit's copy of the verdict said no)."""
    import torch.distributed._symmetric_memory as symm_mem

    monkeypatch.setattr(symm_mem, "is_symm_mem_enabled_for_group", lambda group_name: False)
    with fake_world(2) as world:
        gm = traced(
            lambda x, w1, w2: mlp(x, w1, w2, world.group_name),
            torch.randn(8, H),
            torch.randn(H, F),
            torch.randn(F, H),
        )
        p = AsyncTP(min_tokens=1)
        result = p.run(gm, CompileContext.from_graph(gm))
        registered = torch_api.registered(world.group_name)
    assert registered and result.matches == 0 and count_ops(gm, AG) == count_ops(gm, RS) == 0
    notes = "\n".join(result.notes)
    reason = f"torch {torch.__version__} reports symmetric memory unusable for its group"
    assert notes.count(f"{reason} (is_symm_mem_enabled_for_group is False: ") == 2, notes  # AG and RS
    rule = "after passkit registered" if torch_api.enabled_by_registration() else "symmetric-memory backend"
    assert rule in notes, notes


# ---------------------------------------------------------------------- runtime sizes --


def test_workspace_sizes_follow_torchs_staging():
    a_shard = torch.empty(16, 512, dtype=torch.bfloat16)
    assert runtime.all_gather_need(a_shard, 0, 4) == (16 * 512 * 2, 64)
    assert runtime.all_gather_need(torch.empty(2, 8, 512), 1, 4) == (2 * 8 * 512 * 4, 64)
    assert runtime.all_gather_need(torch.empty(16, 512), 1, 4) == (16 * 512 * 4, 16)  # last dim
    a, b = torch.empty(64, 256, dtype=torch.bfloat16), torch.empty(256, 1024)
    assert runtime.reduce_scatter_need(a, b, 4) == (2 * 64 * 1024 // 4 * 2, 64)
    assert runtime.target_bytes(3 << 20, 64, 0) == 4 << 20
    assert runtime.target_bytes(100, 64, 0) == runtime.MIN_WORKSPACE_BYTES
    assert runtime.target_bytes(2 << 20, 1024, 8192) == 16 << 20


def test_capture_before_set_up_runs_unfused(monkeypatch):
    monkeypatch.setattr(runtime, "_capturing", lambda: True)
    assert runtime.ensure_workspace("nowhere", 1 << 20, 8, 0, 1.0) == "workspace_not_ready_in_capture"


# ------------------------------------------------------------ bounded set-up, gloo --

TIMEOUT_S = 2.0


def _setup_scenarios(rank: int, world: int) -> dict[str, Any]:
    calls: list[tuple[str, int]] = []
    torch_api.reserve_workspace = lambda name, nbytes: calls.append((name, nbytes))  # no CUDA here
    out: dict[str, Any] = {}

    group = dist.new_group()
    out["first"] = runtime.ensure_workspace(group.group_name, 3 << 20, 64, 0, TIMEOUT_S)
    out["again_smaller"] = runtime.ensure_workspace(group.group_name, 1 << 20, 16, 0, TIMEOUT_S)
    out["grown"] = runtime.ensure_workspace(group.group_name, 5 << 20, 128, 0, TIMEOUT_S)
    out["calls"] = list(calls)
    out["registered"] = torch_api.registered(group.group_name)
    out["enabled"] = torch_api.is_enabled(group.group_name)
    # torch's rule: up to 2.14 the registration enables the group; 2.15 asks the
    # accelerator's symmetric-memory backend (none on a CPU-only machine)
    by_backend = torch_api.accelerator_backend() is not None
    out["torch_enables"] = out["registered"] if torch_api.enabled_by_registration() else by_backend
    dist.barrier()

    group = dist.new_group()
    start = time.monotonic()
    try:
        if rank == world - 1:
            time.sleep(TIMEOUT_S + 1)  # never arrives in time
        else:
            runtime.ensure_workspace(group.group_name, 1 << 20, 64, 0, TIMEOUT_S)
        out["missing"] = None
    except RankAgreementError as exc:
        out["missing"] = {"message": str(exc), "ranks": exc.ranks, "step": exc.step, "group": exc.group}
    out["missing_s"] = time.monotonic() - start
    dist.barrier()

    group = dist.new_group()
    try:  # the last rank calls with twice the tokens: a size mismatch, not a hang
        runtime.ensure_workspace(group.group_name, (2 if rank == world - 1 else 1) << 22, 64, 0, TIMEOUT_S)
        out["differ"] = None
    except RankAgreementError as exc:
        out["differ"] = {"message": str(exc), "ranks": exc.ranks}
    return out


def test_symmetric_memory_set_up_is_agreed_bounded_and_named():
    results = gloo_world(_setup_scenarios, 3, timeout=300)
    for rank, out in enumerate(results):
        assert out["first"] == out["again_smaller"] == out["grown"] == ""
        assert [n for _, n in out["calls"]] == [4 << 20, 8 << 20]  # once, grown once; power of two
        assert out["registered"] and out["enabled"] == out["torch_enables"]
        if rank < 2:
            missing = out["missing"]
            assert missing["ranks"] == [2] and missing["step"] == "async_tp:symm_mem"
            assert f"process group {missing['group']!r}, step 'async_tp:symm_mem'" in missing["message"]
            assert "rank(s) [2] did not answer within 2 s" in missing["message"]
            assert out["missing_s"] >= TIMEOUT_S * 0.9  # it waited for the missing rank, then raised
        assert "field 'bytes' differs: 4194304 on ranks 0, 1; 8388608 on rank 2" in out["differ"]["message"]


# --------------------------------------------------- numerics on a gloo world (CPU) --


def _compiled_mlp(rank: int, world: int) -> dict[str, Any]:
    warnings.simplefilter("ignore", FutureWarning)
    group = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(H, F, generator=gen), torch.randn(F, H, generator=gen)
    w1s, w2s = w1.chunk(world, 1)[rank].contiguous(), w2.chunk(world, 0)[rank].contiguous()
    backend = passkit.backend(passes=[{**TEST, "restrict_tokens": False}], mode="eager")
    fn = torch.compile(lambda x: mlp(x, w1s, w2s, group), backend=backend, dynamic=True)
    runtime.reset_stats()
    errors = {}
    for tokens in (4, 12, 20):
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens), dtype=torch.float64)
        ref = (torch.relu(x @ w1.double()) @ w2.double()).chunk(world)[rank]
        out = fn(x.float().chunk(world)[rank].contiguous())
        errors[tokens] = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    return {"errors": errors, "stats": runtime.stats()}


@pytest.mark.slow
def test_compiled_mlp_matches_fp64_on_gloo():
    """The ops the pass leaves compute the MLP (test mode: functional collectives on gloo)
    at several token counts of one dynamic compile."""
    results = gloo_world(_compiled_mlp, 2, timeout=300)
    for out in results:
        assert max(out["errors"].values()) < 1e-5, out
        assert out["stats"] == {"fallback": 6, "fallback:test_mode": 6}
