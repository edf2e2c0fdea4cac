"""vLLM's compile ranges as passkit token ranges, and the notes a vLLM compile's report gets.

Pure passkit: no vLLM import. :mod:`passkit.hosts.vllm` re-exports every name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..._pipeline.build import Pipeline
from ...context import CompileContext
from ...tokens import TokenConstraint, TokenRange

HOST_FUSIONS: dict[str, tuple[str, str]] = {
    "fuse_allreduce_rms": ("allreduce_rmsnorm", "flashinfer_trtllm_fused_allreduce_norm"),
}
"""vLLM's own fusions of sites a passkit pass also fuses: ``PassConfig`` flag -> (the passkit
pass, the op vLLM's fusion leaves in the graph)."""


def token_range(start: int, end: int) -> TokenRange:
    """The passkit :class:`TokenRange` of vLLM's ``Range(start, end)`` (both inclusive).

    A single size ``n`` (a ``compile_sizes`` entry) becomes ``tokens n, multiples of n``, so
    that a pass constrained to multiples of ``k`` applies when ``k`` divides ``n``."""
    lo = max(int(start), 1)
    hi = max(int(end), lo)
    return TokenRange(lo, hi, lo if lo == hi else 1)


def range_label(tokens: TokenRange) -> str:
    """How reports name a vLLM compile: ``tokens 1..8 (vLLM range (1, 8))``."""
    hi = tokens.hi if tokens.hi is not None else tokens.lo
    plain = TokenRange(tokens.lo, tokens.hi)
    return f"{plain} (vLLM {'size' if tokens.lo == hi else 'range'} ({tokens.lo}, {hi}))"


def constraints(pipeline: Pipeline) -> dict[str, TokenConstraint | None]:
    """Each pass's token constraint (None: every size), from a context with no graph."""
    ctx = CompileContext.detect(())
    return {p.name: p.checked_token_constraint(ctx) for p in pipeline.passes}


def applies(pipeline: Pipeline, tokens: TokenRange) -> bool:
    """vLLM's ``is_applicable_for_range``: whether some pass of ``pipeline`` runs on every
    token count of ``tokens`` (other skip reasons, e.g. no CUDA, are decided per graph)."""
    return any(c is None or c.holds_for(tokens) for c in constraints(pipeline).values())


def endpoints(pipeline: Pipeline, extra: Iterable[int] = ()) -> list[int]:
    """The ``compile_ranges_endpoints`` that give every pass a vLLM compile range where it
    applies: each constraint's bounds, plus ``extra`` (e.g. ``max_num_batched_tokens``)."""
    ends = set(extra)
    for c in constraints(pipeline).values():
        if c is not None:
            ends |= c.ends()
    return sorted(e for e in ends if e >= 1)


def range_notes(pipeline: Pipeline, tokens: TokenRange) -> list[str]:
    """Report notes for a compile of ``tokens``: passes skipped only because vLLM's range
    straddles their bounds (with the endpoints that would split it), and passkit config that
    vLLM's ranges replace."""
    notes = []
    straddled = {}
    for name, c in constraints(pipeline).items():
        if c is None or c.holds_for(tokens):
            continue
        inside = sorted(e for e in c.ends() if tokens.lo <= e < (tokens.hi or e + 1))
        if inside:
            straddled[name] = inside
    if straddled:
        cuts = sorted({e for ends in straddled.values() for e in ends})
        notes.append(
            f"{', '.join(straddled)} appl{'ies' if len(straddled) == 1 else 'y'} to part of this vLLM "
            f"range: add {cuts} to compilation_config.compile_ranges_endpoints to compile that part apart"
        )
    if pipeline.config.compile_ranges:
        notes.append(
            "passkit's compile_ranges is not used inside vLLM: vLLM's compile_ranges_endpoints "
            "decide the ranges"
        )
    return notes


def host_fusion_notes(pipeline: Pipeline, pass_config: Any, graph_ops: Iterable[str]) -> list[str]:
    """Say which of vLLM's own fusion and passkit's pass handles sites both could fuse.

    ``pass_config``: vLLM's ``PassConfig`` (or None); ``graph_ops``: the targets of the
    graph's call_function nodes as strings (``"vllm.flashinfer_...default"``)."""
    notes = []
    ops = list(graph_ops)
    for flag, (ours, op) in HOST_FUSIONS.items():
        enabled = bool(getattr(pass_config, flag, False))
        fused = sum(1 for target in ops if op in target)
        if enabled:
            did = f"fused {fused} site(s) into vllm.{op}" if fused else "fused no site"
            rest = f"; passkit's {ours} sees only the sites it left" if ours in pipeline.names() else ""
            notes.append(f"vLLM's own {flag} is enabled and ran before passkit: it {did}{rest}")
        elif ours in pipeline.names():
            notes.append(
                f"vLLM's {flag} is off: these sites are left to passkit's {ours} (its row says what it fused)"
            )
    return notes
