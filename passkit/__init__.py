"""passkit: torch.compile graph passes as a plugin ecosystem.

Enable installed passes by name in config; write your own as a ``Pass`` subclass and
register it with a ``passkit.hookimpl`` (see README, "Writing a pass").
"""

# the public modules, which a pass author or a host adapter reads; the machinery is private
# by path: _plugins/ (the plugin set, hooks called in isolation), _pipeline/ (building a
# pipeline, running it, the checks that follow the graph), _compile/ (the backend, token
# ranges, Inductor)
#
# Imported on first use (PEP 562): ``import passkit`` and ``from passkit import Pass`` load
# only what they name, so the command line answers ``--help`` without importing torch. The
# imports below are what type checkers and readers see; :data:`_LAZY` is what runs.
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from . import compiling, dumps, teardown
    from ._compile.backend import Backend, backend, install
    from ._compile.inductor_failures import guard
    from ._pipeline.build import Pipeline, build_pipeline
    from ._pipeline.run import compile_range, last_report
    from ._plugins.checks import PluginMistake, PluginMistakeWarning
    from ._plugins.registry import PassNameClashWarning, get_plugins, register, unregister
    from .config import Config, PassEntry, load_config
    from .context import CompileContext
    from .environment import EnvironmentCheck
    from .errors import (
        CompilerError,
        ConfigError,
        ConfigWarning,
        OrderError,
        PassCodeError,
        PassDeclinedWarning,
        PassFailedError,
        PasskitError,
        PassSkippedWarning,
        PluginError,
        PluginHookError,
        VerificationError,
    )
    from .hook_failure import HookFailure
    from .hookspecs import hookimpl, hookspec
    from .pass_base import GraphPass, NoOptions, Pass, PassResult, Requirements, Stage
    from .pattern_pass import Pattern, PatternPass
    from .pipeline_plan import PipelinePlan
    from .report import PassRecord, Report
    from .rewrite_counter import may_rewrite
    from .tokens import TokenConstraint, TokenRange

_LAZY = {
    # submodules
    "compiling": ".compiling",
    "dumps": ".dumps",
    "teardown": ".teardown",
    # name -> the module defining it
    "Backend": "._compile.backend",
    "backend": "._compile.backend",
    "install": "._compile.backend",
    "guard": "._compile.inductor_failures",
    "Pipeline": "._pipeline.build",
    "build_pipeline": "._pipeline.build",
    "compile_range": "._pipeline.run",
    "last_report": "._pipeline.run",
    "PluginMistake": "._plugins.checks",
    "PluginMistakeWarning": "._plugins.checks",
    "PassNameClashWarning": "._plugins.registry",
    "get_plugins": "._plugins.registry",
    "register": "._plugins.registry",
    "unregister": "._plugins.registry",
    "Config": ".config",
    "PassEntry": ".config",
    "load_config": ".config",
    "CompileContext": ".context",
    "EnvironmentCheck": ".environment",
    "CompilerError": ".errors",
    "ConfigError": ".errors",
    "ConfigWarning": ".errors",
    "OrderError": ".errors",
    "PassCodeError": ".errors",
    "PassDeclinedWarning": ".errors",
    "PassSkippedWarning": ".errors",
    "PassFailedError": ".errors",
    "PasskitError": ".errors",
    "PluginError": ".errors",
    "PluginHookError": ".errors",
    "VerificationError": ".errors",
    "HookFailure": ".hook_failure",
    "hookimpl": ".hookspecs",
    "hookspec": ".hookspecs",
    "GraphPass": ".pass_base",
    "NoOptions": ".pass_base",
    "Pass": ".pass_base",
    "PassResult": ".pass_base",
    "Requirements": ".pass_base",
    "Stage": ".pass_base",
    "Pattern": ".pattern_pass",
    "PatternPass": ".pattern_pass",
    "PipelinePlan": ".pipeline_plan",
    "PassRecord": ".report",
    "Report": ".report",
    "may_rewrite": ".rewrite_counter",
    "TokenConstraint": ".tokens",
    "TokenRange": ".tokens",
}
"""Public name -> the module it comes from (a submodule's own name: the submodule)."""


def __getattr__(name: str) -> Any:
    """A public name, imported on first use and kept (later lookups do not come here)."""
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module = importlib.import_module(module_name, __name__)
    value = module if module_name == f".{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "Backend",
    "CompileContext",
    "CompilerError",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "EnvironmentCheck",
    "GraphPass",
    "HookFailure",
    "NoOptions",
    "OrderError",
    "Pass",
    "PassCodeError",
    "PassDeclinedWarning",
    "PassEntry",
    "PassFailedError",
    "PassNameClashWarning",
    "PassRecord",
    "PassResult",
    "PassSkippedWarning",
    "PasskitError",
    "Pattern",
    "PatternPass",
    "Pipeline",
    "PipelinePlan",
    "PluginError",
    "PluginHookError",
    "PluginMistake",
    "PluginMistakeWarning",
    "Report",
    "Requirements",
    "Stage",
    "TokenConstraint",
    "TokenRange",
    "VerificationError",
    "__version__",
    "backend",
    "build_pipeline",
    "compile_range",
    "compiling",
    "dumps",
    "get_plugins",
    "guard",
    "hookimpl",
    "hookspec",
    "install",
    "last_report",
    "load_config",
    "may_rewrite",
    "register",
    "teardown",
    "unregister",
]
