"""The pass ``vllm serve`` names on its command line: passkit's pipeline from passkit's config.

::

    PASSKIT_PASSES=allreduce_rmsnorm vllm serve MODEL --tensor-parallel-size 2 \\
      --compilation-config '{"inductor_passes": {"post_grad_custom_post_pass": "passkit_vllm.post_grad_pass"}}'

vLLM's ``CompilationConfig.__post_init__`` resolves each string of ``inductor_passes`` as
``__import__(module).__dict__[name]`` (so only an attribute of a top-level module) and puts
an ``InductorPass`` instance it finds into ``inductor_compile_config`` as it is (a plain
function would be wrapped in ``CallableInductorPass``, whose uuid hashes its source, not
passkit's config). The top-level module ``passkit_vllm``, shipped in the ``passkit``
distribution, is that module: importing it calls :func:`pass_or_exit`, whose
:class:`~passkit.hosts.vllm.inductor_pass.VllmPass` is its attribute ``post_grad_pass``.

The config comes from passkit's sources (``passkit.toml``, ``[tool.passkit]``,
``PASSKIT_*``) read once, when vLLM resolves the name (in the process that parses the
command line); the pass reaches vLLM's engine core and workers pickled as its resolved
config, as from Python. Its uuid is the pipeline's, so another config is another cache key.

A config that fails, or enables no pass, stops vLLM there with one line naming the field
(:func:`pass_or_exit`): a server never comes up without the passes it was started for.
This module imports vLLM only through :func:`passkit.hosts.vllm.post_grad_pass`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...config import Config, load_config
from ...errors import ConfigError, PasskitError
from . import startup
from .startup import SLOT

if TYPE_CHECKING:
    from .inductor_pass import VllmPass

MODULE = "passkit_vllm"
"""The top-level module vLLM imports (``__import__`` of the qualified name's module)."""
ATTRIBUTE = "post_grad_pass"
QUALNAME = f"{MODULE}.{ATTRIBUTE}"
"""What ``--compilation-config``'s ``inductor_passes`` names."""
COMPILATION_CONFIG: dict[str, Any] = {"inductor_passes": {SLOT: QUALNAME}}
"""vLLM's compilation config (as JSON for ``--compilation-config``: :func:`cli_argument`)."""

NO_PASS = (
    "passes: no pass is enabled (set PASSKIT_PASSES=name,... or passes in passkit.toml or "
    "[tool.passkit]); vLLM would run without the passes it was started for"
)


def cli_argument() -> str:
    """``--compilation-config`` and its JSON value, quoted for a POSIX shell."""
    return f"--compilation-config '{json.dumps(COMPILATION_CONFIG)}'"


def configured_pass(make: Callable[[Config], VllmPass] | None = None) -> VllmPass:
    """The vLLM pass of passkit's config sources (``make``: how it is built from the
    resolved config, :func:`passkit.hosts.vllm.post_grad_pass` by default).

    Raises :class:`~passkit.errors.ConfigError` when the config enables no pass, and every
    error of the config, its plugins or the installed vLLM (a :class:`~passkit.PasskitError`)."""
    config = load_config()
    if not config.passes:
        raise ConfigError(NO_PASS)
    if make is None:
        from . import post_grad_pass

        make = post_grad_pass
    return make(config)


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (a pydantic error lists its fields on lines of their own)."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def exit_message(exc: BaseException) -> str:
    return f"passkit: {QUALNAME} cannot be built, so vLLM does not start: {one_line(exc)}"


def pass_or_exit(make: Callable[[Config], VllmPass] | None = None) -> VllmPass:
    """:func:`configured_pass`, or :class:`SystemExit` with :func:`exit_message` (one line
    on stderr, no traceback: neither pydantic, which runs vLLM's ``__post_init__``, nor
    argparse nor asyncio wraps or catches it). On success one line on stderr says what the
    server will run and where the config came from (:func:`.startup.announce`: vLLM's
    logging is not set up yet when it parses its command line)."""
    try:
        custom_pass = configured_pass(make)
    except PasskitError as exc:
        raise SystemExit(exit_message(exc)) from None
    config = custom_pass.pipeline.config
    startup.announce(
        f"passkit: {QUALNAME} runs {', '.join(custom_pass.pipeline.names())} "
        f"(config: {config.passes_from or 'defaults'}; uuid {custom_pass.uuid()})"
    )
    return custom_pass


__all__ = [
    "ATTRIBUTE",
    "COMPILATION_CONFIG",
    "MODULE",
    "QUALNAME",
    "SLOT",
    "cli_argument",
    "configured_pass",
    "exit_message",
    "one_line",
    "pass_or_exit",
]
