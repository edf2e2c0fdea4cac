"""passkit: torch.compile graph passes as a plugin ecosystem.

Enable installed passes by name in config; write your own as a ``Pass`` subclass and
register it with a ``passkit.hookimpl`` (see README, "Writing a pass").
"""

from . import compiling, teardown
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
from .inductor_failures import guard
from .integration import Backend, backend, install
from .pass_base import GraphPass, NoOptions, Pass, PassResult, Requirements, Stage
from .pattern_pass import Pattern, PatternPass
from .pipeline import Pipeline, PipelinePlan, build_pipeline, compile_range, last_report
from .plugin_checks import PluginMistake, PluginMistakeWarning
from .plugins import PassNameClashWarning, get_plugins, register, unregister
from .report import PassRecord, Report
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
    "register",
    "teardown",
    "unregister",
]
