"""Freeing per-group GPU resources that peer ranks may still be using, without hanging.

Collective fusions hold memory shared with the other ranks of a process group (flashinfer's
IPC workspaces today, symmetric-memory buffers next). Freeing it while a kernel, ours or a
peer's, still uses it is undefined, and a kernel whose peer died never finishes. So:

* :func:`release` frees a resource only once the GPU has gone idle, each of the two steps
  (waiting for the device, destroying) bounded by a timeout; what cannot be freed safely
  stays referenced in :data:`leaked` and is left to the process's exit.
* :func:`outside_graph_pools` creates a long-lived resource where no CUDA-graph memory
  pool takes its allocations (a first call inside Inductor's CUDA-graph warm-up).
* :func:`at_exit` registers a pass's "free everything" function with passkit's ordered
  teardown (:mod:`passkit.teardown`): it runs after the CUDA graphs that could replay over
  the resources are destroyed and before the process group is, at
  ``destroy_process_group()`` or interpreter exit, without ever raising.

The registry of live resources stays with each pass (it knows their keys and state).
Nothing here imports flashinfer; CUDA is touched only when it is initialised.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

import passkit.teardown

from .teardown import bounded

__all__ = ["at_exit", "capturing", "leaked", "outside_graph_pools", "release"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

leaked: list[object] = []
"""Resources teardown could not free safely; referenced so that nothing frees them late."""


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


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA): shared
    resources are never created then, and a call that would need one runs its capturable
    fallback instead."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def at_exit(free_all: Callable[[], object], what: str) -> None:
    """Have ``free_all()`` run by passkit's ordered teardown (:func:`passkit.teardown.on_teardown`):
    after Inductor's CUDA graphs are destroyed, before the process group is, at
    ``destroy_process_group()`` or at interpreter exit; a failure is logged, never raised.
    Call it again after creating resources that a teardown already freed the previous ones of."""
    passkit.teardown.on_teardown(free_all, what)


def outside_graph_pools(create: Callable[[], T], what: str) -> T:
    """``create()``'s result, with every allocation it makes outside CUDA-graph memory pools.

    Inductor's CUDA-graph trees warm a graph up (its first call with
    ``mode="reduce-overhead"``) with every allocation of the calling thread routed to the
    graph's private memory pool, as ``torch.cuda.use_mem_pool`` and the hosts' graph pools
    do. A long-lived resource created there (the tensors of a flashinfer workspace, a
    symmetric-memory buffer) is memory the pool's owner did not allocate and does not track:
    Inductor refuses to record (``Detected 2 tensor(s) in the cudagraph pool not tracked as
    outputs``), or frees it under the resource. Pools route per thread, so ``create`` runs on
    a short-lived thread bound to the caller's CUDA device, which allocates from the
    ordinary caching allocator; the caller waits for it, and its exception (any) is
    re-raised here. Collective steps inside ``create`` are fine: every rank's caller waits
    alike. Never call it during CUDA-graph capture (nothing may be created then)."""
    device = (
        torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    )
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            result.append(create())
            if device is not None:  # the caller's stream may differ: the resource is ready for any
                torch.cuda.current_stream().synchronize()
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=run, name=f"passkit-fusion: creating the {what}")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
