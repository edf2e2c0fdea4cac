"""Compile a function with given passes and look at what they did.

:func:`run_passes` compiles ``fn`` with ``torch.compile`` through passkit's backend, in the
eager mode (passes on the post-grad ATen graph, no code generation: fast) or through
Inductor, runs it once on the inputs, and returns a :class:`HarnessResult` holding the
outputs, the uncompiled outputs, the report, and copies of the graph before and after each
pass::

    result = run_passes(model, x, passes=["fold_double_neg"])
    result.assert_matches("fold_double_neg", 1)
    assert_op_count(result.graph_after, "aten.neg", 0)
    result.assert_close()  # vs the uncompiled call, with the output dtype's tolerances

Passes are given by registered name, as ``{"name": ..., **options}``, as ``Pass`` instances
or as ``Pass`` classes; instances and classes need no installed plugin. The pipeline is
built directly from them: config files and ``PASSKIT_*`` variables are not read, so a test
sees the same passes wherever it runs. Inductor's FX graph cache and AOTAutograd's cache are
off, and Dynamo is reset, unless ``caches=True``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.fx
import torch.utils._pytree as pytree

import passkit
from passkit.context import Mode
from passkit.graph_utils import graph_code, snapshot, unified_diff
from passkit.plugins import PluginSet, get_plugins, instantiate

from . import numerics
from .graphs import check_count

__all__ = ["HarnessResult", "PassGraphs", "PassSpec", "copy_graph_module", "resolve_passes", "run_passes"]

PassSpec = str | Mapping[str, Any] | passkit.Pass | type[passkit.Pass]
"""A pass to run: a registered name, ``{"name": ..., **options}``, an instance or a class."""

Reference = Literal["fp32"] | Callable[..., Any] | None


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """An independent copy of ``gm``'s graph (node ``meta`` shallow-copied) in a new module
    sharing ``gm``'s parameters and buffers, so later rewrites of ``gm`` do not show in it."""
    return torch.fx.GraphModule(gm, snapshot(gm.graph))


class PassGraphs(NamedTuple):
    """The graph before and after one pass (copies taken by the harness)."""

    before: torch.fx.GraphModule
    after: torch.fx.GraphModule | None
    """``None`` when the pass failed (the pipeline restored ``before``)."""

    @property
    def before_code(self) -> str:
        return graph_code(self.before)

    @property
    def after_code(self) -> str | None:
        return None if self.after is None else graph_code(self.after)

    def diff(self) -> str:
        """A unified diff of the readable code before and after the pass."""
        return unified_diff(self.before_code, self.after_code or "", "graph")


@dataclasses.dataclass
class HarnessResult:
    """What :func:`run_passes` observed. Graphs are copies: mutate them freely."""

    outputs: Any
    """What the compiled function returned."""
    eager_outputs: Any
    """What the uncompiled function returned on (copies of) the same inputs."""
    reference_outputs: Any
    """What ``reference`` computed, or ``None`` when none was asked for."""
    report: passkit.Report
    """passkit's report for the compiled graph: per pass status, matches, time, nodes."""
    graphs: dict[str, PassGraphs]
    """Per pass that ran or failed, by name: the graph before and after it."""
    graph_before: torch.fx.GraphModule
    """The graph the pipeline received (before its first pass)."""
    graph_after: torch.fx.GraphModule
    """The graph the pipeline returned. In ``"inductor"`` mode with passes in both stages,
    Inductor's own post-grad passes ran in between."""
    pipeline: passkit.Pipeline
    """The pipeline that ran (its ``uuid()`` is what Inductor's cache key sees)."""

    def assert_matches(self, name: str, n: int) -> None:
        """Assert that pass ``name`` ran and reported exactly ``n`` matches."""
        check_count(n, "assert_matches")
        if name not in self.report:
            raise AssertionError(f"pass {name!r} is not in the report (passes: {self.report.names()})")
        record = self.report[name]
        if record.status != "ran":
            why = f": {record.reason}" if record.reason else ""
            raise AssertionError(f"pass {name!r} did not run (status {record.status}{why})")
        if record.matches != n:
            raise AssertionError(
                f"pass {name!r} reported {record.matches} match(es), expected {n}\n"
                f"graph before {name!r}:\n{self.graphs[name].before_code}"
            )

    def assert_close(
        self,
        against: Literal["eager", "reference"] = "eager",
        *,
        dtype: torch.dtype | None = None,
        rtol: float | None = None,
        atol: float | None = None,
    ) -> None:
        """Assert the compiled outputs are close to the uncompiled ones (``"eager"``) or to
        the ``reference`` outputs, with tolerances of the outputs' dtype (or ``dtype``).

        Against an fp32 reference, outputs are upcast first and judged by their own dtype's
        tolerances: a bf16 output is held to bf16 accuracy, not fp32's.
        """
        if against == "eager":
            expected, actual = self.eager_outputs, self.outputs
        elif against == "reference":
            expected = self._reference("assert_close(against='reference')")
            actual = _cast_like(self.outputs, expected)
            dtype = dtype or _floating_dtype(self.outputs)
        else:
            raise ValueError(f"against must be 'eager' or 'reference', got {against!r}")
        numerics.assert_close(
            actual, expected, dtype=dtype, rtol=rtol, atol=atol, msg=f"compiled outputs vs {against}:"
        )

    def assert_no_worse_than_eager(self, factor: float = 1.25) -> None:
        """Assert the compiled outputs' error vs the reference is at most ``factor`` times
        the uncompiled outputs' error (see :func:`passkit_testing.assert_no_worse_than`)."""
        reference = self._reference("assert_no_worse_than_eager()")
        numerics.assert_no_worse_than(self.outputs, self.eager_outputs, reference, factor)

    def _reference(self, what: str) -> Any:
        if self.reference_outputs is None:
            raise ValueError(f"{what} needs a reference: call run_passes(..., reference='fp32')")
        return self.reference_outputs


# ---------------------------------------------------------------------------------------
# running


def run_passes(
    fn: Callable[..., Any],
    *inputs: Any,
    passes: Sequence[PassSpec] | PassSpec,
    mode: Mode = "eager",
    caches: bool = False,
    on_error: Literal["raise", "skip"] = "raise",
    verify: bool | Literal["numeric"] = "numeric",
    reference: Reference = None,
    dynamic: bool | None = None,
) -> HarnessResult:
    """Compile ``fn`` (a function or ``nn.Module``) with ``passes``, call it on ``inputs``.

    Args:
        passes: what to run, in order (stages and ``before``/``after`` hints apply as in a
            real pipeline): registered names, ``{"name": ..., **options}``, ``Pass``
            instances, or ``Pass`` classes (default options); one of them alone is one pass.
        mode: ``"eager"`` (no code generation; fast) or ``"inductor"``.
        caches: keep Inductor's and AOTAutograd's caches and Dynamo's state (off by default,
            so every call runs the passes).
        on_error: ``"raise"`` re-raises a failing pass's :class:`passkit.PassFailedError`;
            ``"skip"`` records it in the report and goes on, as in production.
        verify: ``"numeric"`` (the default): after each pass, lint the graph, re-propagate
            fake tensors and run the graph before and after the pass on the same random
            inputs, comparing the outputs (catches a rewrite that changes values only,
            ``add`` -> ``sub``); ``True``: the first two; ``False``: neither (the cheap
            checks passkit always runs remain).
        reference: ``"fp32"`` to also compute the outputs in float32 (a copy of the module
            and the floating inputs upcast), or a function computing reference outputs from
            the inputs; see :meth:`HarnessResult.assert_close`.
        dynamic: passed to ``torch.compile``.

    The call runs under ``torch.no_grad()`` (the inference graph) with ``fullgraph=True``.
    """
    plugins = get_plugins()
    config = passkit.Config(on_error=on_error, verify=verify)
    pipeline = _RecordingPipeline(config, plugins, resolve_passes(passes, plugins))
    if not pipeline.passes:
        raise ValueError("run_passes() needs at least one pass")
    backend = passkit.Backend(mode=mode, pipeline=pipeline)
    with torch.no_grad():
        eager_outputs = fn(*_cloned(inputs))
        reference_outputs = _reference_outputs(reference, fn, inputs)
        with _compiling(caches), _recording(pipeline):
            compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)
            outputs = compiled(*_cloned(inputs))
    # one report per compiled graph, every stage's records in it
    if len(pipeline.reports) != 1 or pipeline.graph_before is None or pipeline.graph_after is None:
        raise RuntimeError(
            f"expected one compiled graph, got {len(pipeline.reports)} report(s): the harness "
            "expects fn to compile once; with caches=True, an already compiled fn does not run "
            "the passes again"
        )
    report = pipeline.reports[-1]
    return HarnessResult(
        outputs=outputs,
        eager_outputs=eager_outputs,
        reference_outputs=reference_outputs,
        report=report,
        graphs=pipeline.graphs,
        graph_before=pipeline.graph_before,
        graph_after=pipeline.graph_after,
        pipeline=pipeline,
    )


def resolve_passes(
    specs: Sequence[PassSpec] | PassSpec, plugins: PluginSet | None = None
) -> list[passkit.Pass]:
    """Pass instances for ``specs`` (see :data:`PassSpec`); names are looked up in
    ``plugins`` (default: the installed ones), with passkit's unknown-name error. One spec
    alone (``"cleanup"``, a dict, a Pass or a Pass class) is one pass, not a sequence
    (``"cleanup"`` is not the passes ``c``, ``l``, ...)."""
    if isinstance(specs, (str, Mapping, passkit.Pass)) or (
        isinstance(specs, type) and issubclass(specs, passkit.Pass)
    ):
        specs = [specs]
    elif not isinstance(specs, Iterable):
        raise TypeError(
            f"passes: a list of passes (names, dicts with a 'name', Pass objects or classes), got {specs!r}"
        )
    out: list[passkit.Pass] = []
    for spec in specs:
        if isinstance(spec, passkit.Pass):
            out.append(spec)
        elif isinstance(spec, type) and issubclass(spec, passkit.Pass):
            out.append(spec())
        elif isinstance(spec, (str, Mapping)):
            plugins = plugins or get_plugins()
            out.extend(instantiate(passkit.Config(passes=[passkit.PassEntry.model_validate(spec)]), plugins))
        else:
            raise TypeError(f"a pass is a name, a dict with a 'name', a Pass or a Pass class; got {spec!r}")
    names = [p.name for p in out]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"pass(es) {duplicates} given more than once")
    return out


class _RecordingPipeline(passkit.Pipeline):
    """A pipeline that keeps copies of the graph it receives and returns, and (through the
    hooks of :class:`_PassRecorder`) of the graph around each pass."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.graphs: dict[str, PassGraphs] = {}
        self.graph_before: torch.fx.GraphModule | None = None
        self.graph_after: torch.fx.GraphModule | None = None
        self.recording_into = self
        """Where the graphs go: the pipeline :func:`run_passes` reads, also for the
        backend's pipeline of a token range (or of the one count of a static graph)."""

    def for_range(self, *args: Any, **kwargs: Any) -> passkit.Pipeline:
        specialized = super().for_range(*args, **kwargs)
        specialized.recording_into = self.recording_into  # type: ignore[attr-defined]
        return specialized

    def run_stage(
        self, gm: torch.fx.GraphModule, stage: passkit.Stage, mode: Mode = "inductor", **context: Any
    ) -> passkit.Report:
        into = self.recording_into
        if into.graph_before is None:
            into.graph_before = copy_graph_module(gm)
        try:
            return super().run_stage(gm, stage, mode=mode, **context)
        finally:
            into.graph_after = copy_graph_module(gm)


class _PassRecorder:
    """A passkit plugin recording the graph before and after each pass of one pipeline."""

    def __init__(self, pipeline: _RecordingPipeline):
        self.pipeline = pipeline
        self.before: torch.fx.GraphModule | None = None

    @passkit.hookimpl
    def passkit_before_pass(self, pass_: passkit.Pass, gm: torch.fx.GraphModule) -> None:
        self.before = copy_graph_module(gm)

    @passkit.hookimpl
    def passkit_after_pass(self, pass_: passkit.Pass, gm: torch.fx.GraphModule) -> None:
        self._record(pass_, copy_graph_module(gm))

    @passkit.hookimpl
    def passkit_pass_failed(self, pass_: passkit.Pass) -> None:
        self._record(pass_, None)

    def _record(self, pass_: passkit.Pass, after: torch.fx.GraphModule | None) -> None:
        assert self.before is not None, "passkit_before_pass was not called"
        self.pipeline.graphs[pass_.name] = PassGraphs(self.before, after)
        self.before = None


@contextlib.contextmanager
def _recording(pipeline: _RecordingPipeline) -> Iterator[None]:
    """Hook a :class:`_PassRecorder` into the pipeline's plugin manager for the duration.

    It is added after the pipeline was built, so it is not part of the pipeline's uuid.
    """
    recorder = _PassRecorder(pipeline)
    pipeline.plugins.pm.register(recorder)
    try:
        yield
    finally:
        pipeline.plugins.pm.unregister(recorder)


@contextlib.contextmanager
def _compiling(caches: bool) -> Iterator[None]:
    """Compile from scratch with caches off (unless ``caches``); unwrap passkit errors."""
    with contextlib.ExitStack() as stack:
        if not caches:
            torch._dynamo.reset()
            stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
            stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        try:
            yield
        except torch._dynamo.exc.BackendCompilerFailed as exc:  # Inductor's errors derive from it
            if not isinstance(exc.inner_exception, passkit.PasskitError):
                raise
            raise exc.inner_exception from exc.inner_exception.__cause__


def _cloned(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    return pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, inputs)


def _reference_outputs(reference: Reference, fn: Callable[..., Any], inputs: tuple[Any, ...]) -> Any:
    if reference is None:
        return None
    if callable(reference):
        return reference(*_cloned(inputs))
    if reference != "fp32":
        raise ValueError(f"reference must be 'fp32', a function or None, got {reference!r}")
    fp32_fn = copy.deepcopy(fn).float() if isinstance(fn, torch.nn.Module) else fn
    upcast = pytree.tree_map_only(
        torch.Tensor, lambda t: t.float() if t.is_floating_point() else t.clone(), inputs
    )
    return fp32_fn(*upcast)


def _cast_like(values: Any, like: Any) -> Any:
    """``values`` with each floating tensor cast to the dtype of its counterpart in ``like``."""
    flat, spec = pytree.tree_flatten(values)
    flat_like, spec_like = pytree.tree_flatten(like)
    if spec != spec_like:
        return values  # let assert_close report the structure mismatch
    return pytree.tree_unflatten(
        [
            v.to(r.dtype)
            if isinstance(v, torch.Tensor) and isinstance(r, torch.Tensor) and v.is_floating_point()
            else v
            for v, r in zip(flat, flat_like)
        ],
        spec,
    )


def _floating_dtype(values: Any) -> torch.dtype | None:
    """The least precise floating dtype among ``values``' tensors (what their accuracy is
    judged by), or ``None``."""
    dtypes = [
        t.dtype for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    return max(dtypes, key=lambda d: torch.finfo(d).eps, default=None)
