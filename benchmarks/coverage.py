"""Coverage: which all-reduce sites of the Hugging Face families the tensor-parallel passes
take, and whether the output still equals eager. Not a timed benchmark.

Each family is built from its transformers config class at small sizes (2 layers, hidden 64,
4 experts..., random weights: ``passkit_fusion.coverage.configs``), sharded with
``tp_plan="auto"`` on a 2-process gloo world (CPU) and compiled with ``allreduce_rmsnorm``
(reference op), ``allreduce_layernorm`` (reference op; the LayerNorm sites),
``sequence_parallel`` and ``sequence_parallel`` + ``async_tp`` (test mode).
Per family and pass it prints the all-reduces, the sites rewritten, why the rest were left
(the node chain that stopped the matcher) and the largest logit difference from eager, then
the totals. Families that cannot be sharded with ``tp_plan="auto"`` by the installed
transformers say why.

    python benchmarks/coverage.py                       # the 14 listed families (about 10 min on 2 cores)
    python benchmarks/coverage.py --all                 # every causal LM with a TP plan (~100; hours)
    python benchmarks/coverage.py --all --jobs 8 --cache runs/   # 8 families at a time; resumable
    python benchmarks/coverage.py --families Glm4Moe,olmoe   # any family name or model_type
    python benchmarks/coverage.py --families Llama,Qwen3-MoE
    python benchmarks/coverage.py --write               # + benchmarks/results/coverage_cpu.md
    python benchmarks/coverage.py --all --write         # + benchmarks/results/coverage_all.md

The same check for one config a user brings: ``passkit explain-hf config.json --tp 2``.

GPUs (``--gpu``): the same families at hidden 4096 in bf16 on ``--tp`` GPUs over NCCL, compiled by
Inductor with the serving pipeline (``allreduce_rmsnorm`` with flashinfer's fused op,
``allreduce_layernorm`` with its symmetric-memory op, ``cleanup``) and by Inductor alone: sites
fused per pass and the error against eager beside Inductor's. ``--dp 2`` runs two data-parallel
replicas of the TP group (4 GPUs at ``--tp 2``; on 2 GPUs ``--tp 1``: the passes must find no
tensor-parallel all-reduce to take).

    python benchmarks/coverage.py --gpu --jobs 2 --write    # + benchmarks/results/coverage_gpu.md
    python benchmarks/coverage.py --gpu --tp 1 --dp 2 --families Llama,Qwen3-MoE

Two GPUs (``--decode``): a Qwen3-MoE-shaped decode step (real dims, 8 layers by default,
random weights) at TP=2 over NCCL, Inductor vs passkit with ``allreduce_rmsnorm`` (flashinfer),
timed per token count with CUDA graphs: see :mod:`coverage_decode`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
NOT_A_NORM = (
    "no RMSNorm after the all-reduce",
    "no LayerNorm after the all-reduce",
    "no norm follows",
    "a LayerNorm follows (allreduce_layernorm's site",
    "an RMSNorm follows (allreduce_rmsnorm's site",
    "no norm reads the sum plus a residual",
)
"""The reasons a site is not followed by the pass's norm at all (no norm within a reshape or
a scale; a post-norm model's embedding, which no norm reads; hyper-connections' streams, whose
norms read a mix of streams; the other norm kind, which the other pass takes: LayerNorm sites
are ``allreduce_layernorm``'s, RMSNorm sites the others'): not counted as sites its norm
follows."""


def totals(reports: list) -> dict[str, dict[str, int]]:
    """Per pass: all-reduces, rewritten, and the all-reduces followed by the pass's norm (an
    RMSNorm; a LayerNorm for ``allreduce_layernorm``: all but those rejected because no such
    norm follows them, and none in a family without that kind of norm, whatever the reason
    its sites were left): the denominator."""
    out: dict[str, dict[str, int]] = {}
    for report in reports:
        kinds = set(report.norm.split("+"))
        for o in report.outcomes:
            if o.label.endswith("async_tp") or o.error:
                continue
            t = out.setdefault(o.label, {"all_reduces": 0, "rewritten": 0, "followed_by_norm": 0})
            no_norm = sum(n for reason, n in o.reasons.items() if any(r in reason for r in NOT_A_NORM))
            t["all_reduces"] += o.all_reduces
            t["rewritten"] += o.rewritten
            if PASS_NORMS.get(o.label, "RMSNorm") in kinds or report.norm == "?":
                t["followed_by_norm"] += o.all_reduces - no_norm
    return out


PASS_NORMS = {"allreduce_layernorm": "LayerNorm"}
"""The norm each pass ends its sites in (the others: RMSNorm)."""


def render(reports: list, args: argparse.Namespace, seconds: float, reused: int = 0) -> str:
    """The totals by norm kind, a line per family (sites rewritten of those its norm follows,
    per pass), then every family's full table (the reasons), grouped by norm kind."""
    import torch
    import transformers
    from passkit_fusion.coverage.run import format_report, versions

    lines = [
        f"Machine: {platform.machine()} CPU, {platform.system()}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}; TP={args.tp} gloo processes, {args.tokens} tokens, "
        f"fp32, passkit mode {args.mode}; {seconds:.0f} s"
        + (f" (and {reused} families' reports read from the cache of earlier runs)." if reused else "."),
    ]
    made = Counter(r.versions for r in reports)
    if len(made) > 1 or (made and next(iter(made)) != versions()):
        lines.append(
            "Reports made with: " + "; ".join(f"{v} ({n} families)" for v, n in made.most_common()) + "."
        )
    groups: dict[str, list] = {}
    for report in reports:  # by norm kind: RMSNorm families first
        groups.setdefault(report.norm, []).append(report)
    order = sorted(groups, key=lambda k: (k != "RMSNorm", k))
    lines += [
        "",
        "| norm | pass | all-reduces | followed by its norm | rewritten | rewritten / followed by its norm |",
        "|---|---|---|---|---|---|",
    ]
    for kind in order:
        for label, t in totals(groups[kind]).items():
            share = f"{t['rewritten'] / t['followed_by_norm']:.1%}" if t["followed_by_norm"] else "-"
            lines.append(
                f"| {kind} | {label} | {t['all_reduces']} | {t['followed_by_norm']} | {t['rewritten']} | {share} |"
            )
    not_run = [r for r in reports if r.error]
    if not_run:
        lines += ["", f"{len(not_run)} of {len(reports)} families not run (the reason is in their row)."]
    failed = [(r.name, o.label) for r in reports for o in r.outcomes if o.error]
    if failed:
        shown = ", ".join(f"{name} ({label})" for name, label in failed)
        lines += [
            "",
            f"{len(failed)} pass configuration(s) failed with passkit's own error (in their rows): {shown}.",
        ]
    errors = [o.max_error for r in reports for o in r.outcomes if not o.error]
    if errors:
        lines += ["", f"Largest logit difference from eager, every family and pass: {max(errors):.2e}"]
    lines += ["", "## Per family", "", *family_lines(reports, order)]
    for kind in order:
        lines += [
            "",
            f"## {kind} families ({len(groups[kind])}): the reasons",
            "",
            format_report(groups[kind]),
        ]
    return "\n".join(lines)


PASS_COLUMNS = ("allreduce_rmsnorm", "allreduce_layernorm", "sequence_parallel")


def family_lines(reports: list, order: list[str]) -> list[str]:
    """A row per family: per pass ``rewritten/followed by its norm`` (``+n`` more all-reduces
    no such norm follows), the largest logit difference, or why it did not run."""
    lines = [
        "| norm | family | config | " + " | ".join(PASS_COLUMNS) + " | max abs error vs eager |",
        "|---|---|---|" + "---|" * len(PASS_COLUMNS) + "---|",
    ]
    for kind in order:
        for report in (r for r in reports if r.norm == kind):
            if report.error:
                cells = [f"not run: {report.error.splitlines()[0]}"] + [""] * (len(PASS_COLUMNS) - 1)
                lines.append(
                    f"| {kind} | {report.name} | {report.config_class} | " + " | ".join(cells) + " | - |"
                )
                continue
            mine = totals([report])
            failed = {o.label for o in report.outcomes if o.error}
            cells = []
            for label in PASS_COLUMNS:
                t = mine.get(label)
                if t is None:
                    cells.append("**failed**" if label in failed else "-")
                    continue
                other = t["all_reduces"] - t["followed_by_norm"]
                cell = f"{t['rewritten']}/{t['followed_by_norm']}" + (f" (+{other})" if other else "")
                cells.append(f"**{cell}**" if t["rewritten"] < t["followed_by_norm"] else cell)
            error = max((o.max_error for o in report.outcomes if not o.error), default=0.0)
            lines.append(
                f"| {kind} | {report.name} | {report.config_class} | "
                + " | ".join(cells)
                + f" | {error:.1e} |"
            )
    return lines


def check_family(family: str, args: argparse.Namespace) -> Any:
    """One family's report: shrunk to ``args.layers`` layers and checked on a ``args.tp``-rank
    gloo world; a config its class rejects at small sizes is reported, not raised."""
    from passkit_fusion.coverage.configs import load_config, small_config
    from passkit_fusion.coverage.run import FamilyReport, check_model

    config = load_config(family)
    try:
        small = small_config(config, layers=args.layers, hidden=args.hidden)
    except Exception as exc:
        error = f"cannot shrink it: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return FamilyReport(family, type(config).__name__, args.tp, [], error=error)
    if not args.gpu:
        return check_model(small, name=family, tp=args.tp, tokens=args.tokens, mode=args.mode)
    from passkit_fusion.coverage.run import GPU_PASSES

    return check_model(
        small,
        name=family,
        tp=args.tp,
        dp=args.dp,
        tokens=args.tokens,
        mode="inductor",
        world="nccl",
        dtype="bfloat16",
        passes=GPU_PASSES,
    )


GPU_COLUMNS = ("allreduce_rmsnorm", "allreduce_layernorm")
GPU_FAMILIES = ("olmo2", "qwen3_next", "cohere", "starcoder2")
"""Beside the 14 listed, on GPUs: the norms the kernels must also meet (OLMo2's norm after
the sublayer, Qwen3-Next's zero-centred weight, Cohere's bias-free LayerNorm, Starcoder2's
LayerNorm with a bias); Gemma's ``(1 + w)`` and Granite's multipliers are among the 14."""


def render_gpu(reports: list, args: argparse.Namespace, seconds: float, reused: int = 0) -> str:
    """``--gpu``'s table: a row per family, per pass the sites fused of those its norm
    follows (and its status where it did not run), passkit's error against eager beside
    Inductor's; then every family's reasons."""
    import torch
    import transformers
    from passkit_fusion.coverage.run import format_report

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    layout = f"{args.dp} data-parallel replicas x TP={args.tp}" if args.dp > 1 else f"TP={args.tp}"
    lines = [
        f"Machine: {args.dp * args.tp}x {gpu}; torch {torch.__version__}, transformers {transformers.__version__}; "
        f"{layout} over NCCL, hidden {args.hidden}, {args.layers} layers, bf16, random weights, {args.tokens} "
        f'tokens; Inductor with `passes=["allreduce_rmsnorm", "allreduce_layernorm", "cleanup"]` '
        f"(the GPU kernels) beside Inductor alone; {seconds:.0f} s"
        + (f" (and {reused} families read from the cache)." if reused else "."),
        "",
        "| norm | family | config | "
        + " | ".join(GPU_COLUMNS)
        + " | passkit error vs eager | Inductor error vs eager |",
        "|---|---|---|" + "---|" * len(GPU_COLUMNS) + "---|---|",
    ]
    for report in sorted(reports, key=lambda r: (r.norm != "RMSNorm", r.norm)):
        head = f"| {report.norm} | {report.name} | {report.config_class} | "
        if report.error:
            lines.append(
                head + f"not run: {report.error.splitlines()[0]} |" + " |" * len(GPU_COLUMNS) + " - |"
            )
            continue
        by_label = {o.label: o for o in report.outcomes}
        mine = totals([report])
        cells = []
        for label in GPU_COLUMNS:
            o, t = by_label.get(label), mine.get(label)
            if o is None or t is None:
                cells.append(f"**failed**: {o.error}" if o is not None and o.error else "-")
                continue
            cell = f"{t['rewritten']}/{t['followed_by_norm']}"
            other = t["all_reduces"] - t["followed_by_norm"]
            cell += f" (+{other})" if other else ""
            if t["rewritten"] < t["followed_by_norm"]:
                cell = f"**{cell}**"
            not_ran = [s for s in o.statuses if not s.startswith("ran")]
            cells.append(cell + (f" ({'; '.join(not_ran)})" if not_ran else ""))
        ours = max(
            (o.max_error for o in report.outcomes if o.label in GPU_COLUMNS and not o.error), default=None
        )
        base = by_label.get("inductor")
        lines.append(
            head
            + " | ".join(cells)
            + f" | {'-' if ours is None else f'{ours:.1e}'} | {'-' if base is None else f'{base.max_error:.1e}'} |"
        )
    lines += ["", "## The reasons", "", format_report(reports)]
    return "\n".join(lines)


def load_report(path: Path) -> Any:
    """A :class:`FamilyReport` written by :func:`save_report`."""
    from passkit_fusion.coverage.run import FamilyReport, PassOutcome

    data = json.loads(path.read_text())
    data["outcomes"] = [PassOutcome(**o) for o in data["outcomes"]]
    return FamilyReport(**data)


def save_report(report: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(report), indent=1))
    tmp.replace(path)  # a run killed while writing leaves no half file to resume from


def run_families(families: list[str], args: argparse.Namespace) -> tuple[list[Any], int]:
    """Every family's report, in ``families``' order, and how many were read from the cache: ``args.jobs`` at a time (each family's
    ranks are processes: threads only wait on them), reusing and filling ``args.cache``.
    Prints a line per family as it finishes (``[k/n] family: ...``) on stderr."""
    cache: Path | None = args.cache
    done: dict[str, Any] = {}
    if cache is not None:
        for family in families:
            if (cache / f"{family}.json").is_file():
                done[family] = load_report(cache / f"{family}.json")
        if done:
            print(f"{len(done)} of {len(families)} families read from {cache}", file=sys.stderr, flush=True)
    todo = [f for f in families if f not in done]
    started = time.perf_counter()

    def one(family: str) -> tuple[str, Any, float]:
        t0 = time.perf_counter()
        return family, check_family(family, args), time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(one, f) for f in todo]
        for k, future in enumerate(as_completed(futures), 1):
            family, report, seconds = future.result()
            done[family] = report
            if cache is not None:
                save_report(report, cache / f"{family}.json")
            print(
                f"[{k}/{len(todo)}] {family}: {progress_line(report)} ({seconds:.0f} s; "
                f"{time.perf_counter() - started:.0f} s so far)",
                file=sys.stderr,
                flush=True,
            )
    return [done[f] for f in families], len(families) - len(todo)


def progress_line(report: Any) -> str:
    """``allreduce_rmsnorm 5/5, sequence_parallel 5/5, ...`` or ``not run: ...``."""
    if report.error:
        return f"not run: {report.error.splitlines()[0][:160]}"
    return ", ".join(
        f"{o.label} failed" if o.error else f"{o.label} {o.rewritten}/{o.all_reduces}"
        for o in report.outcomes
        if not o.label.endswith("async_tp")
    )


def main(argv: list[str] | None = None) -> int:
    from passkit_fusion.coverage.configs import FAMILIES, ConfigError, load_config, tp_families

    argv = sys.argv[1:] if argv is None else argv
    if "--decode" in argv:  # the two-GPU timing has its own arguments
        if str(HERE) not in sys.path:
            sys.path.insert(0, str(HERE))
        from coverage_decode import main as decode_main

        return decode_main([a for a in argv if a != "--decode"])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--families",
        help="comma-separated family names, model_types or config classes (default: the 14 listed; "
        "--gpu: and the norm variants of GPU_FAMILIES)",
    )
    ap.add_argument(
        "--all",
        action="store_true",
        help="every causal LM with a tensor-parallel plan in the installed transformers (slow: ~1 min each)",
    )
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="on GPUs over NCCL: hidden 4096, bf16, the GPU kernels in one Inductor compile beside Inductor alone",
    )
    ap.add_argument("--dp", type=int, default=1, help="--gpu: data-parallel replicas of the TP group")
    ap.add_argument("--hidden", type=int, help="residual stream width (default 64; --gpu: 4096)")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mode", choices=("eager", "inductor"), default="eager")
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="families checked at once (each is a world of --tp processes of one thread): a machine's cores / tp",
    )
    ap.add_argument(
        "--cache",
        type=Path,
        help="write each family's report to CACHE/<family>.json as it finishes and reuse the reports found "
        "there (a long run stopped part way resumes; delete a file to rerun its family)",
    )
    ap.add_argument(
        "--write",
        action="store_true",
        help="write benchmarks/results/coverage_cpu.{md,json} (--all: coverage_all.{md,json})",
    )
    ap.add_argument("--write-to", type=Path, help="write the files into this folder instead")
    ap.add_argument(
        "--decode",
        action="store_true",
        help="the two-GPU decode timing; its arguments: coverage_decode.py --help",
    )
    args = ap.parse_args(argv)
    if args.gpu and args.hidden is None:
        args.hidden = 4096
    if args.dp > 1 and not args.gpu:
        ap.error("--dp needs --gpu (the CPU table is one TP group)")
    default = [*FAMILIES, *GPU_FAMILIES] if args.gpu else list(FAMILIES)
    listed = [f.strip() for f in args.families.split(",") if f.strip()] if args.families else default
    families = list(tp_families()) if args.all else listed
    unknown = []
    for family in families:
        try:
            load_config(family)
        except ConfigError:
            unknown.append(family)
    if unknown:
        ap.error(
            f"unknown families {unknown} (a family name, model_type or config class; listed: {', '.join(FAMILIES)})"
        )
    start = time.perf_counter()
    reports, reused = run_families(families, args)
    render_table = render_gpu if args.gpu else render
    text = render_table(reports, args, time.perf_counter() - start, reused)
    print(text)
    if args.write or args.write_to:
        out = args.write_to or HERE / "results"
        out.mkdir(parents=True, exist_ok=True)
        stem, title = ("coverage_all", "every family with a TP plan, ") if args.all else ("coverage_cpu", "")
        where = "CPU"
        if args.gpu:
            stem = "coverage_gpu" + (f"_dp{args.dp}_tp{args.tp}" if args.dp > 1 else "")
            where = "GPUs"
        (out / f"{stem}.md").write_text(
            f"# Coverage on {where}, {title}benchmarks/coverage.py\n\n" + text + "\n"
        )
        (out / f"{stem}.json").write_text(json.dumps([dataclasses.asdict(r) for r in reports], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
