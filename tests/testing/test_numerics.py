"""Tests of passkit_testing.numerics."""

from __future__ import annotations

import math

import pytest
import torch
from passkit_testing.numerics import assert_close, assert_no_worse_than, relative_error, tolerances


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# --------------------------------------------------------------------------- tolerances


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.float64, (1e-7, 1e-7)),
        (torch.float32, (1.3e-6, 1e-5)),
        (torch.float16, (1e-3, 1e-3)),
        (torch.bfloat16, (1.6e-2, 1e-2)),
        (torch.complex64, (1.3e-6, 1e-5)),
        (torch.int64, (0.0, 0.0)),
        (torch.bool, (0.0, 0.0)),
    ],
)
def test_tolerances_per_dtype(dtype: torch.dtype, expected: tuple[float, float]) -> None:
    assert tolerances(dtype) == expected


def test_dtypes_without_default_tolerances_need_explicit_ones() -> None:
    x = torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="pass rtol and atol explicitly"):
        tolerances(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="pass rtol and atol explicitly"):
        assert_close(x, x, rtol=0.1)
    assert_close(x, x, rtol=0.1, atol=0.1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_tolerances_accept_one_rounding_but_fp32_tolerances_do_not(dtype: torch.dtype) -> None:
    exact = _randn(1000)
    rounded = exact.to(dtype).float()
    assert_close(rounded, exact, dtype=dtype)
    with pytest.raises(AssertionError):
        assert_close(rounded, exact)


# --------------------------------------------------------------------------- assert_close


def test_assert_close_passes_on_equal_nested_structures() -> None:
    x = _randn(3, 4)
    nan_inf = torch.tensor([math.nan, math.inf, -math.inf, 1.0])
    actual = (x + 1e-7, [nan_inf, None], {"ids": torch.arange(3)})
    expected = (x, [nan_inf.clone(), None], {"ids": torch.arange(3)})
    assert_close(actual, expected)


def test_assert_close_fails_on_a_bf16_mismatch_and_says_where() -> None:
    expected = torch.ones(2, 4, dtype=torch.bfloat16)
    actual = expected.clone()
    actual[1, 2] = 1.0625  # 4 bf16 ulps off
    with pytest.raises(AssertionError) as info:
        assert_close(actual, expected, msg="fused attention output")
    message = str(info.value)
    assert message.startswith("fused attention output\n")
    assert "(shape (2, 4), torch.bfloat16, rtol=0.016, atol=0.01)" in message
    assert "mismatched elements: 1 / 8 (12.5%)" in message
    assert (
        "largest absolute difference among them: 0.0625 at index (1, 2) (actual 1.0625, expected 1)"
        in message
    )


def test_assert_close_fails_at_the_nested_position() -> None:
    expected = ([torch.zeros(3), torch.zeros(3)], torch.zeros(1))
    actual = ([torch.zeros(3), torch.tensor([0.0, 0.0, 1.0])], torch.zeros(1))
    with pytest.raises(AssertionError, match=r"not close at \[0\]\[1\].*\n.*1 / 3"):
        assert_close(actual, expected)


@pytest.mark.parametrize(
    ("actual", "expected", "pattern"),
    [
        (
            torch.zeros(2, 3),
            torch.zeros(3, 2),
            r"shape mismatch at the output: actual \(2, 3\), expected \(3, 2\)",
        ),
        (
            torch.zeros(2),
            torch.zeros(2, dtype=torch.float64),
            "dtype mismatch at the output: actual torch.float32",
        ),
        ((torch.zeros(1),), (torch.zeros(1), torch.zeros(1)), "length mismatch at the output"),
        ({"a": torch.zeros(1)}, {"b": torch.zeros(1)}, r"key mismatch at the output"),
        ((torch.zeros(1), None), (torch.zeros(1), torch.zeros(1)), r"type mismatch at \[1\]: actual is None"),
        (
            torch.tensor([math.nan]),
            torch.tensor([1.0]),
            r"absolute difference among them: inf .*\n.*relative difference among them: inf",
        ),
        (torch.tensor([1, 2]), torch.tensor([1, 3]), "mismatched elements: 1 / 2"),
    ],
)
def test_assert_close_fails_on_any_difference(actual: object, expected: object, pattern: str) -> None:
    with pytest.raises(AssertionError, match=pattern):
        assert_close(actual, expected)


def test_explicit_tolerances_override_the_defaults() -> None:
    expected = torch.ones(4)
    actual = expected + 1e-3
    assert_close(actual, expected, atol=2e-3)
    assert_close(actual, expected, rtol=2e-3, atol=0.0)
    with pytest.raises(AssertionError, match=r"rtol=0\.0001, atol=0"):
        assert_close(actual, expected, rtol=1e-4, atol=0.0)


def test_assert_close_rejects_non_tensor_leaves() -> None:
    with pytest.raises(TypeError, match=r"got int at \[0\]"):
        assert_close([1], [1])


# --------------------------------------------------------------------------- relative errors


def test_relative_error_is_the_norm_ratio() -> None:
    reference = torch.tensor([3.0, 4.0])
    assert relative_error(torch.tensor([3.0, 4.5]), reference) == pytest.approx(0.1)
    assert relative_error(
        (reference, torch.tensor([0.0])), (reference, torch.tensor([5.0]))
    ) == pytest.approx(5.0 / math.sqrt(50.0))
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    assert relative_error(torch.ones(2), torch.zeros(2)) == math.inf


def test_relative_error_is_computed_in_float64() -> None:
    reference = torch.full((4,), 1.0e4, dtype=torch.bfloat16)
    assert relative_error(reference, reference) == 0.0
    assert relative_error(reference + 64, reference) == pytest.approx(64 / 1e4, rel=1e-2)


def test_relative_error_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="shape mismatch"):
        relative_error(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="structure mismatch"):
        relative_error((torch.zeros(2),), (torch.zeros(2), torch.zeros(2)))


def _bf16_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.bfloat16() @ w.bfloat16()).float()


def test_assert_no_worse_than_accepts_an_equally_accurate_candidate() -> None:
    x, w = _randn(16, 64, seed=1), _randn(64, 8, seed=2)
    reference = x.double() @ w.double()
    baseline = _bf16_matmul(x, w)
    candidate = _bf16_matmul(x[:, :32], w[:32]) + _bf16_matmul(x[:, 32:], w[32:])  # reordered sum
    assert_no_worse_than(candidate, baseline, reference)


def test_assert_no_worse_than_fails_on_a_less_accurate_candidate() -> None:
    x, w = _randn(16, 64, seed=1), _randn(64, 8, seed=2)
    reference = x @ w
    baseline = _bf16_matmul(x, w)
    candidate = baseline + 3 * (baseline - reference)
    with pytest.raises(
        AssertionError, match=r"relative error vs reference .* > .* = max\(1.25 x baseline error"
    ):
        assert_no_worse_than(candidate, baseline, reference)


def test_assert_no_worse_than_accepts_errors_below_the_reference_precision() -> None:
    reference = _randn(100)
    candidate = reference.double() * (1 + 2**-30)  # off by far less than float32's epsilon
    assert_no_worse_than(candidate, reference, reference)  # the baseline is exact
    with pytest.raises(AssertionError, match=r"floor 0\.000e"):
        assert_no_worse_than(candidate, reference, reference, floor=0.0)


def test_assert_no_worse_than_rejects_a_non_positive_factor() -> None:
    with pytest.raises(ValueError, match="factor"):
        assert_no_worse_than(torch.zeros(1), torch.zeros(1), torch.zeros(1), factor=0.0)
