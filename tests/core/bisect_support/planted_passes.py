"""A third-party plugin with planted bugs, for the bisect tests (installed by them into a
throw-away site folder with an entry point: never imported from the test tree).

Each pass rewrites every site it finds and is wrong at one of them (``PLANTED``: the tests
turn it off to check that a reproducer then passes).
"""

import operator

import pydantic
import torch

import passkit

aten = torch.ops.aten
PLANTED = True


class WrongSite(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)
    wrong_site: int = 5
    """The site (0-based, graph order) the pass gets wrong."""


class WrongScale(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)
    wrong_scale: float = 6.5
    """The scale whose site the pattern's replacement gets wrong."""


class PlantedPattern(passkit.PatternPass):
    """relu(x) * c -> clamp_min(x, 0) * c: off by one at the site of scale ``wrong_scale``."""

    name = "planted_pattern"
    Options = WrongScale

    def patterns(self):
        wrong = self.options.wrong_scale

        def search(x, c):
            return aten.mul.Tensor(aten.relu.default(x), c)

        def replace(x, c):
            out = aten.mul.Tensor(aten.clamp_min.default(x, 0.0), c)
            return out + 1.0 if PLANTED and c == wrong else out

        return [passkit.Pattern(search, replace, [torch.empty(8)], scalars={"c": 1.2345}, name="relu_scale")]


def _negated(graph, pass_):
    """The aten.neg nodes of ``graph``, in graph order."""
    return list(graph.find_nodes(op="call_function", target=aten.neg.default))


class PlantedGraph(passkit.GraphPass):
    """neg(x) -> x * -1 at every site, the counter asked first; x * 1 at ``wrong_site``."""

    name = "planted_graph"
    Options = WrongSite

    def run(self, gm, ctx):
        n = 0
        for i, node in enumerate(_negated(gm.graph, self)):
            if not ctx.may_rewrite(f"neg {node.name}"):
                continue
            scale = 1.0 if PLANTED and i == self.options.wrong_site else -1.0
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(aten.mul.Tensor, (node.args[0], scale))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


def not_an_op(x):
    """A plain Python function: runs eagerly, but Inductor has no lowering for it."""
    return operator.neg(x)


class PlantedCrash(passkit.GraphPass):
    """neg(x) -> neg(x) again (a no-op rewrite), and at ``wrong_site`` a call Inductor rejects."""

    name = "planted_crash"
    Options = WrongSite

    def run(self, gm, ctx):
        n = 0
        for i, node in enumerate(_negated(gm.graph, self)):
            if not ctx.may_rewrite(f"neg {node.name}"):
                continue
            target = not_an_op if PLANTED and i == self.options.wrong_site else aten.neg.default
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(target, (node.args[0],))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


class PlantedGrad(passkit.GraphPass):
    """On backward graphs: mul(a, c) -> div(a, 1 / c), and 1.5 times that at ``wrong_site``."""

    name = "planted_grad"
    Options = WrongSite
    graph_kinds = ("backward",)

    def run(self, gm, ctx):
        n = 0
        muls = [
            m
            for m in gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor)
            if isinstance(m.args[1], float)
        ]
        for i, node in enumerate(muls):
            if not ctx.may_rewrite(f"mul {node.name}"):
                continue
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(aten.div.Tensor, (node.args[0], 1.0 / node.args[1]))
                if PLANTED and i == self.options.wrong_site:
                    new = gm.graph.call_function(aten.mul.Tensor, (new, 1.5))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


class WholeGraph(passkit.GraphPass):
    """Never asks the counter: doubles the graph's first output (counted once per run)."""

    name = "planted_whole"

    def run(self, gm, ctx):
        out = next(iter(gm.graph.find_nodes(op="output")))
        first = out.args[0][0]
        with gm.graph.inserting_before(out):
            doubled = gm.graph.call_function(aten.mul.Tensor, (first, 2.0))
        doubled.meta.update(first.meta)
        out.args = ((doubled, *out.args[0][1:]),)
        return passkit.PassResult(modified=True, matches=1)


class PlantedRaise(passkit.GraphPass):
    """Raises at ``wrong_site`` (after rewriting the sites before it)."""

    name = "planted_raise"
    Options = WrongSite

    def run(self, gm, ctx):
        for i, node in enumerate(_negated(gm.graph, self)):
            if PLANTED and i == self.options.wrong_site:
                raise RuntimeError(f"planted failure at {node.name}")
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(aten.mul.Tensor, (node.args[0], -1.0))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
        return passkit.PassResult(modified=True, matches=self.options.wrong_site)


class PlantedDetach(passkit.GraphPass):
    """Pre-grad: ``a * b`` of two tensors -> ``torch.mul(a, b)`` at every site, and
    ``torch.mul(a, b.detach())`` at ``wrong_site``: the forward is exact, ``b``'s gradient
    misses that site's part."""

    name = "planted_detach"
    stage = passkit.Stage.PRE_GRAD
    Options = WrongSite

    def run(self, gm, ctx):
        n = 0
        sites = [
            m
            for m in gm.graph.find_nodes(op="call_function", target=operator.mul)
            if all(isinstance(a, torch.fx.Node) for a in m.args)
        ]
        for i, node in enumerate(sites):
            if not ctx.may_rewrite(f"mul {node.name}"):
                continue
            a, b = node.args
            with gm.graph.inserting_before(node):
                if PLANTED and i == self.options.wrong_site:
                    b = gm.graph.call_method("detach", (b,))
                    b.meta.update(node.args[1].meta)
                new = gm.graph.call_function(torch.mul, (a, b))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


def _from_tangents(graph):
    """The nodes of a joint graph computed from a tangent (its backward half)."""
    found = set(n for n in graph.find_nodes(op="placeholder") if n.name.startswith("tangents"))
    for node in graph.nodes:
        if any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


class PlantedJoint(passkit.GraphPass):
    """Joint: mul(a, c) -> div(a, 1 / c) at every site, forward and backward; 1.5 times that at
    the ``wrong_site``-th site of the backward half: the forward is exact, a gradient is off."""

    name = "planted_joint"
    stage = passkit.Stage.JOINT
    Options = WrongSite

    def run(self, gm, ctx):
        backward = _from_tangents(gm.graph)
        n, seen = 0, 0
        muls = [
            m
            for m in gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor)
            if isinstance(m.args[1], float)
        ]
        for node in muls:
            wrong = False
            if node in backward:
                wrong = PLANTED and seen == self.options.wrong_site
                seen += 1
            if not ctx.may_rewrite(f"mul {node.name}"):
                continue
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(aten.div.Tensor, (node.args[0], 1.0 / node.args[1]))
                if wrong:
                    new = gm.graph.call_function(aten.mul.Tensor, (new, 1.5))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


class RequiredNeg(PlantedGraph):
    """``planted_graph``'s rewrite, declared required: bisect never refuses it."""

    name = "planted_required"
    required = True


@passkit.hookimpl
def passkit_register_passes():
    return [
        PlantedPattern,
        PlantedGraph,
        PlantedCrash,
        PlantedGrad,
        WholeGraph,
        PlantedRaise,
        PlantedDetach,
        PlantedJoint,
        RequiredNeg,
    ]
