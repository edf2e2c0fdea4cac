"""The ranks' partial sums + residual add + RMSNorm in one Triton kernel (the last step of
``matmul_all_reduce_rmsnorm`` on the copy engines).

One program per row (token), reading each rank's partial product of the row (this rank's own
and the ones its peers pushed into its symmetric memory):

* ``total = p_0 + p_1 + ... + p_{W-1}``, added **in rank order** in fp32 and rounded once
  to the activation dtype: every rank computes the same bits, as an all-reduce's result is;
* ``residual_out = total + residual``, rounded to the activation dtype (the unfused sum);
* ``norm_out = residual_out * rsqrt(mean(residual_out^2) + eps) * (weight + weight_bias)``
  in fp32, rounded once (:func:`passkit_fusion.reference.rms_norm`).

Without the kernel the sum would be written by one kernel and read back by Inductor's add +
RMSNorm: two full passes over the rows more (about 40 us a site at 8192 tokens x 4096 in
bf16 on an H200). Up to :data:`MAX_PARTS` partials are read directly; more are summed first.

Triton is imported when :func:`partials_add_rmsnorm` is first called, never at import: the
CPU package does not need it. ``TRITON_INTERPRET=1`` runs the kernel on CPU tensors (tests).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from ..triton_rows import MAX_BLOCK, row_block

__all__ = ["MAX_HIDDEN", "MAX_PARTS", "RowsNorm", "partials_add_rmsnorm"]

MAX_PARTS = 4
MAX_HIDDEN = MAX_BLOCK
"""The largest hidden size the kernel normalises (one row per program): the pass leaves
sites with a larger one to the plain op."""


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def partials_add_rmsnorm_kernel(
        P0, P1, P2, P3, R, W, NORM, RES, stride_p, stride_r, stride_o, H, eps, weight_bias, row0,
        PARTS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64) + row0
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        total = tl.load(P0 + row * stride_p + cols, mask=mask, other=0.0).to(tl.float32)
        if PARTS > 1:
            total += tl.load(P1 + row * stride_p + cols, mask=mask, other=0.0).to(tl.float32)
        if PARTS > 2:
            total += tl.load(P2 + row * stride_p + cols, mask=mask, other=0.0).to(tl.float32)
        if PARTS > 3:
            total += tl.load(P3 + row * stride_p + cols, mask=mask, other=0.0).to(tl.float32)
        total = total.to(RES.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        h = (total + r).to(RES.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(RES + row * stride_o + cols, h, mask=mask)
        hf = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / H + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + weight_bias
        y = hf * rstd * w
        tl.store(
            NORM + row * stride_o + cols, y.to(NORM.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask
        )

    return partials_add_rmsnorm_kernel


def partials_add_rmsnorm(
    parts: Sequence[torch.Tensor],
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_bias: float,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm_out, residual_out)``, both shaped like ``residual``, from the ranks' partials
    (``[rows, hidden]`` each, contiguous rows, in rank order) summed, plus ``residual``,
    RMS-normalised with ``weight + weight_bias``. ``out``: two ``[rows, hidden]`` tensors
    with one row stride (rows of larger ones) to write instead, returned as they are."""
    if len(parts) > MAX_PARTS:  # the first ones summed in rank order, then the kernel
        head = parts[0].float()
        for part in parts[1 : len(parts) - MAX_PARTS + 1]:
            head = head + part.float()
        parts = [head.to(parts[0].dtype), *parts[len(parts) - MAX_PARTS + 1 :]]
    rows, hidden = parts[0].shape[0], residual.shape[-1]
    if out is not None:
        RowsNorm(parts, residual, weight, eps, weight_bias, out)(0, rows)
        return out
    norm = torch.empty((rows, hidden), dtype=residual.dtype, device=residual.device)
    res = torch.empty_like(norm)
    RowsNorm(parts, residual, weight, eps, weight_bias, (norm, res))(0, rows)
    return norm.view(residual.shape), res.view(residual.shape)


class RowsNorm:
    """:func:`partials_add_rmsnorm` of fixed tensors, launched over row ranges: the layout is
    checked once, then each call (``norm(start, end)``) is one kernel launch with no view
    made, which is what a chunked caller pays per chunk on the host."""

    def __init__(
        self,
        parts: Sequence[torch.Tensor],
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        weight_bias: float,
        out: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        if not 1 <= len(parts) <= MAX_PARTS:
            raise ValueError(f"partials_add_rmsnorm: 1 to {MAX_PARTS} partials a launch, got {len(parts)}")
        rows, hidden = parts[0].shape[0], residual.shape[-1]
        r2 = residual.reshape(rows, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        norm, res = out
        if (
            norm.shape != (rows, hidden)
            or res.shape != norm.shape
            or res.stride() != norm.stride()
            or norm.stride(-1) != 1
        ):
            raise ValueError("partials_add_rmsnorm: out must be two [rows, hidden] tensors of one layout")
        block, warps = row_block(hidden, "partials_add_rmsnorm")
        if any(
            p.shape != parts[0].shape or p.stride(-1) != 1 or p.stride(0) != parts[0].stride(0) for p in parts
        ):
            raise ValueError("partials_add_rmsnorm: the partials must share one row-major layout")
        padded = [*parts, *[parts[0]] * (MAX_PARTS - len(parts))]
        self._args = (
            *padded, r2, weight, norm, res, parts[0].stride(0), r2.stride(0), norm.stride(0), hidden,
            float(eps), float(weight_bias),
        )  # fmt: skip
        self._meta = {
            "PARTS": len(parts),
            "BLOCK": block,
            "num_warps": warps,
        }
        self._kernel = _kernel()

    def __call__(self, start: int, end: int) -> None:
        """Rows ``start:end``."""
        if end > start:
            self._kernel[(end - start,)](*self._args, start, **self._meta)
