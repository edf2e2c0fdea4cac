"""The CLI's promise (docs/cli.md), as properties over every subcommand and option:

* a bad value for any option (or positional) prints one line on stderr, ``passkit CMD:
  error: ...``, and exits 2, without a traceback; a value the command accepts runs it (here
  the expensive part is stopped at its door). Positionals include module targets that are
  paths or relative names (``../mymodel:make``), options folders that cannot be written
  (``--dump /proc/nope``), and unknown flags name their subcommand's ``--help``;
* output into a pipe whose reader went away (``passkit schema | head``) ends quietly;
* ``passkit check`` refuses the ``PASSKIT_*`` environment exactly when a compile would
  (``passkit.backend()``: the ``compiler`` key resolved too).

The subcommands and their options are read from the parser itself, plugins' included: a new
command without an entry in :data:`VALID` fails the test.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

import passkit
from passkit.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]

VALID = {
    "list": [],
    "show": ["cleanup"],
    "schema": [],
    "check": ["{good}"],
    "explain": ["tests.core.explain_target:make"],
    "bisect": ["tests.core.explain_target:make"],
    "demo": [],
    "tune": [],
    "tune-model": ["passkit_fusion.model:tuning_target"],
    "explain-hf": ["Llama"],
}
"""Each subcommand with positionals it accepts (``{good}``: a valid passkit.toml)."""

BAD_VALUES = ["abc", "-5", "0", "", ",", "1,abc", "1e999", "nope,,", "x" * 300]
BAD_POSITIONALS = {
    "show": ["nope", ""],
    "check": ["{missing}", "{bad}", "{empty_folder}"],
    "explain": [
        "nope",
        "nope:make",
        "tests.core.explain_target:nope",
        "tests.core.explain_target:not_a_pair",
        # module targets that are no module name (issue 46: tracebacks before)
        "../mymodel:make",
        ".mymodel:make",
        ":make",
        "mymodel.py:make",
        "tests.core.explain_target:",
        "my-model:make",
        "tests/core/explain_target.py:make",
    ],
    "tune-model": ["nope", "nope:x", ".mymodel:make", "../mymodel:make", ":make", "nope:"],
    "bisect": ["nope", "nope:make", "tests.core.explain_target:nope", "../mymodel:make", ":make"],
    "explain-hf": ["Lama", "{missing}.json", "{folder}"],
}


BAD_OPTION_VALUES = {
    "--dump": ["/proc/nope", "{good}", "/proc/nope/deeper"],
    "--repro": ["/proc/nope", "{good}", "/proc/nope/deeper"],
}
"""Values an option refuses although they look like its type (folders that cannot be written)."""


class Accepted(BaseException):
    """Raised where a command would start its real work: the arguments were accepted."""


def _stop(*args, **kwargs):
    raise Accepted


@pytest.fixture
def run(monkeypatch, capsys, tmp_path):
    """``main(argv)`` in-process with the expensive doors shut; returns (code, out, err), code
    None when the command was accepted and reached its work."""
    import torch
    import torch.multiprocessing
    from passkit_fusion.coverage import run as coverage_run

    import passkit._bisect.search as bisect_search
    import passkit.demo

    for name in list(os.environ):
        if name.startswith("PASSKIT_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setattr(torch, "compile", _stop)
    monkeypatch.setattr(torch.multiprocessing, "spawn", _stop)
    monkeypatch.setattr(coverage_run, "check_model", _stop)
    monkeypatch.setattr(passkit.demo, "run_core_demo", _stop)
    monkeypatch.setattr(bisect_search, "_run_ranks", _stop)
    (tmp_path / "good.toml").write_text('passes = ["cleanup"]\n')
    (tmp_path / "bad.toml").write_text('passes = ["cleanpu"]\n')
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "passkit.toml").write_text('passes = ["noop_elimination"]\n')
    (tmp_path / "empty").mkdir()
    (tmp_path / "lamma.json").write_text('{"model_type": "lamma"}')
    paths = {
        "lamma": tmp_path / "lamma.json",
        "good": tmp_path / "good.toml",
        "bad": tmp_path / "bad.toml",
        "missing": tmp_path / "missing",
        "folder": tmp_path / "folder",
        "empty_folder": tmp_path / "empty",
    }

    def call(argv):
        argv = [a.format(**paths) for a in argv]
        capsys.readouterr()
        try:
            code = main(argv)
        except Accepted:
            code = None
        out, err = capsys.readouterr()
        return code, out, err

    return call


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser, _ = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _valued_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if a.option_strings and a.nargs != 0 and not isinstance(a, argparse._HelpAction)
    ]


def _assert_kept(argv, code, err):
    assert "Traceback" not in err, (argv, err)
    if code == 2:
        lines = err.rstrip().splitlines()
        assert lines, (argv, "exit 2 with nothing on stderr")
        # the error's line (a config's field errors continue it, indented, one per field)
        first = max(i for i, line in enumerate(lines) if not line.startswith(" "))
        assert lines[first].startswith("passkit") and ": error: " in lines[first], (argv, err)
    else:  # accepted: it ran (0/1) or reached its real work (None)
        assert code in (None, 0, 1), (argv, code, err)


def test_every_subcommand_has_valid_arguments_listed():
    assert set(_subcommands()) == set(VALID)


def test_bad_option_values_print_one_line_and_exit_2(run):
    for command, parser in _subcommands().items():
        for action in _valued_options(parser):
            for value in BAD_VALUES:
                argv = [command, *VALID[command], action.option_strings[-1], value]
                code, _out, err = run(argv)
                _assert_kept(argv, code, err)


def test_unwritable_dump_folders_print_one_line_and_exit_2(run):
    """Issue 46: ``--dump /proc/nope`` warned twice, exited 0 and said the dumps were written."""
    for command, parser in _subcommands().items():
        for action in _valued_options(parser):
            for value in BAD_OPTION_VALUES.get(action.option_strings[-1], []):
                argv = [command, *VALID[command], action.option_strings[-1], value]
                code, out, err = run(argv)
                assert code == 2, (argv, code, out, err)
                _assert_kept(argv, code, err)
                assert f"{action.option_strings[-1]} " in err and "cannot be written" in err, err
                assert "written under" not in out, out


def test_bad_positionals_print_one_line_and_exit_2(run):
    for command, values in BAD_POSITIONALS.items():
        for value in values:
            argv = [command, value]
            code, _out, err = run(argv)
            assert code == 2, (argv, code, err)
            _assert_kept(argv, code, err)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["explain", "tests.core.explain_target:make", "--compile-ranges", "abc"], "'abc' is not an integer"),
        (["explain", "tests.core.explain_target:make", "--compile-ranges", "256,16"], "--compile-ranges"),
        (["explain", "tests.core.explain_target:make", "--passes", "cleanpu"], "--passes: unknown pass"),
        (["demo", "--only", "nope"], "no demo named 'nope'"),
        (["demo", "--only", "tp_pases"], "did you mean 'tp_passes'"),
        (["check", "{empty_folder}"], "a folder with no passkit.toml or pyproject.toml"),
        (["explain-hf", "Lama"], "did you mean 'Llama'"),
        (["explain-hf", "Llama", "--tokens", "0"], "argument --tokens: 0 is not >= 1"),
        (["show", "cleanpu"], "did you mean 'cleanup'"),
        (["nope"], "invalid choice: 'nope'"),
        (["explain", "../mymodel:make"], "run passkit from the folder holding mymodel.py and give 'mymodel:make'"),
        (["explain", ".mymodel:make"], "is a path or a relative name, not a module name"),
        (["explain", ":make"], "has no module name before ':'"),
        (["explain", "mymodel.py:make"], "give 'mymodel:make'"),
        (["tune-model", "--cpu", ".mymodel:make"], "give 'mymodel:make'"),
        (["explain", "tests.core.explain_target:make", "--dump", "/proc/nope"], "--dump /proc/nope: cannot be written"),
        (["explain", "tests.core.explain_target:make", "--dump", "{good}"], "a file is in its place"),
        (["list", "--jsn"], "passkit list: error: unrecognized arguments: --jsn (see `passkit list --help`)"),
        (["check", "{good}", "extra"], "(see `passkit check --help`)"),
        (["explain-hf", "{empty_folder}"], "a folder with no config.json in it"),  # not "no such file"
        (["explain-hf", "{lamma}"], "model_type 'lamma' is not known to transformers"),
    ],
)
def test_the_mistakes_of_the_issue_are_named(run, argv, expected):
    code, _out, err = run(argv)
    assert code == 2 and expected in err, err
    # one line (a config's field errors continue it, indented, one per field)
    assert len([line for line in err.rstrip().splitlines() if not line.startswith(" ")]) == 1, err
    assert err.startswith("passkit"), err


def test_an_unknown_model_type_is_one_short_line(run):
    """Issue 46: transformers' message, quoted whole, listed every model_type (2,003 characters)."""
    code, _out, err = run(["explain-hf", "{lamma}"])
    assert code == 2 and "did you mean 'llama'" in err and len(err) < 300, err


def test_check_reads_a_folder_and_the_environment(run, monkeypatch):
    code, out, _ = run(["check", "{folder}"])
    assert code == 0 and "1 pass(es): noop_elimination" in out
    monkeypatch.setenv("PASSKIT_PASSES", "cleanup,noop_elimination")
    code, out, _ = run(["check", "{good}"])
    assert code == 0 and "2 pass(es)" in out and "read: environment (PASSKIT_*)" in out


ENV_CASES = [
    ("PASSKIT_PASSES", "fold_double_reluu"),
    ("PASSKIT_PASSES", "cleanup"),
    ("PASSKIT_ON_ERROR", "explode"),
    ("PASSKIT_ON_ERROR", "raise"),
    ("PASSKIT_VERIFY", "maybe"),
    ("PASSKIT_COMPILE_RANGES", "16,abc"),
    ("PASSKIT_COMPILE_RANGES", "256,16"),
    ("PASSKIT_COMPILE_AT", "never"),
    ("PASSKIT_DISABLE", "cleanup"),
    ("PASSKIT_CONFIG", "/nonexistent.toml"),
    ("PASSKIT_PASES", "cleanup"),
    ("PASSKIT_COMPILER", "aot_eagr"),  # issue 46: check said OK, the compile refused
    ("PASSKIT_COMPILER", "nosuchpkg.mod:fn"),
    ("PASSKIT_COMPILER", "passkit:__version__"),  # not callable
    ("PASSKIT_COMPILER", "aot_eager"),
    ("PASSKIT_COMPILER", "tests.core.explain_target:make"),  # a callable: accepted
]


@pytest.mark.parametrize(("variable", "value"), ENV_CASES)
def test_check_refuses_the_environment_exactly_when_a_compile_would(run, monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    try:
        passkit.backend()  # what torch.compile(backend="passkit") makes first
        compile_refuses = False
    except passkit.PasskitError:
        compile_refuses = True
    code, _out, err = run(["check"])
    assert (code == 2) == compile_refuses, (variable, value, code, err)
    _assert_kept(["check"], code, err)
    if variable != "PASSKIT_CONFIG":  # (a named file replaces the argument's)
        code, _out, err = run(["check", "{good}"])
        assert (code == 2) == compile_refuses, (variable, value, code, err)


@pytest.mark.parametrize(
    ("toml", "variable", "expected"),
    [
        ('compiler = "aot_eagr"\n', None, ["good.toml: config key compiler: 'aot_eagr'", "did you mean 'aot_eager'"]),
        ('compiler = "nosuchpkg.mod:fn"\n', None, ["good.toml: config key compiler: cannot import"]),
        ("", "aot_eagr", ["PASSKIT_COMPILER (compiler): 'aot_eagr'", "did you mean 'aot_eager'"]),
    ],
)
def test_check_and_a_compile_name_a_bad_compiler_alike(run, monkeypatch, tmp_path, toml, variable, expected):
    """Issue 46: ``passkit check`` passed a compiler key the compile refused, and the compile's
    error named neither the variable nor the close spelling. Both now run one function."""
    (tmp_path / "good.toml").write_text('passes = ["cleanup"]\n' + toml)
    if variable:
        monkeypatch.setenv("PASSKIT_COMPILER", variable)
    code, _out, err = run(["check", "{good}"])
    assert code == 2, err
    for text in expected:
        assert text in err, err
    _assert_kept(["check"], code, err)
    monkeypatch.setenv("PASSKIT_CONFIG", str(tmp_path / "good.toml"))
    with pytest.raises(passkit.ConfigError) as raised:
        passkit.backend()
    for text in expected:
        assert text in str(raised.value)


def test_tune_model_imports_from_the_working_directory_as_explain_does(run, tmp_path):
    (tmp_path / "my_tuning_target.py").write_text("def target(rank, world_size, device):\n    return None\n")
    try:
        assert run(["tune-model", "my_tuning_target:target", "--cpu"])[0] is None  # reached its spawn
    finally:
        sys.modules.pop("my_tuning_target", None)


class _ClosedPipe(io.TextIOBase):
    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize(
    "argv",
    [
        ["list"],
        ["list", "--json"],
        ["show", "allreduce_rmsnorm"],
        ["schema"],
        ["check", "{good}"],
        ["--help"],
        ["explain-hf", "--help"],
    ],
)
def test_a_closed_pipe_ends_quietly(run, monkeypatch, argv):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    code, _out, err = run(argv)
    assert code == 0 and err == "", err


@pytest.mark.parametrize("argv", [["schema"], ["show", "allreduce_rmsnorm"]])
def test_the_console_script_into_a_closed_pipe(argv):
    """The real thing: the reader's end is closed before passkit writes a byte."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            ["passkit", *argv], stdout=write, stderr=subprocess.PIPE, text=True, timeout=300
        )
    finally:
        os.close(write)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
