"""Measuring the fused all-reduce + RMSNorm op for decision tables: :func:`tune`.

:func:`tune` times the unfused path (NCCL + Inductor's add + RMSNorm) and flashinfer's
one-shot and two-shot kernels per token count on an initialised process group and turns the
medians into a :class:`~passkit_fusion.tuning.tables.Table`. The ``passkit tune`` command
(:mod:`passkit_fusion.tuning.cli`) runs it on N local GPUs; the table model and the rule
from measurements to decisions live in :mod:`passkit_fusion.tuning.tables`, the timing
helper in :mod:`passkit_fusion.tuning.timing`.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

from ..reference import rms_norm
from ..tuning.tables import (
    DEFAULT_MARGIN,
    DEFAULT_TUNE_TOKENS,
    Decision,
    Entry,
    Measurement,
    Table,
    TableKey,
    dtype_name,
    rules_from_measurements,
)
from ..tuning.timing import graph_median_us
from . import runtime

__all__ = [
    "make_inputs",
    "measure",
    "replays_for",
    "time_fused_us",
    "time_unfused_us",
    "tune",
]

# ----------------------------------------------------------------------------------------
# Measuring (needs CUDA and an initialised process group)
# ----------------------------------------------------------------------------------------


def replays_for(tokens: int, hidden: int) -> int:
    """Graph replays per measurement, from the shape alone so all ranks agree."""
    numel = tokens * hidden
    if numel <= 2**20:
        return 200
    return 100 if numel <= 2**23 else 40


def make_inputs(
    tokens: int, hidden: int, dtype: torch.dtype, rank: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``(x, residual, weight)`` on the current GPU.

    ``x`` differs per rank; ``residual`` and ``weight`` are identical on every rank, as in
    tensor parallelism (the fused kernel requires it).
    """
    device = torch.device("cuda", torch.cuda.current_device())
    x = _randn((tokens, hidden), seed * 1000 + 17 + rank, dtype, device)
    residual = _randn((tokens, hidden), seed * 1000 + 3, dtype, device)
    weight = 1.0 + 0.1 * _randn((hidden,), seed * 1000 + 5, torch.float32, device)
    return x, residual, weight.to(dtype)


def time_unfused_us(
    group: Any,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    replays: int = 100,
    norm: Literal["inductor", "eager"] = "inductor",
) -> float:
    """NCCL all-reduce (in place, as a compiled graph runs it), then add + RMSNorm as
    Inductor generates them (``norm="inductor"``, what the unfused graph runs when the pass
    leaves a site alone) or in eager torch (``"eager"``, the op's own fallback)."""
    import torch.distributed as dist

    buf = x.clone()
    add_norm = _compiled_add_rmsnorm() if norm == "inductor" else _eager_add_rmsnorm

    def step() -> None:
        dist.all_reduce(buf, group=group)
        add_norm(buf, residual, weight, eps)

    return graph_median_us(step, reset=lambda: buf.copy_(x), replays=replays)


def _eager_add_rmsnorm(
    reduced: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = reduced + residual
    return rms_norm(total, weight, eps, 0.0), total


@functools.cache
def _compiled_add_rmsnorm() -> Callable[..., Any]:
    """Residual add + Llama's RMSNorm, compiled by Inductor for any token count."""

    def add_rmsnorm(
        reduced: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = reduced + residual
        h = total.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(total.dtype), total

    return torch.compile(add_rmsnorm, dynamic=True, fullgraph=True)


def time_fused_us(
    group_name: str,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    decision: Decision,
    replays: int = 100,
) -> float:
    """passkit's op with ``decision`` forced (it must have a prepared workspace)."""
    with runtime.forced(decision):
        return graph_median_us(
            lambda: runtime.fused_allreduce_rmsnorm_cuda(x, residual, weight, eps, 0.0, group_name),
            replays=replays,
        )


def measure(group: Any, hidden: int, dtype: torch.dtype, tokens: int, eps: float = 1e-6) -> Measurement:
    """Time unfused, fused one-shot and (where legal) fused two-shot at one token count.

    Collective: every rank of ``group`` calls it with the same arguments.  The medians are
    max-reduced over the ranks so that every rank returns the same measurement.
    """
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    x, residual, weight = make_inputs(tokens, hidden, dtype, dist.get_rank(group))
    replays = replays_for(tokens, hidden)
    name = group.group_name
    times = [
        time_unfused_us(group, x, residual, weight, eps, replays),
        time_fused_us(name, x, residual, weight, eps, Decision(True, True), replays),
        time_fused_us(name, x, residual, weight, eps, Decision(True, False), replays)
        if tokens > world_size and world_size in runtime.TWOSHOT_WORLD_SIZES
        else -1.0,
    ]
    agreed = torch.tensor(times, dtype=torch.float64, device=x.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    unfused, oneshot, twoshot = agreed.tolist()
    return Measurement(tokens, unfused, oneshot, twoshot if twoshot >= 0 else None)


def tune(
    group: Any,
    hidden: int,
    dtype: torch.dtype,
    token_counts: Iterable[int] = DEFAULT_TUNE_TOKENS,
    *,
    margin: float = DEFAULT_MARGIN,
    eps: float = 1e-6,
) -> Table:
    """Measure the three variants on the current GPUs and return a one-entry table.

    Collective over ``group`` (every rank calls it with the same arguments and gets the
    same table).  Creates a workspace for ``max(token_counts)`` tokens through
    :func:`passkit_fusion.allreduce_rmsnorm.runtime.prepare`.
    """
    import torch.distributed as dist

    counts = sorted(set(token_counts))
    if not counts or counts[0] < 1:
        raise ValueError(f"token_counts must be positive integers, got {counts}")
    prepared = runtime.prepare(group.group_name, hidden, dtype, max_tokens=counts[-1])
    if prepared < counts[-1]:
        raise RuntimeError(
            f"cannot tune: the fused kernel is unavailable here ({runtime.unavailable_reason()})"
        )
    measurements = [measure(group, hidden, dtype, t, eps) for t in counts]
    key = TableKey(torch.cuda.get_device_name(), dist.get_world_size(group), hidden, dtype_name(dtype))
    source = {
        "measured": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "flashinfer": runtime.flashinfer_version(),
        "margin": margin,
        "medians_us": [dataclasses.asdict(m) for m in measurements],
    }
    return Table({key: Entry(rules_from_measurements(measurements, margin), source)})


def _randn(shape: tuple[int, ...], seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
