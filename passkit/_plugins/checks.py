"""Plugin mistakes that load without an error, made loud.

pluggy registers any object: a plugin whose hook functions lack ``@passkit.hookimpl`` loads
fine and contributes nothing, so the only symptom used to be ``unknown pass`` at compile
time. :func:`find_mistakes` names two such mistakes of a registered plugin object:

* a function or method named ``passkit_*`` that is not a hook implementation (the
  ``@passkit.hookimpl`` marker is missing, or the name is a misspelt hook);
* a plugin that implements no hook at all (it registers nothing).

:class:`~passkit._plugins.registry.PluginSet` records them as :class:`PluginMistake` (``passkit list``
prints them, ``passkit list --json`` lists them under ``mistakes``) and
:func:`warn_mistakes` warns of each once per process, with a :class:`PluginMistakeWarning`,
when the first pipeline is built (the first compile).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import warnings

import pluggy

from .. import logs

__all__ = ["PluginMistake", "PluginMistakeWarning", "find_mistakes", "warn_mistakes"]

HOOK_PREFIX = "passkit_"


class PluginMistakeWarning(UserWarning):
    """A plugin loaded but contributes nothing it seems meant to: a ``passkit_*`` function
    without ``@passkit.hookimpl``, or no hook implementation at all."""


@dataclasses.dataclass(frozen=True)
class PluginMistake:
    """A plugin that loaded with a mistake, and what it is."""

    name: str
    distribution: str | None
    version: str | None
    message: str

    def __str__(self) -> str:
        who = f"plugin {self.name!r}"
        if self.distribution:
            who += f" (distribution {self.distribution} {self.version})"
        return f"{who}: {self.message}"


def find_mistakes(pm: pluggy.PluginManager, plugin: object) -> list[str]:
    """What is wrong with ``plugin``, registered in ``pm`` (empty when nothing is)."""
    hooks = sorted(name for name in vars(pm.hook) if name.startswith(HOOK_PREFIX))
    out = []
    for name in _unmarked_hook_functions(pm, plugin):
        if name in hooks:
            out.append(f"{name} is not a hook implementation: decorate it with @passkit.hookimpl")
        else:
            close = difflib.get_close_matches(name, hooks, n=1, cutoff=0.75)
            hint = f"; did you mean {close[0]!r} (with @passkit.hookimpl)?" if close else ""
            out.append(f"{name} is named like a hook but passkit has no hook {name!r}{hint}")
    if not out and not pm.get_hookcallers(plugin):  # (an unmarked hook says it already)
        out.append(
            "it implements no passkit hook, so it registers nothing (a plugin's functions need "
            "@passkit.hookimpl, e.g. on passkit_register_passes)"
        )
    return out


def _unmarked_hook_functions(pm: pluggy.PluginManager, plugin: object) -> list[str]:
    names = []
    for name in dir(plugin):
        if not name.startswith(HOOK_PREFIX):
            continue
        try:
            value = inspect.getattr_static(plugin, name)
        except AttributeError:
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if not inspect.isroutine(value):
            continue
        if pm.parse_hookimpl_opts(plugin, name) is None:
            names.append(name)
    return names


_warned: set[str] = set()


def warn_mistakes(mistakes: list[PluginMistake], stacklevel: int = 2) -> list[str]:
    """Warn of each mistake not warned of before in this process; returns the new ones."""
    new = [str(m) for m in mistakes if str(m) not in _warned]
    for text in new:
        _warned.add(text)
        message = f"passkit: {text}"
        logs.log.warning("%s", message)
        warnings.warn(PluginMistakeWarning(message), stacklevel=stacklevel + 1)
    return new


def reset_warned() -> None:
    """Forget what was warned (tests)."""
    _warned.clear()
