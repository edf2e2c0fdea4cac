"""``compile_at = "first_use"`` (the default): the graph's first call compiles the token
range it falls in, inside Dynamo's compile; each other range compiles at the first call that
lands in it, once, with its report; a guard such a late compile makes (one Dynamo can no
longer add) is checked per call, and a call that does not meet it compiles again."""

from __future__ import annotations

import pytest
import torch
import torch._guards
from torch._dynamo.utils import counters

import passkit
from passkit import PassResult, TokenConstraint

from .broken_passes import ToHalfAfterRelu
from .test_ranges import EvenTanh, Everywhere, SmallRelu, backend, compiled, expected

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("grad", [False, True], ids=["one trace", "a trace per range"])
def test_the_first_call_compiles_its_range_and_a_later_range_compiles_once(grad: bool):
    b = backend(SmallRelu(), EvenTanh(), Everywhere())
    f = compiled(b)
    counters.clear()
    with torch.set_grad_enabled(grad):
        x = torch.randn(3, 4)
        torch.testing.assert_close(f(x), expected(x))
        dispatcher = b.last_dispatcher
        assert dispatcher is not None and len(dispatcher.plan.specializations) == 4
        assert (dispatcher.compiled_count, dispatcher.late_compiles) == (1, 0)
        assert [r.token_range for r in b.reports] == ["tokens 1..16"]
        for n in (20, 25, 19, 3, 21):  # 20 lands in a new range, 25 in another
            x = torch.randn(n, 4)
            torch.testing.assert_close(f(x), expected(x), msg=f"{n} tokens")
    assert b.last_dispatcher is dispatcher  # no Dynamo recompile: the dispatcher compiled them
    assert (dispatcher.compiled_count, dispatcher.late_compiles) == (3, 2)
    assert [r.token_range for r in b.reports] == [
        "tokens 1..16",
        "tokens >= 17, multiples of 2",
        "tokens >= 17",
    ]
    assert all(r.compile_s is not None and r.compile_s > 0 for r in b.reports)
    assert counters["stats"]["unique_graphs"] == 1


def test_upfront_compiles_every_range_at_the_first_call():
    b = backend(SmallRelu(), EvenTanh(), Everywhere(), compile_at="upfront")
    f = compiled(b)
    with torch.no_grad():
        f(torch.randn(3, 4))
    assert b.last_dispatcher is not None
    assert (b.last_dispatcher.compiled_count, b.last_dispatcher.late_compiles) == (4, 0)
    assert len(b.reports) == 4


class LateBranch(passkit.GraphPass):
    """In ranges from 17 tokens only: cos -> sin when the token count is above 40, decided on
    the shape environment as Inductor's lowering decides (a guard on the token count)."""

    name = "late_branch"
    decided: list[bool] = []

    def run(self, gm, ctx):
        if ctx.token_range is None or ctx.token_range.lo < 17:
            return PassResult()
        x = next(
            n for n in gm.graph.find_nodes(op="placeholder") if isinstance(n.meta.get("val"), torch.Tensor)
        )
        size = x.meta["val"].shape[0]
        env = torch._guards.TracingContext.get().fake_mode.shape_env
        big = bool(env.evaluate_expr(size.node.expr > 40))
        LateBranch.decided.append(big)
        if not big:
            return PassResult()
        nodes = list(gm.graph.find_nodes(op="call_function", target=aten.cos.default))
        for node in nodes:
            node.target = aten.sin.default
        return PassResult(modified=bool(nodes), matches=len(nodes))


def _branch_expected(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    first = torch.sigmoid(x) if n <= 16 else torch.relu(x)
    return first + torch.tanh(x) * 2 + (torch.sin(x) if n > 40 else torch.cos(x))


@pytest.mark.parametrize("grad", [False, True], ids=["one trace", "a trace per range"])
def test_a_guard_made_by_a_late_compile_is_checked_per_call(grad: bool):
    LateBranch.decided = []
    b = backend(SmallRelu(), LateBranch())
    counters.clear()
    f = compiled(b)
    with torch.set_grad_enabled(grad):
        for n in (3, 20, 50, 30, 60, 17, 41, 40):
            x = torch.randn(n, 4)
            torch.testing.assert_close(f(x), _branch_expected(x), msg=f"{n} tokens")
    dispatcher = b.last_dispatcher
    assert dispatcher is not None
    # 20 compiled the range under "tokens <= 40", 50 compiled it again under "> 40"
    assert dispatcher.late_compiles == 2 and LateBranch.decided == [False, True]
    assert counters["stats"]["unique_graphs"] == 1  # Dynamo compiled the graph once
    assert sorted(r.token_range for r in b.reports) == ["tokens 1..16", "tokens >= 17", "tokens >= 17"]


class LateToHalf(ToHalfAfterRelu):
    """Breaks Inductor (see broken_passes), from 17 tokens only: in a range compiled late."""

    name = "late_to_half"
    tokens = TokenConstraint(min_tokens=17)


def test_an_inductor_failure_in_a_late_compile_is_isolated_and_named(caplog):
    b = backend(LateToHalf(), Everywhere())
    f = compiled(b)
    with torch.no_grad():
        for n in (3, 20, 30):
            x = torch.randn(n, 4)
            want = torch.relu(x) + torch.tanh(x) * 2 + torch.sin(x)
            torch.testing.assert_close(f(x), want, msg=f"{n} tokens")
    assert b.last_dispatcher is not None and b.last_dispatcher.late_compiles == 1
    late = [r for r in b.reports if r.token_range == "tokens >= 17"]
    assert len(late) == 1  # the failed attempt leaves no report
    record = late[0]["late_to_half"]
    assert record.status == "failed"
    assert record.reason.startswith("Inductor failed on the graph this pass changed")
    assert record.reason.endswith("compiled again without late_to_half")
    assert any(
        "'late_to_half'" in r.getMessage() for r in caplog.records if "Inductor failed" in r.getMessage()
    )


def test_compile_at_first_call_is_upfront():
    from passkit.config import load_config

    assert load_config({"compile_at": "first_call"}).compile_at == "upfront"
    assert load_config({}).compile_at == "first_use"


class SeesHints(passkit.GraphPass):
    """Records the token dimension's size hint each compile's graph carries (no rewrite)."""

    name = "sees_hints"
    seen: list[int] = []

    def run(self, gm, ctx):
        vals = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
        x = next(v for v in vals if isinstance(v, torch.Tensor) and v.dim() == 2)
        SeesHints.seen.append(x.shape[0].node.hint)
        return PassResult()


def _folded(x: torch.Tensor) -> torch.Tensor:
    # a view whose -1 is solved from the sizes: a late compile traced with the first call's
    # sizes as hints fails here ("integer modulo by zero") or decides wrongly
    return torch.relu(x).view(x.shape[0], 2, -1).sum(1)


@pytest.mark.parametrize(
    ("mode", "grad"),
    [("eager", False), ("inductor", True)],
    ids=["eager", "inductor, a trace per range"],
)
def test_a_late_compile_traces_with_the_call_sizes_as_hints(mode: str, grad: bool):
    SeesHints.seen = []
    b = backend(SmallRelu(), SeesHints(), mode=mode)
    f = torch.compile(_folded, backend=b, dynamic=True)
    with torch.set_grad_enabled(grad):
        for n in (6, 20, 30):
            x = torch.randn(n, 4)
            want = (torch.sigmoid(x) if n <= 16 else torch.relu(x)).view(n, 2, -1).sum(1)
            torch.testing.assert_close(f(x), want, msg=f"{n} tokens")
    assert b.last_dispatcher is not None and b.last_dispatcher.late_compiles == 1
    assert SeesHints.seen == [6, 20]  # each compile saw the sizes of the call it was made at
