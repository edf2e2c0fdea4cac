"""Measured fuse decisions end to end: tune two stacks, then Inductor vs the tabled passes
vs the tuned passes side by side in one run.

For each stack (``--stacks``, default the 8-layer Llama-8B-shaped decode stack of
``fusion_e2e.py`` and a 4-layer 70B-shaped prefill stack, hidden 8192, no KV context):

1. ``passkit_fusion.tuning.measure.tune_model`` times the candidate pass sets (Inductor,
   each of sequence_parallel / async_tp / allreduce_rmsnorm alone, sequence_parallel+async_tp,
   all three) at every token count (CUDA-graph replay medians, the slowest rank's), within
   ``--budget`` seconds, and stores the decision;
2. the stack is compiled three ways: ``inductor`` (torch.compile as is), ``tabled`` (the three
   passes with their shipped tables and default bounds, stored decisions ignored) and
   ``tuned`` (the same pass list: the stored decision sets the passes' token ranges);
3. each token count is timed (CUDA-graph replay medians) for the three, next to the best
   pass set the tuning measured there.

With ``--compile-mode reduce-overhead`` the tuning and the three variants compile in that mode
(Inductor's CUDA graphs) and each step is timed per call (CUDA events, a barrier before each).

Targets: tuned >= 0.99x Inductor at every count, and within 1% of the best pass
set. The model and timing helpers are ``fusion_e2e.py``'s.

Run on 2 GPUs (spawns one process per GPU), or under torchrun:
    python benchmarks/tuned_e2e.py [--tokens 1,2,4,...,8192] [--budget 300]
    torchrun --nproc-per-node 2 benchmarks/tuned_e2e.py
On CPU (``--cpu``) a tiny version runs in a 2-rank gloo world (reference op, test-mode async
TP, wall-clock timing): a smoke test of this script, not a benchmark.
Writes tuned_e2e_w<N>[_<stacks>].{json,md} to $OUT (when set) and benchmarks/results/.
One stack takes about the tuning budget plus a few minutes (compiles, timing): run the stacks
one per command (``--stacks llama8b``, then ``--stacks prefill70b``) where a command is
limited to 10 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from fusion_e2e import Stack, causal_mask, time_graph
from passkit_fusion.tuning.timing import call_median_us
from worlds import exit_times, rank0_results, spawn  # benchmarks/ is on sys.path when run as a script

HERE = Path(__file__).resolve().parent
STACKS = {
    # name: (layers, Stack keyword arguments)
    "llama8b": (8, {"hidden": 4096, "heads": 32, "kv_heads": 8, "inter": 14336, "context": 256}),
    "prefill70b": (4, {"hidden": 8192, "heads": 64, "kv_heads": 8, "inter": 28672, "context": 0}),
}
CPU_STACKS = {
    "llama8b": (1, {"hidden": 64, "heads": 4, "kv_heads": 2, "inter": 128, "context": 8}),
    "prefill70b": (1, {"hidden": 32, "heads": 2, "kv_heads": 2, "inter": 64, "context": 0}),
}
VARIANTS = ("inductor", "tabled", "tuned")


def pass_list(cuda: bool) -> list[dict]:
    """The pass list both passkit variants compile with (the tuning tunes it)."""
    return [
        {"name": "sequence_parallel"},
        {"name": "async_tp", "implementation": "auto" if cuda else "test_mode"},
        {"name": "allreduce_rmsnorm", "implementation": "auto" if cuda else "reference"},
    ]


def wall_us(fn, args, repeats: int = 5) -> float:
    """CPU smoke runs: median wall-clock microseconds of ``fn(*args)``."""
    fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def run_stack(name: str, rank: int, world: int, args: argparse.Namespace, cuda: bool) -> dict:
    from passkit_fusion.tuning import decisions, measure

    import passkit
    from passkit import compiling

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    group = dist.group.WORLD.group_name
    layers, dims = (STACKS if cuda else CPU_STACKS)[name]
    torch.manual_seed(0)
    model = Stack(layers, world, group, **dims).to(device, dtype).eval()
    hidden = dims["hidden"]

    def inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator(device=device).manual_seed(tokens)
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
        return x, causal_mask(tokens, model.context, device)

    def mark(example) -> None:
        x, mask = example
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(mask, 0)
        torch._dynamo.mark_dynamic(mask, 1)

    passes = pass_list(cuda)
    timer = None if cuda else measure.wall_clock_timer(repeats=3)
    tuned = measure.tune_model(
        model,
        inputs,
        passes,
        token_counts=args.tokens,
        budget_s=args.budget,
        mark_dynamic=mark,
        timer=timer,
        mode=args.mode,
        compile_mode=args.compile_mode,
        progress=rank == 0,
    )

    def compile_variant(variant: str):
        torch._dynamo.reset()
        if variant == "inductor":
            backend = "inductor" if args.mode == "inductor" else "aot_eager"
        else:
            backend = compiling.scoped(passkit.backend(passes=passes, mode=args.mode))
        fn = torch.compile(model, backend=backend, mode=args.compile_mode)
        example = inputs(8 * world)
        mark(example)
        start = time.perf_counter()
        with torch.no_grad(), _ignoring(variant == "tabled", decisions):
            fn(*example)
        return fn, time.perf_counter() - start, getattr(backend, "backend", None)

    compiled, compile_s, reports = {}, {}, {}
    for variant in VARIANTS:
        fn, seconds, backend = compile_variant(variant)
        compiled[variant], compile_s[variant] = fn, seconds
        if backend is not None:
            reports[variant] = [
                {
                    "range": r.token_range,
                    "passes": {n: [r[n].status, r[n].matches] for n in r.names()},
                    "decision": next(
                        (note for rec in r.records for note in rec.notes if "fuse decision" in note), ""
                    ),
                }
                for r in backend.reports
            ]
    rows = []
    for tokens in args.tokens:
        example = inputs(tokens)
        row: dict = {"tokens": tokens, "decision": decisions.label(tuned.decision.passes_at(tokens))}
        best = tuned.best(tokens)
        base = tuned.medians_us.get(tokens, {}).get(())
        if best is not None and base:
            row["best_set"] = decisions.label(best[0])
            row["best_set_speedup"] = base / best[1]
        with torch.no_grad():
            ref = compiled["inductor"](*example).float()
            for variant, fn in compiled.items():
                with _ignoring(variant == "tabled", decisions):
                    out = fn(*example).float()
                    row.setdefault("rel_diff", {})[variant] = ((out - ref).norm() / ref.norm()).item()
                    row[f"{variant}_us"] = (
                        time_step(fn, example, args) if cuda else wall_us(fn, example)
                    )
        rows.append(row)
    return {
        "stack": name,
        "layers": layers,
        "dims": dims,
        "tuning_s": tuned.seconds,
        "tuning_compile_s": {decisions.label(c): s for c, s in tuned.compile_s.items()},
        "decision": tuned.decision.summary(),
        "decision_file": [str(p) for p in tuned.paths],
        "unmeasured": tuned.unmeasured,
        "tuning_table": tuned.format(),
        "rows": rows,
        "compile_s": compile_s,
        "reports": reports,
    }


def time_step(fn, args_: tuple, args: argparse.Namespace) -> float:
    """Median microseconds of one step on the GPU: a CUDA-graph replay of ``fn`` (captured
    here), or with ``--compile-mode reduce-overhead`` (``fn`` replays its own graphs) one
    call, the ranks lined up by a barrier before each."""
    if args.compile_mode == "reduce-overhead":
        return call_median_us(lambda: fn(*args_), calls=args.replays, before_call=dist.barrier)
    return time_graph(fn, args_, args.replays)


class _ignoring:
    """``decisions.ignored()`` when ``on``, else nothing (the tabled variant's compiles)."""

    def __init__(self, on: bool, decisions) -> None:
        self.cm = decisions.ignored() if on else None

    def __enter__(self) -> None:
        if self.cm is not None:
            self.cm.__enter__()

    def __exit__(self, *exc) -> None:
        if self.cm is not None:
            self.cm.__exit__(*exc)


def worker(rank: int, world: int, port: int | None, args: argparse.Namespace, out_q) -> dict | None:
    cuda = not args.cpu
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    torch._dynamo.config.recompile_limit = 64
    results = {
        "stacks": [run_stack(name, rank, world, args, cuda) for name in args.stacks],
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "world": world,
    }
    dist.destroy_process_group()
    if rank == 0 and out_q is not None:
        out_q.put(results)
    return results if rank == 0 else None


def render(res: dict, args: argparse.Namespace) -> str:
    lines = [
        f"# Measured fuse decisions end to end ({res['device']} x{res['world']}, torch {res['torch']}, "
        f"{time.strftime('%Y-%m-%d')})",
        "",
        "Speedups are Inductor / variant ("
        + (
            f"torch.compile mode={args.compile_mode}: medians of {args.replays} calls, each after a barrier"
            if args.compile_mode
            else f"CUDA-graph replay medians of {args.replays} replays"
        )
        + "; on the CPU wall-clock medians, a smoke run). `best set`: the fastest "
        "pass set the tuning measured at that count (its medians, same run).",
    ]
    for stack in res["stacks"]:
        lines += [
            "",
            f"## {stack['stack']}: {stack['layers']} layers, {stack['dims']}",
            "",
            f"Tuning: {stack['tuning_s']:.1f} s (compiles: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in stack["tuning_compile_s"].items())
            + f"); decision: {stack['decision']}",
        ]
        if stack["unmeasured"]:
            lines.append("Not measured (budget): " + "; ".join(stack["unmeasured"]))
        lines += [
            "",
            "| tokens | Inductor (us) | tabled (us) | tabled | tuned (us) | tuned | tuned runs | best set (tuning) | "
            "tuned / best | max rel. diff |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in stack["rows"]:
            ind = r["inductor_us"]
            best = f"{r['best_set']} {r['best_set_speedup']:.2f}x" if "best_set" in r else "-"
            vs_best = f"{(ind / r['tuned_us']) / r['best_set_speedup']:.3f}" if "best_set" in r else "-"
            lines.append(
                f"| {r['tokens']} | {ind:.1f} | {r['tabled_us']:.1f} | {ind / r['tabled_us']:.3f}x | "
                f"{r['tuned_us']:.1f} | {ind / r['tuned_us']:.3f}x | {r['decision']} | {best} | {vs_best} | "
                f"{max(r['rel_diff'].values()):.1e} |"
            )
        lines += ["", "Compile (first call, every specialization): " + ", ".join(
            f"{k} {v:.1f} s" for k, v in stack["compile_s"].items()
        ) + "."]  # fmt: skip
        for variant, specs in stack["reports"].items():
            for s in specs:
                ran = [n for n, (status, _) in s["passes"].items() if status == "ran"]
                lines.append(f"- {variant}, {s['range'] or 'all tokens'}: {', '.join(ran) or 'no pass'}")
        lines += ["", "Tuning medians (us, slowest rank):", "", stack["tuning_table"]]
    return "\n".join(lines) + "\n"


def main() -> None:

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=",".join(str(2**i) for i in range(14)))
    ap.add_argument("--stacks", default=",".join(STACKS))
    ap.add_argument("--world", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    ap.add_argument("--budget", type=float, default=300.0, help="tuning seconds per stack")
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--mode", choices=["inductor", "eager"], default="inductor")
    ap.add_argument(
        "--compile-mode",
        choices=["reduce-overhead"],
        default=None,
        help="torch.compile's mode for the tuning and the three variants (timed per call, as they replay their own CUDA graphs)",
    )
    ap.add_argument("--cpu", action="store_true", help="tiny smoke run on CPU (gloo, reference op)")
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.stacks = [s for s in args.stacks.split(",") if s]
    unknown = set(args.stacks) - set(STACKS)
    if unknown:
        ap.error(f"unknown stacks {sorted(unknown)}; known: {', '.join(STACKS)}")
    if "RANK" in os.environ:  # torchrun: this process is one rank
        res = worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args, None)
        if res is None:
            return
    else:
        q, procs = spawn(worker, args.world, args)
        res = rank0_results(q, procs, limit=3600.0)
        res["exit_s"] = exit_times(procs, time.monotonic())
    md = render(res, args)
    print(md)
    if not args.cpu:
        for folder in filter(None, [os.environ.get("OUT"), str(HERE / "results")]):
            Path(folder).mkdir(parents=True, exist_ok=True)
            stacks = "" if args.stacks == list(STACKS) else "_" + "_".join(args.stacks)
            stem = f"tuned_e2e_w{res['world']}{stacks}" + ("_ro" if args.compile_mode else "")
            (Path(folder) / f"{stem}.json").write_text(json.dumps(res, indent=2))
            (Path(folder) / f"{stem}.md").write_text(md)


if __name__ == "__main__":
    main()
