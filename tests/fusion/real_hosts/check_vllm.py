"""vLLM 0.33.0's real ops (``vllm.all_reduce``, vLLM IR norms) matched by the vllm dialect.

Run in vLLM's environment with passkit and passkit_fusion importable (not collected by pytest).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import vllm.distributed.parallel_state as parallel_state
import vllm.ir.ops  # noqa: F401  (registers the vllm_ir ops)
from passkit_fusion.dialects import check_schemas
from passkit_fusion.dialects.vllm import VllmDialect

sys.path.insert(0, str(Path(__file__).parent))
from common import EPS, check, fake_world


def block(x, r, w, w2):
    y = torch.ops.vllm.all_reduce(x @ w2, "tp:0")
    out, r = torch.ops.vllm_ir.fused_add_rms_norm(y, r, w, EPS)
    z = torch.ops.vllm.all_reduce(out @ w2, "tp:0")
    return torch.ops.vllm_ir.rms_norm(z, w, EPS), r


if __name__ == "__main__":
    problems = check_schemas(VllmDialect)
    coordinator = fake_world(parallel_state)  # held: _groups keeps a weak reference
    check(block, 2, problems)
