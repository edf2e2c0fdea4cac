"""What a compile costs when nothing can run: a config with no pass loads no plugin, and the
graph's fingerprint (generated code, hashed) is taken only when a pass reads it."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

import passkit
from passkit import compiling
from passkit._plugins.registry import get_plugins

from .support import register_all


@pytest.fixture(autouse=True)
def _plugins(clean_env):
    register_all()


def test_a_config_without_passes_loads_no_plugin_until_asked(clean_env):
    code = (
        "import json, sys, torch, passkit\n"
        "b = passkit.backend(passes=[])\n"
        "before = sorted(m for m in sys.modules if m.startswith(('passkit_fusion', 'passkit.builtin.')))\n"
        "names = sorted(b.pipeline.plugins.passes)\n"
        "print(json.dumps({'before': before, 'names': names, 'uuid': b.pipeline.uuid()}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=clean_env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["before"] == []  # no plugin imported to build it
    assert {"cleanup", "sequence_parallel"} <= set(result["names"])  # loaded when asked for
    empty = passkit.Pipeline(passkit.load_config(passes=[]), get_plugins(), [])
    assert not empty.enabled and empty.inductor_patches() == {}


def test_a_pipeline_without_passes_has_the_identity_of_one_built_with_its_plugins():
    lazy = passkit.build_pipeline(passes=[])
    eager = passkit.Pipeline(lazy.config, get_plugins(), [])
    assert lazy.uuid() == eager.uuid()
    assert lazy.plugins is get_plugins()


def test_a_config_without_passes_still_checks_what_it_names():
    with pytest.warns(passkit.ConfigWarning, match="disable: no installed pass is named 'cleanupp'"):
        passkit.build_pipeline(passes=[], disable=["cleanupp"])
    with pytest.warns(passkit.ConfigWarning, match="block_plugins: no installed plugin"):
        passkit.build_pipeline(passes=[], block_plugins=["no-such-plugin"])


def _counting_fingerprint(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = compiling.fingerprint

    def counted(gm, example_inputs=()):
        calls.append(1)
        return real(gm, example_inputs)

    monkeypatch.setattr(compiling, "fingerprint", counted)
    return calls


def test_the_graph_is_fingerprinted_at_the_first_read_only(monkeypatch):
    calls = _counting_fingerprint(monkeypatch)
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    inputs = (torch.randn(4),)
    pipeline = passkit.build_pipeline(passes=["cleanup"])
    with compiling.scope(gm, inputs, pipeline) as current:
        assert calls == []
        assert compiling.current() is current
        assert current.graph == compiling.fingerprint(gm, inputs)
        assert len(calls) == 2  # the read, and the comparison's own
        assert current.graph == current.graph and len(calls) == 2
        assert current.passes == compiling.pass_identities(pipeline)


class _PreGradNothing(passkit.GraphPass):
    name = "pre_grad_nothing"
    stage = passkit.Stage.PRE_GRAD

    def run(self, gm, ctx):
        return passkit.PassResult.unchanged()


class _PreGradPlugin:
    @passkit.hookimpl
    def passkit_register_passes(self):
        return [_PreGradNothing]


def test_a_pre_grad_pipeline_fingerprints_the_graph_as_dynamo_gave_it(monkeypatch):
    from passkit._plugins.registry import isolated

    calls = _counting_fingerprint(monkeypatch)
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    with isolated():
        passkit.register(_PreGradPlugin(), name="pre-grad-test")
        pipeline = passkit.build_pipeline(passes=["pre_grad_nothing"])
        with compiling.scope(gm, (torch.randn(4),), pipeline):
            assert calls == [1]  # at once: a pre-grad pass may rewrite gm in place


def test_a_compile_no_pass_reads_does_not_fingerprint_the_graph(monkeypatch):
    calls = _counting_fingerprint(monkeypatch)
    for passes in ([], ["cleanup"]):
        torch._dynamo.reset()
        backend = passkit.backend(passes=passes, mode="eager")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = torch.compile(lambda x: torch.relu(x) + 1, backend=backend)(torch.randn(4))
        assert out.shape == (4,)
        assert [r.status for r in backend.reports for r in r.records] == (["ran"] if passes else [])
    assert calls == []
