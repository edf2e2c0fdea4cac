"""Op-level benchmark of all-reduce + residual add + RMSNorm + static FP8 quantization, 2 local GPUs.

``python benchmarks/fusion_op.py --fp8 [--hidden 4096 8192] [--tokens 1 2 4 ...]`` runs this.
For each hidden size and token count (bf16 activations, ``float8_e4m3fn`` output, a static
per-tensor scale in a device tensor), CUDA-graph timed (median over graph replays of 10
back-to-back calls, ``passkit_fusion.tuning.timing.graph_median_us``), microseconds per call:

* ``nccl_inductor``: NCCL ``all_reduce`` (in place), then add + RMSNorm + quantization
  (``(y / scale).clamp(-448, 448).to(float8_e4m3fn)``) compiled by Inductor as one graph:
  what a compiled FP8 model runs where the pass leaves the site alone (the baseline).
* ``nccl_inductor_noquant``: the same without the quantization: what the quantization adds.
* ``pk_fp8_auto``: ``runtime.fused_allreduce_rmsnorm_fp8_cuda`` with its table decision
  (path listed), FP8 output only (``kARResidualRMSNormFP8Quant``).
* ``pk_fp8_1shot`` / ``pk_fp8_2shot``: forced fused paths (two-shot only where tokens > 2).
* ``pk_fp8norm_1shot``: forced one-shot also writing the bf16 norm output
  (``kARResidualRMSNormOutFP8Quant``).
* ``pk_bf16_1shot``: the unquantized fused op, forced one-shot (what fusing the
  quantization saves over ``allreduce_rmsnorm`` + Inductor's quantization is
  ``pk_bf16_1shot + quant`` vs ``pk_fp8_1shot``).

Numerics once per shape: relative L2 error after dequantization against float64, fused
vs unfused (must stay within 1.25x). Writes ``fusion_op_fp8.json`` and ``fusion_op_fp8.md``
into ``--out`` (default ``$OUT`` or ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from passkit_fusion.allreduce_rmsnorm import runtime, tune
from passkit_fusion.tuning import tables, timing
from worlds import run_on_gpus  # benchmarks/ is on sys.path when run as a script

WORLD = int(os.environ.get("GPU_WORLD_SIZE", "2"))
EPS = 1e-6
DTYPE = torch.bfloat16
E4M3 = torch.float8_e4m3fn
ERROR_RATIO_LIMIT = 1.25
ONESHOT, TWOSHOT = tables.Decision(True, True), tables.Decision(True, False)
VARIANTS = (
    "nccl_inductor",
    "nccl_inductor_noquant",
    "pk_fp8_auto",
    "pk_fp8_1shot",
    "pk_fp8_2shot",
    "pk_fp8norm_1shot",
    "pk_bf16_1shot",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fp8", action="store_true", help="(accepted: this is the FP8 benchmark)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2**i for i in range(14)])
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return run_on_gpus(_rank_main, WORLD, args)


def _rank_main(rank: int, args: argparse.Namespace) -> None:
    try:
        _run(rank, args)
    finally:
        torch._dynamo.reset()
        runtime.destroy_workspaces()  # before run_on_gpus destroys the process group


def _add_rmsnorm_quant(
    reduced: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor
):
    h = reduced + residual
    hf = h.float()
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype) * weight
    return (y / scale).clamp(-448, 448).to(E4M3), h


def _add_rmsnorm(reduced: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
    h = reduced + residual
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype) * weight, h


def _run(rank: int, args: argparse.Namespace) -> None:
    group = dist.group.WORLD
    assert group is not None
    quant_compiled = torch.compile(_add_rmsnorm_quant, dynamic=False)
    plain_compiled = torch.compile(_add_rmsnorm, dynamic=False)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for hidden in args.hidden:
        runtime.prepare(group.group_name, hidden, DTYPE, max_tokens=max(args.tokens))
        for tokens in sorted(args.tokens):
            row = _measure(group, hidden, tokens, quant_compiled, plain_compiled)
            rows.append(row)
            if rank == 0:
                _print(row, time.perf_counter() - started)
                _write(args, rows)
    if rank == 0:
        _write(args, rows)
        print(_markdown(rows))


def _measure(group, hidden: int, tokens: int, quant_compiled, plain_compiled) -> dict[str, Any]:
    rank = dist.get_rank()
    x, residual, weight = tune.make_inputs(tokens, hidden, DTYPE, rank)
    xs = [tune.make_inputs(tokens, hidden, DTYPE, r)[0] for r in range(WORLD)]
    total = torch.stack([t.double() for t in xs]).sum(0) + residual.double()
    norm_ref = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    scale = (norm_ref.abs().max() / 448 * 1.1).float().reshape(())
    name = group.group_name
    buf = x.clone()

    def nccl_inductor():
        buf.copy_(x)
        dist.all_reduce(buf, group=group)
        return quant_compiled(buf, residual, weight, scale)

    def nccl_inductor_noquant():
        buf.copy_(x)
        dist.all_reduce(buf, group=group)
        return plain_compiled(buf, residual, weight)

    def pk(decision, need_norm_out=False):
        def step():
            with runtime.forced(decision):
                return runtime.fused_allreduce_rmsnorm_fp8_cuda(
                    x, residual, weight, EPS, 0.0, scale, name, need_norm_out
                )

        return step

    def pk_bf16():
        with runtime.forced(ONESHOT):
            return runtime.fused_allreduce_rmsnorm_cuda(x, residual, weight, EPS, 0.0, name)

    # numerics: unfused (Inductor) vs fused one-shot, dequantized, against float64
    q_u, _ = nccl_inductor()
    (q_f, _, _), _ = pk(ONESHOT)(), pk(None)()
    auto_path = runtime.last_decision().path
    err_u = _rel(q_u.float() * scale, norm_ref)
    err_f = _rel(q_f.float() * scale, norm_ref)
    steps = {
        "nccl_inductor": nccl_inductor,
        "nccl_inductor_noquant": nccl_inductor_noquant,
        "pk_fp8_auto": pk(None),
        "pk_fp8_1shot": pk(ONESHOT),
        "pk_fp8_2shot": pk(TWOSHOT) if tokens > WORLD else None,
        "pk_fp8norm_1shot": pk(ONESHOT, True),
        "pk_bf16_1shot": pk_bf16,
    }
    times: dict[str, float | None] = {}
    for variant, step in steps.items():
        if step is None:
            times[variant] = None
            continue
        us = torch.tensor([timing.graph_median_us(step)], device="cuda")
        dist.all_reduce(us, op=dist.ReduceOp.MAX, group=group)
        times[variant] = float(us.item())
    best_fused = min(t for k, t in times.items() if k in ("pk_fp8_1shot", "pk_fp8_2shot") and t is not None)
    return {
        "hidden": hidden,
        "tokens": tokens,
        "us": times,
        "auto_path": auto_path,
        "speedup_best_fused_vs_inductor": times["nccl_inductor"] / best_fused,
        "speedup_auto_vs_inductor": times["nccl_inductor"] / times["pk_fp8_auto"],
        "err_unfused": err_u,
        "err_fused": err_f,
        "error_ok": err_f <= ERROR_RATIO_LIMIT * err_u + 1e-4,
    }


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out.double() - ref).norm() / ref.norm())


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _print(row: dict[str, Any], elapsed: float) -> None:
    us = " ".join(f"{k}={_fmt(v)}" for k, v in row["us"].items())
    print(
        f"[{elapsed:6.0f}s] hidden {row['hidden']} tokens {row['tokens']}: {us} auto={row['auto_path']} "
        f"x{row['speedup_auto_vs_inductor']:.2f} err {row['err_fused']:.2e}/{row['err_unfused']:.2e}",
        flush=True,
    )


def _markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| hidden | tokens | "
        + " | ".join(VARIANTS)
        + " | auto path | auto vs Inductor | err fused / unfused |"
    )
    lines = [head, "|" + "---|" * (len(VARIANTS) + 5)]
    for row in rows:
        cells = " | ".join(_fmt(row["us"][v]) for v in VARIANTS)
        lines.append(
            f"| {row['hidden']} | {row['tokens']} | {cells} | {row['auto_path']} | "
            f"{row['speedup_auto_vs_inductor']:.2f}x | {row['err_fused']:.2e} / {row['err_unfused']:.2e} |"
        )
    return "\n".join(lines)


def _write(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "flashinfer": runtime.flashinfer_version(),
        "world": WORLD,
    }
    (args.out / "fusion_op_fp8.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    (args.out / "fusion_op_fp8.md").write_text(_markdown(rows) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
