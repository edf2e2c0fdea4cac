"""Exceptions raised by passkit.

Every error a user can cause derives from :class:`PasskitError` and carries a message that
names the offending thing (config field, pass name, plugin distribution). The CLI prints
these without a traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

ECHO_LIMIT = 200
"""The most characters of a user's value an error message repeats (see :func:`cut`)."""


def cut(value: object, limit: int = ECHO_LIMIT) -> str:
    """``str(value)`` for an error message: whole when short, else its start and its length
    (``'aaaa…' (5000 characters)``), so that no message grows with the input."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text)} characters)"


def describe(exc: BaseException) -> str:
    """``Type: message`` for a report or an error, the message cut (:func:`cut`); never
    raises (an exception whose ``str()`` fails is described by its type)."""
    try:
        text = str(exc)
    except Exception:
        text = "<str() of the exception raised>"
    return f"{type(exc).__name__}: {cut(text)}"


def cut_repr(value: object, limit: int = ECHO_LIMIT) -> str:
    """``repr(value)``, cut like :func:`cut`."""
    return cut(repr(value), limit)


def suggest(name: str, known: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for a close name, else ``""``."""
    if len(name) > 200:  # no name that long is close to an installed one (and difflib is quadratic)
        return ""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(c) for c in close) + "?)"


MESSAGE_LIMIT = 2000
"""The longest message a :class:`PasskitError` carries; longer ones are cut (a safety net:
the messages cut the values they echo, see :func:`cut`)."""


class PasskitError(Exception):
    """Base class of every error passkit raises on purpose."""

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str) and len(args[0]) > MESSAGE_LIMIT:
            message = args[0]
            args = (f"{message[: MESSAGE_LIMIT - 60]}… (message cut: {len(message)} characters)",)
        super().__init__(*args)


class ConfigError(PasskitError, ValueError):
    """The configuration is invalid: unknown pass, wrong option type, malformed file..."""


class PluginError(PasskitError):
    """A plugin failed to load, validate or register its passes (strict mode)."""


class PluginHookError(PluginError):
    """A plugin's hookimpl raised at compile or CLI time, with ``strict_plugins`` or
    ``on_error="raise"`` (otherwise it is disabled and recorded; see :mod:`passkit._plugins.hooks`).
    The plugin's exception is the ``__cause__``."""

    def __init__(self, message: str, *, plugin: str, distribution: str | None, hook: str):
        super().__init__(message)
        self.plugin, self.distribution, self.hook = plugin, distribution, hook


class OrderError(ConfigError):
    """The enabled passes cannot be ordered: a cycle or a violated before/after constraint."""


class PassFailedError(PasskitError):
    """A pass failed with ``on_error="raise"``: it raised (the graph has been restored to its
    state before it), or Inductor failed on the graph it changed (``inductor_error``)."""

    def __init__(self, message: str, *, pass_name: str, ran_before: list[str]):
        super().__init__(message)
        self.pass_name = pass_name
        self.ran_before = ran_before
        self.inductor_error: BaseException | None = None
        """When Inductor failed on the graph the pass changed: Inductor's error (also the
        ``__cause__``, which ``torch.compile`` drops from the errors it lets through)."""


class PassCodeError(PasskitError):
    """A pass's own code, called by passkit outside :meth:`~passkit.Pass.run`, raised:
    ``skip_reason``, ``token_constraint``, its options model or ``__init__``. Names the pass
    and the method; the pass's exception is the ``__cause__``."""

    def __init__(self, message: str, *, pass_name: str, method: str):
        super().__init__(message)
        self.pass_name, self.method = pass_name, method


class CompilerError(PasskitError):
    """The compiler passkit's backend hands its graphs to (``compiler=``, config key
    ``compiler``) raised, or returned something that is not a callable. Names the compiler and
    the graph; its exception is the ``__cause__``."""


class VerificationError(PasskitError):
    """A pass left a graph that fails lint or fake-tensor re-propagation."""


class PassDeclinedWarning(UserWarning):
    """An enabled pass declined a graph for a reason the user must act on: it cannot read
    an op of this torch or host version (a schema it does not know), so it changed nothing.
    The report's status says ``declined`` with the reason; this warning is emitted once per
    process for each pass and reason, so a pass that fuses nothing is never silent."""


class PassSkippedWarning(UserWarning):
    """An enabled pass skipped a graph for its own reason (:meth:`passkit.Pass.skip_reason`: a
    package not installed, a device or world size it needs), which holds for every graph of
    the process: it does nothing there. Emitted (and logged) once per process for each pass
    and reason, with the fix where the pass names one; the report's status says ``skipped``."""


class ConfigWarning(UserWarning):
    """A config that passkit accepts but that likely does not do what was meant: a name in
    ``disable``, ``plugins`` or ``block_plugins`` that nothing installed has, an empty
    ``PASSKIT_DUMP_DIR``, a ``passkit.yaml`` passkit does not read, a dump folder it cannot
    write. Also logged."""


def warn_config(message: str) -> None:
    """Warn (:class:`ConfigWarning`) and log ``message`` once per process."""
    if message in _warned:
        return
    _warned.add(message)
    import logging
    import warnings

    logging.getLogger("passkit").warning("passkit: %s", message)
    warnings.warn(message, ConfigWarning, stacklevel=3)


_warned: set[str] = set()
