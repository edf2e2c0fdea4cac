"""``noop_elimination``: drop reshapes, views, slices and expands that change nothing, and
collapse chains of reshapes, so pattern passes see the ops they look for back to back."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.fx

from ..context import CompileContext
from ..pass_base import GraphPass, PassResult

aten = torch.ops.aten

_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_SAME_SHAPE = _RESHAPES | {aten.expand.default}


def _val(node: Any) -> torch.Tensor | None:
    if isinstance(node, torch.fx.Node):
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor):
            return v
    return None


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if a.dim() != b.dim():
        return False
    return all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def _is_full_slice(node: torch.fx.Node, src: torch.Tensor) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    given: list[Any] = list(node.args[1:5])
    dim, start, end, step = given + [0, None, None, 1][len(given) :]  # aten.slice defaults
    if step != 1 or start not in (None, 0) or not isinstance(dim, int):
        return False
    if end is None or (isinstance(end, int) and end >= sys.maxsize // 2):
        return True
    return statically_known_true(end >= src.shape[dim])


class NoopElimination(GraphPass):
    """Remove ops whose output is their input, unchanged."""

    name = "noop_elimination"

    def run(self, gm: torch.fx.GraphModule, ctx: CompileContext) -> PassResult:
        graph = gm.graph
        output = next(iter(reversed(graph.nodes)))
        removed = collapsed = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or not node.args:
                continue
            src = node.args[0]
            if not isinstance(src, torch.fx.Node):
                continue
            if self._collapsible(node, src):
                # reshape(reshape(x, a), b) -> reshape(x, b); the inner one dies if unused
                node.update_arg(0, src.args[0])
                if not src.users:
                    graph.erase_node(src)
                collapsed += 1
                src = node.args[0]
            out_val, src_val = _val(node), _val(src)
            if out_val is None or src_val is None or not self._is_noop(node, out_val, src_val):
                continue
            # never make a graph output the very same tensor as an input
            if src.op == "placeholder" and node in output.all_input_nodes:
                continue
            node.replace_all_uses_with(src)
            graph.erase_node(node)
            removed += 1
        notes = []
        if removed:
            notes.append(f"removed {removed} no-op op(s)")
        if collapsed:
            notes.append(f"collapsed {collapsed} reshape chain(s)")
        return PassResult(modified=bool(removed or collapsed), matches=removed + collapsed, notes=notes)

    @staticmethod
    def _collapsible(node: torch.fx.Node, src: torch.fx.Node) -> bool:
        """``node`` reshapes ``src``, itself a reshape of a contiguous tensor."""
        if node.target not in _RESHAPES or src.op != "call_function" or src.target not in _RESHAPES:
            return False
        base = _val(src.args[0])
        return base is not None and base.is_contiguous()

    @staticmethod
    def _is_noop(node: torch.fx.Node, out_val: torch.Tensor, src_val: torch.Tensor) -> bool:
        if node.target in _SAME_SHAPE:
            return _same_shape(out_val, src_val) and out_val.dtype == src_val.dtype
        if node.target is aten.slice.Tensor:
            return _is_full_slice(node, src_val)
        return False
