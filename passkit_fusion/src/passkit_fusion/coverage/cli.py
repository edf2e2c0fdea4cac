"""``passkit explain-hf CONFIG --tp N``: will the tensor-parallel passes fuse my model?

CONFIG is a Hugging Face ``config.json`` (or the folder holding it), a transformers config
class name (``Qwen3MoeConfig``) or a family of ``benchmarks/coverage.py`` (``Granite-MoE``).
The architecture is built at laptop sizes (same structure, random weights), sharded with
``tp_plan="auto"`` on N gloo processes on the CPU, and compiled with each pass; the command
prints, per pass, the all-reduces, the sites rewritten, why the rest were left and the
difference from eager. Needs ``transformers`` and ``accelerate``; no GPU.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from passkit import PasskitError
from passkit.cli import name_list, positive_int
from passkit.errors import suggest

from .passes import PASSES

EXPLAIN_HF_HELP = (
    "Build a Hugging Face architecture (config.json or config class) at small sizes with "
    "tp_plan='auto' on TP CPU processes and report, per pass, the all-reduce sites fused and why "
    "the rest were left."
)

__all__ = ["EXPLAIN_HF_HELP", "add_explain_hf_arguments", "graph_break_note", "run_explain_hf"]


def add_explain_hf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        help="a config.json path (or its folder), a transformers config class (Qwen3MoeConfig) or a family (Mixtral)",
    )
    parser.add_argument(
        "--tp", type=positive_int, default=2, help="tensor-parallel size: gloo processes (default 2)"
    )
    parser.add_argument("--layers", type=positive_int, default=2, help="decoder layers to build (default 2)")
    parser.add_argument(
        "--tokens",
        type=positive_int,
        default=8,
        help="tokens of the test input, a multiple of --tp (default 8)",
    )
    parser.add_argument(
        "--mode",
        choices=("eager", "inductor"),
        default="eager",
        help="eager: the passes' rewrite run without code generation (fast); inductor: compiled",
    )
    parser.add_argument(
        "--passes",
        type=name_list,
        default=list(PASSES),
        help=f"comma-separated, among {', '.join(PASSES)} (default: all)",
    )
    parser.add_argument("--traceback", action="store_true", help="print a failing rank's whole traceback")


def run_explain_hf(args: argparse.Namespace) -> int:
    """Print the report. A config that cannot be read or built at small sizes, arguments that
    do not fit, and a model that cannot run (the failing rank's own error; its traceback with
    ``--traceback``) raise :class:`passkit.PasskitError`: the CLI prints it on stderr and exits 2."""
    from .configs import ConfigError, load_config, small_config
    from .run import check_model, format_report

    labels = list(args.passes)
    if unknown := [p for p in labels if p not in PASSES]:
        raise PasskitError(
            f"unknown pass configuration(s) {', '.join(map(repr, unknown))}"
            f"{suggest(unknown[0], PASSES)} (known: {', '.join(PASSES)})"
        )
    if args.tp < 2 or args.tokens % args.tp:
        raise PasskitError(
            f"--tp must be >= 2 and divide --tokens (got --tp {args.tp}, --tokens {args.tokens})"
        )
    try:
        config = load_config(args.config)
        small = small_config(config, layers=args.layers)
    except ImportError as exc:
        raise PasskitError(
            f"needs transformers and accelerate ({exc}): pip install 'passkit-fusion[hf]'"
        ) from None
    except (ConfigError, TypeError, ValueError) as exc:
        raise PasskitError(str(exc)) from None
    except Exception as exc:  # a config this transformers rejects at small sizes: no traceback
        raise PasskitError(
            f"{args.config}: cannot build it at small sizes: {type(exc).__name__}: {exc}"
        ) from None
    print(
        f"{type(config).__name__} ({getattr(config, 'model_type', '?')}), {args.layers} layers at small sizes "
        f"(hidden {getattr(small, 'hidden_size', '?')}), random weights, tp_plan='auto' on {args.tp} gloo "
        f"processes, {args.tokens} tokens, passkit mode {args.mode}"
    )
    report = check_model(
        small,
        name=str(args.config),
        tp=args.tp,
        tokens=args.tokens,
        passes={label: PASSES[label] for label in labels},
        mode=args.mode,
        tracebacks=args.traceback,
    )
    print(format_report([report]))
    if report.error:
        raise PasskitError(f"{report.name}: {report.error}")
    print(_summary(report))
    if note := graph_break_note(report):
        print(note, file=sys.stderr)
    return 0


def graph_break_note(report: Any) -> str | None:
    """The advice when some all-reduce ended its graph (its norm in the next one, after a
    Dynamo graph break): which transformers versions' TP plans break graphs, what to do."""
    from ..patterns.sites import ENDS_GRAPH, GRAPH_BREAK_ADVICE

    ends = sum(n for o in report.outcomes for r, n in o.reasons.items() if ENDS_GRAPH in r)
    if not ends:
        return None
    import transformers

    return (
        f"note: {ends} all-reduce(s) ended their graph, so their norms could not be fused "
        f"(transformers {transformers.__version__} here): {GRAPH_BREAK_ADVICE}"
    )


def _summary(report: Any) -> str:
    """One line per fusing pass run (``allreduce_rmsnorm``, ``allreduce_layernorm``): sites
    fused of the all-reduces it saw, the logit difference."""
    lines = [
        f"{o.label}: failed: {o.error}"
        if o.error
        else f"{o.label}: {o.rewritten} of {o.all_reduces} all-reduce(s) fused; logits within {o.max_error:.1e} of eager"
        for o in report.outcomes
        if o.label in ("allreduce_rmsnorm", "allreduce_layernorm")
    ]
    return "\n".join(lines)
