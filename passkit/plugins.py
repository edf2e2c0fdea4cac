"""The plugin set: the plugins installed and loaded, and the passes they register.

What a host adapter or a test harness reads about plugins (``passkit_testing`` does): the
process-wide :func:`get_plugins` (entry points of the ``passkit.passes`` group, loaded once
per process, and what :func:`register` added in-process), the :class:`PluginSet` it returns
with each pass's :class:`PassInfo`, and the pass objects a config's entries name in it
(:func:`instantiate`). Loading, validating and calling plugins is passkit's machinery
(``passkit._plugins``); these are its public names.
"""

from ._plugins.registry import (
    CLI_ENTRY_POINT_GROUP,
    ENTRY_POINT_GROUP,
    HOOKSPECS_GROUP,
    PassInfo,
    PassNameClashWarning,
    PluginFailure,
    PluginInfo,
    PluginSet,
    get_plugins,
    instantiate,
    isolated,
    register,
    unknown_pass_message,
    unregister,
)

__all__ = [
    "CLI_ENTRY_POINT_GROUP",
    "ENTRY_POINT_GROUP",
    "HOOKSPECS_GROUP",
    "PassInfo",
    "PassNameClashWarning",
    "PluginFailure",
    "PluginInfo",
    "PluginSet",
    "get_plugins",
    "instantiate",
    "isolated",
    "register",
    "unknown_pass_message",
    "unregister",
]
