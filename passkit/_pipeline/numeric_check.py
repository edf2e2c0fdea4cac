"""``verify = "numeric"``: the graph before and after a pass, run on the same random inputs.

No structural check sees a rewrite that keeps every shape and dtype and changes only values
(``add`` -> ``sub``, a wrong constant). This level runs the graph as it was before the pass
(the pipeline's snapshot) and as the pass left it, on the same random inputs made from the
placeholders' recorded values (symbolic sizes at their hints), with the same random seed,
and compares every output with a tolerance per dtype (:data:`TOLERANCES`; integers and
booleans exactly). A difference is :class:`~passkit.errors.VerificationError` naming the
pass and the output. It costs two runs of the graph per pass that changed it: on in
passkit-testing's harness, opt-in for users (``verify = "numeric"``, ``PASSKIT_VERIFY=numeric``).

A joint graph (the ``joint`` stage) is called with its ``(primals, tangents)`` signature:
its outputs are the forward outputs and the gradients, so a pass that changes a gradient only
is caught too. Inputs are compared as well: a graph that writes to an input the graph before
the pass left alone (the caller's tensor would change), or writes other values into one, is a
difference.

A graph with collectives (all-reduce, all-gather, reduce-scatter, of torch, symmetric
memory or a host) is not compared: in a fake or single-process world they compute nothing
comparable, and in a real one each rank would run extra collectives out of step. Neither is
a graph that cannot run here before the pass (an op that needs a device this process
lacks, an input without a recorded value): :func:`check` then returns why
(``numeric: not run: ...``), which the pipeline adds to the pass's notes, rather than guess.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ..errors import VerificationError, describe
from .module_state import ModuleState

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (3e-2, 1e-2),
}
"""``(rtol, atol)`` per floating dtype; other floating dtypes (FP8) use ``(0.125, 0.0625)``."""
_DEFAULT_FLOAT = (0.125, 0.0625)
SEED = 20261126


def check(
    gm: torch.fx.GraphModule, before: torch.fx.Graph, pass_name: str, state: ModuleState | None = None
) -> str | None:
    """Raise :class:`VerificationError` naming ``pass_name`` when ``gm`` (after the pass)
    computes other values than ``before`` (the graph before it) on the same random inputs;
    return why when the check could not run (``"numeric: not run: ..."``), else None.

    ``state``: the module's state before the pass (:class:`ModuleState`): the graph before
    the pass runs on the attributes and tensor values it had then, which the pass could not
    touch (without it, on the module's as the pass left them)."""
    from torch.utils._python_dispatch import _disable_current_modes

    lost = state.unrestorable() if state is not None else []
    if lost:
        return (
            f"numeric: not run: the pass wrote in place into {', '.join(lost)}, of which no copy "
            "was kept (the values before the pass are gone)"
        )
    with _disable_current_modes():  # Inductor runs passes under its fake mode: run for real
        why = _check(gm, before, pass_name, state)
    return f"numeric: not run: {why}" if why else None


_COLLECTIVE_WORDS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "c10d",
    "symm_mem",
)


def has_collectives(graph: torch.fx.Graph) -> bool:
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(
            node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
        ):
            name = str(node.target).lower()
            if any(word in name for word in _COLLECTIVE_WORDS):
                return True
    return False


def _check(
    gm: torch.fx.GraphModule, before: torch.fx.Graph, pass_name: str, state: ModuleState | None
) -> str | None:
    if has_collectives(before) or has_collectives(gm.graph):
        return "the graph has collectives (nothing comparable in one process)"
    inputs, why = _inputs(before)
    if inputs is None:
        return why
    from ..graph_utils import snapshot

    try:
        old = torch.fx.GraphModule(_before_root(gm, before, state), snapshot(before))
        expected, wrote_before = _run_inputs(old, inputs)
    except Exception as exc:  # cannot run here (see the module docstring): say so
        return f"the graph before the pass does not run here ({describe(exc)[:200]})"
    try:
        gm.recompile()  # the code of the graph as the pass left it
        got, wrote_after = _run_inputs(gm, inputs)
    except Exception as exc:
        raise VerificationError(
            f"after pass {pass_name!r}: the graph no longer runs on inputs the graph before the "
            f"pass ran on: {describe(exc)}"
        ) from exc
    compare(expected, got, pass_name)
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    for i in sorted(set(wrote_after) - set(wrote_before)):
        name = names[i] if i < len(names) else str(i)
        raise VerificationError(
            f"after pass {pass_name!r}: the graph writes to its input {name!r}, which the graph "
            'before the pass left alone (the caller\'s tensor would change; verify = "numeric")'
        )
    for i in sorted(wrote_before):
        why = _differs(wrote_before[i], wrote_after.get(i, inputs[i]))
        if why:
            name = names[i] if i < len(names) else str(i)
            raise VerificationError(
                f"after pass {pass_name!r}: the graph writes other values into its input {name!r} "
                f'than before the pass: {why} (verify = "numeric")'
            )
    return None


def _before_root(
    gm: torch.fx.GraphModule, before: torch.fx.Graph, state: ModuleState | None
) -> torch.nn.Module | dict[str, Any]:
    """What the graph before the pass reads its attributes from: their values before it."""
    if state is None:
        return gm
    targets = {n.target for n in before.nodes if n.op in ("get_attr", "call_module")}
    return {str(t): state.value_of(gm, str(t)) for t in targets}


def compare(expected: list[Any], got: list[Any], pass_name: str) -> None:
    if len(expected) != len(got):
        raise VerificationError(
            f"after pass {pass_name!r}: the graph returns {len(got)} values, {len(expected)} before"
        )
    for i, (a, b) in enumerate(zip(expected, got)):
        why = _differs(a, b)
        if why:
            raise VerificationError(
                f"after pass {pass_name!r}: output {i} differs from the graph before the pass on "
                f'the same random inputs: {why} (verify = "numeric")'
            )


def _differs(a: Any, b: Any) -> str | None:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return f"{type(a).__name__} before, {type(b).__name__} after"
        try:
            return None if a == b else f"{a!r} before, {b!r} after"
        except Exception:
            return None
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{tuple(a.shape)} {a.dtype} before, {tuple(b.shape)} {b.dtype} after"
    if not a.dtype.is_floating_point and not a.dtype.is_complex:
        if torch.equal(a, b):
            return None
        return f"{int((a != b).sum())} of {a.numel()} elements differ"
    rtol, atol = TOLERANCES.get(a.dtype, _DEFAULT_FLOAT)
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    if torch.allclose(a64, b64, rtol=rtol, atol=atol, equal_nan=True):
        return None
    err = (a64 - b64).abs().nan_to_num(float("inf")).max().item()
    return f"max abs difference {err:.3g} (rtol {rtol:g}, atol {atol:g} for {a.dtype})"


def _run(gm: torch.fx.GraphModule, inputs: list[Any]) -> list[Any]:
    return _run_inputs(gm, inputs)[0]


def _run_inputs(gm: torch.fx.GraphModule, inputs: list[Any]) -> tuple[list[Any], dict[int, Any]]:
    """The flat outputs of ``gm`` on copies of ``inputs``, and the inputs it wrote to (by
    position: their values after the run). A graph whose code takes structured arguments
    (a joint graph: ``(primals, tangents)``) gets them in that structure."""
    args = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    versions = [x._version if isinstance(x, torch.Tensor) else None for x in args]
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(SEED)
        out = gm(*_structured(gm, args))
    flat: list[Any] = []
    _flatten(out, flat)
    wrote = {
        i: x
        for i, (x, v) in enumerate(zip(args, versions))
        if isinstance(x, torch.Tensor) and x._version != v
    }
    return flat, wrote


def _structured(gm: torch.fx.GraphModule, flat: list[Any]) -> list[Any]:
    """``flat`` (one value per placeholder) as the arguments ``gm``'s code takes: a graph made
    with a pytree signature (AOTAutograd's joint graph) takes ``(primals, tangents)``."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    spec = getattr(info, "in_spec", None)
    if spec is None:
        return flat
    import torch.utils._pytree as pytree

    args = pytree.tree_unflatten(flat, spec)
    if isinstance(args, tuple) and len(args) == 2 and isinstance(args[1], dict) and not args[1]:
        args = args[0]  # a spec of (args, kwargs)
    return list(args) if isinstance(args, (tuple, list)) else [args]


def _flatten(value: Any, into: list[Any]) -> None:
    if isinstance(value, (tuple, list)):
        for v in value:
            _flatten(v, into)
    else:
        into.append(value)


def random_inputs(graph: torch.fx.Graph) -> list[Any] | None:
    """Real random inputs shaped like the placeholders' recorded values (None: a placeholder
    records none, or a size has no hint)."""
    return _inputs(graph)[0]


def _inputs(graph: torch.fx.Graph) -> tuple[list[Any] | None, str]:
    """:func:`random_inputs`, and why there are none."""
    gen = torch.Generator().manual_seed(SEED)
    out: list[Any] = []
    for node in graph.find_nodes(op="placeholder"):
        val = node.meta.get("val", node.meta.get("example_value"))
        try:
            out.append(_real(val, gen))
        except _NoInput as exc:
            return None, f"input {node.name!r}: {exc}"
    return out, ""


class _NoInput(Exception):
    pass


def _hint(value: Any) -> int:
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        if hint is None:
            raise _NoInput("a size without a hint")
        return int(hint)
    raise _NoInput(f"a size of type {type(value).__name__}")


def _real(val: Any, gen: torch.Generator) -> Any:
    if val is None:
        raise _NoInput("no recorded value to make an input from")
    if isinstance(val, torch.Tensor):
        if val.device.type != "cpu":
            raise _NoInput(f"on {val.device.type}; the check runs graphs on the CPU only")
        shape = [_hint(s) for s in val.shape]
        dtype = val.dtype
        if dtype == torch.bool:
            return torch.rand(shape, generator=gen) < 0.5
        if dtype.is_floating_point:
            return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
        if dtype.is_complex:
            return torch.randn(shape, generator=gen, dtype=dtype)
        return torch.randint(0, 2, shape, generator=gen, dtype=dtype)  # indices stay in range
    if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
        return _hint(val)
    if isinstance(val, (bool, float)):
        return val
    raise _NoInput(f"a recorded value of type {type(val).__name__}")


__all__ = ["TOLERANCES", "check", "compare", "has_collectives", "random_inputs"]
