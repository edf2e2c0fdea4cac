"""The built-in passes on real compiled modules: op counts and numerics."""

from __future__ import annotations

import pytest
import torch

import passkit

aten = torch.ops.aten


class Capture:
    """A plugin recording the graph code before and after each pass."""

    def __init__(self):
        self.before, self.after = {}, {}

    @passkit.hookimpl
    def passkit_before_pass(self, pass_, gm, context):
        self.before[pass_.name] = gm.graph.python_code("self").src

    @passkit.hookimpl
    def passkit_after_pass(self, pass_, gm, result, record):
        self.after[pass_.name] = gm.graph.python_code("self").src


@pytest.fixture
def capture():
    cap = Capture()
    passkit.register(cap)
    return cap


def count(code, op):
    return code.count(f"torch.ops.aten.{op}(")


@pytest.mark.parametrize("mode", ["eager", "inductor"])
def test_noop_elimination_removes_noops_and_chains(capture, mode):
    def f(x, w):
        y = (x @ w).view(4, 8).reshape(2, 2, 8).reshape(4, 8)  # same-shape view + a chain
        return torch.relu(y.expand(4, 8)) * 2

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    b = passkit.backend(passes=["noop_elimination", "cleanup"], mode=mode, verify=True)
    out = torch.compile(f, backend=b)(x, w)
    torch.testing.assert_close(out, f(x, w))
    rec = b.last_report["noop_elimination"]
    if mode == "eager":  # Inductor's own noop removal runs before post passes
        before, after = capture.before["noop_elimination"], capture.after["noop_elimination"]
        assert count(before, "view.default") == 3 and count(after, "view.default") == 0
        assert rec.matches >= 3 and rec.nodes_after < rec.nodes_before
    assert rec.status == "ran"


def test_noop_elimination_removes_full_slices():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        full = aten.slice.Tensor(x, 1, 0, 9223372036854775807)
        part = aten.slice.Tensor(x, 1, 1, 3)
        return aten.relu.default(full) + part.sum()

    x = torch.randn(4, 8)
    gm = make_fx(f, tracing_mode="fake")(x)
    report = passkit.build_pipeline(passes=["noop_elimination"], verify=True).run(gm)
    code = gm.graph.python_code("self").src
    assert count(code, "slice.Tensor") == 1 and report["noop_elimination"].matches == 1
    torch.testing.assert_close(gm(x), f(x))


def test_noop_elimination_keeps_real_reshapes_and_strided_views(capture):
    def f(x):
        t = x.t()  # non-contiguous: view(view(t)) must not be collapsed onto t
        return t.reshape(32).view(4, 8) + x.reshape(8, 4)[:, 1:3].sum()

    x = torch.randn(4, 8)
    b = passkit.backend(passes=["noop_elimination"], mode="eager", verify=True)
    torch.testing.assert_close(torch.compile(f, backend=b)(x), f(x))
    after = capture.after.get("noop_elimination", capture.before["noop_elimination"])
    assert count(after, "slice.Tensor") == 1  # a partial slice stays


def test_noop_elimination_does_not_alias_input_to_output():
    def f(x):
        return x.view(2, 4), x * 2

    b = passkit.backend(passes=["noop_elimination"], mode="eager", verify=True)
    a, _ = torch.compile(f, backend=b)(torch.randn(2, 4))
    assert a.shape == (2, 4)


def test_cleanup_removes_dead_code_and_sorts(capture):
    class Dead(passkit.GraphPass):
        """Leaves a dead node behind and appends a node out of order."""

        name = "leave_dead"

        def run(self, gm, ctx):
            relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
            with gm.graph.inserting_after(relu):
                gm.graph.call_function(aten.neg.default, (relu,))
            return passkit.PassResult(modified=True, matches=1)

    class P:
        @passkit.hookimpl
        def passkit_register_passes(self):
            return [Dead]

    passkit.register(P())
    b = passkit.backend(passes=["leave_dead", "cleanup"], mode="eager")
    x = torch.randn(8)
    torch.testing.assert_close(torch.compile(lambda t: torch.relu(t) + 1, backend=b)(x), torch.relu(x) + 1)
    rec = b.last_report["cleanup"]
    assert rec.matches == 1 and rec.nodes_after == rec.nodes_before - 1
    assert "neg" not in capture.after["cleanup"]


# a mutating custom op, as a fusion pass would insert: out = x * scale, written in place
@torch.library.custom_op("passkit_test::scale_into", mutates_args=("out",))
def scale_into(x: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    out.copy_(x * scale)


@scale_into.register_fake
def _(x, out, scale):
    return None


def test_reinplace_removes_the_copy_of_functionalized_mutation(capture):
    def f(x):
        buf = torch.empty_like(x)
        torch.ops.passkit_test.scale_into(x, buf, 3.0)
        return buf + 1

    b = passkit.backend(passes=["reinplace"], mode="eager", verify=False)
    x = torch.randn(16)
    torch.testing.assert_close(torch.compile(f, backend=b)(x), x * 3.0 + 1)
    before, after = capture.before["reinplace"], capture.after["reinplace"]
    assert "auto_functionalized" in before and "auto_functionalized" not in after
    assert "torch.ops.passkit_test.scale_into.default(" in after
    assert "clone" not in after  # the buffer is written in place, no copy
    assert b.last_report["reinplace"].matches == 1


def test_reinplace_keeps_the_copy_when_the_buffer_is_read_later(capture):
    def f(x):
        buf = torch.ones_like(x)
        torch.ops.passkit_test.scale_into(x, buf, 3.0)
        return buf + 1

    def g(x):  # an input is mutated: the caller observes it, so no silent in-place
        torch.ops.passkit_test.scale_into(x * 2, x, 3.0)
        return x + 1

    b = passkit.backend(passes=["reinplace"], mode="eager")
    x = torch.randn(16)
    torch.testing.assert_close(torch.compile(f, backend=b)(x), x * 3.0 + 1)
    xin = torch.randn(16)
    expect = xin * 6.0
    torch.testing.assert_close(torch.compile(g, backend=b)(xin), expect + 1)
    torch.testing.assert_close(xin, expect)


def test_reinplace_is_a_noop_without_functionalized_ops():
    b = passkit.backend(passes=["reinplace"], mode="eager")
    torch.compile(lambda t: t + 1, backend=b)(torch.randn(4))
    rec = b.last_report["reinplace"]
    assert rec.status == "ran" and rec.matches == 0 and not rec.modified
