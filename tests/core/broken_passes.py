"""Passes that leave graphs Inductor cannot compile, and a generator of such rewrites (used by
test_inductor_failures and test_fuzz)."""

from __future__ import annotations

import random

import pydantic
import torch

import passkit

aten = torch.ops.aten


class ReluTwice(passkit.GraphPass):
    """Rewrites ``relu(x)`` into ``relu(x, x)`` (issue 27): no schema accepts it."""

    name = "relu_twice"

    def run(self, gm, ctx):
        n = 0
        for node in gm.graph.find_nodes(op="call_function", target=aten.relu.default):
            node.args = (node.args[0], node.args[0])
            n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


class ToHalfAfterRelu(passkit.GraphPass):
    """Inserts ``_to_copy(relu, dtype=float16)`` after each relu, and a copy back to float32
    (issue 27): the schema binds and the outputs keep their dtype (the checks after the pass
    pass), but Inductor rejects the op ("both a fallback and a decomp for same op")."""

    name = "to_half_after_relu"

    def run(self, gm, ctx):
        n = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=aten.relu.default)):
            with gm.graph.inserting_after(node):
                copy = gm.graph.call_function(aten._to_copy.default, (node,), {"dtype": torch.float16})
            with gm.graph.inserting_after(copy):  # and back: the graph's outputs keep their dtype
                back = gm.graph.call_function(aten._to_copy.default, (copy,), {"dtype": torch.float32})
            node.replace_all_uses_with(back, delete_user_cb=lambda user, c=copy: user is not c)
            n += 1
        return passkit.PassResult(modified=n > 0, matches=n, notes=[f"{n} relu(s) cast to float16"])


INVALID_KINDS = ("extra_arg", "missing_arg", "bad_kwarg", "non_tensor", "wrong_target", "half_copy")
"""How :func:`invalid_rewrite` breaks a graph; every kind but ``half_copy`` breaks an op's
schema (the structural check catches it), ``half_copy`` only Inductor rejects."""
CAUGHT_BY_SCHEMA = frozenset(INVALID_KINDS) - {"half_copy"}


def invalid_rewrite(rng: random.Random, kind: str | None = None) -> tuple[str, type[passkit.Pass]]:
    """``(kind, a pass class)`` whose ``run`` breaks one call of ``relu`` / ``add`` / ``mul``
    of the graph in a way of ``kind`` (random by default), after changing nothing else."""
    kind = kind or rng.choice(INVALID_KINDS)
    targets = [aten.relu.default, aten.add.Tensor, aten.mul.Tensor]
    target = rng.choice(targets)
    junk = rng.choice([None, "x", [1, 2], {"a": 1}])
    bad_key = rng.choice(["alpah", "dim", "dtype_", "out"])
    wrong = rng.choice([aten.relu.default, aten.neg.default, aten.sigmoid.default, aten.where.self])

    class InvalidRewrite(passkit.GraphPass):
        name = f"invalid_{kind}"

        def run(self, gm, ctx):
            node = next(iter(gm.graph.find_nodes(op="call_function", target=target)), None)
            if node is None:
                return passkit.PassResult.unchanged()
            if kind == "extra_arg":
                node.args = (*node.args, node.args[0], 1.0)
            elif kind == "missing_arg":
                node.args = ()
            elif kind == "bad_kwarg":
                node.kwargs = {**node.kwargs, bad_key: 1}
            elif kind == "non_tensor":
                node.args = (junk, *node.args[1:])
            elif kind == "wrong_target":
                node.target = wrong if len(node.args) == 2 else aten.where.self
                if node.target is aten.where.self:
                    node.args = node.args[:1]
            else:  # half_copy
                with gm.graph.inserting_after(node):
                    copy = gm.graph.call_function(aten._to_copy.default, (node,), {"dtype": torch.float16})
                with gm.graph.inserting_after(copy):  # and back: every dtype the graph had stays
                    back = gm.graph.call_function(aten._to_copy.default, (copy,), {"dtype": torch.float32})
                node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not copy)
            return passkit.PassResult(modified=True, matches=1)

    InvalidRewrite.__qualname__ = f"InvalidRewrite[{kind}, {target}]"
    return kind, InvalidRewrite


class RaisingOptions(pydantic.BaseModel):
    """An options model whose validator raises ``RuntimeError`` (not ``ValueError``)."""

    k: int = 1

    @pydantic.field_validator("k")
    @classmethod
    def _check(cls, value: int) -> int:
        if value > 2:
            raise RuntimeError(f"k={value} crashes the validator")
        return value


class RaisingOptionsPass(passkit.GraphPass):
    name = "raising_options"
    Options = RaisingOptions

    def run(self, gm, ctx):
        return passkit.PassResult.unchanged()


class RaisingTokenConstraint(passkit.GraphPass):
    name = "raising_token_constraint"

    def token_constraint(self, ctx):
        raise RuntimeError("token_constraint crashed")

    def run(self, gm, ctx):  # pragma: no cover - must not run
        raise AssertionError("a pass whose token_constraint raised must not run")


class RaisingSkipReason(passkit.GraphPass):
    name = "raising_skip_reason"

    def skip_reason(self, ctx):
        raise KeyError("skip_reason crashed")

    def run(self, gm, ctx):  # pragma: no cover - must not run
        raise AssertionError("a pass whose skip_reason raised must not run")


class RaisingDecisionSource(passkit.GraphPass):
    name = "raising_decision_source"

    def decision_source(self, ctx):
        raise ValueError("decision_source crashed")

    def run(self, gm, ctx):  # pragma: no cover - must not run
        raise AssertionError("a pass whose decision_source raised must not run")


class GarbageDecisionSource(passkit.GraphPass):
    name = "garbage_decision_source"

    def decision_source(self, ctx):
        return {"source": "stored"}

    def run(self, gm, ctx):  # pragma: no cover - must not run
        raise AssertionError("a pass whose decision_source returned garbage must not run")


class BrokenPlugin:
    """The passes above, as one in-process plugin."""

    @passkit.hookimpl
    def passkit_register_passes(self):
        return [
            ReluTwice,
            ToHalfAfterRelu,
            RaisingOptionsPass,
            RaisingTokenConstraint,
            RaisingSkipReason,
            RaisingDecisionSource,
            GarbageDecisionSource,
        ]


PLUGIN = BrokenPlugin()
