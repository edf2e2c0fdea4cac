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

Each token count is captured into a CUDA graph and timed over ``--replays`` replays (median);
the table prints both latencies, the ratio, the sites fused and the largest difference
between the two outputs.

    python benchmarks/coverage.py --decode --device cuda --world 2 [--layers 8] [--tokens 1,2,4,...,256]

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


def _variants(args: argparse.Namespace) -> dict[str, Any]:
    impl = "flashinfer" if args.device == "cuda" else "reference"
    return {
        "inductor": None,
        "allreduce_rmsnorm": [
            {"name": "allreduce_rmsnorm", "implementation": impl, "restrict_tokens": False}
        ],
    }


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
    out: dict[str, Any] = {"us": {}, "matches": {}, "diff": {}, "device": str(device)}
    outputs: dict[str, dict[int, torch.Tensor]] = {}
    for name, passes in _variants(args).items():
        torch._dynamo.reset()
        backend: Any = "inductor" if passes is None else passkit.backend(passes=passes)
        compiled = torch.compile(base, backend=backend)  # the token dim marked dynamic below
        outputs[name] = {}
        for t in tokens:
            ids = torch.randint(0, base.config.vocab_size, (1, t), generator=torch.Generator().manual_seed(t))
            ids = ids.to(device)
            torch._dynamo.mark_dynamic(ids, 1)

            def step(ids: torch.Tensor = ids, fn: Any = compiled) -> torch.Tensor:
                return fn(input_ids=ids, use_cache=False).last_hidden_state

            with torch.no_grad():
                outputs[name][t] = step().float().cpu()
                out["us"][(name, t)] = _time(step, args, cuda)
        if passes is not None:
            out["matches"][name] = [
                rec.matches for r in backend.reports for rec in r.records if rec.name == passes[0]["name"]
            ]
            out["notes"] = [n for rec in backend.reports[-1].records for n in rec.notes]
    for t in tokens:
        out["diff"][t] = (outputs["allreduce_rmsnorm"][t] - outputs["inductor"][t]).abs().max().item()
    return out


def _time(step: Any, args: argparse.Namespace, cuda: bool) -> float:
    """Median microseconds of a CUDA-graph replay of ``step``; where the step cannot be
    captured (a host sync in the experts' routing), of a plain call timed with events
    (said in the output: the label ends with ``*``)."""
    if cuda:
        from passkit_fusion.tuning.timing import replay_median_us

        try:
            with torch.no_grad():
                return replay_median_us(step, replays=args.replays)
        except Exception as exc:  # not capturable: time the eager launches instead
            print(f"CUDA graph capture failed ({type(exc).__name__}: {exc}); timing plain calls", flush=True)
            times = []
            with torch.no_grad():
                for _ in range(args.replays):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) * 1e3)
            return -statistics.median(times)  # negative: marks "no CUDA graph"
    times = []
    with torch.no_grad():
        for _ in range(args.replays):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def render(rank0: dict[str, Any], args: argparse.Namespace) -> str:
    tokens = [int(t) for t in args.tokens.split(",")]
    timing = "CUDA-graph replay, median" if args.device == "cuda" else "wall clock, median (smoke run)"
    lines = [
        f"Qwen3-MoE-shaped stack, {args.layers} layers, TP={args.world} on {rank0['device']} "
        f"({'real dims, bf16' if args.device == 'cuda' else 'tiny dims, fp32'}), experts {args.experts}; "
        f"{timing} of {args.replays}; allreduce_rmsnorm sites fused per compiled graph: "
        f"{rank0['matches'].get('allreduce_rmsnorm')}",
        "",
        "| tokens | inductor (us) | allreduce_rmsnorm (us) | speed-up | max abs diff |",
        "|---|---|---|---|---|",
    ]
    for t in tokens:
        a, b = rank0["us"][("inductor", t)], rank0["us"][("allreduce_rmsnorm", t)]
        lines.append(f"| {t} | {_us(a)} | {_us(b)} | {abs(a) / abs(b):.3f}x | {rank0['diff'][t]:.2e} |")
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
        "--experts",
        default="grouped_mm",
        help="transformers experts_implementation: grouped_mm (default), batched_mm, eager",
    )
    args = ap.parse_args(argv)
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
