"""Plugin discovery, isolation and in-process registration."""

from __future__ import annotations

import importlib.metadata
import types

import pytest

import passkit
from passkit._plugins.registry import PluginSet, get_plugins

from .support import MulToScale, register_all


def test_builtins_come_through_the_entry_point():
    plugins = get_plugins()
    info = plugins.passes["noop_elimination"]
    assert info.plugin.distribution == "passkit"
    assert info.plugin.version == importlib.metadata.version("passkit")
    assert info.plugin.name == "builtin"
    eps = importlib.metadata.entry_points(group="passkit.passes")
    assert any(ep.value == "passkit.builtin.plugin" for ep in eps)


def test_discovery_happens_once_per_process():
    assert get_plugins() is get_plugins()


def test_in_process_register_and_unregister():
    register_all()
    assert "mul_to_scale" in get_plugins().passes
    assert get_plugins().passes["mul_to_scale"].plugin.distribution is None
    from .support import PLUGIN

    passkit.unregister(PLUGIN)
    assert "mul_to_scale" not in get_plugins().passes


def _plugin(**hooks):
    return types.SimpleNamespace(**hooks)


def _info(name):
    return passkit._plugins.registry.PluginInfo(name, "acme-passes", "1.2.3", name)


def test_bad_hookimpl_signature_is_reported_with_distribution():
    @passkit.hookimpl
    def passkit_register_passes(unexpected_arg):
        return []

    ps = PluginSet()
    assert not ps.add(_plugin(passkit_register_passes=passkit_register_passes), _info("bad"))
    (failure,) = ps.failures
    assert failure.stage == "validate" and failure.distribution == "acme-passes"
    assert "acme-passes 1.2.3" in str(failure) and "unexpected_arg" in str(failure)


def test_unknown_hook_name_is_reported():
    @passkit.hookimpl
    def passkit_register_pases():
        return []

    ps = PluginSet()
    assert not ps.add(_plugin(passkit_register_pases=passkit_register_pases), _info("typo"))
    assert "passkit_register_pases" in ps.failures[0].error


def test_registration_hook_that_raises_is_isolated():
    @passkit.hookimpl
    def raising():
        raise RuntimeError("cannot register")

    @passkit.hookimpl
    def good():
        return [MulToScale]

    ps = PluginSet()
    assert not ps.add(_plugin(passkit_register_passes=raising), _info("raiser"))
    assert ps.add(_plugin(passkit_register_passes=good), _info("good"))
    assert list(ps.passes) == ["mul_to_scale"]
    assert ps.failures[0].stage == "register" and "cannot register" in ps.failures[0].error


def test_non_pass_return_is_a_registration_failure():
    @passkit.hookimpl
    def passkit_register_passes():
        return [object]

    ps = PluginSet()
    ps.add(_plugin(passkit_register_passes=passkit_register_passes), _info("junk"))
    assert "not a Pass subclass" in ps.failures[0].error


def test_duplicate_pass_name_keeps_the_first():
    def make():
        @passkit.hookimpl
        def passkit_register_passes():
            return [MulToScale]

        return _plugin(passkit_register_passes=passkit_register_passes)

    ps = PluginSet()
    ps.add(make(), _info("one"))
    ps.add(make(), _info("two"))
    assert ps.passes["mul_to_scale"].plugin.name == "one"
    assert ps.failures[0].stage == "duplicate" and "already registered" in ps.failures[0].error


def test_strict_mode_raises_naming_the_plugin():
    @passkit.hookimpl
    def passkit_register_passes():
        raise RuntimeError("nope")

    ps = PluginSet()
    ps._strict = True
    with pytest.raises(
        passkit.PluginError, match=r"plugin 'strict' .distribution acme-passes 1.2.3. failed at register"
    ):
        ps.add(_plugin(passkit_register_passes=passkit_register_passes), _info("strict"))


def test_block_and_autoload_switches():
    assert "cleanup" not in get_plugins(block=["builtin"]).passes
    assert "cleanup" not in get_plugins(block=["passkit"]).passes  # by distribution name
    # the core's own passes still load with autoload off; third-party ones do not
    no_auto = get_plugins(autoload=False)
    assert "cleanup" in no_auto.passes
    assert all(p.plugin.distribution == "passkit" for p in no_auto.passes.values())


def test_allow_list_limits_third_party_plugins():
    allowed = get_plugins(allow=["nothing-like-this"])
    assert all(p.plugin.distribution == "passkit" for p in allowed.passes.values())


class _EntryPoint:
    """What PluginSet reads of an entry point of the ``passkit.hookspecs`` group."""

    def __init__(self, name, load):
        self.name, self.value, self.load = name, f"acme.{name}", load


def test_distributions_add_hookspecs_through_an_entry_point_group(monkeypatch):
    """A ``passkit.hookspecs`` entry point adds its hooks before any plugin loads, so a plugin
    implementing them validates; one that fails to import is recorded, the others load."""
    specs = types.ModuleType("acme_specs")

    @passkit.hookspec
    def acme_things() -> list:  # type: ignore[empty-body]
        """Return things."""

    specs.acme_things = acme_things

    def broken():
        raise ImportError("no module named acme_broken")

    eps = [_EntryPoint("specs", lambda: specs), _EntryPoint("broken", broken)]
    real = passkit._plugins.registry.discover

    def discover(groups):
        found = real(groups)
        found[passkit._plugins.registry.HOOKSPECS_GROUP] = [passkit._plugins.registry.Found(ep, "acme", "1.0") for ep in eps]
        return found

    monkeypatch.setattr(passkit._plugins.registry, "discover", discover)
    ps = PluginSet()
    (failure,) = ps.failures
    assert failure.stage == "hookspecs" and "acme_broken" in failure.error

    @passkit.hookimpl
    def acme_things():
        return ["a thing"]

    assert ps.add(_plugin(acme_things=acme_things), _info("things"))
    assert ps.hook.acme_things() == [["a thing"]]


def test_passkit_fusion_declares_its_dialect_hook():
    eps = importlib.metadata.entry_points(group=passkit._plugins.registry.HOOKSPECS_GROUP)
    assert any(ep.value == "passkit_fusion.dialects.hookspecs" for ep in eps)
    assert get_plugins().hook.passkit_fusion_dialects.spec is not None
