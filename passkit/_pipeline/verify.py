"""Checks run after a pass when ``verify = true``: graph lint and fake-tensor re-propagation.

Re-propagation runs every node again on fake tensors (the graph's own fake mode) and
compares the result's shape, dtype and device with the ``meta["val"]`` recorded on the
node, so a pass that wires a wrong-shaped replacement or forgets metadata is caught at the
pass that did it, not deep inside Inductor's lowering.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from ..errors import VerificationError
from ..graph_utils import recorded_value


def verify_graph(gm: torch.fx.GraphModule, pass_name: str) -> None:
    try:
        gm.graph.lint()
    except Exception as exc:
        raise VerificationError(f"after pass {pass_name!r}: graph lint failed: {exc}") from exc
    problems = repropagate(gm)
    if problems:
        listed = "\n  ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise VerificationError(
            f"after pass {pass_name!r}: metadata disagrees with fake-tensor propagation:\n  {listed}{more}"
        )


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(str(s) for s in value.shape), value.dtype, value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    return None


def repropagate(gm: torch.fx.GraphModule) -> list[str]:
    """Problems found re-running ``gm`` on fake tensors (empty when all agree)."""
    from torch._guards import detect_fake_mode

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [recorded_value(n) for n in placeholders]
    dynamo = any("example_value" in n.meta for n in placeholders)  # the pre-grad stage's graph
    if dynamo:  # Dynamo's own fake mode, the one its example values belong to
        fakes = [v for v in vals if isinstance(v, torch._subclasses.FakeTensor)]
        fake_mode = fakes[0].fake_mode if fakes else None
    else:
        fake_mode = detect_fake_mode(vals)
    if fake_mode is None:
        return []  # nothing recorded to compare against (e.g. a symbolic-trace graph)
    problems: list[str] = []
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module") and recorded_value(node) is None:
            key = "example_value" if "example_value" in node.meta or dynamo else "val"
            problems.append(f"{node.name} ({node.target}) has no meta[{key!r}]")
    interp = _RecordingInterpreter(gm)
    with fake_mode:
        try:
            interp.run(*vals)
        except Exception as exc:
            problems.append(f"fake propagation failed at {interp.current}: {type(exc).__name__}: {exc}")
            return problems
    for node, new in interp.results.items():
        old = recorded_value(node)
        if old is None or new is None:
            continue
        if _signature(old) != _signature(new):
            problems.append(
                f"{node.name} ({node.target}): recorded {_signature(old)}, propagated {_signature(new)}"
            )
    return problems


class _RecordingInterpreter(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm, garbage_collect_values=True)
        self.results: dict[torch.fx.Node, Any] = {}
        self.current = "<start>"

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current = n.name
        out = super().run_node(n)
        if n.op not in ("placeholder", "output"):
            self.results[n] = pytree.tree_map_only(torch.Tensor, lambda t: t, out)
        return out
