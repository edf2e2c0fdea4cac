"""Compile one graph per token range and pick the right one per call.

The backend receives a Dynamo graph whose token dimension is dynamic. :func:`plan`
asks every enabled pass where it applies (:meth:`Pass.token_constraint`), cuts the token
axis at every bound (:func:`passkit.tokens.plan_specializations`) and returns a
:class:`Plan`; the backend compiles each specialization (a normal Inductor or eager compile
of a copy of the graph, with the pipeline restricted to the range) and wraps them in a
:class:`Dispatcher`, which reads the token count of each call and calls the right one: a
few integer comparisons, no re-tracing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from .context import CompileContext, Mode
from .errors import ConfigError
from .tokens import RangeRule, Specialization, TokenConstraint, plan_specializations

if TYPE_CHECKING:
    from .config import TokenDim
    from .pipeline import Pipeline

CompiledFn = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class TokenDimension:
    """Where a call's token count is: ``args[arg]`` itself (a size Dynamo passes as an
    argument) when ``dim`` is None, else ``args[arg].shape[dim]``. ``how`` says how it was
    found, for reports."""

    arg: int
    dim: int | None
    how: str

    def read(self, args: Sequence[Any]) -> int:
        value = args[self.arg]
        return int(value if self.dim is None else value.shape[self.dim])


@dataclasses.dataclass
class Plan:
    """What to compile: the specializations, how calls choose, where the token count is."""

    specializations: list[Specialization]
    rules: list[RangeRule]
    token_dim: TokenDimension


def graph_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> list[Any]:
    """The graph's inputs as Dynamo traced them (fake tensors with symbolic sizes, SymInts),
    falling back to ``example_inputs`` where a placeholder records none."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [n.meta.get("example_value", n.meta.get("val")) for n in placeholders]
    if len(values) != len(example_inputs):
        return list(example_inputs)
    return [v if v is not None else e for v, e in zip(values, example_inputs)]


def static_tokens(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> int | None:
    """The token count a graph with static shapes serves, or None (a dynamic graph, or none
    found).

    Dynamo compiles a graph again with static shapes for a size it specializes (0 and 1:
    a call with 1 token after a dynamic compile gets its own "1-token recompile"); such a
    graph serves that one size only. Its token count is the leading dimension of its first
    tensor input that is not a parameter or buffer (Dynamo names those placeholders
    ``..._parameters_...``/``..._buffers_...``)."""
    inputs = graph_inputs(gm, example_inputs)
    if any(isinstance(v, torch.SymInt) for v in inputs):
        return None
    tensors = [v for v in inputs if isinstance(v, torch.Tensor)]
    if any(not isinstance(s, int) for t in tensors for s in t.shape):
        return None
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if len(names) != len(inputs):
        names = [""] * len(inputs)
    for name, value in zip(names, inputs):
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or isinstance(value, torch.nn.Parameter):
            continue
        if "_parameters_" in name or "_buffers_" in name:
            continue
        return int(value.shape[0])
    return None


def static_label(tokens: int) -> str:
    """How reports name the compile of a static graph serving ``tokens`` tokens only."""
    what = f"Dynamo's {tokens}-token recompile" if tokens <= 1 else "static shapes"
    return f"tokens = {tokens} ({what})"


def static_note(tokens: int | None) -> str:
    """The report note of a graph compiled once, with static shapes (:func:`static_tokens`)."""
    served = f"; it serves {static_label(tokens)}" if tokens is not None else ""
    return (
        f"no dynamic token dimension in the graph's inputs{served}: compiled once; token ranges "
        "(compile_ranges, passes' token constraints) are not applied"
    )


def find_token_dim(example_inputs: Sequence[Any], override: TokenDim | None = None) -> TokenDimension | None:
    """The token dimension of a Dynamo graph's inputs (see :func:`graph_inputs`).

    With ``override`` (config ``token_dim``): that dimension of that tensor input (counting
    tensor inputs only), which must be dynamic. Otherwise the first dynamic dimension of
    the tensor inputs, in order; read at run time from the size argument Dynamo passes for
    it when there is one. None when no input has a dynamic dimension.
    """
    tensors = [(i, t) for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor)]
    symbol = None
    where: tuple[int, int] | None = None
    if override is not None:
        if override.input >= len(tensors):
            raise ConfigError(
                f"token_dim.input={override.input}: the graph has {len(tensors)} tensor input(s)"
            )
        index, tensor = tensors[override.input]
        if override.dim >= tensor.dim():
            raise ConfigError(
                f"token_dim.dim={override.dim}: tensor input {override.input} has {tensor.dim()} dims"
            )
        size = tensor.shape[override.dim]
        if not isinstance(size, torch.SymInt):
            return None
        symbol, where = size.node.expr, (index, override.dim)
    else:
        for index, tensor in tensors:
            for dim, size in enumerate(tensor.shape):
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    symbol, where = size.node.expr, (index, dim)
                    break
            if where is not None:
                break
    if where is None:
        return None
    for i, value in enumerate(example_inputs):
        if isinstance(value, torch.SymInt) and value.node.expr == symbol:
            return TokenDimension(i, None, f"size argument {i} ({symbol})")
    return TokenDimension(where[0], where[1], f"input {where[0]}, dim {where[1]} ({symbol})")


def plan(
    pipeline: Pipeline, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], mode: Mode
) -> Plan | str | None:
    """The specializations to compile; else why ranges were asked for but the graph compiles
    once (a report note), or None when nothing asks for ranges."""
    ctx = CompileContext.detect(example_inputs, mode=mode)
    runnable = [p for p in pipeline.passes if p.checked_skip_reason(ctx) is None]
    constraints: dict[str, TokenConstraint | None] = {
        p.name: p.checked_token_constraint(ctx) for p in runnable
    }
    relations = pipeline.relations
    for p in runnable:  # a pass acting on another's rewrite needs one of them able to run
        if p.name in relations.depends_on and not any(d in constraints for d in relations.depends_on[p.name]):
            del constraints[p.name]
    user_ends = pipeline.config.compile_ranges or []
    if not user_ends and all(c is None for c in constraints.values()):
        return None
    token_dim = find_token_dim(graph_inputs(gm, example_inputs), pipeline.config.token_dim)
    if token_dim is None:
        return static_note(static_tokens(gm, example_inputs))
    specializations, rules = plan_specializations(constraints, user_ends, relations)
    return Plan(specializations, rules, token_dim)


class Dispatcher:
    """Calls the compiled specialization whose range holds the call's token count.

    The ranges cover every count from 1 up, in order: a call costs reading the count, one
    comparison per range until the right one, and ``count % k`` for each divisibility rule
    of that range. ``compile_one(i)`` compiles specialization ``i``: all of them now
    (``at_first_call``, the default: this runs inside the backend, at the graph's first
    call) or each at the first call its range serves. ``fallback`` (compiled at first use)
    serves counts below 1; it runs only the passes that apply to every size.
    """

    def __init__(
        self,
        plan: Plan,
        compile_one: Callable[[int], CompiledFn] | Sequence[CompiledFn],
        fallback: Callable[[], CompiledFn],
        *,
        at_first_call: bool = True,
    ):
        self._arg, self._dim = plan.token_dim.arg, plan.token_dim.dim
        self.plan = plan
        if callable(compile_one):
            self._compile_one = compile_one
            count = len(plan.specializations)
            self.compiled: list[CompiledFn | None] = (
                [compile_one(i) for i in range(count)] if at_first_call else [None] * count
            )
        else:
            self.compiled = list(compile_one)
        # per range: (last count, the index when no divisibility rule applies, else -1,
        # the divisor when exactly one applies, the indices by outcome)
        self._table: list[tuple[float, int, int, dict[Any, int]]] = []
        for rule in plan.rules:
            hi = float("inf") if rule.hi is None else rule.hi
            by_outcome = dict(rule.choice)
            if not rule.divisors:
                self._table.append((hi, by_outcome[()], 0, {}))
            elif len(rule.divisors) == 1:
                single = {outcome[0]: index for outcome, index in by_outcome.items()}
                self._table.append((hi, -1, rule.divisors[0], single))
            else:
                self._table.append((hi, -1, 0, by_outcome))
        self._divisors = {i: plan.rules[i].divisors for i in range(len(plan.rules))}
        self._make_fallback = fallback
        self._fallback: CompiledFn | None = None

    def __call__(self, *args: Any) -> Any:
        return self._pick(args)(*args)

    def _pick(self, args: Sequence[Any]) -> CompiledFn:
        tokens = args[self._arg] if self._dim is None else args[self._arg].shape[self._dim]
        if tokens >= 1:
            for i, (hi, index, divisor, by_outcome) in enumerate(self._table):
                if tokens <= hi:
                    if index < 0:
                        index = (
                            by_outcome[tokens % divisor == 0]
                            if divisor
                            else by_outcome[tuple(tokens % d == 0 for d in self._divisors[i])]
                        )
                    fn = self.compiled[index]
                    return fn if fn is not None else self._compile(index)
        if self._fallback is None:
            self._fallback = self._make_fallback()
        return self._fallback

    def _compile(self, index: int) -> CompiledFn:
        fn = self.compiled[index] = self._compile_one(index)
        return fn

    @property
    def compiled_count(self) -> int:
        """How many specializations are compiled so far."""
        return sum(fn is not None for fn in self.compiled)

    def index_for(self, tokens: int) -> int | None:
        """Which specialization serves ``tokens`` (None: the fallback)."""
        for rule in self.plan.rules:
            if rule.lo <= tokens and (rule.hi is None or tokens <= rule.hi):
                return rule.choice[tuple(tokens % d == 0 for d in rule.divisors)]
        return None


@contextlib.contextmanager
def reentered(tracing: Any) -> Iterator[None]:
    """Inside Dynamo's tracing context ``tracing`` (None: as is). Already inside it (the
    backend call itself): nothing changes."""
    import torch._guards

    if tracing is None or torch._guards.TracingContext.try_get() is tracing:
        yield
        return
    with torch._guards.tracing(tracing):
        yield


DYNAMO_GRAPH_ATTRIBUTES = (
    "_param_name_to_source",
    "_source_to_user_stacks",
    "compile_subgraph_reason",
    "_backend_id",
)
"""What Dynamo sets on the GraphModule it hands a backend, besides ``meta``. AOTAutograd
reads ``_param_name_to_source`` (with each placeholder's ``_dynamo_source``) to know which
inputs are parameters: without them a copy's parameters are not static inputs, and
Inductor's CUDA graphs copy every weight into their input buffers at each replay."""


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule with its own copy of ``gm``'s graph (nodes copied, their metadata
    shallow-copied; submodules and attributes shared): each specialization's compile may
    rewrite its graph. What Dynamo attached to ``gm`` and its placeholders
    (:data:`DYNAMO_GRAPH_ATTRIBUTES`, ``_dynamo_source``) comes along, so AOTAutograd sees a
    Dynamo graph with the same static (parameter) inputs as the original."""
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    output = graph.graph_copy(gm.graph, copies, return_output_node=True)
    value, old_output = output if isinstance(output, tuple) else (output, None)
    new_output = graph.output(value, type_expr=getattr(old_output, "type", None))
    if old_output is not None:
        new_output.meta = dict(old_output.meta)
    for old, new in copies.items():
        if old.op == "placeholder" and hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source  # type: ignore[attr-defined]
    copied = torch.fx.GraphModule(gm, graph)
    copied.meta = dict(getattr(gm, "meta", {}))
    for name in DYNAMO_GRAPH_ATTRIBUTES:
        if hasattr(gm, name):
            setattr(copied, name, getattr(gm, name))
    return copied
