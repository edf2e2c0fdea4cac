"""The ``allreduce_overlap`` pass: overlap a row-parallel matmul's all-reduce with the
matmul itself, in token chunks.

At long prompts the all-reduce after a row-parallel matmul (attention's output projection,
the MLP's down projection) is a large transfer that the step waits for: on 2x H200, 75 us a
site at 2048 tokens and 250 us at 8192 for an 8B-shaped layer, 14-19% of a forward
(``benchmarks/results/hf_tp_profile_*``). The pass cuts the matmul along its rows (the
tokens) into ``chunks`` pieces and moves each piece to the other ranks as soon as it is
computed, while the next piece's matmul runs. Two transports:

* ``"copy_engine"`` (the default): the site becomes one op,
  ``passkit_fusion.matmul_all_reduce``, which has the copy engines push each chunk into the
  peers' symmetric memory beside the next chunk's matmul (no SMs taken from the GEMM), then
  adds the partials in rank order (:mod:`.runtime`);
* ``"nccl"``: the graph gets ``mm(a_0, b) -> all_reduce ; mm(a_1, b) -> all_reduce ; ... ;
  cat(wait_0, ...)``, NCCL's kernels beside the GEMM (measured slower on 2x H200: the two
  contend for SMs).

Every row is reduced exactly as before (the same sum of the same partial rows), so the
output is the same up to the matmul's own rounding on a smaller problem. Enable it by name,
before the passes that take the same all-reduces at other sizes::

    passkit.backend(passes=["allreduce_overlap", "allreduce_rmsnorm", "cleanup"])

It declares a token constraint (from ``min_tokens``; multiples of ``chunks`` with
``"nccl"``), so a compile with a dynamic token dimension gets a specialization with it and
the other sizes without; where it applies it takes the sites ``allreduce_rmsnorm`` and
``sequence_parallel`` would (the one first in the pipeline takes them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pydantic
import torch
import torch.fx as fx

from passkit import CompileContext, GraphPass, PassResult, Requirements, Stage, TokenConstraint

from ..timeouts import TimeoutSeconds
from ..tuning import decisions

_HERE = Path(__file__).resolve().parent
NAME = "allreduce_overlap"


class AllReduceOverlapOptions(pydantic.BaseModel):
    """Options of the ``allreduce_overlap`` pass."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    transport: Literal["copy_engine", "nccl"] = "copy_engine"
    """how each chunk reaches the other ranks: "copy_engine" (the copy engines push it into the peers' symmetric memory; CUDA only, elsewhere a functional all-reduce) or "nccl" (an all-reduce per chunk, NCCL's kernels beside the matmul)"""
    chunks: int = pydantic.Field(2, ge=2, le=16)
    """how many token chunks each matmul and its all-reduce are split into (the last chunk's all-reduce is not overlapped: more chunks hide more of it, each matmul is smaller)"""
    copy_lanes: int = pydantic.Field(1, ge=1, le=8)
    """with "copy_engine": how many streams push each chunk at once, each a slice of it (on 2x H200, 1-4 lanes measured alike: the slices ran one after another; each push is a node of the CUDA graph, which lengthens its launch)"""
    fuse_norm: bool = True
    """with "copy_engine": where the sum is followed by a residual add and an RMSNorm, the op takes them too (one kernel adds the ranks' partials in rank order, the residual, and normalises: the sum is never written and read back on its own)"""
    min_tokens: int = pydantic.Field(2048, ge=1)
    """the smallest token count the pass rewrites: below it the all-reduce is short and the fused all-reduce + RMSNorm op wins"""
    max_tokens: int | None = pydantic.Field(None, ge=1)
    """the largest token count the pass rewrites (None: no bound)"""
    restrict_tokens: bool = True
    """apply min_tokens/max_tokens (the sizes outside compile apart, without the pass); False: every size (every multiple of chunks with "nccl")"""
    collective_timeout_s: TimeoutSeconds = 180.0
    """the bound on the ranks' agreement when the copy-engine buffer is set up (a rank missing fails every rank instead of hanging)"""

    @pydantic.model_validator(mode="after")
    def _bounds(self) -> AllReduceOverlapOptions:
        if self.max_tokens is not None and self.max_tokens < self.min_tokens:
            raise ValueError(f"max_tokens={self.max_tokens} is below min_tokens={self.min_tokens}")
        return self


class AllReduceOverlap(decisions.Tunable, GraphPass):
    """Split each row-parallel matmul and its all-reduce into token chunks, each chunk's
    all-reduce overlapping the next chunk's matmul."""

    name = NAME
    stage = Stage.POST
    before = ("allreduce_rmsnorm", "sequence_parallel", "async_tp")
    shares_sites_with = ("allreduce_rmsnorm", "sequence_parallel")
    Options = AllReduceOverlapOptions
    requires = Requirements(min_world_size=2)
    graph_kinds = ("inference",)
    skip_graph_kinds_reason = "the chunked sums are not what a training graph saves for its backward"
    source_files = (
        *(str(_HERE / f) for f in ("pass_.py", "rewrite.py", "ops.py", "runtime.py", "triton_kernel.py")),
        *(
            str(_HERE.parent / "patterns" / f)
            for f in ("marks.py", "sites.py", "isolation.py", "lead.py", "rmsnorm.py", "graph.py")
        ),
    )

    options: AllReduceOverlapOptions

    def token_constraint(self, ctx: CompileContext) -> TokenConstraint | None:
        """``min_tokens`` to ``max_tokens`` (in multiples of ``chunks`` with ``"nccl"``,
        whose split wants equal chunks; the copy-engine op cuts any row count itself); a
        measured or stored fuse decision for this graph (``passkit tune-model``) replaces
        the bounds unless they are set."""
        multiple = self.options.chunks if self.options.transport == "nccl" else 1
        if (applied := self.decided(ctx, multiple_of=multiple)) is not None:
            return applied.constraint
        if not self.options.restrict_tokens:
            return TokenConstraint(multiple_of=multiple) if multiple > 1 else None
        return TokenConstraint(
            min_tokens=self.options.min_tokens, max_tokens=self.options.max_tokens, multiple_of=multiple
        )

    def skip_reason(self, ctx: CompileContext) -> str | None:
        return super().skip_reason(ctx) or self.nowhere_reason(ctx)

    def run(self, gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
        from .rewrite import Rewriter, find

        opts = self.options
        notes: list[str] = []
        if not gm.graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.all_reduce.default):
            return PassResult(modified=False, matches=0, notes=["no functional all-reduce in the graph"])
        rewriter = Rewriter(
            gm.graph, self.name, opts.chunks, opts.max_tokens or 0, opts.collective_timeout_s, opts.copy_lanes
        )
        with_norm = self._fuse_norm_sites(gm.graph, rewriter, notes) if self._norm_fused() else 0
        sites, reasons = find(gm.graph)
        if sites:
            rewrite = rewriter.fuse if opts.transport == "copy_engine" else rewriter.split
            for site in sites:
                rewrite(site)
            how = "one copy-engine op each" if opts.transport == "copy_engine" else "NCCL all-reduces"
            notes.append(
                f"{len(sites)} matmul + all-reduce site(s) split into {opts.chunks} token chunks ({how}): "
                + ", ".join(s.all_reduce.name for s in sites)
            )
        if reasons:
            notes.append(f"{len(reasons)} all-reduce(s) left: " + ", ".join(reasons))
        if decided := self.decision_note(ctx):
            notes.append(decided)
        matches = len(sites) + with_norm
        return PassResult(modified=bool(matches), matches=matches, notes=notes)

    def _norm_fused(self) -> bool:
        return self.options.transport == "copy_engine" and self.options.fuse_norm

    def _fuse_norm_sites(self, graph: fx.Graph, rewriter: Any, notes: list[str]) -> int:
        """Rewrite the ``mm -> all_reduce -> add residual -> RMSNorm`` sites into
        ``matmul_all_reduce_rmsnorm``; their count. The other all-reduces are left to the
        plain ``mm -> all_reduce`` rewrite (a site this one declines too, with the reason)."""
        from ..patterns.isolation import rewrite_or_decline
        from ..patterns.sites import Site as NormSite
        from ..patterns.sites import candidates
        from .rewrite import norm_site_matmul

        fused: list[str] = []
        plain: list[str] = []
        for found in candidates(graph, kernel_limits=False):
            if not isinstance(found, NormSite):
                continue
            matmul = norm_site_matmul(found)
            if matmul is None:
                continue
            if isinstance(matmul, str):
                plain.append(f"{found.all_reduce.name} ({matmul})")
                continue
            outcome = rewrite_or_decline(
                graph,
                (*found.nodes, matmul[0], *matmul[1]),
                lambda found=found, matmul=matmul: rewriter.fuse_norm(found, *matmul),
                self.name,
                found.all_reduce.name,
            )
            if isinstance(outcome, str):
                plain.append(f"{found.all_reduce.name} ({outcome})")
                continue
            fused.append(f"{found.all_reduce.name} -> {found.module or found.out.name}")
        if fused:
            notes.append(
                f"{len(fused)} matmul + all-reduce + residual add + RMSNorm site(s) into {self.options.chunks} "
                "token chunks (one copy-engine op with the norm each): " + ", ".join(fused)
            )
        if plain:
            notes.append("norm sites left to the plain rewrite: " + ", ".join(plain))
        return len(fused)
