"""The command line answers ``--help`` and usage errors without importing torch.

Each case runs in a fresh interpreter with the installed plugins (passkit-fusion, the
example plugin), as the ``passkit`` console script does (``passkit.cli:main``), and checks
``sys.modules`` after the call: torch costs seconds to import, a ``--help`` should not.
Plugins' commands come from the ``passkit.cli`` entry points (passkit-fusion's
:mod:`passkit_fusion.commands`), which the parser loads without the pass plugins.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import argparse, json, sys
from passkit.cli import build_parser, main

parser, _ = build_parser()
sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
commands = sorted(sub.choices)
cases = [["--help"]] + [[c, "--help"] for c in commands] + [["explain"], ["show"], ["tune-model", "--bogus"]]
seen = []
for argv in cases:
    try:
        code = main(argv)
    except SystemExit as exc:  # not expected: main returns
        code = f"SystemExit {exc.code}"
    seen.append({"argv": argv, "code": code, "torch": "torch" in sys.modules})
    if "torch" in sys.modules:
        break
print("RESULT " + json.dumps({"commands": commands, "seen": seen}))
"""


def _probe() -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, cwd=ROOT)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, f"probe failed (rc {out.returncode}):\n{out.stderr[-3000:]}"
    return json.loads(line.removeprefix("RESULT "))


def test_help_and_usage_errors_do_not_import_torch():
    found = _probe()
    # the built-in commands and passkit-fusion's, from its passkit.cli entry point
    assert {"list", "show", "schema", "check", "explain", "demo"} <= set(found["commands"])
    assert {"tune", "tune-model", "explain-hf"} <= set(found["commands"])
    imported = [case["argv"] for case in found["seen"] if case["torch"]]
    assert not imported, f"`passkit {' '.join(imported[0])}` imported torch"
    codes = {" ".join(case["argv"]): case["code"] for case in found["seen"]}
    assert codes["--help"] == 0 and codes["tune-model --help"] == 0
    assert codes["explain"] == 2 and codes["tune-model --bogus"] == 2  # usage errors


def test_import_passkit_is_light_and_names_resolve_on_use():
    code = (
        "import sys, passkit; light = 'torch' not in sys.modules; "
        "from passkit import Pass, hookimpl, ConfigError; still = 'torch' not in sys.modules; "
        "backend = passkit.backend; print(light, still, 'torch' in sys.modules, callable(backend))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["True", "True", "True", "True"], out.stderr[-2000:]


def test_a_command_of_a_pass_plugin_is_still_found(monkeypatch, capsys):
    """A plugin that adds its command from its ``passkit.passes`` module (not a light
    ``passkit.cli`` one) still gets it: an unknown word makes the CLI load every plugin."""
    import passkit
    from passkit.cli import main

    class Plugin:
        @passkit.hookimpl
        def passkit_cli_commands(self, subparsers):
            subparsers.add_parser("hello", help="say hello")
            return {"hello": lambda args: print("hello from the plugin") or 0}

    plugin = Plugin()
    # registered where only the full plugin set sees it, as an entry point of passkit.passes
    real = passkit._plugins.registry.get_plugins

    def get_plugins(*, cli_only=False, **kwargs):
        found = real(cli_only=cli_only, **kwargs)
        if not cli_only and not found.pm.is_registered(plugin):
            found.add(plugin, passkit._plugins.registry.PluginInfo("hello", None, None, "hello"))
        return found

    monkeypatch.setattr(passkit._plugins.registry, "get_plugins", get_plugins)
    passkit._plugins.registry.reset()
    try:
        assert main(["hello"]) == 0
        assert "hello from the plugin" in capsys.readouterr().out
    finally:
        passkit._plugins.registry.reset()


def test_the_lazy_names_are_the_names_type_checkers_see():
    """``passkit/__init__.py``'s ``_LAZY`` (what runs) and its ``if TYPE_CHECKING:`` imports
    (what type checkers and readers see) name the same things, from the same modules."""
    import ast

    import passkit

    tree = ast.parse((ROOT / "passkit/__init__.py").read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If)]
    imported = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1
        for alias in node.names:
            module = f".{node.module}" if node.module else f".{alias.name}"
            imported[alias.asname or alias.name] = module
    assert imported == passkit._LAZY
    assert set(passkit.__all__) == {*passkit._LAZY, "__version__"}
