"""No plugin can silence another, change a graph unguarded, replace a built-in command or
take ``passkit list`` / ``check`` down: each case with fake plugins installed as real
distributions (:class:`tests.conftest.Site`)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import passkit
from passkit.cli import main

HOOK_PLUGIN = textwrap.dedent(
    """
    import sys
    import torch
    import passkit

    aten = torch.ops.aten

    {body}
    """
)


def install(plugin_site, distribution: str, body: str, group: str = "passkit.passes") -> None:
    module = distribution.replace("-", "_") + "_plugin"
    source = HOOK_PLUGIN.format(body=textwrap.dedent(body).strip())
    plugin_site.install(distribution, {module: source}, {group: {distribution: module}})


def fn(x):
    return torch.relu(x * 2.0) + 1.0


X = torch.randn(8)


def compile_report(**config):
    backend = passkit.backend(compiler="aot_eager", **config)
    out = torch.compile(fn, backend=backend)(X)
    (report,) = backend.reports
    return report, out


# -- vetoes: every plugin is asked -------------------------------------------------------

VETO = """
@passkit.hookimpl
def passkit_before_pass(pass_, gm, context):
    return "aaa-veto rules it out" if pass_.name == "noop_elimination" else None
"""


@pytest.mark.parametrize("silent", ['""', "False", "None"])
def test_a_plugin_saying_no_veto_does_not_hide_another_plugins_veto(plugin_site, clean_env, silent):
    """pluggy's firstresult chain ended at the first non-None answer: ``""`` or ``False``
    from one plugin dropped another plugin's veto."""
    install(plugin_site, "aaa-veto", VETO)
    install(
        plugin_site,
        "zzz-quiet",
        f"@passkit.hookimpl\ndef passkit_before_pass(pass_, gm, context):\n    return {silent}\n",
    )
    report, out = compile_report(passes=["noop_elimination", "cleanup"])
    assert (report["noop_elimination"].status, report["noop_elimination"].reason) == (
        "vetoed",
        "aaa-veto rules it out",
    )
    assert report["cleanup"].status == "ran"
    assert not report.hook_failures
    torch.testing.assert_close(out, fn(X))


def test_every_plugins_veto_reason_is_kept(plugin_site, clean_env):
    install(plugin_site, "aaa-veto", VETO)
    install(plugin_site, "bbb-veto", VETO.replace("aaa-veto", "bbb-veto"))
    report, _ = compile_report(passes=["noop_elimination"])
    assert report["noop_elimination"].status == "vetoed"
    assert sorted(report["noop_elimination"].reason.split("; ")) == [
        "aaa-veto rules it out",
        "bbb-veto rules it out",
    ]


def test_a_veto_that_is_no_reason_is_the_plugins_named_failure(plugin_site, clean_env):
    install(
        plugin_site,
        "acme-true",
        "@passkit.hookimpl\ndef passkit_before_pass(pass_, gm, context):\n    return True\n",
    )
    report, _ = compile_report(passes=["noop_elimination"])
    assert report["noop_elimination"].status == "ran"
    (failure,) = report.hook_failures
    assert (failure.hook, failure.distribution) == ("passkit_before_pass", "acme-true")
    assert "returned True: passkit_before_pass returns the reason to veto the pass" in failure.error


# -- graph changes in passkit_after_pass go through the pass's guards -------------------

CHANGE_SCALE = """
@passkit.hookimpl
def passkit_after_pass(pass_, gm, result, record):
    for node in gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor):
        node.update_arg(1, 3.0)
"""

BREAK_SCHEMA = """
@passkit.hookimpl
def passkit_after_pass(pass_, gm, result, record):
    (relu,) = gm.graph.find_nodes(op="call_function", target=aten.relu.default)
    relu.args = (relu.args[0], 5)
"""

ADD_CLONE = """
@passkit.hookimpl
def passkit_after_pass(pass_, gm, result, record):
    (relu,) = gm.graph.find_nodes(op="call_function", target=aten.relu.default)
    with gm.graph.inserting_after(relu):
        clone = gm.graph.call_function(aten.clone.default, (relu,))
    clone.meta.update(relu.meta)
    relu.replace_all_uses_with(clone, delete_user_cb=lambda user: user is not clone)
"""


def test_a_value_change_after_a_pass_is_caught_by_numeric_verify_and_undone(plugin_site, clean_env):
    """A plugin changing ``x * 2.0`` into ``x * 3.0`` in passkit_after_pass left the report
    clean, with numeric verify on."""
    install(plugin_site, "acme-after", CHANGE_SCALE)
    report, out = compile_report(passes=["noop_elimination"], verify="numeric")
    (failure,) = report.hook_failures
    assert (failure.hook, failure.plugin, failure.distribution) == (
        "passkit_after_pass",
        "acme-after",
        "acme-after",
    )
    assert "the graph it changed in passkit_after_pass fails passkit's checks (undone)" in failure.error
    assert "output 0 differs" in failure.error
    torch.testing.assert_close(out, fn(X))  # the plugin's change is not in the compiled code
    assert "PLUGIN HOOK FAILED: hook passkit_after_pass of plugin 'acme-after'" in report.format()


def test_an_invalid_graph_after_a_pass_names_the_plugin_and_falls_back(plugin_site, clean_env):
    """``relu(x, 5)`` made in passkit_after_pass was a raw error later, naming no plugin."""
    install(plugin_site, "acme-after", BREAK_SCHEMA)
    report, out = compile_report(passes=["noop_elimination", "cleanup"])
    (failure,) = report.hook_failures  # disabled after its first failure: once, not per pass
    assert failure.distribution == "acme-after" and failure.during == "pass 'noop_elimination'"
    assert "VerificationError" in failure.error and "relu" in failure.error
    assert [r.status for r in report.records] == ["ran", "ran"]
    torch.testing.assert_close(out, fn(X))


def test_a_valid_change_after_a_pass_is_kept_and_blamed_on_the_plugin(plugin_site, clean_env):
    install(plugin_site, "acme-after", ADD_CLONE)
    report, out = compile_report(passes=["noop_elimination"])
    record = report["noop_elimination"]
    assert not report.hook_failures and record.modified
    assert any("plugin 'acme-after' changed the graph in passkit_after_pass" in n for n in record.notes), (
        record.notes
    )
    torch.testing.assert_close(out, fn(X))


def test_a_plugin_ending_the_process_in_a_hook_is_named(plugin_site, clean_env):
    install(plugin_site, "acme-exit", "@passkit.hookimpl\ndef passkit_report(report):\n    sys.exit(3)\n")
    report, _ = compile_report(passes=["noop_elimination"])
    (failure,) = report.hook_failures
    assert failure.error == "SystemExit: 3 (a plugin must not end the process)"


# -- the command line's own commands ------------------------------------------------------

REPLACE_CHECK = """
@passkit.hookimpl
def passkit_cli_commands(subparsers):
    subparsers.add_parser("acme-hello")
    return {"check": lambda args: print("fine") or 0, "acme-hello": lambda args: 0}
"""

ADD_LIST_PARSER = """
@passkit.hookimpl
def passkit_cli_commands(subparsers):
    subparsers.add_parser("list")
    return {}
"""


def test_a_plugin_cannot_replace_passkit_check(plugin_site, tmp_path):
    """A plugin returning ``{"check": ...}`` made ``passkit check`` print its "fine", rc 0,
    on an invalid config."""
    install(plugin_site, "acme-cli", REPLACE_CHECK, group="passkit.cli")
    (tmp_path / "passkit.toml").write_text('passes = ["no_such_pass"]\n')
    done = subprocess.run(
        [sys.executable, "-m", "passkit.cli", "check"], env=plugin_site.env(), cwd=tmp_path,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "fine" not in done.stdout and "unknown pass 'no_such_pass'" in done.stderr
    assert (
        "hook passkit_cli_commands of plugin 'acme-cli (commands)' (distribution acme-cli 0.1) raised"
        in done.stderr
    )
    assert (
        "the command(s) 'check' are passkit's own: a plugin cannot replace a built-in command" in done.stderr
    )


def test_a_plugin_adding_a_parser_named_list_leaves_list_working(plugin_site, clean_env, capsys):
    install(plugin_site, "acme-cli", ADD_LIST_PARSER, group="passkit.cli")
    assert main(["list"]) == 0
    shown = capsys.readouterr()
    assert "cleanup" in shown.out
    assert (
        "hook passkit_cli_commands of plugin 'acme-cli (commands)'" in shown.err
        and "conflicting subparser" in shown.err
    )


@pytest.mark.parametrize("status", ['"done"', "[0]", "1.5"])
def test_a_plugin_command_returning_no_exit_status_is_one_line(plugin_site, clean_env, capsys, status):
    body = f"""
    @passkit.hookimpl
    def passkit_cli_commands(subparsers):
        subparsers.add_parser("acme-run")
        return {{"acme-run": lambda args: {status}}}
    """
    install(plugin_site, "acme-cli", body, group="passkit.cli")
    assert main(["acme-run"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert (
        "passkit acme-run: error: the plugin command 'acme-run' returned" in err
        and "not an exit status" in err
    )


# -- passkit_environment_checks that misbehave --------------------------------------------

BAD_CHECKS = {
    "acme-five": "return 5",
    "acme-raises": "yield passkit.EnvironmentCheck('acme thing', True, 'fine')\n    raise RuntimeError('gave up midway')",
    "acme-exits": "sys.exit(0)",
}


def _install_bad_checks(plugin_site):
    for dist, body in BAD_CHECKS.items():
        install(plugin_site, dist, f"@passkit.hookimpl\ndef passkit_environment_checks():\n    {body}\n")


def test_bad_environment_checks_leave_list_and_check_working(plugin_site, clean_env, capsys):
    """``return 5`` crashed ``passkit list``; ``sys.exit(0)`` made it print nothing, rc 0."""
    _install_bad_checks(plugin_site)
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "cleanup" in out
    assert (
        "FAIL passkit_environment_checks: TypeError: returned 5: passkit_environment_checks returns a list"
        in out
    )
    assert "FAIL passkit_environment_checks: RuntimeError: gave up midway [plugin 'acme-raises'" in out
    assert (
        "FAIL passkit_environment_checks: SystemExit: 0 (a plugin must not end the process) [plugin 'acme-exits'"
        in out
    )
    assert main(["check"]) == 1
    out = capsys.readouterr().out
    assert "3 environment check(s) failed" in out and "acme-five" in out
    assert main(["list", "--json"]) == 0
    failed = [c for c in json.loads(capsys.readouterr().out)["environment"] if not c["ok"]]
    assert len(failed) == 3


def test_an_after_pass_plugin_is_part_of_the_cache_identity(plugin_site, clean_env):
    """Its kept changes are in the compiled code: a warm Inductor cache must not serve the
    code compiled without it (or with another version of it)."""
    without = passkit.backend(passes=["noop_elimination"], compiler="aot_eager").pipeline.uuid()
    install(plugin_site, "acme-after", ADD_CLONE)
    with_it = passkit.backend(passes=["noop_elimination"], compiler="aot_eager").pipeline.uuid()
    assert with_it != without


def test_a_value_returned_by_a_hook_that_returns_nothing_is_said_once(plugin_site, clean_env, caplog):
    install(
        plugin_site,
        "acme-chatty",
        "@passkit.hookimpl\ndef passkit_after_pass(pass_, gm, result, record):\n    return 'ok'\n",
    )
    with caplog.at_level("WARNING", logger="passkit"):
        report, _ = compile_report(passes=["noop_elimination", "cleanup"])
    assert not report.hook_failures and report["cleanup"].status == "ran"
    said = [r.getMessage() for r in caplog.records if "acme-chatty" in r.getMessage()]
    assert said == [
        "passkit: hook passkit_after_pass of 'acme-chatty' returned 'ok'; the hook returns nothing, the value is ignored"
    ]
