"""The ``fusion`` entry point of the ``passkit.passes`` group: what passkit-fusion adds.

Loading it is cheap: it imports the pass classes (names, options, token constraints, skip
reasons) and nothing they need to rewrite a graph or run. The custom ops are defined when a
pass runs or when an op is first looked up (:mod:`.lazy_ops`: code that Inductor restores
from its cache calls ``torch.ops.passkit_fusion.*``, which defines them then); the matcher,
the runtimes, flashinfer and torch's async-TP modules load when a pass needs them.
"""

from __future__ import annotations

import argparse
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


@hookimpl
def passkit_demos() -> dict[str, Any]:
    return {"allreduce_rmsnorm": _demo, "tp_passes": _tp_demo}


@hookimpl
def passkit_cli_commands(subparsers: Any) -> dict[str, Any]:
    from .coverage.cli import EXPLAIN_HF_HELP, add_explain_hf_arguments
    from .tuning.cli import TUNE_HELP, TUNE_MODEL_HELP, add_tune_arguments, add_tune_model_arguments

    add_tune_arguments(subparsers.add_parser("tune", help=TUNE_HELP, description=TUNE_HELP))
    add_tune_model_arguments(
        subparsers.add_parser("tune-model", help=TUNE_MODEL_HELP, description=TUNE_MODEL_HELP)
    )
    add_explain_hf_arguments(
        subparsers.add_parser("explain-hf", help=EXPLAIN_HF_HELP, description=EXPLAIN_HF_HELP)
    )
    return {"tune": _tune, "tune-model": _tune_model, "explain-hf": _explain_hf}


def _explain_hf(args: argparse.Namespace) -> int:
    from .coverage.cli import run_explain_hf

    return run_explain_hf(args)


def _tune(args: argparse.Namespace) -> int:
    from .allreduce_rmsnorm.runtime import destroy_workspaces
    from .allreduce_rmsnorm.tune import tune
    from .tuning.cli import run_tune

    return run_tune(args, tune=tune, cleanup=destroy_workspaces)


def _tune_model(args: argparse.Namespace) -> int:
    from .tuning.cli import run_tune_model

    return run_tune_model(args)


def _demo(args: argparse.Namespace) -> int:
    from .demo import main

    return main(args)


def _tp_demo(args: argparse.Namespace) -> int:
    from .tp_demo import main

    return main(args)
