"""passkit inside vLLM: one line adds a passkit pipeline to vLLM's post-grad pass manager.

::

    import passkit.hosts.vllm
    from vllm import LLM

    llm = LLM(model, compilation_config={"inductor_compile_config": {
        "post_grad_custom_post_pass": passkit.hosts.vllm.post_grad_pass(passes=["allreduce_rmsnorm"])}})

vLLM's ``PostGradPassManager`` runs its own passes, then the one object in
``inductor_compile_config["post_grad_custom_post_pass"]`` (which must be an instance of its
``InductorPass``), then lowers its IR ops. :func:`post_grad_pass` builds that object: a
:class:`passkit.hosts._vllm_pass.VllmPass` running a passkit :class:`~passkit.Pipeline`
(config from Python, ``PASSKIT_*``, ``passkit.toml``, ``[tool.passkit]`` as everywhere).

vLLM splits the token axis into compile ranges itself (``compile_ranges_endpoints``,
``compile_sizes``) and compiles each apart; the pass reads the range of the compile under
way from vLLM's pass context and runs the pipeline restricted to it (:func:`token_range`), so
passkit never splits ranges a second time: a pass whose token constraint does not hold on
the whole range is skipped, with the reason in the report. vLLM asks
``is_applicable_for_range`` first; the answer (:func:`applies`) is whether any enabled pass's
constraint holds there.

Nothing in this module imports vLLM: the ``InductorPass`` subclass lives in
``passkit.hosts._vllm_pass``, imported by :func:`post_grad_pass`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .. import logs
from ..config import Config
from ..context import CompileContext
from ..pipeline import Pipeline, build_pipeline
from ..tokens import TokenConstraint, TokenRange
from . import OnUnknown, check_version

if TYPE_CHECKING:
    from ._vllm_pass import VllmPass

HOST = "vllm"

HOST_FUSIONS: dict[str, tuple[str, str]] = {
    "fuse_allreduce_rms": ("allreduce_rmsnorm", "flashinfer_trtllm_fused_allreduce_norm"),
}
"""vLLM's own fusions of sites a passkit pass also fuses: ``PassConfig`` flag -> (the passkit
pass, the op vLLM's fusion leaves in the graph)."""


def post_grad_pass(
    config: Config | dict[str, Any] | None = None,
    *,
    on_unknown_version: OnUnknown = "warn",
    **overrides: Any,
) -> VllmPass:
    """The vLLM ``InductorPass`` running passkit's pipeline: put it in
    ``compilation_config["inductor_compile_config"]["post_grad_custom_post_pass"]``.

    ``config``/``overrides`` as for :func:`passkit.backend` (``passes=[...]``...). A vLLM
    version passkit was not tested with warns (``on_unknown_version="raise"``: a
    :class:`~passkit.hosts.HostError`) naming the found and supported versions.
    """
    version = check_version(HOST, on_unknown=on_unknown_version)
    logs.register_with_torch()
    try:
        from ._vllm_pass import VllmPass
    except ImportError as exc:
        from . import HostError

        raise HostError(
            f"passkit.hosts.vllm: vLLM {version} lacks an API the adapter needs ({exc}); "
            f"passkit supports the versions in passkit.hosts.HOSTS['vllm']"
        ) from None
    return VllmPass(build_pipeline(config, **overrides), version=version)


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
            notes.append(f"vLLM's {flag} is off: passkit's {ours} is the pass fusing these sites")
    return notes


__all__ = [
    "HOST",
    "HOST_FUSIONS",
    "applies",
    "constraints",
    "endpoints",
    "host_fusion_notes",
    "post_grad_pass",
    "range_label",
    "range_notes",
    "token_range",
]
