"""What ``implementation="auto"`` means for the collective fusion passes, in one place.

``auto`` writes the op a graph's device can run: the pass's native kernels (flashinfer's,
symmetric memory's) on a CUDA graph, and the reference op (the same values from torch ops
and ``torch.distributed``'s all-reduce: the sites fuse, nothing gets faster) on any other
device, where the native kernels cannot run. The choice of the reference op is said once
per process at WARNING, so a CPU user knows which op runs without raising the log level.
"""

from __future__ import annotations

__all__ = ["for_device", "say_chosen"]

_said: set[tuple[str, str, str]] = set()


def for_device(option: str, device: str | None, native: str) -> str:
    """The op implementation a pass with ``implementation=option`` writes into a graph on
    ``device``: ``native`` (the pass's kernels, CUDA only) or ``"reference"``."""
    if option == "reference" or (option == "auto" and device != "cuda"):
        return "reference"
    return native


def say_chosen(pass_name: str, option: str, impl: str, device: str | None, native: str) -> None:
    """Log once per process which op ``auto`` chose, where it is not the native one."""
    if option != "auto" or impl != "reference":
        return
    key = (pass_name, impl, str(device))
    if key in _said:
        return
    _said.add(key)
    from passkit import logs

    logs.log.warning(
        "passkit: %s (implementation='auto') writes the reference op into this %s graph: %s "
        "needs CUDA; the reference op computes the same values with torch.distributed's "
        "all-reduce (the sites fuse, nothing gets faster). Set implementation='reference' to "
        "choose it without this line",
        pass_name, device, native,
    )  # fmt: skip
