"""End to end: one step of an 8-layer Llama-8B-shaped stack under tensor parallelism,
``torch.compile`` as is vs passkit-fusion's passes enabled by name, every variant in one run.

Variants (``--variants``, default all):
- ``inductor``: ``torch.compile`` as is;
- ``allreduce_rmsnorm``: passkit with ``allreduce_rmsnorm`` (its token range: the tuned table's);
- ``allreduce_rmsnorm_one_compile``: the same with ``restrict_tokens=False`` (one compile);
- ``sp_async_tp``: passkit with ``sequence_parallel`` + ``async_tp`` (their token ranges);
- ``all_three``: passkit with ``sequence_parallel``, ``async_tp`` and ``allreduce_rmsnorm``,
  range-specialized together: where the sequence-parallel passes apply they take the sites;
- ``torch_async_tp``: PyTorch's own async TP: the same stack written sequence-parallel by hand
  (reduce-scatter / all-gather around the norms) compiled by Inductor with
  ``_micro_pipeline_tp`` and symmetric memory enabled (token counts divisible by TP only).

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
VARIANTS = (
    "inductor",
    "allreduce_rmsnorm",
    "allreduce_rmsnorm_one_compile",
    "sp_async_tp",
    "all_three",
    "torch_async_tp",
)


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


class FP8Linear(nn.Module):
    """A linear layer of an FP8 checkpoint: weight in float8_e4m3fn with a per-tensor scale,
    the input quantized with a static per-tensor scale (plain torch), ``torch._scaled_mm``."""

    def __init__(self, linear: nn.Linear, in_scale: float = 2.0**-4):
        super().__init__()
        w = linear.weight.detach().float()
        w_scale = w.abs().max().clamp_min(1e-12) / 448.0
        self.register_buffer("weight", (w / w_scale).to(torch.float8_e4m3fn))
        self.register_buffer("w_scale", w_scale.reshape(()))
        self.register_buffer("in_scale", torch.tensor(in_scale, device=w.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = (x / self.in_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return torch._scaled_mm(
            q, self.weight.t(), scale_a=self.in_scale, scale_b=self.w_scale, out_dtype=torch.bfloat16
        )


def to_fp8(model: nn.Module) -> nn.Module:
    """Every layer's linears as FP8 linears (static input scales), in place."""
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(layer, name, FP8Linear(getattr(layer, name)))
    return model


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

    def forward_sp(self, x: torch.Tensor, residual: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The same layer written sequence-parallel: ``x`` (normed) and ``residual`` hold this
        rank's tokens; all-gather before the column-parallel matmuls, reduce-scatter after
        the row-parallel ones (what PyTorch's async TP fuses)."""
        import torch.distributed._functional_collectives as funcol

        def gather(t: torch.Tensor) -> torch.Tensor:
            return funcol.all_gather_tensor(t, 0, self.group)

        def scatter(t: torch.Tensor) -> torch.Tensor:
            return funcol.reduce_scatter_tensor(t, "sum", 0, self.group)

        x = gather(x)
        t = x.shape[0]
        q, k, v = self.qkv(x).split([self.h * self.hd, self.kvh * self.hd, self.kvh * self.hd], dim=-1)
        q = q.view(1, t, self.h, self.hd).transpose(1, 2)
        k = torch.cat([self.k_cache, k.view(1, t, self.kvh, self.hd).transpose(1, 2)], dim=2)
        v = torch.cat([self.v_cache, v.view(1, t, self.kvh, self.hd).transpose(1, 2)], dim=2)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        residual = residual + scatter(self.o(att.transpose(1, 2).reshape(t, -1)))
        gate, up = self.gate_up(gather(self.post_norm(residual))).chunk(2, dim=-1)
        return residual + scatter(self.down(F.silu(gate) * up))


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

    def sequence_parallel(self, rank: int) -> nn.Module:
        """This stack (same weights) written sequence-parallel by hand, for ``rank``."""
        return _SequenceParallelStack(self, rank)


class _SequenceParallelStack(nn.Module):
    def __init__(self, stack: Stack, rank: int):
        super().__init__()
        self.stack, self.rank = stack, rank
        self.world = dist.get_world_size()

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        layers, group = self.stack.layers, self.stack.layers[0].group
        residual = hidden_states.chunk(self.world)[self.rank]
        x = layers[0].inp_norm(residual)
        for i, layer in enumerate(layers):
            residual = layer.forward_sp(x, residual, mask)
            nxt = layers[i + 1].inp_norm if i + 1 < len(layers) else self.stack.final_norm
            x = nxt(residual)
        return funcol.all_gather_tensor(x, 0, group)


def causal_mask(tokens: int, context: int, device: torch.device) -> torch.Tensor:
    rows = torch.arange(tokens, device=device).unsqueeze(1)
    cols = torch.arange(context + tokens, device=device).unsqueeze(0)
    return cols <= rows + context


def time_graph(fn, args, replays: int) -> float:
    """Median microseconds of one CUDA-graph replay of ``fn(*args)``."""
    return replay_median_us(lambda: fn(*args), replays=replays)


def _enable_symm_mem(group: str) -> None:
    """torch <= 2.12 needs symmetric memory enabled per group before Inductor's async TP."""
    import warnings

    import torch.distributed._symmetric_memory as symm_mem

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group)


def variant_passes(name: str, impl: str, args: argparse.Namespace) -> list | None:
    """The passkit pass list of a variant (None: no passkit)."""
    arrms = {"name": "allreduce_rmsnorm", "implementation": impl, "max_tokens": args.max_tokens}
    sp = {"name": "sequence_parallel", **({"min_tokens": args.sp_min_tokens} if args.sp_min_tokens else {})}
    atp = {"name": "async_tp", **({"min_tokens": args.atp_min_tokens} if args.atp_min_tokens else {})}
    return {
        "inductor": None,
        "torch_async_tp": None,
        "allreduce_rmsnorm": [arrms],
        "allreduce_rmsnorm_one_compile": [{**arrms, "restrict_tokens": False}],
        "sp_async_tp": [sp, atp],
        "all_three": [sp, atp, arrms],
    }[name]


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
    dims = (
        {"context": args.context}
        if cuda
        else {"hidden": 64, "heads": 4, "kv_heads": 2, "inter": 128, "context": 8}
    )
    model = Stack(args.layers, world, group, **dims).to(device, dtype).eval()
    if args.fp8:
        model = to_fp8(model)
    hidden = model.final_norm.weight.shape[0]
    impl = "auto" if cuda else "reference"

    # every variant is a torch.compile of the same forward: each keeps its own cache entries
    torch._dynamo.config.recompile_limit = 64
    compiled, compile_s, failed, backends = {}, {}, {}, {}
    for name in args.variants:
        torch._dynamo.reset()
        passes = variant_passes(name, impl, args)
        t0 = world * 8
        x = torch.randn(t0, hidden, device=device, dtype=dtype)
        torch._dynamo.mark_dynamic(x, 0)
        mask = causal_mask(t0, model.context, device)
        torch._dynamo.mark_dynamic(mask, 0)
        torch._dynamo.mark_dynamic(mask, 1)
        start = time.perf_counter()
        try:  # one variant failing must not cost the others' numbers
            if name == "torch_async_tp":
                if not cuda:
                    raise RuntimeError("needs CUDA")
                _enable_symm_mem(group)
                options = {"_micro_pipeline_tp": True}
                fn = torch.compile(model.sequence_parallel(rank), fullgraph=True, options=options)
            else:
                # every range compiled at the first call: its time is the compile column
                backend = (
                    "inductor" if passes is None else passkit.backend(passes=passes, compile_at="upfront")
                )
                fn = torch.compile(model, backend=backend, fullgraph=True)
                if passes is not None:
                    backends[name] = backend
            with torch.no_grad():
                fn(x, mask)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
            continue
        compile_s[name] = time.perf_counter() - start
        compiled[name] = fn
    ranges = {
        name: [
            {
                "range": r.token_range,
                "passes": {n: [r[n].status, r[n].matches] for n in r.names() if n in _PASSES},
            }
            for r in backend.reports
        ]
        for name, backend in backends.items()
        if name in compiled
    }
    if "inductor" not in compiled:  # the baseline failed: report why instead of dying
        args.tokens = []
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        mask = causal_mask(tokens, model.context, device)
        row: dict = {"tokens": tokens}
        with torch.no_grad():
            ref = compiled["inductor"](x, mask).float()
            for name, fn in compiled.items():
                if name == "torch_async_tp" and tokens % world:
                    continue
                out = fn(x, mask).float()
                row.setdefault("rel_diff_vs_inductor", {})[name] = ((out - ref).norm() / ref.norm()).item()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    row[f"{name}_us"] = time_graph(fn, (x, mask), args.replays)
                    row[f"{name}_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        rows.append(row)
    if rank == 0:
        out_q.put(
            {
                "variants": [v for v in args.variants if v in compiled],
                "failed": failed,
                "rows": rows,
                "compile_s": compile_s,
                "ranges": ranges,
                "passes": {
                    name: {n: rec.to_dict() for n, rec in _records(backend)}
                    for name, backend in backends.items()
                    if name in compiled
                },
                "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                "torch": torch.__version__,
                "paths": _runtime_paths() if cuda else {},
            }
        )
    dist.destroy_process_group()


_PASSES = ("sequence_parallel", "async_tp", "allreduce_rmsnorm")


def _records(backend) -> list:
    """Each pass's record from the backend's reports, the one with most matches per pass."""
    best: dict = {}
    for report in backend.reports:
        for n in report.names():
            if n in _PASSES and (n not in best or report[n].matches > best[n].matches):
                best[n] = report[n]
    return list(best.items())


def _runtime_paths() -> dict[str, int]:
    from passkit_fusion.allreduce_rmsnorm import runtime

    return dict(runtime.stats())


def render(res: dict, args: argparse.Namespace) -> str:
    variants = res["variants"]
    others = [v for v in variants if v != "inductor"]
    lines = [
        f"# passkit-fusion end to end ({res['device']} x{args.world}, torch {res['torch']}, {time.strftime('%Y-%m-%d')})",
        "",
        f"{args.layers}-layer Llama-8B-shaped stack, TP={args.world}, bf16{' with FP8 linears (static scales)' if args.fp8 else ''}, KV context {args.context}, "
        f"CUDA-graph timed medians of {args.replays} replays; speedup = Inductor / variant.",
        "",
        "| tokens | Inductor (us) | "
        + " | ".join(f"{v} (us) | speedup" for v in others)
        + " | max rel. diff |",
        "|---|---|" + "---|---|" * len(others) + "---|",
    ]
    for r in res["rows"]:
        diff = max(r.get("rel_diff_vs_inductor", {"": 0.0}).values())
        if "inductor_us" not in r:
            lines.append(f"| {r['tokens']} | - | " + " | ".join("- | -" for _ in others) + f" | {diff:.1e} |")
            continue
        cells = [
            f"{r[f'{v}_us']:.1f} | {r['inductor_us'] / r[f'{v}_us']:.2f}x" if f"{v}_us" in r else "n/a | -"
            for v in others
        ]
        lines.append(f"| {r['tokens']} | {r['inductor_us']:.1f} | " + " | ".join(cells) + f" | {diff:.1e} |")
    if res.get("failed"):
        lines += ["", "Not run: " + "; ".join(f"{k}: {v}" for k, v in res["failed"].items())]
    if res.get("paths"):
        lines += [
            "",
            f"Runtime paths taken by the fused all-reduce op (all variants, warm-up included): {res['paths']}",
        ]
    lines += ["", "Token-range specializations (pass: status, sites):"]
    for name, specs in res.get("ranges", {}).items():
        parts = [
            f"{x['range'] or 'all tokens'}: "
            + ", ".join(f"{n} {s} ({m} sites)" for n, (s, m) in x["passes"].items())
            for x in specs
        ]
        lines.append(f"- {name}: " + "; ".join(parts))
    compile_cells = ", ".join(f"{k} {v:.1f} s" for k, v in res["compile_s"].items())
    lines += ["", f"Compile (first call, dynamic tokens, every specialization): {compile_cells}."]
    for name, recs in res.get("passes", {}).items():
        for n, rec in recs.items():
            lines.append(
                f"- {name} / {n}: {rec.get('ms', 0):.1f} ms, {rec.get('matches', 0)} sites; {'; '.join(rec.get('notes', []))}"
            )
    peaks = {
        v: max((r[f"{v}_peak_mib"] for r in res["rows"] if f"{v}_peak_mib" in r), default=None)
        for v in variants
    }
    if any(p is not None for p in peaks.values()):
        lines += [
            "",
            "Peak memory above the model, largest token count (MiB): "
            + ", ".join(f"{v} {p:.0f}" for v, p in peaks.items() if p is not None),
        ]
    if "exit_s" in res:
        hung = [r for r, t in enumerate(res["exit_s"]) if t is None]
        lines += [
            "",
            f"Process exit after the last result, per rank (s): {res['exit_s']}"
            + (f"; ranks {hung} did not exit within 120 s (killed)" if hung else ""),
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    from worlds import exit_times, rank0_results, spawn  # benchmarks/ is on sys.path when run as a script

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
    ap.add_argument("--context", type=int, default=256, help="cached KV tokens (0: prefill)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--sp-min-tokens", type=int, default=None, help="sequence_parallel's min_tokens")
    ap.add_argument("--atp-min-tokens", type=int, default=None, help="async_tp's min_tokens")
    ap.add_argument("--fp8", action="store_true", help="FP8 linears (static scales, torch._scaled_mm; CUDA)")
    ap.add_argument("--cpu", action="store_true", help="tiny smoke run on CPU (gloo, reference op)")
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if args.fp8 and args.cpu:
        ap.error("--fp8 needs CUDA (torch._scaled_mm in bf16)")
    args.variants = ["inductor", *(v for v in args.variants.split(",") if v and v != "inductor")]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    q, procs = spawn(worker, args.world, args)
    res = rank0_results(q, procs)
    res["exit_s"] = exit_times(procs, time.monotonic())
    md = render(res, args)
    print(md)
    if not args.cpu:
        for folder in filter(None, [os.environ.get("OUT"), str(HERE / "results")]):
            Path(folder).mkdir(parents=True, exist_ok=True)
            stem = f"fusion_e2e{'_fp8' if args.fp8 else ''}_w{args.world}"
            (Path(folder) / f"{stem}.json").write_text(json.dumps(res, indent=2))
            (Path(folder) / f"{stem}.md").write_text(md)


if __name__ == "__main__":
    main()
