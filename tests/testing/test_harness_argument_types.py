"""The harness's helpers take their arguments' types as a pass author writes them, or say
what is wrong: one pass name alone is one pass, a count is an int."""

from __future__ import annotations

import pytest
import torch

from passkit_testing import assert_op_count, assert_replaced, resolve_passes, run_passes

aten = torch.ops.aten


def fn(x):
    return torch.neg(torch.neg(x)) * 2.0


def test_one_pass_name_as_a_str_is_one_pass():
    """``passes="cleanup"`` was the passes 'c', 'l', ... ("unknown pass 'c'")."""
    assert [p.name for p in resolve_passes("noop_elimination")] == ["noop_elimination"]
    assert [p.name for p in resolve_passes({"name": "noop_elimination"})] == ["noop_elimination"]
    result = run_passes(fn, torch.randn(4), passes="fold_double_neg")
    assert result.report.names() == ["fold_double_neg"]
    assert_op_count(result.graph_after, aten.neg.default, 0)


def test_passes_that_are_no_list_is_a_type_error():
    with pytest.raises(TypeError, match=r"passes: a list of passes .* got 3"):
        resolve_passes(3)


@pytest.mark.parametrize("count", ["2", 2.0, True, None])
def test_a_count_that_is_no_int_is_a_type_error_naming_it(count):
    """``assert_op_count(g, op, "2")`` failed with "expected 2, found 2"."""
    gm = torch.fx.symbolic_trace(lambda x: torch.neg(torch.neg(x)))
    with pytest.raises(
        TypeError, match=rf"assert_op_count: n must be an int \(a count\), got {type(count).__name__}"
    ):
        assert_op_count(gm, torch.neg, count)
    with pytest.raises(TypeError, match=r"assert_replaced: n must be an int"):
        assert_replaced(gm, gm, torch.neg, torch.relu, count)
    assert_op_count(gm, torch.neg, 2)  # an int still counts


def test_assert_matches_takes_an_int_only():
    result = run_passes(fn, torch.randn(4), passes=["fold_double_neg"])
    with pytest.raises(TypeError, match=r"assert_matches: n must be an int"):
        result.assert_matches("fold_double_neg", "1")
    result.assert_matches("fold_double_neg", 1)
