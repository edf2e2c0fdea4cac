"""SGLang 0.5.23's real collectives (``outplace_all_reduce``, functionalized
``inplace_all_reduce``) and its native RMSNorm matched by the sglang dialect.

Run in SGLang's environment with passkit and passkit_fusion importable (not collected by pytest).
"""

from __future__ import annotations

import sys
from pathlib import Path

import sglang.srt.distributed.parallel_state as parallel_state
import torch
from passkit_fusion.dialects import check_schemas
from passkit_fusion.dialects.sglang import SGLangDialect

sys.path.insert(0, str(Path(__file__).parent))
from common import EPS, check, fake_world


def native(x, r, w):
    """SGLang's ``RMSNorm.forward_native(x, residual)`` (what its compile paths run)."""
    dtype = x.dtype
    h = x.float() + r.float()
    r = h.to(dtype)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return (h * w).to(dtype), r


def block(x, r, w, w2):
    y = torch.ops.sglang.outplace_all_reduce(x @ w2, "tp:0", "auto")
    out, r = native(y, r, w)
    z = out @ w2
    torch.ops.sglang.inplace_all_reduce(z, "tp:0")
    return native(z, r, w)


if __name__ == "__main__":
    problems = check_schemas(SGLangDialect)
    coordinator = fake_world(parallel_state)  # held: _groups keeps a weak reference
    check(block, 2, problems)
