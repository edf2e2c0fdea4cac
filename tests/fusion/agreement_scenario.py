"""One compile of a 1-layer TinyLlama on a fresh group, on each rank of a gloo world: the
scenario the plan-agreement tests of the passes that change a collective run, one after
another (``allreduce_overlap``, ``sequence_parallel``)."""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist
from passkit_fusion.collective import RankAgreementError
from passkit_fusion.model import LlamaConfig, TinyLlama, shard_functional

import passkit


def compile_on_a_fresh_group(
    rank: int,
    world_size: int,
    pass_config: dict[str, Any] | None,
    ids: torch.Tensor,
    *,
    agree_timeout_s: float,
    group_timeout_s: float,
    compare_eager: bool,
) -> dict[str, Any]:
    """Compile (passkit's eager mode, ``on_error="raise"``) with ``pass_config`` (None: no pass
    on this rank) and ``cleanup``, and call it on ``ids``. Returns ``type`` (None, or the
    error's class name) with ``message`` and, for a ``RankAgreementError``, every rank's
    ``ranks``; ``seconds`` from compile to output or error; with ``compare_eager``, whether
    the output equals the eager model's (``matches_eager``: an eager call is a collective,
    so only where every rank got an output). The ranks leave together (a barrier)."""
    torch._dynamo.reset()
    group = dist.new_group(timeout=datetime.timedelta(seconds=group_timeout_s))
    model = TinyLlama(LlamaConfig(layers=1, kv_heads=4)).float().eval()
    shard_functional(model, group, rank, world_size)
    passes = [{**pass_config, "collective_timeout_s": agree_timeout_s}] if pass_config is not None else []
    backend = passkit.backend(passes=[*passes, "cleanup"], mode="eager", on_error="raise")
    start = time.monotonic()
    out: dict[str, Any] = {"type": None}
    try:
        with torch.no_grad():
            got = torch.compile(model, backend=backend)(ids)
            if compare_eager:
                out["matches_eager"] = bool(torch.allclose(got, model(ids), atol=1e-5, rtol=1e-5))
    except Exception as exc:
        out = {"type": type(exc).__name__, "message": str(exc)}
        if isinstance(exc, RankAgreementError):
            out["ranks"] = exc.ranks
    out["seconds"] = time.monotonic() - start
    dist.barrier()  # the next scenario starts together
    return out
