"""torch.compile integration: the ``passkit`` backend, ``install`` and the eager mode.

Three ways in:

* ``torch.compile(m, backend="passkit")`` — the named backend (entry point
  ``torch_dynamo_backends``); config from files and the environment.
* ``torch.compile(m, backend=passkit.backend(passes=[...]))`` — Python config.
* ``passkit.install(inductor_config, ...)`` — for a framework with its own backend: adds
  the pipeline to its Inductor config dict, composing with passes already there.

Inductor's global config is never changed: the pipeline goes in through ``compile_fx``'s
``config_patches`` for the duration of each compile.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any, cast

import torch
import torch.fx

from .. import compiling, logs, teardown
from .._pipeline.build import Pipeline, build_pipeline
from ..config import COMPILERS, Config, resolve_compiler
from ..context import Mode, graph_kind_scope
from ..errors import CompilerError, ConfigError, PassFailedError, PasskitError, describe
from ..pass_base import STAGE_ORDER, Stage
from ..report import NOT_RESTORED, Report
from ..tokens import TokenRange
from . import inductor_failures, inductor_options, report_cache, shared_trace, specialize
from .inductor_options import ComposedPass

ANY_SIZE = TokenRange(0, None)
"""The range of the fallback compile: only passes that apply to every size run in it."""

CompiledFn = Callable[..., Any]


class Backend:
    """A ``torch.compile`` backend running a passkit pipeline.

    Args:
        config: a :class:`passkit.Config`, a dict, or ``None``; keyword arguments override
            fields (``passes=[...]``, ``on_error="raise"``...). Environment and config files
            fill what Python leaves unset.
        mode: ``"inductor"`` (default) runs the passes as post-grad custom passes and lets
            Inductor generate code; ``"eager"`` runs them on the post-grad ATen graph and
            executes the result as is, with no code generation (``compiler="aot_eager"``).
        compiler: what compiles the graphs after the passes: ``"inductor"`` (default),
            ``"aot_eager"`` (run the ATen graphs as they are: ``mode="eager"``) or any
            AOTAutograd compiler callable ``(gm, example_inputs) -> callable``, called on
            each forward, backward and inference graph after the post-grad stages ran on it.
            With any compiler, the ``pre_grad`` stage runs on Dynamo's graph before
            AOTAutograd and the ``joint`` stage on the joint graph before partitioning.
        inductor_config: extra Inductor config patches for each compile.
        pipeline: a :class:`Pipeline` built elsewhere (e.g. from pass instances, as
            ``passkit_testing`` does), used instead of one built from ``config``.
    """

    def __init__(
        self,
        config: Config | dict[str, Any] | None = None,
        *,
        mode: Mode = "inductor",
        compiler: str | Callable[..., Any] | None = None,
        inductor_config: dict[str, Any] | None = None,
        pipeline: Pipeline | None = None,
        **overrides: Any,
    ):
        if mode not in ("inductor", "eager"):
            raise ValueError(f"mode must be 'inductor' or 'eager', got {mode!r}")
        if pipeline is not None and (config is not None or overrides):
            raise TypeError("give either a pipeline or a config, not both")
        built: Pipeline = pipeline if pipeline is not None else build_pipeline(config, **overrides)
        compiler_key: str | None = None
        if compiler is None and mode == "inductor":  # Python said nothing: the config says
            compiler = resolve_compiler(built.config.compiler, built.config.source_of("compiler"))
            compiler_key = built.config.compiler
        if compiler is None:
            compiler = "aot_eager"
        elif isinstance(compiler, str):
            if compiler not in COMPILERS:
                raise ValueError(
                    f"compiler must be one of {list(COMPILERS)} or an AOTAutograd compiler callable "
                    f"(gm, example_inputs) -> callable, got {compiler!r}"
                )
            if mode == "eager" and compiler == "inductor":
                raise ValueError(
                    "mode='eager' runs no Inductor: give compiler='aot_eager' or mode='inductor'"
                )
        elif not callable(compiler):
            raise ValueError(
                "compiler must be 'inductor', 'aot_eager' or a callable (gm, example_inputs) -> "
                f"callable, got {type(compiler).__name__}"
            )
        if compiler != "inductor":
            mode = "eager"
            if inductor_config:
                raise ValueError(
                    f"inductor_config configures Inductor, which compiler={_compiler_name(compiler)!r} "
                    "does not run"
                )
        logs.register_with_torch()
        if mode == "inductor":
            # Inductor imported now, as torch.compile(backend="inductor") imports it inside
            # torch.compile: imported inside Dynamo's compile of the first call instead, the
            # same import made a warm start about 0.4 s slower on the CPU
            import torch._inductor.compile_fx  # noqa: F401
        self.mode: Mode = mode
        self.compiler: str | Callable[..., Any] = compiler
        self.compiler_name = compiler_key or _compiler_name(compiler)
        """``"inductor"``, ``"aot_eager"``, the config's ``"package.module:name"`` or the custom
        compiler's name (passes' context, and errors)."""
        self.__name__ = f"passkit(compiler={self.compiler_name})"
        """What Dynamo calls this backend in its errors (not ``<Backend object at 0x...>``)."""
        if pipeline is None and not built.enabled:  # say so, and where passkit looked
            from . import nothing_enabled

            nothing_enabled.warn(built.config, self.compiler_name)
        self.pipeline: Pipeline = built
        self.pipeline.driven, self.pipeline.host = STAGE_ORDER, "passkit's backend"
        self.inductor_config = dict(inductor_config or {})
        self._cudagraphs = False
        self.last_dispatcher: specialize.Dispatcher | None = None
        """The dispatcher of the last graph compiled with token-range specializations."""

    @property
    def reports(self) -> list[Report]:
        """One report per graph compiled through this backend, oldest first."""
        return self.pipeline.reports

    @property
    def last_report(self) -> Report | None:
        return self.pipeline.reports[-1] if self.pipeline.reports else None

    def __call__(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        mode: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> CompiledFn:
        """Compile one Dynamo graph. ``mode`` and ``options`` are torch.compile's
        (``torch.compile(m, backend=passkit.backend(...), mode="reduce-overhead")``): each
        token-range specialization gets them as ``backend="inductor"`` would. While it
        compiles, :func:`passkit.compiling.current` names the graph and the passes."""
        with compiling.scope(gm, example_inputs, self.pipeline) as current:
            return self._call(gm, example_inputs, mode, options, current)

    def _call(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        mode: str | None,
        options: dict[str, Any] | None,
        current: compiling.Compiling,
    ) -> CompiledFn:
        try:
            patches = self._compile_patches(mode, options)
        except ConfigError as exc:  # passkit's own error out of torch.compile, not Dynamo's wrapper
            from .dynamo_errors import surface

            surface(exc, inspect.currentframe(), "torch.compile's mode/options")
        if self.mode == "inductor":  # as backend="inductor" does: Triton's compile workers
            from torch._inductor.async_compile import maybe_warm_pool  # start while we plan

            maybe_warm_pool()
        if not self.pipeline.enabled:
            return self._compile(self.pipeline, gm, example_inputs, patches)
        planned = specialize.plan(self.pipeline, gm, example_inputs, self.mode)
        if isinstance(planned, specialize.StaticPlan):  # static shapes: one token count
            static = self.pipeline.for_range(
                planned.token_range, label=planned.label, note=planned.note, left_out=planned.left_out
            )
            return self._compile(static, gm, example_inputs, patches)
        if planned is None or isinstance(planned, str):
            self.pipeline.note = planned
            try:
                return self._compile(self.pipeline, gm, example_inputs, patches)
            finally:
                self.pipeline.note = None
        specs = planned.specializations
        if len(specs) == 1 and not self.pipeline.config.compile_ranges:
            # every token count runs the same passes: one compile, as Inductor would make
            only = self.pipeline.for_range(ANY_SIZE, left_out=dict(specs[0].left_out))
            only.range_label = None
            return self._compile(only, gm, example_inputs, patches)
        # the range of this call compiles now; with compile_at="first_use" each other range
        # compiles at the first call it serves, after Dynamo returned: it re-enters the tracing
        # context of this graph (its fake mode and shape environment keep the token dimension
        # symbolic, as for the range compiled now) and the passkit compile scope, and the
        # guards it makes are checked per call (specialize.LateGuards)
        tracing = torch._guards.TracingContext.try_get()
        if self.mode == "inductor" and self._share_trace(patches):
            shared = self._compile_shared(planned, gm, example_inputs, patches, tracing, current)
            if shared is not None:
                return shared
        source = gm
        symbolic = specialize.graph_inputs(gm, example_inputs)
        guards = specialize.LateGuards.of(symbolic)

        def inputs() -> Sequence[Any]:  # a late compile traces the call's tensors
            return example_inputs if guards is None else guards.example_inputs(example_inputs)

        def compile_spec(i: int) -> CompiledFn:
            pipeline = self._range_pipeline(planned, i)
            with specialize.reentered(tracing), compiling.reentered(current):
                return self._compile(pipeline, specialize.copy_graph_module(source), inputs(), patches)

        spare = specialize.copy_graph_module(gm)
        self.last_dispatcher = specialize.Dispatcher(
            planned,
            compile_spec,
            fallback=lambda: self._compile_in(
                tracing, current, self.pipeline.for_range(ANY_SIZE), spare, inputs(), patches
            ),
            upfront=self.pipeline.config.compile_at == "upfront",
            first=specialize.first_index(planned, symbolic),
            guards=guards,
        )
        return self.last_dispatcher

    def _range_pipeline(self, planned: specialize.Plan, i: int) -> Pipeline:
        """The pipeline of specialization ``i`` of ``planned``."""
        spec, count = planned.specializations[i], len(planned.specializations)
        return self.pipeline.for_range(
            spec.context_range,
            label=spec.label,
            note=f"specialization {i + 1} of {count}; token count from {planned.token_dim.how}",
            left_out={name: f"{why}; this compile serves {spec.label}" for name, why in spec.left_out},
        )

    def _share_trace(self, patches: dict[str, Any]) -> bool:
        """Whether the specializations compile from one AOTAutograd trace
        (:mod:`passkit._compile.shared_trace`): with every range compiled at the first call, or
        without AOTAutograd's cache; a range compiled at its first use with that cache on
        gets its own ``compile_fx``, which the cache serves on a warm start."""
        if any(s in self.pipeline.stages for s in (Stage.PRE_GRAD, Stage.JOINT)):
            return False  # each range runs its own pre-grad/joint passes on its own trace
        if self.pipeline.config.compile_at == "upfront":
            return True
        common = inductor_options.merge_patches(patches, self.inductor_config, {})
        return not shared_trace.served_by_aot_cache(common)

    def _compile_shared(
        self,
        planned: specialize.Plan,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        patches: dict[str, Any],
        tracing: Any,
        current: compiling.Compiling,
    ) -> CompiledFn | None:
        """The specializations compiled from one AOTAutograd trace of ``gm`` (see
        :mod:`passkit._compile.shared_trace`), or None where they cannot share it."""
        common = inductor_options.merge_patches(patches, self.inductor_config, {})
        if not shared_trace.shareable(example_inputs, common):
            return None

        def compile_range(i: int, compile_with: shared_trace.CompileWith) -> CompiledFn:
            with specialize.reentered(tracing), compiling.reentered(current):
                return self._compile(
                    self._range_pipeline(planned, i), gm, example_inputs, patches, compile_with
                )

        def fallback(compile_with: shared_trace.CompileWith) -> CompiledFn:
            with specialize.reentered(tracing), compiling.reentered(current):
                return self._compile(
                    self.pipeline.for_range(ANY_SIZE), gm, example_inputs, patches, compile_with
                )

        try:
            compiled, self.last_dispatcher = shared_trace.compile_from_one_trace(
                specialize.copy_graph_module(gm),
                example_inputs,
                common,
                planned,
                compile_range,
                fallback,
                upfront=self.pipeline.config.compile_at == "upfront",
            )
        except Exception as exc:
            if not _caused_by(exc, shared_trace.NotShareable):
                raise
            logs.log.debug("passkit: specializations compiled apart: %s", exc)
            return None
        return compiled

    def _compile_in(self, tracing: Any, current: compiling.Compiling, *args: Any) -> CompiledFn:
        with specialize.reentered(tracing), compiling.reentered(current):
            return self._compile(*args)

    def _compile_patches(self, mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
        """torch.compile's mode/options as Inductor config patches (checked)."""
        if mode is None and not options:
            return {}
        if self.mode == "eager":
            raise ConfigError(
                f"torch.compile(mode={mode!r}, options={options!r}) configures Inductor's code "
                f"generation, which passkit.backend(compiler={self.compiler_name!r}) does not run: "
                "drop them or use compiler='inductor'"
            )
        patches = inductor_options.compile_patches(mode, options)
        self._cudagraphs |= inductor_options.uses_cudagraphs(patches)
        return patches

    def reset(self) -> None:
        """Called by ``torch._dynamo.reset()``: drop Inductor's CUDA-graph trees when a
        compile used them, as ``backend="inductor"`` does."""
        if self._cudagraphs:
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()

    def _compile(
        self,
        pipeline: Pipeline,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        compile_patches: dict[str, Any] | None = None,
        compile_with: shared_trace.CompileWith | None = None,
    ) -> CompiledFn:
        """One normal compile of ``gm`` with ``pipeline``, timed into its report; a cache
        hit's report is filled from passkit's report cache. ``compile_with``: Inductor's
        inner compile of an AOTAutograd trace shared by the specializations (see
        :meth:`_compile_shared`), called with this compile's config patches. When Inductor
        fails on a graph passes changed, they are named and the graph compiles again without
        them (:mod:`passkit._compile.inductor_failures`)."""
        hits_before = _cache_hits()
        start = time.perf_counter()
        patches: dict[str, Any] = {}
        pre_grad = Stage.PRE_GRAD in pipeline.stages
        attempts: list[Report] = []  # the report of each attempt: the last one compiled

        def collecting() -> contextlib.AbstractContextManager[Report | None]:
            """One report for every stage of this compile (a fresh one per attempt)."""
            return pipeline.collecting(self.mode) if pipeline.enabled else contextlib.nullcontext()

        def run_pre_grad(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
            """The pre-grad stage on Dynamo's graph, before AOTAutograd (any compiler)."""
            pipeline.run_stage(
                graph, Stage.PRE_GRAD, self.mode, example_inputs=example_inputs, compiler=self.compiler_name
            )
            return graph

        if self.mode == "eager":
            with collecting() as report:
                attempts.append(report)
                compiled = self._compile_eager(pipeline, run_pre_grad(gm) if pre_grad else gm, example_inputs)
        else:
            from torch._inductor.compile_fx import compile_fx

            patches = inductor_options.merge_patches(
                compile_patches or {}, self.inductor_config, pipeline.inductor_patches(joint=True)
            )
            if inductor_options.uses_cudagraphs(patches):
                # graphs that capture a collective must go before the process group does
                teardown.guard_process_groups()

            def inductor() -> CompiledFn:
                with collecting() as report:
                    attempts.append(report)
                    if compile_with is not None:
                        return compile_with(patches)
                    # each attempt rewrites its own copy: when Inductor fails on a graph a pre-grad
                    # pass changed, the retry compiles Dynamo's graph without that pass
                    graph = run_pre_grad(specialize.copy_graph_module(gm)) if pre_grad else gm
                    return cast(
                        CompiledFn,
                        compile_fx(
                            graph,
                            list(example_inputs),
                            inner_compile=_kind_recording_inner_compile,
                            config_patches=patches or None,
                        ),
                    )

            compiled = inductor_failures.guarded(inductor, pipeline) if pipeline.enabled else inductor()
        seconds = time.perf_counter() - start
        report = attempts[-1]
        if report is None:  # no pass enabled
            return compiled
        in_inductor = [s.value for s in pipeline.stages if s is not Stage.PRE_GRAD]
        # bisect_limit: a cache identity of its own per process, never a hit: nothing to restore or keep
        if (
            self.mode == "inductor"
            and in_inductor
            and report_cache.in_use(patches)
            and pipeline.config.bisect_limit is None
        ):
            self._with_cached_records(pipeline, report, gm, example_inputs, patches, hits_before, in_inductor)
        pipeline.publish_compile(report, seconds)
        return compiled

    def _with_cached_records(
        self,
        pipeline: Pipeline,
        report: Report,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        patches: dict[str, Any],
        hits_before: int,
        in_inductor: list[str],
    ) -> None:
        """Store the records of a compile whose stages ran in Inductor in passkit's report
        cache, or, when Inductor served its graphs from its cache (their passes did not run
        now), add what those passes did when they built the cached code. The pre-grad stage
        runs on every compile, cached or not: its records are this compile's own."""
        # the graph's inputs as Dynamo traced them (token dimension symbolic): the key of a
        # range is the range (in the uuid), never the token count of the call that compiled it
        key_inputs = specialize.graph_inputs(gm, example_inputs)
        cache_key = report_cache.key(pipeline.uuid(), gm, key_inputs, patches)
        if _cache_hits() == hits_before:
            report_cache.save(cache_key, [report], pipeline.names())
            return
        report.cache_hit = True
        # with a joint stage, the joint graph may have run while its halves came from the cache
        ran = {(r.stage, r.graph_kind) for r in report.records}
        restored = report_cache.load(cache_key, pipeline.names())
        if restored is None:
            ran_stages = {stage for stage, _ in ran}
            if not all(stage in ran_stages for stage in in_inductor):
                logs.log.warning(
                    "passkit: Inductor served a graph from its cache, but passkit's report cache has no "
                    "report of it (%s): what the passes did to it is not known (a report cache cleared or "
                    "kept elsewhere than Inductor's: PASSKIT_CACHE_DIR)",
                    report_cache.cache_dir() / f"{cache_key}.json",
                )
                report.notes.append(NOT_RESTORED)
            return
        missing = [r for old in restored for r in old.records if (r.stage, r.graph_kind) not in ran]
        report.records.extend(missing)
        report.restored = bool(missing)
        if missing and ran:
            fresh = sorted({stage for stage, _ in ran}, key=[s.value for s in STAGE_ORDER].index)
            report.notes.append(
                f"the {', '.join(fresh)} stage(s) ran in this compile; the other records are what the "
                "passes did when they built the cached code (passkit's report cache)"
            )

    def _compile_eager(
        self, pipeline: Pipeline, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
    ) -> CompiledFn:
        """AOTAutograd with passkit's stages around ``self.compiler``: the joint stage in the
        partitioner (or on an inference graph), the post-grad stages on each forward,
        backward and inference graph, then the compiler (``aot_eager``: run as is)."""
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop
        from torch._functorch.partitioners import default_partition
        from torch._inductor.compile_fx import select_decomp_table

        final: Callable[..., Any] = boxed_nop if isinstance(self.compiler, str) else self.compiler
        name, mode = self.compiler_name, self.mode

        def compiler_for(kind: str) -> Callable[..., CompiledFn]:
            def compile_graph(fx_g: torch.fx.GraphModule, inputs: Sequence[Any]) -> CompiledFn:
                if pipeline.enabled:
                    with graph_kind_scope(kind):
                        if kind == "inference" and Stage.JOINT in pipeline.stages:
                            pipeline.run_stage(fx_g, Stage.JOINT, mode, graph_kind=kind, compiler=name)
                        pipeline.run(fx_g, mode=mode, graph_kind=kind, compiler=name)
                if final is boxed_nop:
                    return cast(CompiledFn, final(fx_g, list(inputs)))
                return _call_compiler(final, name, kind, fx_g, inputs)

            compile_graph.__name__ = f"passkit_{kind}_compiler"
            return compile_graph

        def partition_fn(joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
            if not (pipeline.enabled and Stage.JOINT in pipeline.stages):
                return default_partition(joint, joint_inputs, **kwargs)
            from ..graph_utils import restore, snapshot

            before = snapshot(joint.graph)
            report = pipeline.run_stage(joint, Stage.JOINT, mode, graph_kind="joint", compiler=name)
            changed = [r for r in report.records if r.stage == Stage.JOINT.value and r.modified]
            if not changed:
                return default_partition(joint, joint_inputs, **kwargs)
            try:
                return default_partition(joint, joint_inputs, **kwargs)
            except Exception as exc:
                # as Inductor's compile does (passkit._compile.inductor_failures): name the passes that
                # changed the joint graph, and partition it again as it was before them
                why = (
                    f"AOTAutograd's partitioner failed on the joint graph it changed: {describe(exc)[:600]}; "
                    f"compiled without it (compiler {name!r})"
                )
                for record in changed:
                    record.status, record.reason, record.modified = "failed", why, False
                    logs.log.warning("passkit: pass %s failed: %s", record.name, why)
                    if pipeline.config.on_error == "raise":
                        raise PassFailedError(
                            f"pass {record.name!r} failed: {why}", pass_name=record.name, ran_before=[]
                        ) from exc
                restore(joint.graph, before)
                joint.recompile()
                return default_partition(joint, joint_inputs, **kwargs)

        return aot_autograd(
            fw_compiler=compiler_for("forward"),
            bw_compiler=compiler_for("backward"),
            inference_compiler=compiler_for("inference"),
            partition_fn=partition_fn,
            decompositions=select_decomp_table(),
            keep_inference_input_mutations=True,
        )(gm, list(example_inputs))


def _call_compiler(
    compiler: Callable[..., Any], name: str, kind: str, gm: torch.fx.GraphModule, inputs: Sequence[Any]
) -> CompiledFn:
    """A custom compiler's compile of one graph: what it raises, or a result that is not a
    callable (``None``: a ``'NoneType' object is not callable`` at the first call otherwise),
    is a :class:`CompilerError` naming it by its config key."""
    try:
        compiled = compiler(gm, list(inputs))
    except Exception as exc:
        raise CompilerError(f"compiler {name!r} raised compiling the {kind} graph: {describe(exc)}") from exc
    if not callable(compiled):
        raise CompilerError(
            f"compiler {name!r} returned {type(compiled).__name__} for the {kind} "
            "graph, not a callable: an AOTAutograd compiler returns the function that runs the graph "
            "(gm.forward, for one that only inspects it)"
        )
    return cast(CompiledFn, compiled)


def _compiler_name(compiler: Any) -> str:
    if isinstance(compiler, str):
        return compiler
    return str(getattr(compiler, "__name__", None) or type(compiler).__name__)


def _kind_recording_inner_compile(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
    """Inductor's ``compile_fx_inner``, told which graph it compiles: its forward compiler
    passes ``is_inference``, its backward compiler ``is_backward``; the post-grad passes
    it runs read it as their context's ``graph_kind``."""
    from torch._inductor.compile_fx import compile_fx_inner

    if kwargs.get("is_backward"):
        kind = "backward"
    elif kwargs.get("is_inference"):
        kind = "inference"
    else:
        kind = "forward"
    with graph_kind_scope(kind):
        return compile_fx_inner(gm, example_inputs, **kwargs)


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    """Whether ``exc`` or an exception it was raised from or during is a ``kind``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _cache_hits() -> int:
    """Inductor FX-graph-cache plus AOTAutograd-cache hits so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"])


def backend(config: Config | dict[str, Any] | None = None, **options: Any) -> Backend:
    """A ``torch.compile`` backend with the given config; see :class:`Backend`."""
    return Backend(config, **options)


_default_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _default_backend() -> Backend:
    return Backend()


def passkit_backend(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **compile_options: Any
) -> CompiledFn:
    """The named backend ``"passkit"``: config from ``passkit.toml``/pyproject/environment,
    resolved once per process at the first compile. ``compile_options``: torch.compile's
    ``mode`` / ``options``."""
    with _default_lock:
        try:
            b = _default_backend()
        except PasskitError as exc:  # a bad config: name it, not 40 lines of Dynamo
            from .dynamo_errors import surface

            surface(exc, inspect.currentframe(), "backend 'passkit' cannot start")
    try:
        return b(gm, example_inputs, **compile_options)
    except PasskitError as exc:  # e.g. torch.compile's mode/options, a pass with on_error="raise"
        from .dynamo_errors import surface

        surface(exc, inspect.currentframe(), "backend 'passkit'")


def _reset_default_backend() -> None:
    if _default_backend.cache_info().currsize:
        _default_backend().reset()


passkit_backend.reset = _reset_default_backend  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------
# install into a framework's own Inductor config


def install(
    inductor_config: MutableMapping[str, Any],
    config: Config | dict[str, Any] | None = None,
    *,
    token_range: TokenRange | tuple[int, int | None] | None = None,
    **overrides: Any,
) -> Pipeline:
    """Add passkit's pipeline to an Inductor config dict (e.g. a framework's
    ``compilation_config.inductor_compile_config``) and return the pipeline.

    A custom pass already in a slot is kept and runs before passkit's. With no enabled
    pass, nothing is installed. A framework that compiles per size or range tells passkit
    which token counts a compile serves, with ``token_range=(lo, hi)`` (fixed for this
    config) or per compile with ``with passkit.compile_range(lo, hi):``; passes whose token
    constraint does not hold there skip, and the cache identity includes the range.
    """
    logs.register_with_torch()
    pipeline = build_pipeline(config, **overrides)
    if token_range is not None:
        if not isinstance(token_range, TokenRange):
            from .._pipeline.run import compile_range

            with compile_range(*token_range) as checked:
                token_range = checked
        pipeline = pipeline.for_range(token_range)
    for key, stage_pass in pipeline.inductor_patches().items():
        existing = inductor_config.get(key)
        inductor_config[key] = stage_pass if existing is None else ComposedPass(existing, stage_pass)
    return pipeline


__all__ = ["Backend", "ComposedPass", "Stage", "backend", "install", "passkit_backend"]
