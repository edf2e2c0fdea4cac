"""Replay one pass on a saved graph: what the reproducers ``passkit bisect --repro`` writes run.

A reproducer folder holds ``graph.py`` (the graph the pass saw, as readable code: a
``GraphModule`` class), ``constants.pt`` (its tensor attributes) and ``repro.json`` (the
inputs' shapes and dtypes, the seed, the pass and its options, the compile context, how
many rewrites the pass was allowed)::

    gm = load_graph(folder)
    inputs = make_inputs(spec["inputs"], spec["seed"])
    after = replay_pass(gm, spec["pass"], rewrites=spec["rewrites"], context=spec["context"])
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx

import passkit
from passkit import rewrite_counter

from .harness import PassSpec, copy_graph_module, resolve_passes

__all__ = ["gradients", "load_graph", "make_inputs", "replay_pass"]


def load_graph(folder: str | Path) -> torch.fx.GraphModule:
    """The graph of a reproducer folder, traced back from its code (ATen ops as call
    nodes), its tensor attributes restored; fake values are propagated by :func:`replay_pass`.
    Its nodes keep the names of the graph the pass saw (``neg_5``, as the report and the
    pass's errors name them; tracing alone would call it ``neg_default_5``)."""
    folder = Path(folder)
    source = (folder / "graph.py").read_text()
    spec = importlib.util.spec_from_file_location("passkit_repro_graph", folder / "graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    root = module.GraphModule()
    constants = folder / "constants.pt"
    if constants.exists():
        for name, value in torch.load(constants, weights_only=True).items():
            owner = root
            *path, last = name.split(".")
            for part in path:
                owner = getattr(owner, part)
            setattr(owner, last, value)
    traced = torch.fx.symbolic_trace(root)
    _restore_names(traced, _assigned_names(source))
    return traced


def _assigned_names(source: str) -> list[str]:
    """The names ``GraphModule.forward`` of FX's generated code assigns, in order (the
    ``x = None`` that frees a value is not an assignment of a node)."""
    forward = next(
        (
            fn
            for cls in ast.parse(source).body
            if isinstance(cls, ast.ClassDef) and cls.name == "GraphModule"
            for fn in cls.body
            if isinstance(fn, ast.FunctionDef) and fn.name == "forward"
        ),
        None,
    )
    names: list[str] = []
    for stmt in forward.body if forward is not None else []:
        if isinstance(stmt, ast.AnnAssign):
            target = stmt.target
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
        else:
            continue
        frees = isinstance(stmt.value, ast.Constant) and stmt.value.value is None
        if isinstance(target, ast.Name) and not frees:
            names.append(target.id)
    return names


def _restore_names(gm: torch.fx.GraphModule, names: list[str]) -> None:
    """Give the traced nodes (placeholders and output aside) ``names``, in order, when they
    are as many (else they keep the tracer's names)."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    if len(nodes) != len(names) or len(set(names)) != len(names):
        return
    for i, node in enumerate(nodes):  # first out of the way: a wanted name may be taken
        node._rename(f"_passkit_repro_{i}")
    for node, name in zip(nodes, names, strict=True):
        node._rename(name)
    gm.recompile()


def make_inputs(specs: Sequence[Mapping[str, Any]], seed: int = 0) -> list[Any]:
    """Inputs of the given shapes and dtypes (``{"shape": [8, 16], "dtype": "float32"}``, or
    ``{"value": 3}`` for a scalar), random from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    out: list[Any] = []
    for s in specs:
        if "value" in s:
            out.append(s["value"])
            continue
        dtype = getattr(torch, s["dtype"])
        shape = tuple(s["shape"])
        if dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(dtype))
        elif dtype == torch.bool:
            out.append(torch.rand(shape, generator=gen) > 0.5)
        else:
            out.append(torch.randint(0, 4, shape, generator=gen).to(dtype))
    return out


def gradients(
    gm: torch.nn.Module, inputs: Sequence[Any], specs: Sequence[Mapping[str, Any]], *, seed: int = 0
) -> dict[str, torch.Tensor | None]:
    """The gradients of ``gm``'s inputs after a forward and a backward: the inputs whose spec
    says ``"requires_grad": true`` (a pre-grad graph's parameters, and its floating inputs
    under ``--check grad``) want one; the backward is of every output that needs a gradient,
    each times random cotangents from ``seed`` (the same for every call). Keyed by the input's
    label (``L['self']._parameters['w']``) or name, so a difference names the tensor."""
    wanted = [bool(s.get("requires_grad")) for s in specs]
    if not any(wanted):
        raise ValueError("no input wants a gradient (no spec says requires_grad): nothing to compare")
    leaves = [
        x.detach().clone().requires_grad_(w) if isinstance(x, torch.Tensor) else x
        for x, w in zip(inputs, wanted, strict=True)
    ]
    outputs = [o for o in torch.utils._pytree.tree_leaves(gm(*leaves)) if isinstance(o, torch.Tensor)]
    outputs = [o for o in outputs if o.requires_grad]
    if not outputs:
        raise ValueError("no output of the graph needs a gradient: nothing to compare")
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen).to(o)).sum() for o in outputs)
    loss.backward()  # type: ignore[union-attr]
    return {
        f"the gradient of {s.get('label', s.get('name', i))}": x.grad
        for i, (s, x, w) in enumerate(zip(specs, leaves, wanted))
        if w
    }


def replay_pass(
    gm: torch.fx.GraphModule,
    pass_: PassSpec,
    *,
    inputs: Sequence[Any],
    rewrites: int | None = None,
    context: Mapping[str, Any] | None = None,
) -> torch.fx.GraphModule:
    """Run ``pass_`` once on a copy of ``gm`` (fake values propagated from ``inputs``) and
    return the copy; ``rewrites``: allow only the first N rewrites it asks for (the rewrite
    counter), as in the compile a reproducer comes from."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    (p,) = resolve_passes([pass_])
    graph = copy_graph_module(gm)
    FakeTensorProp(graph, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    fields = dict(context or {})
    if fields.get("stage") == "pre_grad":  # Dynamo's graph: its passes read meta["example_value"]
        for node in graph.graph.nodes:
            if "val" in node.meta:
                node.meta.setdefault("example_value", node.meta["val"])
    if isinstance(fields.get("dtype"), str):
        fields["dtype"] = getattr(torch, fields["dtype"])
    ctx = passkit.CompileContext(**fields)
    if rewrites is None:
        result = p.run(graph, ctx)
    else:
        rewrite_counter.reset()
        with rewrite_counter.counting(rewrites, p.name, p.stage.value, "repro"):
            result = p.run(graph, ctx)
    if not isinstance(result, passkit.PassResult):
        raise TypeError(f"pass {p.name!r}: run() returned {type(result).__name__}, not a PassResult")
    graph.graph.lint()
    graph.recompile()
    return graph
