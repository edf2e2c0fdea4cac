"""The graph's outputs, checked after every pass (``verify`` on or off).

A pass that changes what the graph returns (another count of outputs, an output of another
shape, dtype or device) makes Inductor compile a graph that computes something else: the
compile succeeds and the caller gets a wrong result. :func:`check` compares the outputs after
a pass with what they were before it, and raises :class:`~passkit.errors.VerificationError`
naming the pass, so the pipeline restores the graph and records the pass as failed.

What an output is after the pass is not read from its ``meta["val"]`` alone (a pass can copy
the old node's metadata onto a node that computes something else): a node the pass added or
rewired is re-run on fake tensors from its inputs' recorded values, and so is every such node
whose result unchanged nodes or the output use (the boundary of the rewrite: it must keep the
shape, dtype and device that its users were traced with). Nodes the pass did not touch keep
their recorded values. The cost is one look at the output node per pass, plus one fake-tensor
call per rewritten node that reaches the boundary; ``benchmarks/output_check.py`` measures it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx

from ..errors import VerificationError, cut
from ..graph_utils import recorded_value
from .graph_diff import GraphDiff

Signature = tuple[Any, ...]
"""Of one value: ``("tensor", sizes, dtype, device)``, ``("sym", kind)``, ``("node", None)``
(no recorded value: not compared) or ``("const", type name)``."""

_UNKNOWN: Signature = ("node", None)


def output_node(graph: torch.fx.Graph) -> torch.fx.Node | None:
    """The graph's ``output`` node (usually its last node)."""
    for node in reversed(graph.nodes):
        if node.op == "output":
            return node
    return None


def entries(graph: torch.fx.Graph) -> list[Any]:
    """The flattened arguments of the output node (what the graph returns, in order)."""
    out = output_node(graph)
    if out is None:
        return []
    flat: list[Any] = []
    _flatten(out.args, flat)
    return flat


def _flatten(value: Any, into: list[Any]) -> None:
    if isinstance(value, (tuple, list)):
        for v in value:
            _flatten(v, into)
    elif isinstance(value, dict):
        for v in value.values():
            _flatten(v, into)
    else:
        into.append(value)


def signature_of_value(value: Any) -> Signature:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(str(s) for s in value.shape), value.dtype, value.device.type)
    if isinstance(value, (torch.SymInt, int)) and not isinstance(value, bool):
        return ("sym", "int")
    if isinstance(value, (torch.SymFloat, float)):
        return ("sym", "float")
    if isinstance(value, (torch.SymBool, bool)):
        return ("sym", "bool")
    if isinstance(value, (tuple, list)):
        return ("seq", tuple(signature_of_value(v) for v in value))
    return _UNKNOWN


def signature(entry: Any) -> Signature:
    """Of one output entry, from its recorded value (``None`` returned: ``("const", ...)``)."""
    if isinstance(entry, torch.fx.Node):
        val = recorded_value(entry)
        return _UNKNOWN if val is None else signature_of_value(val)
    return ("const", type(entry).__name__)


def outputs(graph: torch.fx.Graph) -> list[Signature]:
    """The signatures of what ``graph`` returns (taken before a pass)."""
    return [signature(e) for e in entries(graph)]


def check(graph: torch.fx.Graph, before: list[Signature], change: GraphDiff, pass_name: str) -> None:
    """Raise :class:`VerificationError` naming ``pass_name`` when the outputs of ``graph``
    differ from ``before`` or a rewritten node breaks what unchanged nodes were traced with
    (see the module docstring); ``change``: what the pass changed
    (:func:`passkit._pipeline.graph_diff.measure`)."""
    changed_set = set(change.changed)
    after = entries(graph)
    if len(after) != len(before):
        raise VerificationError(
            f"after pass {pass_name!r}: the graph returns {len(after)} value(s), it returned "
            f"{len(before)} before the pass (a pass must not change what the graph returns)"
        )
    inferred = _Inference(graph, change.changed)
    if changed_set:
        inferred.value(next(iter(changed_set)))  # runs every rewritten node once
        _raise_errors(inferred, pass_name)
    for i, (entry, old) in enumerate(zip(after, before)):
        new = inferred.signature(entry)
        if not _agree(old, new):
            name = entry.name if isinstance(entry, torch.fx.Node) else cut(repr(entry), 60)
            raise VerificationError(
                f"after pass {pass_name!r}: output {i} ({name}) is {_show(new)}, was {_show(old)}"
            )
    for node in change.changed:
        prior = change.prior.get(node)
        if prior is not None and prior.target is node.target:
            mixed = _inputs_changed(node, prior, inferred)
            if mixed:
                raise VerificationError(f"after pass {pass_name!r}: {mixed}")
    for node in change.changed:  # a rewritten node's recorded value must be what its op computes
        recorded, computed = recorded_value(node), inferred.value(node)
        if isinstance(recorded, torch.Tensor) and isinstance(computed, torch.Tensor):
            old, new = signature_of_value(recorded), signature_of_value(computed)
            if not _agree(old, new):
                raise VerificationError(
                    f"after pass {pass_name!r}: {node.name}'s recorded value is {_show(old)} but its op "
                    f"computes {_show(new)} (a rewrite must record what the node computes)"
                )
    for node in change.changed:
        if all(user in changed_set or user.op == "output" for user in node.users):
            continue  # inside the rewrite: its users were rewired by the pass too
        prior = change.prior.get(node)
        if prior is None:
            continue
        old = signature(prior)
        new = inferred.signature(node)
        if not _agree(old, new):
            users = ", ".join(sorted(u.name for u in node.users if u not in changed_set)[:3])
            raise VerificationError(
                f"after pass {pass_name!r}: {node.name} is {_show(new)}, was {_show(old)}, and "
                f"nodes the pass did not change use it ({users})"
            )


def _inputs_changed(node: torch.fx.Node, prior: torch.fx.Node, inferred: _Inference) -> str | None:
    """Why ``node`` (the same op as ``prior``, rewired by the pass) looks fed inputs its kernel
    refuses although its fake implementation accepted them: tensors of mixed dtypes where all
    of ``prior``'s had one (``addmm``, attention refuse them at run time), or, for an op that
    is not pointwise and takes several tensors, an input of another shape while the result
    keeps its shape (attention given a key of another layout; its CPU kernel can kill the
    process)."""

    def tensors(n: torch.fx.Node, value: Any) -> list[Any]:
        return [v if isinstance(v := value(a), torch.Tensor) else None for a in n.all_input_nodes]

    before = tensors(prior, lambda a: recorded_value(a))
    after = tensors(node, inferred.value)
    old_dtypes = {t.dtype for t in before if t is not None and t.dim() > 0}
    new_dtypes = [t.dtype for t in after if t is not None and t.dim() > 0]
    if len(old_dtypes) == 1 and len(set(new_dtypes)) > 1:
        shown = ", ".join(str(d).replace("torch.", "") for d in new_dtypes)
        return (
            f"{node.name} = {node.target}(...) now gets tensors of dtypes {shown}, all "
            f"{str(next(iter(old_dtypes))).replace('torch.', '')} before the pass"
        )
    tags = getattr(node.target, "tags", ())
    tensors_in = sum(t is not None for t in after)
    if torch.Tag.pointwise in tags or len(before) != len(after) or tensors_in < 2:
        return None  # one tensor input (a reshape of a collapsed chain): its fake kernel decides
    for i, (old, new) in enumerate(zip(before, after)):
        if old is None or new is None:
            continue
        old_shape, new_shape = [str(s) for s in old.shape], [str(s) for s in new.shape]
        if old_shape != new_shape and _agree(signature(prior), inferred.signature(node)):
            return (
                f"{node.name} = {node.target}(...): its input {i} is [{', '.join(new_shape)}], was "
                f"[{', '.join(old_shape)}], and its result kept its shape (an op that is not "
                "pointwise fed a tensor of another shape)"
            )
    return None


def _raise_errors(inferred: _Inference, pass_name: str) -> None:
    if inferred.errors:
        node, exc = inferred.errors[0]
        raise VerificationError(
            f"after pass {pass_name!r}: {node.name} = {node.target}(...) raises on fake tensors of "
            f"its inputs: {type(exc).__name__}: {cut(str(exc), 300)}"
        )


def _agree(old: Signature, new: Signature) -> bool:
    if old in (new, _UNKNOWN) or new == _UNKNOWN:
        return True
    if old[0] == "seq" and new[0] == "seq":
        return len(old[1]) == len(new[1]) and all(_agree(a, b) for a, b in zip(old[1], new[1]))
    return False


def _show(sig: Signature) -> str:
    kind = sig[0]
    if kind == "tensor":
        _, sizes, dtype, device = sig
        return f"{str(dtype).replace('torch.', '')}[{', '.join(sizes)}] on {device}"
    if kind == "sym":
        return f"a {sig[1]}"
    if kind == "const":
        return f"a constant {sig[1]}"
    if kind == "seq":
        return "(" + ", ".join(_show(x) for x in sig[1]) + ")"
    return "unknown"


class _Inference:
    """Values of rewritten nodes, re-run on fake tensors from their inputs' values (memoized);
    unchanged nodes give their recorded value. ``None``: not known (no fake mode, a missing
    recorded value, or an op whose fake run raised: Inductor will judge it)."""

    def __init__(self, graph: torch.fx.Graph, changed: list[torch.fx.Node]):
        self.order = changed
        """The rewritten nodes, in graph order (inputs first)."""
        self.changed = set(changed)
        self.memo: dict[torch.fx.Node, Any] = {}
        self._ran = False
        self.errors: list[tuple[torch.fx.Node, Exception]] = []
        """Rewritten nodes whose op raised on fake tensors of their inputs."""
        self._mode: Any = False  # not looked up yet
        self.graph = graph

    def fake_mode(self) -> Any:
        if self._mode is False:
            from torch._subclasses.fake_tensor import FakeTensor

            self._mode = None
            for n in self.graph.find_nodes(op="placeholder"):
                val = recorded_value(n)
                if isinstance(val, FakeTensor):
                    self._mode = val.fake_mode
                    break
        return self._mode

    def signature(self, entry: Any) -> Signature:
        if not isinstance(entry, torch.fx.Node):
            return ("const", type(entry).__name__)
        if entry not in self.changed:
            return signature(entry)
        val = self.value(entry)
        return _UNKNOWN if val is None else signature_of_value(val)

    def value(self, node: torch.fx.Node) -> Any:
        if node not in self.changed:
            return recorded_value(node)
        if not self._ran:
            self._run()
        return self.memo.get(node)

    def _run(self) -> None:
        """Every rewritten node in graph order (inputs first; no recursion on long chains)."""
        self._ran = True
        mode = self.fake_mode()
        if mode is None:
            return
        missing = False

        def load(n: torch.fx.Node) -> Any:
            nonlocal missing
            v = self.memo.get(n) if n in self.changed else recorded_value(n)
            if v is None:
                missing = True
            return v

        with mode, _no_guards(mode), _quiet_fake_errors():
            for node in self.order:  # not the whole graph: a pass rewrites a few nodes of many
                missing = False
                args = torch.fx.node.map_arg(node.args, load)
                kwargs = torch.fx.node.map_arg(node.kwargs, load)
                if missing:
                    continue
                try:
                    call = self._callable(node, args)
                except Exception:  # a module or method not found: nothing to tell from
                    continue
                if call is None:
                    continue
                if node.op == "call_method":
                    args = args[1:]
                try:
                    self.memo[node] = call(*args, **kwargs)
                except Exception as exc:
                    # a module holds real parameters a fake run may refuse: only its value is unknown
                    if node.op != "call_module" and not _cannot_tell(exc):
                        self.errors.append((node, exc))  # the op rejects its inputs: so would a real run

    def _callable(self, node: torch.fx.Node, args: Any) -> Any:
        """What ``node`` calls: its function, the method of its first argument
        (``call_method``: pre-grad graphs call ``x.narrow(...)``, ``x.to(...)``) or the
        submodule of the graph's module (``call_module``); None: nothing to call."""
        if node.op == "call_function":
            return node.target if callable(node.target) else None
        if node.op == "call_method":
            return getattr(args[0], node.target) if args and isinstance(node.target, str) else None
        if node.op == "call_module":
            owner = self.graph.owning_module
            module = owner.get_submodule(node.target) if owner is not None else None
            if module is None or next(module.buffers(), None) is not None:
                return None  # a module with state (running statistics) is not run for a check
            return module
        return None


def _cannot_tell(exc: Exception) -> bool:
    """Whether a fake run's exception says nothing about the graph (an op without a fake
    implementation, a data-dependent output), as opposed to an op rejecting its inputs."""
    from torch._subclasses import fake_tensor

    names = (
        "DynamicOutputShapeException",
        "DataDependentOutputException",
        "UnsupportedOperatorException",
        "UnsupportedFakeTensorException",
    )
    kinds = tuple(k for n in names if isinstance(k := getattr(fake_tensor, n, None), type))
    return isinstance(exc, (*kinds, NotImplementedError)) or "data-dependent" in str(exc).lower()


@contextlib.contextmanager
def _quiet_fake_errors() -> Any:
    """torch logs a meta kernel that raises at error level; here that is the check's finding,
    reported by the VerificationError, not a log line of its own."""
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled = logger.disabled
    logger.disabled = True  # (setLevel would clear every logger's cache)
    try:
        yield
    finally:
        logger.disabled = disabled


@contextlib.contextmanager
def _no_guards(mode: Any) -> Any:
    """Fake runs for a check must not add guards to the compile's shape environment."""
    shape_env = getattr(mode, "shape_env", None)
    suppress = getattr(shape_env, "suppress_guards", None)
    if suppress is None:
        yield
        return
    with suppress():
        yield


__all__ = ["check", "entries", "output_node", "outputs", "signature"]
