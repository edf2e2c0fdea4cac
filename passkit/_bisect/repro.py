"""The reproducer of a culprit rewrite: the graph its pass saw, the pass, a pytest file.

:class:`Capture` (a plugin of the probe process) copies the graph before each pass and keeps
the copy of the pass run that made rewrite ``index``; :meth:`Capture.write` writes::

    DIR/graph.py        the graph the pass saw, readable (a GraphModule class)
    DIR/constants.pt    its tensor attributes
    DIR/repro.json      inputs (shapes, dtypes), seed, pass and options, context, rewrites allowed
    DIR/test_repro.py   pytest: replays the pass on the graph (passkit_testing.replay_pass);
                        its docstring carries the command that runs it

Inputs come from what the stage records (``meta["val"]``, Dynamo's ``meta["example_value"]``
at pre-grad); a graph that cannot be made standalone is refused in one line
(:class:`ReproRefused`), never written with inputs it cannot make. ``--check grad`` at
pre-grad compares the inputs' gradients after a forward and a backward
(:func:`passkit_testing.gradients`); a joint or backward graph computes gradients itself, so
its outputs are compared, labelled.

It needs passkit, passkit-testing, the pass's plugin and torch: no model code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..hookspecs import hookimpl
from ..rewrite_counter import counted_rewrites


class Capture:
    """Keeps the graph before the pass run that counts rewrite ``index``."""

    def __init__(self, index: int):
        self.index = index
        self.pending: tuple[Any, int, Any] | None = None
        self.found: dict[str, Any] | None = None

    def install(self) -> None:
        from .._plugins.registry import register

        register(self, name="passkit-bisect-capture")

    @hookimpl
    def passkit_before_pass(self, pass_: Any, gm: Any, context: Any) -> None:
        if self.found is None:
            import torch.fx

            from ..graph_utils import snapshot

            self.pending = (torch.fx.GraphModule(gm, snapshot(gm.graph)), len(counted_rewrites()), context)

    @hookimpl
    def passkit_after_pass(self, pass_: Any, gm: Any, result: Any, record: Any) -> None:
        self._settle(pass_, None)

    @hookimpl
    def passkit_pass_failed(self, pass_: Any, gm: Any, error: BaseException, record: Any) -> None:
        self._settle(pass_, error)

    def _settle(self, pass_: Any, error: BaseException | None) -> None:
        if self.found is not None or self.pending is None:
            return
        gm, before, ctx = self.pending
        self.pending = None
        if before < self.index <= len(counted_rewrites()) or (error is not None and before < self.index):
            self.found = {
                "gm": gm,
                "pass": pass_,
                "context": ctx,
                "rewrites": self.index - before,
                "error": error,
            }

    def write(self, folder: Path, spec: dict[str, Any]) -> str:
        """Write the reproducer; the command that runs it (:class:`ReproRefused`: why not)."""
        if self.found is None:
            raise ReproRefused(f"rewrite {self.index} was not made in the repro probe: nothing to write")
        return write(folder, self.found, spec)


def _hint(value: Any) -> int:
    """A size as an int, without a guard: ``int()`` of a SymInt specializes the graph being
    compiled to that size (a host compiling per batch size then got code for one size only)."""
    node = getattr(value, "node", None)
    return int(node.hint) if node is not None else int(value)


class ReproRefused(Exception):
    """A graph this writer cannot make standalone: the one line that says which stage and why."""


def _value(node: Any) -> Any:
    """The value recorded on a placeholder: ``meta["val"]`` (ATen graphs) or Dynamo's
    ``meta["example_value"]`` (the pre-grad stage's torch-level graph)."""
    return node.meta["val"] if "val" in node.meta else node.meta.get("example_value")


def _label(node: Any) -> str:
    """What a placeholder is, for a message: Dynamo's source of it when recorded
    (``L['self']._parameters['w']``), else its name."""
    source = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
    try:
        return str(source() if callable(source) else source) if source is not None else node.name
    except Exception:
        return node.name


def _inputs(gm: Any, stage: str) -> list[dict[str, Any]]:
    """The placeholders' shapes, dtypes and whether they want a gradient; or
    :class:`ReproRefused` naming the first that records no value."""
    import torch

    inputs = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = _value(node)
        if isinstance(val, torch.Tensor):
            shape = [_hint(d) for d in val.shape]
            inputs.append(
                {
                    "name": node.name,
                    "label": _label(node),
                    "shape": shape,
                    "dtype": str(val.dtype).removeprefix("torch."),
                    "requires_grad": bool(val.requires_grad),
                }
            )
        elif isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
            inputs.append({"name": node.name, "value": _hint(val)})
        else:
            what = "no value" if val is None else f"a {type(val).__name__}"
            raise ReproRefused(
                f"stage {stage}: input {node.name!r} of the graph records {what} (neither a tensor nor "
                "a number), so its reproducer cannot make it"
            )
    return inputs


def _outputs(gm: Any, graph_kind: str) -> list[str]:
    """A label per output of ``gm``: which ones are gradients (a joint graph's last outputs
    are its primals' gradients; a backward graph's outputs are all gradients)."""
    (out,) = gm.graph.find_nodes(op="output")
    import torch.utils._pytree as pytree

    n = len(pytree.tree_leaves(out.args[0]))
    if graph_kind == "joint":
        primals = [p.name for p in gm.graph.find_nodes(op="placeholder") if p.name.startswith("primals")]
        if 0 < len(primals) <= n:
            first = n - len(primals)
            grads = [f"the gradient of the forward's input {k} ({p})" for k, p in enumerate(primals)]
            return [f"output {i}" for i in range(first)] + grads
    if graph_kind == "backward":  # one per input of the forward graph, in order
        return [f"the gradient of the forward's input {i}" for i in range(n)]
    return [f"output {i}" for i in range(n)]


def _refuse_unloadable(gm: Any, stage: str) -> None:
    """A graph whose code needs the model's classes (a submodule it calls) cannot be loaded
    without the model: said in one line, instead of a reproducer that fails on its own."""
    for node in gm.graph.nodes:
        if node.op == "call_module":
            raise ReproRefused(
                f"stage {stage}: the graph calls the model's submodule {node.target!r} "
                f"({type(gm.get_submodule(node.target)).__name__}), whose code a reproducer does not hold"
            )


def write(folder: Path, found: dict[str, Any], spec: dict[str, Any]) -> str:
    """Write the reproducer of ``found`` (see the module docstring) into ``folder``; the
    command that runs it. :class:`ReproRefused` (nothing written) for a graph it cannot make
    standalone."""
    import torch
    import torch.fx

    from ..graph_utils import snapshot

    p, ctx = found["pass"], found["context"]
    gm = torch.fx.GraphModule(found["gm"], snapshot(found["gm"].graph))  # its class: GraphModule
    gm.graph.set_codegen(torch.fx.graph.CodeGen())  # flat arguments: a joint graph's pytree spec aside
    gm.recompile()
    stage = str(getattr(ctx.stage, "value", ctx.stage))
    _refuse_unloadable(found["gm"], stage)
    inputs = _inputs(gm, stage)
    code = gm.print_readable(print_output=False)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "graph.py").write_text(
        f'"""The graph pass {p.name!r} saw ({stage}, a {ctx.graph_kind} graph), written by passkit."""\n'
        "# ruff: noqa\nimport torch\nfrom math import inf, nan\nfrom torch import device\n\n\n" + code + "\n"
    )
    constants = {name: t.detach().clone() for name, t in _tensor_attributes(gm).items()}
    if constants:
        torch.save(constants, folder / "constants.pt")
    context = {
        "device": ctx.device,
        "dtype": str(ctx.dtype).removeprefix("torch.") if ctx.dtype is not None else None,
        "world_size": ctx.world_size,
        "mode": ctx.mode,
        "graph_kind": ctx.graph_kind,
        "stage": stage,
        "compiler": ctx.compiler,
    }
    error = found["error"]
    repro = {
        "pass": {"name": p.name, **json.loads(p.options_json())},
        "rewrites": found["rewrites"],
        "check": spec["check"],
        "atol": spec["atol"],
        "rtol": spec["rtol"],
        "seed": spec["seed"],
        "inputs": inputs,
        "outputs": _outputs(gm, ctx.graph_kind),
        "context": context,
        "target": spec["target"],
        "error": f"{type(error).__name__}: {error}" if error is not None else None,
    }
    rewrites = found["rewrites"]
    allowed = (
        f", its first {rewrites} rewrite(s) allowed (passkit bisect)"
        if rewrites is not None
        else " (it raised)"
    )
    (folder / "repro.json").write_text(json.dumps(repro, indent=2) + "\n")
    command = f"python -m pytest {folder.resolve() / 'test_repro.py'}"
    compares = {
        "grad": "the gradients of the graph's inputs after a forward and a backward"
        if stage == "pre_grad"
        else "the graph's outputs (a joint or backward graph's outputs are gradients)",
        "compile": "the outputs, the graph lowered by Inductor as the compile did",
    }.get(spec["check"], "the outputs")
    (folder / "test_repro.py").write_text(
        TEST.format(
            name=p.name,
            target=spec["target"],
            allowed=allowed,
            stage=stage,
            check=spec["check"],
            compares=compares,
            command=command,
        )
    )
    return command


def _tensor_attributes(gm: Any) -> dict[str, Any]:
    import torch

    found = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        owner = gm
        for part in node.target.split("."):
            owner = getattr(owner, part)
        if isinstance(owner, torch.Tensor):
            found[node.target] = owner
    return found


TEST = '''"""passkit reproducer: pass {name!r} on the graph it saw in {target}{allowed}.
Stage {stage}, --check {check}: compares {compares}, before and after the pass.
Needs passkit, passkit-testing, the pass's plugin and torch.

Run: {command}
It fails as the model did; it passes once the pass is fixed.
"""

import json
import pathlib

import torch

from passkit_testing import assert_close, fake_world, gradients, load_graph, make_inputs, replay_pass

HERE = pathlib.Path(__file__).resolve().parent
SPEC = json.loads((HERE / "repro.json").read_text())


def _replay():
    gm = load_graph(HERE)
    inputs = make_inputs(SPEC["inputs"], SPEC["seed"])
    if SPEC["check"] == "grad" and SPEC["context"]["stage"] == "pre_grad":  # forward and backward
        after = replay_pass(gm, SPEC["pass"], inputs=inputs, rewrites=SPEC["rewrites"], context=SPEC["context"])
        expected = gradients(gm, inputs, SPEC["inputs"], seed=SPEC["seed"])
        actual = gradients(after, inputs, SPEC["inputs"], seed=SPEC["seed"])
        assert_close(actual, expected, atol=SPEC["atol"], rtol=SPEC["rtol"])
        return
    with torch.no_grad():
        expected = gm(*inputs)
        after = replay_pass(gm, SPEC["pass"], inputs=inputs, rewrites=SPEC["rewrites"], context=SPEC["context"])
        if SPEC["check"] == "compile":  # lowered by Inductor as the compile did
            actual = _inductor(after, inputs)
        else:
            actual = after(*inputs)
    labels = SPEC["outputs"]
    if len(labels) == len(actual) == len(expected):
        actual, expected = dict(zip(labels, actual)), dict(zip(labels, expected))
    assert_close(actual, expected, atol=SPEC["atol"], rtol=SPEC["rtol"])


def _inductor(gm, inputs):
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with tracing(TracingContext(mode)):
        fake = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
        compiled = compile_fx_inner(gm, fake)
    return compiled(list(inputs))


def test_pass_keeps_the_graph_correct():
    if SPEC["context"]["world_size"] > 1:
        with fake_world(world_size=SPEC["context"]["world_size"]):
            _replay()
    else:
        _replay()
'''
