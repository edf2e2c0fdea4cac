"""Host op dialects: the collectives and norms of torch, vLLM and SGLang, for the passes.

* :mod:`.base`: the :class:`Dialect` interface and what dialects return.
* :mod:`.torch`, :mod:`.vllm`, :mod:`.vllm_cpu` (vLLM's CPU build), :mod:`.sglang`: the
  shipped dialects.
* :mod:`.hookspecs`: the ``passkit_fusion_dialects`` hook a third party implements.

:func:`registered` lists the dialects every plugin declared (passkit-fusion's own
first); :func:`check_schemas` compares a dialect's expected schemas with the ops this
process registered (``nox -s hosts`` runs it against the real vLLM and SGLang).
Importing this package imports no host.
"""

from __future__ import annotations

import logging
from typing import Any

from .base import AllReduce, Collective, Declined, Dialect, HostNorm, check_schemas

__all__ = [
    "AllReduce",
    "Collective",
    "Declined",
    "Dialect",
    "HostNorm",
    "builtin",
    "check_schemas",
    "registered",
]

logger = logging.getLogger("passkit_fusion")

_cache: dict[int, tuple[Any, list[Dialect]]] = {}


def builtin() -> list[type[Dialect]]:
    """The dialects passkit-fusion ships, in matching order."""
    from .sglang import SGLangDialect
    from .torch import TorchDialect
    from .vllm import VllmDialect
    from .vllm_cpu import VllmCpuDialect

    return [TorchDialect, VllmDialect, VllmCpuDialect, SGLangDialect]


def registered(plugins: Any = None) -> list[Dialect]:
    """One instance of every dialect the loaded plugins declare through
    ``passkit_fusion_dialects`` (``plugins``: a ``passkit.plugins.PluginSet``; default
    :func:`passkit.get_plugins`). Built-in dialects come first; a later dialect whose name
    is taken is skipped with a warning. Without the hook (passkit-fusion's metadata not
    installed) the built-in ones."""
    import passkit

    plugins = plugins if plugins is not None else passkit.get_plugins()
    known = _cache.get(id(plugins))
    if known is not None and known[0] is plugins:
        return known[1]
    declared: list[Any] = []
    if getattr(plugins.hook, "passkit_fusion_dialects", None) is not None:
        # each hookimpl isolated: one that raises is recorded (plugin, distribution) and disabled
        results = plugins.call("passkit_fusion_dialects", during="collecting passkit-fusion's dialects")
        for result in reversed(results):  # pluggy calls the last registered first
            if isinstance(result, (list, tuple)):
                declared.extend(result)
            else:
                logger.warning(
                    "passkit_fusion: ignoring passkit_fusion_dialects result %r: not a list", result
                )
    ordered = [*builtin(), *(d for d in declared if _cls(d) not in builtin())]
    dialects: list[Dialect] = []
    for item in ordered:
        dialect = item() if isinstance(item, type) else item
        if not isinstance(dialect, Dialect) or not dialect.name:
            logger.warning("passkit_fusion: ignoring dialect %r: not a named Dialect", item)
            continue
        if any(d.name == dialect.name for d in dialects):
            logger.warning("passkit_fusion: dialect name %r is taken; %r skipped", dialect.name, item)
            continue
        dialects.append(dialect)
    _cache[id(plugins)] = (plugins, dialects)
    return dialects


def _cls(item: Any) -> type:
    return item if isinstance(item, type) else type(item)
