"""Passes and plugins used by the core tests (registered in-process, or by name in a
subprocess through ``register_all``)."""

from __future__ import annotations

import pydantic
import torch

import passkit

aten = torch.ops.aten


class ScaleOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    factor: float = 2.0
    limit: int = 10


class MulToScale(passkit.GraphPass):
    """Rewrite ``x * 3.0`` into ``x * factor`` (a visible, option-dependent rewrite)."""

    name = "mul_to_scale"
    Options = ScaleOptions

    def run(self, gm, ctx):
        n = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor)):
            if len(node.args) == 2 and node.args[1] == 3.0 and n < self.options.limit:
                node.update_arg(1, self.options.factor)
                n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


class HalfwayThenFail(passkit.GraphPass):
    """Rewrites part of the graph, then raises: the pipeline must roll it back."""

    name = "halfway_then_fail"

    def run(self, gm, ctx):
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is aten.relu.default:
                with gm.graph.inserting_after(node):
                    extra = gm.graph.call_function(aten.neg.default, (node,))
                node.replace_all_uses_with(extra, delete_user_cb=lambda u, keep=extra: u is not keep)
                break
        raise RuntimeError("boom in the middle of a rewrite")


class First(passkit.GraphPass):
    name = "first"
    before = ("second",)

    def run(self, gm, ctx):
        return passkit.PassResult.unchanged()


class Second(passkit.GraphPass):
    name = "second"

    def run(self, gm, ctx):
        return passkit.PassResult.unchanged()


class PrePass(passkit.GraphPass):
    name = "pre_pass"
    stage = passkit.Stage.PRE

    def run(self, gm, ctx):
        return passkit.PassResult.unchanged("pre stage ran")


class NeedsCuda(passkit.GraphPass):
    name = "needs_cuda"
    requires = passkit.Requirements(cuda=True)

    def run(self, gm, ctx):  # pragma: no cover - skipped on CPU
        raise AssertionError("must be skipped")


class BadMeta(passkit.GraphPass):
    """Inserts a node whose recorded meta is wrong (verify must catch it)."""

    name = "bad_meta"

    def run(self, gm, ctx):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is aten.relu.default:
                node.meta["val"] = node.meta["val"].new_empty((1, 2, 3))
                return passkit.PassResult(modified=True, matches=1)
        return passkit.PassResult.unchanged()


class TestPlugin:
    """An in-process plugin object providing the passes above."""

    @passkit.hookimpl
    def passkit_register_passes(self):
        return [MulToScale, HalfwayThenFail, First, Second, PrePass, NeedsCuda, BadMeta]


PLUGIN = TestPlugin()


def register_all() -> None:
    passkit.register(PLUGIN, name="core-test-passes")


def small_fn(x):
    return torch.relu(x * 3.0) + 1.0
