"""A plugin's own code raising anywhere passkit calls it (issue 27): its options model, its
pass's ``__init__``, ``token_constraint``, ``skip_reason``, ``decision_source``. Each is a ``ConfigError`` naming
pass, plugin and distribution (set-up time) or a ``failed`` record naming the pass while the
compile goes on (compile time), never a bare traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import passkit

from . import broken_passes
from .support import PLUGIN as CORE_PLUGIN

ROOT = Path(__file__).parents[2]


@pytest.fixture(autouse=True)
def _plugins(clean_env):
    passkit.register(broken_passes.PLUGIN, name="broken-passes")
    passkit.register(CORE_PLUGIN, name="core-test-passes")
    return clean_env


def fn(x):
    return torch.relu(x * 3.0) + 1.0


def expected(x):
    return torch.relu(x * 2.0) + 1.0


def test_options_validator_raising_runtime_error_is_a_named_config_error():
    with pytest.raises(passkit.ConfigError) as caught:
        passkit.backend(passes=[{"name": "raising_options", "k": 3}])
    message = str(caught.value)
    assert message.startswith(
        "Python config: passes.raising_options: the options model RaisingOptions of pass 'raising_options'"
    )
    assert "in-process plugin 'broken-passes'" in message
    assert "RuntimeError: k=3 crashes the validator" in message
    assert passkit.backend(passes=[{"name": "raising_options", "k": 2}]).pipeline.names() == [
        "raising_options"
    ]


def test_pass_init_raising_is_a_named_config_error():
    class BadInit(passkit.GraphPass):
        name = "bad_init"

        def __init__(self, options=None):
            super().__init__(options)
            raise ZeroDivisionError("init crashed")

    class Plugin:
        @passkit.hookimpl
        def passkit_register_passes(self):
            return [BadInit]

    passkit.register(Plugin(), name="acme-init")
    with pytest.raises(
        passkit.ConfigError,
        match=r"passes.bad_init: pass 'bad_init' \(in-process plugin 'acme-init'\) raised ZeroDivisionError: init crashed",
    ):
        passkit.backend(passes=["bad_init"])


def test_options_validator_under_the_named_backend_names_the_variable_and_pass():
    """backend='passkit' in a fresh process: the first lines are passkit's, naming the pass."""
    script = (
        "import sys, torch, passkit\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.core import broken_passes\n"
        "passkit.register(broken_passes.PLUGIN, name='broken-passes')\n"
        "torch.compile(lambda x: x.relu() + 1, backend='passkit')(torch.randn(3))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PASSKIT_")}
    env["PASSKIT_PASSES"] = "raising_options:k=3"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    first = out.stderr.strip().splitlines()[0]
    assert "backend 'passkit' cannot start" in first and "passes.raising_options" in first
    assert "RuntimeError: k=3 crashes the validator" in first
    assert "BackendCompilerFailed" not in out.stderr


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("raising_token_constraint", "token_constraint() raised RuntimeError: token_constraint crashed"),
        ("raising_skip_reason", "skip_reason() raised KeyError: 'skip_reason crashed'"),
        ("raising_decision_source", "decision_source() raised ValueError: decision_source crashed"),
        ("garbage_decision_source", "decision_source() must return a str or None, got {'source': 'stored'}"),
    ],
)
@pytest.mark.parametrize("dynamic", [False, True])
def test_planning_code_raising_is_a_failed_record_and_the_compile_goes_on(name, says, dynamic):
    backend = passkit.backend(passes=["mul_to_scale", name, "cleanup"])
    x = torch.randn(4, 8)
    if dynamic:
        torch._dynamo.mark_dynamic(x, 0)
    out = torch.compile(fn, backend=backend)(x)
    torch.testing.assert_close(out, expected(x))
    report = backend.reports[-1]
    record = report[name]
    assert record.status == "failed"
    assert f"PassCodeError: pass {name!r} (" in record.reason and says in record.reason
    assert report["mul_to_scale"].status == "ran" and report["cleanup"].status == "ran"


def test_planning_code_raising_with_on_error_raise_names_the_pass():
    backend = passkit.backend(passes=["mul_to_scale", "raising_token_constraint"], on_error="raise")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as caught:
        torch.compile(fn, backend=backend)(torch.randn(4, 8))
    error = caught.value.inner_exception  # passkit's own error, not Inductor's wrapper of it
    assert isinstance(error, passkit.PassFailedError) and error.pass_name == "raising_token_constraint"
    assert "PassCodeError: pass 'raising_token_constraint' (" in str(error)
    assert "token_constraint() raised RuntimeError: token_constraint crashed" in str(error)
