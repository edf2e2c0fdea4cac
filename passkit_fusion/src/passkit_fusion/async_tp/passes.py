"""The ``async_tp`` pass: ``all_gather -> matmul`` and ``matmul -> reduce_scatter`` become
PyTorch's symmetric-memory micro-pipelined ops, run through passkit's runtime.

The matching and the rewrite are PyTorch's (``micro_pipeline_tp_pass``, what Inductor runs
under ``config._micro_pipeline_tp``); this pass adds what PyTorch leaves to its user:

* symmetric memory "enabled" for the graph's groups at compile time, as torch's matcher
  requires (a local registration, the same on every rank: the groups come from the graph);
  the collective part (allocating and exchanging the workspace) happens at the ops' first
  call, outside CUDA-graph capture, after a bounded rank agreement (:mod:`.runtime`);
* torch's fused ops are retargeted to ``torch.ops.passkit_fusion.async_tp_*``, which carry the
  runtime settings in the graph (cache hits need no pass) and fall back to the unfused
  computation where the fused op cannot run (a CUDA graph captured before the workspace fits);
* ordering after ``sequence_parallel`` (which produces the all-gathers and reduce-scatters),
  a token range (``min_tokens``.. ``max_tokens``), skip reasons, and report notes naming the
  sites fused and why the others were left.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pydantic
import torch
import torch.fx as fx

from passkit import CompileContext, GraphPass, PassResult, Requirements, Stage, TokenConstraint

from ..timeouts import TimeoutSeconds
from ..tuning import decisions
from . import torch_api

# Registering the pass imports this module and torch_api (which imports torch's private
# modules only when called); the host adapters, the ops and their runtime are imported when
# the pass runs (see passkit_fusion.lazy_ops for the ops at cache hits).
_HERE = Path(__file__).resolve().parent
_ADVICE = "set implementation='test_mode' to rewrite graphs without running the fused ops"
_SYMM_MEM = "symmetric memory (async_tp)"
_C10D = "_c10d_functional"


class AsyncTPOptions(pydantic.BaseModel):
    """Options of the ``async_tp`` pass."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    implementation: Literal["auto", "test_mode"] = "auto"
    """auto: fuse on CUDA graphs where torch has symmetric memory, else skip with the reason; test_mode: rewrite on any device (torch's test mode; the ops then compute the unfused result with functional collectives), for tracing and CPU tests"""
    min_tokens: int = pydantic.Field(4096, ge=1)
    """the smallest token count the pass applies to: micro-pipelining pays only for long GEMMs (with sequence_parallel on the 8-layer Llama-8B stack at TP=2, H200: 0.94x Inductor at 1024 tokens, 1.02x at 2048-8192; the 2-layer HF Llama at TP=2 on H100: 0.97x at 2048 with CUDA graphs, 0.6x without, hence 4096)"""
    max_tokens: int | None = pydantic.Field(None, ge=1)
    """the largest token count the pass applies to (None: no bound); also reserves the symmetric-memory workspace for that many tokens at the first call, so CUDA graphs captured later for any size up to it run fused"""
    restrict_tokens: bool = True
    """declare min_tokens..max_tokens as the pass's token range (passkit compiles the other sizes without it); False: one compile for every size"""
    collective_timeout_s: TimeoutSeconds = 180.0
    """how long a rank waits for the others when setting up symmetric memory before raising RankAgreementError naming the missing ranks"""

    @pydantic.model_validator(mode="after")
    def _range(self) -> AsyncTPOptions:
        if self.max_tokens is not None and self.max_tokens < self.min_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be >= min_tokens ({self.min_tokens})")
        return self


@dataclass
class _Candidate:
    kind: Literal["all_gather", "reduce_scatter"]
    node: fx.Node  # the collective (erased when fused)
    group: str
    dim: int
    matmuls: list[str] = field(default_factory=list)
    why_not: str = ""


class AsyncTP(decisions.Tunable, GraphPass):
    """Fuse all-gather + matmul and matmul + reduce-scatter into PyTorch's symmetric-memory
    micro-pipelined ops (async tensor parallelism)."""

    name = "async_tp"
    stage = Stage.POST
    after = ("sequence_parallel",)
    depends_on = ("sequence_parallel",)
    """With sequence_parallel enabled, its all-gathers and reduce-scatters are what this
    pass fuses: it runs only in sequence_parallel's token ranges (no compile for odd counts
    where it would find nothing); enabled alone, it fuses the collectives the model has."""
    Options = AsyncTPOptions
    requires = Requirements(min_world_size=2)
    graph_kinds = ("inference",)
    skip_graph_kinds_reason = "it overlaps the collectives sequence_parallel makes, on inference graphs only"
    source_files = tuple(str(_HERE / f) for f in ("ops.py", "runtime.py", "torch_api.py", "host.py"))

    options: AsyncTPOptions

    def identity(self) -> dict[str, Any]:
        """The pass's identity plus the dialects it reads graphs with (third parties' too)."""
        from .. import dialects

        return {**super().identity(), "dialects": [d.identity() for d in dialects.registered()]}

    def token_constraint(self, ctx: CompileContext) -> TokenConstraint | None:
        """``min_tokens..max_tokens`` unless ``restrict_tokens`` is off; a measured or stored
        fuse decision for this graph replaces them unless they are set."""
        if (applied := self.decided(ctx)) is not None:
            return applied.constraint
        if not self.options.restrict_tokens:
            return None
        return TokenConstraint(min_tokens=self.options.min_tokens, max_tokens=self.options.max_tokens)

    def skip_reason(self, ctx: CompileContext) -> str | None:
        if ctx.world_size > 1:  # at backend entry on every rank, cache hit or not
            from ..collective import publish_host

            publish_host()
        unmet = super().skip_reason(ctx) or self.nowhere_reason(ctx)
        if unmet:
            return unmet
        missing = torch_api.missing()
        if missing:
            return missing
        if self.options.implementation == "test_mode":
            return None
        if ctx.device != "cuda":
            return f"symmetric-memory async TP needs CUDA tensors (graph is on {ctx.device}) — {_ADVICE}"
        unavailable = torch_api.symm_mem_unavailable()
        return f"{unavailable} — {_ADVICE}" if unavailable else None

    def run(self, gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
        from ..collective import spans_hosts
        from . import host, ops  # noqa: F401  (ops: defines the ops the rewrite writes)

        graph = gm.graph
        test = self.options.implementation == "test_mode"
        across = [r for g in sorted(_collective_groups(graph)) if (r := spans_hosts(g, _SYMM_MEM))]
        if across:  # decided from the hosts the group's ranks exchanged: the same on every rank
            return PassResult.unchanged("; ".join(across))
        _views_around_matmuls_to_reshapes(graph)
        plans = _plain_reduce_scatters(graph)  # sequence_parallel's agreed ones, for torch's matcher
        hosts = host.to_torch(graph)
        found = _candidates(graph)
        groups = sorted({c.group for c in found} | _collective_groups(graph))
        if not test:
            for group in groups:  # local and identical on every rank: torch's matcher needs it
                torch_api.enable_group(group)
        # torch >= 2.15 asks the accelerator's symmetric-memory backend instead of the
        # registration: its pass then leaves a disabled group's candidates, and the notes say why
        disabled = set() if test else {g for g in groups if not torch_api.is_enabled(g)}
        ag_op, rs_op = torch_api.fused_ops()
        preexisting = _count(graph, (ag_op, rs_op))
        if found or not torch_api.has_matchers():
            # with no candidate torch's pass only logs "async TP found no matching
            # all-gather/reduce-scatter patterns" (once per rank); our note says it per graph
            with torch_api.forced_matching() if test else contextlib.nullcontext():
                torch_api.run_torch_pass(graph)
        alive = set(graph.nodes)
        fused = [c for c in found if c.node not in alive]
        left = [c for c in found if c.node in alive]
        for c in left:
            c.why_not = _not_enabled() if c.group in disabled else _why_left(c)
        host.settle(graph, hosts)  # the host's ops back where torch fused nothing
        wrapped = self._retarget(graph, ag_op, rs_op)
        _restore_agreements(graph, plans)
        if ctx.mode == "eager":
            _drop_layout_hints(graph)
        _fill_meta(graph)
        notes = _summarize(fused, left, preexisting, wrapped, groups, self.options) + host.notes(hosts)
        if decided := self.decision_note(ctx):
            notes.append(decided)
        if not fused and hosts.declined:
            return PassResult.declining("; ".join(hosts.declined), notes)
        return PassResult(modified=wrapped > 0, matches=len(fused), notes=notes)

    def _retarget(self, graph: fx.Graph, ag_op: Any, rs_op: Any) -> int:
        """Point torch's fused ops at passkit's wrappers (same arguments + runtime settings)."""
        settings = (
            self.options.implementation,
            self.options.max_tokens or 0,
            float(self.options.collective_timeout_s),
        )
        n = 0
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target is ag_op:
                shard, bs, gather_dim, group = node.args[:4]
                return_a = node.kwargs.get("return_A", node.args[4] if len(node.args) > 4 else True)
                node.target = torch.ops.passkit_fusion.async_tp_all_gather_matmul.default
                node.args, node.kwargs = (shard, bs, gather_dim, group, return_a, *settings), {}
                n += 1
            elif node.target is rs_op:
                node.target = torch.ops.passkit_fusion.async_tp_matmul_reduce_scatter.default
                node.args, node.kwargs = (*node.args[:5], *settings), {}
                n += 1
        return n


# ------------------------------------------------------------------- candidates, notes --


def _plain_reduce_scatters(graph: fx.Graph) -> dict[str, tuple[str, float]]:
    """``sequence_parallel``'s ``agreed_reduce_scatter`` nodes (each group's first
    reduce-scatter) made plain ``reduce_scatter_tensor`` nodes, which torch's matcher fuses;
    returns each group's (plan, timeout), for :func:`_restore_agreements`."""
    from ..sequence_parallel import ops as sp_ops

    plans: dict[str, tuple[str, float]] = {}
    for node in graph.find_nodes(op="call_function", target=sp_ops.agreed_reduce_scatter_op()):
        x, reduce_op, size, group, plan, timeout = node.args
        node.target, node.args = (
            torch.ops._c10d_functional.reduce_scatter_tensor.default,
            (x, reduce_op, size, group),
        )
        plans[str(group)] = (str(plan), float(timeout))  # type: ignore[arg-type]
    return plans


def _restore_agreements(graph: fx.Graph, plans: dict[str, tuple[str, float]]) -> None:
    """Each group's first reduce-scatter agrees on its ``sequence_parallel`` plan again:
    ``agreed_reduce_scatter`` where torch left it, else the fused matmul + reduce-scatter
    that took it over carries the plan (its first call agrees before any collective)."""
    from ..sequence_parallel import ops as sp_ops

    rs = torch.ops._c10d_functional.reduce_scatter_tensor.default
    fused = torch.ops.passkit_fusion.async_tp_matmul_reduce_scatter.default
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (rs, fused):
            continue
        group = str(node.args[3] if node.target is rs else node.args[4])
        if group not in plans:
            continue
        plan, timeout = plans.pop(group)
        if node.target is rs:
            node.target, node.args = sp_ops.agreed_reduce_scatter_op(), (*node.args[:4], plan, timeout)
        else:
            node.args = (*node.args[:8], plan)
    if plans:  # every group's first reduce-scatter is one of the two
        raise RuntimeError(f"async_tp: lost the first reduce-scatter of group(s) {sorted(plans)}")


def _drop_layout_hints(graph: fx.Graph) -> None:
    """Remove the ``inductor_force_stride_order`` nodes torch's rewrite puts before the fused
    ops: layout hints for Inductor's code generation (torch's ops copy a badly strided input
    themselves). Without Inductor they would run as code, and with dynamic shapes their
    symbolic strides are not even defined there."""
    hint = torch.ops.prims.inductor_force_stride_order.default
    for node in list(graph.find_nodes(op="call_function", target=hint)):
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)


def _views_around_matmuls_to_reshapes(graph: fx.Graph) -> None:
    """torch's matcher reads N-D matmuls as ``reshape -> mm -> reshape``: the form Inductor's
    post-grad graph has (``view_to_reshape``, ``_unsafe_view`` decomposed). Graphs compiled
    without Inductor (passkit's eager mode, make_fx) still say ``view`` / ``_unsafe_view``
    there; retarget those (the same result on the contiguous tensors these are)."""
    aten = torch.ops.aten
    views = (aten.view.default, aten._unsafe_view.default)
    for mm in graph.find_nodes(op="call_function", target=aten.mm.default):
        around = [mm.args[0], *mm.users]
        for node in around:
            if isinstance(node, fx.Node) and node.op == "call_function" and node.target in views:
                node.target = aten.reshape.default


def _candidates(graph: fx.Graph) -> list[_Candidate]:
    """torch's own candidates (its finders), with the matmuls each would fuse."""
    if not torch_api.has_matchers():
        return []
    ags, rss = torch_api.find_candidates(graph)
    out = []
    for m in ags:
        mms = [_mm_name(mm) for mm in torch_api.consumer_matmuls(m.res_node)]
        out.append(_Candidate("all_gather", m.ag_node, str(m.group_name), int(m.gather_dim), mms))
    for m in rss:
        mm = torch_api.producer_matmul(m.input_node)
        out.append(
            _Candidate(
                "reduce_scatter",
                m.reduce_scatter_node,
                str(m.group_name),
                int(m.scatter_dim),
                [_mm_name(mm)] if mm is not None else [],
            )
        )
    return out


def _mm_name(matmul: Any) -> str:
    nodes = matmul.nodes
    return (nodes[1] if len(nodes) == 3 else nodes[0]).name


def _collective_groups(graph: fx.Graph) -> set[str]:
    groups = set()
    for node in graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", "") == _C10D:
            name = node.target._opname
            if name == "all_gather_into_tensor":
                groups.add(str(node.args[2]))
            elif name == "reduce_scatter_tensor":
                groups.add(str(node.args[3]))
    return groups


def _count(graph: fx.Graph, targets: tuple[Any, ...]) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target in targets)


def _why_left(c: _Candidate) -> str:
    """Why torch's pass left a candidate (its conditions, restated)."""
    if not c.matmuls:
        return (
            "its result feeds no matmul" if c.kind == "all_gather" else "its input is not a matmul's output"
        )
    if c.kind == "all_gather":
        shard = c.node.args[0]
        val = shard.meta.get("val") if isinstance(shard, fx.Node) else None
        last = val is not None and c.dim in (val.dim() - 1, -1)
        if last and val.shape[-1] < 1024:
            return f"gathered along the last dim with a shard only {val.shape[-1]} wide (< 1024: too small to split)"
        if last:
            return "gathered along the last dim and also used besides the matmuls"
        return "torch's pass declined (a matmul's weight depends on the gather, or mixed matmul kinds)"
    mm_out = c.node.args[0]
    if isinstance(mm_out, fx.Node) and len(mm_out.users) > 1:
        return "the matmul's result has other users"
    return (
        "torch's pass declined (the reduce-scatter feeds the matmul, or a scaled matmul along the last dim)"
    )


def _summarize(
    fused: list[_Candidate],
    left: list[_Candidate],
    preexisting: int,
    wrapped: int,
    groups: list[str],
    options: AsyncTPOptions,
) -> list[str]:
    notes = []
    for kind, label in (
        ("all_gather", "all_gather -> matmul"),
        ("reduce_scatter", "matmul -> reduce_scatter"),
    ):
        sites = [c for c in fused if c.kind == kind]
        if sites:
            listed = ", ".join(f"{c.node.name}(dim {c.dim}) -> {'+'.join(c.matmuls)}" for c in sites)
            notes.append(f"{len(sites)} {label} fused: {listed}")
    if left:
        listed = "; ".join(f"{c.node.name}: {c.why_not}" for c in left)
        notes.append(f"{len(left)} candidate(s) left: {listed}")
    if preexisting:
        notes.append(f"{preexisting} op(s) already fused by Inductor's own micro_pipeline_tp, wrapped too")
    if wrapped:
        notes.append(
            f"{wrapped} op(s) -> passkit_fusion.async_tp_* ({options.implementation}); "
            f"symmetric memory for group(s) {', '.join(groups)} set up at first call"
        )
    if not fused and not left and not preexisting:
        notes.append(
            "no all_gather -> matmul or matmul -> reduce_scatter in the graph (run sequence_parallel first?)"
        )
    return notes


def _fill_meta(graph: fx.Graph) -> None:
    """Fake values for the nodes torch's rewrite added without them."""
    from torch._guards import detect_fake_mode

    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        return

    def val(a: Any) -> Any:
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    with fake_mode:
        for node in graph.nodes:
            if node.op != "call_function" or "val" in node.meta:
                continue
            args = torch.fx.node.map_aggregate(node.args, val)
            kwargs = torch.fx.node.map_aggregate(node.kwargs, val)
            if node.target is operator.getitem and args[0] is None:
                continue
            try:
                node.meta["val"] = node.target(*args, **kwargs)
            except Exception:  # a value torch cannot fake: leave it to Inductor, as torch's pass does
                continue


def _not_enabled() -> str:
    """Why torch's pass left a candidate whose group it reports symmetric memory unusable for."""
    if torch_api.enabled_by_registration():
        rule = "after passkit registered the group"
    else:  # torch >= 2.15
        found = torch_api.accelerator_backend()
        rule = (
            f"the accelerator's symmetric-memory backend is {found}"
            if found
            else "no accelerator with a symmetric-memory backend"
        )
        rule += ", or the group is not registered with c10d"
    return f"torch {torch.__version__} reports symmetric memory unusable for its group (is_symm_mem_enabled_for_group is False: {rule})"
