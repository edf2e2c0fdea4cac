"""The reference implementation of the fused op: what flashinfer's kernel computes, in torch.

It runs anywhere torch.distributed does (gloo on CPU included), so CPU tests and the demo
execute the fused graph for real. The numerics follow the kernel:

* ``residual_out = all_reduce_sum(x) + residual`` in ``x.dtype``, exactly the unfused sum;
* ``norm_out = residual_out * rsqrt(mean(residual_out**2) + eps) * (weight + weight_bias)``
  computed in fp32 and rounded once to ``x.dtype``.

Against model code that downcasts before multiplying by the weight (Llama's reference
RMSNorm), ``norm_out`` can differ by one rounding of ``x.dtype``; against
``torch.nn.functional.rms_norm`` and Gemma's norm it is the same computation.
"""

from __future__ import annotations

import torch


def rms_norm(total: torch.Tensor, weight: torch.Tensor, eps: float, weight_bias: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32, scaled by ``weight + weight_bias``, in ``total.dtype``."""
    h = total.float()
    inv_rms = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * inv_rms * (weight.float() + weight_bias)).to(total.dtype)


def all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum ``x`` over the named process group into a new tensor (the functional collective
    ``torch.compile`` emits for the unfused graph, so the sum is bit-identical to it)."""
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name))


def allreduce_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_bias: float,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm_out, residual_out)`` of all-reduce + optional residual add + RMSNorm.

    Collective: every rank of the group must call it, in the same order.
    """
    total = all_reduce_sum(x, group_name)
    if residual is not None:
        total = total + residual
    return rms_norm(total, weight, eps, weight_bias), total
