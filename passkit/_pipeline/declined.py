"""Loud declines: an enabled pass that cannot read the graph is warned about, once.

A pass that finds an op it cannot read (a schema of another torch or host version) leaves
the graph as it was. That must never be silent: the pipeline marks its record
``declined`` and calls :func:`warn_declined`, which emits a
:class:`~passkit.errors.PassDeclinedWarning` once per process for each pass and reason
(a model compiles dozens of graphs; one warning per cause is enough to act on) and logs it.
"""

from __future__ import annotations

import warnings

from .. import logs
from ..errors import PassDeclinedWarning

__all__ = ["reset_declined_warnings", "warn_declined"]

_warned: set[tuple[str, str]] = set()


def warn_declined(pass_name: str, origin: str, reason: str) -> bool:
    """Warn that pass ``pass_name`` (from ``origin``, its distribution and version) declined a
    graph because of ``reason``; True when this is the first time in this process."""
    key = (pass_name, reason)
    if key in _warned:
        return False
    _warned.add(key)
    message = f"passkit: pass {pass_name!r} ({origin}) changed nothing: {reason}"
    logs.log.warning("%s", message)
    warnings.warn(PassDeclinedWarning(message), stacklevel=2)
    return True


def reset_declined_warnings() -> None:
    """Forget what was warned (tests)."""
    _warned.clear()
