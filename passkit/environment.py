"""What plugins can tell about the running environment: ``passkit list`` and ``passkit check``.

A pass package whose passes read ops of torch or of a serving stack (passkit-fusion's
dialects) answers the ``passkit_environment_checks`` hook with one
:class:`EnvironmentCheck` per thing it depends on: whether it can read the ops the
installed torch and hosts register. ``passkit list`` prints them; ``passkit check`` prints
them and fails when one is not ok, so a pass that would decline every site is seen before
a model is compiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import cut_repr, describe

__all__ = ["EnvironmentCheck", "environment_checks"]


@dataclasses.dataclass(frozen=True)
class EnvironmentCheck:
    """One thing a plugin depends on, checked in this process."""

    subject: str
    """What was checked (``"torch dialect"``)."""
    ok: bool
    detail: str
    """What was found (``"torch 2.11.0+cu130: reads all 4 op(s)"``), or what is wrong."""
    plugin: str = ""
    """The plugin that answered (filled in by :func:`environment_checks`)."""

    def __str__(self) -> str:
        origin = f" [{self.plugin}]" if self.plugin else ""
        return f"{'ok  ' if self.ok else 'FAIL'} {self.subject}: {self.detail}{origin}"


def environment_checks(plugins: Any) -> list[EnvironmentCheck]:
    """Every plugin's answer to ``passkit_environment_checks``, each hookimpl isolated: one
    that raises (``SystemExit`` too; Ctrl-C goes through), even while its generator runs,
    or returns what is not a list of :class:`EnvironmentCheck` becomes a failed check naming
    the plugin, and the others' checks stand."""
    checks: list[EnvironmentCheck] = []
    caller = getattr(plugins.hook, "passkit_environment_checks", None)
    if caller is None:
        return checks
    for impl in reversed(caller.get_hookimpls()):
        info = plugins.info_of(impl.plugin)
        name = info.origin if info is not None else impl.plugin_name
        try:
            found = impl.function()
            if found is None:
                continue
            if isinstance(found, (str, bytes, Mapping)) or not isinstance(found, Iterable):
                raise TypeError(
                    f"returned {cut_repr(found, 100)}: passkit_environment_checks returns a list of "
                    "passkit.EnvironmentCheck"
                )
            answers = list(found)  # a generator runs here: what it raises is the plugin's
        except BaseException as exc:  # SystemExit too: a plugin must not end `passkit check`
            if isinstance(exc, KeyboardInterrupt):
                raise
            why = describe(exc)
            if isinstance(exc, SystemExit):
                why += " (a plugin must not end the process)"
            checks.append(EnvironmentCheck("passkit_environment_checks", False, why, name))
            continue
        for check in answers:
            if isinstance(check, EnvironmentCheck):
                checks.append(dataclasses.replace(check, plugin=name))
            else:
                checks.append(EnvironmentCheck(cut_repr(check, 100), False, "not an EnvironmentCheck", name))
    return checks
