"""The ``allreduce_layernorm`` pass: all-reduce -> (add residual) -> LayerNorm becomes one op.

**It pays**: the GPU benchmark (``benchmarks/allreduce_layernorm.py``) measured the fused op at
1.14-1.57x Inductor's all-reduce + add + LayerNorm at 1 to 256 tokens at TP=2 on 2x H200
(the gate: >= 1.05x). TP=4, H100 and whole models next to ``sequence_parallel`` are not
measured, so it is in no serving config of the docs. Enable it by name for LayerNorm models::

    torch.compile(model, backend=passkit.backend(passes=["allreduce_layernorm", "cleanup"]))

Every site the shared matcher (:mod:`passkit_fusion.patterns.sites`, ``norm="layer"``)
finds, all-reduce -> views/constant scales -> residual add(s) -> LayerNorm (``nn.LayerNorm``,
``F.layer_norm``, Hugging Face LayerNorm modules: weight, optional bias), is replaced by
one call of ``torch.ops.passkit_fusion.allreduce_add_layernorm`` returning ``(norm_out,
residual_out)``: the norm's users read ``norm_out``, every other user of the sum (the next
layer's residual, a second LayerNorm of a parallel-residual block) reads ``residual_out``.
Sites ending in an RMSNorm are ``allreduce_rmsnorm``'s and are reported as such.

With ``implementation="auto"`` (default) the pass writes the symmetric-memory op into a CUDA
graph whose torch has the one-shot all-reduce (and, with ``norm_kernel="triton"``, where
Triton is importable; else it skips, with a warning naming the fix), and the reference op
(its torch implementation: the same values, not faster) into a graph on any other device,
said once per process (:mod:`passkit_fusion.implementation`). ``"reference"`` writes the
reference op on every device (tests, CPU runs); ``"symm_mem"`` only the symmetric-memory one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import operator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pydantic
import torch
import torch.fx as fx

from passkit import CompileContext, GraphPass, PassResult, Requirements, Stage

from .. import implementation

if TYPE_CHECKING:
    from ..patterns.sites import Rejection, Site

_PACKAGE = Path(__file__).resolve().parent.parent
_ADVICE = "set implementation='reference' to run the reference op"
DEFAULT_MAX_BYTES = 4 * 2**20  # the op's (ops.DEFAULT_MAX_BYTES), without importing it here


class AllReduceLayerNormOptions(pydantic.BaseModel):
    """Options of the ``allreduce_layernorm`` pass."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    implementation: Literal["auto", "symm_mem", "reference"] = "auto"
    """auto: symmetric memory + Triton on a CUDA graph (skipped, with a warning, where unavailable), the reference op on any other device; symm_mem: symmetric memory on CUDA only; reference: the torch op, any device"""
    norm_kernel: Literal["triton", "torch"] = "triton"
    """after the one-shot all-reduce: residual add + LayerNorm in one Triton kernel, or in torch ops (torch.add + F.layer_norm)"""
    max_bytes: int = pydantic.Field(DEFAULT_MAX_BYTES, ge=1)
    """largest message (bytes of the all-reduce input) taking the one-shot symmetric-memory path, and the size of its buffer; larger calls run NCCL's all-reduce + add + LayerNorm"""


class AllReduceLayerNorm(GraphPass):
    """Fuse all-reduce (sum) + optional residual add + LayerNorm into one op.

    The op runs torch's symmetric-memory one-shot all-reduce and a Triton residual add +
    LayerNorm kernel on CUDA, ``torch.ops.passkit_fusion.allreduce_add_layernorm``. Measured to pay on 2x H200 (the
    gate: >= 1.05x Inductor at every token count 1-256, TP=2): 1.14-1.57x at hidden 4096 and
    8192 (``benchmarks/allreduce_layernorm.py``)."""

    name = "allreduce_layernorm"
    stage = Stage.POST
    Options = AllReduceLayerNormOptions
    requires = Requirements(min_world_size=2)
    environment_modules = ("triton",)  # its skip reads it: part of the cache identity
    source_files = tuple(
        str(_PACKAGE / f)
        for f in (
            "patterns/sites.py",
            "patterns/isolation.py",
            "patterns/lead.py",
            "patterns/layernorm.py",
            "patterns/rmsnorm.py",
            "patterns/graph.py",
            "allreduce_layernorm/ops.py",
            "allreduce_layernorm/pass_.py",
        )
    )

    options: AllReduceLayerNormOptions

    def identity(self) -> dict[str, Any]:
        from .. import dialects

        return {**super().identity(), "dialects": [d.identity() for d in dialects.registered()]}

    def skip_reason(self, ctx: CompileContext) -> str | None:
        if ctx.world_size > 1:  # at backend entry on every rank, cache hit or not
            from ..collective import publish_host

            publish_host()
        unmet = super().skip_reason(ctx)
        if unmet or self.impl_for(ctx.device) == "reference":
            return unmet
        if ctx.device != "cuda":
            return (
                f"the symmetric-memory all-reduce needs CUDA tensors (graph is on {ctx.device}) — {_ADVICE}"
            )
        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
            return f"torch {torch.__version__} has no torch.ops.symm_mem.one_shot_all_reduce_copy_out — {_ADVICE}"
        if self.options.norm_kernel == "triton" and importlib.util.find_spec("triton") is None:
            return "triton is not installed — set norm_kernel='torch' (torch.add + F.layer_norm) or implementation='reference'"
        return None

    def impl_for(self, device: str | None) -> str:
        """The op implementation this pass writes into a graph on ``device``."""
        return implementation.for_device(self.options.implementation, device, "symm_mem")

    def run(self, gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
        from ..patterns.isolation import rewrite_or_decline
        from ..patterns.lost import warn_lost_sites
        from ..patterns.sites import (
            LAYER,
            Rejection,
            Site,
            candidates,
            check_rewritten,
            count_all_reduces,
            schema_declined,
            warn_graph_ends,
        )
        from . import ops  # noqa: F401  (defines the op the rewrite writes)

        impl = self.impl_for(ctx.device)
        implementation.say_chosen(
            self.name, self.options.implementation, impl, ctx.device, "the symmetric-memory all-reduce"
        )
        all_reduces = count_all_reduces(gm.graph)
        position = {node: float(i) for i, node in enumerate(gm.graph.nodes)}
        sites: list[Site] = []
        rejected: list[Rejection] = []
        needs_sort = False
        multi_host = _groups_across_hosts(gm.graph)
        for found in candidates(gm.graph, norm=LAYER):
            if isinstance(found, Site) and found.group_name in multi_host:
                found = Rejection(found.all_reduce, multi_host[found.group_name])
            if isinstance(found, Rejection):
                rejected.append(found)
                continue
            outcome = rewrite_or_decline(
                gm.graph,
                found.nodes,
                lambda found=found: self._replace(gm.graph, found, position, impl),
                self.name,
                found.all_reduce.name,
            )
            if isinstance(outcome, str):  # failed before changing the graph: declined
                rejected.append(Rejection(found.all_reduce, outcome))
                continue
            needs_sort |= outcome
            sites.append(found)
        if needs_sort:
            from torch._inductor.pattern_matcher import stable_topological_sort

            stable_topological_sort(gm.graph)
        if sites:
            rewritten = len(sites) + sum(len(s.merged) for s in sites)
            check_rewritten(self.name, all_reduces, count_all_reduces(gm.graph), rewritten)
        notes = summarize(sites, rejected, impl)
        if not sites and not rejected:
            from ..patterns.marks import taken_note

            notes = [taken_note(gm.graph) or notes[0]]
        if ends := warn_graph_ends(self.name, rejected):
            notes.append(ends)
        if lost := warn_lost_sites(self.name, rejected):
            notes.append(lost)
        if not sites and (declined := schema_declined(rejected)):
            return PassResult.declining(declined, notes)
        return PassResult(modified=bool(sites), matches=len(sites), notes=notes)

    def _replace(self, graph: fx.Graph, site: Site, position: dict[fx.Node, float], impl: str) -> bool:
        """Swap ``site`` for the fused op; True when the graph needs a topological sort."""
        from ..allreduce_rmsnorm.pass_ import _fake_call, _fused_inputs

        anchor, needs_sort = _insertion_point(site, position)
        op = torch.ops.passkit_fusion.allreduce_add_layernorm.default
        with graph.inserting_before(anchor):
            x, residual, inserted = _fused_inputs(graph, site)
            for i, node in enumerate(inserted):
                position[node] = position[anchor] - 0.9 + 0.4 * i / len(inserted)
            args = (
                x, residual, site.weight, site.bias, site.eps, site.group_name, impl,
                self.options.norm_kernel, self.options.max_bytes,
            )  # fmt: skip
            fused = graph.call_function(op, args)
            outputs = [graph.call_function(operator.getitem, (fused, i)) for i in range(2)]
        for offset, node in zip((0.3, 0.2, 0.1), (fused, *outputs)):
            position[node] = position[anchor] - offset
        vals = _fake_call(op, args)
        fused.meta.update(val=vals, stack_trace=site.out.meta.get("stack_trace"))
        for node, value in zip(outputs, vals):  # type: ignore[call-overload]
            node.meta["val"] = value
        from ..patterns.sites import rebind_outputs

        norm_out, residual_out = outputs
        rebind_outputs(graph, site, norm_out, residual_out, position.__getitem__, new=outputs)
        return needs_sort


def _insertion_point(site: Site, position: dict[fx.Node, float]) -> tuple[fx.Node, bool]:
    """At the sum when every input is defined by then; else after the last input (and the
    graph is sorted afterwards): :func:`passkit_fusion.allreduce_rmsnorm.pass_._insertion_point`
    with the LayerNorm's bias among the inputs."""
    inputs = [
        n
        for n in (
            site.x,
            site.residual,
            site.weight,
            site.bias,
            *site.shared,
            *(m.x for m in site.merged),
            *(a for m in site.merged for v in m.views for a in v.all_input_nodes),  # gates, biases
        )
        if n is not None
    ]
    last_input = max(position[n] for n in inputs)
    anchor = site.total if site.total is not None else site.out
    if last_input < position[anchor]:
        return anchor, False
    return next(n for n in sorted(site.nodes, key=position.__getitem__) if position[n] > last_input), True


def _groups_across_hosts(graph: fx.Graph) -> dict[str, str]:
    """The all-reduce groups of ``graph`` whose ranks span hosts (symmetric memory maps peer
    GPUs' memory: one host only), with the reason; the reference op declines too."""
    from ..collective import spans_hosts

    names = sorted(
        {
            str(node.args[2])
            for node in graph.find_nodes(
                op="call_function", target=torch.ops._c10d_functional.all_reduce.default
            )
        }
    )
    return {
        name: reason
        for name in names
        if (reason := spans_hosts(name, "symmetric memory (allreduce_layernorm)"))
    }


def summarize(sites: list[Site], rejected: list[Rejection], impl: str) -> list[str]:
    """Report notes: sites with/without residual and bias, per layer, the plan fingerprint,
    the reasons candidates were rejected."""
    from ..allreduce_rmsnorm.pass_ import _dialects
    from ..patterns import notes as notes_patterns

    notes: list[str] = []
    if sites:
        with_res = sum(1 for s in sites if s.residual is not None)
        with_bias = sum(1 for s in sites if s.bias is not None)
        plain = sum(1 for s in sites if s.weight is None)
        merged = sum(len(s.merged) for s in sites)
        summed = (
            f"; {merged} all-reduce(s) merged into a site's (AR(a) + AR(b) = AR(a + b))" if merged else ""
        )
        notes.append(
            f"{len(sites)} LayerNorm site(s) -> {impl} op: {with_res} with residual, "
            f"{len(sites) - with_res} without; {with_bias} with bias"
            + (f", {plain} without weight" if plain else "")
            + f"{_dialects(sites)}; "
            f"plan {plan_fingerprint(sites)}{summed}"
        )
        if layers := notes_patterns.per_layer(s.module for s in sites):
            notes.append(layers)
    if left := notes_patterns.rejected([r.reason for r in rejected]):
        notes.append(left)
    if not sites and not rejected:
        notes.append("no all-reduce in the graph")
    return notes


def plan_fingerprint(sites: list[Site]) -> str:
    """A short hash of what was fused, identical on every rank that fused the same graph."""
    plan = [
        [
            s.group_name,
            s.world_size,
            s.hidden,
            str(s.dtype),
            s.residual is not None,
            s.weight is not None,
            s.bias is not None,
            s.eps,
        ]
        + ([len(s.merged)] if s.merged else [])
        for s in sites
    ]
    return hashlib.sha256(json.dumps(plan).encode()).hexdigest()[:8]
