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


@hookimpl
def passkit_environment_checks() -> list[object]:
    """SGLang on a CPU with AMX tiles (:mod:`passkit.hosts.sglang.amx`); nothing elsewhere."""
    from ..environment import EnvironmentCheck
    from ..hosts.sglang import amx

    found = amx.check()
    return [] if found is None else [EnvironmentCheck("SGLang on this CPU (AMX)", *found)]
