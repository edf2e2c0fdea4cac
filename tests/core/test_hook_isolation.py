"""Plugin hooks called at compile and CLI time are isolated: a hookimpl that raises is
recorded (plugin, distribution, hook) and disabled, the compile goes on; strict settings
raise a named error."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import passkit
from passkit import hookimpl
from passkit._pipeline.build import Pipeline
from passkit._plugins.registry import PluginInfo, PluginSet, get_plugins, instantiate

from .support import PLUGIN, register_all, small_fn

COMPILE_HOOKS = {
    "passkit_configure_pipeline": "plan, context",
    "passkit_before_pass": "pass_, gm, context",
    "passkit_after_pass": "pass_, gm, result, record",
    "passkit_pass_failed": "pass_, gm, error, record",
    "passkit_report": "report",
}
PASSES = ["mul_to_scale", "halfway_then_fail", "cleanup"]  # one ran, one failed: every hook fires


@pytest.fixture(autouse=True)
def _plugins(clean_env):
    register_all()


def raising_plugin(hook: str, calls: list[str], message: str = "hook bug") -> object:
    """A plugin object whose ``hook`` raises (and counts its calls)."""
    args = COMPILE_HOOKS.get(hook, "")
    namespace: dict[str, object] = {}
    exec(f"def {hook}(self, {args}):\n    calls.append({hook!r})\n    raise ValueError(message)", {"calls": calls, "message": message}, namespace)  # fmt: skip
    cls = type(f"Raising_{hook}", (), {hook: hookimpl(namespace[hook])})
    return cls()


def spy_plugin(hook: str, calls: list[str]) -> object:
    args = COMPILE_HOOKS[hook]
    namespace: dict[str, object] = {}
    exec(f"def {hook}(self, {args}):\n    calls.append({hook!r})", {"calls": calls}, namespace)
    return type(f"Spy_{hook}", (), {hook: hookimpl(namespace[hook])})()


def traced():
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        return make_fx(small_fn, tracing_mode="fake")(torch.randn(4, 8))


def pipeline_with(plugin: object, **config) -> Pipeline:
    """A pipeline whose plugin set holds the test passes and ``plugin`` as if installed from
    the distribution ``acme-hooks 0.3``."""
    plugins = PluginSet()
    plugins.load_entry_points(autoload=False)  # passkit's built-ins (cleanup)
    assert plugins.add(PLUGIN, PluginInfo("core-test-passes", None, None, __name__))
    assert plugins.add(plugin, PluginInfo("acme", "acme-hooks", "0.3", "acme.plugin")), plugins.failures
    cfg = passkit.load_config(passes=PASSES, **config)
    return Pipeline(cfg, plugins, instantiate(cfg, plugins))


@pytest.mark.parametrize("hook", sorted(COMPILE_HOOKS))
def test_each_compile_hook_is_isolated_recorded_and_disabled(hook):
    calls: list[str] = []
    spied: list[str] = []
    pipeline = pipeline_with(raising_plugin(hook, calls))
    pipeline.plugins.add(spy_plugin(hook, spied), PluginInfo("spy", None, None, "spy"))
    report = pipeline.run(traced())
    # the compile went on: every pass has its usual outcome
    assert [(r.name, r.status) for r in report.records] == [
        ("mul_to_scale", "ran"),
        ("halfway_then_fail", "failed"),
        ("cleanup", "ran"),
    ]
    (failure,) = report.hook_failures
    assert (failure.hook, failure.plugin, failure.distribution, failure.version) == (
        hook,
        "acme",
        "acme-hooks",
        "0.3",
    )
    assert failure.error == "ValueError: hook bug"
    table = report.format()
    assert f"PLUGIN HOOK FAILED: hook {hook} of plugin 'acme' (distribution acme-hooks 0.3) raised" in table
    assert json.loads(report.to_json())["hook_failures"][0]["distribution"] == "acme-hooks"
    assert passkit.Report.from_dict(report.to_dict()).hook_failures == [failure]
    # the other plugin's hookimpl still ran; the failing one is disabled for the next compile
    assert calls == [hook] and spied
    spied.clear()
    again = pipeline.run(traced())
    assert calls == [hook] and not again.hook_failures and spied
    assert pipeline.plugins.hook_failures == [failure]


@pytest.mark.parametrize("setting", [{"strict_plugins": True}, {"on_error": "raise"}])
@pytest.mark.parametrize("hook", ["passkit_configure_pipeline", "passkit_before_pass", "passkit_report"])
def test_strict_settings_raise_a_named_error(hook, setting):
    pipeline = pipeline_with(raising_plugin(hook, []), **setting)
    pipeline.passes = [p for p in pipeline.passes if p.name != "halfway_then_fail"]
    with pytest.raises(passkit.PluginHookError) as caught:
        pipeline.run(traced())
    err = caught.value
    assert (err.plugin, err.distribution, err.hook) == ("acme", "acme-hooks", hook)
    assert isinstance(err.__cause__, ValueError)
    assert f"hook {hook} of plugin 'acme' (distribution acme-hooks 0.3) raised" in str(err)
    assert "ValueError: hook bug" in str(err)


def test_configure_hook_that_changed_the_plan_then_raised_is_undone():
    class HalfConfigured:
        @hookimpl
        def passkit_configure_pipeline(self, plan, context):
            plan.skip("cleanup", "half-done")
            plan.set_options("mul_to_scale", factor=9.0)
            raise RuntimeError("configured half, then broke")

    gm = traced()
    report = pipeline_with(HalfConfigured()).run(gm)
    assert report["cleanup"].status == "ran"
    assert "9.0" not in gm.code and "2.0" in gm.code  # mul_to_scale kept its own options
    assert report.hook_failures[0].during == f"the compile of graph {report.graph_id}"


def test_before_pass_failure_names_the_pass_and_does_not_veto():
    report = pipeline_with(raising_plugin("passkit_before_pass", [])).run(traced())
    assert report["mul_to_scale"].status == "ran"
    assert report.hook_failures[0].during == "pass 'mul_to_scale'"


def test_long_hook_error_is_cut():
    report = pipeline_with(raising_plugin("passkit_report", [], "x" * 50_000)).run(traced())
    assert len(str(report.hook_failures[0])) < 500 and "50000 characters" in report.hook_failures[0].error


def test_torch_compile_survives_every_raising_hook_at_once():
    calls: list[str] = []
    for hook in COMPILE_HOOKS:
        passkit.register(raising_plugin(hook, calls), name=f"bad-{hook}")
    backend = passkit.backend(passes=PASSES)
    x = torch.randn(4, 8)
    out = torch.compile(small_fn, backend=backend)(x)
    torch.testing.assert_close(out, torch.relu(x * 2.0) + 1.0)  # mul_to_scale's rewrite (factor 2)
    (report,) = backend.reports
    assert sorted(f.hook for f in report.hook_failures) == sorted(COMPILE_HOOKS)
    assert {f.plugin for f in report.hook_failures} == {f"bad-{h}" for h in COMPILE_HOOKS}
    assert report["mul_to_scale"].status == "ran" and report["halfway_then_fail"].status == "failed"


def test_hook_wrappers_are_rejected_at_registration():
    class Wrapper:
        @hookimpl(wrapper=True)
        def passkit_report(self, report):
            return (yield)

    plugins = PluginSet()
    assert not plugins.add(Wrapper(), PluginInfo("wrap", "acme-wrap", "1", "wrap"))
    assert plugins.failures[0].stage == "validate" and "wrapper" in plugins.failures[0].error


# -- CLI-time hooks ---------------------------------------------------------------------


def test_raising_cli_commands_hook_leaves_the_cli_working(capsys):
    calls: list[str] = []
    passkit.register(raising_plugin("passkit_cli_commands", calls), name="bad-cli")
    from passkit.cli import main

    assert main(["list"]) == 0
    err = capsys.readouterr().err
    assert "hook passkit_cli_commands of plugin 'bad-cli' (in-process) raised" in err
    assert "ValueError: hook bug" in err and calls == ["passkit_cli_commands"]


def test_raising_cli_commands_hook_with_strict_plugins_is_an_error(capsys, monkeypatch):
    monkeypatch.setenv("PASSKIT_STRICT_PLUGINS", "1")
    passkit.register(raising_plugin("passkit_cli_commands", []), name="bad-cli")
    from passkit.cli import main

    assert main(["list"]) == 2
    assert "passkit: error: hook passkit_cli_commands of plugin 'bad-cli'" in capsys.readouterr().err


def test_raising_demos_hook_and_raising_demo_are_isolated(capsys):
    ran: list[str] = []

    class BrokenDemo:
        @hookimpl
        def passkit_demos(self):
            return {"broken": lambda args: 1 / 0, "fine": lambda args: ran.append("fine") or 0}

    passkit.register(raising_plugin("passkit_demos", []), name="bad-demos")
    passkit.register(BrokenDemo(), name="broken-demo")
    from passkit.demo import main

    status = main(argparse.Namespace(only=["broken", "fine"], mode="eager"))
    out = capsys.readouterr()
    assert status == 1 and ran == ["fine"]
    assert "plugin demo broken failed: ZeroDivisionError" in out.out
    assert "hook passkit_demos of plugin 'bad-demos' (in-process) raised" in out.err
    assert any(f.plugin == "bad-demos" for f in get_plugins().hook_failures)
