"""``cleanup``: dead-code elimination and a stable topological order after rewrites."""

from __future__ import annotations

import torch.fx

from ..context import CompileContext
from ..pass_base import GraphPass, PassResult


class Cleanup(GraphPass):
    """Remove nodes whose results nobody uses (side-effect-free ones only), then sort the
    graph topologically, keeping the existing order wherever it is already valid."""

    name = "cleanup"

    def run(self, gm: torch.fx.GraphModule, ctx: CompileContext) -> PassResult:
        from torch._inductor.pattern_matcher import stable_topological_sort

        graph = gm.graph
        count = len(graph.nodes)
        graph.eliminate_dead_code()
        removed = count - len(graph.nodes)
        order = list(graph.nodes)
        stable_topological_sort(graph)
        reordered = list(graph.nodes) != order
        notes = [f"removed {removed} dead node(s)"] if removed else []
        if reordered:
            notes.append("reordered nodes topologically")
        return PassResult(modified=bool(removed or reordered), matches=removed, notes=notes)
