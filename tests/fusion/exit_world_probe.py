"""Rank function for a ``passkit_testing.gloo_world`` exit check (see test_exit.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from passkit_fusion.model import LlamaConfig, TinyLlama, shard_functional

import passkit


def compile_and_run(rank: int, world_size: int, pass_name: str, compiler: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = shard_functional(TinyLlama(LlamaConfig(layers=1)), dist.group.WORLD, rank, world_size).eval()
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    passes = [{"name": pass_name, "implementation": "reference"}] if pass_name != "none" else []
    backend = passkit.backend(passes=passes, compiler=compiler)
    with torch.no_grad():
        expected = model(ids)
        out = torch.compile(model, backend=backend)(ids)
    record = backend.last_report[pass_name] if passes and backend.last_report else None
    return {
        "close": bool(torch.allclose(out.float(), expected.float(), rtol=1e-3, atol=1e-3)),
        "status": record.status if record else None,
        "matches": record.matches if record else None,
    }
