"""Compile one graph per token range and pick the right one per call.

The backend receives a Dynamo graph whose token dimension is dynamic. :func:`plan`
asks every enabled pass where it applies (:meth:`Pass.token_constraint`), cuts the token
axis at every bound (:func:`passkit.tokens.plan_specializations`) and returns a
:class:`Plan`; the backend compiles each specialization (a normal Inductor or eager compile
of a copy of the graph, with the pipeline restricted to the range) and wraps them in a
:class:`Dispatcher`, which reads the token count of each call and calls the right one: a
few integer comparisons, no re-tracing. A graph with static shapes serves one token count
(:func:`static_token_dim`): :func:`plan` returns a :class:`StaticPlan`, one compile for that
count, without the passes whose token constraint does not admit it.

With ``compile_at = "first_use"`` (the default) the backend compiles the range of the call
being compiled only; the dispatcher compiles each other range at the first call that lands in
it, after Dynamo returned. :class:`LateGuards` makes such a late compile sound: the call's
sizes as the shape environment's hints, the guards the compile makes checked per call, the
shape environment's knowledge of the sizes restored afterwards.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from .. import logs
from ..context import CompileContext, Mode
from ..errors import ConfigError, PasskitError
from ..tokens import RangeRule, Specialization, TokenConstraint, TokenRange, plan_specializations, plan_static

if TYPE_CHECKING:
    from .._pipeline.build import Pipeline
    from ..config import TokenDim

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


def static_token_dim(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], override: TokenDim | None = None
) -> tuple[int | None, str]:
    """The token count a graph with static shapes serves, with where it was read (for
    reports), or ``(None, why)``: the graph has symbolic sizes, or its inputs do not say
    its token count.

    Dynamo compiles a graph with static shapes for ``torch.compile(dynamic=False)``, for a
    first call before it sees a size change, and again for a size it specializes (0 and 1: a
    call with 1 token after a dynamic compile gets its own "1-token recompile"); such a graph
    serves that one size only. With ``override`` (config ``token_dim``) the count is that
    dimension of that tensor input (counting tensor inputs only). Otherwise it is read from
    the first tensor input that is not a parameter or buffer (Dynamo names those placeholders
    ``..._parameters_...``/``..._buffers_...``), where its shape says where the tokens are:
    ``(tokens,)``, ``(tokens, hidden)`` (not integer), or token ids (integer) with one
    dimension above 1: ``(1, tokens)`` (one sequence, as Hugging Face models take
    ``input_ids``), ``(tokens, 1)`` (one token of each of ``tokens`` sequences). Other shapes
    (``(batch, seq, hidden)``, ``(batch, seq)`` ids) are not read: which count a pass's
    constraint means there is not known."""
    inputs = graph_inputs(gm, example_inputs)
    activations = _static_activations(gm, inputs)
    if activations is None:
        return None, "the graph has symbolic sizes, none of them a token dimension passkit can read"
    if override is not None:
        tensors = [(i, v) for i, v in enumerate(inputs) if isinstance(v, torch.Tensor)]
        index, tensor = _override_input(tensors, override)
        return int(tensor.shape[override.dim]), f"input {index}, dim {override.dim} (config token_dim)"
    if not activations:
        return None, "no tensor input besides parameters and buffers"
    index, value = activations[0]
    dtype = value.dtype
    ids = not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
    if value.dim() == 1 or (value.dim() == 2 and not ids):
        return int(value.shape[0]), f"input {index}, dim 0"
    if ids and sum(size > 1 for size in value.shape) <= 1:
        dim = next((d for d, size in enumerate(value.shape) if size > 1), 0)
        return int(value.shape[dim]), f"input {index}, dim {dim} (token ids)"
    return None, (
        f"input {index}, the first that is not a parameter, has shape {tuple(value.shape)}: which "
        "of its dimensions counts the tokens is not known (config token_dim names it)"
    )


def static_tokens(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> int | None:
    """The token count a graph with static shapes serves, or None (a dynamic graph, or none
    found), for the SGLang host's labels and ranges: the leading dimension of the first
    tensor input that is not a parameter or buffer. (:func:`static_token_dim` reads the
    count passkit's backend applies the passes' constraints to, more strictly.)"""
    activations = _static_activations(gm, graph_inputs(gm, example_inputs))
    return int(activations[0][1].shape[0]) if activations else None


def _static_activations(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> list[tuple[int, Any]] | None:
    """The tensor inputs of a graph with static shapes that are not parameters or buffers
    (Dynamo names those placeholders ``..._parameters_...``/``..._buffers_...``) and have a
    dimension, with their indices; None when the graph has a symbolic size."""
    if any(isinstance(v, torch.SymInt) for v in inputs):
        return None
    if any(not isinstance(s, int) for v in inputs if isinstance(v, torch.Tensor) for s in v.shape):
        return None
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if len(names) != len(inputs):
        names = [""] * len(inputs)
    return [
        (index, value)
        for index, (name, value) in enumerate(zip(names, inputs))
        if isinstance(value, torch.Tensor)
        and value.dim() > 0
        and not isinstance(value, torch.nn.Parameter)
        and "_parameters_" not in name
        and "_buffers_" not in name
    ]


def static_label(tokens: int) -> str:
    """How reports name the compile of a static graph serving ``tokens`` tokens only."""
    what = f"Dynamo's {tokens}-token recompile" if tokens <= 1 else "static shapes"
    return f"tokens = {tokens} ({what})"


def static_note(tokens: int | None, how: str | None = None) -> str:
    """The report note of a graph compiled once, with static shapes (:func:`static_token_dim`):
    serving ``tokens``, read from ``how``; or, with ``tokens`` None, no count found (``how``:
    why)."""
    if tokens is None:
        why = f": {how}" if how else ""
        return (
            f"no dynamic token dimension in the graph's inputs and no static token count{why}; "
            "compiled once, every pass runs: token ranges (compile_ranges, passes' token "
            "constraints) are not applied"
        )
    where = f" (token count from {how})" if how else ""
    return (
        f"no dynamic token dimension in the graph's inputs; it serves {static_label(tokens)}{where}: "
        f"compiled once, for that count: a pass whose token constraint does not admit {tokens} "
        "is skipped (compile_ranges do not apply)"
    )


@dataclasses.dataclass(frozen=True)
class StaticPlan:
    """What to compile for a graph with static shapes: one compile serving ``tokens`` only
    (read from ``how``), without the passes of ``left_out`` (name: why;
    :func:`passkit.tokens.plan_static`)."""

    tokens: int
    how: str
    left_out: dict[str, str]

    @property
    def token_range(self) -> TokenRange:
        """``tokens n, multiples of n`` (as a framework's single-size compile): a pass
        constrained to multiples of ``k`` applies when ``k`` divides ``n``."""
        return TokenRange(self.tokens, self.tokens, max(self.tokens, 1))

    @property
    def label(self) -> str:
        return static_label(self.tokens)

    @property
    def note(self) -> str:
        return static_note(self.tokens, self.how)


def _override_input(tensors: Sequence[tuple[int, Any]], override: TokenDim) -> tuple[int, Any]:
    """The tensor input config ``token_dim`` names (its index among all inputs, the tensor),
    checked: :class:`ConfigError` when the graph has no such input or dimension."""
    if override.input >= len(tensors):
        raise ConfigError(f"token_dim.input={override.input}: the graph has {len(tensors)} tensor input(s)")
    index, tensor = tensors[override.input]
    if override.dim >= tensor.dim():
        raise ConfigError(
            f"token_dim.dim={override.dim}: tensor input {override.input} has {tensor.dim()} dims"
        )
    return index, tensor


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
        index, tensor = _override_input(tensors, override)
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
) -> Plan | StaticPlan | str | None:
    """The specializations to compile; for a graph with static shapes, the one compile for
    its token count (:class:`StaticPlan`: the passes whose constraint does not admit it left
    out); else why ranges were asked for but the graph compiles once with every pass (a
    report note: no token count found), or None when nothing asks for ranges."""
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
        tokens, how = static_token_dim(gm, example_inputs, pipeline.config.token_dim)
        if tokens is None:
            return static_note(None, how)
        return StaticPlan(tokens, how, plan_static(constraints, tokens, relations))
    specializations, rules = plan_specializations(constraints, user_ends, relations)
    return Plan(specializations, rules, token_dim)


class Dispatcher:
    """Calls the compiled specialization whose range holds the call's token count.

    The ranges cover every count from 1 up, in order: a call costs reading the count, one
    comparison per range until the right one, and ``count % k`` for each divisibility rule
    of that range. ``compile_one(i)`` compiles specialization ``i``. ``upfront``: all of
    them now (this runs inside the backend, at the graph's first call); else ``first`` (the
    range of the backend's example inputs, None: none) now and each other one at the first
    call its range serves. ``fallback`` (compiled at first use) serves counts below 1; it
    runs only the passes that apply to every size.

    A compile at first use runs after Dynamo built the graph's guards: a guard it would add
    (Inductor deciding on a size) cannot join them. ``guards`` (see :class:`LateGuards`)
    records such guards; a compile that made any serves only the calls where they hold, and a
    call where they do not compiles again (as Dynamo would recompile).
    """

    def __init__(
        self,
        plan: Plan,
        compile_one: Callable[[int], CompiledFn] | Sequence[CompiledFn],
        fallback: Callable[[], CompiledFn],
        *,
        upfront: bool = True,
        first: int | None = None,
        guards: LateGuards | None = None,
    ):
        self._context = contextvars.copy_context()
        """The context of the backend call (Inductor's, AOTAutograd's and Dynamo's config:
        torch keeps a patch or assignment per thread, in context variables): every late
        compile runs in a copy of it, so a range that compiles at its first use in another
        thread compiles as the ranges compiled here do, not with that thread's config."""
        self._arg, self._dim = plan.token_dim.arg, plan.token_dim.dim
        self.plan = plan
        self._guards = guards
        self._guarded: dict[int, list[tuple[Callable[[Sequence[Any]], bool], CompiledFn]]] = {}
        self.late_compiles = 0
        """How many compiles ran at a call (after the backend returned)."""
        if callable(compile_one):
            self._compile_one = compile_one
            count = len(plan.specializations)
            self.compiled: list[CompiledFn | None] = [None] * count
            for i in range(count) if upfront else ([] if first is None else [first]):
                self.compiled[i] = compile_one(i)
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
        self._compiling = threading.RLock()
        """Held by a late compile: threads whose calls fall in a range not compiled yet wait
        for the one compiling it, and use its compile (a range compiles once)."""

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
                    return fn if fn is not None else self._late(index, args)
        if self._fallback is not None:
            return self._fallback
        return self._late(-1, args)

    def _late(self, index: int, args: Sequence[Any]) -> CompiledFn:
        """Specialization ``index`` (-1: the fallback) for a call that finds it not compiled
        (or compiled under guards this call may not meet): compiled now, unless a compile
        whose guards hold for ``args`` is there. One thread compiles; the others wait for it."""
        with self._compiling:
            done = self._fallback if index < 0 else self.compiled[index]
            if done is not None:  # another thread compiled it while this one waited
                return done
            return self._late_locked(index, args)

    def _late_locked(self, index: int, args: Sequence[Any]) -> CompiledFn:
        entries = self._guarded.setdefault(index, [])
        for check, fn in entries:
            if check(args):
                return fn
        make = self._make_fallback if index < 0 else (lambda: self._compile_one(index))

        def compile_now() -> CompiledFn:
            return self._context.copy().run(make)

        self.late_compiles += 1
        holds: _Holds | None
        if self._guards is None:
            fn, holds = compile_now(), None
        else:
            fn, holds = self._guards.compile(compile_now, args)
        if holds is None:
            if index < 0:
                self._fallback = fn
            else:
                self.compiled[index] = fn
            return fn
        if not holds(args):
            what = "token counts below 1" if index < 0 else self.plan.specializations[index].label
            raise LateGuardError(
                f"the compile of {what} at its first use (compile_at='first_use') assumed "
                f"{holds} about the sizes, which the call that compiled it does not meet: set "
                "compile_at = 'upfront' (PASSKIT_COMPILE_AT=upfront) to compile every range "
                "inside Dynamo's compile, where such an assumption becomes a guard"
            )
        entries.append((holds, fn))
        return fn

    @property
    def compiled_count(self) -> int:
        """How many specializations are compiled so far."""
        return sum(fn is not None or bool(self._guarded.get(i)) for i, fn in enumerate(self.compiled))

    def index_for(self, tokens: int) -> int | None:
        """Which specialization serves ``tokens`` (None: the fallback)."""
        for rule in self.plan.rules:
            if rule.lo <= tokens and (rule.hi is None or tokens <= rule.hi):
                return rule.choice[tuple(tokens % d == 0 for d in rule.divisors)]
        return None


class LateGuardError(PasskitError):
    """A range compiled at its first use assumed something about the sizes (a guard Dynamo
    could no longer add) that the call it was compiled for does not meet."""


def example_count(where: TokenDimension, inputs: Sequence[Any]) -> int | None:
    """The token count of the call being compiled, from the graph's (fake, symbolic) inputs,
    without adding a guard; None when it cannot be read."""
    value = inputs[where.arg]
    size = value if where.dim is None else value.shape[where.dim]
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return None if hint is None else int(hint)
    return int(size) if isinstance(size, int) else None


def first_index(plan: Plan, inputs: Sequence[Any]) -> int | None:
    """The specialization serving the token count of ``inputs`` (the backend's example
    inputs), None for the fallback or when the count cannot be read."""
    count = example_count(plan.token_dim, inputs)
    if count is None or count < 1:
        return None
    for rule in plan.rules:
        if rule.lo <= count and (rule.hi is None or count <= rule.hi):
            return rule.choice[tuple(count % d == 0 for d in rule.divisors)]
    return None


class _Holds:
    """Whether a call meets the guards a late compile made (memoized per size)."""

    def __init__(self, guards: list[tuple[Any, Any]], where: dict[Any, TokenDimension]):
        self.guards, self.where = guards, where
        self.seen: dict[tuple[int, ...], bool] = {}

    def __call__(self, args: Sequence[Any]) -> bool:
        values = tuple(w.read(args) for w in self.where.values())
        known = self.seen.get(values)
        if known is None:
            import sympy

            bound = {s: sympy.Integer(v) for s, v in zip(self.where, values)}
            known = self.seen[values] = all(
                bool(sympy.simplify(expr.xreplace(bound) - value) == 0)
                if not isinstance(value, sympy.logic.boolalg.BooleanAtom)
                else bool(expr.xreplace(bound)) == bool(value)
                for expr, value in self.guards
            )
        return known

    def __str__(self) -> str:
        return " and ".join(f"{expr} == {value}" for expr, value in self.guards)


_SHAPE_ENV_STATE = (
    "var_to_range",
    "var_to_range_sloc",
    "replacements",
    "replacements_slocs",
    "divisible",
    "guards",
    "axioms",
    "deferred_runtime_asserts",
    "num_deferred_runtime_asserts",
    "_resimplify_floor_div_axioms",
)
"""The shape environment's knowledge of the sizes, kept across a late compile."""


class LateGuards:
    """The guards a compile after Dynamo's (a specialization compiled at its first use)
    makes on the graph's shape environment.

    Dynamo freezes the shape environment once it has turned its guards into code: a guard
    made later (Inductor deciding ``s0 < 4096`` while it lowers) is dropped, and the code
    compiled under it would serve every size. :meth:`compile` records them and returns the
    compiled function with ``holds(args)``, whether a call meets them (None when there are
    none, the usual case: Inductor's lowering decides on size hints without guarding). Each
    symbol a guard names is read from the call's arguments where ``inputs`` (the compiled
    graph's symbolic inputs) carry it; a guard on a symbol they do not carry makes the
    compiled function unusable (:class:`LateGuardError`).
    """

    def __init__(self, shape_env: Any, inputs: Sequence[Any], context: Any = None):
        self.shape_env = shape_env
        self.inputs = list(inputs)
        self.context = context
        """The tracing context of the graph's compile (its ``tensor_to_context``)."""
        self.call_args: Sequence[Any] | None = None
        """While a late compile runs: the arguments of the call it compiles for."""
        self.symbols: dict[Any, TokenDimension] = {}
        """Each plain symbol of the inputs' sizes and where a call carries it."""
        for value in self.inputs:
            sizes: list[Any] = [value] if isinstance(value, torch.SymInt) else []
            if isinstance(value, torch.Tensor):
                sizes = [s for s in value.shape if isinstance(s, torch.SymInt)]
            for size in sizes:
                expr = size.node.expr
                if expr.is_Symbol and expr not in self.symbols:
                    found = locate_symbol(self.inputs, expr)
                    if found is not None:
                        self.symbols[expr] = found

    @classmethod
    def of(cls, inputs: Sequence[Any]) -> LateGuards | None:
        """For the compile under way (its tracing context's shape environment)."""
        import torch._guards

        context = torch._guards.TracingContext.try_get()
        fake_mode = getattr(context, "fake_mode", None)
        shape_env = getattr(fake_mode, "shape_env", None)
        return None if shape_env is None else cls(shape_env, inputs, context)

    def example_inputs(self, first: Sequence[Any]) -> Sequence[Any]:
        """The example inputs a compile should trace: ``first`` (the backend's, the first
        call's tensors) inside Dynamo's compile; during a late compile, the tensors of the
        call it compiles for, each under the symbolic sizes Dynamo gave the first call's
        (AOTAutograd fakes a real tensor again at each compile, its size hints read from
        the tensor: the first call's tensors would trace with the first call's sizes)."""
        args = self.call_args
        if args is None or len(args) != len(first):
            return first
        known = getattr(self.context, "tensor_to_context", None)
        out = []
        for example, arg in zip(first, args):
            if (
                not isinstance(example, torch.Tensor)
                or not isinstance(arg, torch.Tensor)
                or _is_fake(example)
            ):
                out.append(example)
                continue
            if arg is not example and known is not None and example in known:
                known[arg] = known[example]
            out.append(arg)
        return out

    @contextlib.contextmanager
    def _hints_of(self, args: Sequence[Any]) -> Iterator[None]:
        """The shape environment's size hints, and those of the inputs' sizes, are the call's
        sizes (Inductor decides on hints, the FX-graph cache checks its entries' guards on
        them; the graph was traced with the first call's)."""
        import sympy

        hints = getattr(self.shape_env, "backed_var_to_val", None)
        if hints is None:
            hints = self.shape_env.var_to_val
        saved = {s: hints[s] for s in self.symbols if s in hints}
        for symbol in saved:
            hints[symbol] = sympy.Integer(self.symbols[symbol].read(args))
        nodes: list[tuple[Any, Any]] = []
        for value in self.inputs:
            sizes: list[Any] = [value] if isinstance(value, torch.SymInt) else []
            if isinstance(value, torch.Tensor):
                sizes = [*value.shape, *value.stride(), value.storage_offset()]
            for size in sizes:
                if isinstance(size, torch.SymInt):
                    node = size.node
                    new = node.expr.xreplace(hints)
                    if new.is_number:
                        nodes.append((node, node._hint))
                        node._hint = int(new)
        try:
            yield
        finally:
            hints.update(saved)
            for node, hint in reversed(nodes):
                node._hint = hint

    @contextlib.contextmanager
    def _state_kept(self) -> Iterator[None]:
        """What a late compile learns about the sizes (a guard narrows a symbol's range, adds
        a replacement) does not stay in the graph's shape environment: it holds for the
        calls that compile serves only (:class:`_Holds`), not for the next compile."""
        env = self.shape_env
        kept = {name: _copied(getattr(env, name)) for name in _SHAPE_ENV_STATE if hasattr(env, name)}
        _forget_evaluations(env)
        try:
            yield
        finally:
            for name, value in kept.items():
                setattr(env, name, value)
            _forget_evaluations(env)

    def compile(
        self, compile_fn: Callable[[], CompiledFn], args: Sequence[Any]
    ) -> tuple[CompiledFn, _Holds | None]:
        """``compile_fn()`` for the call with ``args``, and whether a call meets the guards it
        made (None: it made none)."""
        env = self.shape_env
        made: list[tuple[Any, Any]] = []
        original = env._check_frozen

        def check_frozen(expr: Any, concrete_val: Any) -> None:
            made.append((expr, concrete_val))
            original(expr, concrete_val)

        before = len(env.guards)
        env._check_frozen = check_frozen
        self.call_args = args
        try:
            with self._state_kept(), self._hints_of(args):
                fn = compile_fn()
                late = list(env.guards[before:])
        finally:
            del env._check_frozen
            self.call_args = None
        import sympy

        made += [(guard.expr, sympy.true) for guard in late]
        made = list(dict.fromkeys((e, v) for e, v in made if getattr(e, "free_symbols", None)))
        if not made:
            return fn, None
        where: dict[Any, TokenDimension] = {}
        for symbol in sorted({s for expr, _ in made for s in expr.free_symbols}, key=str):
            if symbol not in self.symbols:
                raise LateGuardError(
                    f"a token range compiled at its first use (compile_at='first_use') assumed "
                    f"{' and '.join(f'{e} == {v}' for e, v in made)}, on {symbol}, which the "
                    "graph's inputs do not carry: set compile_at = 'upfront'"
                )
            where[symbol] = self.symbols[symbol]
        logs.log.info("passkit: a range compiled at first use holds under %s", made)
        return fn, _Holds(made, where)


def _is_fake(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


def _forget_evaluations(env: Any) -> None:
    """Drop what the shape environment cached about sizes: its evaluations of guards (kept
    for good in one cache: they assume the guards made so far stay) and what depends on
    the state kept across a late compile."""
    if hasattr(env, "_version_counter"):
        env._version_counter += 1
    for cls in type(env).__mro__:
        for member in vars(cls).values():
            seen = 0
            while member is not None and seen < 4:  # through decorators (functools.wraps)
                clear = getattr(member, "cache_clear", None)
                if callable(clear):
                    clear()
                member, seen = getattr(member, "__wrapped__", None), seen + 1


def _copied(value: Any) -> Any:
    """A copy of a shape environment's field (a dict of lists: the lists copied too)."""
    if isinstance(value, dict):
        return type(value)((k, list(v) if isinstance(v, list) else v) for k, v in value.items())
    return copy.copy(value)


def locate_symbol(inputs: Sequence[Any], symbol: Any, how: str = "") -> TokenDimension | None:
    """Where ``symbol`` is in a graph's symbolic inputs: a size argument, else a tensor dim."""
    for i, value in enumerate(inputs):
        if isinstance(value, torch.SymInt) and value.node.expr == symbol:
            return TokenDimension(i, None, how or f"size argument {i} ({symbol})")
    for i, value in enumerate(inputs):
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and size.node.expr == symbol:
                    return TokenDimension(i, dim, how or f"input {i}, dim {dim} ({symbol})")
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
