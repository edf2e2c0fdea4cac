"""``passkit demo``'s TP=2 demo of ``allreduce_rmsnorm`` (added through ``passkit_demos``).

A Llama-style model (:mod:`passkit_fusion.model`, random weights) is sharded over two
processes and compiled with ``torch.compile`` through passkit, the pass enabled by name.

* Without two GPUs and flashinfer: two gloo processes on the CPU and the reference op. Rank
  0 prints the report (sites per layer), the numerics check against eager and a
  before/after excerpt of the graph around one fused site.
* With two GPUs and flashinfer: NCCL and the fused kernel, the numerics check, and the
  latency of one decode step (CUDA-graph replays, median) with and without the pass.

Run it with ``passkit demo --only allreduce_rmsnorm`` or ``python -m passkit_fusion.demo``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import multiprocessing
import os
import queue
import re
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .model import LlamaConfig, TinyLlama, shard_functional
from .tuning.timing import replay_median_us

PASS_NAME = "allreduce_rmsnorm"
CPU_CONFIG = LlamaConfig()
GPU_CONFIG = LlamaConfig(vocab=32000, hidden=4096, layers=8, heads=32, kv_heads=8, intermediate=14336)
"""An 8-layer stack shaped like an 8B Llama, as in DESIGN.md's measurements."""
GPU_TOKENS = (1, 16, 64, 256)
ERROR_BUDGET = 1.25
"""The compiled bf16 model's relative error vs fp32 may be at most this times eager bf16's."""

_NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
"""NVLink multicast stays off: it can take a shared host's GPUs down."""


def main(args: argparse.Namespace | None = None) -> int:
    """The demo; ``args.mode`` (``passkit demo --mode``) picks Inductor or the eager mode."""
    mode = getattr(args, "mode", None) or "inductor"
    why_not_gpu = gpu_unavailable_reason()
    if why_not_gpu is None:
        return run_gpu_demo()
    print(f"   no GPU run ({why_not_gpu}): 2 gloo processes on the CPU, reference op")
    return run_cpu_demo(mode)


def gpu_unavailable_reason() -> str | None:
    """Why the GPU variant cannot run here, or ``None``."""
    if torch.cuda.device_count() < 2:
        return f"{torch.cuda.device_count()} CUDA GPU(s), 2 needed"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed (pip install passkit-fusion[flashinfer])"
    return None


# ---------------------------------------------------------------------------------------
# CPU: gloo + the reference op


def run_cpu_demo(mode: str = "inductor") -> int:
    cfg = CPU_CONFIG
    print(
        f"== {PASS_NAME}: Llama-style model ({cfg.layers} layers, hidden {cfg.hidden}, bf16, random weights) "
        f"sharded TP=2, torch.compile(backend=passkit, mode={mode})"
    )
    print(f"   passes enabled by name: {PASS_NAME} (implementation='reference'), cleanup")
    ranks = run_world(_cpu_rank, "gloo", 2, args=(mode,), timeout=600)
    first = ranks[0]
    print(first["report"])
    plans = sorted({r["plan"] for r in ranks})
    same_plan = len(plans) == 1
    agree = f"the same sites (plan {plans[0]})" if same_plan else f"DIFFERENT sites (plans {plans})"
    print(f"\n-- both ranks fused {agree}; expected {cfg.sites()} sites (1 + 2 per layer)")
    before, after = first["excerpt"]
    if before:
        print("\n-- before (one all-reduce + residual add + RMSNorm site):")
        print("\n".join("    " + line for line in before))
        print("-- after:")
        print("\n".join("    " + line for line in after))
    accurate = all(r["numerics"].ok for r in ranks)
    print("\n-- numerics (rank 0):", first["numerics"].describe())
    print(f"compile + first run on rank 0: {first['seconds']:.1f} s")
    return 0 if accurate and first["matches"] == cfg.sites() and same_plan else 1


def _cpu_rank(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    import passkit

    torch.set_num_threads(1)
    cfg = CPU_CONFIG
    model = shard_functional(TinyLlama(cfg).to(torch.bfloat16), dist.group.WORLD, rank, world_size).eval()
    fp32 = shard_functional(TinyLlama(cfg), dist.group.WORLD, rank, world_size).eval()
    ids = torch.randint(0, cfg.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    passes = [{"name": PASS_NAME, "implementation": "reference"}, "cleanup"]
    with tempfile.TemporaryDirectory() as dump, torch.no_grad(), _without_compile_caches():
        backend = passkit.backend(passes=passes, mode=mode, dump_dir=dump)
        expected, reference = model(ids), fp32(ids)
        start = time.perf_counter()
        out = torch.compile(model, backend=backend)(ids)
        seconds = time.perf_counter() - start
        report = backend.last_report
        assert report is not None
        excerpt = site_excerpt(*_dumped_graphs(Path(dump)))
    record = report[PASS_NAME]
    plan = next((m.group(1) for note in record.notes if (m := re.search(r"plan (\w+)", note))), "-")
    return {
        "report": report.format(),
        "matches": record.matches,
        "plan": plan,
        "numerics": Numerics.measure(out, expected, reference),
        "excerpt": excerpt,
        "seconds": seconds,
    }


@contextlib.contextmanager
def _without_compile_caches() -> Iterator[None]:
    """Inductor's and AOTAutograd's caches off: a cache hit would skip the passes (and
    still run the fused graph correctly), but the demo is here to show them run."""
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        yield


@dataclasses.dataclass(frozen=True)
class Numerics:
    """The compiled model's output against eager (same dtype) and an fp32 reference."""

    vs_eager_max_abs: float
    vs_eager_relative: float
    eager_error: float
    """Relative error of the eager bf16 model vs fp32 (the bf16 path's own error)."""
    compiled_error: float
    """Relative error of the compiled (fused) bf16 model vs fp32."""

    @classmethod
    def measure(cls, compiled: torch.Tensor, eager: torch.Tensor, reference: torch.Tensor) -> Numerics:
        compiled, eager, reference = compiled.double(), eager.double(), reference.double()

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()

        return cls(
            (compiled - eager).abs().max().item(),
            rel(compiled, eager),
            rel(eager, reference),
            rel(compiled, reference),
        )

    @property
    def ok(self) -> bool:
        return self.compiled_error <= ERROR_BUDGET * self.eager_error + 2**-23

    def describe(self) -> str:
        return (
            f"vs eager bf16: max abs diff {self.vs_eager_max_abs:.2e}, relative {self.vs_eager_relative:.2e}; "
            f"vs fp32: relative error eager {self.eager_error:.2e}, compiled+fused {self.compiled_error:.2e} "
            f"(budget {ERROR_BUDGET}x) -> {'OK' if self.ok else 'TOO INACCURATE'}"
        )


def _dumped_graphs(dump: Path) -> tuple[str, str]:
    from passkit.dumps import pass_graphs

    graph = next(dump.glob(f"run-*/graph_*/*/*_{PASS_NAME}.after.py")).parent.parent
    return pass_graphs(graph, PASS_NAME)


_ASSIGN = re.compile(r"^\s+(\w+) = (.*?)(;  .* = None)?$")
_FUSED = re.compile(r"allreduce_rmsnorm\.default\((\w+), (\w+),")


def site_excerpt(before: str, after: str) -> tuple[list[str], list[str]]:
    """The lines of one fused site with a residual: the nodes it replaced in ``before``
    (from its all-reduce on) and the fused call with its outputs in ``after``."""
    before_lines = [m.groups()[:2] for line in before.splitlines() if (m := _ASSIGN.match(line))]
    after_lines = [m.groups()[:2] for line in after.splitlines() if (m := _ASSIGN.match(line))]
    kept = {name for name, _ in after_lines}
    for i, (name, code) in enumerate(after_lines):
        fused = _FUSED.search(code)
        if not fused or fused.group(2) == "None":
            continue
        x = fused.group(1)
        start = next(j for j, (_, c) in enumerate(before_lines) if "all_reduce.default(" + x + "," in c)
        end = start
        while end + 1 < len(before_lines) and before_lines[end + 1][0] not in kept:
            end += 1
        outputs = [f"{n} = {c}" for n, c in after_lines[i + 1 : i + 3] if c.startswith(name + "[")]
        return [f"{n} = {c}" for n, c in before_lines[start : end + 1]], [f"{name} = {code}", *outputs]
    return [], []


# ---------------------------------------------------------------------------------------
# GPU: NCCL + flashinfer


@dataclasses.dataclass(frozen=True)
class _Timing:
    tokens: int
    inductor_us: float
    fused_us: float


def run_gpu_demo(cfg: LlamaConfig = GPU_CONFIG, implementation: str = "flashinfer") -> int:
    """The GPU variant; ``implementation="reference"`` runs it without flashinfer."""
    print(
        f"== {PASS_NAME}: Llama-style decoder stack ({cfg.layers} layers, hidden {cfg.hidden}, "
        f"intermediate {cfg.intermediate}, bf16, random weights) sharded TP=2 over 2 GPUs, NCCL"
    )
    print(f"   passes enabled by name: {PASS_NAME} (implementation={implementation!r}), cleanup")
    ranks = run_world(_gpu_rank, "nccl", 2, args=(cfg, implementation), timeout=1200)
    first = ranks[0]
    print(first["report"])
    ok = all(r["numerics"].ok for r in ranks) and first["matches"] == cfg.sites()
    print(f"\n-- numerics at {GPU_TOKENS[-1]} tokens (rank 0):", first["numerics"].describe())
    print(f"runtime paths taken (rank 0, eager calls and captures): {first['paths']}")
    print("\none decode step, CUDA-graph replays, median over 100 (rank 0):")
    print(f"{'tokens':>8} {'Inductor (us)':>14} {'fused (us)':>11} {'speedup':>8}")
    for t in first["timings"]:
        print(f"{t.tokens:>8} {t.inductor_us:>14.1f} {t.fused_us:>11.1f} {t.inductor_us / t.fused_us:>7.2f}x")
    return 0 if ok else 1


@torch.no_grad()
@_without_compile_caches()
def _gpu_rank(rank: int, world_size: int, cfg: LlamaConfig, implementation: str) -> dict[str, Any]:
    import passkit

    from .allreduce_rmsnorm import runtime

    probe = _decode_ids(cfg, GPU_TOKENS[-1])
    with torch.device("cuda"):
        model = shard_functional(TinyLlama(cfg), dist.group.WORLD, rank, world_size).eval()
    reference = model(probe)  # fp32
    model = model.to(torch.bfloat16)
    expected = model(probe)
    fused_backend = passkit.backend(passes=[{"name": PASS_NAME, "implementation": implementation}, "cleanup"])
    outputs: dict[str, torch.Tensor] = {}
    medians: dict[str, dict[int, float]] = {}
    for name, backend in (("inductor", "inductor"), ("fused", fused_backend)):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        outputs[name] = compiled(probe)
        medians[name] = {t: _replay_median_us(compiled, _decode_ids(cfg, t)) for t in GPU_TOKENS}
    report = fused_backend.last_report
    assert report is not None
    return {
        "report": report.format(),
        "matches": report[PASS_NAME].matches,
        "numerics": Numerics.measure(outputs["fused"], expected, reference),
        "paths": runtime.stats(),
        "timings": [_Timing(t, medians["inductor"][t], medians["fused"][t]) for t in GPU_TOKENS],
    }


def _decode_ids(cfg: LlamaConfig, tokens: int) -> torch.Tensor:
    """The input of one decode step of ``tokens`` sequences: ``[tokens, 1]`` token ids,
    identical on every rank."""
    gen = torch.Generator("cuda").manual_seed(tokens)
    return torch.randint(0, cfg.vocab, (tokens, 1), device="cuda", generator=gen)


def _replay_median_us(
    fn: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor, iters: int = 100
) -> float:
    """Capture ``fn(ids)`` in a CUDA graph (after warm-up on a side stream: compiles, and
    creates the fused kernel's workspace outside capture) and time its replays."""
    return replay_median_us(lambda: fn(ids), replays=iters, before_replays=dist.barrier)


# ---------------------------------------------------------------------------------------
# running a world of processes


def run_world(
    fn: Callable[..., Any], backend: str, world_size: int, args: Sequence[Any] = (), timeout: float = 600
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank of a ``backend`` ("gloo" or "nccl")
    world of local processes; returns the ranks' values, raises if any rank failed.

    Uses ``passkit_testing``'s worlds when that distribution is installed, else a minimal
    spawner of its own (127.0.0.1 only, NVLink multicast off)."""
    try:
        from passkit_testing.worlds import gloo_world, nccl_world
    except ImportError:
        return _spawn(fn, backend, world_size, tuple(args), timeout)
    runner = gloo_world if backend == "gloo" else nccl_world
    return runner(fn, world_size, args=args, timeout=timeout)


def _spawn(
    fn: Callable[..., Any], backend: str, world_size: int, args: tuple[Any, ...], timeout: float
) -> list[Any]:
    ctx = multiprocessing.get_context("spawn")
    results: Any = ctx.Queue()
    port = _free_port()
    env = {**os.environ, **_NO_MULTICAST}
    procs = [
        ctx.Process(
            target=_rank_main, args=(fn, backend, rank, world_size, port, args, timeout, env, results)
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            try:
                rank, ok, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(values))} timed out after {timeout:g}s"
                ) from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            values[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return [values[r] for r in range(world_size)]


def _rank_main(
    fn: Callable[..., Any],
    backend: str,
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    timeout: float,
    env: dict[str, str],
    results: Any,
) -> None:
    os.environ.update(env)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        results.put((rank, True, fn(rank, world_size, *args)))
    except Exception:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    raise SystemExit(main())
