"""Calling the plugin hooks of the command line (``passkit_cli_commands``, ``passkit_demos``)
with the plugins the config allows.

Below both :mod:`passkit.cli` (which adds plugins' commands) and :mod:`passkit.demo` (which
runs plugins' demos), so that the demo does not import the CLI that runs it.
"""

from __future__ import annotations

import sys
from typing import Any


def call_hook(
    hook: str, cli_only: bool = False, checkpoint: Any = None, check: Any = None, **kwargs: Any
) -> list[Any]:
    """Call a CLI-time plugin hook (``passkit_cli_commands``, ``passkit_demos``), each
    hookimpl isolated: one that raises is named on stderr and skipped (with
    ``strict_plugins``: :class:`PluginHookError`). ``cli_only``: on the light plugin set
    (the ``passkit.cli`` entry points and in-process plugins; no pass plugin is imported,
    hence no torch), else on every plugin. ``checkpoint``, ``check``: see
    :func:`passkit._plugins.hooks.call`."""
    from ..config import load_config
    from .registry import plugins_for

    config = load_config()
    plugins = plugins_for(config, cli_only=cli_only)
    seen = len(plugins.hook_failures)
    results = plugins.call(hook, strict=config.strict_plugins, checkpoint=checkpoint, check=check, **kwargs)
    for failure in plugins.hook_failures[seen:]:
        print(f"passkit: warning: {failure}", file=sys.stderr)
    return results


def plugin_demos(cli_only: bool = False) -> dict[str, Any]:
    """The plugins' demos (``passkit_demos`` hook) by name, in plugin order."""
    found: dict[str, Any] = {}
    for demos in call_hook("passkit_demos", cli_only=cli_only):
        found.update(demos if isinstance(demos, dict) else {})
    return found
