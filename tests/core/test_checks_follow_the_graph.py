"""Issue 45: the checks after every pass follow the graph a pass leaves, whatever it did.

Each case failed silently on c84528f (the compile ran, the report said ``ran``, the caller got
a wrong result): a pass that installs a new graph object (``gm.graph = new``), a pre-grad
pass that inserts a method call (``x.narrow(...)``), a joint pass that changes gradients
(``verify = "numeric"``), a pre-grad pass that writes to the caller's input. Now each is
failed, named, the graph restored, and the caller gets what eager computes.
"""

from __future__ import annotations

import pytest
import torch

import passkit
from passkit import Stage

aten = torch.ops.aten

COMPILERS = ["inductor", "aot_eager"]


@pytest.fixture(autouse=True)
def _env(clean_env):
    return clean_env


def fn(x):
    return torch.relu(x * 3.0) + 1.0


def _val_key(node: torch.fx.Node) -> str:
    return "val" if "val" in node.meta else "example_value"


def _output(graph: torch.fx.Graph) -> torch.fx.Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def _first_output(graph: torch.fx.Graph):
    out = _output(graph)
    flat = out.args[0]
    return out, (flat[0] if isinstance(flat, (list, tuple)) else flat)


def _replace_output(out: torch.fx.Node, old: torch.fx.Node, new: torch.fx.Node) -> None:
    out.args = torch.fx.node.map_arg(out.args, lambda n: new if n is old else n)


class _Swap(passkit.GraphPass):
    """Installs a new graph (``gm.graph = new``): a copy whose first output is sliced to 4
    rows (the slice's recorded value honest: [4, ...])."""

    then_raise = False

    def run(self, gm, ctx):
        new = torch.fx.Graph()
        out = new.graph_copy(gm.graph, {})
        flat = list(out) if isinstance(out, (list, tuple)) else [out]
        key = _val_key(flat[0])
        sl = new.call_function(aten.slice.Tensor, (flat[0], 0, 0, 4))
        sl.meta[key] = flat[0].meta[key][0:4]
        flat[0] = sl
        new.output(tuple(flat) if isinstance(out, (list, tuple)) else sl)
        gm.graph = new
        if self.then_raise:
            raise RuntimeError("gave up after the swap")
        return passkit.PassResult(modified=True, matches=1)


class SwapPost(_Swap):
    name = "swap_post"


class SwapPostThenRaise(_Swap):
    name = "swap_post_then_raise"
    then_raise = True


class SwapPreGrad(_Swap):
    name = "swap_pre_grad"
    stage = Stage.PRE_GRAD


class SwapPreGradThenRaise(_Swap):
    name = "swap_pre_grad_then_raise"
    stage = Stage.PRE_GRAD
    then_raise = True


class _MethodAtOutput(passkit.GraphPass):
    """Pre-grad: the first output goes through a tensor method inserted as a ``call_method``
    node, its recorded value copied from the old output (a lie the check must not trust)."""

    stage = Stage.PRE_GRAD
    method: tuple = ()

    def run(self, gm, ctx):
        out, last = _first_output(gm.graph)
        with gm.graph.inserting_before(out):
            new = gm.graph.call_method(self.method[0], (last, *self.method[1:]))
        new.meta = dict(last.meta)
        _replace_output(out, last, new)
        return passkit.PassResult(modified=True, matches=1)


class NarrowMethod(_MethodAtOutput):
    name = "narrow_method"
    method = ("narrow", 0, 0, 4)


class HalfMethod(_MethodAtOutput):
    name = "half_method"
    method = ("to", torch.float16)


class MutatesInput(passkit.GraphPass):
    """Pre-grad: ``x.add_(100)`` on the caller's input, after its last use (the output is
    unchanged)."""

    name = "mutates_input"
    stage = Stage.PRE_GRAD

    def run(self, gm, ctx):
        x = next(n for n in gm.graph.nodes if n.op == "placeholder")
        out = _output(gm.graph)
        with gm.graph.inserting_before(out):
            node = gm.graph.call_method("add_", (x, 100))
        node.meta["example_value"] = x.meta["example_value"]  # honest: lint and fake runs agree
        return passkit.PassResult(modified=True, matches=1)


class MutatesInputPost(passkit.GraphPass):
    """Post-grad: ``aten.add_(x, 100)`` on the graph's input, after its last use."""

    name = "mutates_input_post"

    def run(self, gm, ctx):
        x = next(n for n in gm.graph.nodes if n.op == "placeholder")
        out = _output(gm.graph)
        with gm.graph.inserting_before(out):
            node = gm.graph.call_function(aten.add_.Tensor, (x, 100))
        node.meta["val"] = x.meta.get("val")
        return passkit.PassResult(modified=True, matches=1)


class _JointGradient(passkit.GraphPass):
    """Joint: changes a gradient only (shapes and dtypes all as before)."""

    stage = Stage.JOINT

    def rewrite(self, gm):
        raise NotImplementedError

    def run(self, gm, ctx):
        if ctx.graph_kind != "joint":
            return passkit.PassResult.unchanged()
        return passkit.PassResult(modified=True, matches=self.rewrite(gm))


class ScaleTangent(_JointGradient):
    """Every use of the first tangent reads ``2 * tangent`` instead."""

    name = "scale_tangent"

    def rewrite(self, gm):
        tangent = next(n for n in gm.graph.nodes if n.op == "placeholder" and "tangent" in n.name)
        with gm.graph.inserting_after(tangent):
            doubled = gm.graph.call_function(aten.mul.Tensor, (tangent, 2.0))
        doubled.meta["val"] = tangent.meta["val"]
        tangent.replace_all_uses_with(doubled, delete_user_cb=lambda u: u is not doubled)
        return 1


class ScaleGradOutput(_JointGradient):
    """The last gradient the joint graph returns, scaled by 3."""

    name = "scale_grad_output"

    def rewrite(self, gm):
        out = _output(gm.graph)
        flat = torch.utils._pytree.tree_leaves(out.args[0])  # forward outputs, then gradients
        grad = [g for g in flat if isinstance(g, torch.fx.Node)][-1]
        with gm.graph.inserting_before(out):
            scaled = gm.graph.call_function(aten.mul.Tensor, (grad, 3.0))
        scaled.meta["val"] = grad.meta["val"]
        _replace_output(out, grad, scaled)
        return 1


PASSES = [
    SwapPost,
    SwapPostThenRaise,
    SwapPreGrad,
    SwapPreGradThenRaise,
    NarrowMethod,
    HalfMethod,
    MutatesInput,
    MutatesInputPost,
    ScaleTangent,
    ScaleGradOutput,
]


class Plugin:
    @passkit.hookimpl
    def passkit_register_passes(self):
        return list(PASSES)


def compiled(name, compiler, fn=fn, **config):
    passkit.register(Plugin(), name="issue45-passes")
    backend = passkit.backend(passes=[name], compiler=compiler, **config)
    return torch.compile(fn, backend=backend), backend


def _records(backend, name):
    return [r[name] for r in backend.reports if name in r]


# -- 1. a pass that installs a new graph -----------------------------------------------------


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("name", ["swap_post", "swap_pre_grad", "swap_post_then_raise", "swap_pre_grad_then_raise"])
@pytest.mark.parametrize("verify", [False, "numeric"])
def test_a_pass_that_installs_a_new_graph_is_checked_and_restored(name, compiler, verify):
    x = torch.randn(8, 16)
    f, backend = compiled(name, compiler, verify=verify)
    out = f(x)
    assert out.shape == (8, 16)
    torch.testing.assert_close(out, fn(x))
    (record,) = _records(backend, name)
    assert record.status == "failed", record
    if name.endswith("then_raise"):
        assert "gave up after the swap" in record.reason
    else:
        assert f"after pass {name!r}: output 0" in record.reason, record.reason
        assert "[4, 16]" in record.reason and "[8, 16]" in record.reason


def test_a_swapped_graph_that_keeps_the_outputs_runs_and_later_passes_see_it():
    """A swap that computes the same thing is no failure; the next pass rewrites the new graph."""
    from .support import MulToScale

    class CopySwap(passkit.GraphPass):
        name = "copy_swap"

        def run(self, gm, ctx):
            new = torch.fx.Graph()
            new.output(new.graph_copy(gm.graph, {}))
            gm.graph = new
            return passkit.PassResult(modified=True)

    class P:
        @passkit.hookimpl
        def passkit_register_passes(self):
            return [CopySwap, MulToScale]

    passkit.register(P(), name="copy-swap")
    backend = passkit.backend(passes=["copy_swap", "mul_to_scale"])
    x = torch.randn(8, 16)
    torch.testing.assert_close(torch.compile(fn, backend=backend)(x), torch.relu(x * 2.0) + 1.0)
    report = backend.reports[-1]
    assert report["copy_swap"].status == "ran" and report["mul_to_scale"].matches == 1


# -- 2. method nodes at the pre-grad stage -----------------------------------------------------


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("name", ["narrow_method", "half_method"])
@pytest.mark.parametrize("training", [False, True])
def test_a_method_node_that_changes_an_output_is_caught_with_verify_off(name, compiler, training):
    x = torch.randn(8, 16, requires_grad=training)
    f, backend = compiled(name, compiler, verify=False)
    out = f(x)
    assert out.shape == (8, 16) and out.dtype == torch.float32
    torch.testing.assert_close(out, fn(x))
    (record,) = _records(backend, name)
    assert record.status == "failed", record
    assert f"after pass {name!r}: output 0" in record.reason, record.reason


# -- 3. joint passes that change gradients -------------------------------------------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))


def _grads(f, model, x):
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad()
    out = f(x)
    out.sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("name", ["scale_tangent", "scale_grad_output"])
def test_numeric_verify_compares_the_gradients_of_a_joint_graph(name, compiler):
    """A module with parameters: AOTAutograd's joint graph takes ``(primals, tangents)``."""
    x = torch.randn(8, 16)
    model = _model()
    f, backend = compiled(name, compiler, fn=model, verify="numeric")
    out, grad, params = _grads(f, model, x)
    want_out, want_grad, want_params = _grads(model, model, x)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(grad, want_grad)
    torch.testing.assert_close(params, want_params)
    (record,) = [r for r in _records(backend, name) if r.status != "skipped" or r.matches]
    assert record.status == "failed", record
    assert f"after pass {name!r}: output" in record.reason and "numeric" in record.reason, record.reason


def test_numeric_verify_says_when_it_could_not_run_a_graph():
    """A graph it cannot run here (an input without a recorded value): a note, not silence."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from passkit._pipeline.build import Pipeline
    from passkit._plugins.registry import PluginInfo, PluginSet, instantiate
    from passkit.config import load_config

    from .support import PLUGIN

    with torch.no_grad():
        gm = make_fx(fn, tracing_mode="fake")(torch.randn(8, 4))
    for node in gm.graph.find_nodes(op="placeholder"):
        node.meta.pop("val")
    plugins = PluginSet()
    plugins.load_entry_points(autoload=False)
    plugins.add(PLUGIN, PluginInfo("core-test-passes", None, None, "tests"))
    cfg = load_config(passes=["mul_to_scale"], verify="numeric", environ={})
    record = Pipeline(cfg, plugins, instantiate(cfg, plugins)).run(gm)["mul_to_scale"]
    assert record.status == "ran"
    assert any(n.startswith("numeric: not run: ") for n in record.notes), record.notes


# -- 4. a pass that writes to the caller's input ---------------------------------------------------


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("verify", [False, "numeric"])
@pytest.mark.parametrize("training", [False, True])
def test_a_pre_grad_pass_that_mutates_an_input_fails_named(compiler, verify, training):
    x = torch.randn(8, 16)
    kept = x.clone()
    f, backend = compiled("mutates_input", compiler, verify=verify)
    arg = x.requires_grad_(True) if training else x
    out = f(arg)
    torch.testing.assert_close(out, fn(kept))
    torch.testing.assert_close(x.detach(), kept)  # the caller's input is untouched
    (record,) = _records(backend, "mutates_input")
    assert record.status == "failed", record
    assert "after pass 'mutates_input'" in record.reason and "input" in record.reason, record.reason


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_post_grad_pass_that_mutates_an_input_fails_named(compiler):
    x = torch.randn(8, 16)
    kept = x.clone()
    f, backend = compiled("mutates_input_post", compiler)
    with torch.no_grad():
        torch.testing.assert_close(f(x), fn(kept))
    torch.testing.assert_close(x, kept)
    (record,) = _records(backend, "mutates_input_post")
    assert record.status == "failed" and "input" in record.reason, record


class CopySwapPreGrad(passkit.GraphPass):
    """Pre-grad: installs a plain copy of Dynamo's graph (``graph_copy`` keeps no node
    attributes: Dynamo's ``_dynamo_source``, which AOTAutograd asserts, is lost)."""

    name = "copy_swap_pre_grad"
    stage = Stage.PRE_GRAD

    def run(self, gm, ctx):
        new = torch.fx.Graph()
        new.output(new.graph_copy(gm.graph, {}))
        gm.graph = new
        return passkit.PassResult(modified=True)


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("training", [False, True])
def test_a_pre_grad_swap_keeps_dynamos_node_attributes(compiler, training):
    class P:
        @passkit.hookimpl
        def passkit_register_passes(self):
            return [CopySwapPreGrad]

    passkit.register(P(), name="copy-swap-pre-grad")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=training)
    backend = passkit.backend(passes=["copy_swap_pre_grad"], compiler=compiler)
    torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x))
    record = next(r["copy_swap_pre_grad"] for r in backend.reports if "copy_swap_pre_grad" in r)
    assert record.status == "ran", record
