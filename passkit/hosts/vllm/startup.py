"""What a vLLM server says about passkit at start, where a user reads it (no vLLM import).

vLLM builds its ``CompilationConfig`` (and so passkit's pass) inside ``parse_args()``,
before its logging is configured, and its engine core and workers rebuild the pass while
unpickling their config: a log record there is dropped. So the line saying what runs goes to
stderr, once per process (:func:`announce`). And a config whose compilation mode is
``NONE`` compiles nothing, so no pass ever runs: :func:`nothing_compiled_reason` names the
cause and the flag that changes it, and the adapter warns with it once per process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["SLOT", "announce", "nothing_compiled_reason", "reset"]

SLOT = "post_grad_custom_post_pass"
"""The Inductor config key vLLM's backend adds to its ``PostGradPassManager``."""

_announced: list[str] = []


def announce(line: str) -> bool:
    """Print ``line`` on stderr, once per process; True when printed now."""
    if _announced:
        return False
    _announced.append(line)
    print(line, file=sys.stderr, flush=True)
    return True


def nothing_compiled_reason(vllm_config: Any, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why vLLM compiles no graph with ``vllm_config`` (its ``VllmConfig`` after
    ``__post_init__``), naming the flag to change, or None when it compiles."""
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation, "mode", None)
    if getattr(mode, "name", str(mode)) != "NONE":
        return None
    model = getattr(vllm_config, "model_config", None)
    if getattr(model, "enforce_eager", False):
        cause = "--enforce-eager is set (drop it)"
    elif environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH") == "1":
        cause = (
            "VLLM_USE_BREAKABLE_CUDAGRAPH=1 (set by hand, or by vLLM itself for this model) disables "
            "vLLM's torch.compile pipeline (set VLLM_USE_BREAKABLE_CUDAGRAPH=0)"
        )
    else:
        cause = "the compilation mode is NONE (-O0 or -cc.mode=none: use -O2, or drop the flag)"
    return f"vLLM compiles nothing in this server: {cause}"


def reset() -> None:
    """Forget what was announced (tests)."""
    _announced.clear()
