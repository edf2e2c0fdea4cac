"""A name means one thing everywhere: a pass spelled bare or qualified in ``passes``,
``disable`` and options, from a file or the environment; a distribution however it is spelled
in the block and allow lists; a pass name fits every place passkit writes it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import passkit
from passkit._plugins.registry import get_plugins, passes_for, plugins_for, warn_unknown_names
from passkit.cli import main
from passkit.pipeline_plan import PipelinePlan

ACME = textwrap.dedent(
    """
    import passkit

    class Fold(passkit.GraphPass):
        name = {name!r}

        def run(self, gm, ctx):
            return passkit.PassResult.unchanged()

    @passkit.hookimpl
    def passkit_register_passes():
        return [Fold]
    """
)


def _install(plugin_site, distribution="Acme_Passes", name="fold"):
    plugin_site.install(
        distribution,
        {"acme_passes_plugin": ACME.format(name=name)},
        {"passkit.passes": {"acme": "acme_passes_plugin"}},
    )


def fn(x):
    return torch.relu(x) + 1.0


@pytest.mark.parametrize(
    ("passes", "disable"),
    [("cleanup", "passkit:cleanup"), ("passkit:cleanup", "cleanup"), ("passkit:cleanup", "PassKit:cleanup")],
)
def test_a_pass_disabled_in_any_spelling_by_the_environment_does_not_run(
    clean_env, monkeypatch, passes, disable
):
    """The file enables it, the environment disables it: disable wins whatever the spelling
    (``PASSKIT_DISABLE=passkit:cleanup`` let ``cleanup`` run)."""
    (clean_env / "passkit.toml").write_text(f'passes = ["{passes}", "noop_elimination"]\n')
    monkeypatch.setenv("PASSKIT_DISABLE", disable)
    config = passkit.load_config()
    assert config.pass_names == ["noop_elimination"]
    backend = passkit.backend(compiler="aot_eager")
    torch.compile(fn, backend=backend)(torch.randn(4))
    (report,) = backend.reports
    assert [r.name for r in report.records] == ["noop_elimination"]


@pytest.mark.parametrize(
    ("passes", "disable"), [("cleanup", "passkit:cleanup"), ("passkit:cleanup", "cleanup")]
)
def test_one_source_enabling_and_disabling_one_pass_in_two_spellings_is_an_error(
    clean_env, monkeypatch, passes, disable
):
    """``passes=["passkit:cleanup"]`` + ``disable=["cleanup"]`` ran nothing and said nothing;
    the same spelling twice was already an error."""
    (clean_env / "passkit.toml").write_text(f'passes = ["{passes}"]\ndisable = ["{disable}"]\n')
    with pytest.raises(passkit.ConfigError, match=r"are both enabled \(passes\) and disabled \(disable\)"):
        passkit.load_config()
    monkeypatch.setenv("PASSKIT_PASSES", passes)
    monkeypatch.setenv("PASSKIT_DISABLE", disable)
    (clean_env / "passkit.toml").unlink()
    with pytest.raises(passkit.ConfigError, match=r"(?s)PASSKIT_\*.*both enabled"):
        passkit.load_config()


def test_a_lower_source_disabling_the_qualified_name_warns_and_wins(clean_env, caplog):
    (clean_env / "passkit.toml").write_text('disable = ["passkit:cleanup"]\n')
    with caplog.at_level("WARNING", logger="passkit"):
        config = passkit.load_config(passes=["cleanup", "noop_elimination"])
    assert config.pass_names == ["noop_elimination"]
    assert "pass 'cleanup', enabled by Python config, does not run" in caplog.text


def test_a_qualified_disable_of_another_distribution_leaves_the_pass_alone(clean_env):
    config = passkit.load_config(passes=["passkit:cleanup"], disable=["acme-passes:cleanup"])
    assert config.pass_names == ["passkit:cleanup"]


def test_options_and_plan_find_a_pass_by_either_spelling(clean_env):
    config = passkit.load_config(passes=[{"name": "passkit:noop_elimination"}])
    assert (
        config.options_for("noop_elimination") == {} and config.options_for("passkit:noop_elimination") == {}
    )
    plan = PipelinePlan(passes_for(config)[1])
    plan.skip("passkit:noop_elimination", "not today")
    assert plan.skipped == {"noop_elimination": "not today"}


# -- distributions: PEP 503 names in block and allow lists --------------------------------


@pytest.mark.parametrize("spelling", ["acme-passes", "Acme_Passes", "ACME.passes"])
def test_blocking_a_distribution_by_any_spelling_blocks_it(plugin_site, clean_env, spelling):
    """``passkit list`` prints ``acme-passes``; blocking that name blocked nothing."""
    _install(plugin_site)
    assert "fold" in get_plugins().passes
    config = passkit.load_config(block_plugins=[spelling])
    plugins = plugins_for(config)
    assert "fold" not in plugins.passes
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the entry matches: no "does nothing" warning
        warn_unknown_names(config, plugins)
    allowed = plugins_for(passkit.load_config(plugins=[spelling]))
    assert "fold" in allowed.passes


def test_blocking_the_qualified_owner_name_in_a_fresh_process(plugin_site, tmp_path):
    """The qualified names passkit prints (``acme-passes:fold``) name the distribution as
    PEP 503 spells it; blocking that spelling blocked nothing."""
    _install(plugin_site)
    env = plugin_site.env(PASSKIT_BLOCK_PLUGINS="acme-passes", PASSKIT_PASSES="fold")
    blocked = subprocess.run(
        [sys.executable, "-m", "passkit.cli", "check"], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert blocked.returncode == 2, blocked.stdout + blocked.stderr
    assert "unknown pass 'fold'" in blocked.stderr and "does nothing" not in blocked.stderr


def test_a_block_entry_that_matches_nothing_warns_once_naming_it(plugin_site, clean_env):
    _install(plugin_site)
    config = passkit.load_config(block_plugins=["acme-pases"])
    with pytest.warns(passkit.ConfigWarning) as caught:
        warn_unknown_names(config, plugins_for(config))
        warn_unknown_names(config, plugins_for(config))
    (warning,) = [w for w in caught if "acme-pases" in str(w.message)]
    assert "block_plugins: no installed plugin or distribution is named 'acme-pases'" in str(warning.message)
    assert "did you mean 'acme-passes'" in str(warning.message)


# -- pass names that cannot be written everywhere -----------------------------------------


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("evil/slash", "contains '/'"),
        ("two\nlines", "contains '\\n'"),
        ("tab\tbed", "contains '\\t'"),
        ("a,b", "contains ','"),
        ("x" * 101, "101 characters long"),
        ("..", "starts with '.'"),
    ],
)
def test_a_pass_name_that_cannot_be_written_is_a_named_plugin_failure(
    plugin_site, clean_env, capsys, name, why
):
    _install(plugin_site, name=name)
    plugins = get_plugins()
    (failure,) = [f for f in plugins.failures if f.distribution == "Acme_Passes"]
    assert failure.stage == "register" and why in failure.error, failure.error
    assert "pass class Fold: name" in failure.error
    assert "cleanup" in plugins.passes  # the other plugins loaded
    assert main(["list"]) == 0
    shown = capsys.readouterr()
    assert "acme" in shown.out + shown.err and why in shown.out + shown.err
