"""The vLLM ``InductorPass`` that runs a passkit pipeline (imports vLLM: load it through
:func:`passkit.hosts.vllm.post_grad_pass`, never from ``passkit``'s own imports).

While a :class:`VllmPass` exists in a process, vLLM's ``CompilerManager.compile`` (one graph,
one compile range) runs wrapped (:func:`wrap_compiler_manager`; vLLM has no hook for it): a
compile served from vLLM's or Inductor's cache, which calls no pass, gets its report restored
from passkit's report cache, and an Inductor failure on a graph passkit's passes changed
compiles the graph again without them (:mod:`passkit._compile.inductor_failures`). Compiles whose
pass manager holds no passkit pass go through untouched.

A warm start served from vLLM's own AOT compile cache (``VLLM_USE_AOT_COMPILE``, on by
default with torch >= 2.10, and its "mega" artifact, on with torch >= 2.12) compiles no
graph at all: vLLM loads the whole compiled model. So vLLM's ``VllmSerializableFunction``
is wrapped too (:func:`wrap_aot_artifacts`): when vLLM serializes the model it compiled,
the reports of that model's compiles are stored in passkit's report cache under a hash of
the artifact's bytes; when vLLM loads an artifact with those bytes, the reports are restored
(``cache_hit``, ``restored``, a note saying so), one per compile range, as the cold start
made them.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch.fx
from vllm.compilation.passes.inductor_pass import InductorPass, get_pass_context

from ..._pipeline.build import Pipeline, build_pipeline
from ...config import Config
from ...tokens import TokenRange
from . import ranges as adapter
from . import startup
from .startup import SLOT


class VllmPass(InductorPass):
    """A vLLM ``InductorPass`` running ``pipeline`` on every graph vLLM's pass manager hands it,
    restricted to the compile range of that graph (from vLLM's pass context).

    Attributes:
        pipeline: the passkit pipeline (every range); ``reports`` holds one report per
            compiled graph and range, oldest first.
        version: the vLLM version it was built for.
    """

    def __init__(self, pipeline: Pipeline, version: str = "") -> None:
        self.pipeline = pipeline
        self.version = version
        self._by_range: dict[TokenRange, Pipeline] = {}
        wrap_compiler_manager()
        wrap_aot_artifacts()
        wrap_vllm_config()

    # -- what vLLM calls -------------------------------------------------------------------
    def __call__(self, graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        if not isinstance(gm, torch.fx.GraphModule):
            raise TypeError("passkit: vLLM passed a graph without an owning GraphModule")
        tokens = current_range()
        pipeline = self.for_range(tokens) if tokens is not None else self.pipeline
        notes = adapter.range_notes(pipeline, tokens) if tokens is not None else []
        if tokens is None and (outside := outside_manager()) is not None:
            notes.append(outside)
            if not _warned_outside:
                _warned_outside.append(outside)
                import warnings

                from ... import logs

                logs.log.warning("passkit: %s", outside)
                warnings.warn(f"passkit: {outside}", RuntimeWarning, stacklevel=2)
        notes += adapter.host_fusion_notes(pipeline, _pass_config(), _graph_ops(graph))
        pipeline.note = "; ".join(notes) or None
        try:
            pipeline.run(gm, mode="inductor")
        finally:
            pipeline.note = None

    def is_applicable_for_range(self, compile_range: Any) -> bool:
        """Whether some enabled pass applies on all of ``compile_range``; when none does,
        vLLM compiles the range without calling the pass, and this records that range's
        report (every pass skipped, with why)."""
        tokens = adapter.token_range(compile_range.start, compile_range.end)
        pipeline = self.for_range(tokens)
        if adapter.applies(pipeline, tokens):
            return True
        if pipeline.passes:
            pipeline.note = "; ".join(adapter.range_notes(pipeline, tokens)) or None
            try:
                pipeline.record_not_run("no enabled pass applies to this vLLM compile range")
            finally:
                pipeline.note = None
        return False

    def uuid(self) -> str:
        """passkit's cache identity (passes, versions, options, plugins), with the compile
        range when vLLM compiles one; it also feeds vLLM's ``CompilationConfig.compute_hash``
        (called with no range), so vLLM's cache directory changes with passkit's config."""
        tokens = current_range()
        pipeline = self.pipeline if tokens is None else self.for_range(tokens)
        return f"passkit-vllm:{pipeline.uuid()}"

    # -- passkit side ------------------------------------------------------------------------
    @property
    def reports(self) -> list[Any]:
        return self.pipeline.reports

    def for_range(self, tokens: TokenRange) -> Pipeline:
        """The pipeline restricted to ``tokens`` (one per range; reports go to ``reports``)."""
        found = self._by_range.get(tokens)
        if found is None:
            label = adapter.range_label(tokens)
            found = self._by_range[tokens] = self.pipeline.for_range(tokens, label=label)
        return found

    def __deepcopy__(self, memo: dict[int, Any]) -> VllmPass:
        """vLLM deep-copies its Inductor config: share this pass (it holds the reports)."""
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its resolved config (vLLM sends its config to engine and worker
        processes): the receiving process rebuilds the pipeline from its own plugins."""
        return (_rebuild, (self.pipeline.config.model_dump(mode="json"), self.version))

    def __repr__(self) -> str:
        return f"<passkit VllmPass {self.pipeline.names()}>"


def _rebuild(config: dict[str, Any], version: str) -> VllmPass:
    """The pass in vLLM's engine core or a worker, from the config the server resolved; the
    process says once on stderr what it runs (its log is not set up while it unpickles)."""
    import os

    rebuilt = VllmPass(build_pipeline(Config.model_validate(config)), version=version)
    startup.announce(
        f"passkit: vLLM process {os.getpid()} runs {', '.join(rebuilt.pipeline.names())} "
        f"(the config the server resolved; uuid {rebuilt.uuid()})"
    )
    return rebuilt


def wrap_vllm_config() -> None:
    """Wrap ``VllmConfig.__post_init__`` once per process: a config holding a passkit pass
    whose compilation mode ends ``NONE`` (``--enforce-eager``, ``-O0``, breakable CUDA graphs)
    compiles nothing, and passkit warns once, naming the flag (:mod:`.startup`). A vLLM
    without that class is left alone."""
    try:
        from vllm.config import VllmConfig
    except ImportError:
        return
    original = VllmConfig.__post_init__
    if getattr(original, "passkit_wrapped", False):
        return

    @functools.wraps(original)
    def __post_init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        why = startup.nothing_compiled_reason(self)
        ours = getattr(self.compilation_config, "inductor_compile_config", {}).get(SLOT)
        if why and isinstance(ours, VllmPass):
            from ..._pipeline.declined import warn_host_idle

            warn_host_idle(ours.pipeline.names(), why)

    __post_init__.passkit_wrapped = True  # type: ignore[attr-defined]
    VllmConfig.__post_init__ = __post_init__  # type: ignore[method-assign]


def current_range() -> TokenRange | None:
    """The token range of the compile vLLM is running, None outside one (vLLM hashes its
    config, and so this pass's uuid, outside any compile)."""
    try:
        context = get_pass_context()
    except AssertionError:  # vLLM asserts that a context is set
        return None
    compile_range = getattr(context, "compile_range", None)
    if compile_range is None:
        return None
    return adapter.token_range(compile_range.start, compile_range.end)


_warned_outside: list[str] = []
"""The reason :func:`outside_manager` gave, once it was warned about in this process."""


def outside_manager() -> str | None:
    """Why vLLM runs this pass outside its own pass manager (no compile range, no vLLM
    pass ran before it, no restored report on a cache hit), or None when it does not.

    vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``) replaces ``CompilationMode.VLLM_COMPILE``
    with ``DYNAMO_TRACE_ONCE`` in ``CpuPlatform.check_and_update_config``: Dynamo traces the
    model once and plain Inductor compiles it, calling the pass from
    ``inductor_compile_config["post_grad_custom_post_pass"]`` directly."""
    from vllm.config import get_current_vllm_config_or_none

    # a worker's lazy compile runs outside vLLM's config context: no config, no pass context
    # either, which vLLM's own manager always sets (the caller saw no compile range)
    config = get_current_vllm_config_or_none()
    mode = None if config is None else getattr(config.compilation_config, "mode", None)
    mode_name = getattr(mode, "name", str(mode))
    if mode_name == "VLLM_COMPILE":
        return None
    try:
        from vllm.platforms import current_platform

        platform = type(current_platform).__name__
        cpu = bool(current_platform.is_cpu())
    except Exception:  # pragma: no cover - a vLLM without a platform API
        platform, cpu = "?", False
    if cpu:
        why = (
            "vLLM's CPU platform (VLLM_TARGET_DEVICE=cpu) sets CompilationMode.DYNAMO_TRACE_ONCE, "
            "so plain Inductor compiles the model"
        )
    elif mode is None:
        why = f"vLLM on {platform} called this pass outside its pass manager (no compile range)"
    else:
        why = f"vLLM compiles in CompilationMode.{mode_name} on {platform}, with plain Inductor"
    return (
        f"{why}: passkit runs outside vLLM's pass manager, on one graph for every token count "
        "(no vLLM compile range: passes' token constraints are decided for every size; no vLLM "
        "pass ran before passkit)"
    )


def _pass_config() -> Any:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return None if config is None else config.compilation_config.pass_config


def _graph_ops(graph: torch.fx.Graph) -> list[str]:
    return [str(n.target) for n in graph.nodes if n.op == "call_function"]


def wrap_compiler_manager() -> None:
    """Wrap vLLM's ``CompilerManager.compile`` once per process (see the module docstring)."""
    from vllm.compilation import backends

    manager = backends.CompilerManager
    if getattr(manager.compile, "passkit_wrapped", False):
        return
    manager.compile = _reported(manager.compile)  # type: ignore[method-assign]


def _reported(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compile(
        self: Any,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        additional_inductor_config: dict[str, Any],
        compilation_config: Any,
        compile_range: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        def call() -> Any:
            return original(
                self,
                graph,
                example_inputs,
                additional_inductor_config,
                compilation_config,
                compile_range,
                *args,
                **kwargs,
            )

        manager = additional_inductor_config.get("post_grad_custom_post_pass")
        ours = [p for p in getattr(manager, "passes", ()) if isinstance(p, VllmPass)]
        if not ours or compile_range is None:
            return call()
        pipeline = ours[0].for_range(adapter.token_range(compile_range.start, compile_range.end))
        before = len(pipeline.reports)
        compiled = _compile_reported(
            call, pipeline, graph, example_inputs, f"vLLM's graph for range {compile_range}"
        )
        made = _made_by_manager.setdefault(self, [])
        made.extend(((compile_range.start, compile_range.end), r) for r in pipeline.reports[before:])
        return compiled

    compile.passkit_wrapped = True  # type: ignore[attr-defined]
    return compile


_first_code: weakref.WeakKeyDictionary[torch.fx.GraphModule, str] = weakref.WeakKeyDictionary()
"""The code of each graph vLLM compiles, as passkit first saw it."""


def _compile_reported(
    call: Callable[[], Any],
    pipeline: Pipeline,
    graph: torch.fx.GraphModule,
    example_inputs: list[Any],
    what: str,
) -> Any:
    """One vLLM compile with ``pipeline``: Inductor failures guarded; a compile that made no
    report (served from a cache: no pass ran) gets one restored from passkit's report cache."""
    from ... import logs
    from ..._compile import inductor_failures, report_cache

    try:  # vLLM changes a graph as it compiles it (one graph, every range): key by its first code
        code = _first_code.setdefault(graph, graph.code)
        key: str | None = report_cache.key(pipeline.uuid(), graph, example_inputs, code=code)
    except Exception:  # a graph passkit cannot key: no restored report, nothing else lost
        logs.log.debug("passkit: no report-cache key for a vLLM compile", exc_info=True)
        key = None
    before = len(pipeline.reports)
    compiled = inductor_failures.guarded(call, pipeline, what)
    if key is None:
        return compiled
    new = pipeline.reports[before:]
    if new:
        report_cache.save(key, new)
    else:
        restored = report_cache.load(key)
        records = [r for old in restored for r in old.records] if restored else []
        pipeline.record_cache_hit("inductor", records)
    return compiled


_made_by_manager: weakref.WeakKeyDictionary[Any, list[tuple[tuple[int, int], Any]]] = (
    weakref.WeakKeyDictionary()
)
"""The reports of each vLLM ``CompilerManager``'s compiles, with their compile range."""

AOT_NOTE = "restored from vLLM's compile cache: vLLM loaded this compiled range, no pass ran"


def wrap_aot_artifacts() -> None:
    """Wrap vLLM's ``VllmSerializableFunction`` (de)serialization once per process (see the
    module docstring). A vLLM without it (no AOT compile) is left alone."""
    try:
        from vllm.compilation.caching import VllmSerializableFunction
    except ImportError:
        return
    cls = VllmSerializableFunction
    if getattr(cls.serialize_compile_artifacts, "passkit_wrapped", False):
        return
    serialize = cls.serialize_compile_artifacts.__func__
    deserialize = cls.deserialize_compile_artifacts.__func__

    def serialize_compile_artifacts(owner: Any, compiled_fn: Any) -> bytes:
        data = serialize(owner, compiled_fn)
        try:
            manager = getattr(getattr(compiled_fn, "vllm_backend", None), "compiler_manager", None)
            made = _made_by_manager.get(manager, []) if manager is not None else []
            if made:
                _save_aot_reports(data, made)
        except Exception:  # losing the restored report never fails vLLM's save
            from ... import logs

            logs.log.debug("passkit: could not store reports with vLLM's artifact", exc_info=True)
        return data

    def deserialize_compile_artifacts(owner: Any, data: bytes) -> Any:
        fn = deserialize(owner, data)
        if getattr(fn, "_fake_mode", None) is None and getattr(fn, "vllm_backend", None) is None:
            # vLLM's mega artifact: no graph is compiled (else the compiles to come run
            # through CompilerManager.compile, which restores their reports itself)
            try:
                _restore_aot_reports(data)
            except Exception:
                from ... import logs

                logs.log.debug("passkit: could not restore reports for vLLM's artifact", exc_info=True)
        return fn

    serialize_compile_artifacts.passkit_wrapped = True  # type: ignore[attr-defined]
    cls.serialize_compile_artifacts = classmethod(serialize_compile_artifacts)  # type: ignore[assignment]
    cls.deserialize_compile_artifacts = classmethod(deserialize_compile_artifacts)  # type: ignore[assignment]


def _aot_path(data: bytes) -> Any:
    import hashlib

    from ..._compile import report_cache

    return report_cache.cache_dir() / f"vllm-aot-{hashlib.sha256(data).hexdigest()[:32]}.json"


def _save_aot_reports(data: bytes, made: list[tuple[tuple[int, int], Any]]) -> None:
    import json
    import os

    path = _aot_path(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps([{"range": list(r), "report": report.to_dict()} for r, report in made]))
    tmp.replace(path)


def _restore_aot_reports(data: bytes) -> None:
    """Record, on this process's :class:`VllmPass`, the reports stored with the artifact
    ``data`` (nothing when none were stored or no passkit pass is configured)."""
    import json

    from vllm.config import get_current_vllm_config_or_none

    from ... import logs
    from ...report import Report

    config = get_current_vllm_config_or_none()
    slot = None if config is None else config.compilation_config.inductor_compile_config
    ours = (slot or {}).get("post_grad_custom_post_pass")
    if not isinstance(ours, VllmPass):
        ours = next((p for p in getattr(ours, "passes", ()) if isinstance(p, VllmPass)), None)
    if ours is None:
        return
    path = _aot_path(data)
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logs.log.debug("passkit: no reports stored with vLLM's artifact (%s): %s", path, exc)
        stored = None
    if not stored:
        ours.pipeline.note = AOT_NOTE + "; passkit stored no report with it"
        try:
            ours.pipeline.record_cache_hit("inductor")
        finally:
            ours.pipeline.note = None
        return
    for entry in stored:
        start, end = entry["range"]
        old = Report.from_dict(entry["report"])
        pipeline = ours.for_range(adapter.token_range(start, end))
        pipeline.note = "; ".join([AOT_NOTE, *old.notes])
        try:
            pipeline.record_cache_hit("inductor", list(old.records))
        finally:
            pipeline.note = None
