"""Tests of passkit_testing.graphs."""

from __future__ import annotations

import collections
import copy
import operator

import pytest
import torch
import torch.fx
from passkit_testing.graphs import assert_op_count, assert_replaced, count_ops, find_ops, op_counts, op_name

aten = torch.ops.aten


def _graph() -> torch.fx.Graph:
    """x, y -> (add.Tensor, add.Tensor, add.Scalar, mm, getitem): two overloads of aten.add."""
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    a = graph.call_function(aten.add.Tensor, (x, y))
    b = graph.call_function(aten.add.Tensor, (a, y))
    c = graph.call_function(aten.add.Scalar, (b, 2))
    d = graph.call_function(aten.mm.default, (c, y))
    e = graph.call_function(operator.getitem, (d, 0))
    graph.output((d, e))
    return graph


def _replace_adds(graph: torch.fx.Graph, new_op: torch._ops.OpOverload, limit: int) -> None:
    """A toy pass: retarget the first ``limit`` ``aten.add.Tensor`` calls to ``new_op``."""
    for node in find_ops(graph, aten.add.Tensor)[:limit]:
        node.target = new_op


def test_op_counts_names_ops_readably() -> None:
    assert op_counts(_graph()) == collections.Counter(
        {"aten.add.Tensor": 2, "aten.add.Scalar": 1, "aten.mm.default": 1, "operator.getitem": 1}
    )


def test_op_name_of_packets_callables_and_higher_order_ops() -> None:
    assert op_name(aten.add) == "aten.add"
    assert op_name(torch.relu) == "torch.relu"
    assert op_name(torch.ops.higher_order.cond) == "higher_order.cond"


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        (aten.add.Tensor, 2),
        (aten.add.Scalar, 1),
        (aten.add, 3),  # a packet counts all its overloads
        ("aten.add.Tensor", 2),
        ("aten.add", 3),
        ("torch.ops.aten.mm.default", 1),
        (operator.getitem, 1),
        (aten.relu.default, 0),
    ],
)
def test_count_ops_accepts_every_kind_of_op(op: object, expected: int) -> None:
    graph = _graph()
    assert count_ops(graph, op) == expected  # type: ignore[arg-type]
    assert count_ops(torch.fx.GraphModule(torch.nn.Module(), graph), op) == expected  # type: ignore[arg-type]
    assert count_ops(op_counts(graph), op) == expected  # type: ignore[arg-type]


def test_find_ops_returns_matching_nodes_in_graph_order() -> None:
    nodes = find_ops(_graph(), aten.add)
    assert [node.target for node in nodes] == [aten.add.Tensor, aten.add.Tensor, aten.add.Scalar]


@pytest.mark.parametrize("name", ["aten.ad.Tensor", "aten.add.Tensr", "operator.getitem", "add", "a.b.c.d"])
def test_unknown_or_malformed_op_names_are_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="op"):
        count_ops(_graph(), name)


def test_non_ops_and_non_graphs_are_rejected() -> None:
    with pytest.raises(TypeError, match="expected an op"):
        count_ops(_graph(), 42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"torch\.fx\.Graph"):
        find_ops("graph", aten.add)  # type: ignore[arg-type]


def test_assert_op_count_passes_on_the_right_count() -> None:
    assert_op_count(_graph(), aten.add, 3)
    assert_op_count(_graph(), "aten.relu.default", 0)


def test_assert_op_count_fails_with_all_op_counts() -> None:
    with pytest.raises(AssertionError) as info:
        assert_op_count(_graph(), aten.mm.default, 2)
    message = str(info.value)
    assert "expected 2 call(s) of aten.mm.default, found 1" in message
    assert "aten.add.Tensor   2" in message
    assert "operator.getitem  1" in message


def test_assert_replaced_passes_with_graph_or_counts_as_before() -> None:
    graph = _graph()
    before_graph, before_counts = copy.deepcopy(graph), op_counts(graph)
    _replace_adds(graph, aten.sub.Tensor, limit=2)
    assert_replaced(before_graph, graph, aten.add.Tensor, aten.sub.Tensor, 2)
    assert_replaced(before_counts, graph, "aten.add", "aten.sub", 2)


def test_assert_replaced_n_zero_means_unchanged() -> None:
    graph = _graph()
    assert_replaced(graph, graph, aten.add.Tensor, aten.sub.Tensor, 0)
    with pytest.raises(AssertionError):
        before = op_counts(graph)
        _replace_adds(graph, aten.sub.Tensor, limit=1)
        assert_replaced(before, graph, aten.add.Tensor, aten.sub.Tensor, 0)


def test_assert_replaced_fails_on_a_wrong_count_with_both_graphs_counts() -> None:
    graph = _graph()
    before = op_counts(graph)
    _replace_adds(graph, aten.sub.Tensor, limit=1)
    with pytest.raises(AssertionError) as info:
        assert_replaced(before, graph, aten.add.Tensor, aten.sub.Tensor, 2)
    message = str(info.value)
    assert "expected 2 call(s) of aten.add.Tensor replaced by aten.sub.Tensor" in message
    assert "aten.add.Tensor went 2 -> 1 and aten.sub.Tensor went 0 -> 1" in message
    assert "aten.add.Tensor   2 -> 1  (-1)" in message
    assert "aten.mm.default   1 -> 1\n" in message


def test_assert_replaced_fails_when_old_ops_vanish_without_replacement() -> None:
    graph = _graph()
    before = op_counts(graph)
    _replace_adds(graph, aten.mul.Tensor, limit=2)  # not the op the test expects
    with pytest.raises(AssertionError, match=r"aten\.sub\.Tensor went 0 -> 0"):
        assert_replaced(before, graph, aten.add.Tensor, aten.sub.Tensor, 2)


def test_assert_replaced_rejects_bad_arguments() -> None:
    graph = _graph()
    with pytest.raises(ValueError, match="n must be >= 0"):
        assert_replaced(graph, graph, aten.add.Tensor, aten.sub.Tensor, -1)
    with pytest.raises(ValueError, match="same op"):
        assert_replaced(graph, graph, aten.add.Tensor, "aten.add.Tensor", 1)
