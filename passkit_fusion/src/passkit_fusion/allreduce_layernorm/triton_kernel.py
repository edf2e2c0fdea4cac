"""Residual add + LayerNorm in one Triton kernel (the GPU path of ``allreduce_add_layernorm``).

One program per row (token): ``residual_out = x + residual`` rounded to the activation
dtype (the unfused sum, bit for bit), then LayerNorm of that rounded sum in fp32 (mean, the
biased variance of the centred values, ``rsqrt(var + eps)``), times ``weight`` plus ``bias``,
rounded once to the output dtype: what ``F.layer_norm`` computes.

Triton is imported when :func:`add_layernorm` is first called, never at import: the CPU
package does not need it. ``TRITON_INTERPRET=1`` runs the kernel on CPU tensors (tests).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..triton_rows import MAX_BLOCK, row_block

__all__ = ["add_layernorm", "max_hidden"]


def max_hidden() -> int:
    """The largest hidden size the one-row-per-program kernel takes."""
    return MAX_BLOCK


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def add_layernorm_kernel(
        X, R, W, B, NORM, RES, stride_x, stride_r, stride_n, stride_o, H, eps,
        HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(RES.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(RES + row * stride_o + cols, x, mask=mask)
        h = x.to(tl.float32)
        mean = tl.sum(h, axis=0) / H
        centred = tl.where(mask, h - mean, 0.0)
        var = tl.sum(centred * centred, axis=0) / H
        rstd = 1.0 / tl.sqrt(var + eps)
        y = centred * rstd
        if HAS_WEIGHT:
            y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(
            NORM + row * stride_n + cols, y.to(NORM.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask
        )

    return add_layernorm_kernel


def add_layernorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm_out, residual_out)`` with ``residual_out = x + residual`` (``x`` itself without
    a residual) and ``norm_out = layer_norm(residual_out)``. ``residual_out`` may be given
    (written in place; it may be ``x`` itself)."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    norm = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if residual is None:
        res2 = x2
    else:
        res2 = (residual_out if residual_out is not None else torch.empty_like(x)).view(-1, hidden)
    r2 = residual.reshape(-1, hidden).contiguous() if residual is not None else x2
    block, warps = row_block(hidden, "add_layernorm")
    if rows:
        _kernel()[(rows,)](
            x2, r2, weight if weight is not None else x2, bias if bias is not None else x2, norm, res2,
            x2.stride(0), r2.stride(0), norm.stride(0), res2.stride(0), hidden, float(eps),
            HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            BLOCK=block, num_warps=warps,
        )  # fmt: skip
    out_res = res2.view(x.shape) if residual is not None else x
    return norm.view(x.shape), out_res
