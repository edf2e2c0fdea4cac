"""Op-level benchmark: a row-parallel matmul and its all-reduce, with and without overlap.

For the Llama-8B row-parallel projections sharded over ``--world`` local GPUs (attention's
output projection ``[T, 4096/W] @ [4096/W, 4096]`` and the MLP's down projection
``[T, 14336/W] @ [14336/W, 4096]``, bf16), at each token count T it times side by side, in
interleaved rounds (every variant once per round, ``--rounds`` rounds, the median of the
rounds' medians), CUDA-graph replays of:

- ``mm``: the matmul alone: the ceiling, what the step would cost if the all-reduce were free;
- ``nccl``: the matmul, then NCCL's all-reduce (torch's functional collective: Inductor's graph);
- ``ce2`` / ``ce4``: ``passkit_fusion.matmul_all_reduce`` with 2 / 4 chunks: each chunk's
  transfer on the copy engines (2 lanes: two streams, each a half of the chunk) beside the next
  chunk's matmul (``allreduce_overlap``'s default transport); ``ce2x1`` / ``ce4x4``: 1 and 4 lanes.

"kept" is the share of the all-reduce's cost an overlapped variant wins back:
``(nccl - ce) / (nccl - mm)``. Numerics: each ``ce`` output against NCCL's (relative error).
Device times are max over ranks.

``--probe-norm`` (one GPU) times only the step after the matmuls of ``fuse_norm``'s op: its
partials + residual + RMSNorm kernel (all rows, and in 4 chunks as the op runs it) against
Inductor's add + RMSNorm of the sum (what the unfused graph runs after its all-reduce) and of
the two partials, with the HBM rate each reaches.

``--host-cost`` (any ``--world``, one GPU too) times the host: microseconds a call takes to
enqueue, called eagerly back to back as a graph without CUDA graphs calls it (no synchronize
inside the timed calls, variants interleaved), for NCCL's path and the op's, and a cProfile of
the op's calls split by function: what a forward without CUDA graphs pays per site on the CPU.

Run on a machine with W GPUs:  python benchmarks/overlap_op.py --world 2 --out benchmarks/results/
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from passkit_fusion.tuning.timing import graph_median_us
from results import write as write_result  # benchmarks/ is on sys.path when run as a script
from worlds import max_over_ranks, run_on_gpus

HIDDEN, INTERMEDIATE = 4096, 14336
PROJECTIONS = {"o_proj": HIDDEN, "down_proj": INTERMEDIATE}
VARIANTS = ("mm", "nccl", "ce2", "ce4", "ce2x1", "ce4x4")
CE = {"ce2": (2, 2), "ce4": (4, 2), "ce2x1": (2, 1), "ce4x4": (4, 4)}
"""copy-engine variants: (chunks, copy lanes)"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--probe-copies",
        action="store_true",
        help="first print the copy engines' rate between GPU 0 and 1 (push, pull; one way, both ways at once)",
    )
    parser.add_argument(
        "--probe-norm",
        action="store_true",
        help="only the norm step, on one GPU: the op's partials + residual + RMSNorm kernel (whole, in 4 chunks) "
        "against Inductor's add + RMSNorm of the sum (the unfused graph's) and of two partials",
    )
    parser.add_argument(
        "--host-cost",
        action="store_true",
        help="host microseconds per eager call (NCCL's path, the op's), and a cProfile of the op's calls",
    )
    args = parser.parse_args(argv)
    if args.host_cost:
        return run_on_gpus(_host_cost, args.world, args)
    if args.probe_norm:
        return run_on_gpus(_probe_norm, 1, args)
    return run_on_gpus(_rank_main, args.world, args)


def _probe_norm(rank: int, args: argparse.Namespace) -> None:
    """us per call and the HBM rate (bytes read and written / time) of the norm step at each
    token count, hidden 4096, bf16, CUDA-graph timed, steps interleaved round by round."""
    print("| tokens | step | us | GB/s |\n|---|---|---|---|", flush=True)
    for tokens in args.tokens:
        steps = _norm_steps(tokens)
        samples: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(args.rounds):
            for name, (step, _moved) in steps.items():
                samples[name].append(graph_median_us(step, ops_per_graph=4, replays=30))
        nbytes = tokens * HIDDEN * 2
        for name, (_step, moved) in steps.items():
            us = statistics.median(samples[name])
            print(f"| {tokens} | {name} | {us:.1f} | {moved * nbytes / us / 1e3:.0f} |", flush=True)


def _norm_steps(tokens: int) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (step, how many ``[tokens, hidden]`` tensors it reads and writes)."""
    from passkit_fusion.allreduce_overlap.runtime import chunk_bounds
    from passkit_fusion.allreduce_overlap.triton_kernel import partials_add_rmsnorm

    def rmsnorm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        hs = h.float()
        return w * (hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)

    inductor_sum = torch.compile(lambda s, r, w: (rmsnorm(s + r, w), s + r))
    inductor_parts = torch.compile(lambda p0, p1, r, w: (rmsnorm((p0 + p1) + r, w), (p0 + p1) + r))
    p0, p1, r = (torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    w = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    norm, total = torch.empty_like(p0), torch.empty_like(p0)

    def chunked() -> None:
        for lo, hi in chunk_bounds(tokens, 4):
            partials_add_rmsnorm(
                [p0[lo:hi], p1[lo:hi]], r[lo:hi], w, 1e-6, 0.0, out=(norm[lo:hi], total[lo:hi])
            )

    return {
        "Inductor: add + RMSNorm of the sum (the unfused graph's)": (lambda: inductor_sum(p0, r, w), 4),
        "Inductor: partials + add + RMSNorm": (lambda: inductor_parts(p0, p1, r, w), 5),
        "the op's kernel, all rows": (lambda: partials_add_rmsnorm([p0, p1], r, w, 1e-6, 0.0), 5),
        "the op's kernel, 4 chunks": (chunked, 5),
    }


HOST_VARIANTS = (
    "mm",
    "mm + all_reduce_ + wait_tensor (Inductor's calls)",
    "mm + funcol.all_reduce",
    "op, 2 chunks, no norm",
    "op, 2 chunks, norm",
    "op's Python function, 2 chunks, norm",
    "op, 4 chunks, norm",
)


def _host_cost(rank: int, args: argparse.Namespace) -> None:
    """Host us per call: ``calls`` calls enqueued back to back, timed up to the last enqueue
    (then one synchronize, not timed), median over ``rounds`` interleaved rounds, max over
    ranks; then a cProfile of the norm op's calls, per call, by function."""
    import cProfile
    import pstats

    calls = 40
    if rank == 0:
        print(f"| tokens | {' | '.join(HOST_VARIANTS)} |\n|---|{'---|' * len(HOST_VARIANTS)}", flush=True)
    profiled = None
    for tokens in args.tokens:
        steps = _host_steps(args.world, tokens)
        profiled = profiled or steps["op's Python function, 2 chunks, norm"]  # the first count's
        samples: dict[str, list[float]] = {v: [] for v in steps}
        for _ in range(args.rounds):
            for v, step in steps.items():
                dist.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    step()
                samples[v].append((time.perf_counter() - t0) / calls * 1e6)
                torch.cuda.synchronize()
        us = [max_over_ranks(statistics.median(samples[v])) for v in steps]
        if rank == 0:
            print(f"| {tokens} | {' | '.join(f'{u:.1f}' for u in us)} |", flush=True)
    if rank == 0:
        print("\n| piece of the op's host work | us per call |\n|---|---|", flush=True)
    for piece, us in _host_pieces().items():
        if rank == 0:
            print(f"| {piece} | {us:.1f} |", flush=True)
    profile = cProfile.Profile()
    dist.barrier()
    profile.enable()
    for _ in range(calls):
        profiled()
    profile.disable()
    torch.cuda.synchronize()
    if rank == 0:
        print(
            f"\ncProfile of the op's Python function, 2 chunks, norm, at {args.tokens[0]} tokens, {calls} calls (tottime / {calls} = us per call):"
        )
        stats = pstats.Stats(profile)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]  # type: ignore[attr-defined]
        print("| function | calls per op call | us per op call (own) |\n|---|---|---|")
        for (file, line, fn), (_cc, nc, tt, _ct, _callers) in rows:
            where = fn if file == "~" else f"{fn} ({Path(file).name}:{line})"
            print(f"| `{where}` | {nc / calls:g} | {tt / calls * 1e6:.1f} |")
    dist.barrier()


def _host_pieces(calls: int = 200, rounds: int = 5) -> dict[str, float]:
    """Host us per call of each kind of call the op makes (median of ``rounds``)."""
    from passkit_fusion.allreduce_overlap import runtime
    from passkit_fusion.allreduce_overlap.triton_kernel import partials_add_rmsnorm

    name = dist.group.WORLD.group_name
    handle = runtime._buffers[name].handle
    rank = dist.get_rank()
    compute = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    event = torch.cuda.Event()
    event.record()
    x = torch.randn(16, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    out = (torch.empty_like(x), torch.empty_like(x))

    def in_stream() -> None:
        with torch.cuda.stream(side):
            pass

    def new_event() -> None:
        torch.cuda.Event().record(side)

    pieces: dict[str, Callable[[], object]] = {
        "symmetric-memory barrier (handle.barrier)": lambda: handle.barrier(channel=0),
        "a view of the buffer (handle.get_buffer)": lambda: handle.get_buffer(rank, (16, HIDDEN), x.dtype, 0),
        "torch.cuda.Event() + record": new_event,
        "record of a kept event": lambda: event.record(side),
        "stream.wait_event": lambda: compute.wait_event(event),
        "stream.wait_stream": lambda: side.wait_stream(compute),
        "with torch.cuda.stream(s)": in_stream,
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "x.copy_(y), 16 x 4096": lambda: out[0].copy_(x),
        "Triton norm kernel (partials_add_rmsnorm)": lambda: partials_add_rmsnorm(
            [x, x], x, w, 1e-6, 0.0, out=out
        ),
        "dist.get_world_size(resolve_group(name))": lambda: dist.get_world_size(runtime.resolve_group(name)),
    }
    result = {}
    for piece, fn in pieces.items():
        samples = []
        for _ in range(rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
        result[piece] = max_over_ranks(statistics.median(samples))
    return result


def _host_steps(world: int, tokens: int) -> dict[str, Callable[[], object]]:
    import passkit_fusion.allreduce_overlap.ops  # noqa: F401  (registers the ops)
    import torch.distributed._functional_collectives as funcol
    from passkit_fusion.allreduce_overlap import runtime

    from passkit_fusion import reference

    warnings.simplefilter("ignore", FutureWarning)
    name = dist.group.WORLD.group_name
    k = INTERMEDIATE // world
    a = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(HIDDEN, k, device="cuda", dtype=torch.bfloat16) / k**0.5).t()
    residual = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    ops, c10d = torch.ops.passkit_fusion, torch.ops._c10d_functional
    norm_args = (residual, weight, 1e-6, 0.0, name)

    def inductors() -> object:
        buf = torch.mm(a, b)
        c10d.all_reduce_.default(buf, "sum", name)
        return c10d.wait_tensor.default(buf)

    steps: dict[str, Callable[[], object]] = dict(
        zip(
            HOST_VARIANTS,
            (
                lambda: a @ b,
                inductors,
                lambda: funcol.wait_tensor(funcol.all_reduce(a @ b, "sum", name)),
                lambda: ops.matmul_all_reduce.default(a, b, name, 2, 1, 16384, 120.0),
                lambda: ops.matmul_all_reduce_rmsnorm.default(a, b, *norm_args, 2, 1, 16384, 120.0),
                lambda: runtime.matmul_all_reduce_rmsnorm(a, b, *norm_args, 2, 1, 16384, 120.0),
                lambda: ops.matmul_all_reduce_rmsnorm.default(a, b, *norm_args, 4, 1, 16384, 120.0),
            ),
            strict=True,
        )
    )
    for step in steps.values():  # the buffer, the kernels' compilation
        step()
    for v in ("op, 2 chunks, norm", "op, 4 chunks, norm"):  # the op's numbers, before its time
        got = steps[v]()
        want = reference.allreduce_rmsnorm(torch.mm(a, b), residual, weight, 1e-6, 0.0, name)
        err = max(
            float((g.float() - w.float()).norm() / w.float().norm()) for g, w in zip(got, want, strict=True)
        )
        if dist.get_rank() == 0:
            print(
                f"{v}, {tokens} tokens: relative error vs reference.allreduce_rmsnorm {err:.1e}", flush=True
            )
    torch.cuda.synchronize()
    return steps


def _rank_main(rank: int, args: argparse.Namespace) -> None:
    if args.probe_copies:
        _probe_copies(rank)
    rows = []
    for tokens in args.tokens:
        for proj, width in PROJECTIONS.items():
            rows.append(_measure(args, tokens, proj, width))
            if rank == 0:
                print(_line(rows[-1]), flush=True)
    if rank == 0:
        _report(args, rows)


def _measure(args: argparse.Namespace, tokens: int, proj: str, width: int) -> dict[str, object]:
    import passkit_fusion.allreduce_overlap.ops  # noqa: F401  (registers the op)
    import torch.distributed._functional_collectives as funcol

    warnings.simplefilter("ignore", FutureWarning)
    name = dist.group.WORLD.group_name
    gen = torch.Generator(device="cuda").manual_seed(tokens + dist.get_rank())
    k = width // args.world
    a = torch.randn(tokens, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    b = (
        torch.randn(HIDDEN, k, generator=gen, device="cuda", dtype=torch.bfloat16) / k**0.5
    ).t()  # nn.Linear's
    op = torch.ops.passkit_fusion.matmul_all_reduce.default
    steps: dict[str, Callable[[], object]] = {
        "mm": lambda: a @ b,
        "nccl": lambda: funcol.wait_tensor(funcol.all_reduce(a @ b, "sum", name)),
        **{
            v: (lambda c=c, lanes=lanes: op(a, b, name, c, lanes, 16384, 120.0))
            for v, (c, lanes) in CE.items()
        },
    }
    ref = steps["nccl"]()
    row: dict[str, object] = {"tokens": tokens, "proj": proj, "k": k}
    for v in CE:
        got = steps[v]()
        row[f"{v}_rel_err"] = float((got.float() - ref.float()).norm() / ref.float().norm())
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for v in VARIANTS:
            dist.barrier()
            samples[v].append(graph_median_us(steps[v], ops_per_graph=4, replays=args.replays))
    for v in VARIANTS:
        row[v] = max_over_ranks(statistics.median(samples[v]))
    return row


def _probe_copies(rank: int) -> None:
    """GB/s of one ``Tensor.copy_`` between this GPU and the next one's symmetric memory."""
    import torch.distributed._symmetric_memory as symm_mem

    warnings.simplefilter("ignore", FutureWarning)
    peer = (rank + 1) % dist.get_world_size()
    mb = 128
    buf = symm_mem.empty(mb << 20, dtype=torch.uint8, device="cuda")
    handle = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    local = torch.empty(mb << 20, dtype=torch.uint8, device="cuda")
    for size_mb in (8, 32, 128):
        n = size_mb << 20
        there, here = handle.get_buffer(peer, (n,), torch.uint8, 0), local[:n]
        for how, both in (("push", False), ("push", True), ("pull", False), ("pull", True)):
            active = both or rank == 0
            times = []
            for _ in range(5):
                dist.barrier()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                if active:
                    (there.copy_(here) if how == "push" else here.copy_(there))
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            rate = n / statistics.median(times) / 1e9
            if rank == 0:
                print(
                    f"copy probe: {how} {size_mb} MB, {'both ways' if both else 'one way'}: {rate:.0f} GB/s",
                    flush=True,
                )
    dist.barrier()


def _kept(r: dict[str, object], v: str) -> str:
    mm, nccl, ce = float(r["mm"]), float(r["nccl"]), float(r[v])  # type: ignore[arg-type]
    return f"{(nccl - ce) / (nccl - mm):.0%}" if nccl > mm else "-"


def _line(r: dict[str, object]) -> str:
    return (
        f"| {r['tokens']} | {r['proj']} | {r['mm']} | {r['nccl']} | {r['ce2']} ({_kept(r, 'ce2')}) | "
        f"{r['ce4']} ({_kept(r, 'ce4')}) | {r['ce2x1']} ({_kept(r, 'ce2x1')}) | {r['ce4x4']} ({_kept(r, 'ce4x4')}) | "
        f"{max(float(r[f'{v}_rel_err']) for v in CE):.1e} |"  # type: ignore[arg-type]
    )


def _report(args: argparse.Namespace, rows: list[dict[str, object]]) -> None:
    lines = [
        f"# Row-parallel matmul + all-reduce, overlapped on the copy engines ({torch.cuda.get_device_name()} "
        f"x{args.world}, torch {torch.__version__})",
        "",
        f"Llama-8B row-parallel projections (hidden {HIDDEN}; o_proj k = {HIDDEN}/{args.world}, down_proj k = "
        f"{INTERMEDIATE}/{args.world}), bf16, us per step: CUDA-graph replays (4 steps a graph, {args.replays} "
        f"replays), median of {args.rounds} interleaved rounds, max over ranks. In brackets: the share of "
        "NCCL's cost won back, (nccl - ce) / (nccl - mm).",
        "",
        "| tokens | projection | mm alone (ceiling) | mm + NCCL all-reduce | copy engine, 2 chunks | "
        "copy engine, 4 chunks | 2 chunks, 1 lane | 4 chunks, 4 lanes | max rel. err vs NCCL |",
        "|---|---|---|---|---|---|---|---|---|",
        *(_line(r) for r in rows),
    ]
    out = None if args.out is None else args.out / f"overlap_op_w{args.world}"
    write_result(out, "\n".join(lines), rows, indent=1)


if __name__ == "__main__":
    sys.exit(main())
