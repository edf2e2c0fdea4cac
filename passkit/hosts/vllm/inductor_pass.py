"""The vLLM ``InductorPass`` that runs a passkit pipeline (imports vLLM: load it through
:func:`passkit.hosts.vllm.post_grad_pass`, never from ``passkit``'s own imports)."""

from __future__ import annotations

from typing import Any

import torch.fx
from vllm.compilation.passes.inductor_pass import InductorPass, get_pass_context

from ...config import Config
from ...pipeline import Pipeline, build_pipeline
from ...tokens import TokenRange
from . import ranges as adapter


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

    # -- what vLLM calls -------------------------------------------------------------------
    def __call__(self, graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        if not isinstance(gm, torch.fx.GraphModule):
            raise TypeError("passkit: vLLM passed a graph without an owning GraphModule")
        tokens = current_range()
        pipeline = self.for_range(tokens) if tokens is not None else self.pipeline
        notes = adapter.range_notes(pipeline, tokens) if tokens is not None else []
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
    return VllmPass(build_pipeline(Config.model_validate(config)), version=version)


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


def _pass_config() -> Any:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return None if config is None else config.compilation_config.pass_config


def _graph_ops(graph: torch.fx.Graph) -> list[str]:
    return [str(n.target) for n in graph.nodes if n.op == "call_function"]
