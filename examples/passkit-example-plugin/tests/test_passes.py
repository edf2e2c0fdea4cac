"""Tests of the example passes, written with passkit-testing (its pytest plugin provides
the ``passkit_harness`` fixture)."""

import pytest
import torch

from passkit_testing import assert_op_count, assert_replaced, conformance_tests

aten = torch.ops.aten


def double_neg(x):
    return torch.neg(torch.neg(x)) * 2


def scaled_mul_add(a, b, c):
    return a + b * c * 0.5


def swish_twice(x):
    return x * torch.sigmoid(x) + x.sigmoid() * x * 2


def abc(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 8, generator=g).to(dtype) for _ in range(3)]


def test_fold_double_neg(passkit_harness):
    result = passkit_harness(double_neg, torch.randn(8), passes=["fold_double_neg"])
    result.assert_matches("fold_double_neg", 1)
    assert_op_count(result.graph_after, aten.neg, 0)
    result.assert_close()


def test_fold_double_neg_never_returns_an_input(passkit_harness):
    result = passkit_harness(lambda x: torch.neg(torch.neg(x)), torch.randn(8), passes=["fold_double_neg"])
    result.assert_matches("fold_double_neg", 0)


@pytest.mark.parametrize("value", [0.5, -3.0])
def test_fuse_addcmul_matches_any_scalar(passkit_harness, value):
    result = passkit_harness(lambda a, b, c: a + b * c * value, *abc(), passes=["fuse_addcmul"])
    result.assert_matches("fuse_addcmul", 1)
    assert_replaced(result.graph_before, result.graph_after, aten.add, aten.addcmul, n=1)
    assert_op_count(result.graph_after, aten.mul, 0)
    result.assert_close()


def test_fuse_addcmul_min_numel(passkit_harness):
    option = {"name": "fuse_addcmul", "min_numel": 33}  # the inputs have 32 elements
    result = passkit_harness(scaled_mul_add, *abc(), passes=[option])
    result.assert_matches("fuse_addcmul", 0)


def test_fuse_addcmul_bf16_accuracy(passkit_harness):
    result = passkit_harness(scaled_mul_add, *abc(torch.bfloat16), passes=["fuse_addcmul"], reference="fp32")
    result.assert_matches("fuse_addcmul", 1)
    result.assert_close()  # vs the uncompiled bf16 call, with bf16 tolerances
    result.assert_no_worse_than_eager()  # vs an fp32 reference


def test_both_passes_through_inductor(passkit_harness):
    result = passkit_harness(
        lambda a, b, c: scaled_mul_add(a, b, c) + double_neg(a),
        *abc(),
        passes=["fold_double_neg", "fuse_addcmul"],
        mode="inductor",
    )
    result.assert_matches("fold_double_neg", 1)
    result.assert_matches("fuse_addcmul", 1)
    result.assert_close()


test_fold_double_neg_conformance = conformance_tests("fold_double_neg", sample=(double_neg, [torch.randn(8)]))

test_fuse_addcmul_conformance = conformance_tests(
    "fuse_addcmul",
    options_variants=[{}, {"min_numel": 16}],
    sample=(scaled_mul_add, abc()),
)


def test_silu_from_sigmoid_at_pre_grad(passkit_harness):
    result = passkit_harness(swish_twice, torch.randn(8), passes=["silu_from_sigmoid"])
    result.assert_matches("silu_from_sigmoid", 2)  # the function and the method form
    assert result.report["silu_from_sigmoid"].stage == "pre_grad"
    result.assert_close()
