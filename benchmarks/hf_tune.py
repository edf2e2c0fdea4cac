"""Stored fuse decisions on the Hugging Face Llama: tuned, stored, restored in a fresh program.

What a user does, in the user's order, each step its own program:

1. ``passkit tune-model hf_tp:tune_target`` (``hf_tp.py``'s model, DTensor plan and serving
   config) measures the pass sets per token count on ``--world`` GPUs, in torch.compile's
   ``--compile-mode``, and stores the decision under ``$PASSKIT_CACHE_DIR/fusion-decisions``;
2. ``hf_tp.py --one-process`` compiles Inductor and passkit's serving config in that mode in
   fresh processes: passkit's compiles find the stored decision by the graph's fingerprint
   (each compile's pass records say ``decision: stored``), and both are timed in
   interleaved rounds;
3. one table per token count: the decision's pass set, the best set the tuning measured (its
   speed-up over Inductor), the fresh program's passkit / Inductor, and the ratio of the two
   speed-ups (target: the stored choice within 1% of the best measured, >= 0.99).

    python benchmarks/hf_tune.py --world 2 [--compile-mode reduce-overhead] [--timing calls] [--budget 240]
    python benchmarks/hf_tune.py --smoke          # CPU, gloo, a tiny Llama (plumbing only)

Writes ``hf_tune_w<N>[_ro].{md,json}`` to ``--out-dir`` (default ``$OUT`` or ``/tmp``).
A fresh ``PASSKIT_CACHE_DIR`` (``--cache``) keeps earlier decisions out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run(cmd: list[str], env: dict[str, str], log: Path) -> None:
    """``cmd`` from ``benchmarks/`` (its modules importable), its output teed to ``log``."""
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            sys.stderr.write(line)
        if proc.wait():
            raise SystemExit(f"{cmd[0]} {cmd[1]} failed with exit code {proc.returncode} (log: {log})")


def stored_decisions(cache: Path) -> list[Any]:
    from passkit_fusion.tuning import decisions

    return [decisions.load(p) for p in sorted((cache / "fusion-decisions").glob("*.json"))]


def restored(report: dict[str, Any]) -> bool:
    """Whether a compile's report says it used the stored decision: every pass that says
    where its token range came from (its record's ``decision``, ran or skipped) says
    ``stored``."""
    sources = report.get("decision_sources") or {}
    return bool(sources) and all(s == "stored" for s in sources.values())


def mode_suffix(args: argparse.Namespace) -> str:
    """How hf_tp.py names the variants of ``--compile-mode``: ``" reduce-overhead"`` or ``""``."""
    return " reduce-overhead" if args.compile_mode == "reduce-overhead" else ""


def table(args: argparse.Namespace, found: list[Any], fresh: dict[str, Any]) -> tuple[str, list[dict]]:
    """The markdown report and its rows."""
    ro = mode_suffix(args)
    ind, pk = f"inductor{ro}", f"passkit{ro}"
    decision = found[0]
    rows = []
    for t in args.tokens:
        medians = decision.medians_us.get(t, {})
        best = min(medians.items(), key=lambda kv: kv[1]) if medians else None
        base = medians.get("inductor")
        row: dict[str, Any] = {
            "tokens": t,
            "stored": "+".join(decision.passes_at(t)) or "inductor",
            "best_set": best[0] if best else None,
            "best_speedup": base / best[1] if best and base else None,
            "inductor_ms": fresh["ms"][ind][t],
            "passkit_ms": fresh["ms"][pk][t],
        }
        row["fresh_speedup"] = row["inductor_ms"] / row["passkit_ms"]
        if row["best_speedup"]:
            row["fresh_vs_best"] = row["fresh_speedup"] / row["best_speedup"]
        rows.append(row)
    reports = fresh["reports"].get(pk, [])
    lines = [
        f"# Stored fuse decisions, HF Llama 8B-shaped, {fresh['layers']} layers, DTensor TP={fresh['world']}"
        f"{', mode=reduce-overhead' if ro else ''}",
        "",
        f"{fresh['device']}, torch {fresh['torch']}, {time.strftime('%Y-%m-%d')}. Tuned by `passkit tune-model "
        f"hf_tp:tune_target` (budget {args.budget:g} s), stored, then restored by a fresh `hf_tp.py --one-process` "
        "(interleaved rounds, CUDA events, barrier before each forward). `best set`: the fastest pass set the "
        "tuning measured at that count, and its speed-up over Inductor there; `fresh`: passkit's speed-up over "
        "Inductor in the fresh program; `fresh / best`: target >= 0.99.",
        "",
        f"Decision: {decision.summary()}" + (f"; not measured: {'; '.join(decision.unmeasured)}" if decision.unmeasured else ""),
        f"Decision files: {len(found)} (one per graph Dynamo made).",
        "",
        "| tokens | stored set | best set (tuning) | best / Inductor | fresh passkit / Inductor | fresh / best |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        best = f"{r['best_speedup']:.3f}x" if r["best_speedup"] else "-"
        vs = f"{r['fresh_vs_best']:.3f}" if "fresh_vs_best" in r else "-"
        lines.append(
            f"| {r['tokens']} | {r['stored']} | {r['best_set'] or '-'} | {best} | {r['fresh_speedup']:.3f}x "
            f"({r['passkit_ms']:.3f} vs {r['inductor_ms']:.3f} ms) | {vs} |"
        )
    lines += ["", "The fresh program's compiles (passkit):", ""]
    for rep in reports:
        fused = ", ".join(f"{p} {st} {m}" for p, (st, m) in rep["passes"].items())
        sources = ", ".join(f"{p} {s}" for p, s in (rep.get("decision_sources") or {}).items()) or "none"
        note = rep.get("decision") or "no fuse decision note"
        lines.append(f"- {rep['range']}: {fused}; decisions: {sources}; {note[:240]}")
    everyone = all(restored(rep) for rep in reports) and bool(reports)
    lines += ["", f"Every compile found the stored decision: {'yes' if everyone else 'NO'}."]
    lines += ["", "Tuning medians (us, slowest rank):", ""]
    labels = sorted({k for m in decision.medians_us.values() for k in m})
    lines += ["| tokens | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 1)]
    for t in sorted(decision.medians_us):
        m = decision.medians_us[t]
        lines.append(f"| {t} | " + " | ".join(f"{m[k]:.1f}" if k in m else "-" for k in labels) + " |")
    return "\n".join(lines) + "\n", rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048, 8192])
    ap.add_argument("--budget", type=float, default=240.0, help="tuning seconds")
    ap.add_argument("--compile-mode", choices=["default", "reduce-overhead"], default="default")
    ap.add_argument("--candidates", nargs="+", default=None, help="as passkit tune-model's (names joined by '+')")
    ap.add_argument(
        "--timing",
        choices=["graphs", "calls"],
        default=None,
        help="as passkit tune-model's: calls counts each call's host time (a program without CUDA graphs)",
    )
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4, help="the fresh program's interleaved rounds")
    ap.add_argument("--cache", type=Path, default=None, help="PASSKIT_CACHE_DIR (default: a new folder)")
    ap.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT") or "/tmp"))
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, a tiny Llama: plumbing only")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.layers, args.budget, args.rounds = [1, 8], 1, 240.0, 2
    cache = args.cache or Path(f"/tmp/hf_tune_cache_{os.getpid()}")
    # both caches in one fresh folder: an Inductor cache hit of an earlier program's compile
    # would have its report in another passkit cache (a hit without its report)
    env = {
        **os.environ,
        "PASSKIT_CACHE_DIR": str(cache),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "HF_TUNE_LAYERS": str(args.layers),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    ro = mode_suffix(args)
    stem = f"hf_tune_w{args.world}" + ("_ro" if ro else "") + (f"_{args.timing}" if args.timing else "")
    log = args.out_dir / f"{stem}.log"
    tokens = [str(t) for t in args.tokens]
    tune = [sys.executable, "-m", "passkit.cli", "tune-model", "hf_tp:tune_target", "--world-size", str(args.world)]
    tune += ["--tokens", *tokens, "--budget", str(args.budget)]
    if args.compile_mode != "default":
        tune += ["--compile-mode", args.compile_mode]
    if args.candidates:
        tune += ["--candidates", *args.candidates]
    if args.timing:
        tune += ["--timing", args.timing]
    if args.smoke:
        tune.append("--cpu")
    run(tune, env, log)
    found = stored_decisions(cache)
    if not found:
        raise SystemExit(f"passkit tune-model stored no decision under {cache} (log: {log})")
    fresh_out = args.out_dir / f"{stem}_fresh"
    check = [sys.executable, "hf_tp.py", "--world", str(args.world), "--one-process", "--tokens", *tokens]
    check += ["--layers", str(args.layers), "--rounds", str(args.rounds), "--out", str(fresh_out)]
    check += ["--only", f"inductor{ro}", f"passkit{ro}"] + (["--smoke"] if args.smoke else [])
    run(check, env, log)
    fresh = json.loads(fresh_out.with_suffix(".json").read_text())
    fresh["ms"] = {n: {int(t): v for t, v in per.items()} for n, per in fresh["ms"].items()}
    text, rows = table(args, found, fresh)
    print(text)
    (args.out_dir / f"{stem}.md").write_text(text)
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "fresh": fresh}
    record["decisions"] = [d.summary() for d in found]
    (args.out_dir / f"{stem}.json").write_text(json.dumps(record, indent=1, default=str))


if __name__ == "__main__":
    main()
