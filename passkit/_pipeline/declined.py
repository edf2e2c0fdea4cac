"""Loud declines and skips: an enabled pass that changes nothing is warned about, once.

A pass that finds an op it cannot read (a schema of another torch or host version) leaves
the graph as it was: the pipeline marks its record ``declined`` and calls
:func:`warn_declined`. A pass whose own :meth:`~passkit.Pass.skip_reason` (its requirements:
a package, the device, the world size) skips a graph skips every graph of the process
alike: the pipeline calls :func:`warn_skipped`. Neither may be silent at default log
settings: each emits its warning (:class:`~passkit.errors.PassDeclinedWarning`,
:class:`~passkit.errors.PassSkippedWarning`) and logs it, once per process for each pass and
reason (a model compiles dozens of graphs; one line per cause is enough to act on).
Skips a user chose (a token range, a graph kind, the order of passes) stay in the report only.
"""

from __future__ import annotations

import warnings

from .. import logs
from ..errors import PassDeclinedWarning, PassSkippedWarning

__all__ = ["reset_declined_warnings", "warn_declined", "warn_host_idle", "warn_skipped"]

_warned: set[tuple[str, str]] = set()


def warn_declined(pass_name: str, origin: str, reason: str) -> bool:
    """Warn that pass ``pass_name`` (from ``origin``, its distribution and version) declined a
    graph because of ``reason``; True when this is the first time in this process."""
    message = f"passkit: pass {pass_name!r} ({origin}) changed nothing: {reason}"
    return _once((pass_name, reason), message, PassDeclinedWarning)


def warn_skipped(pass_name: str, origin: str, reason: str) -> bool:
    """Warn that the enabled pass ``pass_name`` skipped a graph for its own ``reason`` (which
    names the fix: the package to install, the option to set); True the first time."""
    message = f"passkit: pass {pass_name!r} ({origin}) is enabled but does not run: {reason}"
    return _once((pass_name, reason), message, PassSkippedWarning)


def warn_host_idle(pass_names: list[str], reason: str) -> bool:
    """Warn that the host compiles nothing, so the enabled ``pass_names`` never run:
    ``reason`` names the cause and the flag to change. True the first time."""
    message = f"passkit: the enabled passes {', '.join(pass_names)} do not run: {reason}"
    return _once(("<host>", reason), message, PassSkippedWarning)


def _once(key: tuple[str, str], message: str, category: type[Warning]) -> bool:
    if key in _warned:
        return False
    _warned.add(key)
    logs.log.warning("%s", message)
    warnings.warn(category(message), stacklevel=3)
    return True


def reset_declined_warnings() -> None:
    """Forget what was warned (tests)."""
    _warned.clear()
