"""The ``fusion`` entry point of the ``passkit.cli`` group: passkit-fusion's commands
(``passkit tune``, ``tune-model``, ``explain-hf``) and demos.

The command line loads this module alone to build its parser: it imports no pass and no
torch (each command's modules load when it runs), so ``passkit --help`` and ``passkit
tune-model --help`` answer at once.
"""

from __future__ import annotations

import argparse
from typing import Any

from passkit import hookimpl


@hookimpl
def passkit_environment_variables() -> dict[str, str]:
    """The variables passkit-fusion reads (its README documents each): the core accepts them."""
    return {
        "PASSKIT_FUSION_PDL": "launch allreduce_rmsnorm's kernel with programmatic dependent launch (launch_with_pdl)",
        "PASSKIT_FUSION_CHECK_CALLS": "ranks agree on every call's token count (check_calls; a debugging switch)",
        "PASSKIT_FUSION_COLLECTIVE_TIMEOUT": "seconds a rank waits for the others to agree on a plan (collective_timeout_s)",
        "PASSKIT_FUSION_HOST_ID": "this machine's identity, for which ranks share a host",
    }


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
