"""The hooks a passkit plugin can implement.

A plugin is any module or object with functions decorated by ``passkit.hookimpl`` whose
names are below. Installed plugins are found through the ``passkit.passes`` entry-point
group; in-process ones are added with ``passkit.register(plugin)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

PROJECT = "passkit"
hookspec = pluggy.HookspecMarker(PROJECT)
"""Marks a hook specification a distribution adds for other plugins to implement (its module
named in the ``passkit.hookspecs`` entry-point group)."""
hookimpl = pluggy.HookimplMarker(PROJECT)
"""Marks a plugin's implementation of a hook (``@passkit.hookimpl`` on a function named like
the hook). A ``passkit_*`` function without it is no hook: ``passkit list`` reports it."""

if TYPE_CHECKING:
    import argparse

    import torch.fx

    from .context import CompileContext
    from .environment import EnvironmentCheck
    from .pass_base import Pass, PassResult
    from .pipeline_plan import PipelinePlan
    from .report import PassRecord, Report


@hookspec
def passkit_register_passes() -> list[type[Pass]]:  # type: ignore[empty-body]
    """Return the pass classes this plugin provides."""


@hookspec
def passkit_configure_pipeline(plan: PipelinePlan, context: CompileContext) -> None:
    """Adjust the passes about to run for one compile (skip some, change options).

    ``plan`` is mutable: ``plan.skip(name, reason)``, ``plan.set_options(name, **opts)``.
    Must decide from ``context`` and the graph-independent config only, identically on
    every rank.
    """


@hookspec
def passkit_before_pass(pass_: Pass, gm: torch.fx.GraphModule, context: CompileContext) -> str | None:
    """Called before each pass. Return a non-empty string (the reason) to veto the pass;
    None, ``""`` or ``False`` vetoes nothing. Every plugin is asked (no answer hides another
    plugin's veto); the pass is vetoed when any of them vetoes it, with every reason."""


@hookspec
def passkit_after_pass(pass_: Pass, gm: torch.fx.GraphModule, result: PassResult, record: PassRecord) -> None:
    """Called after each pass that ran and succeeded."""


@hookspec
def passkit_pass_failed(
    pass_: Pass, gm: torch.fx.GraphModule, error: BaseException, record: PassRecord
) -> None:
    """Called after a pass raised; ``gm`` is already restored to its state before it."""


@hookspec
def passkit_report(report: Report) -> None:
    """Called once per compiled graph with the full report."""


@hookspec
def passkit_cli_commands(subparsers: argparse._SubParsersAction) -> dict[str, Any]:  # type: ignore[empty-body]
    """Add sub-commands to the ``passkit`` CLI.

    Add parsers to ``subparsers`` and return ``{command_name: handler}`` where
    ``handler(args) -> int`` runs the command.

    Implement it (and :func:`passkit_demos`) in a light module named in the ``passkit.cli``
    entry-point group: the CLI builds its parser from those modules alone, without the pass
    plugins, so ``passkit --help`` imports no torch; import what a command needs inside its
    handler. A ``passkit.passes`` plugin implementing it works too, but its commands are
    not listed by ``passkit --help`` (the CLI loads every plugin when a command is unknown).
    """


@hookspec
def passkit_demos() -> dict[str, Any]:  # type: ignore[empty-body]
    """Return ``{name: fn}`` of demos ``passkit demo`` runs after the core one.

    ``fn(args) -> int`` prints its own output and returns an exit status.
    """


@hookspec
def passkit_environment_checks() -> list[EnvironmentCheck]:  # type: ignore[empty-body]
    """Return what this plugin depends on in the running environment, each checked: a
    list of :class:`passkit.EnvironmentCheck` (e.g. whether its passes can read the ops
    the installed torch registers). ``passkit list`` prints them; ``passkit check`` fails
    when one is not ok."""


@hookspec
def passkit_environment_variables() -> dict[str, str]:  # type: ignore[empty-body]
    """Return ``{variable: what it does}`` of the ``PASSKIT_*`` environment variables this
    distribution reads (``{"PASSKIT_FUSION_PDL": "launch the fused kernel with PDL"}``).

    passkit refuses a ``PASSKIT_*`` variable it does not know (a typo would be ignored); the
    ones a distribution declares here are accepted. Implement it in the light module named in
    the ``passkit.cli`` entry-point group: passkit asks when the environment holds a variable
    it does not know, before any pass plugin loads. Each name must start with ``PASSKIT_`` and
    be upper case; passkit's own are not a plugin's to declare.
    """
