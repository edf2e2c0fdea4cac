"""Config messages name what to fix (issue 27): the field path of a pass listed twice, the
known keys once with a suggestion, the environment variable (and the file) a bad value came
from; ``passes=None`` means "not set"."""

from __future__ import annotations

import pytest

import passkit
from passkit.config import load_config


@pytest.fixture(autouse=True)
def _env(clean_env):
    return clean_env


def error(**kwargs) -> str:
    with pytest.raises(passkit.ConfigError) as caught:
        passkit.build_pipeline(**kwargs)
    return str(caught.value)


def test_a_pass_listed_twice_names_the_field():
    message = error(passes=["cleanup", "cleanup"])
    assert (
        message
        == "Python config: invalid configuration:\n  passes: pass 'cleanup' is listed twice, got ['cleanup', 'cleanup']"
    )


def test_a_pass_listed_twice_in_the_environment_names_the_variable():
    message = error(environ={"PASSKIT_PASSES": "cleanup,cleanup"})
    assert "\n  PASSKIT_PASSES (passes): pass 'cleanup' is listed twice" in message


def test_a_misspelt_key_lists_the_known_keys_once_and_suggests():
    message = error(pases=["cleanup"])
    assert message.count("passes, disable, on_error") == 1
    assert "pases: unknown config key (known config keys: passes, disable," in message
    assert message.endswith("(did you mean 'passes' or 'dump_passes'?)")


@pytest.mark.parametrize(
    ("environ", "variable"),
    [
        ({"PASSKIT_ON_ERROR": "sometimes"}, "PASSKIT_ON_ERROR (on_error): Input should be 'raise' or 'skip'"),
        ({"PASSKIT_COMPILE_AT": "later"}, "PASSKIT_COMPILE_AT (compile_at)"),
        ({"PASSKIT_COMPILE_RANGES": "0"}, "PASSKIT_COMPILE_RANGES (compile_ranges): every boundary"),
        (
            {"PASSKIT_PASSES": "cleanup:max_nodes=lots"},
            "PASSKIT_PASSES: invalid configuration:\n  passes.cleanup.max_nodes",
        ),
        (
            {"PASSKIT_PASSES": "clenup"},
            "PASSKIT_PASSES: unknown pass 'clenup' in passes (did you mean 'cleanup'?)",
        ),
    ],
)
def test_errors_from_the_environment_name_the_variable(environ, variable):
    assert variable in error(environ=environ)


def test_errors_of_options_from_a_file_name_the_file(tmp_path):
    config = tmp_path / "passkit.toml"
    config.write_text('passes = [{ name = "cleanup", max_nodes = 3 }]\n')
    assert error(cwd=tmp_path).startswith(f"{config}: invalid configuration:\n  passes.cleanup.max_nodes")


def test_passes_none_means_not_set():
    assert load_config(passes=None, environ={}).passes == []
    assert load_config(passes=None, environ={"PASSKIT_PASSES": "cleanup"}).pass_names == ["cleanup"]
    assert passkit.backend(passes=None, on_error=None).pipeline.config.on_error == "skip"
    assert (
        load_config(dump_dir=None, environ={"PASSKIT_DUMP_DIR": "d"}).dump_dir is None
    )  # None is a value here


def test_enabled_and_disabled_names_both_fields():
    message = error(passes=["cleanup"], disable=["cleanup"])
    assert "\n  config: pass(es) ['cleanup'] are both enabled (passes) and disabled (disable)" in message


def test_a_resolved_config_keeps_the_source_of_its_passes():
    """Hosts resolve the config first, then build the pipeline from it (SGLang's entry point)."""
    config = load_config(environ={"PASSKIT_PASSES": "cleanup:max_nodes=lots"})
    assert config.passes_from == "PASSKIT_PASSES"
    assert error(config=config).startswith(
        "PASSKIT_PASSES: invalid configuration:\n  passes.cleanup.max_nodes"
    )
