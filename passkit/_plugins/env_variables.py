"""The ``PASSKIT_*`` environment variables installed distributions declare.

passkit refuses a ``PASSKIT_*`` variable it does not know, so that a typo is an error rather
than a setting silently ignored; a distribution that reads variables of its own
(passkit-fusion's ``PASSKIT_FUSION_PDL``...) declares them through the
``passkit_environment_variables`` hook, implemented in its light ``passkit.cli`` module, and
the core's check (:func:`passkit.config.env_source`) asks here.

This module stands below the config and the plugin registry (the registry's plugin sets are
built from a config, which is being read when its variables are checked): it loads the
``passkit.cli`` entry points itself (light modules: no pass plugin, no torch; a module
already imported is not imported again) into a plugin manager of its own, every
distribution allowed (a variable is a known name whether or not its distribution's passes
load), each hookimpl isolated and its return checked (:mod:`.hook_returns`). A distribution
that fails is named in one log line, and its variables stay unknown.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable
from typing import cast

import pluggy

from .. import hookspecs, logs
from ..errors import describe
from . import hook_returns

CLI_GROUP = "passkit.cli"

_said: set[str] = set()


def declared_variables(reserved: Iterable[str] = ()) -> dict[str, str]:
    """``{variable: "what it does [distribution]"}`` of every installed distribution's
    ``passkit_environment_variables``. ``reserved``: the core's own variables, which no
    distribution declares (they stay the core's)."""
    reserved = frozenset(reserved)
    found: dict[str, str] = {}
    for who, value in _answers():  # checked by hook_returns: a dict, a list or a tuple of names
        described = value if isinstance(value, dict) else dict.fromkeys(cast("Iterable[str]", value), "")
        for name, what in described.items():
            if name not in reserved:
                found.setdefault(name, f"{what} [{who}]".strip())
    return found


def _answers() -> list[tuple[str, object]]:
    """``(distribution, value)`` of each ``passkit.cli`` module's hookimpl that answered well."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    out: list[tuple[str, object]] = []
    for ep in importlib.metadata.entry_points(group=CLI_GROUP):
        dist = getattr(getattr(ep, "dist", None), "name", None) or ep.value
        try:
            module = ep.load()
            if not pm.is_registered(module):
                pm.register(module, name=f"{dist}:{ep.name}")
            impls = [i for i in pm.hook.passkit_environment_variables.get_hookimpls() if i.plugin is module]
            for impl in impls:
                value = impl.function()
                if value is None:
                    continue
                wrong = hook_returns.problem("passkit_environment_variables", value, repr(dist))
                if wrong:
                    raise hook_returns.HookReturnError(wrong)
                out.append((dist, value))
        except BaseException as exc:  # SystemExit too: a plugin must not end config loading
            if isinstance(exc, KeyboardInterrupt):
                raise
            message = (
                f"passkit: the environment variables of distribution {dist!r} ({ep.value}) are not "
                f"known: its passkit_environment_variables failed: {describe(exc)}"
            )
            if message not in _said:
                _said.add(message)
                logs.log.warning("%s", message)
    return out
