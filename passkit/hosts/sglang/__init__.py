"""passkit inside SGLang: ``pip install passkit`` plus a passkit config is all a user does.

SGLang loads every distribution in the ``sglang.srt.plugins`` entry-point group in each of
its processes before the engine starts (``SGLANG_PLUGINS`` restricts them). passkit
declares one, :func:`plugin`: when the passkit config (``passkit.toml``, ``[tool.passkit]``,
``PASSKIT_PASSES``...) enables passes, it registers its hooks with SGLang's
``HookRegistry``; with no pass enabled it registers nothing and imports nothing of SGLang's
compile stack.

* After ``SGLangBackend.configure_post_pass`` (the piecewise CUDA-graph backend, which
  compiles through SGLang's ``PostGradPassManager``): a :class:`~passkit.hosts.sglang.inductor_pass.
  SGLangPass` is added to that manager (post-grad stage; a ``pre``-stage pass goes into the
  backend's ``post_grad_custom_pre_pass`` slot). SGLang hands each compile a runtime shape
  (``None``: the general compile, which serves the capture sizes, since SGLang pads every
  batch it runs through the compiled model to one of them); :func:`token_range` maps it
  to a passkit :class:`~passkit.TokenRange`, passes whose token constraint does not hold
  there are skipped with the reason in the report, and SGLang's ``is_applicable_for_shape``
  is answered from the constraints (:func:`applies`). passkit never splits ranges itself.
  Around ``CompilerManager.compile`` (one piece, one shape): a compile Inductor serves from
  its cache runs no pass, so its report is restored from passkit's report cache (SGLang's
  ranks share one Inductor cache folder).
* Around ``torch_compile_decoration.patch_model`` (``--enable-torch-compile``: plain
  ``torch.compile`` of the model per captured batch size, mode ``max-autotune-no-cudagraphs``,
  Inductor's global config): the compiled forward it yields runs inside an Inductor config
  patch carrying passkit's pipeline for that batch size (``tokens n``), so nothing global
  changes and the FX graph cache sees passkit's uuid.

:func:`install` is the same in Python, for the calling process (a script driving SGLang's
compile in-process, tests, or a plugin of your own); SGLang's scheduler processes get
passkit through the entry point. Reports, dumps, ``TORCH_LOGS=passkit`` and the CLI work as
everywhere: the pipeline is the one :func:`passkit.build_pipeline` makes.

The adapter is this package, its imports in one direction: :mod:`.ranges` (SGLang's shapes
as passkit token ranges, report notes) below :mod:`.inductor_pass` (the ``InductorPass``
subclass, which imports SGLang) and :mod:`.adapter` (:class:`SGLangAdapter`, which makes
those passes, importing :mod:`.inductor_pass` only then), all below this module: the entry
point, :func:`install` and the hooks SGLang calls. Importing it imports no SGLang.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ... import logs
from ..._pipeline.build import Pipeline, build_pipeline
from ...config import Config, load_config
from ...errors import PasskitError
from .. import HostError, OnUnknown, check_version
from .adapter import SGLangAdapter
from .ranges import applies, constraints, range_notes, token_range

HOST = "sglang"

PIECEWISE_TARGET = "sglang.srt.compilation.backend.SGLangBackend.configure_post_pass"
"""Hooked (after): where SGLang's piecewise backend installs its post-grad pass manager."""
COMPILE_TARGET = "sglang.srt.compilation.backend.CompilerManager.compile"
"""Hooked (around): one piece's compile; an Inductor cache hit (SGLang's ranks share one
cache folder) gets a report restored from passkit's report cache."""
TORCH_COMPILE_TARGET = "sglang.srt.compilation.torch_compile_decoration.patch_model"
"""Hooked (around): where ``--enable-torch-compile`` wraps the model in ``torch.compile``."""
CPU_TORCH_COMPILE_TARGET = "sglang.srt.model_executor.cpu_graph_runner.patch_model"
"""The same for SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``; hooked only there)."""
PARSED_ARGS_TARGET = "sglang.srt.server_args.ServerArgs.from_cli_args"
"""Hooked (after): the server's arguments as the launcher parses them (SGLang loads its
plugins first). Arguments that compile nothing (:mod:`.startup`) warn once, naming the flag.
(``ServerArgs`` is a msgspec struct: its ``__post_init__`` cannot be hooked after the fact.)"""
RESOLVED_ARGS_TARGET = "sglang.srt.server_args.ServerArgs.resolve_once"
"""Hooked (around): the arguments an ``Engine`` built in Python resolves, checked alike."""

PIECEWISE = "piecewise backend"
TORCH_COMPILE = "--enable-torch-compile"
PATH_API: dict[str, tuple[tuple[str, str], ...]] = {
    PIECEWISE: (
        ("sglang.srt.compilation.backend", "SGLangBackend.configure_post_pass"),
        ("sglang.srt.compilation.backend", "CompilerManager.compile"),
        ("sglang.srt.compilation.pass_manager", "PostGradPassManager.add"),
        ("sglang.srt.compilation.inductor_pass", "pass_context"),
        ("sglang.srt.compilation.inductor_pass", "SGLangInductorPass"),
    ),
    TORCH_COMPILE: (("sglang.srt.compilation.torch_compile_decoration", "patch_model"),),
}
"""What each of SGLang's compile paths needs of SGLang: a path whose modules do not import
(the piecewise backend on a CPU-only install: ``weak_ref_tensor is implemented only for
CUDA...``) is left alone, the other one still gets passkit."""
REQUIRED_API = (
    *PATH_API[PIECEWISE],
    *PATH_API[TORCH_COMPILE],
    ("sglang.srt.plugins.hook_registry", "HookRegistry"),
)
"""Everything the adapter uses of SGLang (checked by :func:`check_api`)."""


# ---------------------------------------------------------------------------------------
# the hooks SGLang calls

_active: SGLangAdapter | None = None
_error: PasskitError | None = None
_explicit = False
_hooks_registered = False
_registered_paths: set[str] = set()
_watching: list[str] = []


def active() -> SGLangAdapter | None:
    """The adapter SGLang's compiles in this process use (None: passkit is not installed)."""
    return _active


def _adapter_for_compile() -> SGLangAdapter | None:
    if _error is not None:  # a config that failed when the plugin loaded: fail the compile
        from ..._compile.dynamo_errors import surface  # loudly, passkit's message first (not Dynamo's)

        surface(_error, inspect.currentframe(), "not enabled in SGLang")
    return _active


def _after_configure_post_pass(result: Any, backend: Any, *args: Any, **kwargs: Any) -> None:
    adapter = _adapter_for_compile()
    if adapter is not None:
        adapter.attach(backend)


def _around_compile(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    adapter = _adapter_for_compile()
    if adapter is None or not adapter.pipeline.enabled:
        return original(*args, **kwargs)
    bound = inspect.signature(original).bind(*args, **kwargs)
    slots = bound.arguments["inductor_config"]
    manager, pre = slots.get("post_grad_custom_post_pass"), slots.get("post_grad_custom_pre_pass")
    candidates = [*getattr(manager, "passes", ()), pre, getattr(pre, "second", None)]
    ours = [p for p in candidates if getattr(p, "adapter", None) is adapter]
    if not ours:  # this backend was configured before passkit was installed
        return original(*args, **kwargs)
    shape, graph = bound.arguments.get("runtime_shape"), bound.arguments.get("graph")
    inputs = bound.arguments.get("example_inputs") or []
    static = adapter.static_tokens(graph, inputs) if shape is None else None
    with adapter.compiling_static(static):  # the pass, called inside, picks the same pipeline
        pipeline = adapter.for_shape(shape, ours[0].capture_sizes)
        return adapter.reported_compile(lambda: original(*args, **kwargs), pipeline, graph, inputs)


def _around_patch_model(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    adapter = _adapter_for_compile()
    if adapter is None or not adapter.pipeline.enabled:
        return original(*args, **kwargs)
    bound = inspect.signature(original).bind(*args, **kwargs)
    if not bound.arguments.get("enable_compile"):
        return original(*args, **kwargs)
    num_tokens = bound.arguments.get("num_tokens")
    if _dynamic_torch_compile(original):
        num_tokens = None

    @contextlib.contextmanager
    def patched() -> Iterator[Any]:
        with original(*args, **kwargs) as forward:
            yield adapter.compiled_forward(forward, num_tokens)

    return patched()


def _dynamic_torch_compile(original: Callable[..., Any]) -> bool:
    """Whether SGLang's ``patch_model`` compiles with dynamic shapes (ROCm with
    ``SGLANG_TORCH_DYNAMIC_SHAPE=1``): one compile then serves every batch size."""
    module = inspect.getmodule(inspect.unwrap(original))
    is_hip = bool(getattr(module, "_is_hip", False))
    return is_hip and os.environ.get("SGLANG_TORCH_DYNAMIC_SHAPE", "").lower() in ("1", "true", "yes")


def _register_hooks(paths: Iterable[str]) -> None:
    """Register passkit's hooks of SGLang's compile ``paths`` (those whose modules import:
    SGLang logs a traceback for a hook whose target does not) with its ``HookRegistry``,
    each once per process."""
    global _hooks_registered
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks: dict[str, list[tuple[str, Callable[..., Any], Any]]] = {
        PIECEWISE: [
            (PIECEWISE_TARGET, _after_configure_post_pass, HookType.AFTER),
            (COMPILE_TARGET, _around_compile, HookType.AROUND),
        ],
        TORCH_COMPILE: [(TORCH_COMPILE_TARGET, _around_patch_model, HookType.AROUND)],
    }
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1":
        hooks[TORCH_COMPILE].append((CPU_TORCH_COMPILE_TARGET, _around_patch_model, HookType.AROUND))
    for path in paths:
        if path in _registered_paths:
            continue
        for target, hook, kind in hooks[path]:
            HookRegistry.register(target, hook, kind)
        _registered_paths.add(path)
    _hooks_registered = bool(_registered_paths)


def check_api(version: str) -> tuple[str, ...]:
    """The compile paths of SGLang ``version`` passkit can hook (:data:`PATH_API`), each one
    only if all it uses imports and exists. Raise :class:`~passkit.hosts.HostError` naming
    what is missing or fails to import (and why) when no path is left, or SGLang's hook
    registry is missing. A path left out is logged once, naming why."""
    problems = {path: _api_problem(api) for path, api in PATH_API.items()}
    registry = _api_problem((("sglang.srt.plugins.hook_registry", "HookRegistry"),))
    paths = tuple(path for path, problem in problems.items() if problem is None)
    if registry is None and paths:
        for path, problem in problems.items():
            if problem is not None:
                logs.log.warning(
                    "passkit: SGLang's %s is not available (%s); passkit hooks %s only",
                    path,
                    problem,
                    ", ".join(paths),
                )
        return paths
    found = [p for p in (registry, *problems.values()) if p is not None]
    if any(p.startswith("fails to import") for p in found):
        raise HostError(f"passkit.hosts.sglang: SGLang {version} {'; '.join(found)}")
    from .. import HOSTS

    supported = ", ".join(f"{s}.x" for s in HOSTS[HOST].supported)
    raise HostError(
        f"passkit.hosts.sglang: SGLang {version} {'; '.join(found)}; passkit supports "
        f"SGLang {supported} (tested with 0.5.23)"
    )


def _api_problem(api: Iterable[tuple[str, str]]) -> str | None:
    """Why ``api`` (module, attribute path) is not usable, or None."""
    import importlib

    missing, broken = [], []
    for module_name, path in api:
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                missing.append(module_name)
            else:
                broken.append(f"{module_name} ({type(exc).__name__}: {exc})")
            continue
        except Exception as exc:
            broken.append(
                f"{module_name} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            )
            continue
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            missing.append(f"{module_name}.{path}")
    if broken:
        return f"fails to import {'; '.join(dict.fromkeys(broken))}"
    if missing:
        return f"lacks {', '.join(missing)}"
    return None


def install(
    config: Config | dict[str, Any] | None = None,
    *,
    pipeline: Pipeline | None = None,
    on_unknown_version: OnUnknown = "warn",
    **overrides: Any,
) -> SGLangAdapter:
    """Make SGLang's compiles in this process run a passkit pipeline; return its adapter.

    ``config``/``overrides`` as for :func:`passkit.backend` (``passes=[...]``), or a
    ``pipeline`` built elsewhere. Replaces a pipeline installed before (by the entry point
    or an earlier call). An SGLang version passkit was not tested with warns
    (``on_unknown_version="raise"``: a :class:`~passkit.hosts.HostError`); one lacking an
    API the adapter uses raises, naming it.
    """
    global _active, _error, _explicit
    version = check_version(HOST, on_unknown=on_unknown_version)
    paths = check_api(version)
    logs.register_with_torch()
    if pipeline is not None and (config is not None or overrides):
        raise TypeError("give either a pipeline or a config, not both")
    adapter = SGLangAdapter(
        pipeline if pipeline is not None else build_pipeline(config, **overrides), version
    )
    _register_hooks(paths)
    _prepare_amx()
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()  # idempotent: targets already patched are skipped
    _active, _error, _explicit = adapter, None, True
    return adapter


def uninstall() -> None:
    """Stop adding passkit to SGLang's compiles in this process (the hooks stay, idle)."""
    global _active, _error, _explicit
    _active, _error, _explicit = None, None, False


def plugin() -> None:
    """The ``sglang.srt.plugins`` entry point, run by SGLang in each of its processes.

    Does nothing unless the passkit config enables passes. A config error is logged here in
    one line (SGLang would swallow an exception) and raised at the first compile, its message
    first, so a server never starts silently without the passes it was configured with. An
    SGLang whose compile paths cannot be hooked (a version without the APIs passkit uses, or
    neither path importable) is logged in one line and passkit stays off: no hooks. A path
    that does not import (the piecewise backend on a CPU-only install) is left alone; the
    other still gets passkit.
    """
    global _active
    if _explicit:
        return  # install() in this process decides
    try:
        config = load_config()
    except PasskitError as exc:
        _fail(exc, _paths_or_none())
        return
    if not config.passes:
        return
    try:
        version = check_version(HOST)
        paths = check_api(version)
    except PasskitError as exc:
        _fail(exc, ())  # nothing passkit could hook: stay off, no hooks
        return
    try:
        logs.register_with_torch()
        _active = SGLangAdapter(build_pipeline(config), version)
    except PasskitError as exc:
        _fail(exc, paths)
        return
    _register_hooks(paths)  # SGLang's load_plugins applies them after every plugin ran
    _watch_server_args()
    _prepare_amx()
    logs.log.info(
        "passkit: SGLang plugin enabled %s (%s)", ", ".join(_active.pipeline.names()), ", ".join(paths)
    )


def _check_server_args(server_args: Any) -> None:
    """Warn once when the server's arguments compile nothing passkit could run in."""
    from ..._pipeline.declined import warn_host_idle
    from .startup import nothing_compiled_reason

    if _active is not None and (why := nothing_compiled_reason(server_args)):
        warn_host_idle(_active.pipeline.names(), why)


def _after_parsed_args(result: Any, *args: Any, **kwargs: Any) -> None:
    _check_server_args(result)


def _around_resolve(original: Callable[..., Any], server_args: Any, *args: Any, **kwargs: Any) -> Any:
    first = not getattr(server_args, "_resolution_finished", False)  # a child gets it resolved
    result = original(server_args, *args, **kwargs)
    if first:
        _check_server_args(server_args)
    return result


def _watch_server_args() -> None:
    """Register the checks of the server's arguments once per process (an SGLang without
    ``ServerArgs.from_cli_args`` / ``resolve_once`` is left alone)."""
    if _watching:
        return
    api = (
        ("sglang.srt.server_args", "ServerArgs.from_cli_args"),
        ("sglang.srt.server_args", "ServerArgs.resolve_once"),
    )
    if _api_problem(api) is not None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(PARSED_ARGS_TARGET, _after_parsed_args, HookType.AFTER)
    HookRegistry.register(RESOLVED_ARGS_TARGET, _around_resolve, HookType.AROUND)
    _watching.append(PARSED_ARGS_TARGET)


def _prepare_amx() -> None:
    """On a CPU with AMX tiles, answer SGLang's AMX check before Dynamo traces, and say what
    SGLang's all-reduce does there (:mod:`.amx`); nothing elsewhere."""
    from . import amx

    try:
        found = amx.prepare()
    except Exception:  # never fail SGLang's start over a note
        logs.log.debug("passkit: SGLang's AMX check failed", exc_info=True)
        return
    if found is not None:
        ok, what = found
        (logs.log.info if ok else logs.log.warning)("passkit: %s", what)


def _paths_or_none() -> tuple[str, ...]:
    """The compile paths passkit can hook here, or none (quietly)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return check_api(check_version(HOST))
    except PasskitError:
        return ()


def _fail(exc: PasskitError, paths: Iterable[str]) -> None:
    """Record why passkit is off (raised at the first compile on a hooked ``paths``)."""
    global _error
    _error = exc
    logs.log.error("passkit: not enabled in SGLang: %s", exc)
    paths = tuple(paths)
    if paths:
        try:
            _register_hooks(paths)
        except ImportError:  # pragma: no cover - SGLang calls this entry point, so it exists
            pass


__all__ = [
    "HOST",
    "SGLangAdapter",
    "active",
    "applies",
    "check_api",
    "constraints",
    "install",
    "plugin",
    "range_notes",
    "token_range",
    "uninstall",
]
