"""The end of a distributed program that compiled with CUDA graphs: what is freed, in which order.

A CUDA graph that captured an NCCL collective holds a reference on the NCCL communicator
until the graph is destroyed, and NCCL (>= 2.26) destroys a communicator only once those
references are gone: ``torch.distributed.destroy_process_group()`` blocks forever while a
captured graph is alive (pytorch/pytorch#115388). Inductor's CUDA-graph trees
(``mode="reduce-overhead"``) keep every graph they record for the life of the process, so a
program whose compiled graphs captured a collective (sequence parallelism's reduce-scatter
and all-gather, an unfused all-reduce) never returns from its last line.

passkit orders the end instead. :func:`teardown` runs, once per set of resources:

1. wait for the GPU to finish its queued work (bounded: a kernel waiting for a dead peer
   never finishes, and destroying a graph that still runs is undefined; past the bound the
   graphs are left alone and a warning says so);
2. destroy the CUDA graphs Inductor's CUDA-graph trees recorded (NCCL's references drop), and
   reset Dynamo, so that a compiled function called afterwards compiles and records again
   instead of replaying a graph that is gone;
3. free what passes registered with :func:`on_teardown`, last registered first
   (passkit-fusion's flashinfer IPC workspaces and symmetric memory): no graph that could
   replay over them is left;

and then torch destroys the process group. :func:`guard_process_groups` (called by a
passkit backend that compiles with CUDA graphs, and by passes that register resources) wraps
``torch.distributed.destroy_process_group`` so that :func:`teardown` runs first, and runs it
at interpreter exit too (a program that never destroys its group: the process group is
destroyed after the interpreter's exit handlers). Graphs a host records itself (vLLM's and
SGLang's ``torch.cuda.CUDAGraph`` objects) belong to the host, which frees them.
"""

from __future__ import annotations

import atexit
import functools
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["guard_process_groups", "on_teardown", "recorded_cuda_graphs", "release_cuda_graphs", "teardown"]

logger = logging.getLogger("passkit")

GPU_IDLE_TIMEOUT_S = 30.0
"""How long :func:`teardown` waits for the GPU before it leaves the graphs alone."""

_frees: dict[Callable[[], object], str] = {}
_lock = threading.Lock()
_guarded = False


def on_teardown(free: Callable[[], object], what: str) -> None:
    """Have :func:`teardown` call ``free()`` after the CUDA graphs are gone (once per
    function until it has run; register again after creating new resources). ``free`` must
    not raise; if it does, the error is logged. Also guards process-group destruction
    (:func:`guard_process_groups`)."""
    with _lock:
        _frees[free] = what
    guard_process_groups()


def recorded_cuda_graphs() -> int | None:
    """How many CUDA graphs Inductor's CUDA-graph trees of this thread hold (``None`` when
    their internals cannot be read on this torch)."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None or not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0  # nothing recorded one (and importing Inductor to learn that costs seconds)
    try:

        if not torch._C._is_key_in_tls("tree_manager_containers"):
            return 0
        count = 0
        for container in trees.get_obj(trees.local, "tree_manager_containers").values():
            manager = getattr(container, "tree_manager", None)
            if manager is None or manager.roots is None:
                continue
            nodes = [n for roots in manager.roots.values() for n in roots]
            while nodes:
                node = nodes.pop()
                nodes.extend(c for children in node.children.values() for c in children)
                count += getattr(node, "graph", None) is not None
        return count
    except Exception:  # private internals of another torch release
        return None


def release_cuda_graphs(*, timeout_s: float = GPU_IDLE_TIMEOUT_S) -> int | None:
    """Destroy the CUDA graphs Inductor's CUDA-graph trees recorded, once the GPU is idle,
    and reset Dynamo so that compiled functions record again at their next call. Returns how
    many graphs were destroyed (``None``: unknown on this torch; 0 also when the GPU did not
    go idle within ``timeout_s``, which is logged)."""
    count = recorded_cuda_graphs()
    if count == 0:
        return 0
    if not _gpu_idle(timeout_s):
        logger.warning(
            "passkit: the GPU did not finish its work within %g s (a collective waiting for a peer "
            "that died?): the %s CUDA graph(s) Inductor recorded are left alive, and NCCL's "
            "destroy_process_group() waits for them",
            timeout_s,
            "?" if count is None else count,
        )
        return 0
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    reset_cudagraph_trees()
    torch._dynamo.reset()  # compiled functions compile (and record) again at their next call
    logger.info("passkit: destroyed %s CUDA graph(s) recorded by Inductor", "?" if count is None else count)
    return count


def teardown(reason: str = "teardown") -> None:
    """Free, in order, what a compiled distributed program holds (the module's docstring):
    the GPU idle, Inductor's CUDA graphs, then the resources registered with
    :func:`on_teardown`, last registered first. Never raises."""
    try:
        release_cuda_graphs()
    except Exception as exc:
        logger.warning("passkit: destroying Inductor's CUDA graphs before %s failed: %s", reason, exc)
    with _lock:
        frees = list(_frees.items())[::-1]
        _frees.clear()
    for free, what in frees:
        try:
            free()
        except Exception as exc:
            logger.warning("passkit: freeing %s before %s failed: %s", what, reason, exc)


def _gpu_idle(timeout_s: float) -> bool:
    done = threading.Event()

    def sync() -> None:
        torch.cuda.synchronize()
        done.set()

    threading.Thread(target=sync, name="passkit: waiting for the GPU", daemon=True).start()
    return done.wait(timeout_s)


def guard_process_groups() -> None:
    """Make ``torch.distributed.destroy_process_group`` run :func:`teardown` first, and run
    :func:`teardown` at interpreter exit. Idempotent; the wrapper keeps the original's
    signature, name and docstring."""
    global _guarded
    with _lock:
        if _guarded or not torch.distributed.is_available():
            return
        _guarded = True
    import torch.distributed.distributed_c10d as c10d

    original = c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        teardown("destroy_process_group()")
        return original(*args, **kwargs)

    destroy_process_group.__passkit_original__ = original  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group
    if torch.distributed.destroy_process_group is original:
        torch.distributed.destroy_process_group = destroy_process_group
    atexit.register(teardown, "interpreter exit")
