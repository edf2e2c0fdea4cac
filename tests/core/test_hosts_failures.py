"""Issue 27 inside the hosts, with no host installed: where SGLang's own compile is what
fails (its piecewise backend's ``CompilerManager.compile``, its ``--enable-torch-compile``
forward), passkit names the passes that changed the graph and compiles without them, as
``passkit.backend`` does; its config error is raised with passkit's message first; a compile
path that does not import gets no hook."""

from __future__ import annotations

import pytest
import torch

import passkit
from passkit.hosts import sglang as host

from . import broken_passes
from .support import PLUGIN as CORE_PLUGIN


@pytest.fixture(autouse=True)
def _plugins(clean_env):
    passkit.register(broken_passes.PLUGIN, name="broken-passes")
    passkit.register(CORE_PLUGIN, name="core-test-passes")
    yield clean_env
    host.uninstall()


def fn(x):
    return torch.relu(x * 3.0) + 1.0


X = torch.randn(4, 8)
EXPECTED = torch.relu(X * 2.0) + 1.0


def test_sglang_piecewise_compile_inductor_failure_compiles_again_without_the_pass():
    """``reported_compile`` wraps SGLang's ``CompilerManager.compile`` (here: Inductor with
    the pipeline in its config, as SGLang's manager runs it)."""
    from torch._inductor.compile_fx import compile_fx

    adapter = host.SGLangAdapter(
        passkit.build_pipeline(passes=["mul_to_scale", "to_half_after_relu"]), "0.5.23"
    )
    pipeline = adapter.for_shape(8)
    compiled = []

    def backend(gm, example_inputs):
        def sglang_compile():
            return compile_fx(gm, example_inputs, config_patches=pipeline.inductor_patches())

        compiled.append(adapter.reported_compile(sglang_compile, pipeline, gm, example_inputs))
        return compiled[-1]

    out = torch.compile(fn, backend=backend)(X)
    torch.testing.assert_close(out, EXPECTED)
    (report,) = adapter.reports
    assert report.token_range == "tokens 8, multiples of 8"
    assert report["to_half_after_relu"].status == "failed"
    assert "both a fallback and a decomp" in report["to_half_after_relu"].reason
    assert report["mul_to_scale"].status == "ran"


def test_sglang_enable_torch_compile_inductor_failure_compiles_again_without_the_pass():
    """``--enable-torch-compile``: SGLang's forward is ``torch.compile``'d with Inductor's
    global config, which passkit patches around each call; the first call's compile fails
    on the pass's graph, and is compiled again without it."""
    adapter = host.SGLangAdapter(
        passkit.build_pipeline(passes=["mul_to_scale", "to_half_after_relu"]), "0.5.23"
    )
    forward = adapter.compiled_forward(torch.compile(fn, mode="max-autotune-no-cudagraphs"), 4)
    torch.testing.assert_close(forward(X), EXPECTED)
    torch.testing.assert_close(forward(X), EXPECTED)  # compiled once
    (report,) = adapter.reports
    assert report["to_half_after_relu"].status == "failed"
    assert report["to_half_after_relu"].reason.startswith("Inductor failed on the graph this pass changed")


def test_sglang_config_error_at_the_first_compile_is_passkits_error(monkeypatch):
    monkeypatch.setattr(host, "_error", passkit.ConfigError("passes.cleanup.max_nodes: unknown option"))
    with pytest.raises(passkit.ConfigError, match=r"passes\.cleanup\.max_nodes") as caught:
        host._after_configure_post_pass(None, object())
    assert isinstance(caught.value, torch._dynamo.exc.ShortenTraceback)  # Dynamo lets it through


def test_sglang_paths_that_do_not_import_are_left_alone(monkeypatch):
    """The piecewise backend fails to import (a CPU-only install); --enable-torch-compile
    still gets passkit, and the piecewise backend no hook (SGLang would log a traceback)."""

    def problem(api):
        modules = {m for m, _ in api}
        if "sglang.srt.compilation.backend" in modules:
            return "fails to import sglang.srt.compilation.backend (RuntimeError: weak_ref_tensor is implemented only for CUDA)"
        return None

    monkeypatch.setattr(host, "_api_problem", problem)
    assert host.check_api("0.5.23") == (host.TORCH_COMPILE,)

    monkeypatch.setattr(host, "_api_problem", lambda api: "fails to import sglang.srt (ImportError: no)")
    with pytest.raises(passkit.hosts.HostError, match=r"fails to import sglang\.srt"):
        host.check_api("0.5.23")
