"""SGLang's compile shapes as passkit token ranges, and the notes an SGLang compile's
report gets. Pure passkit: no SGLang import; :mod:`passkit.hosts.sglang` re-exports it."""

from __future__ import annotations

from collections.abc import Iterable

from ..._pipeline.build import Pipeline
from ...context import CompileContext
from ...tokens import TokenConstraint, TokenRange


def token_range(runtime_shape: int | None, capture_sizes: Iterable[int] = ()) -> TokenRange:
    """The passkit :class:`TokenRange` of one SGLang compile.

    ``runtime_shape=n`` (a per-shape compile): ``tokens n, multiples of n``, so that a pass
    constrained to multiples of ``k`` applies when ``k`` divides ``n``. ``None`` (the
    general compile): the span of ``capture_sizes`` (the CUDA-graph token buckets SGLang
    pads every compiled run to), or every size when there are none."""
    if runtime_shape is not None:
        n = max(int(runtime_shape), 1)
        return TokenRange(n, n, n)
    sizes = sorted({int(s) for s in capture_sizes if int(s) >= 1})
    if not sizes:
        return TokenRange(1, None)
    return TokenRange(sizes[0], sizes[-1])


def constraints(pipeline: Pipeline) -> dict[str, TokenConstraint | None]:
    """Each pass's token constraint (None: every size), from a context with no graph."""
    ctx = CompileContext.detect(())
    return {p.name: p.checked_token_constraint(ctx) for p in pipeline.passes}


def applies(pipeline: Pipeline, tokens: TokenRange) -> bool:
    """SGLang's ``is_applicable_for_shape``: whether some pass of ``pipeline`` applies to
    every token count of ``tokens`` (other skip reasons, e.g. no CUDA, are decided per graph)."""
    return any(c is None or c.holds_for(tokens) for c in constraints(pipeline).values())


def range_notes(
    pipeline: Pipeline, tokens: TokenRange, runtime_shape: int | None, static: int | None = None
) -> list[str]:
    """Report notes for one SGLang compile: what the range is, passes it straddles, and
    passkit config that SGLang's shapes replace. ``static``: the general compile is of a
    graph with static shapes serving that token count only (Dynamo's 1-token recompile)."""
    what = f"SGLang compile for runtime shape {runtime_shape}"
    if runtime_shape is None and static is not None:
        what = (
            f"SGLang general-shape compile of a graph Dynamo compiled with static shapes: it "
            f"serves {static} token{'s' if static != 1 else ''} only"
        )
    elif runtime_shape is None:
        what = "SGLang general-shape compile (serves the CUDA-graph capture sizes " + (
            f"{tokens.lo}..{tokens.hi})" if tokens.hi is not None else "; none known: every size)"
        )
    notes = [what]
    straddled = [
        name
        for name, c in constraints(pipeline).items()
        if c is not None and not c.holds_for(tokens) and any(tokens.contains(e) for e in c.ends())
    ]
    if straddled:
        notes.append(
            f"{', '.join(straddled)} appl{'ies' if len(straddled) == 1 else 'y'} to part of this range "
            "only: SGLang compiles it once, so the pass is skipped here"
        )
    if pipeline.config.compile_ranges:
        notes.append(
            "passkit's compile_ranges is not used inside SGLang: SGLang's shapes decide the compiles"
        )
    return notes
