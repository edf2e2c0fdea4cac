"""The ``sequence_parallel`` pass: the residual stream between tensor-parallel layers is
sharded along tokens.

``all_reduce -> (add residual) -> RMSNorm -> column-parallel matmul`` becomes
``reduce_scatter -> add -> RMSNorm on this rank's 1/W of the tokens -> all_gather -> matmul``
(see :mod:`.rewrite`): the add and the norm do 1/W of the work, and the collectives are the
functional ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` along dim 0 of a 2-D
``[tokens, hidden]`` view, which torch's micro-pipeline TP matcher (the ``async_tp`` pass,
ordered after this one) can overlap with the neighbouring matmuls. Enable it by name::

    torch.compile(model, backend=passkit.backend(passes=["sequence_parallel", "cleanup"]))

Valid only when the token count is a multiple of the group size: the pass declares it as a
token constraint, so a compile with a dynamic token dimension gets a specialization with
the pass (multiples of W, from ``min_tokens``) and one without it (the other sizes).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pydantic
import torch
import torch.fx as fx

from passkit import CompileContext, GraphPass, PassResult, Requirements, Stage, TokenConstraint

from ..timeouts import TimeoutSeconds
from ..tuning import decisions

if TYPE_CHECKING:
    from ..patterns.sites import Rejection, Site
    from . import rewrite

# Registering the pass imports this module only: the matcher, the rewrite and the op are
# imported when the pass runs (see passkit_fusion.lazy_ops for the op at cache hits).
_PACKAGE = Path(__file__).resolve().parent.parent
NAME = "sequence_parallel"


class SequenceParallelOptions(pydantic.BaseModel):
    """Options of the ``sequence_parallel`` pass."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    min_tokens: int = pydantic.Field(4096, ge=1)
    """the smallest token count the pass rewrites. Sequence parallelism pays only with many tokens: with async_tp, the 8-layer Llama-8B stack at TP=2 on H200 was 0.94x Inductor at 1024 tokens and 1.02x at 2048-8192 (benchmarks/fusion_e2e.py), but the 2-layer HF Llama at TP=2 on H100 was 0.97x with CUDA graphs and 0.6x without at 2048 (benchmarks/hf_tp.py), so the default starts at 4096; allreduce_rmsnorm wins below"""
    max_tokens: int | None = pydantic.Field(None, ge=1)
    """the largest token count the pass rewrites (None: no bound)"""
    restrict_tokens: bool = True
    """apply min_tokens/max_tokens (compile the sizes outside apart, without the pass; static shapes outside are left alone); False: every token count that is a multiple of the group size"""

    collective_timeout_s: TimeoutSeconds = 180.0
    """how long a rank waits at the graph's first reduce-scatter for the others to agree on the plan (the sites, dtypes, groups and these options) before raising RankAgreementError naming the ranks missing or differing"""

    @pydantic.model_validator(mode="after")
    def _bounds(self) -> SequenceParallelOptions:
        if self.max_tokens is not None and self.max_tokens < self.min_tokens:
            raise ValueError(f"max_tokens={self.max_tokens} is below min_tokens={self.min_tokens}")
        return self


class SequenceParallel(decisions.Tunable, GraphPass):
    """Shard the residual stream along tokens: all-reduce + residual add + RMSNorm becomes
    reduce-scatter + add + RMSNorm on 1/W of the tokens + all-gather."""

    name = NAME
    stage = Stage.POST
    before = ("async_tp",)
    shares_sites_with = ("allreduce_rmsnorm",)
    """The same all-reduce + add + RMSNorm sites (the same matcher): where both apply, the
    one configured first takes them, and the other is left out of that token range."""
    Options = SequenceParallelOptions
    requires = Requirements(min_world_size=2)
    graph_kinds = ("inference",)
    skip_graph_kinds_reason = (
        "in training the forward graph outputs each residual sum for the backward graph at "
        "full size (sharding it would change what backward receives), and a backward graph "
        "holds no all-reduce -> RMSNorm site"
    )
    source_files = tuple(
        str(_PACKAGE / f)
        for f in (
            "patterns/sites.py",
            "patterns/isolation.py",
            "patterns/lead.py",
            "sequence_parallel/rewrite.py",
            "sequence_parallel/ops.py",
            "patterns/marks.py",
        )
    )

    options: SequenceParallelOptions

    def identity(self) -> dict[str, Any]:
        """The pass's identity plus the dialects it reads graphs with (third parties' too)."""
        from .. import dialects

        return {**super().identity(), "dialects": [d.identity() for d in dialects.registered()]}

    def token_constraint(self, ctx: CompileContext) -> TokenConstraint | None:
        """Multiples of the world size (a validity condition: every rank gets the same
        number of tokens), from ``min_tokens`` up to ``max_tokens`` unless
        ``restrict_tokens`` is off. Sites on a smaller tensor-parallel subgroup need
        multiples of its size, which a multiple of the world size is when the subgroup
        size divides the world size (checked per site). A measured or stored fuse decision
        for this graph replaces ``min_tokens``/``max_tokens`` unless they are set."""
        if ctx.world_size < 2:
            return None
        if (applied := self.decided(ctx, multiple_of=ctx.world_size)) is not None:
            return applied.constraint
        if not self.options.restrict_tokens:
            return TokenConstraint(multiple_of=ctx.world_size)
        first = -(-self.options.min_tokens // ctx.world_size) * ctx.world_size
        if self.options.max_tokens is not None and first > self.options.max_tokens:
            return None  # no multiple in range: skip_reason says so
        return TokenConstraint(
            min_tokens=self.options.min_tokens, max_tokens=self.options.max_tokens, multiple_of=ctx.world_size
        )

    def skip_reason(self, ctx: CompileContext) -> str | None:
        unmet = super().skip_reason(ctx) or self.nowhere_reason(ctx)
        if unmet:
            return unmet
        if self.decided(ctx) is not None:
            return None
        if self.options.restrict_tokens and self.token_constraint(ctx) is None:
            return (
                f"no multiple of the world size {ctx.world_size} in "
                f"{self.options.min_tokens}..{self.options.max_tokens}"
            )
        return None

    def run(self, gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
        from ..patterns.lost import warn_lost_sites
        from ..patterns.sites import (
            Rejection,
            check_rewritten,
            count_all_reduces,
            find_sites,
            host_fusion_note,
            schema_declined,
            warn_graph_ends,
        )
        from . import rewrite  # imports the token_shard op

        host = host_fusion_note(gm.graph)  # before the rewrite takes the host's ops out
        all_reduces = count_all_reduces(gm.graph)
        sites, rejected = find_sites(gm.graph, kernel_limits=False)
        symbol = rewrite.token_symbol(gm.graph)
        taken: list[Site] = []
        claimed: dict[fx.Node, Site] = {}  # node -> the site taking it: one norm is rewritten once
        for site in sites:
            problem = self._problem(site, ctx, symbol)
            if not problem and (other := next((claimed[n] for n in site.nodes if n in claimed), None)):
                problem = f"its nodes (the norm {other.out.name}) belong to another site already"
            if not problem and not ctx.may_rewrite(f"{self.name} at all-reduce {site.all_reduce.name}"):
                problem = "refused by bisect_limit (passkit bisect)"
            if not problem:
                claimed.update(dict.fromkeys(site.nodes, site))
            if problem:
                rejected.append(Rejection(site.all_reduce, problem))
            else:
                taken.append(site)
        outcome = rewrite.Outcome()
        if taken:
            plan, timeout = agreed_plan(taken, self.options), self.options.collective_timeout_s
            rewriter = rewrite.Rewriter(gm.graph, self.name, plan=plan, timeout_s=timeout)
            for site in taken:
                rewriter.site(site)
            rewriter.finish()
            outcome = rewriter.outcome
            # the report counts the graph: every site's and merged all-reduce must be gone
            rewritten = len(taken) + sum(len(s.merged) for s in taken)
            check_rewritten(self.name, all_reduces, count_all_reduces(gm.graph), rewritten)
        notes = summarize(taken, rejected, outcome)
        if not taken and not rejected:
            fused = len(gm.graph.find_nodes(op="call_function", target=_fused_op()))
            notes = [f"no all-reduce left: {fused} site(s) taken by allreduce_rmsnorm"] if fused else notes
        if ends := warn_graph_ends(self.name, rejected):
            notes.append(ends)
        if lost := warn_lost_sites(self.name, rejected):
            notes.append(lost)
        if host:
            notes.append(host)
        if decided := self.decision_note(ctx):
            notes.append(decided)
        if not taken and (declined := schema_declined(rejected)):
            return PassResult.declining(declined, notes)
        return PassResult(modified=bool(taken), matches=len(taken), notes=notes)

    def _problem(self, site: Site, ctx: CompileContext, symbol: object) -> str | None:
        """Why ``site`` cannot be rewritten in this compile, or None. Decided from the
        graph, the group's size and the compile's token range: the same on every rank."""
        from . import rewrite

        w = site.world_size
        if w < 2:
            return f"process group {site.group_name!r} has size {w}"
        count = rewrite.token_count(site)
        static = isinstance(count, int) or (isinstance(count, torch.SymInt) and count.node.expr.is_number)
        if static:
            count = int(count)
            if count % w:
                return f"{count} tokens: not a multiple of the group size {w}"
            lo, hi = self.options.min_tokens, self.options.max_tokens
            if self.options.restrict_tokens and (count < lo or (hi is not None and count > hi)):
                return f"{count} tokens: outside min_tokens..max_tokens ({lo}..{hi or ''})"
            return None
        span = ctx.token_range
        if span is None or span.multiple_of % w:
            served = f"this compile serves {span}" if span else "no token range"
            return (
                f"symbolic token count {count}: nothing guarantees multiples of {w} ({served}; "
                "compile with the passkit backend and a dynamic token dimension)"
            )
        if not rewrite.divisible_by_token_symbol(count, symbol):  # type: ignore[arg-type]
            return f"symbolic token count {count}: not a multiple of the token dimension {symbol}"
        return None


def _fused_op() -> object:
    from ..allreduce_rmsnorm import ops as fused_ops  # noqa: F401  (registers the allreduce_rmsnorm op)

    return torch.ops.passkit_fusion.allreduce_rmsnorm.default


def summarize(sites: list[Site], rejected: list[Rejection], outcome: rewrite.Outcome) -> list[str]:
    """Report notes: the sites taken and how their residuals were handled, the plan's
    fingerprint (compare it across ranks' logs), and why the others were rejected."""
    from ..patterns import notes as notes_patterns

    notes: list[str] = []
    if sites:
        notes.append(
            f"{len(sites)} site(s) -> reduce-scatter + RMSNorm on 1/{sites[0].world_size} of the tokens "
            f"+ all-gather: {outcome.sliced} residual(s) sliced (first), {outcome.sharded} already "
            f"sharded (middle), {outcome.no_residual} without residual; {outcome.gathered} sum(s) "
            f"gathered for other users (last); plan {plan_fingerprint(sites)}"
            + (f"; {outcome.shared} shared term(s) sliced" if outcome.shared else "")
            + (f"; {outcome.merged} all-reduce(s) merged into a site's" if outcome.merged else "")
            + (f"; {outcome.rerouted} matmul(s) re-routed to read the all-gather" if outcome.rerouted else "")
        )
        if layers := notes_patterns.per_layer(s.module for s in sites):
            notes.append(layers)
    if left := notes_patterns.rejected([r.reason for r in rejected]):
        notes.append(left)
    if not sites and not rejected:
        notes.append("no all-reduce in the graph")
    return notes


def plan_fingerprint(sites: list[Site]) -> str:
    plan = [
        [s.group_name, s.world_size, str(s.dtype), s.residual is not None, s.eps, s.weight_bias]
        for s in sites
    ]
    return hashlib.sha256(json.dumps(plan).encode()).hexdigest()[:8]


def agreed_plan(sites: list[Site], options: SequenceParallelOptions) -> str:
    """What every rank's rewrite of this graph must share (JSON), agreed at the first call
    before the first reduce-scatter: the sites (group, size, dtype, residual, norm) and the
    token options (a rank with other bounds takes other token counts apart)."""
    plan = {
        "sites": len(sites),
        "merged": sum(len(s.merged) for s in sites),
        "groups": sorted({f"{s.group_name}/{s.world_size}" for s in sites}),
        "fingerprint": plan_fingerprint(sites),
        "min_tokens": options.min_tokens,
        "max_tokens": options.max_tokens,
        "restrict_tokens": options.restrict_tokens,
    }
    return json.dumps(plan, sort_keys=True)
