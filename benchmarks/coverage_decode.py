"""A Qwen3-MoE-shaped step at TP=2: Inductor vs passkit's ``allreduce_rmsnorm``, side by side.

Hugging Face's ``Qwen3MoeModel`` at Qwen3-30B-A3B's dimensions (hidden 2048, 32 query heads
of 128, 4 KV heads, 128 experts of 768, top-8, vocabulary 151936), ``--layers`` decoder
layers (default 8), random bf16 weights, sharded with ``tp_plan="auto"`` over ``--world``
GPUs (NCCL). The step is the decoder stack (no LM head) on T new tokens (batch 1, no KV
context), T = 1..256: the all-reduces, norms, attention projections and MoE blocks of a
decode step batched over T tokens. Variants, each compiled once with a dynamic token
dimension:

* ``inductor``: ``torch.compile`` as is;
* ``allreduce_rmsnorm``: passkit with ``allreduce_rmsnorm`` (flashinfer), every site the
  matcher takes (MoE blocks included: their all-reduce is followed by a reshape).

Each variant runs in each ``--modes`` entry: ``default`` (``torch.compile``'s default mode;
each token count captured by this script into a CUDA graph and timed over ``--replays``
replays, median) and ``reduce-overhead`` (``mode="reduce-overhead"``: Inductor's own CUDA
graphs, each call timed with CUDA events after warm-up, median). One table per mode: both
latencies, the ratio, the sites fused and the largest difference between the two outputs.

    python benchmarks/coverage.py --decode --device cuda --world 2 [--layers 8] [--tokens 1,2,4,...,256] [--modes default,reduce-overhead]

``--device cpu`` runs a tiny version (hidden 64, 4 experts) on a gloo world with the
reference op and wall-clock timing: a smoke test of this script, not a measurement.
Writes benchmarks/results/coverage_decode_cuda.md (and $OUT/ when set).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REAL_DIMS: dict[str, Any] = {  # Qwen3-30B-A3B
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "vocab_size": 151936,
}
TINY_DIMS: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "moe_intermediate_size": 32,
    "intermediate_size": 128,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 256,
}


def build_checkpoint(folder: Path, args: argparse.Namespace) -> None:
    import transformers

    dims = REAL_DIMS if args.device == "cuda" else TINY_DIMS
    config = transformers.Qwen3MoeConfig(num_hidden_layers=args.layers, **dims)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with torch.device(args.device):  # random init of ~5B parameters: on the GPU it takes seconds
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()


MODES = ("default", "reduce-overhead")


def _variants(args: argparse.Namespace) -> dict[str, Any]:
    """``inductor`` (the baseline) and the passkit variants asked for: ``allreduce_rmsnorm``
    (every site fused at every token count) and ``tabled`` (the pass as shipped: fused where
    the tuned tables or the conservative rules say it pays)."""
    impl = "flashinfer" if args.device == "cuda" else "reference"
    known = {
        "allreduce_rmsnorm": [
            {"name": "allreduce_rmsnorm", "implementation": impl, "restrict_tokens": False}
        ],
        "tabled": [{"name": "allreduce_rmsnorm", "implementation": impl}],
    }
    asked = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in asked if v not in known]
    if bad or not asked:
        raise SystemExit(f"--variants: {', '.join(bad) or 'empty'}: choose among {', '.join(known)}")
    return {"inductor": None, **{v: known[v] for v in asked}}


def _modes(args: argparse.Namespace) -> list[str]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SystemExit(f"--modes: {', '.join(bad) or 'empty'}: choose among {', '.join(MODES)}")
    return modes


def _key(name: str, mode: str) -> str:
    """The variant's label in a mode: ``inductor``, ``inductor reduce-overhead``."""
    return name if mode == "default" else f"{name} {mode}"


def worker(rank: int, world: int, folder: str, args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    import passkit

    os.environ["LOCAL_RANK"] = str(rank)
    torch._dynamo.config.cache_size_limit = 64  # T = 1 may get its own graph
    os.environ.setdefault("WORLD_SIZE", str(world))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder,
        distributed_config=transformers.DistributedConfig(tp_plan="auto", tp_size=world),
        dtype=torch.bfloat16 if cuda else torch.float32,
        experts_implementation=args.experts,
    ).eval()
    base = model.model
    device = next(base.parameters()).device
    tokens = [int(t) for t in args.tokens.split(",")]
    out: dict[str, Any] = {
        "us": {},
        "matches": {},
        "diff": {},
        "device": str(device),
        "transformers": transformers.__version__,
    }
    outputs: dict[str, dict[int, torch.Tensor]] = {}

    def step_for(fn: Any, t: int) -> Any:
        ids = torch.randint(0, base.config.vocab_size, (1, t)).to(device)
        return lambda: fn(input_ids=ids, use_cache=False).last_hidden_state

    for mode in _modes(args):
        for name, passes in _variants(args).items():
            key = _key(name, mode)
            torch._dynamo.reset()
            backend: Any = "inductor" if passes is None else passkit.backend(passes=passes)
            compile_mode = None if mode == "default" else mode
            compiled = torch.compile(base, backend=backend, mode=compile_mode)  # token dim dynamic below
            outputs[key] = {}
            for t in tokens:
                ids = torch.randint(
                    0, base.config.vocab_size, (1, t), generator=torch.Generator().manual_seed(t)
                ).to(device)
                torch._dynamo.mark_dynamic(ids, 1)

                def step(ids: torch.Tensor = ids, fn: Any = compiled) -> torch.Tensor:
                    return fn(input_ids=ids, use_cache=False).last_hidden_state

                with torch.no_grad():
                    outputs[key][t] = step().float().cpu()
                    out["us"][(key, t)] = _time(step, args, cuda, graphs_of_its_own=compile_mode is not None)
            if cuda and mode == "default" and args.profile in tokens:
                _profile(step_for(compiled, args.profile), key, args.profile, rank)
            if passes is not None:
                out["matches"][key] = [
                    rec.matches for r in backend.reports for rec in r.records if rec.name == passes[0]["name"]
                ]
                out["notes"] = [n for rec in backend.reports[-1].records for n in rec.notes]
        for name in _variants(args):
            for t in tokens:
                a, b = outputs[_key(name, mode)][t], outputs[_key("inductor", mode)][t]
                out["diff"][(_key(name, mode), t)] = (a - b).abs().max().item()

    return out


def _profile(step: Any, key: str, t: int, rank: int) -> None:
    """The GPU kernels of 5 plain calls of ``step`` (no CUDA graph: each kernel seen), top 25
    by CUDA time, written to ``$OUT/profile_<variant>_<T>.txt`` by rank 0."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
    if rank == 0 and os.environ.get("OUT"):
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90)
        (Path(os.environ["OUT"]) / f"profile_{key.replace(' ', '_')}_{t}.txt").write_text(table)


def _time(step: Any, args: argparse.Namespace, cuda: bool, graphs_of_its_own: bool = False) -> float:
    """Median microseconds of a CUDA-graph replay of ``step``; where the step cannot be
    captured (a host sync in the experts' routing), of a plain call timed with events
    (said in the output: the label ends with ``*``). ``graphs_of_its_own``: the step replays
    Inductor's CUDA graphs (``reduce-overhead``): its calls are timed with events, after
    warm-up calls (the first ones record the graphs), the ranks lined up by a barrier before
    each (a collective waits for both)."""
    if cuda and graphs_of_its_own:
        from passkit_fusion.tuning.timing import call_median_us

        with torch.no_grad():
            return call_median_us(step, calls=args.replays, before_call=torch.distributed.barrier)
    if cuda:
        from passkit_fusion.tuning.timing import call_median_us, replay_median_us

        try:
            with torch.no_grad():
                return replay_median_us(step, replays=args.replays, before_replays=torch.distributed.barrier)
        except Exception as exc:  # not capturable: time the eager launches instead
            print(f"CUDA graph capture failed ({type(exc).__name__}: {exc}); timing plain calls", flush=True)
            with torch.no_grad():
                return -call_median_us(step, calls=args.replays, warmup=0)  # negative: marks "no CUDA graph"
    times = []
    with torch.no_grad():
        for _ in range(args.replays):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def render(rank0: dict[str, Any], args: argparse.Namespace) -> str:
    tokens = [int(t) for t in args.tokens.split(",")]
    dims = "real dims, bf16" if args.device == "cuda" else "tiny dims, fp32"
    lines = [
        f"Qwen3-MoE-shaped stack, {args.layers} layers, TP={args.world} on {rank0['device']} ({dims}), "
        f"experts {args.experts}, torch {torch.__version__}, transformers {rank0.get('transformers', '?')}",
    ]
    for mode in _modes(args):
        if args.device != "cuda":
            timing = "wall clock, median (smoke run)"
        elif mode == "default":
            timing = "CUDA-graph replay (captured by the script), median"
        else:
            timing = "calls replaying Inductor's CUDA graphs, timed with CUDA events, median"
        names = [n for n in _variants(args) if n != "inductor"]
        fused = "; ".join(f"{n}: {rank0['matches'].get(_key(n, mode))}" for n in names)
        lines += [
            "",
            f"### mode {mode}: {timing} of {args.replays}; sites fused per compiled graph: {fused}",
            "",
            "| tokens | inductor (us) | "
            + " | ".join(f"{n} (us) | speed-up | max abs diff" for n in names)
            + " |",
            "|---|---|" + "---|---|---|" * len(names),
        ]
        for t in tokens:
            base = rank0["us"][(_key("inductor", mode), t)]
            cells = [str(t), _us(base)]
            for n in names:
                v = rank0["us"][(_key(n, mode), t)]
                cells += [_us(v), f"{abs(base) / abs(v):.3f}x", f"{rank0['diff'][(_key(n, mode), t)]:.2e}"]
            lines.append("| " + " | ".join(cells) + " |")
    if any(v < 0 for v in rank0["us"].values()):
        lines += ["", "\\* not capturable into a CUDA graph: plain calls timed with CUDA events"]
    lines += ["", "allreduce_rmsnorm notes: " + " | ".join(rank0.get("notes", []))]
    return "\n".join(lines)


def _us(value: float) -> str:
    """Microseconds; ``*`` where the step was timed without a CUDA graph (negative)."""
    return f"{abs(value):.1f}" + ("*" if value < 0 else "")


def main(argv: list[str] | None = None) -> int:
    from passkit_fusion.demo import run_world

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument(
        "--variants",
        default="allreduce_rmsnorm",
        help="comma-separated passkit variants next to inductor: allreduce_rmsnorm (every site, "
        "every size), tabled (as shipped: where the tables say it pays)",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="T",
        help="GPU: the kernels of each variant at T tokens (default mode), to $OUT/profile_*.txt",
    )
    ap.add_argument(
        "--modes",
        default="default,reduce-overhead",
        help=f"comma-separated torch.compile modes, among {', '.join(MODES)} (default: both)",
    )
    ap.add_argument(
        "--experts",
        default="grouped_mm",
        help="transformers experts_implementation: grouped_mm (default), batched_mm, eager",
    )
    args = ap.parse_args(argv)
    _modes(args)  # a bad --modes or --variants fails before any model is built
    _variants(args)
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        print(f"needs {args.world} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    if args.device == "cpu":
        args.replays = min(args.replays, 3)
    folder = Path(tempfile.mkdtemp(prefix="passkit-decode-"))
    try:
        build_checkpoint(folder, args)
        ranks = run_world(
            worker,
            "nccl" if args.device == "cuda" else "gloo",
            args.world,
            args=(str(folder), args),
            timeout=3000,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    text = render(ranks[0], args)
    print(text)
    name = f"coverage_decode_{args.device}.md"
    if args.device == "cuda":  # the CPU run is a smoke test, not a result
        (HERE / "results" / name).write_text("# benchmarks/coverage.py --decode\n\n" + text + "\n")
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / name).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
