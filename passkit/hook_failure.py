"""The record of a plugin hookimpl that raised (:class:`HookFailure`).

Its own module because three places share it: :mod:`passkit._plugins.hooks` makes it,
:class:`~passkit._plugins.registry.PluginSet` keeps the process's failures, and a
:class:`~passkit.report.Report` lists those of its compile.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class HookFailure:
    """A plugin's hookimpl that raised, and was disabled."""

    hook: str
    plugin: str
    distribution: str | None
    version: str | None
    error: str
    """``ExceptionType: message`` (a long message is cut)."""
    during: str | None = None
    """What passkit was doing (``"pass 'cleanup'"``, ``"compile of graph 3"``), if known."""
    detail: str = dataclasses.field(default="", compare=False, repr=False)
    """The last frames of the traceback (in ``passkit list --json`` and logs, not reports)."""

    @property
    def who(self) -> str:
        who = f"plugin {self.plugin!r}"
        if self.distribution:
            who += f" (distribution {self.distribution} {self.version or ''})".replace(" )", ")")
        else:
            who += " (in-process)"
        return who

    def __str__(self) -> str:
        during = f" during {self.during}" if self.during else ""
        return (
            f"hook {self.hook} of {self.who} raised{during}: {self.error}; "
            f"that hookimpl is disabled for the rest of the process"
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "detail"}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HookFailure:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})
