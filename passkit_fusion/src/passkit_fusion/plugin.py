"""The ``fusion`` entry point of the ``passkit.passes`` group: what passkit-fusion adds.

Loading it is cheap: it imports the pass classes (names, options, token constraints, skip
reasons) and nothing they need to rewrite a graph or run. The custom ops are defined when a
pass runs or when an op is first looked up (:mod:`.lazy_ops`: code that Inductor restores
from its cache calls ``torch.ops.passkit_fusion.*``, which defines them then); the matcher,
the runtimes, flashinfer and torch's async-TP modules load when a pass needs them.
Its command-line commands and demos are in :mod:`.commands` (the ``passkit.cli`` entry
point), which the command line loads without this module.
"""

from __future__ import annotations

from typing import Any

from passkit import Pass, hookimpl

from . import lazy_ops
from .allreduce_layernorm import AllReduceLayerNorm
from .allreduce_overlap import AllReduceOverlap
from .allreduce_rmsnorm import AllReduceRMSNorm
from .async_tp import AsyncTP
from .sequence_parallel import SequenceParallel

lazy_ops.install()


@hookimpl
def passkit_register_passes() -> list[type[Pass]]:
    return [AllReduceRMSNorm, AllReduceLayerNorm, AllReduceOverlap, SequenceParallel, AsyncTP]


@hookimpl(optionalhook=True)  # optional: the plugin still loads where the hookspec entry point is missing
def passkit_fusion_dialects() -> list[Any]:
    from .dialects import builtin

    return builtin()


@hookimpl
def passkit_environment_checks() -> list[Any]:
    """Each registered dialect against the torch and hosts installed here (``passkit list``,
    ``passkit check``): whether it can read the ops they register."""
    from passkit import EnvironmentCheck

    from .dialects import registered

    return [EnvironmentCheck(f"{d.name} dialect", *d.check_environment()) for d in registered()]
