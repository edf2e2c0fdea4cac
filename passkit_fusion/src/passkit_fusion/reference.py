"""The reference implementation of the fused ops: what flashinfer's kernel computes, in torch.

It runs anywhere torch.distributed does (gloo on CPU included), so CPU tests and the demo
execute the fused graph for real. The numerics follow the kernel:

* ``residual_out = all_reduce_sum(x) + residual`` in ``x.dtype``, exactly the unfused sum;
* ``norm_out = residual_out * rsqrt(mean(residual_out**2) + eps) * (weight + weight_bias)``
  computed in fp32 and rounded once to ``x.dtype``.

* with FP8 quantization, ``quant_out = saturate(norm_out.float() * (1 / scale))`` as
  ``float8_e4m3fn`` (:func:`fp8_quantize`).

The LayerNorm op (``allreduce_add_layernorm``) computes ``norm_out`` with
``torch.nn.functional.layer_norm`` on ``residual_out``: what ``nn.LayerNorm`` does in eager.

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


def allreduce_add_layernorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm_out, residual_out)`` of all-reduce + optional residual add + LayerNorm over the
    last dim (``torch.nn.functional.layer_norm``: fp32 math, one rounding to ``x.dtype``).

    ``residual_out`` is the unfused sum bit for bit; ``norm_out`` is what ``nn.LayerNorm``
    computes in eager on that sum. Collective: every rank of the group calls it in order."""
    total = all_reduce_sum(x, group_name)
    if residual is not None:
        total = total + residual
    return layer_norm(total, weight, bias, eps), total


def layer_norm(
    total: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm of ``total`` over its last dim with ``weight`` (and ``bias``), in ``total.dtype``."""
    return torch.nn.functional.layer_norm(total, (total.shape[-1],), weight, bias, eps)


FP8_MAX = 448.0
"""The largest finite ``float8_e4m3fn`` value; the kernel saturates to it."""


def fp8_quantize(norm: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static per-tensor ``float8_e4m3fn`` quantization as flashinfer's kernel does it: the
    norm output (already rounded to its dtype) times ``1 / scale`` in fp32, saturated to
    ``[-448, 448]``. ``scale`` (one element) is the dequantization scale: ``q * scale ~ norm``."""
    inverse = torch.reciprocal(scale.reshape(()).float())
    return (norm.float() * inverse).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def allreduce_rmsnorm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_bias: float,
    scale: torch.Tensor,
    group_name: str,
    need_norm_out: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(quant_out, norm_out, residual_out)`` of all-reduce + optional residual add +
    RMSNorm + static FP8 quantization (:func:`fp8_quantize`). ``norm_out`` is empty
    (shape ``[0]``) unless ``need_norm_out``. Collective, like :func:`allreduce_rmsnorm`."""
    norm, total = allreduce_rmsnorm(x, residual, weight, eps, weight_bias, group_name)
    quant = fp8_quantize(norm, scale)
    return quant, (norm if need_norm_out else norm.new_empty((0,))), total
