"""Logging: the ``passkit`` logger, registered with torch so ``TORCH_LOGS=passkit`` works,
and structured artifacts that tlparse shows."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

log = logging.getLogger("passkit")
_registered = False


def register_with_torch() -> None:
    """Make ``TORCH_LOGS=passkit`` (or ``+passkit`` for debug) control our logger."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        from torch._logging._internal import log_registry, register_log

        if "passkit" not in log_registry.log_alias_to_log_qnames:
            register_log("passkit", "passkit")
            if "passkit" in os.environ.get("TORCH_LOGS", ""):
                import torch._logging._internal as internal

                # re-read TORCH_LOGS now that the alias exists (it resets every torch
                # logger: tens of milliseconds, so only when TORCH_LOGS names passkit)
                internal._init_logs()
    except Exception:  # pragma: no cover - private API moved; plain logging still works
        log.debug("could not register the passkit logger with torch._logging", exc_info=True)


def artifact(name: str, payload: Callable[[], str], encoding: str = "json") -> None:
    """Emit a structured-trace artifact (shown by tlparse); free when tracing is off."""
    try:
        from torch._logging import trace_structured

        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": name, "encoding": encoding},
            payload_fn=payload,
        )
    except Exception:  # pragma: no cover
        log.debug("structured trace failed", exc_info=True)
