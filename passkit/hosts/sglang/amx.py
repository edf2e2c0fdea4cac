"""SGLang on a CPU with AMX tiles (Intel Sapphire Rapids and later): what its all-reduce does
there, and the one thing passkit does about it. No SGLang import at module level.

SGLang's ``GroupCoordinator.all_reduce`` sends a CPU tensor to
``torch.ops.sgl_kernel.shm_allreduce`` when ``is_shm_available`` holds, which asks
``cpu_has_amx_support()``: AMX tiles (``torch.cpu._is_amx_tile_supported()``) *and*
sgl_kernel's CPU backend, found by ``import sgl_kernel`` in an ``lru_cache``'d helper,
``_is_intel_amx_backend_available``. Dynamo ignores ``lru_cache`` and traces the helper's
body, so the import runs inside the trace, and where sgl_kernel does not import (a CPU-only
machine with SGLang's CUDA wheels, or none installed) the trace fails (``Unsupported: Import
failure ... sgl_kernel``), with or without passkit. Without AMX tiles the helper is never
called and CPU tensors take torch's functional all-reduce.

:func:`prepare` (passkit's SGLang plugin and :func:`passkit.hosts.sglang.install` call it on
an AMX CPU) asks SGLang's helper once, outside any trace, and pins its answer: the module's
``_is_intel_amx_backend_available`` becomes a function returning that answer, which Dynamo
traces as a constant. Without sgl_kernel's CPU backend the trace then takes torch's
functional all-reduce, which passkit-fusion reads; with it, SGLang's
``sgl_kernel.shm_allreduce``, which passkit-fusion's sglang dialect does not read (its sites
are not fused; the report says no all-reduce was found). :func:`check` is the same as a
``passkit check`` line (it asks, and pins nothing).
"""

from __future__ import annotations

import importlib.util
from typing import Any

FUNCTIONAL = (
    "this CPU has AMX tiles and sgl_kernel's CPU backend is not available: passkit asked SGLang's "
    "AMX check (which imports sgl_kernel; inside Dynamo's trace that fails with 'Import failure "
    "... sgl_kernel') before tracing and pinned its answer, so SGLang all-reduces CPU tensors "
    "with torch's functional all-reduce, which passkit-fusion fuses"
)
SHM = (
    "this CPU has AMX tiles and sgl_kernel's CPU backend loads: SGLang all-reduces CPU tensors "
    "with sgl_kernel.shm_allreduce (its shared-memory kernel), which passkit-fusion's sglang "
    "dialect does not read: allreduce_rmsnorm and sequence_parallel find no all-reduce site on "
    "this CPU (uninstall sgl_kernel's CPU build to use torch's all-reduce there)"
)
UNKNOWN = (
    "this CPU has AMX tiles, and SGLang's cpu_has_amx_support() could not be asked ({why}): "
    "if SGLang imports sgl_kernel while Dynamo traces, the trace fails ('Import failure ... "
    "sgl_kernel'); without passkit, make sgl_kernel importable or run on a CPU without AMX"
)


def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles, as torch (and SGLang) read it."""
    import torch

    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except Exception:
        return False


def prepare(pin: bool = True) -> tuple[bool, str] | None:
    """On an AMX CPU: ask SGLang's AMX check now, outside any trace, and (``pin``) make
    SGLang's ``_is_intel_amx_backend_available`` return that answer from now on (see the
    module docstring); ``(ok, what SGLang's all-reduce does on CPU tensors)``, ``ok`` False
    when passkit-fusion cannot fuse there. None without AMX tiles."""
    if not amx_tiles():
        return None
    try:
        common: Any = importlib.import_module("sglang.srt.utils.common")
        helper = getattr(common, "_is_intel_amx_backend_available", None)
        backend = bool(helper()) if helper is not None else False
        if pin and helper is not None and not getattr(helper, "passkit_pinned", False):
            common._is_intel_amx_backend_available = _pinned(helper, backend)
        shm = bool(common.cpu_has_amx_support())
    except Exception as exc:
        return False, UNKNOWN.format(why=f"{type(exc).__name__}: {exc}")
    return (False, SHM) if shm else (True, FUNCTIONAL)


def _pinned(helper: Any, answer: bool) -> Any:
    """``helper`` answering ``answer`` without running (Dynamo traces it as a constant)."""

    def _is_intel_amx_backend_available() -> bool:
        return answer

    _is_intel_amx_backend_available.passkit_pinned = True  # type: ignore[attr-defined]
    _is_intel_amx_backend_available.__wrapped__ = helper  # type: ignore[attr-defined]
    _is_intel_amx_backend_available.cache_clear = getattr(helper, "cache_clear", lambda: None)  # type: ignore[attr-defined]
    return _is_intel_amx_backend_available


def check() -> tuple[bool, str] | None:
    """``passkit check``'s line for SGLang on this CPU (None: SGLang not installed, or no
    AMX tiles: nothing to say)."""
    if importlib.util.find_spec("sglang") is None or not amx_tiles():
        return None
    return prepare(pin=False)
