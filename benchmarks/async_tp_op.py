"""Op-level benchmark: the MLP's collectives under TP, sequence parallelism and async TP.

For the Llama-8B MLP sharded over ``--world`` local GPUs (hidden 4096, intermediate 14336 / W
per rank, bf16), at each token count T it times, side by side in one run, one MLP block's
collective-bearing part three ways:

- ``tp``: replicated input ``[T, H] @ W_up`` ... ``@ W_down`` then ``all_reduce`` (today's graph);
- ``sp``: the token-sharded input ``[T/W, H]`` is ``all_gather``-ed before the first matmul and
  the second matmul's result ``reduce_scatter``-ed (what ``sequence_parallel`` writes);
- ``async_tp``: the same with PyTorch's symmetric-memory ops ``fused_all_gather_matmul`` and
  ``fused_matmul_reduce_scatter`` (what ``async_tp`` writes), multicast off.

It answers where ``sequence_parallel``'s and ``async_tp``'s ``min_tokens`` should lie. Device
times are CUDA-graph medians (eager medians where a graph cannot be captured), max over ranks.

Run on a machine with W GPUs:  python benchmarks/async_tp_op.py --world 2 --out results/
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from results import write as write_result  # benchmarks/ is on sys.path when run as a script
from worlds import max_over_ranks, run_on_gpus

HIDDEN, INTERMEDIATE = 4096, 14336
VARIANTS = ("tp", "sp", "async_tp")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    return run_on_gpus(_rank_main, args.world, args)


def _rank_main(rank: int, args: argparse.Namespace) -> None:
    rows = [_measure(args, tokens) for tokens in args.tokens]
    if rank == 0:
        _report(args, rows)


def _measure(args: argparse.Namespace, tokens: int) -> dict[str, object]:
    import torch.distributed._functional_collectives as funcol
    import torch.distributed._symmetric_memory as symm_mem

    world, group = args.world, dist.group.WORLD
    name = group.group_name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(name)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    bf16 = torch.bfloat16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda", dtype=bf16) / shape[-1] ** 0.5

    x_full = randn(tokens, HIDDEN)
    x_shard = x_full.chunk(world)[dist.get_rank()].contiguous()
    w_up = randn(INTERMEDIATE // world, HIDDEN).t()  # column-parallel, [H, I/W] as nn.Linear stores it
    w_down = randn(HIDDEN, INTERMEDIATE // world).t()  # row-parallel, [I/W, H]
    h = randn(tokens, INTERMEDIATE // world)

    def tp() -> None:
        up = x_full @ w_up
        out = funcol.all_reduce(h @ w_down, "sum", name)
        funcol.wait_tensor(out)
        del up

    def sp() -> None:
        full = funcol.wait_tensor(funcol.all_gather_tensor(x_shard, 0, name))
        up = full @ w_up
        out = funcol.wait_tensor(funcol.reduce_scatter_tensor(h @ w_down, "sum", 0, name))
        del up, out

    def async_tp() -> None:
        torch.ops.symm_mem.fused_all_gather_matmul(x_shard, [w_up], 0, name)
        torch.ops.symm_mem.fused_matmul_reduce_scatter(h, w_down, "sum", 0, name)

    steps: dict[str, Callable[[], None]] = {"tp": tp, "sp": sp, "async_tp": async_tp}
    row: dict[str, object] = {"tokens": tokens}
    for variant in VARIANTS:
        us, how = _time(steps[variant], args.replays)
        row[variant] = max_over_ranks(us)
        row[f"{variant}_timing"] = how
    # numerics: async TP's outputs vs the unfused SP ops
    _, (up,) = torch.ops.symm_mem.fused_all_gather_matmul(x_shard, [w_up], 0, name)
    ref_up = funcol.wait_tensor(funcol.all_gather_tensor(x_shard, 0, name)) @ w_up
    rs = torch.ops.symm_mem.fused_matmul_reduce_scatter(h, w_down, "sum", 0, name)
    ref_rs = funcol.wait_tensor(funcol.reduce_scatter_tensor(h @ w_down, "sum", 0, name))
    row["rel_err"] = max(_rel(up, ref_up), _rel(rs, ref_rs))
    return row


def _time(step: Callable[[], None], replays: int) -> tuple[float, str]:
    """CUDA-graph median of one step (us); eager median where capture fails."""
    try:
        from passkit_fusion.tuning.timing import graph_median_us

        return graph_median_us(step, ops_per_graph=5, replays=replays), "graph"
    except Exception as exc:  # capture of a symmetric-memory op may be unsupported
        torch.cuda.synchronize()
        dist.barrier()
        print(f"graph capture failed ({type(exc).__name__}: {exc}); eager timing", flush=True)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times), "eager"


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def _report(args: argparse.Namespace, rows: list[dict[str, object]]) -> None:
    lines = [
        f"# MLP collectives: TP vs sequence parallel vs async TP ({torch.cuda.get_device_name()} x{args.world}, "
        f"torch {torch.__version__})",
        "",
        f"Llama-8B MLP shard (hidden {HIDDEN}, intermediate {INTERMEDIATE}/{args.world}), bf16, "
        f"median of {args.replays} replays, max over ranks. multicast off: "
        f"TORCH_SYMM_MEM_DISABLE_MULTICAST={os.environ.get('TORCH_SYMM_MEM_DISABLE_MULTICAST')}",
        "",
        "| tokens | tp (us) | sp (us) | async_tp (us) | sp speedup | async_tp speedup | async_tp vs sp | rel. err | timing |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tp_, sp_, atp = (float(r[v]) for v in VARIANTS)  # type: ignore[arg-type]
        lines.append(
            f"| {r['tokens']} | {tp_} | {sp_} | {atp} | {tp_ / sp_:.2f}x | {tp_ / atp:.2f}x | "
            f"{sp_ / atp:.2f}x | {float(r['rel_err']):.1e} | "  # type: ignore[arg-type]
            f"{'/'.join(str(r[f'{v}_timing']) for v in VARIANTS)} |"
        )
    out = None if args.out is None else args.out / f"async_tp_op_w{args.world}"
    write_result(out, "\n".join(lines), rows, indent=1)


if __name__ == "__main__":
    sys.exit(main())
