"""``passkit demo``'s TP=2 demo of the three passes together: ``sequence_parallel``,
``async_tp`` and ``allreduce_rmsnorm``, enabled by name and range-specialized by passkit.

One dynamic-token compile of the Llama-style model (:mod:`passkit_fusion.model`) sharded
over two processes; passkit splits the token axis where the passes' ranges differ:
``allreduce_rmsnorm`` on small token counts, ``sequence_parallel`` + ``async_tp`` on large
counts divisible by the world size, and none of them elsewhere. Each call is dispatched by
its token count; rank 0 prints one report per token range and the numerics of every call
against eager.

* Without two GPUs and flashinfer: gloo processes on the CPU, fp32, ``async_tp`` in torch's
  test mode (its fused ops computed with functional collectives) and ``allreduce_rmsnorm``'s
  reference op.
* With two GPUs and flashinfer: NCCL, bf16, flashinfer's fused kernel and symmetric memory,
  and one step's latency per token count (CUDA-graph replays) against Inductor.

Run it with ``passkit demo --only tp_passes`` or ``python -m passkit_fusion.tp_demo``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from .demo import GPU_CONFIG, _without_compile_caches, gpu_unavailable_reason, run_world
from .model import LlamaConfig, TinyLlama, shard_functional

NAME = "tp_passes"
CPU_CONFIG = LlamaConfig(layers=2)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What differs between the CPU and the GPU run."""

    backend: str
    cfg: LlamaConfig
    dtype: torch.dtype
    calls: tuple[int, ...]
    """token counts called, in this order, after the first (compiling) call"""
    small: int
    """allreduce_rmsnorm's largest token count"""
    large: int
    """sequence_parallel's and async_tp's smallest token count"""
    tolerance: float
    async_tp: str
    allreduce_rmsnorm: str

    def passes(self) -> list[Any]:
        return [
            {"name": "sequence_parallel", "min_tokens": self.large},
            {"name": "async_tp", "implementation": self.async_tp, "min_tokens": self.large},
            {"name": "allreduce_rmsnorm", "implementation": self.allreduce_rmsnorm, "max_tokens": self.small},
            "cleanup",
        ]


CPU = Setup("gloo", CPU_CONFIG, torch.float32, (4, 64, 33, 16, 128), 16, 32, 1e-4, "test_mode", "reference")
GPU = Setup("nccl", GPU_CONFIG, torch.bfloat16, (4, 64, 1024, 4096, 4095), 1024, 2048, 2e-2, "auto", "auto")
"""Token counts from 4: the model's compiled graph holds for 4 tokens and more (dynamo
guards on it; 1 to 3 tokens would compile again, statically)."""


def main(args: argparse.Namespace | None = None) -> int:
    why_not_gpu = gpu_unavailable_reason()
    setup = GPU if why_not_gpu is None else CPU
    if why_not_gpu:
        print(f"   no GPU run ({why_not_gpu}): 2 gloo processes on the CPU, fp32, test-mode/reference ops")
    cfg = setup.cfg
    print(
        f"== {NAME}: Llama-style model ({cfg.layers} layers, hidden {cfg.hidden}, {str(setup.dtype)[6:]}, "
        f"random weights) sharded TP=2 ({setup.backend}), one torch.compile with a dynamic token dimension"
    )
    print("   passes enabled by name, in this order:")
    for p in setup.passes():
        print(f"     {p}")
    ranks = run_world(_rank, setup.backend, 2, args=(setup,), timeout=1200)
    first = ranks[0]
    print(f"\n-- {len(first['reports'])} compiled specializations, one report each (rank 0):")
    for text in first["reports"]:
        print(text)
    print("\n-- calls (rank 0): token count -> the specialization it ran, relative difference vs eager")
    for call in first["calls"]:
        print(f"   {call['tokens']:>6} tokens -> {call['range']:<34} {call['rel']:.1e}")
    if first["timings"]:
        print("\none step, CUDA-graph replays, median over 50 (rank 0):")
        print(f"{'tokens':>8} {'Inductor (us)':>14} {'passkit (us)':>13} {'speedup':>8}")
        for tokens, (base, ours) in first["timings"].items():
            print(f"{tokens:>8} {base:>14.1f} {ours:>13.1f} {base / ours:>7.2f}x")
    accurate = all(c["rel"] <= setup.tolerance for r in ranks for c in r["calls"])
    same = len({tuple(r["fingerprint"]) for r in ranks}) == 1
    used = {n for r in first["ran"] for n in r}
    print(
        f"\n-- numerics within {setup.tolerance:g} of eager on every call and rank: {accurate}; "
        f"both ranks compiled the same specializations: {same}; passes that rewrote a range: {sorted(used)}"
    )
    return 0 if accurate and same and {"sequence_parallel", "allreduce_rmsnorm"} <= used else 1


@torch.no_grad()
@_without_compile_caches()
def _rank(rank: int, world_size: int, setup: Setup) -> dict[str, Any]:
    import passkit

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if setup.backend == "nccl" else torch.device("cpu")
    with device:
        model = shard_functional(TinyLlama(setup.cfg), dist.group.WORLD, rank, world_size)
    model = model.to(setup.dtype).eval()
    backend = passkit.backend(passes=setup.passes())
    compiled = torch.compile(model, backend=backend)

    def ids(tokens: int) -> torch.Tensor:
        gen = torch.Generator(device).manual_seed(tokens)
        return torch.randint(0, setup.cfg.vocab, (tokens, 1), device=device, generator=gen)

    calls = []
    for tokens in (2 * setup.large, *setup.calls):
        x = ids(tokens)
        torch._dynamo.mark_dynamic(x, 0)  # the token dimension: one compile for every count
        out, expected = compiled(x).double(), model(x).double()
        rel = (torch.linalg.vector_norm(out - expected) / torch.linalg.vector_norm(expected)).item()
        calls.append({"tokens": tokens, "range": _range_of(backend, tokens), "rel": rel})
    timings = {}
    if setup.backend == "nccl":
        from .tuning.timing import replay_median_us

        torch._dynamo.reset()
        plain = torch.compile(model)
        for tokens in setup.calls:
            x = ids(tokens)
            torch._dynamo.mark_dynamic(x, 0)
            timings[tokens] = tuple(
                replay_median_us(lambda fn=fn, x=x: fn(x), replays=50, before_replays=dist.barrier)
                for fn in (plain, compiled)
            )
    reports = backend.reports
    return {
        "reports": [r.format() for r in reports],
        "ran": [[n for n in r.names() if r[n].status == "ran" and r[n].matches] for r in reports],
        "fingerprint": [f"{r.token_range}:{[(n, r[n].matches) for n in r.names()]}" for r in reports],
        "calls": calls,
        "timings": timings,
    }


def _range_of(backend: Any, tokens: int) -> str:
    """The token range of the specialization that serves ``tokens`` (as the dispatcher picks it)."""
    dispatcher = backend.last_dispatcher
    if dispatcher is None:
        return "(one compile)"
    index = dispatcher.index_for(tokens)
    return "(fallback: every size)" if index is None else dispatcher.plan.specializations[index].label


if __name__ == "__main__":
    raise SystemExit(main())
