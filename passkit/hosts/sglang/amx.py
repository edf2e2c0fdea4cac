"""SGLang on a CPU with AMX tiles (Intel Sapphire Rapids and later): what its all-reduce does
there, and the one thing passkit does about it. No SGLang import at module level.

SGLang's ``GroupCoordinator.all_reduce`` sends a CPU tensor to
``torch.ops.sgl_kernel.shm_allreduce`` when ``is_shm_available`` holds, which asks
``cpu_has_amx_support()``: AMX tiles (``torch.cpu._is_amx_tile_supported()``) *and*
sgl_kernel's CPU backend, found by ``import sgl_kernel`` in an ``lru_cache``'d helper. When
that helper first runs while Dynamo traces the model, Dynamo meets the import and the trace
fails (``Import failure ... sgl_kernel``), with or without passkit. Without AMX tiles the
helper is never called and CPU tensors take torch's functional all-reduce.

:func:`prepare` answers SGLang's question once, outside any trace (passkit's SGLang plugin
and :func:`passkit.hosts.sglang.install` call it on an AMX CPU), so the trace reads the cached
answer: without sgl_kernel's CPU backend the trace takes torch's functional all-reduce, which
passkit-fusion reads; with it, SGLang's ``sgl_kernel.shm_allreduce``, which passkit-fusion's
sglang dialect does not read (its sites are not fused; the report says no all-reduce was
found). :func:`check` is the same as a ``passkit check`` line.
"""

from __future__ import annotations

import importlib.util
from typing import Any

FUNCTIONAL = (
    "this CPU has AMX tiles and sgl_kernel's CPU backend is not available: passkit answered "
    "SGLang's cpu_has_amx_support() before Dynamo traces (that check imports sgl_kernel, and an "
    "import inside a trace fails: 'Import failure ... sgl_kernel'), so SGLang all-reduces CPU "
    "tensors with torch's functional all-reduce, which passkit-fusion fuses"
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
    "sgl_kernel'); call sglang.srt.utils.common.cpu_has_amx_support() once before compiling"
)


def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles, as torch (and SGLang) read it."""
    import torch

    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except Exception:
        return False


def prepare() -> tuple[bool, str] | None:
    """On an AMX CPU: ask SGLang's ``cpu_has_amx_support()`` now (outside any trace, so its
    cached answer is what the trace reads); ``(ok, what SGLang's all-reduce does on CPU
    tensors)``, ``ok`` False when passkit-fusion cannot fuse there. None without AMX tiles."""
    if not amx_tiles():
        return None
    try:
        common: Any = importlib.import_module("sglang.srt.utils.common")
        shm = bool(common.cpu_has_amx_support())
    except Exception as exc:
        return False, UNKNOWN.format(why=f"{type(exc).__name__}: {exc}")
    return (False, SHM) if shm else (True, FUNCTIONAL)


def check() -> tuple[bool, str] | None:
    """``passkit check``'s line for SGLang on this CPU (None: SGLang not installed, or no
    AMX tiles: nothing to say)."""
    if importlib.util.find_spec("sglang") is None or not amx_tiles():
        return None
    return prepare()
