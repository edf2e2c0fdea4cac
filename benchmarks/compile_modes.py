"""torch.compile's modes through passkit vs Inductor: forward latency side by side, one run.

A Hugging Face Llama (8B-shaped: hidden 4096, 32 heads, 8 KV heads, MLP 14336; ``--layers``
layers, random weights, bf16) at world size 1, compiled four ways with a dynamic token
dimension: Inductor and passkit (the serving config ``sequence_parallel, async_tp,
allreduce_rmsnorm, cleanup``, whose fusion passes cannot run at world size 1), each with the
default mode and with ``mode="reduce-overhead"`` (Inductor's CUDA graphs). Each variant is
timed at every token count (median of ``--iters`` forwards after warm-up, CUDA events around
each call, no hand-made CUDA graphs); the output of passkit's reduce-overhead forward is
compared with Inductor's; the CUDA-graph records and replays are counted.

    python benchmarks/compile_modes.py --out benchmarks/results/compile_modes_h100
    python benchmarks/compile_modes.py --smoke       # CPU, a tiny Llama (plumbing only)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from results import write as write_result  # benchmarks/ is on sys.path when run as a script

import passkit

SERVING = ["sequence_parallel", "async_tp", "allreduce_rmsnorm", "cleanup"]
VARIANTS = {
    "inductor": ("inductor", None),
    "inductor reduce-overhead": ("inductor", "reduce-overhead"),
    "passkit": ("passkit", None),
    "passkit reduce-overhead": ("passkit", "reduce-overhead"),
}


class GraphCounter:
    """Counts Inductor's CUDA-graph recordings and replays (wraps two methods)."""

    def __init__(self) -> None:
        self.recorded = self.replayed = 0
        self._undo: list[Any] = []

    def __enter__(self) -> GraphCounter:
        from torch._inductor import cudagraph_trees as trees

        for cls, name, field in (
            (trees.CUDAGraphTreeManager, "record_function", "recorded"),
            (trees.CUDAGraphNode, "run_graph", "replayed"),
        ):
            original = getattr(cls, name)

            def counted(*args: Any, _original: Any = original, _field: str = field, **kwargs: Any) -> Any:
                setattr(self, _field, getattr(self, _field) + 1)
                return _original(*args, **kwargs)

            setattr(cls, name, counted)
            self._undo.append((cls, name, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for cls, name, original in self._undo:
            setattr(cls, name, original)


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, int, torch.device]:
    torch.manual_seed(0)
    if args.smoke:
        from passkit_fusion.model import LlamaConfig, TinyLlama

        cfg = LlamaConfig(layers=1)
        return TinyLlama(cfg).eval(), cfg.vocab, torch.device("cpu")
    model, vocab = hf_llama(args.layers, torch.device("cuda"), torch.bfloat16)
    return model, vocab, torch.device("cuda")


def hf_llama(layers: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, int]:
    """A Hugging Face Llama, 8B-shaped, ``layers`` layers, random weights, no KV cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=layers,
        vocab_size=32000,
        max_position_embeddings=8192,
    )
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    model.config.use_cache = False
    return model, cfg.vocab_size


def forward_fn(model: torch.nn.Module, smoke: bool):
    if smoke:
        return model
    return lambda ids: model(input_ids=ids, use_cache=False).logits


def time_calls(fn: Any, ids: torch.Tensor, iters: int, device: torch.device) -> float:
    """Median milliseconds of ``fn(ids)`` (a fresh output each call, as a server reads it)."""
    if device.type == "cuda":
        from passkit_fusion.tuning.timing import call_median_us

        return call_median_us(lambda: fn(ids), calls=iters, warmup=0) / 1e3
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(ids)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4, help="timing rounds, order alternating; medians")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, 3 iterations")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.smoke:
        args.iters, args.tokens, args.rounds = 3, [1, 8], 2
    model, vocab, device = build(args)
    fn = forward_fn(model, args.smoke)
    inputs = {
        t: torch.randint(0, vocab, (1, t), generator=torch.Generator().manual_seed(t)).to(device)
        for t in args.tokens
    }
    for t, ids in inputs.items():
        if t > 1:  # dynamic tokens, as a server compiles; Dynamo specializes a size of 1
            torch._dynamo.mark_dynamic(ids, 1)
    torch._dynamo.config.cache_size_limit = 64  # four variants of one forward live side by side
    torch._dynamo.config.accumulated_cache_size_limit = 512
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, dict[int, torch.Tensor]] = {}
    compiled: dict[str, Any] = {}
    for name, (backend_name, mode) in VARIANTS.items():  # compile and warm up each variant
        backend: Any = "inductor" if backend_name == "inductor" else passkit.backend(passes=SERVING)
        compiled[name] = torch.compile(fn, backend=backend, mode=mode)
        row: dict[str, Any] = {"samples": {t: [] for t in args.tokens}}
        with torch.no_grad(), GraphCounter() as graphs:
            t0 = time.perf_counter()
            for t in sorted(args.tokens, reverse=True):  # the dynamic graph first
                for _ in range(3):  # compile, CUDA-graph warm-up and record
                    compiled[name](inputs[t])
            row["compile_and_warmup_s"] = round(time.perf_counter() - t0, 2)
            outputs[name] = {t: compiled[name](inputs[t]).float().clone() for t in args.tokens}
        row["cudagraphs_recorded"] = graphs.recorded
        if backend_name == "passkit":
            row["reports"] = [
                (r.token_range, r.compile_s, [(x.name, x.status) for x in r.records]) for r in backend.reports
            ]
        results[name] = row
        print(f"{name}: compiled and warm in {row['compile_and_warmup_s']} s", file=sys.stderr, flush=True)
    if device.type == "cuda":  # clocks up before timing
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        for _ in range(50):
            a @ a
        torch.cuda.synchronize()
    with torch.no_grad(), GraphCounter() as graphs:
        for i in range(args.rounds * args.iters):  # interleaved: drift hits every variant alike
            order = list(VARIANTS) if i % 2 == 0 else list(reversed(VARIANTS))
            for t in args.tokens:
                for name in order:
                    results[name]["samples"][t].append(time_calls(compiled[name], inputs[t], 1, device))
    replays = graphs.replayed
    for name, row in results.items():
        row["ms"] = {t: statistics.median(v) for t, v in row["samples"].items()}
        row["cudagraphs_replayed"] = replays if "reduce-overhead" in name else 0
        del row["samples"]
    same = {
        t: torch.equal(outputs["passkit reduce-overhead"][t], outputs["inductor reduce-overhead"][t])
        for t in args.tokens
    }
    close = {
        t: float((outputs["passkit reduce-overhead"][t] - outputs["inductor reduce-overhead"][t]).abs().max())
        for t in args.tokens
    }
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    title = (
        f"modes: {'tiny Llama (smoke)' if args.smoke else f'HF Llama 8B-shaped, {args.layers} layers, bf16'}, "
        f"world size 1, {device_name}, torch {torch.__version__}, median of {args.rounds * args.iters} forwards "
        "per variant and size, the variants' calls interleaved"
    )
    head = (
        "| variant | "
        + " | ".join(f"{t} tok ms" for t in args.tokens)
        + " | vs Inductor same mode | CUDA graphs recorded (replays, both RO variants) |"
    )
    lines = [title, "", head, "|" + "---|" * (len(args.tokens) + 3)]
    for name, row in results.items():
        base = results["inductor reduce-overhead" if "reduce-overhead" in name else "inductor"]
        ratio = " / ".join(f"{base['ms'][t] / row['ms'][t]:.3f}x" for t in args.tokens)
        ms = " | ".join(f"{row['ms'][t]:.3f}" for t in args.tokens)
        lines.append(
            f"| {name} | {ms} | {ratio} | {row['cudagraphs_recorded']} / {row['cudagraphs_replayed']} |"
        )
    speedup = " / ".join(
        f"{results['inductor']['ms'][t] / results['passkit reduce-overhead']['ms'][t]:.2f}x"
        for t in args.tokens
    )
    lines += [
        "",
        f"passkit reduce-overhead vs Inductor default: {speedup}",
        f"passkit reduce-overhead output identical to Inductor reduce-overhead: {same} (max abs diff {close})",
    ]
    data = {"title": title, "results": results, "identical": same, "max_abs_diff": close}
    write_result(args.out, "\n".join(lines), data, indent=2, default=str)


if __name__ == "__main__":
    main()
