"""The pass configurations ``passkit explain-hf`` reports, by label: read by its parser
(the command line builds it without importing torch) and by :mod:`.run`."""

from __future__ import annotations

from typing import Any

PASSES: dict[str, list[Any]] = {
    "allreduce_rmsnorm": [{"name": "allreduce_rmsnorm", "implementation": "reference"}],
    "allreduce_layernorm": [{"name": "allreduce_layernorm", "implementation": "reference"}],
    "sequence_parallel": [{"name": "sequence_parallel", "min_tokens": 1}],
    "sequence_parallel+async_tp": [
        {"name": "sequence_parallel", "min_tokens": 1},
        {"name": "async_tp", "implementation": "test_mode", "min_tokens": 1},
    ],
}
"""The pass configurations reported, by label (CPU stand-ins for the CUDA kernels).
``allreduce_layernorm`` (opt-in) takes the sites a LayerNorm follows, the others those an
RMSNorm follows; each reports the other kind's sites as not its own."""
