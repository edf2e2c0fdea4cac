"""The two-GPU gate's model: a Hugging Face Llama sharded TP=2 with DTensor, through passkit.

``LlamaForCausalLM`` with 8B-shaped layers (hidden 4096, 32 heads, 8 KV heads, MLP 14336;
``--layers`` layers, random weights, bf16), sharded with a DTensor plan (attention and MLP
projections ``ColwiseParallel`` in, ``RowwiseParallel`` out, as a user writes it), tokens
marked dynamic with ``torch._dynamo.mark_dynamic``. Compiled four ways: Inductor and passkit
with the serving config (``sequence_parallel, async_tp, allreduce_rmsnorm, cleanup``), each
with the default mode and with ``mode="reduce-overhead"``. Prints, side by side in one run:

* the sites each pass fused in each compile (its token range, status, matches), so a pass
  that fuses nothing shows;
* forward latency per token count (medians over interleaved rounds, CUDA events, the ranks
  aligned by a barrier before each forward) and the ratio to Inductor in the same mode, with
  the issue's targets checked;
* the output's difference to Inductor's.

    torchrun-free: python benchmarks/hf_tp.py --world 2 --out benchmarks/results/hf_tp_h100x2
    python benchmarks/hf_tp.py --smoke     # CPU, gloo, a tiny Llama (plumbing only)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from compile_modes import time_calls  # benchmarks/ is on sys.path when run as a script

SERVING = ["sequence_parallel", "async_tp", "allreduce_rmsnorm", "cleanup"]
VARIANTS = {
    "inductor": ("inductor", None),
    "passkit": ("serving", None),
    "inductor reduce-overhead": ("inductor", "reduce-overhead"),
    "passkit reduce-overhead": ("serving", "reduce-overhead"),
    "passkit allreduce_rmsnorm": ("allreduce_rmsnorm", None),
    "passkit allreduce_rmsnorm reduce-overhead": ("allreduce_rmsnorm", "reduce-overhead"),
    "passkit sp4096 reduce-overhead": ("sp4096", "reduce-overhead"),
    "passkit sp2048": ("sp2048", None),
    "passkit sp2048 reduce-overhead": ("sp2048", "reduce-overhead"),
    "passkit pdl reduce-overhead": ("pdl", "reduce-overhead"),
    "ceiling reduce-overhead": ("ceiling", "reduce-overhead"),
    "ceiling": ("ceiling", None),
}
"""name -> (pass set, mode). ``serving``: the README's serving config; ``allreduce_rmsnorm``:
that pass alone; ``sp4096`` / ``sp2048``: the serving config with sequence parallelism and
async TP from 4096 / 2048 tokens; ``pdl``: the serving config, the fused kernel launched with
programmatic dependent launch (``launch_with_pdl``, set while the variant compiles and records
its CUDA graphs); ``ceiling``: every all-reduce removed (wrong output; the time a forward
would take if the all-reduces cost nothing: no fusion of them can beat it). The first four
are the gate's; ``--variants`` adds others."""
GATE = list(VARIANTS)[:4]
EXTRA = {
    "arn": "passkit allreduce_rmsnorm",
    "arn-ro": "passkit allreduce_rmsnorm reduce-overhead",
    "sp4096-ro": "passkit sp4096 reduce-overhead",
    "sp2048": "passkit sp2048",
    "sp2048-ro": "passkit sp2048 reduce-overhead",
    "pdl-ro": "passkit pdl reduce-overhead",
    "ceiling-ro": "ceiling reduce-overhead",
    "ceiling": "ceiling",
}
"""``--variants`` names for the variants beyond the gate's."""


def pass_set(kind: str, impl: str) -> list:
    arn = {"name": "allreduce_rmsnorm", "implementation": impl}
    if kind == "allreduce_rmsnorm":
        return [arn, "cleanup"]
    if kind in ("sp4096", "sp2048"):
        first = int(kind[2:])
        return [
            {"name": "sequence_parallel", "min_tokens": first},
            {"name": "async_tp", "min_tokens": first},
            arn,
            "cleanup",
        ]
    if kind == "ceiling":
        return [CEILING, "cleanup"]
    return [p if p != "allreduce_rmsnorm" else arn for p in SERVING]


CEILING = "benchmark_drop_all_reduce"


def register_ceiling_pass() -> None:
    """``benchmark_drop_all_reduce``: every functional all-reduce replaced by its input."""
    import passkit

    c10d = torch.ops._c10d_functional

    class DropAllReduce(passkit.GraphPass):
        name = CEILING

        def run(self, gm, ctx):  # type: ignore[no-untyped-def]
            dropped = 0
            for wait in gm.graph.find_nodes(op="call_function", target=c10d.wait_tensor.default):
                reduce = wait.args[0]
                if getattr(reduce, "target", None) is c10d.all_reduce.default:
                    wait.replace_all_uses_with(reduce.args[0])
                    gm.graph.erase_node(wait)
                    gm.graph.erase_node(reduce)
                    dropped += 1
            return passkit.PassResult(modified=dropped > 0, matches=dropped)

    class Plugin:
        @passkit.hookimpl
        def passkit_register_passes(self):  # type: ignore[no-untyped-def]
            return [DropAllReduce]

    passkit.register(Plugin(), name="hf_tp_ceiling")


PASSES = ("sequence_parallel", "async_tp", "allreduce_rmsnorm", CEILING)


def fused_runtime() -> Any:
    from passkit_fusion.allreduce_rmsnorm import runtime

    return runtime


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[Any, int]:
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.smoke:
        cfg = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=args.layers,
            vocab_size=256,
        )
    else:
        cfg = LlamaConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_hidden_layers=args.layers,
            vocab_size=32000,
            max_position_embeddings=8192,
        )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    model.config.use_cache = False
    return model, cfg.vocab_size


def shard(model: Any, world: int, device: torch.device) -> None:
    """The DTensor TP plan a user writes for a Llama: column-parallel in, row-parallel out."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device.type, (world,))
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    import passkit

    cuda = not args.smoke
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo", rank=rank, world_size=world, device_id=device if cuda else None
    )
    model, vocab = build_model(args, device, torch.bfloat16 if cuda else torch.float32)
    shard(model, world, device)
    impl = "auto" if cuda else "reference"
    register_ceiling_pass()
    variants = {n: VARIANTS[n] for n in dict.fromkeys([*GATE, *(EXTRA[v] for v in args.variants)])}

    def forward(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits

    inputs = {}
    for t in args.tokens:
        ids = torch.randint(0, vocab, (1, t), generator=torch.Generator().manual_seed(t)).to(device)
        if t > 1:  # Dynamo specializes a size of 1 (its own recompile, for every backend)
            torch._dynamo.mark_dynamic(ids, 1)
        inputs[t] = ids
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 512
    compiled: dict[str, Any] = {}
    backends: dict[str, Any] = {}
    compile_s: dict[str, float] = {}
    outputs: dict[str, dict[int, torch.Tensor]] = {}
    for name, (kind, mode) in variants.items():
        passes = (
            pass_set(kind, impl)
            if cuda or kind == "ceiling"
            else [{"name": "allreduce_rmsnorm", "implementation": impl}, "cleanup"]
        )
        backend: Any = "inductor" if kind == "inductor" else passkit.backend(passes=passes)
        fn = torch.compile(forward, backend=backend, mode=mode)
        t0 = time.perf_counter()
        if kind == "pdl":
            fused_runtime().configure(launch_with_pdl=True)
        with torch.no_grad():
            for t in sorted(args.tokens, reverse=True):  # the dynamic graph first
                for _ in range(3):  # compile, CUDA-graph warm-up and record
                    fn(inputs[t])
            outputs[name] = {t: fn(inputs[t]).float() for t in args.tokens}
        if kind == "pdl":  # the CUDA graphs keep the launches recorded with it
            fused_runtime().configure(launch_with_pdl=False)
        compile_s[name] = time.perf_counter() - t0
        compiled[name] = fn
        if kind != "inductor":
            backends[name] = backend
        if rank == 0:
            print(f"{name}: compiled and warm in {compile_s[name]:.1f} s", file=sys.stderr, flush=True)
    if cuda:  # clocks up before timing
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        for _ in range(50):
            a @ a
        torch.cuda.synchronize()
    samples: dict[str, dict[int, list[float]]] = {n: {t: [] for t in args.tokens} for n in variants}
    with torch.no_grad():
        for i in range(args.rounds):
            order = list(variants) if i % 2 == 0 else list(reversed(variants))
            for t in args.tokens:
                for name in order:
                    for _ in range(args.iters):
                        # the ranks start each forward together, as a server's broadcast of the
                        # batch makes them; free-running, a rank's timing would include its wait
                        # for a late peer at the first collective (absent without collectives)
                        dist.barrier()
                        samples[name][t].append(time_calls(compiled[name], inputs[t], 1, device))
    ms = {n: {t: statistics.median(v) for t, v in per.items()} for n, per in samples.items()}
    diff = {
        n: {
            t: float((outputs[n][t] - outputs[base][t]).abs().max() / outputs[base][t].abs().max())
            for t in args.tokens
        }
        for n in variants
        for base in ["inductor reduce-overhead" if "reduce-overhead" in n else "inductor"]
    }
    reports = {
        name: [
            {
                "range": r.token_range or ("cache hit" if r.cache_hit else "all sizes"),
                "passes": {p: [r[p].status, r[p].matches] for p in r.names() if p in PASSES},
                "notes": {p: r[p].reason or "; ".join(r[p].notes)[:300] for p in r.names() if p in PASSES},
            }
            for r in backend.reports
        ]
        for name, backend in backends.items()
    }
    if rank == 0:
        queue.put(
            {
                "device": torch.cuda.get_device_name(0) if cuda else "cpu (gloo)",
                "torch": torch.__version__,
                "world": world,
                "layers": args.layers,
                "ms": ms,
                "rel_diff_vs_inductor": diff,
                "compile_and_warmup_s": compile_s,
                "reports": reports,
            }
        )
    dist.barrier()
    # leave at once: flashinfer's IPC workspaces and symmetric memory make an orderly
    # teardown of two processes slow (benchmarks/teardown.py measures it); nothing is left to do
    sys.stdout.flush()
    os._exit(0)


def render(res: dict[str, Any], args: argparse.Namespace) -> str:
    tokens = args.tokens
    lines = [
        f"HF Llama {'tiny (smoke)' if args.smoke else '8B-shaped'}, {res['layers']} layers, DTensor TP={res['world']}, "
        f"tokens dynamic; {res['device']}, torch {res['torch']}; medians of {args.rounds * args.iters} "
        "forwards per variant and size, variants interleaved",
        "",
        "sites per compile (passkit serving config; range: status/matches per pass):",
    ]
    for name, reps in res["reports"].items():
        for r in reps:
            cells = ", ".join(f"{p} {s}/{m}" for p, (s, m) in r["passes"].items())
            lines.append(f"  {name:<24} {r['range']:<32} {cells}")
            for p, note in r["notes"].items():
                if note and r["passes"][p][0] != "skipped":
                    lines.append(f"  {'':<24} {'':<32}   {p}: {note}")
    ms = {n: {int(t): v for t, v in per.items()} for n, per in res["ms"].items()}
    lines += [
        "",
        "latency, ms (median), and the ratio to Inductor in the same mode (> 1: passkit faster):",
        "",
    ]
    lines += [
        "| variant | " + " | ".join(f"{t} tok" for t in tokens) + " |",
        "|" + "---|" * (len(tokens) + 1),
    ]
    for n in ms:
        base = "inductor reduce-overhead" if "reduce-overhead" in n else "inductor"
        cells = [
            f"{ms[n][t]:.3f}" + ("" if n == base else f" ({ms[base][t] / ms[n][t]:.3f}x)") for t in tokens
        ]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    checks: list[str] = []
    for t in tokens:
        plain = ms["inductor"][t] / ms["passkit"][t]
        ro = ms["inductor reduce-overhead"][t] / ms["passkit reduce-overhead"][t]
        if plain < 0.99:
            checks.append(f"passkit {plain:.3f}x Inductor at {t} tokens (target >= 0.99x)")
        target = 1.15 if t <= 256 else 0.99
        if ro < target:
            ceiling = ms.get("ceiling reduce-overhead", {}).get(t)
            bound = (
                ""
                if ceiling is None
                else f"; no all-reduce at all: {ms['inductor reduce-overhead'][t] / ceiling:.3f}x"
            )
            checks.append(
                f"passkit reduce-overhead {ro:.3f}x Inductor's at {t} tokens (target >= {target}x{bound})"
            )
    if any(n.startswith("ceiling") for n in ms):
        lines += [
            "",
            "ceiling: the same forward with every all-reduce removed (its output is wrong): the most any "
            "fusion of the all-reduces can gain",
        ]
    diffs = {n: max(v.values()) for n, v in res["rel_diff_vs_inductor"].items()}
    lines += [
        "",
        "max |out - Inductor's| / max |Inductor's| per variant: "
        + json.dumps({k: f"{v:.2e}" for k, v in diffs.items()}),
    ]
    lines.append(
        "compile + warm-up s: " + json.dumps({k: round(v, 1) for k, v in res["compile_and_warmup_s"].items()})
    )
    lines.append("targets: " + ("all met" if not checks else "NOT MET: " + "; ".join(checks)))
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048, 8192])
    parser.add_argument("--iters", type=int, default=20, help="forwards per variant, size and round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, variant order alternating")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny Llama, few forwards")
    parser.add_argument(
        "--variants", nargs="+", default=[], choices=list(EXTRA), help="beside the gate's four"
    )
    parser.add_argument("--out", type=Path, default=None, help="write OUT.md and OUT.json")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.iters, args.rounds, args.layers = [1, 8], 2, 2, 1
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args.world, port, args, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=3000)
    for p in procs:
        p.join(timeout=60)
    text = render(result, args)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    if any(p.exitcode for p in procs):
        sys.exit(1)


if __name__ == "__main__":
    main()
