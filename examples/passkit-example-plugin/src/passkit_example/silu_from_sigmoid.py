"""``silu_from_sigmoid``: a pre-grad pass that rewrites ``x * torch.sigmoid(x)`` into
``F.silu(x)`` on Dynamo's torch-level graph, before AOTAutograd.

At this stage the graph holds what the model's Python called (``torch.sigmoid``,
``operator.mul``, ``Tensor.sigmoid`` methods), not ATen ops: a module-level pattern is still
visible as written. The rewrite happens before autograd, so the backward graph is that of
``silu`` too, and it works under any compiler passkit's backend hands the graph to.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

import passkit

_MULS = (operator.mul, torch.mul, "mul")
_SIGMOIDS = (torch.sigmoid, torch.nn.functional.sigmoid, "sigmoid")


def _is(node: object, targets: tuple[object, ...]) -> bool:
    """A ``call_function`` of one of ``targets``, or a ``call_method`` named in them."""
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_function":
        return node.target in targets
    return node.op == "call_method" and node.target in targets


def _sigmoid_of(node: object, x: object) -> bool:
    return _is(node, _SIGMOIDS) and len(node.args) == 1 and node.args[0] is x and not node.kwargs  # type: ignore[union-attr]


class SiluFromSigmoid(passkit.GraphPass):
    """Replace ``x * torch.sigmoid(x)`` (either order, function or method) by ``F.silu(x)``."""

    name = "silu_from_sigmoid"
    stage = passkit.Stage.PRE_GRAD

    def run(self, gm, ctx):
        graph = gm.graph
        rewritten = 0
        for node in list(graph.nodes):
            if not _is(node, _MULS) or len(node.args) != 2 or node.kwargs:
                continue
            a, b = node.args
            if _sigmoid_of(b, a):
                x, sig = a, b
            elif _sigmoid_of(a, b):
                x, sig = b, a
            else:
                continue
            with graph.inserting_before(node):
                silu = graph.call_function(F.silu, (x,))
            silu.meta.update(node.meta)  # Dynamo's example value: the same shape and dtype
            node.replace_all_uses_with(silu)
            graph.erase_node(node)
            if not sig.users:
                graph.erase_node(sig)
            rewritten += 1
        return passkit.PassResult(modified=rewritten > 0, matches=rewritten)
