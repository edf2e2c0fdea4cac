"""The SGLang ``InductorPass`` that runs a passkit pipeline (this module imports SGLang).

SGLang's ``PostGradPassManager.add`` accepts only its own ``InductorPass`` instances; the
manager asks each pass ``is_applicable_for_shape(runtime_shape)`` and calls it on the graph,
inside SGLang's ``pass_context(runtime_shape)``; its ``uuid()`` (part of Inductor's FX graph
cache key) hashes the passes' ``uuid()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch.fx
from sglang.srt.compilation.inductor_pass import SGLangInductorPass, get_pass_context

from ..._pipeline.build import Pipeline
from ...pass_base import Stage
from .ranges import applies

_NO_CONTEXT = object()


class SGLangAdapterLike(Protocol):
    """What the pass uses of its :class:`passkit.hosts.sglang.SGLangAdapter` (a protocol:
    the adapter makes the pass, so this module imports nothing of it)."""

    pipeline: Pipeline

    def for_shape(self, runtime_shape: int | None, capture_sizes: Sequence[int] = ()) -> Pipeline: ...


def runtime_shape() -> Any:
    """SGLang's runtime shape of the compile under way (None: the general compile), or
    ``_NO_CONTEXT`` outside SGLang's ``pass_context``."""
    try:
        return get_pass_context().runtime_shape
    except AssertionError:
        return _NO_CONTEXT


class SGLangPass(SGLangInductorPass):
    """One stage of a passkit pipeline as an SGLang post-grad pass.

    ``capture_sizes``: the CUDA-graph token buckets of the backend it was added to (the
    range of its general-shape compile).
    """

    def __init__(self, adapter: SGLangAdapterLike, stage: Stage, capture_sizes: tuple[int, ...] = ()):
        super().__init__()
        self.adapter = adapter
        self.stage = stage
        self.capture_sizes = capture_sizes
        self.pass_name = f"passkit[{stage.value}]"

    def pipeline(self, shape: Any = _NO_CONTEXT) -> Pipeline:
        """The pipeline of the compile for SGLang's ``shape`` (default: the current one)."""
        if shape is _NO_CONTEXT:
            shape = runtime_shape()
        if shape is _NO_CONTEXT:
            return self.adapter.pipeline  # not inside an SGLang compile: no range known
        return self.adapter.for_shape(shape, self.capture_sizes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.begin()
        self.pipeline().custom_pass(self.stage)(graph)
        self.end_and_log()

    def is_applicable_for_shape(self, shape: int | None) -> bool:
        """Whether some pass applies to every token count of SGLang's ``shape``. When none
        does, SGLang skips this pass for the compile: its report (every pass skipped, with
        why) is recorded here."""
        pipeline = self.pipeline(shape)
        token_range = pipeline.current_range()
        if token_range is None or applies(pipeline, token_range) or Stage.PRE in pipeline.stages:
            return True  # (with a pre stage, the graph's report is open: complete it there)
        pipeline.record_not_run(f"no enabled pass applies to {token_range}")
        return False

    def uuid(self) -> str:
        return f"passkit:sglang:{self.stage.value}:{self.pipeline().uuid()}"

    def __deepcopy__(self, memo: dict[int, Any]) -> SGLangPass:
        """Inductor deep-copies its config per compile: share this pass (it holds the
        pipeline, whose reports must stay one list)."""
        return self
