"""What the package's row-wise Triton kernels share (one program per row, the whole hidden
dimension in one block: the residual add + LayerNorm of ``allreduce_layernorm``, the partials
+ residual + RMSNorm of ``allreduce_overlap``): the block and the warps for a hidden size.
Imports without Triton."""

from __future__ import annotations

MAX_BLOCK = 65536
"""The largest hidden size a row fits in one program's block."""


def row_block(hidden: int, kernel: str) -> tuple[int, int]:
    """``(block, num_warps)`` for rows of ``hidden`` elements: the next power of two, and 4,
    8 or 16 warps as it grows. A hidden size above :data:`MAX_BLOCK` is a ``ValueError``
    naming ``kernel``."""
    block = 1 << max(hidden - 1, 0).bit_length()
    if block > MAX_BLOCK:
        raise ValueError(f"{kernel}: hidden {hidden} above {MAX_BLOCK}")
    return block, 4 if block <= 2048 else 8 if block <= 8192 else 16
