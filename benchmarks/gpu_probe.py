"""Probe a GPU machine before the fusion benchmarks: versions, GPUs, links, flashinfer's API.

Prints what the fused all-reduce + RMSNorm runtime relies on (the signatures of flashinfer's
current and legacy all-reduce fusion API, the multicast-off environment) and builds
flashinfer's trtllm communication kernels once in this single process, so that processes
started later load them instead of compiling them concurrently.

Run: python benchmarks/gpu_probe.py            (exit status 1 if a requirement is missing)
"""

from __future__ import annotations

import inspect
import os
import platform
import subprocess
import sys
import time

import torch

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0"}
API_FUNCTIONS = (
    "create_allreduce_fusion_workspace",
    "allreduce_fusion",
    "trtllm_create_ipc_workspace_for_all_reduce_fusion",
    "trtllm_allreduce_fusion",
    "trtllm_destroy_ipc_workspace_for_all_reduce_fusion",
)


def print_versions() -> None:
    """Python, torch, CUDA and NCCL versions, and each GPU."""
    print(
        f"python {platform.python_version()}  torch {torch.__version__}  "
        f"cuda {torch.version.cuda}  nccl {'.'.join(map(str, torch.cuda.nccl.version()))}"
    )
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        print(
            f"gpu {i}: {props.name}  sm_{props.major}{props.minor}  "
            f"{props.total_memory / 2**30:.0f} GiB  {props.multi_processor_count} SMs"
        )


def print_topology() -> None:
    """``nvidia-smi topo -m``: how the GPUs are linked."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30, check=False
        )
        print(out.stdout.strip() or out.stderr.strip())
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"nvidia-smi topo unavailable: {exc}")


def check_multicast_off() -> bool:
    """True when the environment keeps NVLink multicast off (required on shared machines)."""
    ok = all(os.environ.get(k) == v for k, v in MULTICAST_OFF.items())
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        print(f"{name}={os.environ.get(name)}")
    return ok


def print_flashinfer_api() -> bool:
    """flashinfer's version and the signatures of its all-reduce fusion functions."""
    try:
        import flashinfer
        import flashinfer.comm as comm
    except Exception as exc:
        print(f"flashinfer import failed: {type(exc).__name__}: {exc}")
        return False
    print(f"flashinfer {flashinfer.__version__} at {os.path.dirname(flashinfer.__file__)}")
    for name in API_FUNCTIONS:
        fn = getattr(comm, name, None)
        print(f"  {name}{inspect.signature(fn) if fn else ': absent'}")
    return True


def build_comm_kernels() -> None:
    """JIT-build (or load the prebuilt) trtllm communication module, timed."""
    from flashinfer.comm.trtllm_ar import get_trtllm_comm_module

    start = time.perf_counter()
    get_trtllm_comm_module()
    print(f"trtllm comm kernels ready in {time.perf_counter() - start:.1f} s")


def main() -> int:
    print_versions()
    print_topology()
    multicast_off = check_multicast_off()
    if not multicast_off:
        print("NVLink multicast is not disabled: refusing to go on (set NCCL_NVLS_ENABLE=0)")
        return 1
    if not print_flashinfer_api():
        return 1
    build_comm_kernels()
    return 0


if __name__ == "__main__":
    sys.exit(main())
