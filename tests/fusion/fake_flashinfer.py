"""A hand-written stand-in for the part of ``flashinfer.comm`` that passkit_fusion.allreduce_rmsnorm.runtime uses.

The five functions keep flashinfer 0.7.2.post1's parameter names, order, kinds and defaults
(``flashinfer/comm/allreduce.py``: ``create_allreduce_fusion_workspace``, ``allreduce_fusion``;
``flashinfer/comm/trtllm_ar.py``: ``trtllm_create_ipc_workspace_for_all_reduce_fusion``,
``trtllm_allreduce_fusion``, ``trtllm_destroy_ipc_workspace_for_all_reduce_fusion``); type
annotations are simplified. As in flashinfer, the unified API's trtllm backend shares its
workspace creation and kernel with the ``trtllm_*`` functions (passing the metadata).

Instead of CUDA kernels over IPC buffers, the bodies run on CPU tensors with
``torch.distributed`` on the workspace's process group (gloo in tests): all-reduce in fp32,
add the residual, RMS-normalise with ``rms_gamma + weight_bias``, and for the FP8 patterns
(``kARResidualRMSNormFP8Quant``, ``kARResidualRMSNormOutFP8Quant``) quantize as the kernel
does: the norm output rounded to the input dtype, times ``1 / scale_factor[0]`` in fp32,
saturated to ``float8_e4m3fn`` (``scale_factor`` must be a one-element fp32 tensor). Only
these patterns and the ``trtllm`` backend are emulated; anything else raises
``NotImplementedError``. The argument checks flashinfer makes are kept (workspace metadata,
two-shot needs more tokens than ranks, contiguous inputs), and so are the preconditions its
kernel silently relies on (the workspace's rank, world size, capacity and lamport dtype;
gamma in the input's dtype), which raise here, so that a wrong argument fails a CPU test.

:func:`install` puts modules ``flashinfer`` and ``flashinfer.comm`` into ``sys.modules``, in
one of :data:`VARIANTS`:

* ``"0.7.2"``: both APIs with the signatures above, and the compiled kernel's entry point
  (``comm.trtllm_ar.get_trtllm_comm_module().trtllm_allreduce_fusion``, recorded as
  ``kernel:trtllm_allreduce_fusion``).
* ``"legacy-only"``: only the ``trtllm_*`` functions, without the ``metadata`` /
  ``create_metadata`` / ``weight_bias`` parameters, which flashinfer added over time: the
  shape of an older API for runtime's signature probing, not a copy of one release. Calling
  them with those keywords is a ``TypeError``.
* ``"unified-no-weight-bias"``: only the unified API, ``allreduce_fusion`` without
  ``weight_bias``.

Every call of a public function is appended to :data:`CALLS` as ``(name, arguments)``.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

VERSION = "0.7.2.post1+fake"
VARIANTS = ("0.7.2", "legacy-only", "unified-no-weight-bias")

CALLS: list[tuple[str, dict[str, Any]]] = []
"""``(function name, its bound arguments)`` for every call, in order."""


class AllReduceFusionPattern:
    """The values of ``flashinfer.comm.AllReduceFusionPattern`` (0.7.2) up to those used here."""

    kAllReduce = 0
    kARResidualRMSNorm = 1
    kARResidualRMSNormFP8Quant = 2
    kARResidualRMSNormFP4Quant = 3
    kARResidualRMSNormOutFP8Quant = 4
    kARResidualRMSNormOutFP4Quant = 5


_FP8_PATTERNS = (
    AllReduceFusionPattern.kARResidualRMSNormFP8Quant,
    AllReduceFusionPattern.kARResidualRMSNormOutFP8Quant,
)


# ------------------------------------------------------------------------ workspace state


class _State:
    """What the IPC buffers of one workspace would hold: the group and the sizes."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        world_size: int,
        max_token_num: int,
        hidden_dim: int,
        use_fp32_lamport: bool,
    ) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.max_token_num, self.hidden_dim = max_token_num, hidden_dim
        self.use_fp32_lamport = use_fp32_lamport
        self.destroyed = False

    def release(self) -> None:
        """Destroyed: the group is let go, as flashinfer keeps no reference on it (a gloo
        group kept alive here past ``destroy_process_group()`` is destructed during the
        interpreter's finalization, where its worker threads abort the process)."""
        self.destroyed = True
        self.group = None  # type: ignore[assignment]


_WORKSPACES: dict[int, _State] = {}
_KEYS = itertools.count(1)


def reset() -> None:
    """Forget the recorded calls (workspaces stay)."""
    CALLS.clear()


def live_workspaces() -> int:
    """How many workspaces were created and not destroyed."""
    return sum(not s.destroyed for s in _WORKSPACES.values())


def _record(name: str, arguments: dict[str, Any]) -> None:
    CALLS.append((name, dict(arguments)))


# ------------------------------------------------------------------------ legacy (trtllm_*) API


def trtllm_create_ipc_workspace_for_all_reduce_fusion(
    tp_rank: int,
    tp_size: int,
    max_token_num: int,
    hidden_dim,
    use_fp32_lamport: bool = False,
    group: dist.ProcessGroup | None = None,
    create_metadata: bool = False,
    comm_backend: Any = None,
    use_symm_dev_mem: bool = False,
):
    _record("trtllm_create_ipc_workspace_for_all_reduce_fusion", locals())
    return _create_ipc(
        tp_rank,
        tp_size,
        max_token_num,
        hidden_dim,
        use_fp32_lamport,
        group,
        create_metadata,
        comm_backend,
        use_symm_dev_mem,
    )


def _create_ipc(
    tp_rank,
    tp_size,
    max_token_num,
    hidden_dim,
    use_fp32_lamport,
    group,
    create_metadata,
    comm_backend,
    use_symm_dev_mem,
):
    if use_symm_dev_mem and not create_metadata:
        raise ValueError("use_symm_dev_mem is only supported when create_metadata=True")
    if use_symm_dev_mem or comm_backend is not None:
        raise NotImplementedError("fake flashinfer: only the torch.distributed IPC path")
    group = group if group is not None else dist.group.WORLD
    if (tp_rank, tp_size) != (dist.get_rank(group), dist.get_world_size(group)):
        raise ValueError(
            f"tp_rank/tp_size ({tp_rank}, {tp_size}) do not match the group's "
            f"({dist.get_rank(group)}, {dist.get_world_size(group)})"
        )
    key = next(_KEYS)
    _WORKSPACES[key] = _State(group, tp_rank, tp_size, max_token_num, hidden_dim, use_fp32_lamport)
    ipc_handles = [[key] * tp_size]  # flashinfer: one list of peer pointers per buffer
    workspace_tensor = torch.tensor([key], dtype=torch.int64)  # flashinfer: the pointers
    dist.barrier(group=group)  # creation is collective
    if not create_metadata:
        return ipc_handles, workspace_tensor
    metadata = {
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "max_token_num": max_token_num,
        "hidden_dim": hidden_dim,
        "use_fp32_lamport": use_fp32_lamport,
    }
    return ipc_handles, workspace_tensor, metadata


def trtllm_destroy_ipc_workspace_for_all_reduce_fusion(
    workspace: list[list[int]], group: dist.ProcessGroup | None = None
) -> None:
    _record("trtllm_destroy_ipc_workspace_for_all_reduce_fusion", locals())
    state = _WORKSPACES[workspace[0][0]]
    if state.destroyed:
        raise RuntimeError("fake flashinfer: workspace destroyed twice")
    state.release()


def trtllm_allreduce_fusion(
    allreduce_in: torch.Tensor,
    world_size: int,
    world_rank: int,
    token_num: int,
    hidden_dim: int,
    workspace_ptrs: torch.Tensor,
    launch_with_pdl: bool,
    trigger_completion_at_end: bool,
    fp32_acc: bool,
    pattern_code: int,
    use_oneshot: bool | None,
    allreduce_out: torch.Tensor | None,
    residual_in: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    norm_out: torch.Tensor | None,
    quant_out: torch.Tensor | None,
    scale_out: torch.Tensor | None,
    rms_gamma: torch.Tensor | None,
    rms_eps: float | None,
    scale_factor: Any,
    layout_code: Any,
    metadata: dict | None = None,
    block_quant_group_size: int | None = None,
    weight_bias: float | None = None,
) -> None:
    _record("trtllm_allreduce_fusion", locals())
    if block_quant_group_size is not None or layout_code is not None:
        raise NotImplementedError("fake flashinfer: block or FP4 quantising patterns")
    _fused_kernel(
        allreduce_in,
        world_size,
        world_rank,
        token_num,
        hidden_dim,
        workspace_ptrs,
        pattern_code,
        use_oneshot,
        allreduce_out,
        residual_in,
        residual_out,
        norm_out,
        quant_out,
        rms_gamma,
        rms_eps,
        metadata,
        weight_bias,
        scale_factor,
    )


def _check_metadata(
    token_num: int, hidden_dim: int, world_size: int, dtype: torch.dtype, metadata: dict
) -> None:
    """flashinfer's ``check_trtllm_allreduce_fusion_workspace_metadata``."""
    errors = []
    if world_size != metadata["tp_size"]:
        errors.append(f"world_size ({world_size}) does not match workspace tp_size")
    if token_num * hidden_dim > metadata["max_token_num"] * metadata["hidden_dim"]:
        errors.append(f"token_num ({token_num}) * hidden_dim ({hidden_dim}) exceeds the workspace")
    if metadata["use_fp32_lamport"] != (dtype == torch.float32):
        errors.append(f"use_fp32_lamport does not match allreduce_in.dtype ({dtype})")
    if errors:
        raise ValueError("Workspace validation failed:\n" + "\n".join(errors))


def _fused_kernel(
    allreduce_in,
    world_size,
    world_rank,
    token_num,
    hidden_dim,
    workspace_ptrs,
    pattern_code,
    use_oneshot,
    allreduce_out,
    residual_in,
    residual_out,
    norm_out,
    quant_out,
    rms_gamma,
    rms_eps,
    metadata,
    weight_bias,
    scale_factor=None,
) -> None:
    if metadata is not None:
        _check_metadata(token_num, hidden_dim, world_size, allreduce_in.dtype, metadata)
    if use_oneshot is None:
        raise NotImplementedError("fake flashinfer: use_oneshot=None (flashinfer's heuristic)")
    if not use_oneshot:
        assert token_num > world_size, "sequence length should be larger than tp_size"
    fp8 = pattern_code in _FP8_PATTERNS
    if pattern_code != AllReduceFusionPattern.kARResidualRMSNorm and not fp8:
        raise NotImplementedError(f"fake flashinfer: pattern {pattern_code}")
    writes_norm = pattern_code != AllReduceFusionPattern.kARResidualRMSNormFP8Quant
    if any(t is None for t in (residual_in, residual_out, rms_gamma, rms_eps)) or (
        writes_norm and norm_out is None
    ):
        raise ValueError(f"pattern {pattern_code} needs residual_in/out, norm_out, rms_gamma, rms_eps")
    if fp8 != (quant_out is not None) or fp8 != (scale_factor is not None):
        raise ValueError(f"pattern {pattern_code}: quant_out and scale_factor go with the FP8 patterns only")
    if fp8 and not (
        isinstance(scale_factor, torch.Tensor)
        and scale_factor.dtype == torch.float32
        and scale_factor.numel() == 1
    ):
        raise RuntimeError(
            "fake flashinfer kernel: scale_factor must be a one-element fp32 tensor (the kernel reads *scale_factor)"
        )
    # What the CUDA kernel assumes without checking (it would read or write out of bounds).
    state = _WORKSPACES[int(workspace_ptrs[0])]
    dtype, numel = allreduce_in.dtype, token_num * hidden_dim
    problems = [
        state.destroyed and "the workspace was destroyed",
        (world_rank, world_size) != (state.rank, state.world_size)
        and f"rank/world size {world_rank}/{world_size} are not the workspace's",
        numel > state.max_token_num * state.hidden_dim and f"{token_num} tokens overflow the workspace",
        state.use_fp32_lamport != (dtype == torch.float32) and "lamport buffers of the wrong dtype",
        rms_gamma.dtype != dtype and f"rms_gamma is {rms_gamma.dtype}, input is {dtype}",
        rms_gamma.shape != (hidden_dim,) and f"rms_gamma has shape {tuple(rms_gamma.shape)}",
        *(
            t.shape != (numel,) and f"{name} is not a flat [{numel}] tensor"
            for name, t in (
                ("allreduce_in", allreduce_in),
                ("residual_in", residual_in),
                ("residual_out", residual_out),
                ("norm_out", norm_out),
                ("quant_out", quant_out),
            )
            if t is not None
        ),
        *(
            t.dtype != dtype and f"{name} is {t.dtype}, input is {dtype}"
            for name, t in (
                ("residual_in", residual_in),
                ("residual_out", residual_out),
                ("norm_out", norm_out),
            )
            if t is not None
        ),
        fp8
        and quant_out.dtype != torch.float8_e4m3fn
        and f"quant_out is {quant_out.dtype}, not float8_e4m3fn",
    ]
    if problems := [p for p in problems if p]:
        raise RuntimeError("fake flashinfer kernel: " + "; ".join(problems))
    summed = allreduce_in.view(token_num, hidden_dim).float()
    dist.all_reduce(summed, group=state.group)
    if allreduce_out is not None:
        allreduce_out.view(token_num, hidden_dim).copy_(summed)
    summed += residual_in.view(token_num, hidden_dim).float()
    residual_out.view(token_num, hidden_dim).copy_(summed)
    gamma = rms_gamma.float() + (weight_bias or 0.0)
    normed = (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + rms_eps) * gamma).to(dtype)
    if norm_out is not None:
        norm_out.view(token_num, hidden_dim).copy_(normed)
    if fp8:
        inverse = 1.0 / scale_factor.reshape(()).float()
        quant = (normed.float() * inverse).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        quant_out.view(token_num, hidden_dim).copy_(quant)


# ------------------------------------------------------------------------ unified API


class TRTLLMAllReduceFusionWorkspace:
    """flashinfer's trtllm workspace: wraps the ``trtllm_*`` IPC workspace (with metadata)."""

    def __init__(
        self,
        tp_size: int,
        tp_rank: int,
        max_token_num: int,
        hidden_dim: int,
        dtype: torch.dtype = torch.float16,
        comm_backend: Any = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.world_size, self.rank = tp_size, tp_rank
        self.ipc_handles, self.workspace_tensor, self.metadata = _create_ipc(
            tp_rank=tp_rank,
            tp_size=tp_size,
            max_token_num=max_token_num,
            hidden_dim=hidden_dim,
            use_fp32_lamport=dtype == torch.float32,
            group=group,
            create_metadata=True,
            comm_backend=comm_backend,
            use_symm_dev_mem=False,
        )
        self._destroyed = False

    @property
    def backend(self) -> str:
        return "trtllm"

    def destroy(self) -> None:
        CALLS.append(("TRTLLMAllReduceFusionWorkspace.destroy", {}))
        if self._destroyed:
            return
        _WORKSPACES[self.ipc_handles[0][0]].release()
        self._destroyed = True


def create_allreduce_fusion_workspace(
    backend: str = "auto",
    world_size: int | None = None,
    rank: int | None = None,
    max_token_num: int | None = None,
    hidden_dim: int | None = None,
    dtype: torch.dtype | None = None,
    gpus_per_node: int | None = None,
    comm_backend: Any = None,
    force_oneshot_support: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    top_k: int | None = None,
    rms_eps: float | None = None,
    weight_bias: float | None = None,
    routed_scaling_factor: float | None = None,
    include_shared_expert: bool | None = None,
    add_residual: bool | None = None,
    write_residual_output: bool | None = None,
    apply_rms_norm: bool | None = None,
    output_dtype: torch.dtype | None = None,
    dynamic_fp8: bool | None = None,
    write_norm_output: bool | None = None,
    config: Any = None,
) -> TRTLLMAllReduceFusionWorkspace:
    _record("create_allreduce_fusion_workspace", locals())
    if backend not in ("trtllm", "mnnvl", "mnnvl-cutedsl", "auto"):
        raise ValueError(f"unknown backend {backend!r}")
    if backend != "trtllm":  # "auto" may choose an NVLink-multicast backend on real hardware
        raise NotImplementedError(f"fake flashinfer: backend {backend!r}")
    if None in (world_size, rank, max_token_num, hidden_dim, dtype):
        raise ValueError("world_size, rank, max_token_num, hidden_dim and dtype are required")
    return TRTLLMAllReduceFusionWorkspace(
        world_size, rank, max_token_num, hidden_dim, dtype, comm_backend, group
    )


def allreduce_fusion(
    input: torch.Tensor,
    workspace: TRTLLMAllReduceFusionWorkspace,
    pattern: int,
    launch_with_pdl: bool = False,
    trigger_completion_at_end: bool = True,
    output: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    norm_out: torch.Tensor | None = None,
    quant_out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    residual_in: torch.Tensor | None = None,
    rms_gamma: torch.Tensor | None = None,
    rms_eps: float = 1e-06,
    scale_factor: Any = None,
    layout_code: int | None = None,
    use_oneshot: bool | None = None,
    fp32_acc: bool = False,
    moe_reduction_device_num_experts: int | None = None,
    moe_reduction_scale_input: torch.Tensor | None = None,
    moe_reduction_active_experts_token_input: torch.Tensor | None = None,
    moe_reduction_token_input: torch.Tensor | None = None,
    expanded_idx_to_permuted_idx: torch.Tensor | None = None,
    expert_scale_factor: torch.Tensor | None = None,
    shared_expert_output: torch.Tensor | None = None,
    block_quant_group_size: int | None = None,
    weight_bias: float = 0.0,
    *,
    moe_finalize_backend: str = "trtllm",
) -> torch.Tensor:
    _record("allreduce_fusion", locals())
    if not isinstance(workspace, TRTLLMAllReduceFusionWorkspace):
        raise NotImplementedError(f"fake flashinfer: workspace {type(workspace).__name__}")
    token_num, hidden_dim = input.shape  # flashinfer unpacks exactly two dims

    def flat(t: torch.Tensor | None, name: str) -> torch.Tensor | None:
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        return None if t is None else t.view(-1)

    output = torch.empty_like(input) if output is None else output
    if block_quant_group_size is not None or layout_code is not None:
        raise NotImplementedError("fake flashinfer: block or FP4 quantising patterns")
    if isinstance(scale_factor, int | float):  # flashinfer wraps a number in a tensor
        scale_factor = torch.tensor([scale_factor], dtype=torch.float32)
    _fused_kernel(
        flat(input, "input"),
        workspace.world_size,
        workspace.rank,
        token_num,
        hidden_dim,
        workspace.workspace_tensor,
        pattern,
        use_oneshot,
        flat(output, "output"),
        flat(residual_in, "residual_in"),
        flat(residual_out, "residual_out"),
        flat(norm_out, "norm_out"),
        flat(quant_out, "quant_out"),
        rms_gamma,
        rms_eps,
        workspace.metadata,
        weight_bias,
        scale_factor,
    )
    if norm_out is not None:
        return norm_out
    return quant_out if quant_out is not None else output


# ------------------------------------------------------------------------ compiled entry point


def _kernel_entry(
    allreduce_in: torch.Tensor,
    world_size: int,
    world_rank: int,
    token_num: int,
    hidden_dim: int,
    workspace_ptrs: torch.Tensor,
    launch_with_pdl: bool,
    use_oneshot: bool,
    trigger_completion_at_end: bool,
    fp32_acc: bool,
    pattern_code: int,
    allreduce_out: torch.Tensor | None,
    residual_in: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    norm_out: torch.Tensor | None,
    quant_out: torch.Tensor | None,
    scale_out: torch.Tensor | None,
    rms_gamma: torch.Tensor | None,
    rms_eps: float | None,
    scale_factor: Any,
    layout_code: Any,
    block_quant_group_size: int | None = None,
    weight_bias: float | None = None,
) -> None:
    """``trtllm_ar.get_trtllm_comm_module().trtllm_allreduce_fusion`` (0.7.2's parameters):
    no Python checks; the C++ reads data pointers only, so any contiguous tensor with
    ``token_num * hidden_dim`` elements is accepted (checked here)."""
    _record("kernel:trtllm_allreduce_fusion", locals())
    if block_quant_group_size is not None or layout_code is not None:
        raise NotImplementedError("fake flashinfer: block or FP4 quantising patterns")

    def flat(t: torch.Tensor | None, name: str) -> torch.Tensor | None:
        if t is None:
            return None
        if not t.is_contiguous() or t.numel() != token_num * hidden_dim:
            raise RuntimeError(
                f"fake flashinfer kernel: {name} is not a contiguous [{token_num}, {hidden_dim}]"
            )
        return t.view(-1)

    _fused_kernel(
        flat(allreduce_in, "allreduce_in"),
        world_size,
        world_rank,
        token_num,
        hidden_dim,
        workspace_ptrs,
        pattern_code,
        use_oneshot,
        flat(allreduce_out, "allreduce_out"),
        flat(residual_in, "residual_in"),
        flat(residual_out, "residual_out"),
        flat(norm_out, "norm_out"),
        flat(quant_out, "quant_out"),
        rms_gamma,
        rms_eps,
        None,
        weight_bias,
        scale_factor,
    )


def get_trtllm_comm_module() -> types.SimpleNamespace:
    """``flashinfer.comm.trtllm_ar.get_trtllm_comm_module``: the loaded kernel module's functions."""
    return types.SimpleNamespace(trtllm_allreduce_fusion=_kernel_entry)


# ------------------------------------------------------------------------ modules


def _without(fn: Callable[..., Any], *names: str) -> Callable[..., Any]:
    """``fn`` without parameters ``names`` (in its signature and when called)."""
    signature = inspect.signature(fn)
    reduced = signature.replace(parameters=[p for p in signature.parameters.values() if p.name not in names])

    def older(*args: Any, **kwargs: Any) -> Any:
        bound = reduced.bind(*args, **kwargs)  # TypeError for a parameter it lacks
        return fn(**bound.arguments)

    older.__name__ = older.__qualname__ = fn.__name__
    older.__signature__ = reduced  # type: ignore[attr-defined]
    return older


def make_modules(variant: str = "0.7.2") -> tuple[types.ModuleType, types.ModuleType]:
    """New ``flashinfer`` and ``flashinfer.comm`` modules of the given :data:`VARIANTS`."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    comm = types.ModuleType("flashinfer.comm")
    comm.AllReduceFusionPattern = AllReduceFusionPattern
    if variant in ("0.7.2", "unified-no-weight-bias"):
        comm.create_allreduce_fusion_workspace = create_allreduce_fusion_workspace
        comm.allreduce_fusion = (
            allreduce_fusion if variant == "0.7.2" else _without(allreduce_fusion, "weight_bias")
        )
    if variant == "0.7.2":
        comm.trtllm_create_ipc_workspace_for_all_reduce_fusion = (
            trtllm_create_ipc_workspace_for_all_reduce_fusion
        )
        comm.trtllm_allreduce_fusion = trtllm_allreduce_fusion
        comm.trtllm_ar = types.ModuleType("flashinfer.comm.trtllm_ar")
        comm.trtllm_ar.get_trtllm_comm_module = get_trtllm_comm_module
    elif variant == "legacy-only":
        comm.trtllm_create_ipc_workspace_for_all_reduce_fusion = _without(
            trtllm_create_ipc_workspace_for_all_reduce_fusion,
            "create_metadata",
            "comm_backend",
            "use_symm_dev_mem",
        )
        comm.trtllm_allreduce_fusion = _without(
            trtllm_allreduce_fusion, "metadata", "block_quant_group_size", "weight_bias"
        )
    if variant != "unified-no-weight-bias":
        comm.trtllm_destroy_ipc_workspace_for_all_reduce_fusion = (
            trtllm_destroy_ipc_workspace_for_all_reduce_fusion
        )
    flashinfer = types.ModuleType("flashinfer")
    flashinfer.__version__ = VERSION
    flashinfer.__path__ = []  # a package, so that ``import flashinfer.comm`` finds the submodule
    flashinfer.comm = comm
    return flashinfer, comm


def install(variant: str = "0.7.2") -> types.ModuleType:
    """Put the fake ``flashinfer`` and ``flashinfer.comm`` into ``sys.modules``; return comm."""
    flashinfer, comm = make_modules(variant)
    sys.modules["flashinfer"] = flashinfer
    sys.modules["flashinfer.comm"] = comm
    return comm


# ----------------------------------------------------------------------------------------
# A pretend GPU, for processes that run passkit_fusion.allreduce_rmsnorm.runtime's fused paths on the CPU


class LooksCuda(torch.Tensor):
    """A CPU tensor whose ``is_cuda`` is True: passes runtime's per-call CUDA check."""

    @property
    def is_cuda(self) -> bool:
        return True


def clear_runtime_caches() -> None:
    """Forget what runtime learnt about flashinfer and CUDA (both are faked here)."""
    from passkit_fusion.allreduce_rmsnorm import flashinfer_api

    flashinfer_api.flashinfer_comm.cache_clear()
    flashinfer_api.select_api.cache_clear()
    flashinfer_api.unavailable.cache_clear()


class _IdleStream:
    """A pretend GPU's stream: nothing ever runs on it."""

    def synchronize(self) -> None:
        return None


def pretend_gpu(name: str = "Fake GPU") -> None:
    """In this process (a rank): torch.cuda reports one sm90 GPU called ``name`` (device 0)
    that is never capturing a graph and whose ``synchronize`` (and its stream's) returns at once, and runtime's
    per-call check sees CPU inputs as CUDA ones."""
    from passkit_fusion.allreduce_rmsnorm import runtime

    torch.cuda.is_available = lambda: True
    torch.cuda.is_initialized = lambda: True
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_name = lambda device=None: name
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: 0
    torch.cuda.set_device = lambda device: None
    torch.cuda.current_stream = lambda device=None: _IdleStream()
    call_unavailable = runtime._call_unavailable

    def with_cpu_tensors(x: torch.Tensor, weight_bias: float) -> str | None:
        return call_unavailable(x.as_subclass(LooksCuda), weight_bias)

    runtime._call_unavailable = with_cpu_tensors
    clear_runtime_caches()
