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
from typing import Literal

import pydantic
import torch.fx as fx

from passkit import CompileContext, GraphPass, PassResult, Requirements, Stage, TokenConstraint

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
    copy_lanes: int = pydantic.Field(2, ge=1, le=8)
    """with "copy_engine": how many streams push each chunk at once, each a slice of it (on 2x H200, 1-4 lanes measured alike)"""
    min_tokens: int = pydantic.Field(2048, ge=1)
    """the smallest token count the pass rewrites: below it the all-reduce is short and the fused all-reduce + RMSNorm op wins"""
    max_tokens: int | None = pydantic.Field(None, ge=1)
    """the largest token count the pass rewrites (None: no bound)"""
    restrict_tokens: bool = True
    """apply min_tokens/max_tokens (the sizes outside compile apart, without the pass); False: every size (every multiple of chunks with "nccl")"""
    collective_timeout_s: float = pydantic.Field(180.0, gt=0)
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
        str(_HERE / "pass_.py"),
        str(_HERE / "rewrite.py"),
        str(_HERE / "ops.py"),
        str(_HERE / "runtime.py"),
        str(_HERE.parent / "patterns/marks.py"),
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

        sites, reasons = find(gm.graph)
        notes: list[str] = []
        opts = self.options
        if sites:
            rewriter = Rewriter(
                gm.graph,
                self.name,
                opts.chunks,
                opts.max_tokens or 0,
                opts.collective_timeout_s,
                opts.copy_lanes,
            )
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
        if not sites and not reasons:
            notes.append("no functional all-reduce in the graph")
        if decided := self.decision_note(ctx):
            notes.append(decided)
        return PassResult(modified=bool(sites), matches=len(sites), notes=notes)
