"""Exceptions raised by passkit.

Every error a user can cause derives from :class:`PasskitError` and carries a message that
names the offending thing (config field, pass name, plugin distribution). The CLI prints
these without a traceback.
"""

from __future__ import annotations


class PasskitError(Exception):
    """Base class of every error passkit raises on purpose."""


class ConfigError(PasskitError, ValueError):
    """The configuration is invalid: unknown pass, wrong option type, malformed file..."""


class PluginError(PasskitError):
    """A plugin failed to load, validate or register its passes (strict mode)."""


class OrderError(ConfigError):
    """The enabled passes cannot be ordered: a cycle or a violated before/after constraint."""


class PassFailedError(PasskitError):
    """A pass raised while running with ``on_error="raise"``.

    The graph has been restored to its state before the failing pass.
    """

    def __init__(self, message: str, *, pass_name: str, ran_before: list[str]):
        super().__init__(message)
        self.pass_name = pass_name
        self.ran_before = ran_before


class VerificationError(PasskitError):
    """A pass left a graph that fails lint or fake-tensor re-propagation."""
