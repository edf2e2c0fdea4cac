"""End to end: one decode step of an 8-layer Llama-8B-shaped stack, TP=2, torch.compile as
is vs with passkit's ``allreduce_rmsnorm`` enabled by name, both in one run.

Shape (per DESIGN.md): hidden 4096, 32 query heads of 128 (8 KV heads), intermediate 14336,
bf16, sharded over the ranks Megatron-style (q/k/v and gate/up column-parallel, o and down
row-parallel, a functional all-reduce after each row-parallel layer). "Tokens" are the new
tokens of the step (batch 1), attending to a KV context of 256 cached tokens plus
themselves. One compile per variant with a dynamic token dimension; each token count is
captured into a CUDA graph and timed over many replays (median of per-replay CUDA events).

Run on a machine with 2 GPUs (spawns one process per GPU):
    python benchmarks/fusion_e2e.py [--tokens 1,16,64,256,1024,4096] [--layers 8]
On CPU (`--cpu`) it runs a tiny version in a gloo world with the reference op: a smoke test
of this script, not a benchmark.
Writes fusion_e2e.{json,md} to $OUT (when set) and benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from passkit_fusion.tuning.timing import replay_median_us
from torch import nn

HERE = Path(__file__).resolve().parent


class Norm(nn.Module):
    """RMSNorm as Llama's reference code writes it."""

    def __init__(self, hidden: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Layer(nn.Module):
    """One tensor-parallel shard of a Llama decoder layer with a KV cache of ``context``."""

    def __init__(
        self, hidden: int, heads: int, kv_heads: int, inter: int, world: int, context: int, group: str
    ):
        super().__init__()
        self.group, self.hd = group, hidden // heads
        self.h, self.kvh = heads // world, kv_heads // world
        self.inp_norm, self.post_norm = Norm(hidden), Norm(hidden)
        self.qkv = nn.Linear(hidden, (self.h + 2 * self.kvh) * self.hd, bias=False)
        self.o = nn.Linear(self.h * self.hd, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * inter // world, bias=False)
        self.down = nn.Linear(inter // world, hidden, bias=False)
        self.register_buffer("k_cache", torch.randn(1, self.kvh, context, self.hd) * 0.5)
        self.register_buffer("v_cache", torch.randn(1, self.kvh, context, self.hd) * 0.5)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(x, "sum", self.group)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x`` is the normed input; returns the new residual stream (after attention + MLP)."""
        t = x.shape[0]
        q, k, v = self.qkv(x).split([self.h * self.hd, self.kvh * self.hd, self.kvh * self.hd], dim=-1)
        q = q.view(1, t, self.h, self.hd).transpose(1, 2)
        k = torch.cat([self.k_cache, k.view(1, t, self.kvh, self.hd).transpose(1, 2)], dim=2)
        v = torch.cat([self.v_cache, v.view(1, t, self.kvh, self.hd).transpose(1, 2)], dim=2)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        residual = residual + self.reduce(self.o(att.transpose(1, 2).reshape(t, -1)))
        h = self.post_norm(residual)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return residual + self.reduce(self.down(F.silu(gate) * up))


class Stack(nn.Module):
    def __init__(
        self, layers: int, world: int, group: str, hidden=4096, heads=32, kv_heads=8, inter=14336, context=256
    ):
        super().__init__()
        self.layers = nn.ModuleList(
            Layer(hidden, heads, kv_heads, inter, world, context, group) for _ in range(layers)
        )
        self.final_norm = Norm(hidden)
        self.context = context

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        x = self.layers[0].inp_norm(hidden_states)
        for i, layer in enumerate(self.layers):
            residual = layer(x, residual, mask)
            nxt = self.layers[i + 1].inp_norm if i + 1 < len(self.layers) else self.final_norm
            x = nxt(residual)
        return x


def causal_mask(tokens: int, context: int, device: torch.device) -> torch.Tensor:
    rows = torch.arange(tokens, device=device).unsqueeze(1)
    cols = torch.arange(context + tokens, device=device).unsqueeze(0)
    return cols <= rows + context


def time_graph(fn, args, replays: int) -> float:
    """Median microseconds of one CUDA-graph replay of ``fn(*args)``."""
    return replay_median_us(lambda: fn(*args), replays=replays)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_q) -> None:
    import passkit

    cuda = not args.cpu
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    group = dist.group.WORLD.group_name
    torch.manual_seed(0)
    dims = {} if cuda else {"hidden": 64, "heads": 4, "kv_heads": 2, "inter": 128, "context": 8}
    model = Stack(args.layers, world, group, **dims).to(device, dtype).eval()
    hidden = model.final_norm.weight.shape[0]
    impl = "auto" if cuda else "reference"

    def fusion(restrict_tokens: bool) -> passkit.Backend:
        options = {"implementation": impl, "max_tokens": args.max_tokens, "restrict_tokens": restrict_tokens}
        return passkit.backend(passes=[{"name": "allreduce_rmsnorm", **options}])

    variants = {
        "inductor": "inductor",
        # one compile for every size: above its workspace the op runs the unfused path
        "passkit": fusion(restrict_tokens=False),
        # token ranges: up to the tuned bound the pass fuses, larger sizes compile without it
        "passkit_ranges": fusion(restrict_tokens=True),
    }
    compiled, compile_s = {}, {}
    for name, backend in variants.items():
        torch._dynamo.reset()
        x = torch.randn(16, hidden, device=device, dtype=dtype)
        torch._dynamo.mark_dynamic(x, 0)
        mask = causal_mask(16, model.context, device)
        torch._dynamo.mark_dynamic(mask, 0)
        torch._dynamo.mark_dynamic(mask, 1)
        fn = torch.compile(model, backend=backend, fullgraph=True)
        start = time.perf_counter()
        with torch.no_grad():
            fn(x, mask)
        compile_s[name] = time.perf_counter() - start
        compiled[name] = fn
    report = variants["passkit"].last_report
    ranges = [
        {
            "range": r.token_range,
            "matches": r["allreduce_rmsnorm"].matches,
            "status": r["allreduce_rmsnorm"].status,
        }
        for r in variants["passkit_ranges"].reports
        if "allreduce_rmsnorm" in r
    ]
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        mask = causal_mask(tokens, model.context, device)
        with torch.no_grad():
            ref = compiled["inductor"](x, mask).float()
            err = max(
                ((compiled[name](x, mask).float() - ref).norm() / ref.norm()).item()
                for name in ("passkit", "passkit_ranges")
            )
            row = {"tokens": tokens, "rel_diff_vs_inductor": err}
            if cuda:
                for name, fn in compiled.items():
                    row[f"{name}_us"] = time_graph(fn, (x, mask), args.replays)
                row["speedup"] = row["inductor_us"] / row["passkit_us"]
                row["speedup_ranges"] = row["inductor_us"] / row["passkit_ranges_us"]
        rows.append(row)
    if rank == 0:
        rec = report["allreduce_rmsnorm"] if report and "allreduce_rmsnorm" in report else None
        out_q.put(
            {
                "rows": rows,
                "compile_s": compile_s,
                "pass": rec.to_dict() if rec else None,
                "ranges": ranges,
                "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                "torch": torch.__version__,
                "paths": _runtime_paths() if cuda else {},
            }
        )
    dist.destroy_process_group()


def _runtime_paths() -> dict[str, int]:
    from passkit_fusion.allreduce_rmsnorm import runtime

    return dict(runtime.stats())


def render(res: dict, args: argparse.Namespace) -> str:
    lines = [
        f"# passkit allreduce_rmsnorm, end to end ({res['device']} x{args.world}, torch {res['torch']}, {time.strftime('%Y-%m-%d')})",
        "",
        f"{args.layers}-layer Llama-8B-shaped stack, TP={args.world}, bf16, KV context 256, CUDA-graph timed medians of {args.replays} replays.",
        "",
        "passkit: one compile for every size (`restrict_tokens=False`); passkit ranges: the pass's "
        "token range from the tuned table, larger sizes compiled without it (the default).",
        "",
        "| tokens | Inductor (us) | passkit (us) | speedup | passkit ranges (us) | speedup | rel. diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        if "inductor_us" in r:
            lines.append(
                f"| {r['tokens']} | {r['inductor_us']:.1f} | {r['passkit_us']:.1f} | {r['speedup']:.2f}x "
                f"| {r['passkit_ranges_us']:.1f} | {r['speedup_ranges']:.2f}x | {r['rel_diff_vs_inductor']:.1e} |"
            )
        else:
            lines.append(f"| {r['tokens']} | - | - | - | - | - | {r['rel_diff_vs_inductor']:.1e} |")
    p = res["pass"] or {}
    if "paths" in res:
        lines += [
            "",
            f"Runtime paths taken by the fused op (all token counts, warm-up included): {res['paths']}",
        ]
    lines += [
        "",
        "Specializations of passkit ranges: "
        + "; ".join(
            f"{x['range']}: allreduce_rmsnorm {x['status']} ({x['matches']} sites)"
            for x in res.get("ranges", [])
        ),
        "",
        f"Compile (first call, dynamic tokens): Inductor {res['compile_s']['inductor']:.1f} s, with passkit {res['compile_s']['passkit']:.1f} s, "
        f"passkit ranges {res['compile_s']['passkit_ranges']:.1f} s (all specializations at the first call); "
        f"the pass itself: {p.get('ms', 0):.1f} ms, {p.get('matches', 0)} sites fused ({p.get('status')}; {'; '.join(p.get('notes', []))}).",
    ]
    if "exit_s" in res:
        hung = [r for r, t in enumerate(res["exit_s"]) if t is None]
        lines += [
            "",
            f"Process exit after the last result, per rank (s): {res['exit_s']}"
            + (f"; ranks {hung} did not exit within 120 s (killed)" if hung else ""),
        ]
    return "\n".join(lines) + "\n"


def _exit_times(procs: list, results_at: float, limit: float = 120.0) -> list[float | None]:
    """Seconds from rank 0 handing over its results (its last line) to each rank's exit;
    None for a rank still alive after ``limit`` seconds (then killed)."""
    exits: list[float | None] = []
    for p in procs:
        p.join(timeout=max(0.0, results_at + limit - time.monotonic()))
        exits.append(round(time.monotonic() - results_at, 2) if not p.is_alive() else None)
    for p in procs:
        if p.is_alive():
            p.kill()
    return exits


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,16,64,256,1024,2048,4096,8192,16384")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="fused-kernel workspace size (default: from the tuned table)",
    )
    ap.add_argument("--cpu", action="store_true", help="tiny smoke run on CPU (gloo, reference op)")
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.world, port, args, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    res = q.get(timeout=1500)
    res["exit_s"] = _exit_times(procs, time.monotonic())
    md = render(res, args)
    print(md)
    if not args.cpu:
        for folder in filter(None, [os.environ.get("OUT"), str(HERE / "results")]):
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / f"fusion_e2e_w{args.world}.json").write_text(json.dumps(res, indent=2))
            (Path(folder) / f"fusion_e2e_w{args.world}.md").write_text(md)


if __name__ == "__main__":
    main()
