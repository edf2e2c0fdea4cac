"""The warm start of three variants side by side: Inductor alone, passkit with no pass
(``passkit.backend(passes=[])``) and passkit with the TP serving config (``sequence_parallel,
async_tp, allreduce_rmsnorm, cleanup``) at world size 1, where none of the TP passes can apply.

A warm start is what a serving process pays at every restart: Inductor's FX-graph and
AOTAutograd caches (one folder, ``TORCHINDUCTOR_CACHE_DIR``) and passkit's report cache
(``PASSKIT_CACHE_DIR``) are shared by every variant and primed by one run of each, then
``--samples`` rounds run each variant once, in a fresh process, the order alternating round by
round so that drift on a shared machine hits each alike. Each sample is
:func:`compile_bill.measure`'s start: from the moment the process asks for a compile (before
``import passkit`` and the backend) to the first call's output, the model built before it.
Printed per variant: the samples, the median, the ratio to Inductor's median, the median CPU
seconds of the start window (``time.process_time``: steadier than wall time where other
engineers share the cores) and the backend's part of the start (``import passkit`` and
building the backend: nothing for Inductor, which ``torch.compile`` imports itself).

    python benchmarks/warm_start.py                          # CPU: HF Llama, hidden 256, 4 layers
    python benchmarks/warm_start.py --device cuda            # one GPU: hidden 4096, 4 layers, bf16
    python benchmarks/warm_start.py --baseline-tree /tmp/before   # an earlier passkit beside it

``--baseline-tree DIR``: a checkout of an earlier passkit (``git archive <commit> | tar -x -C
DIR``); both passkit variants also run from it (``... [before]``), in the same rounds, so
before and after are measured side by side. ``--cold``: before priming, each variant's
cold start in an empty cache folder of its own (variants alternating, ``--cold`` rounds).
``--profile DIR``: after the timed rounds, one more warm start per variant under cProfile.
``--budget S``: no round starts after S seconds (the rounds done are the result). Results:
``--out`` (``.md`` and ``.json``), rewritten after every round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compile_bill  # beside this script

VARIANTS = {
    "inductor": "inductor",
    "passkit no pass": "passkit no pass",
    "passkit TP serving": "passkit first_use",
}
"""This script's variant names -> compile_bill's (the serving config, compile_at first_use)."""


def run(args: argparse.Namespace, variant: str, cache_root: str, profile_to: str = "") -> dict[str, Any]:
    """One fresh process of ``variant`` with the caches under ``cache_root``."""
    before = variant.endswith(compile_bill.BEFORE)
    name = VARIANTS[variant.removesuffix(compile_bill.BEFORE)] + (compile_bill.BEFORE if before else "")
    os.environ["PASSKIT_CACHE_DIR"] = os.path.join(cache_root, "passkit-reports")
    return compile_bill.run_variant(
        args, "hf-llama", 1, name, os.path.join(cache_root, "inductor"), profile_to
    )


def rows_of(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    base = statistics.median(r["start_s"] for r in results["inductor"])
    base_cpu = statistics.median(r["cpu_s"] for r in results["inductor"])
    rows = []
    for variant, samples in results.items():
        median = statistics.median(r["start_s"] for r in samples)
        cpu = statistics.median(r["cpu_s"] for r in samples)
        rows.append(
            {
                "variant": variant,
                "samples_start_s": [round(r["start_s"], 3) for r in samples],
                "start_s": round(median, 3),
                "vs_inductor": round(median / base, 3),
                "cpu_s": round(cpu, 3),
                "cpu_vs_inductor": round(cpu / base_cpu, 3),
                "backend_s": round(statistics.median(r["backend_s"] for r in samples), 3),
                "gc_s": round(statistics.median(r["gc_s"] for r in samples), 3),
                "fxgraph_hits": samples[0]["cache"]["fxgraph_hit"],
                "fxgraph_misses": max(r["cache"]["fxgraph_miss"] for r in samples),
                "compiles": samples[0]["compiles"],
            }
        )
    return rows


def render(
    rows: list[dict[str, Any]], cold: dict[str, list[dict[str, float]]], primed: dict[str, float]
) -> str:
    """One row per variant; "priming s": its first run in the shared folder (cold for its own
    graphs, but served the kernels an earlier variant compiled), "cold s": ``--cold``'s, each
    in its own empty folder, with the median CPU seconds of the compiling process and its
    ratio to Inductor's (steadier where others share the cores; the CPU of Inductor's compile
    workers, other processes, is not in it: it is the part passkit can add to)."""
    lines = [
        "| variant | warm start s (samples) | median | vs Inductor | CPU s | vs Inductor "
        "| backend s | GC s | FX graph cache hits (misses) | priming s | cold s (samples) "
        "| cold CPU s (the process) | vs Inductor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base_cold = _median_cpu(cold.get("inductor", []))
    for row in rows:
        samples = ", ".join(f"{s:.2f}" for s in row["samples_start_s"])
        runs = cold.get(row["variant"], [])
        colds = ", ".join(f"{r['start_s']:.1f}" for r in runs) or "-"
        cold_cpu = _median_cpu(runs)
        cold_cpu_cells = (
            f"{cold_cpu:.1f} | {cold_cpu / base_cold:.2f}x" if cold_cpu and base_cold else "- | -"
        )
        lines.append(
            f"| {row['variant']} | {samples} | {row['start_s']:.2f} | {row['vs_inductor']:.2f}x | "
            f"{row['cpu_s']:.2f} | {row['cpu_vs_inductor']:.2f}x | {row['backend_s']:.2f} | "
            f"{row['gc_s']:.2f} | {row['fxgraph_hits']} ({row['fxgraph_misses']}) | "
            f"{primed.get(row['variant'], float('nan')):.1f} | {colds} | {cold_cpu_cells} |"
        )
    return "\n".join(lines)


def _median_cpu(runs: list[dict[str, float]]) -> float | None:
    return statistics.median(r["cpu_s"] for r in runs) if runs else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=None, help="default: 4096 on cuda, 256 on cpu")
    parser.add_argument("--tokens", type=int, default=16, help="token count of the first call")
    parser.add_argument("--samples", type=int, default=5, help="warm samples per variant (rounds)")
    parser.add_argument("--cold", type=int, default=0, help="cold samples per variant, own folders")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--baseline-tree", type=Path, default=None, help="also run passkit from here")
    parser.add_argument("--limit", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--budget", type=float, default=0, help="start no round after this many seconds")
    parser.add_argument("--profile", type=Path, default=None, help="cProfile one more warm start each")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.samples < 1:
        parser.error("--samples must be at least 1")
    if args.hidden is None:
        args.hidden = 4096 if args.device == "cuda" else 256
    variants = list(args.variants)
    if "inductor" not in variants:
        variants.insert(0, "inductor")
    if args.baseline_tree:
        variants += [v + compile_bill.BEFORE for v in variants if v != "inductor"]
    # what compile_bill.run_variant reads
    args.tokens, args.limit = [args.tokens], args.limit
    compiled = compile_bill.byte_compile(args.baseline_tree)
    load_before = compile_bill._load()
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    cold: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    primed: dict[str, float] = {}
    began = time.monotonic()

    def report(rounds: int) -> None:
        """Print the table of the ``rounds`` done, and write it to ``--out`` (after every
        round: a run stopped by a time limit keeps what it measured)."""
        title = _title(args, rounds, load_before, compiled)
        table = render(rows_of(results), cold, primed)
        print(f"{title}\n{table}", flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.with_suffix(".md").write_text(f"{title}\n\n{table}\n")
            payload = {"title": title, "rows": rows_of(results), "priming_s": primed, "cold": cold}
            payload["samples"] = results
            args.out.with_suffix(".json").write_text(json.dumps(payload, indent=2))

    with tempfile.TemporaryDirectory(prefix="passkit-warm-start-") as root:
        for round_ in range(args.cold):
            for variant in variants if round_ % 2 == 0 else variants[::-1]:
                print(f"{variant}: cold {round_ + 1}/{args.cold} ...", file=sys.stderr, flush=True)
                own = os.path.join(root, f"cold-{round_}-{variants.index(variant)}")
                done = run(args, variant, own)
                cold[variant].append({k: round(done[k], 2) for k in ("start_s", "cpu_s")})
        shared = os.path.join(root, "shared")
        for variant in variants:
            print(f"{variant}: priming the shared caches ...", file=sys.stderr, flush=True)
            primed[variant] = round(run(args, variant, shared)["start_s"], 2)
        for round_ in range(args.samples):
            if args.budget and round_ and time.monotonic() - began > args.budget:
                print(f"--budget {args.budget:g} s spent: {round_} rounds", file=sys.stderr)
                break
            for variant in variants if round_ % 2 == 0 else variants[::-1]:
                print(f"{variant}: warm {round_ + 1}/{args.samples} ...", file=sys.stderr, flush=True)
                result = run(args, variant, shared)
                if result["cache"]["fxgraph_miss"]:
                    print(f"{variant}: a warm start missed the FX graph cache", file=sys.stderr)
                results[variant].append(result)
            report(round_ + 1)
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
            for variant in variants:
                slug = variant.replace(" ", "_").replace("[", "").replace("]", "")
                print(f"{variant}: profiled warm start -> {args.profile}", file=sys.stderr, flush=True)
                run(args, variant, shared, str(args.profile / f"warm_{slug}.txt"))


def _title(args: argparse.Namespace, rounds: int, load_before: str, compiled: str) -> str:
    import torch

    machine = f"{platform.node()} ({os.cpu_count()} CPUs), torch {torch.__version__}"
    if args.device == "cuda":
        machine += f", {torch.cuda.get_device_name()}"
    try:
        import transformers

        machine += f", transformers {transformers.__version__}"
    except ImportError:
        pass
    dtype = "bf16" if args.device == "cuda" else "fp32"
    return (
        f"warm start at world size 1: Hugging Face Llama body, hidden {args.hidden}, {args.layers} layers, "
        f"{dtype}, first call {args.tokens[0]} tokens (dynamic); {rounds} warm samples per variant "
        f"(of {args.samples} asked), a fresh process each, variants alternating, caches shared and "
        f"primed; {machine}, device {args.device}; {load_before} before, {compile_bill._load()} after; "
        f"{compiled}"
    )


if __name__ == "__main__":
    main()
