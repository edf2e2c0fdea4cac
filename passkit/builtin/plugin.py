"""The core's own plugin: the ``builtin`` entry point in ``passkit.passes``."""

from __future__ import annotations

from ..hookspecs import hookimpl
from ..pass_base import Pass
from .cleanup import Cleanup
from .noop_elimination import NoopElimination
from .reinplace import Reinplace


@hookimpl
def passkit_register_passes() -> list[type[Pass]]:
    return [NoopElimination, Cleanup, Reinplace]
