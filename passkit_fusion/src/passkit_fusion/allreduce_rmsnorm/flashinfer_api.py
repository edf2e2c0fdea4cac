"""flashinfer's fused all-reduce + residual add + RMSNorm, behind one interface.

flashinfer exposes the kernel through two APIs: the unified one
(``create_allreduce_fusion_workspace`` + ``allreduce_fusion``, flashinfer >= 0.5) and the
older ``trtllm_*`` functions; :class:`UnifiedApi` and :class:`LegacyApi` adapt both to
:class:`FlashinferApi` (create a workspace, run the kernel, destroy the workspace), probing
the signatures for the parameters flashinfer added over time (``weight_bias``,
``metadata``). :class:`KernelApi` (the default where it is found) creates the unified API's
workspace and calls the compiled kernel's entry point
(``flashinfer.comm.trtllm_ar.get_trtllm_comm_module().trtllm_allreduce_fusion``) directly:
both Python APIs re-validate every argument at every call (about 55 us of host time per call
on an H200 host, against 5-12 us of kernel at 1-256 tokens), which passkit checks once per
site and token count; without CUDA graphs that host time is what the fusion must save. Its
parameters are probed when the first workspace is created (loading the kernel module);
an entry point without them falls back to the unified API, with a warning. With ``quant_out`` and ``scale_factor`` the kernel also quantizes the norm
output to ``float8_e4m3fn`` (patterns ``kARResidualRMSNormFP8Quant`` /
``kARResidualRMSNormOutFP8Quant``): it computes ``fp8(norm_out * (1 / *scale_factor))``
with saturation, reading ``scale_factor`` (a one-element fp32 CUDA tensor, the
dequantization scale) at run time, so a CUDA graph sees later updates of it. :func:`select_api` picks one, :func:`unavailable` says why none can run.

flashinfer is imported lazily, on the first call of :func:`flashinfer_comm`; this module
imports without it and without CUDA. The results are cached per process.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import sys
from types import ModuleType
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

__all__ = [
    "SUPPORTED_SM_MAJORS",
    "ApiName",
    "FlashinferApi",
    "KernelApi",
    "KernelHandle",
    "LegacyApi",
    "LegacyHandle",
    "UnifiedApi",
    "flashinfer_comm",
    "flashinfer_version",
    "select_api",
    "unavailable",
]

logger = logging.getLogger(__name__)

#: Compute-capability majors flashinfer builds its trtllm all-reduce kernels for.
SUPPORTED_SM_MAJORS = frozenset({9, 10, 12})

ApiName = Literal["auto", "kernel", "unified", "legacy"]
API_NAMES: tuple[str, ...] = ("auto", "kernel", "unified", "legacy")


class FlashinferApi(Protocol):
    name: str
    supports_weight_bias: bool
    supports_fp8: bool
    """The FP8 patterns (``kARResidualRMSNormFP8Quant``, ``kARResidualRMSNormOutFP8Quant``) exist."""

    def create(
        self,
        *,
        group: dist.ProcessGroup,
        rank: int,
        world_size: int,
        max_tokens: int,
        hidden: int,
        dtype: torch.dtype,
    ) -> Any: ...

    def run(
        self,
        handle: Any,
        *,
        x: torch.Tensor,
        residual: torch.Tensor,
        gamma: torch.Tensor,
        eps: float,
        weight_bias: float,
        oneshot: bool,
        norm_out: torch.Tensor | None,
        residual_out: torch.Tensor,
        quant_out: torch.Tensor | None = None,
        scale_factor: torch.Tensor | None = None,
        launch_with_pdl: bool = False,
    ) -> None: ...

    def destroy(self, handle: Any) -> None: ...


class UnifiedApi:
    """``create_allreduce_fusion_workspace`` + ``allreduce_fusion`` (flashinfer >= 0.5)."""

    name = "unified"

    def __init__(self, comm: ModuleType) -> None:
        self._comm = comm
        self.supports_weight_bias = _accepts(comm.allreduce_fusion, "weight_bias")
        self.supports_fp8 = _has_fp8_patterns(comm)

    def create(
        self,
        *,
        group: dist.ProcessGroup,
        rank: int,
        world_size: int,
        max_tokens: int,
        hidden: int,
        dtype: torch.dtype,
    ) -> Any:
        workspace = self._comm.create_allreduce_fusion_workspace(
            backend="trtllm",
            world_size=world_size,
            rank=rank,
            max_token_num=max_tokens,
            hidden_dim=hidden,
            dtype=dtype,
            group=group,
        )
        if getattr(workspace, "backend", "trtllm") != "trtllm":
            workspace.destroy()
            raise RuntimeError(
                f"flashinfer created a {workspace.backend!r} workspace when "
                "asked for 'trtllm'; refusing to use it"
            )
        return workspace

    def run(
        self,
        handle: Any,
        *,
        x: torch.Tensor,
        residual: torch.Tensor,
        gamma: torch.Tensor,
        eps: float,
        weight_bias: float,
        oneshot: bool,
        norm_out: torch.Tensor | None,
        residual_out: torch.Tensor,
        quant_out: torch.Tensor | None = None,
        scale_factor: torch.Tensor | None = None,
        launch_with_pdl: bool = False,
    ) -> None:
        extra: dict[str, Any] = {"weight_bias": weight_bias} if weight_bias else {}
        if quant_out is not None:
            extra.update(quant_out=quant_out, scale_factor=scale_factor)
        self._comm.allreduce_fusion(
            input=x,
            workspace=handle,
            pattern=pattern_code(self._comm, norm_out is not None, quant_out is not None),
            launch_with_pdl=launch_with_pdl,
            trigger_completion_at_end=True,
            residual_out=residual_out,
            norm_out=norm_out,
            residual_in=residual,
            rms_gamma=gamma,
            rms_eps=eps,
            use_oneshot=oneshot,
            **extra,
        )

    def destroy(self, handle: Any) -> None:
        handle.destroy()


#: The compiled entry point's parameters :class:`KernelApi` passes (flashinfer 0.7's names).
KERNEL_PARAMETERS = (
    "allreduce_in", "world_size", "world_rank", "token_num", "hidden_dim", "workspace_ptrs",
    "launch_with_pdl", "use_oneshot", "trigger_completion_at_end", "fp32_acc", "pattern_code",
    "allreduce_out", "residual_in", "residual_out", "norm_out", "quant_out", "scale_out",
    "rms_gamma", "rms_eps", "scale_factor", "layout_code",
)  # fmt: skip


@dataclasses.dataclass
class KernelHandle:
    """A unified-API workspace and the kernel entry point that runs on it (None: the entry
    point lacks :data:`KERNEL_PARAMETERS`; the unified API runs instead)."""

    workspace: Any
    kernel: Any
    workspace_ptrs: torch.Tensor
    rank: int
    world_size: int


class KernelApi(UnifiedApi):
    """The unified API's ``trtllm`` workspace, the kernel's compiled entry point called directly
    (see the module docstring): the same kernel and arguments as :class:`UnifiedApi`, without
    flashinfer's per-call Python checks (passkit's runtime makes them once per site)."""

    name = "kernel"

    def __init__(self, comm: ModuleType, trtllm_ar: ModuleType) -> None:
        super().__init__(comm)
        self._trtllm_ar = trtllm_ar
        patterns = comm.AllReduceFusionPattern
        self._patterns = {(True, False): patterns.kARResidualRMSNorm}
        if self.supports_fp8:
            self._patterns[(False, True)] = patterns.kARResidualRMSNormFP8Quant
            self._patterns[(True, True)] = patterns.kARResidualRMSNormOutFP8Quant

    def create(
        self,
        *,
        group: dist.ProcessGroup,
        rank: int,
        world_size: int,
        max_tokens: int,
        hidden: int,
        dtype: torch.dtype,
    ) -> KernelHandle:
        workspace = super().create(
            group=group, rank=rank, world_size=world_size, max_tokens=max_tokens, hidden=hidden, dtype=dtype
        )
        return KernelHandle(workspace, self._entry_point(), workspace.workspace_tensor, rank, world_size)

    def _entry_point(self) -> Any:
        kernel = self._trtllm_ar.get_trtllm_comm_module().trtllm_allreduce_fusion
        missing = [p for p in KERNEL_PARAMETERS if not _accepts(kernel, p)]
        if self.supports_weight_bias and not _accepts(kernel, "weight_bias"):
            missing.append("weight_bias")
        if missing:
            logger.warning(
                "passkit_fusion: flashinfer's trtllm_allreduce_fusion entry point lacks %s; "
                "calling it through flashinfer's unified API instead (more host time per call)",
                ", ".join(missing),
            )
            return None
        return kernel

    def run(
        self,
        handle: KernelHandle,
        *,
        x: torch.Tensor,
        residual: torch.Tensor,
        gamma: torch.Tensor,
        eps: float,
        weight_bias: float,
        oneshot: bool,
        norm_out: torch.Tensor | None,
        residual_out: torch.Tensor,
        quant_out: torch.Tensor | None = None,
        scale_factor: torch.Tensor | None = None,
        launch_with_pdl: bool = False,
    ) -> None:
        if handle.kernel is None:
            super().run(
                handle.workspace, x=x, residual=residual, gamma=gamma, eps=eps, weight_bias=weight_bias,
                oneshot=oneshot, norm_out=norm_out, residual_out=residual_out, quant_out=quant_out,
                scale_factor=scale_factor, launch_with_pdl=launch_with_pdl,
            )  # fmt: skip
            return
        extra = {"weight_bias": weight_bias} if weight_bias else {}
        tokens, hidden = x.shape
        handle.kernel(
            allreduce_in=x,
            world_size=handle.world_size,
            world_rank=handle.rank,
            token_num=tokens,
            hidden_dim=hidden,
            workspace_ptrs=handle.workspace_ptrs,
            launch_with_pdl=launch_with_pdl,
            use_oneshot=oneshot,
            trigger_completion_at_end=True,
            fp32_acc=False,
            pattern_code=self._patterns[(norm_out is not None, quant_out is not None)],
            allreduce_out=None,
            residual_in=residual,
            residual_out=residual_out,
            norm_out=norm_out,
            quant_out=quant_out,
            scale_out=None,
            rms_gamma=gamma,
            rms_eps=eps,
            scale_factor=scale_factor,
            layout_code=None,
            **extra,
        )

    def destroy(self, handle: KernelHandle) -> None:
        handle.workspace.destroy()


@dataclasses.dataclass
class LegacyHandle:
    ipc_handles: Any
    workspace_tensor: torch.Tensor
    metadata: dict[str, Any] | None
    group: dist.ProcessGroup
    rank: int
    world_size: int


class LegacyApi:
    """``trtllm_create_ipc_workspace_for_all_reduce_fusion`` + ``trtllm_allreduce_fusion``."""

    name = "legacy"

    def __init__(self, comm: ModuleType) -> None:
        self._comm = comm
        self.supports_weight_bias = _accepts(comm.trtllm_allreduce_fusion, "weight_bias")
        self.supports_fp8 = _has_fp8_patterns(comm)
        self._takes_metadata = _accepts(comm.trtllm_allreduce_fusion, "metadata")
        self._makes_metadata = _accepts(
            comm.trtllm_create_ipc_workspace_for_all_reduce_fusion, "create_metadata"
        )

    def create(
        self,
        *,
        group: dist.ProcessGroup,
        rank: int,
        world_size: int,
        max_tokens: int,
        hidden: int,
        dtype: torch.dtype,
    ) -> LegacyHandle:
        extra = {"create_metadata": True} if self._makes_metadata else {}
        created = self._comm.trtllm_create_ipc_workspace_for_all_reduce_fusion(
            tp_rank=rank,
            tp_size=world_size,
            max_token_num=max_tokens,
            hidden_dim=hidden,
            use_fp32_lamport=dtype == torch.float32,
            group=group,
            **extra,
        )
        metadata = created[-1] if self._makes_metadata else None
        return LegacyHandle(created[0], created[1], metadata, group, rank, world_size)

    def run(
        self,
        handle: LegacyHandle,
        *,
        x: torch.Tensor,
        residual: torch.Tensor,
        gamma: torch.Tensor,
        eps: float,
        weight_bias: float,
        oneshot: bool,
        norm_out: torch.Tensor | None,
        residual_out: torch.Tensor,
        quant_out: torch.Tensor | None = None,
        scale_factor: torch.Tensor | None = None,
        launch_with_pdl: bool = False,
    ) -> None:
        extra: dict[str, Any] = {"weight_bias": weight_bias} if weight_bias else {}
        if self._takes_metadata and handle.metadata is not None:
            extra["metadata"] = handle.metadata
        tokens, hidden = x.shape
        self._comm.trtllm_allreduce_fusion(
            allreduce_in=x.view(-1),
            world_size=handle.world_size,
            world_rank=handle.rank,
            token_num=tokens,
            hidden_dim=hidden,
            workspace_ptrs=handle.workspace_tensor,
            launch_with_pdl=launch_with_pdl,
            use_oneshot=oneshot,
            trigger_completion_at_end=True,
            fp32_acc=False,
            pattern_code=pattern_code(self._comm, norm_out is not None, quant_out is not None),
            allreduce_out=None,
            residual_in=residual.view(-1),
            residual_out=residual_out.view(-1),
            norm_out=None if norm_out is None else norm_out.view(-1),
            quant_out=None if quant_out is None else quant_out.view(-1),
            scale_out=None,
            rms_gamma=gamma,
            rms_eps=eps,
            scale_factor=scale_factor,
            layout_code=None,
            **extra,
        )

    def destroy(self, handle: LegacyHandle) -> None:
        self._comm.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(handle.ipc_handles, group=handle.group)


def _has_fp8_patterns(comm: ModuleType) -> bool:
    patterns = comm.AllReduceFusionPattern
    return hasattr(patterns, "kARResidualRMSNormFP8Quant") and hasattr(
        patterns, "kARResidualRMSNormOutFP8Quant"
    )


def pattern_code(comm: ModuleType, norm_out: bool, quant_out: bool) -> int:
    """flashinfer's pattern for the outputs wanted: ``kARResidualRMSNorm`` (norm only),
    ``kARResidualRMSNormFP8Quant`` (FP8 only), ``kARResidualRMSNormOutFP8Quant`` (both).
    Every pattern also writes ``residual_out``."""
    patterns = comm.AllReduceFusionPattern
    if not quant_out:
        return patterns.kARResidualRMSNorm
    return patterns.kARResidualRMSNormOutFP8Quant if norm_out else patterns.kARResidualRMSNormFP8Quant


def _accepts(fn: Any, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@functools.cache
def flashinfer_comm() -> ModuleType | None:
    try:
        import flashinfer.comm as comm
    except Exception as exc:  # ImportError, or a broken install failing at import time
        level = logging.DEBUG if isinstance(exc, ModuleNotFoundError) else logging.WARNING
        logger.log(
            level,
            "flashinfer.comm unavailable (%s: %s); the fused all-reduce + "
            "RMSNorm falls back to torch.distributed",
            type(exc).__name__,
            exc,
        )
        return None
    return comm


@functools.cache
def select_api(preference: ApiName) -> FlashinferApi | None:
    comm = flashinfer_comm()
    if comm is None:
        return None
    unified = hasattr(comm, "create_allreduce_fusion_workspace") and hasattr(comm, "allreduce_fusion")
    legacy = hasattr(comm, "trtllm_create_ipc_workspace_for_all_reduce_fusion") and hasattr(
        comm, "trtllm_allreduce_fusion"
    )
    trtllm_ar = getattr(comm, "trtllm_ar", None)
    kernel = unified and hasattr(trtllm_ar, "get_trtllm_comm_module")
    if kernel and preference in ("auto", "kernel"):
        return KernelApi(comm, trtllm_ar)
    if unified and preference in ("auto", "unified"):
        return UnifiedApi(comm)
    if legacy and preference in ("auto", "legacy"):
        return LegacyApi(comm)
    return None


def flashinfer_version() -> str | None:
    """The installed flashinfer's version, or None when it cannot be imported."""
    if flashinfer_comm() is None:
        return None
    return str(getattr(sys.modules.get("flashinfer"), "__version__", "unknown"))


@functools.cache
def unavailable(preference: ApiName) -> str | None:
    """Why this process cannot run the fused kernel with the API ``preference``, or None."""
    if not torch.cuda.is_available():
        return "cuda_unavailable"
    if flashinfer_comm() is None:
        return "flashinfer_missing"
    if select_api(preference) is None:
        return f"flashinfer_api_missing:{preference}"
    if torch.cuda.get_device_capability()[0] not in SUPPORTED_SM_MAJORS:
        return "gpu_arch_unsupported"
    return None
