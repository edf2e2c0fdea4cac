"""What a compile costs through passkit vs Inductor alone: cold and warm, side by side.

For each config (world size 1 with the serving passes, which cannot run there; world size 2
with the three fusion passes) and each variant (Inductor alone; passkit compiling every
token range at the first call; passkit compiling each range at its first use), one fresh
process compiles a Llama-style model with a dynamic token dimension and calls it at token
counts that visit every range passkit plans. Cold: an empty Inductor cache directory;
warm: the same directory again (FX-graph and AOTAutograd caches hit). Printed per variant:
the compiles (specializations), the first call's seconds (what a notebook waits for), the
seconds until every size ran (what a serving warm-up waits for), each against Inductor.

    python benchmarks/compile_bill.py                       # CPU: gloo, reference ops
    python benchmarks/compile_bill.py --device cuda --model hf-llama --worlds 1
    python benchmarks/compile_bill.py --smoke               # tiny, for the test suite

Results: benchmarks/results/compile_bill_<device>.md/.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
SERVING = ["sequence_parallel", "async_tp", "allreduce_rmsnorm", "cleanup"]
VARIANTS = ("inductor", "passkit first_call", "passkit first_use")


def passes_for(device: str) -> list[Any]:
    """The serving config; on CPU the fusion ops' reference / test-mode implementations,
    with allreduce_rmsnorm bounded as the world-2 H200 table bounds it."""
    if device == "cuda":
        return list(SERVING)
    return [
        "sequence_parallel",
        {"name": "async_tp", "implementation": "test_mode"},
        {"name": "allreduce_rmsnorm", "implementation": "reference", "max_tokens": 4096},
        "cleanup",
    ]


def build_model(args: argparse.Namespace, rank: int, world: int):
    import torch

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    device = (
        torch.device(args.device, rank if args.device == "cuda" else 0) if args.device == "cuda" else "cpu"
    )
    torch.manual_seed(0)
    if args.model == "hf-llama":
        from compile_modes import hf_llama

        model, vocab = hf_llama(args.layers, device, dtype)
        return model, vocab, device
    from passkit_fusion.model import LlamaConfig as TinyConfig
    from passkit_fusion.model import TinyLlama, shard_functional

    cfg = TinyConfig(
        hidden=args.hidden, layers=args.layers, intermediate=2 * args.hidden, heads=4, kv_heads=2
    )
    model = TinyLlama(cfg).to(device=device, dtype=dtype).eval()
    if world > 1:
        import torch.distributed as dist

        model = shard_functional(model, dist.group.WORLD, rank, world)
    return model, cfg.vocab, device


def measure(rank: int, world: int, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One variant's compile in this process: seconds of the first call, then of each size."""
    import torch

    import passkit

    model, vocab, device = build_model(args, rank, world)
    if variant == "inductor":
        backend: Any = "inductor"
    else:
        backend = passkit.backend(passes=passes_for(args.device), compile_at=variant.split()[1])
    compiled = torch.compile(model, backend=backend)
    sizes = [int(t) for t in args.tokens]
    times = []
    with torch.no_grad():
        for t in sizes:
            ids = torch.randint(0, vocab, (1, t), device=device, generator=None)
            torch._dynamo.mark_dynamic(ids, 1)
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            compiled(ids)
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    out: dict[str, Any] = {"first_call_s": times[0], "all_sizes_s": sum(times), "sizes": sizes}
    if variant == "inductor":
        from torch._dynamo.utils import counters

        out["compiles"] = int(counters["stats"]["unique_graphs"]) or 1
    else:
        ranges = sorted({r.token_range or "every size" for r in backend.reports})
        out["compiles"] = len(backend.reports)
        out["ranges"] = ranges
        out["passkit_compile_s"] = [r.compile_s for r in backend.reports]
    return out


def _child(args: argparse.Namespace) -> None:
    """Run one variant (in a fresh process); print its JSON result on the last line."""
    world, variant = args.world, args.variant
    if world == 1:
        result = measure(0, 1, variant, args)
    else:
        from passkit_testing import gloo_world, nccl_world

        run = nccl_world if args.device == "cuda" else gloo_world
        result = run(measure, world, args=(variant, args), timeout=args.limit)[0]
    print(json.dumps(result))


def run_variant(args: argparse.Namespace, world: int, variant: str, cache_dir: str) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--world",
        str(world),
        "--variant",
        variant,
        "--device",
        args.device,
        "--model",
        args.model,
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.hidden),
        "--limit",
        str(args.limit),
        "--tokens",
        *map(str, args.tokens),
    ]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.limit + 60)
    if done.returncode != 0:
        raise SystemExit(f"{variant} (world {world}) failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def render(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    head = (
        "| world | cache | variant | compiles | first call s | vs Inductor | every size s | vs Inductor |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for row in rows:
        base = next(
            r
            for r in rows
            if r["world"] == row["world"] and r["cache"] == row["cache"] and r["variant"] == "inductor"
        )
        lines.append(
            f"| {row['world']} | {row['cache']} | {row['variant']} | {row['compiles']} | "
            f"{row['first_call_s']:.2f} | {row['first_call_s'] / base['first_call_s']:.2f}x | "
            f"{row['all_sizes_s']:.2f} | {row['all_sizes_s'] / base['all_sizes_s']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", choices=["tiny", "hf-llama"], default="tiny")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 7, 2048, 2049, 4098, 4099])
    parser.add_argument("--repeats", type=int, default=1, help="median of this many runs per cell")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, metavar="VARIANT")
    parser.add_argument("--limit", type=float, default=900.0, help="seconds per variant run")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one layer (for tests)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="inductor", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    if args.smoke:
        args.layers, args.hidden, args.tokens = 1, 64, [16, 7, 2048, 2049]
    rows: list[dict[str, Any]] = []
    variants = [v for v in VARIANTS if v in args.variants]
    for world in args.worlds:
        runs_of: dict[str, dict[str, list[dict[str, Any]]]] = {v: {"cold": [], "warm": []} for v in variants}
        for repeat in range(args.repeats):  # the variants alternate: drift hits each alike
            for variant in variants if repeat % 2 == 0 else list(reversed(variants)):
                with tempfile.TemporaryDirectory(prefix="passkit-compile-bill-") as cache:
                    for temperature in ("cold", "warm"):
                        print(f"[world {world}] {variant}: {temperature} ...", file=sys.stderr, flush=True)
                        runs_of[variant][temperature].append(run_variant(args, world, variant, cache))
        for variant in variants:
            for cache, runs in runs_of[variant].items():
                rows.append(
                    {
                        "world": world,
                        "cache": cache,
                        "variant": variant,
                        "compiles": runs[0]["compiles"],
                        "ranges": runs[0].get("ranges"),
                        "first_call_s": statistics.median(r["first_call_s"] for r in runs),
                        "all_sizes_s": statistics.median(r["all_sizes_s"] for r in runs),
                    }
                )
    rows.sort(key=lambda r: (r["world"], r["cache"] != "cold", VARIANTS.index(r["variant"])))
    for row in rows:
        row["repeats"] = args.repeats
    table = render(rows, args)
    import platform

    import torch

    machine = f"{platform.node()} ({os.cpu_count()} CPUs), torch {torch.__version__}, device {args.device}"
    if args.device == "cuda":
        machine += f" ({torch.cuda.get_device_name()})"
    title = (
        f"compile bill: model {args.model}, {args.layers} layers, hidden {args.hidden if args.model == 'tiny' else 4096}, "
        f"tokens {args.tokens}; {machine}"
    )
    print(title)
    print(table)
    for row in rows:
        if row["variant"] != "inductor" and row["cache"] == "cold":
            print(f"world {row['world']} {row['variant']}: ranges {row['ranges']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(f"{title}\n\n{table}\n")
        args.out.with_suffix(".json").write_text(json.dumps({"title": title, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
