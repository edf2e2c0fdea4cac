"""The hook through which a distribution adds a dialect (see :mod:`.base`).

passkit-fusion declares this module in the ``passkit.hookspecs`` entry-point group, so
passkit adds the hook to its plugin manager before it loads any plugin: a plugin (an
installed ``passkit.passes`` entry point, or ``passkit.register(obj)`` in-process)
implements it with ``passkit.hookimpl`` like any passkit hook::

    @passkit.hookimpl
    def passkit_fusion_dialects():
        return [MyStackDialect]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from passkit import hookspec

if TYPE_CHECKING:
    from .base import Dialect


@hookspec
def passkit_fusion_dialects() -> list[type[Dialect] | Dialect]:  # type: ignore[empty-body]
    """Return the dialects (classes or instances) this plugin provides. passkit-fusion's
    own plugin returns ``torch``, ``vllm`` and ``sglang``; names must be unique."""
