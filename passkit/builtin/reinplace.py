"""``reinplace``: turn ``auto_functionalized`` calls of mutating custom ops back into
in-place calls where nothing observes the mutated buffer afterwards.

Functionalization wraps a mutating op (for instance a fused kernel that writes its output
into a buffer) in ``auto_functionalized``, which clones every mutated argument. When the
argument is dead after the call, the clone is pure overhead: this pass lets the op write
into the buffer directly. It uses Inductor's own alias analysis (the one Inductor runs at
the end of its post-grad passes), so it is also what makes the eager mode copy-free.
"""

from __future__ import annotations

import torch
import torch.fx

from ..context import CompileContext
from ..pass_base import GraphPass, PassResult


def _auto_functionalized_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    hops = {torch.ops.higher_order.auto_functionalized}
    v2 = getattr(torch.ops.higher_order, "auto_functionalized_v2", None)
    if v2 is not None:
        hops.add(v2)
    return [n for n in graph.nodes if n.op == "call_function" and n.target in hops]


class Reinplace(GraphPass):
    """Re-inplace mutating custom ops wrapped by functionalization."""

    name = "reinplace"

    def run(self, gm: torch.fx.GraphModule, ctx: CompileContext) -> PassResult:
        from torch._inductor.fx_passes.post_grad import decompose_auto_functionalized
        from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops_core

        graph = gm.graph
        nodes = _auto_functionalized_nodes(graph)
        if not nodes:
            return PassResult.unchanged()
        reinplace_inplaceable_ops_core(graph)
        clones: list[int] = []
        for node in nodes:
            # Inductor records which mutated args still need a copy; the rest are in place
            only = node.meta.get("only_clone_these_tensors", node.meta.get("only_clone_these_bases"))
            clones.append(len(only) if only is not None else -1)
        decompose_auto_functionalized(graph)
        inplace = sum(1 for c in clones if c == 0)
        return PassResult(
            modified=True,
            matches=inplace,
            notes=[f"{len(nodes)} functionalized call(s), {inplace} fully in place"],
        )
