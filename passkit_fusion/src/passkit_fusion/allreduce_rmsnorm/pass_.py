"""The ``allreduce_rmsnorm`` pass: all-reduce -> (add residual) -> RMSNorm becomes one op.

Every site :mod:`passkit_fusion.patterns.sites` finds (in any host dialect) is replaced by one call of
``torch.ops.passkit_fusion.allreduce_rmsnorm`` returning ``(norm_out, residual_out)``: the
norm's users read ``norm_out``, every other user of the sum (or of the all-reduce result,
without a residual) reads ``residual_out``. Enable it by name::

    torch.compile(model, backend=passkit.backend(passes=[
        {"name": "allreduce_rmsnorm", "implementation": "reference"}, "cleanup"]))

With ``implementation="auto"`` (the default) the pass writes the op each graph's device can
run: flashinfer's kernel for a CUDA graph (where flashinfer is importable; without it the
pass skips, with a warning naming the fix), the reference op (its torch implementation:
the same values, not faster) for a graph on any other device, said once per process.
``"reference"`` writes the reference op on every device (tests, demos, CPU runs);
``"flashinfer"`` only flashinfer's, skipping elsewhere.

With ``fuse_fp8_quant`` (the default), a site whose norm output is quantized to
``float8_e4m3fn`` with a static per-tensor scale (FP8 checkpoints: the quantization before
the next ``torch._scaled_mm``) becomes one call of
``torch.ops.passkit_fusion.allreduce_rmsnorm_fp8`` returning ``(quant_out, norm_out,
residual_out)``: the quantization's users read ``quant_out``, other users of the norm
output (if any) read ``norm_out``, which the kernel then writes too.

An RMSNorm without a weight (nanochat's: no learnable scale) is fused too: the ops (and
flashinfer's kernels) take a weight, so the rewrite passes a ones weight of the hidden size
in the activations' dtype, created in the graph (``aten.ones``): the same value, as
``x * 1`` is exact.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import operator
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pydantic
import torch
import torch.fx as fx

from passkit import CompileContext, GraphPass, PassResult, Requirements, Stage, TokenConstraint

from .. import implementation
from ..tuning import decisions

if TYPE_CHECKING:
    from ..patterns.sites import Rejection, Site

# Registering the pass imports this module only: the matcher (``patterns``), the op
# (``ops``), the tables and the collective helpers are imported where they are used, when
# the pass is enabled and can run (see passkit_fusion.lazy_ops for the op at cache hits).
_PACKAGE = Path(__file__).resolve().parent.parent
_ADVICE = "set implementation='reference' to run the reference op"


class AllReduceRMSNormOptions(pydantic.BaseModel):
    """Options of the ``allreduce_rmsnorm`` pass."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    implementation: Literal["auto", "flashinfer", "reference"] = "auto"
    """auto: flashinfer on a CUDA graph (skipped, with a warning, without flashinfer), the reference op on any other device; flashinfer: flashinfer on CUDA only; reference: the torch op, any device"""
    max_tokens: int | None = pydantic.Field(None, ge=1)
    """the largest token count the pass fuses (and the flashinfer workspace's capacity); None: the largest the tuned table fuses for this GPU, world size and dtype (the workspace capped at 64 MiB of input)"""
    restrict_tokens: bool = True
    """compile apart the token counts above max_tokens and leave them to Inductor (token-range specialization); False: one compile for every size, the op falls back to the unfused path above its workspace"""
    check_rank_consistency: bool = True
    """the runtime compares its plan across ranks before the first fused call"""
    fuse_fp8_quant: bool = True
    """also fuse a static per-tensor float8_e4m3fn quantization of the norm output (flashinfer's FP8 patterns); the bf16/fp16 norm output is still written when something else reads it"""


class AllReduceRMSNorm(decisions.Tunable, GraphPass):
    """Fuse all-reduce (sum) + optional residual add + RMSNorm into one flashinfer kernel.

    The kernel is flashinfer's ``allreduce_fusion`` with pattern ``kARResidualRMSNorm``,
    reached through ``torch.ops.passkit_fusion.allreduce_rmsnorm``."""

    name = "allreduce_rmsnorm"
    stage = Stage.POST
    Options = AllReduceRMSNormOptions
    requires = Requirements(min_world_size=2)
    environment_modules = ("flashinfer",)  # its skip reads it: part of the cache identity
    graph_kinds = ("inference",)
    skip_graph_kinds_reason = (
        "in training the forward graph outputs each residual sum and norm input for the "
        "backward graph, so no site can fuse, and a backward graph holds no all-reduce -> "
        "RMSNorm site (measured on a TP TinyLlama: 0 of 5 forward sites)"
    )
    source_files = tuple(
        str(_PACKAGE / f)
        for f in (
            "patterns/sites.py",
            "patterns/isolation.py",
            "patterns/lead.py",
            "allreduce_rmsnorm/ops.py",
            "patterns/rmsnorm.py",
            "patterns/fp8.py",
            "patterns/graph.py",
        )
    )

    options: AllReduceRMSNormOptions

    def identity(self) -> dict[str, Any]:
        """The pass's identity plus the dialects it reads graphs with (third parties' too)."""
        from .. import dialects

        return {**super().identity(), "dialects": [d.identity() for d in dialects.registered()]}

    def token_constraint(self, ctx: CompileContext) -> TokenConstraint | None:
        """Token counts up to ``max_tokens``, else up to the largest the tuned table fuses
        on this GPU at this world size and dtype (on a GPU the table does not hold, the
        conservative rule's bound): there the fused kernel beats NCCL + Inductor's
        add+RMSNorm; above, the sizes compile without the pass. The hidden size
        is not known before the graph is seen, so the bound is the largest over the
        table's hidden sizes (per hidden size, the op's table still decides per call).
        A measured or stored fuse decision for this graph (:mod:`..tuning.decisions`)
        replaces the table's bound unless ``max_tokens`` is set."""
        if (applied := self.decided(ctx)) is not None:
            return applied.constraint
        if not self.options.restrict_tokens:
            return None
        if self.options.max_tokens is not None:
            return TokenConstraint(max_tokens=self.options.max_tokens)
        if self.impl_for(ctx.device) != "flashinfer" or ctx.device != "cuda" or ctx.dtype is None:
            return None
        from ..tuning import tables

        bound = tables.default_table().planned_bound(torch.cuda.get_device_name(), ctx.world_size, ctx.dtype)
        return TokenConstraint(max_tokens=bound) if bound else None

    def skip_reason(self, ctx: CompileContext) -> str | None:
        if ctx.world_size > 1:  # at backend entry on every rank, cache hit or not
            from ..collective import publish_host

            publish_host()
        unmet = super().skip_reason(ctx) or self.nowhere_reason(ctx)
        if unmet or self.impl_for(ctx.device) == "reference":
            return unmet
        if ctx.device != "cuda":
            return f"flashinfer's fused kernel needs CUDA tensors (graph is on {ctx.device}) — {_ADVICE}"
        if importlib.util.find_spec("flashinfer") is None:
            return f"flashinfer is not installed (pip install passkit-fusion[flashinfer]) — {_ADVICE}"
        return None

    def impl_for(self, device: str | None) -> str:
        """The op implementation this pass writes into a graph on ``device``: ``auto`` is
        flashinfer's on CUDA and the reference op elsewhere (the only one that runs there)."""
        return implementation.for_device(self.options.implementation, device, "flashinfer")

    def run(self, gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
        from ..patterns.isolation import rewrite_or_decline
        from ..patterns.lost import warn_lost_sites
        from ..patterns.sites import (
            Rejection,
            Site,
            candidates,
            check_rewritten,
            count_all_reduces,
            host_fusion_note,
            schema_declined,
            warn_graph_ends,
        )
        from . import ops  # noqa: F401  (defines the ops the rewrite writes)

        impl = self.impl_for(ctx.device)
        implementation.say_chosen(
            self.name, self.options.implementation, impl, ctx.device, "flashinfer's kernel"
        )
        host = host_fusion_note(gm.graph)  # before the rewrite takes the host's ops out
        all_reduces = count_all_reduces(gm.graph)
        position = {node: float(i) for i, node in enumerate(gm.graph.nodes)}
        sites: list[Site] = []
        rejected: list[Rejection] = []
        needs_sort = False
        multi_host = _groups_across_hosts(gm.graph)
        for found in candidates(gm.graph, fp8=self.options.fuse_fp8_quant):
            if isinstance(found, Site) and found.group_name in multi_host:
                found = Rejection(found.all_reduce, multi_host[found.group_name])
            if isinstance(found, Site) and (unprofitable := self._never_pays(found, impl)):
                found = Rejection(found.all_reduce, unprofitable)
            if isinstance(found, Rejection):
                rejected.append(found)
                continue
            outcome = rewrite_or_decline(
                gm.graph,
                (*found.nodes, *(found.quant.nodes if found.quant else ())),
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
        if sites:  # the report counts the graph: every site and merged all-reduce must be gone
            rewritten = len(sites) + sum(len(s.merged) for s in sites)
            check_rewritten(self.name, all_reduces, count_all_reduces(gm.graph), rewritten)
        notes = summarize(sites, rejected, impl)
        if not sites and not rejected:  # another pass (sequence_parallel) may have taken them
            from ..patterns.marks import taken_note

            notes = [taken_note(gm.graph) or notes[0]]
        if ends := warn_graph_ends(self.name, rejected):
            notes.append(ends)
        if lost := warn_lost_sites(self.name, rejected):
            notes.append(lost)
        if host:
            notes.append(host)
            if not sites and host.startswith("host already fused"):
                from ..patterns.notes import say_host_fused

                say_host_fused(self.name, host.split("; ")[0])
        if decided := self.decision_note(ctx):
            notes.append(decided)
        if not sites and (declined := schema_declined(rejected)):
            return PassResult.declining(declined, notes)
        return PassResult(modified=bool(sites), matches=len(sites), notes=notes)

    def _never_pays(self, site: Site, impl: str) -> str | None:
        """Why fusing ``site`` can never pay on this GPU, or None.

        The fused op picks fused or unfused per call from the tuned table; when the table
        has no fused rule at all for this GPU, world size, hidden size and dtype, every
        call would take the op's unfused fallback, slower than what Inductor generates for
        the unfused graph. Then the site is left alone. A graph-level and device-model fact,
        the same on every rank of a homogeneous group.
        """
        if impl != "flashinfer":
            return None
        from ..tuning import tables

        device = site.x.meta["val"].device
        gpu = torch.cuda.get_device_name(device)
        rules = tables.default_table().resolve(gpu, site.world_size, site.hidden, site.dtype)
        if any(rule.decision.use_fused for rule in rules):
            return None
        return (
            f"no tuned table fuses {gpu} x{site.world_size}, hidden {site.hidden}, "
            f"{str(site.dtype).removeprefix('torch.')} (run `passkit tune` to measure one)"
        )

    def _replace(self, graph: fx.Graph, site: Site, position: dict[fx.Node, float], impl: str) -> bool:
        """Swap ``site`` for the fused op; True when the graph needs a topological sort.

        ``position`` orders the graph's nodes; the new nodes get positions just before
        their anchor, so later sites can order them too."""
        quant = site.quant
        need_norm_out = site.need_norm_out
        anchor, needs_sort = _insertion_point(site, position)
        with graph.inserting_before(anchor):
            x, residual, inserted = _fused_inputs(graph, site)
            for i, node in enumerate(inserted):  # the lead's copies, the residual's sum
                position[node] = position[anchor] - 0.9 + 0.4 * i / len(inserted)
            weight = site.weight
            if weight is None:  # a norm without a weight: the op's weight is ones
                weight = ones_weight(graph, site)
                position[weight] = position[anchor] - 0.45
            scale: fx.Node | None = None
            if quant is not None:
                scale = quant.scale
                if quant.inverse:  # the graph multiplies by 1/scale: hand the kernel the scale
                    scale = graph.call_function(torch.ops.aten.reciprocal.default, (quant.scale,))
                    scale.meta["val"] = _fake_call(torch.ops.aten.reciprocal.default, (quant.scale,))
                    position[scale] = position[anchor] - 0.5
                op = torch.ops.passkit_fusion.allreduce_rmsnorm_fp8.default
                args: tuple[object, ...] = (
                    x, residual, weight, site.eps, site.weight_bias, scale,
                    site.group_name, impl, need_norm_out,
                    self.options.max_tokens, self.options.check_rank_consistency,
                )  # fmt: skip
            else:
                op = torch.ops.passkit_fusion.allreduce_rmsnorm.default
                args = (
                    x, residual, weight, site.eps, site.weight_bias, site.group_name,
                    impl, self.options.max_tokens, self.options.check_rank_consistency,
                )  # fmt: skip
            fused = graph.call_function(op, args)
            outputs = [graph.call_function(operator.getitem, (fused, i)) for i in range(3 if quant else 2)]
        for offset, node in zip((0.4, 0.3, 0.2, 0.1), (fused, *outputs)):
            position[node] = position[anchor] - offset
        vals = _fake_call(op, args)
        fused.meta.update(val=vals, stack_trace=site.out.meta.get("stack_trace"))
        for node, value in zip(outputs, vals):
            node.meta["val"] = value
        from ..patterns.sites import rebind_outputs

        taken = (*site.nodes, *quant.nodes) if quant is not None else site.nodes
        if quant is not None:
            quant_out, norm_out, residual_out = outputs
            quant.out.replace_all_uses_with(quant_out)
        else:
            norm_out, residual_out = outputs
        rebind_outputs(
            graph, site, norm_out if need_norm_out else None, residual_out, position.__getitem__,
            inside=taken, replaced=taken, new=outputs,  # an empty norm_out goes
        )  # fmt: skip
        return needs_sort


def _groups_across_hosts(graph: fx.Graph) -> dict[str, str]:
    """The all-reduce groups of ``graph`` whose ranks are on more than one host, with the
    reason (flashinfer's IPC workspaces map peer GPUs' memory: one host only). Decided from
    the host list the group's ranks exchange (the same on every rank; see
    :mod:`passkit_fusion.collective.hosts`); the reference op declines too, as it stands in
    for flashinfer's."""
    from ..collective import spans_hosts

    names = sorted(
        {
            str(node.args[2])
            for node in graph.find_nodes(
                op="call_function", target=torch.ops._c10d_functional.all_reduce.default
            )
        }
    )
    out = {}
    for name in names:
        if reason := spans_hosts(name, "flashinfer's IPC workspaces (allreduce_rmsnorm)"):
            out[name] = reason
    return out


def _fused_inputs(graph: fx.Graph, site: Site) -> tuple[fx.Node, fx.Node | None, list[fx.Node]]:
    """The fused op's input and residual, inserted at the graph's insertion point: the
    all-reduce input with the site's lead applied (the all-reduce is linear: a constant
    scale moves before it, a view keeping the hidden dim commutes with it), and the
    residual with the shared terms (and the merged all-reduces' row-parallel biases) added
    first (``AR + (s + residual)``); then the nodes inserted, in order."""
    from ..patterns.lead import replay_lead

    before = set(graph.nodes)
    x = replay_lead(graph, (*site.lead, *site.chain_views), site.result, site.x)  # type: ignore[arg-type]
    for merged in site.merged:  # AR(a) + AR(b) = AR(a + b)
        lead = (*merged.views, *merged.after)
        other = replay_lead(graph, lead, merged.result, merged.x, identity=merged.bias_adds)
        x = graph.call_function(torch.ops.aten.add.Tensor, (x, other))
        x.meta["val"] = _fake_call(torch.ops.aten.add.Tensor, x.args)
    residual = site.residual
    biases = [b for m in site.merged for b in m.biases]  # AR(a) + b = AR(a) + (b + residual)
    if residual is not None and (site.shared or biases):
        terms = [
            replay_lead(graph, after, term, term)
            for term, after in zip(site.shared, site.shared_views or [()] * len(site.shared))
        ] + biases
        residual = terms[0]
        for term in (*terms[1:], site.residual):
            residual = graph.call_function(torch.ops.aten.add.Tensor, (residual, term))
            residual.meta["val"] = _fake_call(torch.ops.aten.add.Tensor, residual.args)
    return x, residual, [n for n in graph.nodes if n not in before]


def ones_weight(graph: fx.Graph, site: Site) -> fx.Node:
    """A ones weight of the site's hidden size in its activations' dtype and device, inserted
    at the graph's insertion point: what the fused ops (and flashinfer's kernels), which take
    a weight, read for a norm without one (``x * 1`` is exact)."""
    like = site.x.meta["val"]
    kwargs = {"dtype": site.dtype, "layout": torch.strided, "device": like.device, "pin_memory": False}
    node = graph.call_function(torch.ops.aten.ones.default, ([site.hidden],), kwargs)
    node.meta["val"] = _fake_call(torch.ops.aten.ones.default, ([site.hidden],), kwargs, like=like)
    node.meta["stack_trace"] = site.out.meta.get("stack_trace")
    return node


def _insertion_point(site: Site, position: dict[fx.Node, float]) -> tuple[fx.Node, bool]:
    """Where the fused op goes: at the sum, when its inputs are all defined by then (the
    usual case: weights are graph inputs); else after its last input, and the users of
    ``residual_out`` that came earlier must be moved after it (the bool is True)."""
    scale = site.quant.scale if site.quant is not None else None
    inputs = [
        n
        for n in (
            site.x,
            site.residual,
            site.weight,
            scale,
            *site.shared,
            *(m.x for m in site.merged),
            *(a for m in site.merged for v in m.views for a in v.all_input_nodes),  # a gate
        )
        if n is not None
    ]
    last_input = max(position[n] for n in inputs)
    # no residual output read: at the host's norm op, else at the norm's output
    anchor = site.total or (site.host_norm.node if site.host_norm is not None else site.out)
    if last_input < position[anchor]:
        return anchor, False
    return next(n for n in sorted(site.nodes, key=position.__getitem__) if position[n] > last_input), True


def _fake_call(
    op: object, args: tuple[object, ...], kwargs: dict[str, Any] | None = None, like: object = None
) -> object:
    """``op``'s outputs on the graph's fake tensors (its fake implementation); ``like``: a
    fake tensor of the graph, for an op that reads none (a factory)."""
    from torch._guards import detect_fake_mode

    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    fake_mode = detect_fake_mode([v for v in (*vals, like) if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        raise RuntimeError("allreduce_rmsnorm: the graph's tensors carry no fake values")
    with fake_mode:
        return op(*vals, **(kwargs or {}))  # type: ignore[operator]


def summarize(sites: list[Site], rejected: list[Rejection], impl: str) -> list[str]:
    """Report notes: sites with/without residual, sites per layer, the plan's fingerprint
    (compare it across ranks' logs) and the reasons candidates were rejected."""
    from ..patterns import notes as notes_patterns

    notes: list[str] = []
    if sites:
        with_res = sum(1 for s in sites if s.residual is not None)
        quantized = [s for s in sites if s.quant is not None]
        fp8 = ""
        if quantized:
            keep = sum(1 for s in quantized if s.need_norm_out)
            forms = Counter(s.quant.form for s in quantized if s.quant is not None)
            fp8 = f"; {len(quantized)} with FP8 quant ({', '.join(f'{k}={v}' for k, v in forms.items())}"
            fp8 += f"; {keep} also writing the norm output)" if keep else ")"
        merged = sum(len(s.merged) for s in sites)
        summed = (
            f"; {merged} all-reduce(s) merged into a site's (AR(a) + AR(b) = AR(a + b))" if merged else ""
        )
        plain = sum(1 for s in sites if s.weight is None)
        notes.append(
            f"{len(sites)} site(s) -> {impl} op: {with_res} with residual, {len(sites) - with_res} without"
            + (f", {plain} RMSNorm(s) without weight (a ones weight)" if plain else "")
            + f"{fp8}{_dialects(sites)}; plan {plan_fingerprint(sites)}{summed}"
        )
        if layers := notes_patterns.per_layer(s.module for s in sites):
            notes.append(layers)
    if skipped := [s.quant_skipped for s in sites if s.quant_skipped]:
        notes.append(
            f"FP8 quantization left unfused at {len(skipped)} site(s): {notes_patterns.counted(skipped)}"
        )
    if left := notes_patterns.rejected([r.reason for r in rejected]):
        notes.append(left)
    if not sites and not rejected:
        notes.append("no all-reduce in the graph")
    return notes


def _dialects(sites: list[Site]) -> str:
    """``" (vllm dialect: vllm.all_reduce, vllm_ir norms)"``: where the sites were not torch's."""
    hosts = Counter(s.dialect for s in sites if s.dialect != "torch")
    return " (" + ", ".join(f"{n} in the {d} dialect" for d, n in hosts.items()) + ")" if hosts else ""


def plan_fingerprint(sites: list[Site]) -> str:
    """A short hash of what was fused, identical on every rank that fused the same graph."""
    plan = [
        [s.group_name, s.world_size, s.hidden, str(s.dtype), s.residual is not None, s.eps, s.weight_bias]
        + ([s.quant.form, s.need_norm_out] if s.quant is not None else [])
        + ([len(s.merged)] if s.merged else [])
        + (["no weight"] if s.weight is None else [])
        for s in sites
    ]
    return hashlib.sha256(json.dumps(plan).encode()).hexdigest()[:8]
