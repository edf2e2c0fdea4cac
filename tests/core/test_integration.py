"""torch.compile integration: named backend, Python backend, install(), eager mode, caches."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import passkit
from passkit._compile.backend import ComposedPass

from .support import register_all, small_fn

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _plugins(clean_env):
    register_all()


def x():
    return torch.arange(8.0).reshape(2, 4) - 3


def test_python_backend_runs_passes_through_inductor():
    b = passkit.backend(passes=["mul_to_scale", "cleanup"])
    out = torch.compile(small_fn, backend=b)(x())
    torch.testing.assert_close(out, torch.relu(x() * 2.0) + 1.0)
    (report,) = b.reports
    assert report.mode == "inductor" and report["mul_to_scale"].matches == 1


def test_inductor_global_config_untouched():
    from torch._inductor import config

    b = passkit.backend(passes=["mul_to_scale"])
    torch.compile(small_fn, backend=b)(x())
    assert config.post_grad_custom_post_pass is None and config.post_grad_custom_pre_pass is None


def test_two_models_two_configs_one_process():
    b1 = passkit.backend(passes=[{"name": "mul_to_scale", "factor": 10.0}])
    b2 = passkit.backend(passes=[{"name": "mul_to_scale", "factor": 100.0}])
    f1 = torch.compile(lambda t: small_fn(t), backend=b1)
    f2 = torch.compile(lambda t: small_fn(t) * 1, backend=b2)
    torch.testing.assert_close(f1(x()), torch.relu(x() * 10.0) + 1.0)
    torch.testing.assert_close(f2(x()), torch.relu(x() * 100.0) + 1.0)
    assert len(b1.reports) == 1 and len(b2.reports) == 1


def test_no_pass_installs_nothing(monkeypatch):
    from torch._inductor import compile_fx

    seen = {}
    real = compile_fx.compile_fx

    def spy(gm, inputs, config_patches=None, **kw):
        seen["patches"] = config_patches
        return real(gm, inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(compile_fx, "compile_fx", spy)
    b = passkit.backend()
    torch.compile(small_fn, backend=b)(x())
    assert seen["patches"] is None and b.reports == []


def test_eager_mode_runs_passes_without_codegen():
    b = passkit.backend(passes=["mul_to_scale"], mode="eager")
    out = torch.compile(small_fn, backend=b)(x())
    torch.testing.assert_close(out, torch.relu(x() * 2.0) + 1.0)
    assert b.last_report.mode == "eager" and b.last_report["mul_to_scale"].matches == 1


def test_install_composes_with_existing_pass():
    calls = []

    class Existing(torch._inductor.custom_graph_pass.CustomGraphPass):
        def __call__(self, graph):
            calls.append(len(graph.nodes))

        def uuid(self):
            return "existing-v1"

    inductor_config = {"post_grad_custom_post_pass": Existing(), "max_autotune": False}
    pipeline = passkit.install(inductor_config, passes=["mul_to_scale"])
    composed = inductor_config["post_grad_custom_post_pass"]
    assert isinstance(composed, ComposedPass)
    assert composed.uuid() == ("existing-v1", f"passkit:post_grad_post:{pipeline.uuid()}")
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, inputs):
        return compile_fx(gm, inputs, config_patches=inductor_config)

    out = torch.compile(small_fn, backend=backend)(x())
    torch.testing.assert_close(out, torch.relu(x() * 2.0) + 1.0)
    assert calls and pipeline.reports[-1]["mul_to_scale"].matches == 1


def test_install_with_nothing_enabled_leaves_config_alone():
    cfg = {"post_grad_custom_post_pass": None}
    passkit.install(cfg)
    assert cfg == {"post_grad_custom_post_pass": None}


def _env(**extra):
    """A child environment: no PASSKIT_* settings, no compile caches (a cache hit would skip
    the passes), the repository importable."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PASSKIT_", "TORCH_LOGS")) or k == "PASSKIT_CACHE_DIR"
    }
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    env.update(extra)
    return env


def run_python(code: str, cwd, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (see :func:`_env`); fail with its stderr."""
    out = subprocess.run(
        [sys.executable, "-c", code], env=_env(**env), cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return out


@pytest.mark.slow  # a fresh process compiling with Inductor: about 60 s on 2 cores
def test_named_backend_reads_env_config(tmp_path):
    code = (
        "import torch, passkit\n"
        "f = torch.compile(lambda t: (t.view(4, 2).view(2, 4) * 2).relu(), backend='passkit')\n"
        "f(torch.randn(2, 4))\n"
        "print(passkit.last_report().to_json())\n"
    )
    out = run_python(code, tmp_path, PASSKIT_PASSES="noop_elimination,cleanup")
    report = json.loads(out.stdout)
    assert [p["name"] for p in report["passes"]] == ["noop_elimination", "cleanup"]
    assert report["passes"][0]["status"] == "ran" and report["mode"] == "inductor"


def test_torch_logs_shows_the_report(tmp_path):
    code = (
        "import torch, passkit\n"
        "torch.compile(lambda t: t.view(2, 4) + 1, backend=passkit.backend(passes=['noop_elimination'], mode='eager'))(torch.randn(2, 4))\n"
    )
    out = run_python(code, tmp_path, TORCH_LOGS="passkit")
    assert "passkit report" in out.stderr and "noop_elimination" in out.stderr


@pytest.mark.slow
def test_fx_graph_cache_hits_in_fresh_process_and_options_change_the_key(tmp_path):
    env = _env(
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"),
        TORCHINDUCTOR_FX_GRAPH_CACHE="1",
        TORCHINDUCTOR_AUTOGRAD_CACHE="0",
        PASSKIT_CACHE_DIR=str(tmp_path / "reports"),
    )

    def run(factor):
        out = subprocess.run(
            [sys.executable, "-m", "tests.core.cache_probe", str(factor)],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = run(2.0)
    assert (first["miss"], first["hit"], first["bypass"]) == (1, 0, 0)
    second = run(2.0)
    assert (second["miss"], second["hit"], second["bypass"]) == (0, 1, 0)
    assert second["out"] == first["out"]
    assert first["ran"] == ["mul_to_scale", "cleanup"] and first["cache_hit_reports"] == 0
    # a cache hit skips the passes entirely; the report says so, and passkit's own report
    # cache still tells what the passes did when they built the cached code
    assert second["reports"] == second["cache_hit_reports"] == second["restored"] == 1
    assert second["ran"] == ["mul_to_scale", "cleanup"]
    shutil.rmtree(tmp_path / "reports")
    without = run(2.0)
    assert (without["hit"], without["cache_hit_reports"], without["restored"], without["ran"]) == (
        1,
        1,
        0,
        [],
    )
    third = run(5.0)
    assert (third["miss"], third["hit"], third["bypass"]) == (1, 0, 0)
    assert third["out"] != first["out"]


def test_both_stages_run_in_inductor_and_share_one_report():
    b = passkit.backend(passes=["pre_pass", "mul_to_scale"])
    torch.testing.assert_close(torch.compile(small_fn, backend=b)(x()), torch.relu(x() * 2.0) + 1.0)
    (report,) = b.reports
    assert [(r.name, r.stage, r.status) for r in report.records] == [
        ("pre_pass", "post_grad_pre", "ran"),
        ("mul_to_scale", "post_grad_post", "ran"),
    ]
