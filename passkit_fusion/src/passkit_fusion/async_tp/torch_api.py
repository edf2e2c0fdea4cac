"""Every torch API the ``async_tp`` pass touches, in one place (torch 2.11 to 2.15).

PyTorch ships the matcher and the fused ops of micro-pipeline tensor parallelism; they are
private (``torch._inductor.fx_passes.micro_pipeline_tp``, ``torch.distributed._symmetric_memory``)
and may move. This module imports them lazily, says in one sentence what is missing
(:func:`missing`), and wraps the two places where passkit must bend torch's behaviour:

* torch's pass returns at once where NCCL is not built in (the CPU wheels), even in its own
  test mode; :func:`forced_matching` lets it match there, for tracing tests only.
* ``enable_symm_mem_for_group`` is deprecated (FutureWarning) in 2.13 yet, up to torch 2.14,
  still the only thing that makes ``is_symm_mem_enabled_for_group`` true, which torch's pass
  requires; :func:`enable_group` calls it without the warning. It is local (it registers the
  group's store prefix with ``_SymmetricMemory.set_group_info``; no communication, no
  allocation). torch 2.15 ("symmetric memory no longer requires explicit enablement") answers
  ``is_symm_mem_enabled_for_group`` from the accelerator instead: true where a
  symmetric-memory backend is registered for the current accelerator and the group is
  registered with c10d, whatever was enabled (:func:`enabled_by_registration` says which
  rule this torch follows, :func:`accelerator_backend` what 2.15 asks). passkit still
  registers the group (harmless there) and then asks :func:`is_enabled`: the pass says so
  when torch would fuse nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

AG_MM = "fused_all_gather_matmul"
MM_RS = "fused_matmul_reduce_scatter"

_REQUIRED = {
    "torch._inductor.fx_passes.micro_pipeline_tp": ("micro_pipeline_tp_pass",),
    "torch.distributed._symmetric_memory": (
        "enable_symm_mem_for_group",
        "is_symm_mem_enabled_for_group",
        "get_symm_mem_workspace",
    ),
}
_OPTIONAL_MATCHERS = (
    "find_all_gather_patterns",
    "find_reduce_scatter_patterns",
    "_find_consumer_matmuls",
    "_find_producer_matmul",
)


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except Exception:  # ImportError, or an import-time error of a private module
        return None


def missing() -> str | None:
    """Why this torch cannot run the pass (an API passkit needs is absent), or None."""
    import torch.distributed as dist

    if not dist.is_available():
        return f"torch {torch.__version__} is built without torch.distributed"
    for mod_name, names in _REQUIRED.items():
        mod = _module(mod_name)
        if mod is None:
            return f"torch {torch.__version__} has no {mod_name} (async TP needs torch >= 2.11)"
        absent = [n for n in names if not hasattr(mod, n)]
        if absent:
            return f"torch {torch.__version__} lacks {mod_name}.{absent[0]} (async TP needs torch >= 2.11)"
    for op in (AG_MM, MM_RS):
        if not hasattr(torch.ops.symm_mem, op):
            return f"torch {torch.__version__} has no op torch.ops.symm_mem.{op}"
    return None


def symm_mem_unavailable() -> str | None:
    """Why symmetric memory cannot run in this process (CUDA-side), or None."""
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return "symmetric memory needs CUDA, and no CUDA device is visible"
    if not dist.is_nccl_available():
        return f"torch {torch.__version__} is built without NCCL, which torch's async-TP pass requires"
    try:
        from torch._C._distributed_c10d import _SymmetricMemory  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} is built without symmetric memory (_SymmetricMemory)"
    return None


def mptp() -> ModuleType:
    """``torch._inductor.fx_passes.micro_pipeline_tp``."""
    return importlib.import_module("torch._inductor.fx_passes.micro_pipeline_tp")


def symm_mem() -> ModuleType:
    """``torch.distributed._symmetric_memory``."""
    return importlib.import_module("torch.distributed._symmetric_memory")


def fused_ops() -> tuple[Any, Any]:
    """The overloads torch's pass writes: ``(fused_all_gather_matmul, fused_matmul_reduce_scatter)``."""
    return (
        torch.ops.symm_mem.fused_all_gather_matmul.default,
        torch.ops.symm_mem.fused_matmul_reduce_scatter.default,
    )


def run_torch_pass(graph: torch.fx.Graph) -> None:
    """Run torch's ``micro_pipeline_tp_pass`` on ``graph`` (in place)."""
    mptp().micro_pipeline_tp_pass(graph)


def has_matchers() -> bool:
    """Whether torch's candidate finders are there (for per-site notes; optional)."""
    mod = mptp()
    return all(hasattr(mod, n) for n in _OPTIONAL_MATCHERS)


def find_candidates(graph: torch.fx.Graph) -> tuple[list[Any], list[Any]]:
    """torch's own candidate lists: ``(all_gather matches, reduce_scatter matches)``."""
    mod = mptp()
    return list(mod.find_all_gather_patterns(graph)), list(mod.find_reduce_scatter_patterns(graph))


def consumer_matmuls(node: torch.fx.Node) -> list[Any]:
    return list(mptp()._find_consumer_matmuls(node))


def producer_matmul(node: torch.fx.Node) -> Any:
    return mptp()._find_producer_matmul(node)


def enable_group(group_name: str) -> None:
    """``enable_symm_mem_for_group(group_name)``, idempotent, without its deprecation warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        symm_mem().enable_symm_mem_for_group(group_name)


def is_enabled(group_name: str) -> bool:
    """torch's own verdict (``is_symm_mem_enabled_for_group``): whether its pass may fuse
    the group's collectives."""
    return bool(symm_mem().is_symm_mem_enabled_for_group(group_name))


def registered(group_name: str) -> bool:
    """Whether :func:`enable_group` registered the group with symmetric memory in this process."""
    return group_name in getattr(symm_mem(), "_group_name_to_store", {})


def enabled_by_registration() -> bool:
    """Whether this torch's ``is_symm_mem_enabled_for_group`` is the registration
    :func:`enable_group` makes (torch <= 2.14), not the accelerator's backend (torch >= 2.15)."""
    return torch.torch_version.TorchVersion(torch.__version__) < (2, 15)


def accelerator_backend() -> str | None:
    """The symmetric-memory backend registered for the current accelerator, which torch 2.15
    asks (``_SymmetricMemory.get_backend``); None without an accelerator, without one
    registered, or on a torch without the query."""
    accelerator = getattr(torch, "accelerator", None)
    try:
        from torch._C._distributed_c10d import _SymmetricMemory

        device = accelerator.current_accelerator(check_available=True) if accelerator else None
        backend = None if device is None else _SymmetricMemory.get_backend(device)
    except (ImportError, AttributeError, RuntimeError, TypeError):
        return None
    return None if backend is None else str(backend)


def reserve_workspace(group_name: str, nbytes: int) -> None:
    """Grow torch's per-group symmetric-memory workspace to at least ``nbytes``. Collective
    (allocation + handle exchange on every rank of the group); never during CUDA-graph capture."""
    symm_mem().get_symm_mem_workspace(group_name, min_size=nbytes)


@contextlib.contextmanager
def forced_matching() -> Iterator[None]:
    """Within the block torch's pass matches without symmetric memory or NCCL: its test mode
    (every group counts as enabled) and ``dist.is_nccl_available`` answering True.
    For tracing on CPU only: graph rewriting, nothing runs."""
    import torch.distributed as dist

    mode = getattr(symm_mem(), "_test_mode", None)
    if mode is None:
        raise RuntimeError(f"torch {torch.__version__} has no symmetric-memory test mode")
    real = dist.is_nccl_available
    dist.is_nccl_available = lambda: True  # type: ignore[assignment]
    try:
        with mode():
            yield
    finally:
        dist.is_nccl_available = real  # type: ignore[assignment]
