"""``torch.ops.passkit_fusion.allreduce_add_layernorm``: the op ``allreduce_layernorm`` swaps in.

``allreduce_add_layernorm(x, residual, weight, bias, eps, group_name, impl, norm_kernel,
max_bytes) -> (norm_out, residual_out)``: all-reduce (sum) ``x`` over the group, add
``residual`` (optional), LayerNorm over the last dim with ``weight`` and ``bias``
(both optional: OLMo's LayerNorm has neither). A functional ``torch.library`` op (new outputs, inputs untouched) with a fake
implementation, defined like ``allreduce_rmsnorm`` (:mod:`passkit_fusion.allreduce_rmsnorm.ops`:
``torch.library.Library``, one implementation for every device).

``impl`` is fixed in the graph at compile time:

* ``"symm_mem"``: :mod:`.runtime` on CUDA: torch's symmetric-memory one-shot all-reduce
  (``torch.ops.symm_mem.one_shot_all_reduce_copy_out`` into a persistent symmetric buffer
  per group and dtype), then residual add + LayerNorm in one Triton kernel
  (``norm_kernel="triton"``) or in torch ops (``"torch"``). Messages above ``max_bytes``, and
  groups without symmetric memory, take NCCL's all-reduce (the plain path), identically on
  every rank.
* ``"reference"``: :func:`passkit_fusion.reference.allreduce_add_layernorm` (functional
  all-reduce + add + ``F.layer_norm``), on any device: gloo and CPU tests.
"""

import torch

from .. import reference
from ..op_library import define

OP_NAME = "passkit_fusion::allreduce_add_layernorm"
IMPLEMENTATIONS = ("symm_mem", "reference")
NORM_KERNELS = ("triton", "torch")
DEFAULT_MAX_BYTES = 4 * 2**20
"""Largest message (bytes of ``x``) the one-shot path takes by default: 256 tokens at hidden
8192 in bf16. Larger ones run NCCL's all-reduce."""

SCHEMA = (
    "allreduce_add_layernorm(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, "
    "str group_name, str impl, str norm_kernel='triton', int max_bytes=4194304) -> (Tensor, Tensor)"
)

_runtime_module = None


def allreduce_add_layernorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    group_name: str,
    impl: str,
    norm_kernel: str = "triton",
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce (sum) ``x`` over ``group_name``, add ``residual`` (when given), LayerNorm
    over the last dim with ``weight`` and ``bias`` (each when given).

    Returns ``(norm_out, residual_out)``, shaped like ``x``, of ``x.dtype``. Collective:
    every rank of the group calls it with the same shapes, in the same order."""
    if impl == "reference":
        return reference.allreduce_add_layernorm(x, residual, weight, bias, eps, group_name)
    if impl == "symm_mem":
        if not x.is_cuda:
            raise RuntimeError(
                f"passkit_fusion.allreduce_add_layernorm: impl='symm_mem' needs CUDA tensors, got "
                f"{x.device} (compile with implementation='reference' to run the reference op)"
            )
        return _runtime().allreduce_add_layernorm_cuda(
            x, residual, weight, bias, eps, group_name, norm_kernel, max_bytes
        )
    raise ValueError(
        f"passkit_fusion.allreduce_add_layernorm: impl must be one of {IMPLEMENTATIONS}, got {impl!r}"
    )


def _fake(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    group_name: str,
    impl: str,
    norm_kernel: str = "triton",
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    if weight is not None:
        torch._check(weight.dim() == 1 and weight.shape[0] == x.shape[-1], lambda: "weight must be [hidden]")
    if bias is not None:
        torch._check(bias.dim() == 1 and bias.shape[0] == x.shape[-1], lambda: "bias must be [hidden]")
    if residual is not None:
        torch._check(residual.shape == x.shape, lambda: "residual must have x's shape")
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _runtime():  # type: ignore[no-untyped-def]
    global _runtime_module
    if _runtime_module is None:  # once: an import statement per call costs microseconds
        from . import runtime

        _runtime_module = runtime
    return _runtime_module


define(SCHEMA, allreduce_add_layernorm, _fake)
