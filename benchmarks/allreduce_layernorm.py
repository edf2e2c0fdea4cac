"""Op-level benchmark of all-reduce + residual add + LayerNorm on N local GPUs (spawns N ranks).

Does ``allreduce_layernorm`` pay? Per token count (1..256 by default) at hidden 4096
(``--hidden 4096 8192`` for more), bf16, world ``--world`` (2) over NCCL, each rank times
each variant CUDA-graph captured (10 calls per graph, median over many replays, max over
ranks), microseconds per call:

* ``inductor``: ``torch.compile`` (default Inductor) of ``F.layer_norm(all_reduce(x) +
  residual)`` with the functional all-reduce: what a compiled graph runs where the pass
  leaves the site alone. The baseline.
* ``fused``: ``torch.ops.passkit_fusion.allreduce_add_layernorm`` with ``impl="symm_mem"``,
  ``norm_kernel="triton"``: torch's symmetric-memory one-shot all-reduce into the op's
  persistent buffer, then residual add + LayerNorm in one Triton kernel. What the pass runs.
* ``symm_torch``: the same op with ``norm_kernel="torch"`` (``torch.add`` + ``F.layer_norm``).
* ``symm_inductor``: the one-shot all-reduce, then Inductor's compiled add + LayerNorm.

Numerics per shape: the fused outputs against the baseline's (``residual_out`` exact,
``norm_out`` max abs difference). The table's ``speedup`` is ``inductor / fused``; the
pass becomes a default candidate only when it is >= 1.05 at every token count of 1-256 at
TP=2 (the ``verdict`` line).

Writes ``<out>.json`` and ``<out>.md``; ``--out`` is a path prefix (default
``benchmarks/results/allreduce_layernorm``).

    python3 benchmarks/allreduce_layernorm.py --world 2 --out benchmarks/results/allreduce_layernorm_h200x2
    python3 benchmarks/allreduce_layernorm.py --cpu --tokens 1 8 --hidden 64   # gloo smoke run, no GPU

``--cpu``: a gloo world on the CPU, wall-clock medians of eager calls, the op's reference
implementation and ``aot_eager`` for the baseline: it checks the script, not speed.
NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
EPS = 1e-5
VARIANTS = ("inductor", "fused", "symm_torch", "symm_inductor")
GATE = 1.05
"""The speedup over Inductor the fused op must reach at every token count 1-256 (TP=2)."""


@dataclasses.dataclass
class Row:
    hidden: int
    tokens: int
    us: dict[str, float | None]
    """Median microseconds per call, max over ranks (None: not run)."""
    residual_exact: bool
    norm_max_abs: float
    path: str
    """The path the fused op took (``symm_mem``, ``fallback:<reason>``)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks, one GPU each (default 2)")
    p.add_argument("--hidden", type=int, nargs="+", default=[4096])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--replays", type=int, default=200, help="graph replays per measurement (default 200)")
    p.add_argument(
        "--max-bytes", type=int, default=4 * 2**20, help="the op's one-shot threshold and buffer size"
    )
    p.add_argument("--cpu", action="store_true", help="gloo smoke run on the CPU (no timing worth reading)")
    p.add_argument(
        "--out",
        type=Path,
        default=HERE / "results" / "allreduce_layernorm",
        help="path prefix of the .json and .md results",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch
    import torch.multiprocessing as mp

    if not args.cpu and torch.cuda.device_count() < args.world:
        print(f"needs {args.world} GPUs, found {torch.cuda.device_count()} (--cpu: the gloo smoke run)")
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    json_path = args.out.with_suffix(".json")
    json_path.unlink(missing_ok=True)
    from worlds import free_port  # benchmarks/ is on sys.path when run as a script

    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(rank, port, args, str(json_path))) for rank in range(args.world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [i for i, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        print(f"ranks {failed} failed (exit codes {[procs[i].exitcode for i in failed]})", file=sys.stderr)
        return 1
    if not json_path.exists():
        print("rank 0 wrote no result", file=sys.stderr)
        return 1
    payload = json.loads(json_path.read_text())
    rows = [Row(**r) for r in payload["rows"]]
    text = render(rows, payload["environment"])
    print(text)
    args.out.with_suffix(".md").write_text(text)
    return 0


def _rank_main(rank: int, port: int, args: argparse.Namespace, json_path: str) -> None:
    import torch.distributed as dist
    from worlds import join

    join(rank, args.world, port, cuda=not args.cpu)
    try:
        rows = _run(rank, args)
        if rank == 0:  # before the teardown: the results are kept whatever happens after
            payload = {"environment": environment(args), "rows": [dataclasses.asdict(r) for r in rows]}
            Path(json_path).write_text(json.dumps(payload, indent=1) + "\n")
    finally:
        if not args.cpu:
            from passkit_fusion.allreduce_layernorm import runtime

            runtime.destroy_buffers()
        dist.destroy_process_group()


def _run(rank: int, args: argparse.Namespace) -> list[Row]:
    import torch
    import torch._dynamo
    import torch.distributed as dist

    torch._dynamo.config.recompile_limit = 256  # one static compile per shape and variant
    torch._dynamo.config.accumulated_recompile_limit = 4096
    from passkit_fusion.allreduce_layernorm import (
        ops,  # noqa: F401  (defines the op)
        runtime,
    )

    group = dist.group.WORLD
    assert group is not None
    name = group.group_name
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float32 if args.cpu else torch.bfloat16
    backend = "aot_eager" if args.cpu else "inductor"
    baseline = torch.compile(_unfused, backend=backend, fullgraph=True, dynamic=False)
    add_ln = torch.compile(_add_layernorm, backend=backend, fullgraph=True, dynamic=False)
    impl = "reference" if args.cpu else "symm_mem"
    rows: list[Row] = []
    started = time.perf_counter()
    for hidden in args.hidden:
        if not args.cpu:
            runtime.prepare(name, dtype, args.max_bytes, device=device)
        for tokens in sorted(args.tokens):
            x, r, w, b = _inputs(tokens, hidden, dtype, device, rank)

            def op(kernel: str, x=x, r=r, w=w, b=b) -> Any:
                return torch.ops.passkit_fusion.allreduce_add_layernorm(
                    x, r, w, b, EPS, name, impl, kernel, args.max_bytes
                )

            def symm_inductor(x=x, r=r, w=w, b=b) -> Any:
                return add_ln(runtime.one_shot_all_reduce(x, name, args.max_bytes), r, w, b)

            def unfused(x=x, r=r, w=w, b=b) -> Any:
                return baseline(x, r, w, b, name)

            steps: dict[str, Callable[[], Any] | None] = {
                "inductor": unfused,
                "fused": lambda: op("triton"),
                "symm_torch": lambda: op("torch"),
                "symm_inductor": None if args.cpu else symm_inductor,
            }
            want_norm, want_total = baseline(x, r, w, b, name)
            runtime.reset_stats()
            got_norm, got_total = op("triton")
            path = ",".join(sorted(runtime.stats())) or impl
            local = [(_time(step, args) if step is not None else -1.0) for step in steps.values()]
            agreed = torch.tensor(local, dtype=torch.float64, device=device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            diff = (got_norm.float() - want_norm.float()).abs().max().item() if got_norm.numel() else 0.0
            row = Row(
                hidden,
                tokens,
                {v: (t if t >= 0 else None) for v, t in zip(steps, agreed.tolist())},
                bool(torch.equal(got_total, want_total)),
                float(diff),
                path,
            )
            rows.append(row)
            if rank == 0:
                us = "  ".join(f"{k}={_fmt(v)}" for k, v in row.us.items())
                print(
                    f"[{time.perf_counter() - started:6.1f}s] h={hidden} t={tokens}  {us}  path={path}  "
                    f"residual {'exact' if row.residual_exact else 'DIFFERS'}, norm max abs {diff:.2e}",
                    flush=True,
                )
    return rows


def _unfused(x: Any, r: Any, w: Any, b: Any, group_name: str) -> Any:
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    total = funcol.all_reduce(x, "sum", group_name) + r  # type: ignore[arg-type]
    return F.layer_norm(total, (total.shape[-1],), w, b, EPS), total


def _add_layernorm(reduced: Any, r: Any, w: Any, b: Any) -> Any:
    import torch.nn.functional as F

    total = reduced + r
    return F.layer_norm(total, (total.shape[-1],), w, b, EPS), total


def _inputs(tokens: int, hidden: int, dtype: Any, device: Any, rank: int) -> tuple[Any, ...]:
    import torch

    rep = torch.Generator().manual_seed(tokens)
    own = torch.Generator().manual_seed(1000 + 17 * rank + tokens)
    x = torch.randn(tokens, hidden, generator=own).to(dtype).to(device)
    r = torch.randn(tokens, hidden, generator=rep).to(dtype).to(device)
    w = (1.0 + 0.1 * torch.randn(hidden, generator=rep)).to(dtype).to(device)
    b = (0.1 * torch.randn(hidden, generator=rep)).to(dtype).to(device)
    return x, r, w, b


def _time(step: Callable[[], Any], args: argparse.Namespace) -> float:
    """Median microseconds of one call: CUDA-graph timed on the GPU (10 calls per graph,
    ``--replays`` replays), wall clock of eager calls on the CPU."""
    import torch.distributed as dist

    dist.barrier()
    if args.cpu:
        for _ in range(2):
            step()
        times = []
        for _ in range(max(3, min(args.replays, 20))):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)
    from passkit_fusion.tuning import timing

    return timing.graph_median_us(step, replays=args.replays)


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    gpu = "cpu (gloo)" if args.cpu else torch.cuda.get_device_name()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "world": args.world,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "dtype": "float32" if args.cpu else "bfloat16",
        "eps": EPS,
        "max_bytes": args.max_bytes,
        "timing": (
            "wall clock of eager calls (CPU smoke run)"
            if args.cpu
            else "CUDA graph of 10 calls, median replay time / 10; max over ranks"
        ),
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def verdict(rows: list[Row], env: dict[str, Any]) -> str:
    """Whether the fused op reaches :data:`GATE` over Inductor at every token count 1-256."""
    if str(env["gpu"]).startswith("cpu"):
        return "verdict: none (CPU smoke run: the reference op and aot_eager, nothing GPU-like timed)"
    gated = [r for r in rows if 1 <= r.tokens <= 256 and r.us.get("fused") and r.us.get("inductor")]
    if env["world"] != 2 or not gated:
        return "verdict: not a TP=2 run of 1-256 tokens: no verdict on the default"
    worst = min(gated, key=lambda r: r.us["inductor"] / r.us["fused"])  # type: ignore[operator]
    ratio = worst.us["inductor"] / worst.us["fused"]  # type: ignore[operator]
    ok = ratio >= GATE and all(r.residual_exact for r in gated)
    return (
        f"verdict: {'PAYS' if ok else 'does not pay'}: the smallest speedup is {ratio:.2f}x "
        f"(hidden {worst.hidden}, {worst.tokens} tokens); the gate is >= {GATE}x at every token count "
        f"1-256 ({'recommend it for LayerNorm models' if ok else 'keep it out of serving configs on this machine'})"
    )


def render(rows: list[Row], env: dict[str, Any]) -> str:
    """The Markdown table: microseconds per call side by side, the ratios, the numerics."""
    lines = [
        f"# All-reduce + residual add + LayerNorm, op level ({env['world']}x {env['gpu']})",
        "",
        f"{env['date']}; torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, {env['dtype']}, "
        f"eps {env['eps']}, one-shot threshold {env['max_bytes']} bytes. {env['timing']}.",
        "",
        "Microseconds per call. inductor: torch.compile of functional all-reduce + add + LayerNorm "
        "(the baseline); fused: the op (symmetric-memory one-shot + Triton add+LayerNorm); "
        "symm_torch: the op with norm_kernel='torch'; symm_inductor: one-shot + Inductor's add+LayerNorm. "
        "x = inductor / variant.",
        "",
        "| hidden | tokens | inductor | fused | x | symm_torch | x | symm_inductor | x | op path | residual | norm max abs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = r.us.get("inductor")
        cells = []
        for v in VARIANTS[1:]:
            t = r.us.get(v)
            cells += [_fmt(t), f"{base / t:.2f}x" if base and t else "-"]
        lines.append(
            f"| {r.hidden} | {r.tokens} | {_fmt(base)} | " + " | ".join(cells) + f" | {r.path} | "
            f"{'exact' if r.residual_exact else 'DIFFERS'} | {r.norm_max_abs:.2e} |"
        )
    lines += ["", verdict(rows, env)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
