"""``torch.ops.passkit_fusion.allreduce_rmsnorm`` and ``allreduce_rmsnorm_fp8``: the ops the pass swaps in.

``allreduce_rmsnorm_fp8`` is the same computation followed by a static per-tensor
``float8_e4m3fn`` quantization of the norm output (``scale`` is the dequantization scale,
a one-element tensor); it returns ``(quant_out, norm_out, residual_out)``, ``norm_out``
empty (shape ``[0]``) unless ``need_norm_out``.

A functional ``torch.library`` custom op (new outputs, inputs untouched) with a fake
implementation, so it traces, compiles and re-propagates like any ATen op. Importing this
module registers it: the pass imports it when it runs, and :mod:`passkit_fusion.lazy_ops`
when the op is first looked up, so graphs that Inductor restores from its cache (where the
pass does not run again) still find the op.

``impl`` picks the implementation, fixed in the graph at compile time:

* ``"flashinfer"``: flashinfer's fused kernel through :mod:`passkit_fusion.allreduce_rmsnorm.runtime` (CUDA),
  which creates its workspace lazily on the first call and falls back to the unfused
  computation, identically on every rank, where the kernel cannot run (e.g. more tokens
  than the workspace holds).
* ``"reference"``: :func:`passkit_fusion.reference.allreduce_rmsnorm`, on any device.

``max_tokens`` (``None``: sized by the runtime from the tuned table, up to the largest token
count the table fuses) and ``check_rank_consistency`` travel in the graph too: they are handed to
``runtime.configure`` on the first flashinfer call of the process (and again only if they
change), so they hold after a cache hit as well.

The ops are defined with ``torch.library.Library`` (schema, one implementation for every
device, a fake), not ``torch.library.custom_op``: a compiled graph calls them once per site
on every forward, and ``custom_op``'s Python wrappers (its autograd layer and alias checks)
cost two to three times the dispatcher's own call (15.7 vs 7.0 us on a busy CPU core, measured with
``benchmarks/op_host_cost.py``), which a launch-bound forward without CUDA graphs pays per site.
"""

import torch

from .. import reference
from ..op_library import define

OP_NAME = "passkit_fusion::allreduce_rmsnorm"
FP8_OP_NAME = "passkit_fusion::allreduce_rmsnorm_fp8"
IMPLEMENTATIONS = ("flashinfer", "reference")

SCHEMA = (
    "allreduce_rmsnorm(Tensor x, Tensor? residual, Tensor weight, float eps, float weight_bias, "
    "str group_name, str impl, SymInt? max_tokens=None, bool check_rank_consistency=True) -> (Tensor, Tensor)"
)
FP8_SCHEMA = (
    "allreduce_rmsnorm_fp8(Tensor x, Tensor? residual, Tensor weight, float eps, float weight_bias, "
    "Tensor scale, str group_name, str impl, bool need_norm_out, SymInt? max_tokens=None, "
    "bool check_rank_consistency=True) -> (Tensor, Tensor, Tensor)"
)

_runtime_settings: tuple[int | None, bool] | None = None
"""The ``(max_tokens, check_rank_consistency)`` last handed to ``runtime.configure``."""
_runtime_module = None
""":mod:`.runtime`, once the first flashinfer call imported it."""


def allreduce_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_bias: float,
    group_name: str,
    impl: str,
    max_tokens: int | None = None,
    check_rank_consistency: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce (sum) ``x`` over the process group ``group_name``, add ``residual`` (when
    given), RMS-normalise over the last dim with ``weight + weight_bias``.

    Returns ``(norm_out, residual_out)``, both shaped like ``x`` and of ``x.dtype``;
    ``residual_out`` is the all-reduced sum (with the residual). Collective: every rank of
    the group calls it with the same shapes, in the same order.
    """
    if impl == "reference":
        return reference.allreduce_rmsnorm(x, residual, weight, eps, weight_bias, group_name)
    if impl == "flashinfer":
        return _flashinfer(
            x, residual, weight, eps, weight_bias, group_name, max_tokens, check_rank_consistency
        )
    raise ValueError(f"passkit_fusion.allreduce_rmsnorm: impl must be one of {IMPLEMENTATIONS}, got {impl!r}")


def _fake(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_bias: float,
    group_name: str,
    impl: str,
    max_tokens: int | None = None,
    check_rank_consistency: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(weight.dim() == 1 and weight.shape[0] == x.shape[-1], lambda: "weight must be [hidden]")
    if residual is not None:
        torch._check(residual.shape == x.shape, lambda: "residual must have x's shape")
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _flashinfer(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_bias: float,
    group_name: str,
    max_tokens: int | None,
    check_rank_consistency: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    runtime = _runtime(x, max_tokens, check_rank_consistency)
    return runtime.fused_allreduce_rmsnorm_cuda(x, residual, weight, eps, weight_bias, group_name)


def allreduce_rmsnorm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_bias: float,
    scale: torch.Tensor,
    group_name: str,
    impl: str,
    need_norm_out: bool,
    max_tokens: int | None = None,
    check_rank_consistency: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`allreduce_rmsnorm`, then quantize the norm output to ``float8_e4m3fn`` with the
    static per-tensor dequantization scale ``scale`` (``quant_out * scale ~ norm_out``).

    Returns ``(quant_out, norm_out, residual_out)``: ``quant_out`` shaped like ``x``,
    ``norm_out`` like ``x`` when ``need_norm_out`` (else empty, shape ``[0]``),
    ``residual_out`` like ``x``. Collective, like :func:`allreduce_rmsnorm`.
    """
    if impl == "reference":
        return reference.allreduce_rmsnorm_fp8(
            x, residual, weight, eps, weight_bias, scale, group_name, need_norm_out
        )
    if impl == "flashinfer":
        runtime = _runtime(x, max_tokens, check_rank_consistency)
        return runtime.fused_allreduce_rmsnorm_fp8_cuda(
            x, residual, weight, eps, weight_bias, scale, group_name, need_norm_out
        )
    raise ValueError(
        f"passkit_fusion.allreduce_rmsnorm_fp8: impl must be one of {IMPLEMENTATIONS}, got {impl!r}"
    )


def _fake_fp8(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_bias: float,
    scale: torch.Tensor,
    group_name: str,
    impl: str,
    need_norm_out: bool,
    max_tokens: int | None = None,
    check_rank_consistency: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _fake(x, residual, weight, eps, weight_bias, group_name, impl)
    torch._check(scale.numel() == 1, lambda: "scale must have one element (a per-tensor scale)")
    norm_out = x.new_empty(x.shape) if need_norm_out else x.new_empty((0,))
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), norm_out, x.new_empty(x.shape)


define(SCHEMA, allreduce_rmsnorm, _fake)
define(FP8_SCHEMA, allreduce_rmsnorm_fp8, _fake_fp8)


def _runtime(x: torch.Tensor, max_tokens: int | None, check_rank_consistency: bool):
    """The CUDA runtime, configured with the graph's settings (see the module docstring)."""
    global _runtime_module, _runtime_settings
    if not x.is_cuda:
        raise RuntimeError(
            f"passkit_fusion.allreduce_rmsnorm: impl='flashinfer' needs CUDA tensors, got {x.device} "
            "(compile with implementation='reference' to run the reference op)"
        )
    if _runtime_module is None:  # once: an import statement per call costs microseconds
        from . import runtime  # imports flashinfer lazily itself

        _runtime_module = runtime
    settings = (max_tokens, check_rank_consistency)
    if _runtime_settings != settings:
        _runtime_module.configure(max_tokens=max_tokens, check_rank_consistency=check_rank_consistency)
        _runtime_settings = settings
    return _runtime_module
