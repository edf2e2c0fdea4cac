"""Calling plugin hooks in isolation.

Every hook passkit calls while compiling or running the CLI (``passkit_configure_pipeline``,
``passkit_before_pass``, ``passkit_after_pass``, ``passkit_pass_failed``,
``passkit_report``, ``passkit_cli_commands``, ``passkit_demos``) goes through :func:`call`,
which calls each plugin's hookimpl on its own, in pluggy's order. A hookimpl that raises
does not reach the compile: the failure is recorded as a :class:`HookFailure` naming the
plugin, its distribution and version, the hook and the error (on the compile's report, and
on the :class:`~passkit._plugins.registry.PluginSet`), and that hookimpl is disabled for the rest of
the process (in that plugin set: :func:`passkit._plugins.registry.reset` loads plugins afresh), so a
broken hook is reported once rather than at every pass of every compile. The other
plugins' hookimpls, and the passes, go on. With ``strict=True`` (``strict_plugins = true``
or ``on_error = "raise"``) a :class:`~passkit.errors.PluginHookError` naming the same
things is raised instead, chained to the plugin's exception.

(``passkit_register_passes`` runs when plugins load; :class:`~passkit._plugins.registry.PluginSet`
isolates it the same way, as a load failure.)
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any, Protocol

import pluggy

from .. import logs
from ..errors import PluginHookError, describe
from ..hook_failure import HookFailure
from . import hook_returns

Undo = Callable[[], None]


class PluginOrigin(Protocol):
    """Where a plugin comes from (a :class:`passkit._plugins.registry.PluginInfo`)."""

    @property
    def name(self) -> str: ...
    @property
    def distribution(self) -> str | None: ...
    @property
    def version(self) -> str | None: ...


class PluginSetLike(Protocol):
    """What :func:`call` uses of a :class:`passkit._plugins.registry.PluginSet`: a protocol, so that
    this module imports nothing of :mod:`passkit._plugins.registry`, which calls hooks through it."""

    pm: pluggy.PluginManager
    disabled_hooks: set[tuple[str, int]]
    hook_failures: list[HookFailure]

    def info_of(self, plugin: object) -> PluginOrigin | None: ...


def call(
    plugins: PluginSetLike,
    hook: str,
    kwargs: dict[str, Any],
    *,
    strict: bool = False,
    during: str | None = None,
    record: list[HookFailure] | None = None,
    checkpoint: Callable[[], Undo] | None = None,
    check: Callable[[object, Any], None] | None = None,
) -> list[Any]:
    """Call every enabled hookimpl of ``hook`` with ``kwargs``, each in isolation.

    Returns the non-``None`` results in pluggy's call order (every hookimpl is called: no
    hook lets one plugin's answer hide another's); for a ``firstresult`` hook a plugin
    adds, stops at the first and returns ``[it]``. A hookimpl that raises (any
    ``BaseException`` but ``KeyboardInterrupt``; ``SystemExit`` is named as the plugin's
    mistake) or returns a value its hook does not take (:mod:`.hook_returns`) is disabled
    and its :class:`HookFailure` appended to ``plugins.hook_failures`` and to ``record`` (a
    report's list), and logged; with ``strict`` a :class:`PluginHookError` is raised.
    ``checkpoint()``, when given, is called before each hookimpl and returns a function
    that undoes what that hookimpl changed, called when it fails; ``check(plugin, value)``,
    when given, is called after each hookimpl returns and raises when what it changed or
    returned is wrong (the pipeline's guards on a graph changed in ``passkit_after_pass``, a
    plugin command named like a built-in one): that hookimpl's failure too, undone."""
    caller = getattr(plugins.pm.hook, hook)
    firstresult = bool(caller.spec and caller.spec.opts.get("firstresult"))
    results: list[Any] = []
    for impl in reversed(caller.get_hookimpls()):  # pluggy calls the last registered first
        if (hook, id(impl.plugin)) in plugins.disabled_hooks:
            continue
        undo = checkpoint() if checkpoint is not None else None
        try:
            value = impl.function(*[kwargs[name] for name in impl.argnames])
            wrong = hook_returns.problem(hook, value, _name(plugins, impl.plugin))
            if wrong:
                raise hook_returns.HookReturnError(wrong)
            if check is not None:
                check(impl.plugin, value)
        except BaseException as exc:  # SystemExit too: a hookimpl must not end the process
            if isinstance(exc, KeyboardInterrupt):
                raise
            if undo is not None:
                undo()
            failure = _failure(plugins, hook, impl.plugin, exc, during)
            if strict:
                raise PluginHookError(
                    f"hook {hook} of {failure.who} raised{_during(during)}: {failure.error} "
                    f"(strict_plugins / on_error='raise'; otherwise the hookimpl is disabled and "
                    f"the failure recorded in the report)",
                    plugin=failure.plugin,
                    distribution=failure.distribution,
                    hook=hook,
                ) from exc
            plugins.disabled_hooks.add((hook, id(impl.plugin)))
            plugins.hook_failures.append(failure)
            if record is not None:
                record.append(failure)
            logs.log.warning("passkit: %s", failure)
            continue
        if value is not None:
            results.append(value)
            if firstresult:
                break
    return results


def _name(plugins: PluginSetLike, plugin: object) -> str:
    info = plugins.info_of(plugin)
    return repr(info.name) if info else repr(str(plugins.pm.get_name(plugin)))


def _during(during: str | None) -> str:
    return f" during {during}" if during else ""


def _failure(
    plugins: PluginSetLike, hook: str, plugin: object, exc: BaseException, during: str | None
) -> HookFailure:
    info = plugins.info_of(plugin)
    return HookFailure(
        hook=hook,
        plugin=info.name if info else str(plugins.pm.get_name(plugin)),
        distribution=info.distribution if info else None,
        version=info.version if info else None,
        error=describe(exc) + (" (a plugin must not end the process)" if isinstance(exc, SystemExit) else ""),
        during=during,
        detail=_traceback(exc),
    )


def _traceback(exc: BaseException) -> str:
    try:
        return "".join(traceback.format_exception(exc, limit=-3))
    except Exception:  # an exception whose str() raises
        return ""
