"""Counting ``sequence_parallel``'s reduce-scatters: a group's first one is the plan-checked
``passkit_fusion.agreed_reduce_scatter`` (the ranks agree on the plan before it), the others
plain ``_c10d_functional.reduce_scatter_tensor``."""

from __future__ import annotations

import torch

REDUCE_SCATTER = "_c10d_functional.reduce_scatter_tensor.default"
AGREED_RS = "passkit_fusion.agreed_reduce_scatter.default"


def reduce_scatters(gm: torch.fx.GraphModule) -> int:
    """The graph's reduce-scatters, checking that the first one (the graph's first rewritten
    collective; one group in these graphs) is ``agreed_reduce_scatter`` and the others plain."""
    from passkit_fusion.sequence_parallel import ops

    agreed, plain = ops.agreed_reduce_scatter_op(), torch.ops._c10d_functional.reduce_scatter_tensor.default
    found = [n.target for n in gm.graph.nodes if n.target in (agreed, plain)]
    assert found[:1] in ([], [agreed]) and agreed not in found[1:], found
    return len(found)
