"""Config schema, sources, precedence and every user-facing error message."""

from __future__ import annotations

import pytest

import passkit
from passkit.config import load_config

from .support import register_all


def write(path, text):
    path.write_text(text)
    return path


def test_defaults(clean_env):
    cfg = load_config()
    assert cfg.passes == [] and cfg.on_error == "skip" and cfg.dump_dir is None
    assert cfg.autoload and not cfg.verify


def test_entries_accept_names_and_tables():
    cfg = passkit.Config(passes=["cleanup", {"name": "mul_to_scale", "factor": 4.0}])
    assert cfg.pass_names == ["cleanup", "mul_to_scale"]
    assert cfg.options_for("mul_to_scale") == {"factor": 4.0}
    same = passkit.Config(passes=[{"name": "mul_to_scale", "options": {"factor": 4.0}}])
    assert same.options_for("mul_to_scale") == {"factor": 4.0}


def test_precedence_python_env_toml_pyproject(clean_env, monkeypatch):
    write(
        clean_env / "pyproject.toml",
        '[tool.passkit]\npasses = ["cleanup"]\non_error = "raise"\nverify = true\ndump_dir = "from-pyproject"\n',
    )
    assert load_config().pass_names == ["cleanup"]
    write(clean_env / "passkit.toml", 'passes = ["noop_elimination"]\ndump_dir = "from-toml"\n')
    cfg = load_config()
    assert cfg.pass_names == ["noop_elimination"]  # passkit.toml beats pyproject
    assert cfg.on_error == "raise" and cfg.verify  # fields it leaves unset come from below
    assert str(cfg.dump_dir) == "from-toml"
    monkeypatch.setenv("PASSKIT_PASSES", "reinplace, cleanup")
    monkeypatch.setenv("PASSKIT_DUMP_DIR", "from-env")
    cfg = load_config()
    assert cfg.pass_names == ["reinplace", "cleanup"] and str(cfg.dump_dir) == "from-env"
    cfg = load_config(passes=["noop_elimination"])  # Python beats everything
    assert cfg.pass_names == ["noop_elimination"] and str(cfg.dump_dir) == "from-env"
    cfg = load_config(passkit.Config(dump_dir="from-python"))
    assert str(cfg.dump_dir) == "from-python" and cfg.pass_names == ["reinplace", "cleanup"]


def test_config_file_found_in_parent_and_explicit(clean_env, monkeypatch):
    write(clean_env / "passkit.toml", 'passes = ["cleanup"]\n')
    sub = clean_env / "a" / "b"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    assert load_config().pass_names == ["cleanup"]
    other = write(clean_env / "other.toml", 'passes = ["reinplace"]\n')
    monkeypatch.setenv("PASSKIT_CONFIG", str(other))
    assert load_config().pass_names == ["reinplace"]
    monkeypatch.setenv("PASSKIT_CONFIG", str(clean_env / "missing.toml"))
    with pytest.raises(passkit.ConfigError, match=r"PASSKIT_CONFIG=.*missing.toml: no such file"):
        load_config()


def test_disable_from_higher_source_removes_lower_enable(clean_env, monkeypatch):
    write(clean_env / "passkit.toml", 'passes = ["noop_elimination", "cleanup"]\n')
    monkeypatch.setenv("PASSKIT_DISABLE", "cleanup")
    cfg = load_config()
    assert cfg.pass_names == ["noop_elimination"] and cfg.disable == ["cleanup"]


def test_env_passes_with_inline_options(clean_env, monkeypatch):
    monkeypatch.setenv("PASSKIT_PASSES", "noop_elimination, mul_to_scale:factor=4.5:limit=3, cleanup")
    cfg = load_config()
    assert cfg.pass_names == ["noop_elimination", "mul_to_scale", "cleanup"]
    assert cfg.options_for("mul_to_scale") == {"factor": 4.5, "limit": 3}
    monkeypatch.setenv("PASSKIT_PASSES", "mul_to_scale:factor:x")
    with pytest.raises(passkit.ConfigError, match=r"expected name:option=value, got 'mul_to_scale:factor:x'"):
        load_config()
    # name:word (no '=') is a qualified pass name (distribution:pass); unknown, it names both
    monkeypatch.setenv("PASSKIT_PASSES", "mul_to_scale:factor")
    assert load_config().pass_names == ["mul_to_scale:factor"]
    with pytest.raises(passkit.ConfigError, match=r"an option is written name:option=value"):
        passkit.build_pipeline()


def test_env_booleans_and_plugin_switches(clean_env, monkeypatch):
    monkeypatch.setenv("PASSKIT_VERIFY", "yes")
    monkeypatch.setenv("PASSKIT_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PASSKIT_BLOCK_PLUGINS", "a,b")
    monkeypatch.setenv("PASSKIT_ON_ERROR", "raise")
    cfg = load_config()
    assert cfg.verify and not cfg.autoload and cfg.block_plugins == ["a", "b"]
    assert cfg.on_error == "raise"
    monkeypatch.setenv("PASSKIT_VERIFY", "maybe")
    with pytest.raises(passkit.ConfigError, match=r"PASSKIT_VERIFY='maybe': expected"):
        load_config()


def test_unknown_env_variable_suggests(clean_env, monkeypatch):
    monkeypatch.setenv("PASSKIT_PASES", "cleanup")
    with pytest.raises(
        passkit.ConfigError, match=r"unknown environment variable PASSKIT_PASES.*PASSKIT_PASSES"
    ):
        load_config()


def test_malformed_toml_names_file_and_line(clean_env):
    write(clean_env / "passkit.toml", 'passes = ["cleanup"]\non_error = \n')
    with pytest.raises(passkit.ConfigError) as exc:
        load_config()
    msg = str(exc.value)
    assert "passkit.toml" in msg and "line 2" in msg and "malformed TOML" in msg


def test_unknown_key_lists_known_keys(clean_env):
    write(clean_env / "passkit.toml", 'pases = ["cleanup"]\n')
    with pytest.raises(passkit.ConfigError) as exc:
        load_config()
    assert "pases" in str(exc.value) and "known config keys: passes" in str(exc.value)


def test_bad_value_names_field(clean_env):
    with pytest.raises(passkit.ConfigError, match=r"on_error: Input should be 'raise' or 'skip'"):
        load_config(on_error="explode")


def test_pass_listed_twice(clean_env):
    with pytest.raises(passkit.ConfigError, match=r"'cleanup' is listed twice"):
        load_config(passes=["cleanup", "cleanup"])


def test_enabled_and_disabled(clean_env):
    with pytest.raises(passkit.ConfigError, match=r"both enabled \(passes\) and disabled"):
        load_config(passes=["cleanup"], disable=["cleanup"])


def test_unknown_pass_lists_installed_and_suggests(clean_env):
    with pytest.raises(passkit.ConfigError) as exc:
        passkit.build_pipeline(passes=["noop_elimnation"])
    msg = str(exc.value)
    assert "unknown pass 'noop_elimnation'" in msg
    assert "did you mean 'noop_elimination'" in msg
    installed = msg.split("Installed passes: ")[1]
    assert all(name in installed for name in ("cleanup", "noop_elimination", "reinplace"))


def test_wrong_option_type_names_pass_field_and_type(clean_env):
    register_all()
    with pytest.raises(passkit.ConfigError) as exc:
        passkit.build_pipeline(passes=[{"name": "mul_to_scale", "limit": "many"}])
    msg = str(exc.value)
    assert "passes.mul_to_scale.limit" in msg and "expected int" in msg and "'many'" in msg
    with pytest.raises(
        passkit.ConfigError,
        match=r"passes.mul_to_scale.factr: unknown option \(known options: factor, limit\)",
    ):
        passkit.build_pipeline(passes=[{"name": "mul_to_scale", "factr": 1.0}])


def test_options_from_toml_tables(clean_env):
    register_all()
    write(
        clean_env / "passkit.toml",
        '[[passes]]\nname = "mul_to_scale"\nfactor = 5.0\n\n[[passes]]\nname = "cleanup"\n',
    )
    pipeline = passkit.build_pipeline()
    assert pipeline.names() == ["mul_to_scale", "cleanup"]
    assert pipeline.passes[0].options.factor == 5.0


def _special(path, kind):
    """Make ``path`` a ``kind`` of name that exists but is no readable file."""
    import os

    if kind == "folder":
        path.mkdir()
    elif kind == "symlink loop":
        os.symlink(path.name, path)
    elif kind == "dangling symlink":
        os.symlink("nowhere.toml", path)
    elif kind == "named pipe":
        os.mkfifo(path)
    return {
        "folder": "a folder, not a file",
        "symlink loop": "a symlink loop",
        "dangling symlink": "a dangling symlink (to nowhere.toml)",
        "named pipe": "a named pipe (FIFO), not a file",
    }[kind]


KINDS = ["folder", "symlink loop", "dangling symlink", "named pipe"]


@pytest.mark.parametrize("filename", ["passkit.toml", "pyproject.toml"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_config_name_that_is_no_file_is_a_named_error_not_absent(clean_env, filename, kind):
    """Such a name was treated as no config file: ``passkit check`` said OK, 0 passes, and a
    compile ran with no pass, nothing on stderr."""
    why = _special(clean_env / filename, kind)
    with pytest.raises(passkit.ConfigError) as raised:
        load_config()
    assert str(raised.value) == f"config file {clean_env / filename}: {why}"
    from passkit.cli import main

    assert main(["check"]) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_passkit_config_naming_no_file_says_what_it_is(clean_env, monkeypatch, kind):
    why = _special(clean_env / "mine.toml", kind)
    monkeypatch.setenv("PASSKIT_CONFIG", str(clean_env / "mine.toml"))
    with pytest.raises(passkit.ConfigError) as raised:
        load_config()
    assert str(raised.value) == f"PASSKIT_CONFIG={clean_env / 'mine.toml'}: {why}"


def test_a_config_looking_name_passkit_does_not_read_stays_a_warning(clean_env):
    (clean_env / ".passkit.toml").mkdir()  # not read at all: no error for what it is
    assert load_config().passes == []


@pytest.mark.parametrize(
    "passes",
    [
        ["cleanup", "passkit:cleanup"],
        ["passkit:cleanup", "cleanup"],
        [{"name": "cleanup"}, "passkit:cleanup"],
    ],
)
def test_the_bare_and_qualified_names_of_one_pass_are_listed_twice(clean_env, passes):
    """The pipeline ran ``cleanup`` twice; the bare name twice is refused, and so is this."""
    first, second = (p if isinstance(p, str) else p["name"] for p in passes)
    with pytest.raises(passkit.ConfigError) as raised:
        passkit.build_pipeline(passes=passes)
    assert str(raised.value) == (
        f"Python config: passes: pass 'cleanup' is listed twice (as {first!r} and {second!r}: the bare "
        "and the qualified name of one pass)"
    )
