"""The SGLang adapter's logic that needs no SGLang installed: its shapes as passkit token
ranges, applicability, report notes, the entry point doing nothing without passes, the
``--enable-torch-compile`` wrapper (the real SGLang: ``tests/hosts/test_sglang.py``)."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import warnings

import pytest
import torch

import passkit
from passkit import TokenConstraint, TokenRange
from passkit.hosts import HostVersionWarning, check_version
from passkit.hosts import sglang as host

NO_SGLANG = importlib.util.find_spec("sglang") is None


class _Everywhere(passkit.GraphPass):
    name = "everywhere"

    def run(self, gm, ctx):
        return passkit.PassResult()


class _Small(passkit.GraphPass):
    name = "small"
    tokens = TokenConstraint(max_tokens=512)

    def run(self, gm, ctx):
        return passkit.PassResult()


class _Plugin:
    @passkit.hookimpl
    def passkit_register_passes(self):
        return [_Everywhere, _Small]


@pytest.fixture
def pipeline_of(clean_env):
    passkit.register(_Plugin())
    yield lambda *names, **config: passkit.build_pipeline(passes=list(names), **config)
    host.uninstall()


def test_importing_the_sglang_adapter_imports_no_sglang(clean_env):
    code = (
        "import sys, passkit, passkit.hosts.sglang as h\n"
        "h.plugin()  # no pass configured: does nothing\n"
        "assert h.active() is None and not h._hooks_registered\n"
        "assert not {m for m in sys.modules if m.split('.')[0] == 'sglang'}, 'sglang was imported'\n"
        "assert 'passkit.hosts.sglang.inductor_pass' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=clean_env)


def test_sglang_versions():
    assert check_version("sglang", "0.5.23") == "0.5.23"
    with pytest.warns(HostVersionWarning, match=r"found sglang 0\.6\.0; passkit supports sglang 0\.5\.x"):
        check_version("sglang", "0.6.0")


def test_sglang_shapes_map_to_token_ranges():
    assert host.token_range(8) == TokenRange(8, 8, 8)  # a per-shape compile
    assert host.token_range(None, [16, 4, 256, 8]) == TokenRange(4, 256)  # general: the capture sizes
    assert host.token_range(None) == TokenRange(1, None)  # nothing known: every size
    assert host.token_range(0) == TokenRange(1, 1, 1)


def test_is_applicable_for_shape_comes_from_the_passes_token_constraints(pipeline_of):
    small = pipeline_of("small")
    assert host.applies(small, host.token_range(None, [1, 512]))
    assert not host.applies(small, host.token_range(None, [1, 1024]))
    assert not host.applies(small, host.token_range(600))
    assert host.applies(pipeline_of("small", "everywhere"), host.token_range(600))


def test_range_notes_say_what_the_compile_serves(pipeline_of):
    notes = host.range_notes(pipeline_of("small", compile_ranges=[64]), TokenRange(1, 1024), None)
    assert "general-shape compile (serves the CUDA-graph capture sizes 1..1024)" in notes[0]
    assert "small applies to part of this range only" in notes[1]
    assert "compile_ranges is not used inside SGLang" in notes[2]
    assert host.range_notes(pipeline_of("small"), TokenRange(8, 8, 8), 8) == [
        "SGLang compile for runtime shape 8"
    ]


def test_the_adapter_keeps_one_pipeline_per_shape_and_reports_in_one_list(pipeline_of):
    adapter = host.SGLangAdapter(pipeline_of("small", "everywhere"), "0.5.23")
    general = adapter.for_shape(None, [4, 2048])
    assert general is adapter.for_shape(None, [4, 2048])
    assert general.current_range() == TokenRange(4, 2048)
    assert general.reports is adapter.reports
    assert general.uuid() != adapter.for_shape(8).uuid() != adapter.pipeline.uuid()


def _piece(tokens, dynamic: bool):
    """A Dynamo-like piece: a weight placeholder, then the activations (``tokens`` rows);
    ``dynamic``: its token dimension symbolic, as SGLang's general compile gets it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    class Piece(torch.nn.Module):
        def forward(self, w, x):
            return x @ w

    gm = torch.fx.symbolic_trace(Piece())
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    placeholders[0].name = "l_self_modules_layers_modules_0_parameters_weight_"
    mode = FakeTensorMode(shape_env=ShapeEnv() if dynamic else None)
    x = torch.randn(tokens, 8)
    if dynamic:
        from torch._dynamo.source import ConstantSource
        from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

        context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
        fake_x = mode.from_tensor(x, symbolic_context=context, source=ConstantSource("x"))
    else:
        fake_x = mode.from_tensor(x)
    weight = torch.randn(8, 8)
    inputs = [mode.from_tensor(weight, static_shapes=True) if dynamic else mode.from_tensor(weight), fake_x]
    for node, value in zip(placeholders, inputs):
        node.meta["val"] = value
    return gm, inputs


def test_dynamos_1_token_recompile_is_labelled_by_the_token_it_serves(pipeline_of):
    """Issue 27: SGLang compiles a graph Dynamo recompiled for 1 token (static shapes) as a
    general compile; its report says it serves 1 token, not the capture sizes' span."""
    adapter = host.SGLangAdapter(pipeline_of("small", "everywhere"), "0.5.23")
    static_gm, static_inputs = _piece(1, dynamic=False)
    dynamic_gm, dynamic_inputs = _piece(4, dynamic=True)
    assert adapter.static_tokens(dynamic_gm, dynamic_inputs) is None
    assert adapter.static_tokens(static_gm, static_inputs) == 1
    with adapter.compiling_static(adapter.static_tokens(static_gm, static_inputs)):
        static = adapter.for_shape(None, [1, 300])
        assert static is adapter.for_shape(None, [1, 300])  # the pass, inside, gets the same
    general = adapter.for_shape(None, [1, 300])
    assert general is not static and general.range_label == "tokens 1..300"
    assert static.current_range() == TokenRange(1, 1, 1)
    assert static.range_label == "tokens = 1 (Dynamo's 1-token recompile)"
    assert "serves 1 token only" in static.note
    # the plain torch.compile path labels such a graph the same way
    from passkit._compile import specialize

    assert "it serves tokens = 1 (Dynamo's 1-token recompile)" in specialize.static_note(
        specialize.static_tokens(static_gm, static_inputs)
    )


def test_layer_names_read_as_module_paths_from_every_dynamo_source():
    """Issue 27: on SGLang's ``--enable-torch-compile`` path Dynamo names modules through the
    compiled bound method's closure; reports show the module path."""
    from passkit.graph_utils import module_path, module_path_from_source

    cases = {
        "L['fn'].__closure__[1].cell_contents.__self__.layers.1": "layers.1",
        "L['self'].layers[0].mlp": "layers.0.mlp",
        "L['self']._modules['layers']._modules['1']": "layers.1",
        "L['self'].model.layers[2].post_attention_layernorm": "model.layers.2.post_attention_layernorm",
        "self.layers.1": "layers.1",
        "layers.1": "layers.1",
        "L['self']": "",
    }
    assert {s: module_path_from_source(s) for s in cases} == cases
    node = torch.fx.Graph().placeholder("x")
    node.meta["nn_module_stack"] = {
        "a": ("L['fn'].__closure__[1].cell_contents.__self__", object),
        "b": ("L['fn'].__closure__[1].cell_contents.__self__.layers.1", object),
    }
    assert module_path(node) == "layers.1"
    from passkit_fusion.patterns.graph import module_path as fusion_module_path

    assert fusion_module_path(node) == "layers.1"


def _fake_patch_model(model, enable_compile, num_tokens, tp_group):
    """SGLang's ``torch_compile_decoration.patch_model``'s signature; yields the forward."""

    @contextlib.contextmanager
    def patched():
        yield (lambda: torch._inductor.config.post_grad_custom_post_pass) if enable_compile else model

    return patched()


def test_enable_torch_compile_forward_runs_inside_passkits_inductor_patch(pipeline_of):
    import torch._inductor.config

    host._active = host.SGLangAdapter(pipeline_of("everywhere"), "0.5.23")
    with host._around_patch_model(_fake_patch_model, "model", True, num_tokens=8, tp_group=None) as forward:
        installed = forward()  # what Inductor's global config holds while SGLang's forward runs
        assert forward.passkit_pipeline.current_range() == TokenRange(8, 8, 8)
    assert installed.pipeline is forward.passkit_pipeline
    assert torch._inductor.config.post_grad_custom_post_pass is None  # restored afterwards
    with host._around_patch_model(_fake_patch_model, "model", False, num_tokens=8, tp_group=None) as forward:
        assert forward == "model"  # not compiled: untouched
    host.uninstall()
    with host._around_patch_model(_fake_patch_model, "model", True, num_tokens=8, tp_group=None) as forward:
        assert not hasattr(forward, "passkit_pipeline")  # not installed: untouched


def test_an_enable_torch_compile_cache_hit_gets_a_report(pipeline_of):
    from torch._dynamo.utils import counters

    adapter = host.SGLangAdapter(pipeline_of("everywhere"), "0.5.23")

    def served_from_cache():
        counters["inductor"]["fxgraph_cache_hit"] += 1

    adapter.compiled_forward(served_from_cache, 8)()
    adapter.compiled_forward(lambda: None, 8)()  # a call that compiles nothing: no report
    (report,) = adapter.reports
    assert report.cache_hit and report.token_range == "tokens 8, multiples of 8"


@pytest.mark.skipif(not NO_SGLANG, reason="SGLang is installed here")
def test_the_entry_point_with_passes_but_no_sglang_fails_clearly(clean_env, monkeypatch, caplog):
    monkeypatch.setenv("PASSKIT_PASSES", "cleanup")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        host.plugin()
    try:
        assert host.active() is None
        assert "sglang is not installed" in str(host._error)
        assert "passkit: not enabled in SGLang" in caplog.text
        with pytest.raises(passkit.PasskitError, match="sglang is not installed"):
            host._around_patch_model(_fake_patch_model, "model", True, num_tokens=8, tp_group=None)
    finally:
        host.uninstall()


def test_the_entry_point_reports_a_config_error_at_the_first_compile(clean_env, monkeypatch):
    monkeypatch.setenv("PASSKIT_PASSES", "no_such_pass")
    host.plugin()
    try:
        error = host._error  # without SGLang: it is not installed; with it: the unknown pass
        assert isinstance(error, passkit.PasskitError)
        assert ("sglang is not installed" if NO_SGLANG else "no_such_pass") in str(error)
        with pytest.raises(passkit.PasskitError):
            host._after_configure_post_pass(None, object())
    finally:
        host.uninstall()


def _fake_sglang_common(monkeypatch, backend: bool) -> list[int]:
    """``sglang.srt.utils.common`` as SGLang's AMX check reads it: ``cpu_has_amx_support()``
    (AMX tiles and sgl_kernel's CPU backend). Returns the list its calls are counted in."""
    import types

    calls: list[int] = []
    common = types.ModuleType("sglang.srt.utils.common")
    common._is_intel_amx_backend_available = lambda: calls.append(1) or backend  # type: ignore[attr-defined]
    common.cpu_has_amx_support = lambda: common._is_intel_amx_backend_available()  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt", "sglang.srt.utils"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.utils.common", common)
    return calls


@pytest.mark.parametrize("backend", [False, True])
def test_on_an_amx_cpu_sglangs_amx_check_is_answered_before_tracing(monkeypatch, backend):
    """Issue 27: on a CPU with AMX tiles SGLang's all-reduce asks ``cpu_has_amx_support()``,
    which imports sgl_kernel: inside Dynamo's trace that fails. passkit asks it first (the
    answer is cached), and says which all-reduce SGLang then uses; ``passkit check`` too."""
    from passkit.builtin import plugin as builtin_plugin
    from passkit.hosts.sglang import amx

    calls = _fake_sglang_common(monkeypatch, backend)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert amx.prepare() is None and not calls  # no AMX: SGLang never asks, nor does passkit
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    ok, what = amx.prepare()
    assert calls == [1]
    common = sys.modules["sglang.srt.utils.common"]
    assert common._is_intel_amx_backend_available.passkit_pinned  # the answer, pinned
    assert common.cpu_has_amx_support() is backend and calls == [1]  # no second import
    assert ok is (not backend)
    assert ("sgl_kernel.shm_allreduce" in what) is backend
    assert ("torch's functional all-reduce" in what) is (not backend)
    monkeypatch.setattr(amx, "check", amx.prepare)  # SGLang "installed"
    (line,) = builtin_plugin.passkit_environment_checks()
    assert line.subject == "SGLang on this CPU (AMX)" and line.ok is (not backend)


def test_without_sglang_or_amx_passkit_check_says_nothing_about_it(monkeypatch):
    from passkit.builtin import plugin as builtin_plugin

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert builtin_plugin.passkit_environment_checks() == []


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({}, "without --enable-torch-compile"),
        ({"enable_torch_compile": True}, None),
        ({"enable_torch_compile": True, "device": "cpu", "disable_cuda_graph": True}, None),
        (
            {"enable_torch_compile": True, "device": "cuda", "disable_cuda_graph": True},
            "--disable-cuda-graph",
        ),
        (
            {"enable_torch_compile": True, "device": "cuda", "cuda_graph_backend_decode": "disabled"},
            "--cuda-graph-backend-decode disabled",
        ),
    ],
)
def test_server_arguments_that_compile_nothing_are_named(args, named):
    """SGLang 0.5.23 reaches Inductor only through ``--enable-torch-compile``, inside its decode
    graph capture (``tests/hosts/test_sglang.py`` feeds its real parser)."""
    from types import SimpleNamespace

    from passkit.hosts.sglang.startup import nothing_compiled_reason

    reason = nothing_compiled_reason(SimpleNamespace(**args))
    if named is None:
        assert reason is None
    else:
        assert reason is not None and named in reason, reason
