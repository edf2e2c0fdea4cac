"""``fold_double_neg``: a hand-written graph pass that rewrites ``neg(neg(x))`` into ``x``."""

import torch

import passkit

aten = torch.ops.aten


class FoldDoubleNeg(passkit.GraphPass):
    """Replace ``-(-x)`` by ``x``."""

    name = "fold_double_neg"

    def run(self, gm, ctx):
        graph = gm.graph
        output = graph.output_node()
        folded = 0
        for outer in graph.find_nodes(op="call_function", target=aten.neg.default):
            inner = outer.args[0]
            if not (isinstance(inner, torch.fx.Node) and inner.target is aten.neg.default):
                continue
            x = inner.args[0]
            if x.op == "placeholder" and outer in output.all_input_nodes:
                continue  # never return an input itself as an output
            outer.replace_all_uses_with(x)
            graph.erase_node(outer)
            if not inner.users:
                graph.erase_node(inner)
            folded += 1
        return passkit.PassResult(modified=folded > 0, matches=folded)


class FoldDoubleNegJoint(FoldDoubleNeg):
    """``fold_double_neg`` at the joint stage: on the forward+backward graph before it is
    partitioned, so the backward's ``neg(neg(grad))`` goes with the forward's, and the
    partitioner saves nothing for it. Under ``passkit.backend`` only (hosts run the
    post-grad stages)."""

    name = "fold_double_neg_joint"
    stage = passkit.Stage.JOINT
