"""Token-range specializations compiled from one AOTAutograd trace.

Every specialization of a graph starts from the same Dynamo graph, and what Inductor does
before its post-grad passes (AOTAutograd's trace with Inductor's decompositions, the
joint-graph passes) does not depend on the token range: only the post-grad passes (where
passkit's pipeline runs), lowering and code generation do. So the backend hands the graph
to ``compile_fx`` once, with :func:`compile_from_one_trace`'s inner compiler: the
inference graph AOTAutograd produces is copied for each specialization and compiled by
Inductor's ``compile_fx_inner`` under that specialization's config patches (its pipeline,
its own FX-graph-cache entry), and a :class:`BoxedDispatcher` picks one per call inside
AOTAutograd's runtime wrappers.

Training graphs (a backward that must match its forward's specialization) and CUDA-graph
compiles are left to one ``compile_fx`` per specialization, as is a graph whose traced
inputs do not carry the token count (:class:`NotShareable`). So are the ranges of
``compile_at = "first_use"`` (the default) where AOTAutograd's cache is on
(:func:`served_by_aot_cache`): the first call compiles one range only, so one trace for
every range saves nothing there, and a warm start (a restart with the caches full) is
served from AOTAutograd's cache per range without tracing at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.fx

from .specialize import (
    Dispatcher,
    LateGuards,
    Plan,
    TokenDimension,
    copy_graph_module,
    first_index,
    graph_inputs,
    locate_symbol,
)

CompiledFn = Callable[..., Any]
CompileWith = Callable[[dict[str, Any]], CompiledFn]
"""Compiles the traced graph (a fresh copy) under the given Inductor config patches."""


class NotShareable(Exception):
    """The graph cannot be compiled this way; compile each specialization on its own."""


class BoxedDispatcher(Dispatcher):
    """A :class:`~passkit._compile.specialize.Dispatcher` with Inductor's boxed calling convention
    (one list of arguments, which the compiled graph may clear)."""

    _boxed_call = True

    def __call__(self, args: list[Any]) -> Any:  # type: ignore[override]
        return self._pick(args)(args)


def shareable(example_inputs: Sequence[Any], compile_patches: dict[str, Any]) -> bool:
    """Whether the specializations of a graph with these inputs can share one trace: an
    inference graph (no input requires grad, or grad is off) and no CUDA graphs."""
    from .inductor_options import uses_cudagraphs

    if uses_cudagraphs(compile_patches):
        return False
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs
    )
    return not needs_grad


def served_by_aot_cache(compile_patches: dict[str, Any]) -> bool:
    """Whether AOTAutograd's cache can serve a ``compile_fx`` of one specialization (it is on,
    with the FX graph cache it stores into, locally or remotely). A shared trace cannot be
    cached by it (its compiled result is a dispatcher, not one graph's code), so a warm
    start through one traces the graph again."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    aot = functorch_config.enable_autograd_cache or getattr(
        functorch_config, "enable_remote_autograd_cache", False
    )
    names = ("fx_graph_cache", "fx_graph_remote_cache")
    fx = any(compile_patches.get(n, getattr(inductor_config, n, False)) for n in names)
    return bool(aot and fx)


def token_symbol(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], where: TokenDimension) -> Any:
    """The symbol of the token count in the Dynamo graph's inputs."""
    value = graph_inputs(gm, example_inputs)[where.arg]
    size = value if where.dim is None else value.shape[where.dim]
    if not isinstance(size, torch.SymInt):
        raise NotShareable("the token count is not symbolic")
    return size.node.expr


def locate(inputs: Sequence[Any], symbol: Any, how: str) -> TokenDimension:
    """Where ``symbol`` is in the traced graph's inputs: a size argument, else a tensor dim."""
    found = locate_symbol(inputs, symbol, how)
    if found is None:
        raise NotShareable(f"the traced graph's inputs do not carry the token count {symbol}")
    return found


def compile_from_one_trace(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    patches: dict[str, Any],
    plan: Plan,
    compile_range: Callable[[int, CompileWith], CompiledFn],
    fallback: Callable[[CompileWith], CompiledFn],
    upfront: bool,
) -> tuple[CompiledFn, BoxedDispatcher]:
    """Compile ``gm`` once through AOTAutograd (config ``patches``: those common to every
    specialization) and each specialization of ``plan`` from its trace.

    ``compile_range(i, compile_with)`` compiles specialization ``i`` by calling
    ``compile_with(its patches)`` (the backend wraps it with the pipeline for the range,
    timing and reports); ``fallback(compile_with)`` likewise for token counts below 1.
    ``upfront``: every specialization now; else the one the example inputs fall in now, the
    others at their first use (see :class:`~passkit._compile.specialize.Dispatcher`).
    Returns what ``compile_fx`` returns and the dispatcher inside it. Raises
    :class:`NotShareable` (before anything is compiled) where the trace cannot be shared.
    """
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.virtualized import V

    symbol = token_symbol(gm, example_inputs, plan.token_dim)
    made: list[BoxedDispatcher] = []

    def inner(traced: torch.fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> CompiledFn:
        if made or not kwargs.get("is_inference", False):
            raise NotShareable("a training graph (forward and backward)")
        where = locate(inputs, symbol, plan.token_dim.how)
        fake_mode = V.fake_mode

        def compile_with(range_patches: dict[str, Any]) -> CompiledFn:
            with V.set_fake_mode(fake_mode), inductor_config.patch(range_patches), _own_output_strides():
                return compile_fx_inner(copy_graph_module(traced), inputs, **kwargs)

        traced_plan = Plan(plan.specializations, plan.rules, where)
        dispatcher = BoxedDispatcher(
            traced_plan,
            lambda i: compile_range(i, compile_with),
            fallback=lambda: fallback(compile_with),
            upfront=upfront,
            first=first_index(traced_plan, inputs),
            guards=LateGuards.of(inputs),
        )
        made.append(dispatcher)
        return dispatcher

    # inner returns a dispatcher over Inductor's OutputCodes, not one OutputCode
    compiled = compile_fx(
        gm,
        list(example_inputs),
        inner_compile=inner,  # type: ignore[arg-type]
        config_patches=patches or None,
    )
    return cast(CompiledFn, compiled), made[0]


@contextlib.contextmanager
def _own_output_strides() -> Iterator[None]:
    """Each inner compile reports its output strides to the tracing context, which expects
    one report: the first compile's stays (AOTAutograd reads it only to describe fake
    outputs), the others' are dropped."""
    context = torch._guards.TracingContext.try_get()
    strides = getattr(context, "output_strides", None)
    if strides is None or not strides:
        yield
        return
    first = list(strides)
    strides.clear()
    try:
        yield
    finally:
        strides[:] = first
