"""passkit: torch.compile graph passes as a plugin ecosystem.

Enable installed passes by name in config; write your own as a ``Pass`` subclass and
register it with a ``passkit.hookimpl`` (see README, "Writing a pass").
"""

# the public modules, which a pass author or a host adapter reads; the machinery is private
# by path: _plugins/ (the plugin set, hooks called in isolation), _pipeline/ (building a
# pipeline, running it, the checks that follow the graph), _compile/ (the backend, token
# ranges, Inductor)
from . import compiling, teardown
from ._compile.backend import Backend, backend, install
from ._compile.inductor_failures import guard
from ._pipeline.build import Pipeline, build_pipeline
from ._pipeline.run import compile_range, last_report
from ._plugins.checks import PluginMistake, PluginMistakeWarning
from ._plugins.registry import PassNameClashWarning, get_plugins, register, unregister
from ._version import __version__
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
