"""Op-level benchmark of all-reduce + residual add + RMSNorm on 2 local GPUs (spawns 2 ranks).

For each hidden size and token count (bf16), CUDA-graph timed (median over graph replays of
10 back-to-back calls), microseconds per call:

* ``nccl_torch``: NCCL ``all_reduce`` (in place, as a compiled graph runs it) + add + RMSNorm
  in eager torch (fp32 math): what the op's own unfused fallback runs.
* ``nccl_inductor``: the same all-reduce, then add + RMSNorm compiled by Inductor: what the
  graph runs where the pass leaves a site alone, the baseline the tuned table compares with.
* ``raw_1shot`` / ``raw_2shot``: flashinfer's ``allreduce_fusion`` called directly on its own
  ``trtllm`` workspace with preallocated outputs (two-shot only where tokens > world size).
* ``pk_auto``: ``passkit_fusion.allreduce_rmsnorm.runtime.fused_allreduce_rmsnorm_cuda`` with its table decision
  (the path it took is listed).
* ``pk_1shot`` / ``pk_2shot``: the same op with the fused path forced: its overhead over raw.

Once per shape it checks numerics against a float64 reference (relative L2 error of
``norm_out`` and ``residual_out``; fused must stay within 1.25x of the unfused error), and
at the end times eager calls (host overhead included) for a few shapes: the op's unfused
fallback, raw one-shot and the op's forced one-shot.  From the
measurements it derives the decision table for this GPU at world size 2 (fuse where the
faster passkit fused variant beats ``nccl_inductor`` by the margin); the largest token count
it fuses is also where ``allreduce_rmsnorm``'s token range ends.

Writes ``fusion_op.json``, ``fusion_op.md`` and ``table_<gpu>_w2.json`` into ``--out``
(default: ``$OUT`` when set, else ``benchmarks/results``).

Run: python benchmarks/fusion_op.py [--hidden 4096 8192] [--tokens 1 2 4 ...]
``--fp8``: the FP8 variant instead (all-reduce + add + RMSNorm + static FP8 quantization vs
NCCL + Inductor's add + RMSNorm + quantization): ``benchmarks/fusion_op_fp8.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from passkit_fusion.allreduce_rmsnorm import runtime, tune
from passkit_fusion.tuning import tables, timing
from worlds import run_on_gpus  # benchmarks/ is on sys.path when run as a script

WORLD = int(os.environ.get("GPU_WORLD_SIZE", "2"))
"""Ranks (one GPU each); set GPU_WORLD_SIZE=4 or 8 on larger machines."""
EPS = 1e-6
DTYPE = torch.bfloat16
ERROR_RATIO_LIMIT = 1.25
EAGER_SHAPES = ((4096, 1), (4096, 128), (8192, 1))
EAGER_ITERS = 300
VARIANTS = ("nccl_torch", "nccl_inductor", "raw_1shot", "raw_2shot", "pk_auto", "pk_1shot", "pk_2shot")


@dataclasses.dataclass
class Row:
    """One shape's medians (us, max over ranks), the auto path, and its numerics."""

    hidden: int
    tokens: int
    us: dict[str, float | None]
    pk_auto_path: str
    errors: dict[str, dict[str, float]]
    numerics_ok: bool


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--fp8" in argv:
        sys.path.insert(0, str(Path(__file__).parent))
        import fusion_op_fp8

        return fusion_op_fp8.main(argv)
    args = _parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return run_on_gpus(_rank_main, WORLD, args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2**i for i in range(14)])
    parser.add_argument("--margin", type=float, default=tables.DEFAULT_MARGIN)
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    )
    return parser


def _rank_main(rank: int, args: argparse.Namespace) -> None:
    try:
        _run(rank, args)
    finally:
        runtime.destroy_workspaces()  # before run_on_gpus destroys the process group


def _run(rank: int, args: argparse.Namespace) -> None:
    import flashinfer.comm as comm

    group = dist.group.WORLD
    assert group is not None
    rows: list[Row] = []
    started = time.perf_counter()
    max_tokens = max(args.tokens)
    for hidden in args.hidden:
        raw_ws = comm.create_allreduce_fusion_workspace(
            backend="trtllm",
            world_size=WORLD,
            rank=rank,
            max_token_num=max_tokens,
            hidden_dim=hidden,
            dtype=DTYPE,
            group=group,
        )
        runtime.prepare(group.group_name, hidden, DTYPE, max_tokens=max_tokens)
        for tokens in sorted(args.tokens):
            rows.append(_measure_shape(comm, raw_ws, group, hidden, tokens))
            if rank == 0:
                _print_row(rows[-1], time.perf_counter() - started)
                _write_results(args, rows, eager=[], table=None)
        raw_ws.destroy()
    eager = _measure_eager(comm, group, rank)
    table = _tuned_table(rows, args.margin)
    if rank == 0:
        _write_results(args, rows, eager, table)
        print(_markdown(rows, eager, table))


def _measure_shape(comm: Any, raw_ws: Any, group: dist.ProcessGroup, hidden: int, tokens: int) -> Row:
    """Numerics, then the six timings, agreed (max) over the ranks."""
    rank = dist.get_rank(group)
    x, residual, weight = tune.make_inputs(tokens, hidden, DTYPE, rank, seed=tokens)
    errors, numerics_ok = _check_numerics(group, x, residual, weight, tokens, hidden)
    replays = tune.replays_for(tokens, hidden)
    name = group.group_name
    twoshot = tokens > WORLD
    timers: dict[str, Callable[[], float]] = {
        "nccl_torch": lambda: tune.time_unfused_us(group, x, residual, weight, EPS, replays, norm="eager"),
        "nccl_inductor": lambda: tune.time_unfused_us(group, x, residual, weight, EPS, replays),
        "raw_1shot": lambda: _time_raw(comm, raw_ws, x, residual, weight, True, replays),
        "raw_2shot": lambda: _time_raw(comm, raw_ws, x, residual, weight, False, replays),
        "pk_auto": lambda: timing.graph_median_us(
            lambda: runtime.fused_allreduce_rmsnorm_cuda(x, residual, weight, EPS, 0.0, name), replays=replays
        ),
        "pk_1shot": lambda: tune.time_fused_us(
            name, x, residual, weight, EPS, tables.Decision(True, True), replays
        ),
        "pk_2shot": lambda: tune.time_fused_us(
            name, x, residual, weight, EPS, tables.Decision(True, False), replays
        ),
    }
    local = [timers[v]() if twoshot or not v.endswith("2shot") else -1.0 for v in VARIANTS]
    runtime.reset_stats()
    runtime.fused_allreduce_rmsnorm_cuda(x, residual, weight, EPS, 0.0, name)
    record = runtime.last_decision()
    auto_path = (
        f"{record.path}:{record.reason}" if record and record.reason else str(record.path if record else "?")
    )
    agreed = torch.tensor(local, dtype=torch.float64, device=x.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    us = {v: (t if t >= 0 else None) for v, t in zip(VARIANTS, agreed.tolist())}
    return Row(hidden, tokens, us, auto_path, errors, numerics_ok)


def _time_raw(
    comm: Any,
    workspace: Any,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    oneshot: bool,
    replays: int,
) -> float:
    norm_out, residual_out = torch.empty_like(x), torch.empty_like(x)
    pattern = comm.AllReduceFusionPattern.kARResidualRMSNorm

    def step() -> None:
        comm.allreduce_fusion(
            input=x,
            workspace=workspace,
            pattern=pattern,
            launch_with_pdl=False,
            trigger_completion_at_end=True,
            residual_out=residual_out,
            norm_out=norm_out,
            residual_in=residual,
            rms_gamma=weight,
            rms_eps=EPS,
            use_oneshot=oneshot,
        )

    return timing.graph_median_us(step, replays=replays)


def _check_numerics(
    group: dist.ProcessGroup,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    tokens: int,
    hidden: int,
) -> tuple[dict[str, dict[str, float]], bool]:
    """Relative L2 errors vs float64 of unfused, fused one-shot and fused two-shot."""
    xs = [tune.make_inputs(tokens, hidden, DTYPE, r, seed=tokens)[0] for r in range(WORLD)]
    total = torch.stack([t.double() for t in xs]).sum(0) + residual.double()
    norm_ref = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    decisions = {"unfused": tables.UNFUSED, "fused_1shot": tables.Decision(True, True)}
    if tokens > WORLD:
        decisions["fused_2shot"] = tables.Decision(True, False)
    errors = {}
    for label, decision in decisions.items():
        with runtime.forced(decision):
            norm, res = runtime.fused_allreduce_rmsnorm_cuda(x, residual, weight, EPS, 0.0, group.group_name)
        errors[label] = {"norm": _rel(norm, norm_ref), "residual": _rel(res, total)}
    limit = {k: ERROR_RATIO_LIMIT * errors["unfused"][k] + 1e-7 for k in ("norm", "residual")}
    ok = all(errors[label][k] <= limit[k] for label in errors for k in limit)
    return errors, ok


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out.double() - ref).norm() / ref.norm())


def _measure_eager(comm: Any, group: dist.ProcessGroup, rank: int) -> list[dict[str, Any]]:
    """Per-call wall time of eager calls (host overhead included), max over ranks."""
    return [_eager_row(comm, group, rank, hidden, tokens) for hidden, tokens in EAGER_SHAPES]


def _eager_row(comm: Any, group: dist.ProcessGroup, rank: int, hidden: int, tokens: int) -> dict[str, Any]:
    x, residual, weight = tune.make_inputs(tokens, hidden, DTYPE, rank)
    runtime.prepare(group.group_name, hidden, DTYPE, max_tokens=tokens)
    raw_ws = comm.create_allreduce_fusion_workspace(
        backend="trtllm",
        world_size=WORLD,
        rank=rank,
        max_token_num=max(tokens, 8),
        hidden_dim=hidden,
        dtype=DTYPE,
        group=group,
    )
    norm_out, residual_out = torch.empty_like(x), torch.empty_like(x)
    pattern = comm.AllReduceFusionPattern.kARResidualRMSNorm
    fns: dict[str, Callable[[], object]] = {
        "pk_fallback": lambda: runtime.unfused_allreduce_rmsnorm(x, residual, weight, EPS, 0.0, group),
        "raw_1shot": lambda: comm.allreduce_fusion(
            input=x,
            workspace=raw_ws,
            pattern=pattern,
            launch_with_pdl=False,
            trigger_completion_at_end=True,
            residual_out=residual_out,
            norm_out=norm_out,
            residual_in=residual,
            rms_gamma=weight,
            rms_eps=EPS,
            use_oneshot=True,
        ),
        "pk_1shot": lambda: runtime.fused_allreduce_rmsnorm_cuda(
            x, residual, weight, EPS, 0.0, group.group_name
        ),
    }
    row: dict[str, Any] = {"hidden": hidden, "tokens": tokens}
    with runtime.forced(tables.Decision(True, True)):
        for label, fn in fns.items():
            row[label] = _eager_us(fn, group)
    raw_ws.destroy()
    return row


def _eager_us(fn: Callable[[], object], group: dist.ProcessGroup) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(EAGER_ITERS):
        fn()
    torch.cuda.synchronize()
    local = (time.perf_counter() - start) * 1e6 / EAGER_ITERS
    agreed = torch.tensor([local], dtype=torch.float64, device="cuda")
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return float(agreed.item())


def _tuned_table(rows: list[Row], margin: float) -> tables.Table:
    """The decision table these measurements imply (unfused = nccl_inductor, fused = pk_*)."""
    gpu = torch.cuda.get_device_name()
    entries = {}
    for hidden in sorted({r.hidden for r in rows}):
        measurements = [
            tables.Measurement(r.tokens, r.us["nccl_inductor"] or 0.0, r.us["pk_1shot"], r.us["pk_2shot"])
            for r in rows
            if r.hidden == hidden
        ]
        key = tables.TableKey(gpu, WORLD, hidden, tables.dtype_name(DTYPE))
        entries[key] = tables.Entry(
            tables.rules_from_measurements(measurements, margin),
            {
                "measured": datetime.date.today().isoformat(),
                "by": "benchmarks/fusion_op.py",
                "torch": torch.__version__,
                "flashinfer": runtime.flashinfer_version(),
                "margin": margin,
                "medians_us": [dataclasses.asdict(m) for m in measurements],
            },
        )
    return tables.Table(entries)


def _environment() -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "gpus": WORLD,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "flashinfer": runtime.flashinfer_version(),
        "dtype": tables.dtype_name(DTYPE),
        "eps": EPS,
        "timing": "CUDA graph of 10 calls, median replay time / 10; max over ranks",
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
    }


def _write_results(
    args: argparse.Namespace, rows: list[Row], eager: list[dict[str, Any]], table: tables.Table | None
) -> None:
    data = {
        "environment": _environment(),
        "rows": [dataclasses.asdict(r) for r in rows],
        "eager_us": eager,
        "tuned_table": table.to_json() if table else None,
    }
    (args.out / "fusion_op.json").write_text(json.dumps(data, indent=1) + "\n")
    if table is not None:
        (args.out / "fusion_op.md").write_text(_markdown(rows, eager, table))
        slug = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
        tables.save_table(table, args.out / f"table_{slug}_w{WORLD}.json")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _markdown(rows: list[Row], eager: list[dict[str, Any]], table: tables.Table) -> str:
    env = _environment()
    lines = [
        f"# Fused all-reduce + residual + RMSNorm, op level ({env['gpus']}x {env['gpu']})",
        "",
        f"{env['date']}; torch {env['torch']} (CUDA {env['cuda']}, NCCL {env['nccl']}), "
        f"flashinfer {env['flashinfer']}, {env['dtype']}, eps {env['eps']}. {env['timing']}.",
        "",
        "Microseconds per call. speedup = nccl_inductor / fastest passkit fused variant; "
        "pk_auto path = what the op chose with the tables shipped when this ran.",
        "",
        "| hidden | tokens | nccl_torch | nccl_inductor | raw_1shot | raw_2shot | pk_auto | pk_auto path "
        "| pk_1shot | pk_2shot | speedup | tuned choice | numerics |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fused = [t for t in (r.us["pk_1shot"], r.us["pk_2shot"]) if t]
        speedup = (r.us["nccl_inductor"] or 0.0) / min(fused) if fused else 0.0
        choice = table.lookup(env["gpu"], WORLD, r.hidden, DTYPE, r.tokens).label()
        err = r.errors
        numerics = (
            f"{'ok' if r.numerics_ok else 'FAIL'} (unf {err['unfused']['norm']:.2e}, "
            f"1s {err['fused_1shot']['norm']:.2e}"
            + (f", 2s {err['fused_2shot']['norm']:.2e})" if "fused_2shot" in err else ")")
        )
        lines.append(
            f"| {r.hidden} | {r.tokens} | "
            + " | ".join(_fmt(r.us[v]) for v in VARIANTS[:5])
            + f" | {r.pk_auto_path} | {_fmt(r.us['pk_1shot'])} | {_fmt(r.us['pk_2shot'])} "
            f"| {speedup:.2f}x | {choice} | {numerics} |"
        )
    lines += [
        "",
        "Eager calls (host overhead included), microseconds per call; pk_fallback is the "
        "op's unfused path (copy + NCCL all_reduce + add + RMSNorm):",
        "",
        "| hidden | tokens | pk_fallback | raw_1shot | pk_1shot |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {e['hidden']} | {e['tokens']} | {e['pk_fallback']:.1f} | {e['raw_1shot']:.1f} "
        f"| {e['pk_1shot']:.1f} |"
        for e in eager
    ]
    lines += ["", "Tuned rules (tokens up to max_tokens take the decision; above: unfused):", ""]
    for key, entry in table.entries.items():
        rules = ", ".join(f"<= {r.max_tokens}: {r.decision.label()}" for r in entry.rules)
        lines.append(f"- hidden {key.hidden}: {rules or 'never fuse'}")
    return "\n".join(lines) + "\n"


def _print_row(row: Row, elapsed: float) -> None:
    us = "  ".join(f"{v}={_fmt(row.us[v])}" for v in VARIANTS)
    errs = " ".join(f"{k}:{v['norm']:.2e}/{v['residual']:.2e}" for k, v in row.errors.items())
    print(
        f"[{elapsed:6.1f}s] h={row.hidden} t={row.tokens}  {us}  auto={row.pk_auto_path}  "
        f"err(norm/res) {errs}  {'ok' if row.numerics_ok else 'NUMERICS FAIL'}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
