"""The reproducer of a culprit rewrite: the graph its pass saw, the pass, a pytest file.

:class:`Capture` (a plugin of the probe process) copies the graph before each pass and keeps
the copy of the pass run that made rewrite ``index``; :meth:`Capture.write` writes::

    DIR/graph.py        the graph the pass saw, readable (a GraphModule class)
    DIR/constants.pt    its tensor attributes
    DIR/repro.json      inputs (shapes, dtypes), seed, pass and options, context, rewrites allowed
    DIR/test_repro.py   pytest: replays the pass on the graph (passkit_testing.replay_pass)

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

    def write(self, folder: Path, spec: dict[str, Any], example: Any) -> None:
        if self.found is None:
            raise RuntimeError(f"rewrite {self.index} was not made in the repro probe: nothing to write")
        write(folder, self.found, spec)


def _hint(value: Any) -> int:
    """A size as an int, without a guard: ``int()`` of a SymInt specializes the graph being
    compiled to that size (a host compiling per batch size then got code for one size only)."""
    node = getattr(value, "node", None)
    return int(node.hint) if node is not None else int(value)


def write(folder: Path, found: dict[str, Any], spec: dict[str, Any]) -> None:
    """Write the reproducer of ``found`` (see the module docstring) into ``folder``."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    import torch.fx

    from ..graph_utils import snapshot

    p, ctx = found["pass"], found["context"]
    gm = torch.fx.GraphModule(found["gm"], snapshot(found["gm"].graph))  # its class: GraphModule
    code = gm.print_readable(print_output=False)
    (folder / "graph.py").write_text(
        f'"""The graph pass {p.name!r} saw ({ctx.stage}, a {ctx.graph_kind} graph), written by passkit."""\n'
        "# ruff: noqa\nimport torch\nfrom math import inf, nan\nfrom torch import device\n\n\n" + code + "\n"
    )
    constants = {name: t.detach().clone() for name, t in _tensor_attributes(gm).items()}
    if constants:
        torch.save(constants, folder / "constants.pt")
    inputs = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            shape = [_hint(d) for d in val.shape]
            inputs.append({"name": node.name, "shape": shape, "dtype": str(val.dtype).removeprefix("torch.")})
        else:
            inputs.append({"name": node.name, "value": _hint(val) if val is not None else None})
    context = {
        "device": ctx.device,
        "dtype": str(ctx.dtype).removeprefix("torch.") if ctx.dtype is not None else None,
        "world_size": ctx.world_size,
        "mode": ctx.mode,
        "graph_kind": ctx.graph_kind,
        "stage": ctx.stage,
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
    (folder / "test_repro.py").write_text(TEST.format(name=p.name, target=spec["target"], allowed=allowed))


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
Needs passkit, passkit-testing, the pass's plugin and torch.

Run: pytest test_repro.py. It fails as the model did; it passes once the pass is fixed.
"""

import json
import pathlib

import torch

from passkit_testing import assert_close, fake_world, load_graph, make_inputs, replay_pass

HERE = pathlib.Path(__file__).resolve().parent
SPEC = json.loads((HERE / "repro.json").read_text())


def _replay():
    gm = load_graph(HERE)
    inputs = make_inputs(SPEC["inputs"], SPEC["seed"])
    with torch.no_grad():
        expected = gm(*inputs)
        after = replay_pass(gm, SPEC["pass"], inputs=inputs, rewrites=SPEC["rewrites"], context=SPEC["context"])
        if SPEC["check"] == "compile":  # lowered by Inductor as the compile did
            actual = _inductor(after, inputs)
        else:
            actual = after(*inputs)
    assert_close(list(actual), list(expected), atol=SPEC["atol"], rtol=SPEC["rtol"])


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
