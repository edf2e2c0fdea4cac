"""The ``PASSKIT_*`` variables an installed distribution declares are accepted by the core
(``passkit_environment_variables``); any other ``PASSKIT_*`` stays an error naming it."""

from __future__ import annotations

import pytest
import torch

import passkit
from passkit._plugins.env_variables import declared_variables
from passkit.cli import main


def test_passkit_fusion_documented_variables_start_passkit_check(clean_env, monkeypatch, capsys):
    """``PASSKIT_FUSION_PDL=1 passkit check`` said "unknown environment variable", rc 2."""
    monkeypatch.setenv("PASSKIT_FUSION_PDL", "1")
    monkeypatch.setenv("PASSKIT_FUSION_CHECK_CALLS", "1")
    monkeypatch.setenv("PASSKIT_PASSES", "cleanup")  # (no pass enabled exits 1: what a server refuses)
    assert main(["check"]) == 0
    assert "unknown environment variable" not in capsys.readouterr().err


def test_every_variable_the_fusion_readme_names_is_declared():
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "passkit_fusion" / "README.md").read_text()
    documented = set(re.findall(r"PASSKIT_FUSION_[A-Z_]+", readme))
    declared = declared_variables()
    assert documented and documented <= set(declared), documented - set(declared)
    assert all(declared[name].endswith("[passkit-fusion]") for name in documented)


def test_a_backend_passkit_compile_starts_with_a_fusion_variable(clean_env, monkeypatch):
    monkeypatch.setenv("PASSKIT_FUSION_PDL", "1")
    monkeypatch.setenv("PASSKIT_PASSES", "noop_elimination")
    monkeypatch.setenv("PASSKIT_COMPILER", "aot_eager")
    x = torch.randn(4)
    out = torch.compile(lambda t: torch.relu(t) + 1, backend="passkit")(x)
    torch.testing.assert_close(out, torch.relu(x) + 1)


def test_an_unknown_variable_is_still_an_error_with_a_suggestion(clean_env, monkeypatch):
    monkeypatch.setenv("PASSKIT_FUSION_PLD", "1")
    with pytest.raises(
        passkit.ConfigError,
        match=r"unknown environment variable PASSKIT_FUSION_PLD \(did you mean PASSKIT_FUSION_PDL\?\)",
    ):
        passkit.load_config()
    monkeypatch.delenv("PASSKIT_FUSION_PLD")
    monkeypatch.setenv("PASSKIT_VERIFI", "1")
    with pytest.raises(passkit.ConfigError, match=r"did you mean PASSKIT_VERIFY\?"):
        passkit.load_config()


DECLARES = """
import passkit

@passkit.hookimpl
def passkit_environment_variables():
    return {declared}
"""


def test_a_third_party_distribution_declares_its_variables(plugin_site, clean_env, monkeypatch, capsys):
    plugin_site.install(
        "acme-env", {"acme_env_cli": DECLARES.format(declared='{"PASSKIT_ACME_MODE": "how acme runs"}')},
        {"passkit.cli": {"acme": "acme_env_cli"}},
    )  # fmt: skip
    monkeypatch.setenv("PASSKIT_ACME_MODE", "fast")
    assert passkit.load_config().passes == []
    assert main(["list"]) == 0
    assert "PASSKIT_ACME_MODE: how acme runs [acme-env]" in capsys.readouterr().out


@pytest.mark.parametrize(
    "declared", ['["acme_lower"]', "5", '{"PASSKIT_acme": ""}', "__import__('sys').exit(0)"]
)
def test_a_bad_declaration_is_the_distributions_named_failure(
    plugin_site, clean_env, monkeypatch, caplog, declared
):
    plugin_site.install(
        "acme-env",
        {"acme_env_cli": DECLARES.format(declared=declared)},
        {"passkit.cli": {"acme": "acme_env_cli"}},
    )
    monkeypatch.setenv("PASSKIT_ACME_MODE", "fast")
    unknown = pytest.raises(passkit.ConfigError, match="unknown environment variable PASSKIT_ACME_MODE")
    with caplog.at_level("WARNING", logger="passkit"), unknown:
        passkit.load_config()
    assert "the environment variables of distribution 'acme-env' (acme_env_cli) are not known" in caplog.text
    assert "HookReturnError: returned" in caplog.text or "SystemExit: 0" in caplog.text
