"""What each plugin hook may return, checked for every hookimpl's value.

:func:`problem` says what is wrong with a value a hookimpl returned (None: nothing);
:mod:`passkit._plugins.hooks` treats a wrong value as that hookimpl's failure (named,
isolated, disabled) as it treats an exception, so a plugin cannot crash a caller with a
value of the wrong type (a ``passkit_cli_commands`` handler map that is a list, a
``passkit_before_pass`` "reason" that is ``True``). Hooks that return nothing
(``passkit_configure_pipeline``, ``passkit_after_pass``, ``passkit_pass_failed``,
``passkit_report``) ignore a value, with a log line once per hookimpl.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import logs
from ..errors import cut_repr


class HookReturnError(TypeError):
    """A hookimpl returned a value its hook does not take (named as the plugin's failure)."""


def veto_reason(value: Any) -> str | None:
    """The veto a ``passkit_before_pass`` value says: a non-empty string; None, ``""`` and
    ``False`` are no veto (and end nothing: every plugin is asked)."""
    return value if isinstance(value, str) and value else None


def _before_pass(value: Any) -> str | None:
    if value is None or value is False or isinstance(value, str):
        return None
    return "passkit_before_pass returns the reason to veto the pass (a non-empty str), or None"


def _handlers(hook: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if not isinstance(value, dict):
            return f"{hook} returns a dict of name -> handler(args) -> int"
        for name, handler in value.items():
            if not isinstance(name, str) or not name:
                return f"{hook} returned the name {cut_repr(name)} (names are non-empty str)"
            if not callable(handler):
                return f"{hook} returned {cut_repr(handler)} for {name!r}, which is not callable"
        return None

    return check


def _variables(value: Any) -> str | None:
    names = list(value) if isinstance(value, (dict, list, tuple)) else None
    if names is None:
        return "passkit_environment_variables returns a dict of variable -> what it does"
    for name in names:
        if not isinstance(name, str) or not name.startswith("PASSKIT_") or not name.isupper():
            return f"declared the variable {cut_repr(name)} (a name is upper case and starts with PASSKIT_)"
    return None


_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "passkit_before_pass": _before_pass,
    "passkit_cli_commands": _handlers("passkit_cli_commands"),
    "passkit_demos": _handlers("passkit_demos"),
    "passkit_environment_variables": _variables,
}
_RETURN_NOTHING = frozenset(
    {"passkit_configure_pipeline", "passkit_after_pass", "passkit_pass_failed", "passkit_report"}
)
_said: set[tuple[str, str]] = set()


def problem(hook: str, value: Any, who: str) -> str | None:
    """What is wrong with ``value``, returned by ``who``'s hookimpl of ``hook`` (None:
    nothing). None itself is always fine (the hookimpl has nothing to say)."""
    if value is None:
        return None
    if hook in _RETURN_NOTHING:
        if (hook, who) not in _said:
            _said.add((hook, who))
            logs.log.warning(
                "passkit: hook %s of %s returned %s; the hook returns nothing, the value is ignored",
                hook,
                who,
                cut_repr(value, 100),
            )
        return None
    check = _CHECKS.get(hook)
    found = check(value) if check is not None else None
    return None if found is None else f"returned {cut_repr(value, 100)}: {found}"
