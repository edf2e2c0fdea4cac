"""The SGLang adapter: one passkit pipeline serving SGLang's compiles in a process.

No SGLang import at module level: :meth:`SGLangAdapter.post_grad_pass` imports
:mod:`.inductor_pass` (which imports SGLang) when SGLang's backend asks for the pass.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ... import logs
from ..._compile import specialize
from ..._pipeline.build import Pipeline
from ...pass_base import Stage
from ...report import Report
from ...tokens import TokenRange
from .ranges import range_notes, token_range

if TYPE_CHECKING:
    from .inductor_pass import SGLangPass


class SGLangAdapter:
    """One passkit pipeline serving SGLang's compiles in this process.

    ``pipeline``: the configured passes; per compile the adapter uses
    ``pipeline.for_range(token_range)`` (cached per range), whose reports land in
    ``pipeline.reports`` (:attr:`reports`).
    """

    def __init__(self, pipeline: Pipeline, version: str):
        self.pipeline = pipeline
        self.version = version
        self._ranges: dict[tuple[TokenRange, int | str | None], Pipeline] = {}
        self._lock = threading.Lock()
        self._static = threading.local()

    @property
    def reports(self) -> list[Report]:
        """One report per graph SGLang compiled with passkit, oldest first."""
        return self.pipeline.reports

    def for_shape(self, runtime_shape: int | None, capture_sizes: Sequence[int] = ()) -> Pipeline:
        """The pipeline of a compile for SGLang's ``runtime_shape``. Inside
        :meth:`compiling_static` (a general compile of a graph with static shapes, e.g.
        Dynamo's 1-token recompile) the general compile serves that token count only."""
        static = getattr(self._static, "tokens", None) if runtime_shape is None else None
        if static is not None:
            tokens = TokenRange(static, static, static)
            key: tuple[TokenRange, int | str | None] = (tokens, "static")
        else:
            tokens = token_range(runtime_shape, capture_sizes)
            key = (tokens, runtime_shape)
        with self._lock:
            found = self._ranges.get(key)
            if found is None:
                notes = range_notes(self.pipeline, tokens, runtime_shape, static=static)
                label = specialize.static_label(static) if static is not None else None
                found = self._ranges[key] = self.pipeline.for_range(
                    tokens, label=label, note="; ".join(notes)
                )
        return found

    @staticmethod
    def static_tokens(graph: Any, example_inputs: Sequence[Any]) -> int | None:
        """The one token count a piece with static shapes serves (None: a dynamic piece, or
        one passkit cannot read): :func:`passkit._compile.specialize.static_tokens`."""
        try:
            return specialize.static_tokens(graph, list(example_inputs or ()))
        except Exception:  # never fail SGLang's compile over a label
            logs.log.debug("passkit: cannot read a static SGLang piece's token count", exc_info=True)
            return None

    @contextlib.contextmanager
    def compiling_static(self, tokens: int | None) -> Iterator[None]:
        """For the block (one piece's compile, this thread): a general compile serves
        ``tokens`` only (None: as SGLang says)."""
        previous = getattr(self._static, "tokens", None)
        self._static.tokens = tokens
        try:
            yield
        finally:
            self._static.tokens = previous

    # -- the piecewise backend ---------------------------------------------------------
    def post_grad_pass(self, stage: Stage = Stage.POST, capture_sizes: Sequence[int] = ()) -> SGLangPass:
        """The SGLang ``InductorPass`` running ``stage`` of the pipeline (imports SGLang)."""
        from .inductor_pass import SGLangPass

        return SGLangPass(self, stage, tuple(capture_sizes))

    def attach(self, backend: Any) -> None:
        """Add the pipeline to an ``SGLangBackend`` whose ``configure_post_pass`` ran: the
        post stage to its ``PostGradPassManager``, the pre stage to its Inductor config."""
        if not self.pipeline.enabled or getattr(backend, "_passkit_attached", None) is self:
            return
        sizes = _capture_sizes(backend)
        for stage in self.pipeline.host_stages():  # post-grad: SGLang runs no other stage
            stage_pass = self.post_grad_pass(stage, sizes)
            if stage is Stage.POST:
                backend.post_grad_pass_manager.add(stage_pass)
            else:
                from ..._compile.backend import ComposedPass

                existing = backend.inductor_config.get("post_grad_custom_pre_pass")
                backend.inductor_config["post_grad_custom_pre_pass"] = (
                    stage_pass if existing is None else ComposedPass(existing, stage_pass)
                )
        backend._passkit_attached = self
        logs.log.info(
            "passkit: added %s to SGLang's post-grad pass manager (capture sizes %s)",
            ", ".join(self.pipeline.names()),
            list(sizes) or "none",
        )

    def reported_compile(
        self, compile_fn: Callable[[], Any], pipeline: Pipeline, gm: Any, example_inputs: Sequence[Any]
    ) -> Any:
        """Run ``compile_fn`` (one compile of ``gm`` with ``pipeline``); when Inductor serves
        it from its cache (no pass runs), record a report restored from passkit's report
        cache, as :class:`passkit.Backend` does. When Inductor fails on the graph passes
        changed, they are named and the piece compiles again without them
        (:mod:`passkit._compile.inductor_failures`)."""
        from ..._compile import inductor_failures, report_cache
        from ..._compile.backend import _cache_hits

        before, hits = len(pipeline.reports), _cache_hits()
        compiled = inductor_failures.guarded(compile_fn, pipeline, "SGLang's piece")
        try:
            cache_key = report_cache.key(pipeline.uuid(), gm, example_inputs)
        except Exception:  # a graph passkit cannot key: no restored report, nothing else lost
            logs.log.debug("passkit: no report-cache key for an SGLang compile", exc_info=True)
            return compiled
        new = pipeline.reports[before:]
        if new:
            report_cache.save(cache_key, new)
        elif _cache_hits() > hits:
            restored = report_cache.load(cache_key)
            records = [r for old in restored for r in old.records] if restored else []
            pipeline.record_cache_hit("inductor", records)
        return compiled

    # -- --enable-torch-compile ----------------------------------------------------------
    def compiled_forward(self, forward: Callable[..., Any], num_tokens: int | None) -> Callable[..., Any]:
        """Wrap the ``torch.compile``'d ``forward`` SGLang compiles for ``num_tokens`` tokens
        (None: a dynamic compile serving every size): each call runs inside an Inductor
        config patch with passkit's pipeline for that size."""
        if not self.pipeline.enabled:
            return forward
        pipeline = self.for_shape(num_tokens)

        def run(*args: Any, **kwargs: Any) -> Any:
            from ..._compile import inductor_failures
            from ..._compile.backend import _cache_hits

            before, hits = len(pipeline.reports), _cache_hits()
            with _inductor_patch(pipeline):  # a failed compile is retried by the next call
                result = inductor_failures.guarded(
                    lambda: forward(*args, **kwargs), pipeline, "the batch size"
                )
            if len(pipeline.reports) == before and _cache_hits() > hits:
                # compiled from Inductor's cache: no pass ran (torch.compile hides the graph,
                # so passkit's report cache cannot say what they did when it was built)
                pipeline.record_cache_hit("inductor")
            return result

        run.__wrapped__ = forward  # type: ignore[attr-defined]
        run.passkit_pipeline = pipeline  # type: ignore[attr-defined]
        return run


def _capture_sizes(backend: Any) -> tuple[int, ...]:
    config = getattr(backend, "compile_config", None)
    getter = getattr(config, "get_capture_sizes", None)
    try:
        return tuple(int(s) for s in (getter() if getter else ()) or ())
    except (TypeError, ValueError):
        return ()


@contextlib.contextmanager
def _inductor_patch(pipeline: Pipeline) -> Iterator[None]:
    """Inductor's global config patched (for the block) with the pipeline, composed after
    custom passes already there."""
    import torch._inductor.config as inductor_config

    from ..._compile.backend import ComposedPass

    patches = {}
    for key, stage_pass in pipeline.inductor_patches().items():
        existing = getattr(inductor_config, key)
        patches[key] = stage_pass if existing is None else ComposedPass(existing, stage_pass)
    with inductor_config.patch(patches):
        yield
