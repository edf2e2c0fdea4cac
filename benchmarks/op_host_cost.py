"""Host time per call of the fused all-reduce + RMSNorm, the way a compiled graph calls it.

Without CUDA graphs a forward at small token counts is launch-bound: the GPU waits for the
host, so what a site costs is the host time of its calls. This measures it, side by side:

CPU (default; no GPU needed): the dispatcher's cost of calling an op with
``allreduce_rmsnorm``'s schema defined with ``torch.library.custom_op`` and with
``torch.library.Library`` (the op does nothing), in microseconds per call.

``--device cuda`` (2 GPUs; spawns ``--world`` ranks): microseconds of host time per call
(``--calls`` back-to-back calls, then one synchronize, medians over rounds, variants
interleaved), hidden 4096, bf16, for each token count:

* ``nccl``: ``_c10d_functional.all_reduce_`` + ``wait_tensor``, the collective as Inductor's
  code calls it where no pass fused (its add + RMSNorm kernel adds one launch);
* ``unified``: flashinfer's ``allreduce_fusion`` on a trtllm workspace, outputs preallocated;
* ``kernel``: the kernel's compiled entry point (``trtllm_ar.get_trtllm_comm_module()``);
* ``op`` / ``op_unified``: ``torch.ops.passkit_fusion.allreduce_rmsnorm`` as compiled code
  calls it, through the kernel's entry point (the default) / flashinfer's unified API.

    python benchmarks/op_host_cost.py
    python benchmarks/op_host_cost.py --device cuda --out $OUT/op_host_cost
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from results import write as write_result  # benchmarks/ is on sys.path when run as a script

SCHEMA = (
    "(Tensor x, Tensor? residual, Tensor weight, float eps, float weight_bias, str group_name, "
    "str impl, SymInt? max_tokens=None, bool check_rank_consistency=True) -> (Tensor, Tensor)"
)


def per_call_us(fn: Callable[[], Any], calls: int, sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def dispatcher_costs(calls: int, rounds: int) -> dict[str, float]:
    """custom_op vs Library.define + impl, same schema, a body that returns preallocated outputs."""
    x, w = torch.randn(1, 4096), torch.randn(4096)
    out = (torch.empty(1, 4096), torch.empty(1, 4096))

    @torch.library.custom_op("op_host_cost::by_custom_op", mutates_args=())
    def by_custom_op(
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        weight_bias: float,
        group_name: str,
        impl: str,
        max_tokens: int | None = None,
        check_rank_consistency: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return out[0].clone(), out[1].clone()

    lib = torch.library.Library("op_host_cost", "FRAGMENT")
    lib.define("by_library" + SCHEMA)
    lib.impl("by_library", lambda *a, **k: (out[0].clone(), out[1].clone()), "CompositeExplicitAutograd")
    ops = torch.ops.op_host_cost
    variants = {"custom_op": ops.by_custom_op.default, "library": ops.by_library.default}
    samples: dict[str, list[float]] = {n: [] for n in variants}
    with torch.no_grad():
        for i in range(rounds):
            for name in variants if i % 2 == 0 else reversed(variants):
                op = variants[name]
                samples[name].append(
                    per_call_us(lambda op=op: op(x, x, w, 1e-6, 0.0, "0", "flashinfer"), calls, lambda: None)
                )
    return {n: statistics.median(v) for n, v in samples.items()}


def gpu_worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    import flashinfer.comm as comm
    from flashinfer.comm import trtllm_ar
    from passkit_fusion.allreduce_rmsnorm import ops, runtime  # noqa: F401 (defines the op)

    group = dist.group.WORLD
    name, hidden, dtype = group.group_name, 4096, torch.bfloat16
    workspace = comm.create_allreduce_fusion_workspace(
        backend="trtllm",
        world_size=world,
        rank=rank,
        max_token_num=max(args.tokens),
        hidden_dim=hidden,
        dtype=dtype,
        group=group,
    )
    kernel = trtllm_ar.get_trtllm_comm_module().trtllm_allreduce_fusion
    pattern = comm.AllReduceFusionPattern.kARResidualRMSNorm
    c10d = torch.ops._c10d_functional
    op = torch.ops.passkit_fusion.allreduce_rmsnorm.default
    sync = torch.cuda.synchronize

    def measure(tokens: int) -> dict[str, Any]:
        g = torch.Generator(device="cuda").manual_seed(tokens)
        x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=g)
        residual, weight = torch.randn_like(x), torch.ones(hidden, device="cuda", dtype=dtype)
        norm_out, residual_out = torch.empty_like(x), torch.empty_like(x)

        def unified() -> None:
            comm.allreduce_fusion(
                input=x, workspace=workspace, pattern=pattern, launch_with_pdl=False,
                trigger_completion_at_end=True, residual_out=residual_out, norm_out=norm_out,
                residual_in=residual, rms_gamma=weight, rms_eps=1e-6, use_oneshot=True,
            )  # fmt: skip

        def direct() -> None:
            kernel(
                allreduce_in=x, world_size=world, world_rank=rank, token_num=tokens, hidden_dim=hidden,
                workspace_ptrs=workspace.workspace_tensor, launch_with_pdl=False, use_oneshot=True,
                trigger_completion_at_end=True, fp32_acc=False, pattern_code=pattern, allreduce_out=None,
                residual_in=residual, residual_out=residual_out, norm_out=norm_out, quant_out=None,
                scale_out=None, rms_gamma=weight, rms_eps=1e-6, scale_factor=None, layout_code=None,
            )  # fmt: skip

        def nccl() -> None:
            c10d.wait_tensor(c10d.all_reduce_(x, "sum", name))

        def through_op() -> None:
            op(x, residual, weight, 1e-6, 0.0, name, "flashinfer", None, True)

        variants: dict[str, Callable[[], None]] = {
            "nccl": nccl,
            "unified": unified,
            "kernel": direct,
            "op": through_op,
            "op_unified": through_op,
        }
        samples: dict[str, list[float]] = {n: [] for n in variants}
        with torch.no_grad():
            for i in range(args.rounds):
                for v in variants if i % 2 == 0 else reversed(variants):
                    runtime.configure(flashinfer_api="unified" if v == "op_unified" else "auto")
                    variants[v]()  # routes the call (and makes the workspace) once, untimed
                    dist.barrier()
                    samples[v].append(per_call_us(variants[v], args.calls, sync))
        row: dict[str, Any] = {v: statistics.median(s) for v, s in samples.items()}
        row["path"] = runtime.last_decision().path  # type: ignore[union-attr]
        return row

    results = {tokens: measure(tokens) for tokens in args.tokens}
    profile = ""
    if args.profile:  # where the op's host time goes: cProfile over op calls at the first size
        import cProfile
        import io
        import pstats

        x = torch.randn(args.tokens[0], hidden, device="cuda", dtype=dtype)
        residual, weight = torch.randn_like(x), torch.ones(hidden, device="cuda", dtype=dtype)
        runtime.configure(flashinfer_api="auto")
        with torch.no_grad():
            op(x, residual, weight, 1e-6, 0.0, name, "flashinfer", None, True)
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.calls * 5):
                op(x, residual, weight, 1e-6, 0.0, name, "flashinfer", None, True)
            profiler.disable()
        sync()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        profile = text.getvalue()
    if rank == 0:
        queue.put(
            {
                "device": torch.cuda.get_device_name(0),
                "torch": torch.__version__,
                "us": results,
                "profile": profile,
            }
        )
    sync()
    dist.barrier()
    sys.stdout.flush()
    # the program's own end: the benchmark's workspace, then passkit's, then the group (the
    # parent waits for each rank's exit)
    workspace.destroy()
    runtime.destroy_workspaces()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--calls", type=int, default=200, help="back-to-back calls per sample")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--profile", action="store_true", help="cuda: cProfile the op's calls on rank 0")
    parser.add_argument("--out", type=Path, default=None, help="write OUT.md and OUT.json")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
        us = dispatcher_costs(args.calls * 10, args.rounds)
        res: dict[str, Any] = {"device": "cpu", "torch": torch.__version__, "dispatch_us": us}
        lines = [
            f"op dispatch, {res['torch']} on one CPU core, us per call (median of {args.rounds}):",
            "",
            "| custom_op | Library | ratio |",
            "|---|---|---|",
            f"| {us['custom_op']:.2f} | {us['library']:.2f} | {us['custom_op'] / us['library']:.2f}x |",
        ]
    else:
        from worlds import spawn  # benchmarks/ is on sys.path when run as a script

        queue, procs = spawn(gpu_worker, args.world, args)
        res = queue.get(timeout=600)
        for p in procs:
            p.join(timeout=60)
        variants = ["nccl", "unified", "kernel", "op", "op_unified"]
        lines = [
            f"host us per call, {res['device']} x{args.world}, torch {res['torch']}, hidden 4096 bf16, "
            f"{args.calls} calls per sample, medians of {args.rounds} (rank 0):",
            "",
            "| tokens | " + " | ".join(variants) + " | op path |",
            "|" + "---|" * (len(variants) + 2),
        ]
        for t, row in res["us"].items():
            lines.append(f"| {t} | " + " | ".join(f"{row[v]:.1f}" for v in variants) + f" | {row['path']} |")
        if res.get("profile"):
            lines += [
                "",
                f"cProfile of {args.calls * 5} op calls at {args.tokens[0]} tokens (rank 0):",
                "```",
                res["profile"],
                "```",
            ]
    write_result(args.out, "\n".join(lines), res, indent=1, json_newline=True)


if __name__ == "__main__":
    main()
