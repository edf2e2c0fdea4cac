"""Plugin mistakes that load without an error are loud: ``passkit list`` reports them and the
first compile warns (``passkit.PluginMistakeWarning``), instead of a bare ``unknown pass``."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import passkit
from passkit._plugins import checks as plugin_checks
from passkit._plugins.registry import PluginInfo, PluginSet, get_plugins
from passkit.cli import main

from .support import MulToScale


class Unmarked:
    """The issue's plugin: ``passkit_register_passes`` without ``@passkit.hookimpl``."""

    def passkit_register_passes(self):
        return [MulToScale]


class Misspelt:
    def passkit_register_pass(self):  # singular: no such hook
        return [MulToScale]


class Empty:
    """Registers nothing at all."""

    def helper(self):
        return 1


class Good:
    @staticmethod
    @passkit.hookimpl
    def passkit_register_passes():
        return [MulToScale]

    def not_a_hook(self):
        return None


def _info(name: str) -> PluginInfo:
    return PluginInfo(name, "acme-passes", "1.2.3", name)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    plugin_checks.reset_warned()
    yield
    plugin_checks.reset_warned()


def test_a_hook_function_without_the_marker_is_a_mistake():
    ps = PluginSet()
    assert ps.add(Unmarked(), _info("unmarked"))
    (mistake,) = ps.mistakes  # one line per cause: not also "registers nothing"
    assert "passkit_register_passes is not a hook implementation: decorate it with @passkit.hookimpl" in (
        mistake.message
    )
    assert str(mistake).startswith("plugin 'unmarked' (distribution acme-passes 1.2.3): ")
    assert "mul_to_scale" not in ps.passes


def test_a_misspelt_hook_name_gets_a_suggestion():
    ps = PluginSet()
    ps.add(Misspelt(), _info("misspelt"))
    messages = [m.message for m in ps.mistakes]
    assert any(
        "passkit_register_pass is named like a hook but passkit has no hook 'passkit_register_pass'; "
        "did you mean 'passkit_register_passes'" in m
        for m in messages
    ), messages


def test_a_plugin_with_no_hook_registers_nothing():
    ps = PluginSet()
    ps.add(Empty(), _info("empty"))
    (mistake,) = ps.mistakes
    assert "implements no passkit hook, so it registers nothing" in mistake.message


def test_a_correct_plugin_and_the_installed_ones_have_no_mistake():
    ps = PluginSet()
    assert ps.add(Good(), _info("good"))
    assert ps.mistakes == [] and "mul_to_scale" in ps.passes
    # builtin, passkit-fusion and the example plugin: no false alarm on real plugins
    assert get_plugins().mistakes == []
    assert len(get_plugins().plugins) >= 3


def test_strict_plugins_raises_on_a_mistake():
    ps = PluginSet()
    ps._strict = True
    with pytest.raises(passkit.PluginError, match=r"decorate it with @passkit\.hookimpl"):
        ps.add(Unmarked(), _info("unmarked"))
    assert not ps.pm.get_plugins()


def test_passkit_list_reports_the_mistake(capsys, clean_env):
    passkit.register(Unmarked(), name="fold_plugin")
    assert main(["list"]) == 0
    err = capsys.readouterr().err
    assert "PLUGIN MISTAKE: plugin 'fold_plugin': passkit_register_passes is not a hook implementation" in err
    assert main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert any(
        m["name"] == "fold_plugin" and "@passkit.hookimpl" in m["message"] for m in data["mistakes"]
    ), data["mistakes"]


def test_the_first_compile_warns_and_the_unknown_pass_error_names_the_mistake(clean_env):
    passkit.register(Unmarked(), name="fold_plugin")
    with (
        pytest.warns(passkit.PluginMistakeWarning, match="'fold_plugin': passkit_register_passes"),
        pytest.raises(passkit.ConfigError) as info,
    ):
        passkit.backend(passes=["mul_to_scale"])
    assert "unknown pass 'mul_to_scale'" in str(info.value)
    assert "Plugins that loaded with a mistake: plugin 'fold_plugin'" in str(info.value)


def test_a_compile_that_does_not_need_the_plugin_warns_once(clean_env):
    passkit.register(Empty(), name="empty_plugin")
    with pytest.warns(passkit.PluginMistakeWarning, match="'empty_plugin': it implements no passkit hook"):
        b = passkit.backend(passes=["cleanup"], mode="eager")
        torch.compile(lambda x: x + 1, backend=b)(torch.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", passkit.PluginMistakeWarning)
        passkit.backend(passes=["cleanup"], mode="eager")  # once per process
