"""Numerical comparisons for pass tests: dtype-aware closeness and relative-error budgets.

A graph pass must not change what a program computes beyond what its dtype allows::

    assert_close(compiled(x), eager(x))                       # tolerances from the dtype
    assert_no_worse_than(fused(x), unfused(x), reference(x))  # error budget vs an fp32 reference

Comparisons are done in float64 (complex128), whatever the inputs' dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["assert_close", "assert_no_worse_than", "relative_error", "tolerances"]

_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}
"""(rtol, atol) per real floating dtype; complex dtypes use their real counterpart's.

The rtols are torch.testing's: about one unit in the last place for float16 (2**-10) and two for
bfloat16 (2 * 2**-7), while float32's 1.3e-6 (about 11 ulp) leaves room for a reordered
reduction. torch.testing's atol of 1e-5 is kept for float32/float64 but raised to the rtol for
the half types: a pass that fuses or reorders ops changes where rounding happens, and an output
near zero produced by cancellation then carries an absolute error of the order of the
*operands'* rounding (eps * |operand|), which an atol of 1e-5 would flag for no fault of the
pass.
"""

_EXACT_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.uint64}
    | {torch.int8, torch.int16, torch.int32, torch.int64}
)


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """Default ``(rtol, atol)`` for comparing tensors of ``dtype``.

    float64 ``(1e-7, 1e-7)``, float32 ``(1.3e-6, 1e-5)``, float16 ``(1e-3, 1e-3)``, bfloat16
    ``(1.6e-2, 1e-2)``; complex dtypes as their real part; integers and bool ``(0, 0)``.

    Raises:
        ValueError: for dtypes without a sensible default (float8, quantized, ...): pass
            ``rtol`` and ``atol`` explicitly for those.
    """
    if dtype in _EXACT_DTYPES:
        return (0.0, 0.0)
    real = dtype.to_real() if dtype.is_complex else dtype
    if real not in _TOLERANCES:
        raise ValueError(f"no default tolerances for {dtype}; pass rtol and atol explicitly")
    return _TOLERANCES[real]


def assert_close(
    actual: Any,
    expected: Any,
    *,
    dtype: torch.dtype | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    msg: str = "",
) -> None:
    """Assert that tensors, or (nested) tuples/lists/dicts of tensors, are close.

    Elementwise ``|actual - expected| <= atol + rtol * |expected|``, with NaN matching NaN
    (a pass must preserve NaN propagation, not just finite values) and infinities matching
    equal infinities. Structure, shapes, dtypes and devices must match exactly. Tolerances
    default to :func:`tolerances` of ``dtype``, itself defaulting to each tensor's dtype; pass
    ``dtype`` to judge e.g. float32 outputs of a bfloat16 computation by bfloat16 standards.

    Raises:
        AssertionError: naming where the first mismatch is, with the number of mismatched
            elements and the largest absolute and relative differences among them, with their
            indices and values.
        TypeError: for leaves that are neither tensors nor ``None``.
    """
    problems = _compare(actual, expected, "", dtype, rtol, atol)
    if problems:
        raise AssertionError("\n".join([msg, problems] if msg else [problems]))


def relative_error(actual: Any, reference: Any) -> float:
    """``‖actual - reference‖ / ‖reference‖`` (Frobenius norms, computed in float64).

    Accepts tensors or matching (nested) tuples/lists/dicts of them, whose elements are then
    treated as one vector. Returns 0 when both are zero, ``inf`` when only ``reference`` is.
    """
    a, r = _flat_float64(actual, reference)
    diff, norm = torch.linalg.vector_norm(a - r).item(), torch.linalg.vector_norm(r).item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return float(diff / norm)


def assert_no_worse_than(
    candidate: Any,
    baseline: Any,
    reference: Any,
    factor: float = 1.25,
    *,
    floor: float | None = None,
) -> None:
    """Assert ``relative_error(candidate, reference) <= factor * relative_error(baseline, reference)``.

    For instance "the fused bfloat16 graph is at most 25% less accurate than the unfused
    bfloat16 graph, both measured against a float32 reference". Errors up to ``floor`` are
    always accepted: the reference only resolves differences down to its own rounding, so
    ``floor`` defaults to the machine epsilon of its most precise floating dtype (0 if it has
    none).

    Raises:
        AssertionError: with both errors and the bound.
    """
    if factor <= 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    candidate_error = relative_error(candidate, reference)
    baseline_error = relative_error(baseline, reference)
    floor = _epsilon(reference) if floor is None else floor
    bound = max(factor * baseline_error, floor)
    if not candidate_error <= bound:
        raise AssertionError(
            f"candidate is less accurate than allowed: relative error vs reference "
            f"{candidate_error:.3e} > {bound:.3e} = max({factor:g} x baseline error "
            f"{baseline_error:.3e}, floor {floor:.3e})"
        )


# --------------------------------------------------------------------------- comparison


def _compare(
    actual: Any,
    expected: Any,
    path: str,
    dtype: torch.dtype | None,
    rtol: float | None,
    atol: float | None,
) -> str | None:
    """Describe the first difference between ``actual`` and ``expected``, or return ``None``."""
    where = path or "the output"
    if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
        return _compare_tensors(actual, expected, where, dtype, rtol, atol)
    if actual is None and expected is None:
        return None
    if isinstance(actual, (tuple, list)) and isinstance(expected, (tuple, list)):
        if len(actual) != len(expected):
            return f"length mismatch at {where}: actual has {len(actual)} items, expected {len(expected)}"
        pairs = [(f"{path}[{i}]", a, e) for i, (a, e) in enumerate(zip(actual, expected))]
    elif isinstance(actual, dict) and isinstance(expected, dict):
        if actual.keys() != expected.keys():
            return f"key mismatch at {where}: actual has {sorted(map(str, actual))}, expected {sorted(map(str, expected))}"
        pairs = [(f"{path}[{k!r}]", actual[k], expected[k]) for k in expected]
    else:
        _check_leaf(actual, where)
        _check_leaf(expected, where)
        return f"type mismatch at {where}: actual is {_kind(actual)}, expected {_kind(expected)}"
    for sub_path, a, e in pairs:
        if problem := _compare(a, e, sub_path, dtype, rtol, atol):
            return problem
    return None


def _check_leaf(value: Any, where: str) -> None:
    if not isinstance(value, (torch.Tensor, tuple, list, dict, type(None))):
        raise TypeError(
            f"assert_close compares tensors and (nested) tuples/lists/dicts of tensors; "
            f"got {type(value).__name__} at {where}"
        )


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "a tensor"
    return "None" if value is None else f"a {type(value).__name__}"


def _compare_tensors(
    actual: torch.Tensor,
    expected: torch.Tensor,
    where: str,
    dtype: torch.dtype | None,
    rtol: float | None,
    atol: float | None,
) -> str | None:
    for attribute in ("shape", "dtype", "device"):
        a, e = getattr(actual, attribute), getattr(expected, attribute)
        if a != e:
            return f"{attribute} mismatch at {where}: actual {_show(a)}, expected {_show(e)}"
    rtol, atol = _resolve_tolerances(dtype or expected.dtype, rtol, atol)
    a, e = _wide(actual), _wide(expected)
    mismatched = ~torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    if not mismatched.any():
        return None
    return _mismatch_report(a, e, mismatched, where, expected, rtol, atol)


def _resolve_tolerances(dtype: torch.dtype, rtol: float | None, atol: float | None) -> tuple[float, float]:
    """The explicit tolerances, completed with the defaults of ``dtype`` where missing."""
    if rtol is not None and atol is not None:
        return rtol, atol
    default_rtol, default_atol = tolerances(dtype)
    return (default_rtol if rtol is None else rtol), (default_atol if atol is None else atol)


def _show(value: Any) -> str:
    return str(tuple(value)) if isinstance(value, torch.Size) else str(value)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU in float64 (complex128 for complex tensors)."""
    return t.detach().cpu().to(torch.complex128 if t.is_complex() else torch.float64)


def _mismatch_report(
    a: torch.Tensor,
    e: torch.Tensor,
    mismatched: torch.Tensor,
    where: str,
    expected: torch.Tensor,
    rtol: float,
    atol: float,
) -> str:
    abs_diff = _nan_as_inf(torch.where(mismatched, (a - e).abs(), 0.0))
    rel_diff = _nan_as_inf(torch.where(mismatched, abs_diff / e.abs(), 0.0))
    count, total = int(mismatched.sum()), mismatched.numel()
    lines = [
        f"tensors are not close at {where} (shape {_show(expected.shape)}, {expected.dtype}, "
        f"rtol={rtol:g}, atol={atol:g})",
        f"  mismatched elements: {count} / {total} ({100.0 * count / total:.1f}%)",
    ]
    for label, diff in (("absolute", abs_diff), ("relative", rel_diff)):
        index = _unravel(int(diff.argmax()), a.shape)
        lines.append(
            f"  largest {label} difference among them: {diff[index].item():.6g} at index {index} "
            f"(actual {a[index].item():.8g}, expected {e[index].item():.8g})"
        )
    return "\n".join(lines)


def _nan_as_inf(t: torch.Tensor) -> torch.Tensor:
    """NaN differences (NaN on one side only) count as infinitely large."""
    return t.nan_to_num(nan=math.inf, posinf=math.inf)


def _unravel(flat_index: int, shape: torch.Size) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), shape))


# --------------------------------------------------------------------------- error measures


def _flat_float64(actual: Any, reference: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """All tensors of ``actual`` and of ``reference`` flattened into two float64 vectors."""
    a_leaves, a_spec = pytree.tree_flatten(actual)
    r_leaves, r_spec = pytree.tree_flatten(reference)
    if a_spec != r_spec:
        raise ValueError(f"structure mismatch: actual is {a_spec}, reference is {r_spec}")
    for i, (a, r) in enumerate(zip(a_leaves, r_leaves)):
        if not (isinstance(a, torch.Tensor) and isinstance(r, torch.Tensor)):
            raise TypeError(f"leaf {i}: expected tensors, got {type(a).__name__} and {type(r).__name__}")
        if a.shape != r.shape:
            raise ValueError(f"leaf {i}: shape mismatch: {_show(a.shape)} vs {_show(r.shape)}")
    return _concat(a_leaves), _concat(r_leaves)


def _concat(leaves: list[torch.Tensor]) -> torch.Tensor:
    if not leaves:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([_wide(t).reshape(-1) for t in leaves])


def _epsilon(reference: Any) -> float:
    floating = [
        t.dtype
        for t in pytree.tree_leaves(reference)
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    ]
    return min((torch.finfo(d).eps for d in floating), default=0.0)
