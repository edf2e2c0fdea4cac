"""What a new user runs into first: unreadable config paths, huge values echoed back,
``PASSKIT_DISABLE`` against Python's config, ``passkit explain`` next to the model file,
and a bad option under ``backend="passkit"``."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import passkit
from passkit.config import load_config
from passkit.errors import MESSAGE_LIMIT

SCRIPTS = Path(sys.executable).parent


@pytest.fixture(autouse=True)
def _env(clean_env):
    return clean_env


@pytest.mark.parametrize(
    "value, says",
    [
        ("/tmp/" + "a" * 5000 + ".toml", "cannot be read: File name too long"),
        ("/tmp/" + "/".join(["d" * 250] * 30), "cannot be read"),
        ("/", "not a file"),
        ("/nonexistent/passkit.toml", "no such file"),
    ],
)
def test_passkit_config_naming_an_unreadable_path_is_a_config_error(value, says):
    with pytest.raises(passkit.ConfigError) as caught:
        load_config(environ={"PASSKIT_CONFIG": value})
    message = str(caught.value)
    assert message.startswith("PASSKIT_CONFIG=") and says in message
    assert len(message) < 400


def test_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'passes = ["\xff\xfe"]\n')
    with pytest.raises(passkit.ConfigError, match="malformed TOML"):
        load_config(environ={"PASSKIT_CONFIG": str(bad)})


HUGE = "x" * 20_000


@pytest.mark.parametrize(
    "environ, field",
    [
        ({"PASSKIT_ON_ERROR": HUGE}, "on_error"),
        ({"PASSKIT_VERIFY": HUGE}, "PASSKIT_VERIFY"),
        ({"PASSKIT_COMPILE_RANGES": HUGE}, "PASSKIT_COMPILE_RANGES"),
        ({"PASSKIT_PASSES": "a:b:" + HUGE}, "PASSKIT_PASSES"),  # a:b is a qualified name
        ({"PASSKIT_" + "Z" * 5000: "1"}, "unknown environment variable PASSKIT_ZZZ"),
        ({"PASSKIT_DUMP_DIR": "\0" * 3}, None),  # accepted by the config (a path); not echoed
    ],
)
def test_messages_cut_the_values_they_echo(environ, field):
    try:
        load_config(environ=environ)
    except passkit.ConfigError as exc:
        message = str(exc)
        assert field is not None and field in message
        assert len(message) < 600, len(message)
        assert "characters)" in message  # the value's length is given
    else:
        assert field is None


def test_huge_pass_name_and_option_values_are_cut():
    with pytest.raises(passkit.ConfigError) as caught:
        passkit.build_pipeline(passes=[HUGE])
    assert len(str(caught.value)) < 1000 and "20002 characters" in str(caught.value)
    with pytest.raises(passkit.ConfigError) as caught:
        passkit.build_pipeline(passes=[{"name": "noop_elimination", HUGE: 1, "y" * 300: [HUGE] * 50}])
    assert len(str(caught.value)) < 1500


def test_many_errors_are_summarised():
    cfg = {f"key{i}": i for i in range(200)}
    with pytest.raises(passkit.ConfigError) as caught:
        load_config(cfg)
    assert "and 195 more error(s)" in str(caught.value) and len(str(caught.value)) <= MESSAGE_LIMIT


def test_no_passkit_error_message_exceeds_the_limit():
    err = passkit.ConfigError("m" * 100_000)
    assert len(str(err)) <= MESSAGE_LIMIT and "100000 characters" in str(err)


# -- PASSKIT_DISABLE against Python -------------------------------------------------------


def test_disable_from_the_environment_switches_off_a_pass_enabled_in_python(caplog):
    with caplog.at_level(logging.WARNING, logger="passkit"):
        cfg = load_config(passes=["noop_elimination", "cleanup"], environ={"PASSKIT_DISABLE": "cleanup"})
    assert cfg.pass_names == ["noop_elimination"] and cfg.disable == ["cleanup"]
    assert (
        "pass 'cleanup', enabled by Python config, does not run: environment (PASSKIT_*) disables it"
        in caplog.text
    )


def test_disable_in_python_removes_a_pass_the_environment_enables(caplog):
    with caplog.at_level(logging.WARNING, logger="passkit"):
        cfg = load_config(disable=["cleanup"], environ={"PASSKIT_PASSES": "noop_elimination,cleanup"})
    assert cfg.pass_names == ["noop_elimination"]
    assert "does not run" not in caplog.text  # the higher source decided: nothing to warn about


def test_disable_from_a_file_switches_off_a_pass_enabled_in_python(tmp_path):
    (tmp_path / "passkit.toml").write_text('disable = ["cleanup"]\n')
    assert load_config(passes=["cleanup"], cwd=tmp_path).pass_names == []


# -- passkit explain next to the model file ---------------------------------------------------


def test_explain_finds_a_module_in_the_working_directory(tmp_path, monkeypatch, capsys):
    """As the console script runs it: its own folder, not the working directory, is on the
    import path."""
    (tmp_path / "m_next_to_cwd.py").write_text(
        textwrap.dedent(
            """
            import torch

            def model():
                return (lambda x: torch.relu(x.view(2, 8).view(16)) * 3.0), (torch.randn(16),)
            """
        )
    )
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "m_next_to_cwd", raising=False)
    from passkit.cli import main

    code = main(["explain", "m_next_to_cwd:model", "--passes", "noop_elimination", "--mode", "eager"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "noop_elimination" in out.out and " ran " in out.out
    sys.modules.pop("m_next_to_cwd", None)


# -- a bad option under backend="passkit" ---------------------------------------------------


def test_named_backend_bad_option_names_field_and_value_first(tmp_path):
    script = "import torch\ntorch.compile(lambda x: x.relu() + 1, backend='passkit')(torch.randn(3))\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PASSKIT_")}
    env["PASSKIT_PASSES"] = "noop_elimination,cleanup:max_nodes=lots"
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert "backend 'passkit' cannot start" in lines[0] and "invalid configuration" in lines[0]
    assert "passes.cleanup.max_nodes: unknown option" in lines[1]
    assert "BackendCompilerFailed" not in out.stderr
    assert any(
        line.startswith("passkit.errors.ConfigError: PASSKIT_PASSES: invalid configuration") for line in lines
    )
    assert len(lines) <= 16, out.stderr


def test_named_backend_error_is_the_config_error_in_process():
    import passkit._compile.backend

    os.environ["PASSKIT_ON_ERROR"] = "sometimes"
    passkit._compile.backend._default_backend.cache_clear()
    try:
        with pytest.raises(passkit.ConfigError, match="on_error") as caught:
            torch.compile(lambda x: x + 1, backend="passkit")(torch.randn(2))
    finally:
        del os.environ["PASSKIT_ON_ERROR"]
        passkit._compile.backend._default_backend.cache_clear()
    assert type(caught.value).__name__ == "ConfigError"
    assert not isinstance(caught.value.__cause__, Exception)
