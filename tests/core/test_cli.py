"""The ``passkit`` command line, run as a user would (the installed console script)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def cli(monkeypatch, capsys):
    """Run ``passkit ARGS`` in-process (fast); the console script itself is tested once."""
    from passkit.cli import main

    def run(*args, cwd=None, env=None):
        for name in list(os.environ):
            if name.startswith("PASSKIT_"):
                monkeypatch.delenv(name)
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        monkeypatch.chdir(cwd or ROOT)
        monkeypatch.syspath_prepend(str(ROOT))
        capsys.readouterr()
        code = main(list(args))
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


def test_console_script_is_installed():
    out = subprocess.run(["passkit", "--version"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("passkit ")


def test_list_shows_builtins_with_distribution(cli):
    out = cli("list")
    assert out.returncode == 0, out.stderr
    assert "noop_elimination" in out.stdout and "passkit 0.1.0" in out.stdout


def test_list_json(cli):
    data = json.loads(cli("list", "--json").stdout)
    names = {p["name"]: p for p in data["passes"]}
    assert names["cleanup"]["distribution"] == "passkit" and names["cleanup"]["stage"] == "post_grad_post"
    assert isinstance(data["failures"], list)


def test_show_and_unknown_name(cli):
    out = cli("show", "noop_elimination")
    assert out.returncode == 0 and "options schema" in out.stdout and "Remove ops" in out.stdout
    bad = cli("show", "noop_elimnation")
    assert bad.returncode == 2 and "did you mean 'noop_elimination'" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_schema_lists_pass_names(cli):
    schema = json.loads(cli("schema").stdout)
    variants = schema["properties"]["passes"]["items"]["anyOf"]
    assert {"const": "cleanup"} in variants
    assert "on_error" in schema["properties"]


def test_check_good_and_bad_files(cli, tmp_path):
    good = tmp_path / "passkit.toml"
    good.write_text('passes = ["noop_elimination", "cleanup"]\n')
    out = cli("check", str(good))
    assert out.returncode == 0 and "OK" in out.stdout and "2 pass(es)" in out.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('passes = ["cleanpu"]\n')
    out = cli("check", str(bad))
    assert out.returncode == 2 and "unknown pass 'cleanpu'" in out.stderr and "Traceback" not in out.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text("passes = [\n")
    out = cli("check", str(broken))
    assert out.returncode == 2 and "malformed TOML" in out.stderr and "broken.toml" in out.stderr
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[tool.passkit]\npasses = ["cleanup"]\n')
    assert cli("check", str(pyproject)).returncode == 0


def test_explain_prints_report_and_dumps(cli, tmp_path):
    dump = tmp_path / "dump"
    out = cli(
        "explain",
        "tests.core.explain_target:make",
        "--passes",
        "noop_elimination,cleanup",
        "--mode",
        "eager",
        "--dump",
        str(dump),
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert "noop_elimination" in out.stdout and "ran" in out.stdout
    assert list(dump.glob("run-*/graph_*/report.json"))


def test_explain_shows_a_report_per_token_range(cli):
    out = cli(
        "explain",
        "tests.core.explain_target:make_tokens",
        "--passes",
        "cleanup",
        "--dynamic",
        "--compile-ranges",
        "2",
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert "passkit report (graph" in out.stdout
    assert ", tokens 1..2)" in out.stdout and ", tokens >= 3)" in out.stdout


def test_explain_uses_config_file(cli, tmp_path):
    (tmp_path / "passkit.toml").write_text('passes = ["cleanup"]\n')
    out = cli("explain", "tests.core.explain_target:make", "--mode", "eager", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "cleanup" in out.stdout


@pytest.mark.parametrize(
    "target, message",
    [
        ("nocolon", "must look like 'package.module:function'"),
        ("no.such.module:make", "cannot import 'no.such.module'"),
        ("tests.core.explain_target:missing", "has no attribute 'missing'"),
        ("tests.core.explain_target:not_a_pair", "must return (model_or_function, example_args_tuple)"),
    ],
)
def test_explain_bad_targets(cli, target, message):
    out = cli("explain", target, "--passes", "cleanup", cwd=ROOT)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


def test_bad_env_config_is_one_line(cli):
    out = cli("explain", "tests.core.explain_target:make", cwd=ROOT, env={"PASSKIT_ON_ERROR": "explode"})
    assert out.returncode == 2 and "on_error" in out.stderr and "Traceback" not in out.stderr


def test_core_demo_shows_report_excerpt_and_numerics(cli):
    out = cli("demo", "--only", "core", "--mode", "eager")
    assert out.returncode == 0, out.stderr
    assert "passes enabled by name: noop_elimination, cleanup" in out.stdout
    assert "noop_elimination" in out.stdout and "ran" in out.stdout
    assert "before/after excerpt" in out.stdout and "numerics vs eager" in out.stdout and "OK" in out.stdout


def test_options_attribute_docstrings_are_read_when_shown_not_at_import(cli):
    import pydantic

    from passkit._plugins.options_docs import documented

    class Options(pydantic.BaseModel):
        size: int = 0
        """the size, from the docstring"""
        named: int = pydantic.Field(1, description="its own description")
        """a docstring that loses"""

    assert Options.model_fields["size"].description is None  # nothing read at class creation
    assert documented(Options) is Options and documented(Options) is Options  # once
    assert Options.model_fields["size"].description == "the size, from the docstring"
    assert Options.model_fields["named"].description == "its own description"
    assert Options.model_json_schema()["properties"]["size"]["description"] == "the size, from the docstring"
    # passkit-fusion's options document their fields this way: list and schema show them
    fusion = {p["name"]: p for p in json.loads(cli("list", "--json").stdout)["passes"]}
    assert "the largest token count the pass fuses" in fusion["allreduce_rmsnorm"]["options"]["max_tokens"]
    schema = json.dumps(json.loads(cli("schema").stdout))
    assert "the largest token count the pass fuses" in schema


def test_check_fails_where_a_server_would_refuse_and_passes_where_it_would_run(cli, tmp_path):
    """``passkit check && vllm serve ...`` starts the server exactly when it would run its
    passes: an empty pass list (what the server refuses) exits 1 naming it; the fusion
    passes pass the environment checks of this machine (a dialect whose ops this build does
    not register is idle, not a failure)."""
    empty = tmp_path / "passkit.toml"
    empty.write_text("passes = []\n")
    out = cli("check", str(empty))
    assert out.returncode == 1, out
    assert "no pass is enabled" in out.stdout and "refuses to start" in out.stdout, out.stdout
    served = tmp_path / "served.toml"
    served.write_text('passes = ["allreduce_rmsnorm", "cleanup"]\n')
    out = cli("check", str(served))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAIL" not in out.stdout, out.stdout
