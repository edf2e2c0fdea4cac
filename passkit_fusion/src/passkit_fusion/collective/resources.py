"""Freeing per-group GPU resources that peer ranks may still be using, without hanging.

Collective fusions hold memory shared with the other ranks of a process group (flashinfer's
IPC workspaces today, symmetric-memory buffers next). Freeing it while a kernel, ours or a
peer's, still uses it is undefined, and a kernel whose peer died never finishes. So:

* :func:`release` frees a resource only once the GPU has gone idle, each of the two steps
  (waiting for the device, destroying) bounded by a timeout; what cannot be freed safely
  stays referenced in :data:`leaked` and is left to the process's exit.
* :func:`at_exit` registers a pass's "free everything" function once, to run at
  interpreter exit without ever raising (the exit status stays the process's own).

The registry of live resources stays with each pass (it knows their keys and state).
Nothing here imports flashinfer; CUDA is touched only when it is initialised.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable

import torch

from .teardown import bounded

__all__ = ["at_exit", "leaked", "release"]

logger = logging.getLogger(__name__)

leaked: list[object] = []
"""Resources teardown could not free safely; referenced so that nothing frees them late."""

_at_exit: set[Callable[[], object]] = set()


def release(resource: object, destroy: Callable[[], object], *, timeout_s: float, what: str) -> bool:
    """Free ``resource`` by calling ``destroy()`` once the GPU is done with it; True if freed.

    When the device does not go idle within ``timeout_s``, or ``destroy`` does not return
    (or raises) within it, ``resource`` is appended to :data:`leaked` instead, with a log
    line naming ``what``, and False is returned."""
    gpu_busy = (
        torch.cuda.is_available()
        and torch.cuda.is_initialized()
        and not bounded(torch.cuda.synchronize, timeout_s, f"waiting for the GPU before freeing the {what}")
    )
    if gpu_busy:
        leaked.append(resource)  # keep it referenced: no destructor frees it under a kernel
        logger.warning(
            "passkit_fusion: the GPU did not go idle: a fused kernel is most likely waiting "
            "for a peer rank that died. Anything that synchronizes the device will block too "
            "(dist.destroy_process_group(), torch.cuda.synchronize(), freeing CUDA memory)."
        )
        return False
    if not bounded(destroy, timeout_s, f"destroying the {what}"):
        leaked.append(resource)
        return False
    return True


def at_exit(free_all: Callable[[], object], what: str) -> None:
    """Run ``free_all()`` at interpreter exit (registered once per function), logging
    instead of raising when it fails."""
    if free_all in _at_exit:
        return
    _at_exit.add(free_all)

    def run() -> None:
        try:
            free_all()
        except Exception as exc:
            logger.warning("passkit_fusion: destroying %s at exit failed: %s", what, exc)

    atexit.register(run)
