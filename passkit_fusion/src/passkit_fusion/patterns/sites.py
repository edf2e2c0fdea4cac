"""Find ``all_reduce -> (add residual) -> RMSNorm`` sites in post-grad ATen graphs, in
every host's dialect.

The all-reduce comes from a dialect (:mod:`passkit_fusion.dialects`): torch's
``wait_tensor(all_reduce(x, "sum", group))`` (functional collectives, DTensor; followed by
``aten.copy`` for an in-place ``dist.all_reduce``), vLLM's ``vllm.all_reduce(x,
group)``, SGLang's ``sglang.outplace_all_reduce`` / functionalized
``sglang.inplace_all_reduce``... From its sum the matcher walks forward:

* to the host's norm op when the dialect has one (vLLM IR's ``rms_norm``, or
  ``fused_add_rms_norm`` which also adds the residual);
* else over the optional residual add, in the activation dtype (Llama, Hugging Face) or
  in fp32 (``h = sum.float() + residual.float()``, ``residual = h.to(dtype)``: SGLang's
  and vLLM's native RMSNorm with a residual), to the native RMSNorm decomposition
  (:func:`passkit_fusion.patterns.rmsnorm.match_rmsnorm`: Llama's fp32 upcast,
  ``F.rms_norm``, Gemma's ``1 + weight``, ``x * x``, the weight on either side of the
  downcast, no weight at all: nanochat's).

The group the graph names is resolved by the dialect to the torch process group the
rewrites use (:attr:`Site.group_name`). Everything is decided from the graph and the
process group's size, never from rank-local state, so every rank finds the same sites.
A dialect whose ops' registered schemas differ from the ones it knows declines: each of
its all-reduces is rejected with the reason.

With ``fp8=True`` the matcher also looks after the norm for a static per-tensor
``float8_e4m3fn`` quantization (:func:`passkit_fusion.patterns.fp8.match_fp8_quant`) and
records it in :attr:`Site.quant`; a quantization the kernel would compute differently
leaves the site fused without it, the reason in :attr:`Site.quant_skipped`.

A candidate the fused kernel would compute differently is rejected with a reason: a reduce
op other than sum, a norm over another dim, a weight in another dtype than the activations,
an intermediate (the all-reduce result included) also used outside the match, a residual
add that broadcasts or promotes, an unsupported dtype, hidden size or world size. (The
fp32-residual form is fused although the kernel normalizes the rounded sum rather than
the fp32 one: the hosts' own fusions make the same substitution.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from ..dialects.base import AllReduce, Declined, Dialect, HostNorm
from .fp8 import Fp8Quant, NoQuant, match_fp8_quant
from .graph import (
    Mismatch,
    dtype_str,
    group_world_size,
    module_path,
    same_shape,
    shape_str,
    sole_user,
    val,
)
from .isolation import error_reason
from .layernorm import LayerNorm, match_layernorm
from .lead import describe_chain, is_lead_op, is_view, walk_lead
from .rmsnorm import NoNorm, RMSNorm, cast_dtype, match_rmsnorm, match_rmsnorm_fp32

aten = torch.ops.aten

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SUPPORTED_WORLD_SIZES = (2, 4, 8, 16)
"""World sizes of flashinfer's fused all-reduce kernels (16 runs one-shot only)."""
HIDDEN_MULTIPLE = 8
"""The kernel moves 16-byte vectors: 8 elements of a 16-bit dtype."""
MAX_HIDDEN = 16384
"""Largest hidden size the kernel is known to launch with (one token per thread block cluster)."""


RMS = "rms"
LAYER = "layer"
NORM_KINDS = (RMS, LAYER)
"""The norms a site can end in: RMSNorm (``allreduce_rmsnorm``, ``sequence_parallel``) and
LayerNorm (``allreduce_layernorm``)."""
LAYERNORM_NOT_HERE = "a LayerNorm follows (allreduce_layernorm's site: enable that pass to fuse it)"
"""The reason RMSNorm passes give for an all-reduce whose sum a LayerNorm reads."""
RMSNORM_NOT_HERE = "an RMSNorm follows (allreduce_rmsnorm's site, not allreduce_layernorm's)"
"""The reason ``allreduce_layernorm`` gives for an all-reduce whose sum an RMSNorm reads."""


@dataclasses.dataclass(frozen=True)
class Merged:
    """Another all-reduce of the same group whose sum is added to a site's sum before the
    residual (DeepSeek's routed experts + shared experts, each row-parallel): the all-reduce
    is linear, so the site reduces both inputs at once, ``AR(a) + AR(b) = AR(a + b)``, one
    collective instead of two."""

    all_reduce: fx.Node
    x: fx.Node
    """Its input."""
    result: fx.Node
    term: fx.Node
    """What the site's add reads: :attr:`result`, or the last view of it."""
    nodes: tuple[fx.Node, ...]
    """Its own nodes, from the collective to :attr:`result` (in the site's nodes)."""
    views: tuple[fx.Node, ...]
    """The lead from :attr:`result` to :attr:`term` (in the site's nodes): views keeping the
    hidden dim, a sum over leading dims (Llama-4's top-k sum), constant scales, a gate every
    rank computes alike (Qwen3-Next's ``sigmoid(g) * AR(shared)``)."""
    after: tuple[fx.Node, ...]
    """The site's views after the add reading :attr:`term` (the site's own chain)."""
    bias_adds: tuple[fx.Node, ...] = ()
    """Adds of a row-parallel bias in :attr:`views` (GPT-NeoX's and Phi's parallel block:
    ``AR(attn) + b + AR(mlp) + b' + x``; ``allreduce_layernorm`` only): the identity when the
    lead is replayed before the all-reduce; their biases (:attr:`biases`) join the residual."""

    @property
    def biases(self) -> tuple[fx.Node, ...]:
        """The biases :attr:`bias_adds` add, to be added to the residual after the all-reduce."""
        return tuple(_bias_of(add) for add in self.bias_adds)  # type: ignore[misc]


@dataclasses.dataclass(frozen=True)
class Site:
    """One all-reduce -> (add residual) -> RMSNorm that the fused op can replace."""

    all_reduce: fx.Node
    x: fx.Node
    """The all-reduce's input."""
    group_name: str
    """The torch process group's name (resolved by the dialect from :attr:`host_group`)."""
    world_size: int
    residual: fx.Node | None
    total: fx.Node | None
    """The node whose value ``residual_out`` takes over: the residual add, or the all-reduce
    result without a residual; None when the host's fused add+norm op has a residual
    output nothing reads."""
    weight: fx.Node | None
    """The norm weight as stored (before any upcast); its dtype is the activations'. None:
    a norm without a weight (an RMSNorm without a learnable scale, nanochat's; a LayerNorm
    without affine weight): a rewrite whose op takes a weight passes ones (the same value)."""
    weight_bias: float
    eps: float
    out: fx.Node
    """The norm's output node."""
    nodes: tuple[fx.Node, ...]
    """Every node the fused op replaces (``total`` and ``out`` included); all of them are
    used only inside the site, except ``total`` and ``out``."""
    hidden: int
    dtype: torch.dtype
    module: str
    """Where the norm lives in the model (``layers.0.post_attention_layernorm``), or ``""``."""
    quant: Fp8Quant | None = None
    """The static FP8 quantization of the norm output the fused op also takes over (only
    when matched with ``fp8=True``); its nodes are not in :attr:`nodes`."""
    quant_skipped: str | None = None
    """Why an FP8 quantization after the norm is left out of the fusion, if one is."""
    need_norm_out: bool = True
    """Whether anything besides :attr:`quant` reads the norm output (then the fused op
    writes the norm output too); always True without a quantization."""
    result: fx.Node | None = None
    """The node holding the all-reduce's sum (in :attr:`head`)."""
    head: tuple[fx.Node, ...] = ()
    """The all-reduce's own nodes, from the collective to :attr:`result`."""
    dialect: str = "torch"
    host_group: str = ""
    """The group as the graph names it (the host's name)."""
    host_norm: HostNorm | None = None
    """The host's norm op, when the norm is one (else the native decomposition)."""
    lead: tuple[fx.Node, ...] = ()
    """Views (keeping the hidden dim) and constant scales between :attr:`result` and the
    residual add or norm (:mod:`.lead`), in order; in :attr:`nodes`. A rewrite that fuses
    the all-reduce applies them to :attr:`x` first (:func:`.lead.replay_lead`)."""
    shared: tuple[fx.Node, ...] = ()
    """Terms added to the sum before :attr:`residual` (a shared expert's output:
    ``norm(AR(routed) + shared + residual)``), in order; the fused op adds them to the
    residual first. Their adds are in :attr:`nodes`."""
    merged: tuple[Merged, ...] = ()
    """All-reduces summed into this site (not in :attr:`shared`); their nodes are in
    :attr:`nodes`."""
    shared_views: tuple[tuple[fx.Node, ...], ...] = ()
    """For each :attr:`shared` term, the views keeping the hidden dim that follow its add
    (``(AR + shared).view(B, S, H) + residual``: Qwen2-MoE); in :attr:`nodes`. The fused op
    applies them to the term, and all of them (after :attr:`lead`) to :attr:`x`."""
    norm_kind: str = RMS
    """``"rms"`` (RMSNorm) or ``"layer"`` (LayerNorm: :attr:`bias` may be set, no weight bias)."""
    bias: fx.Node | None = None
    """The LayerNorm's bias as stored (None: without bias, and always for an RMSNorm)."""

    @property
    def chain_views(self) -> tuple[fx.Node, ...]:
        """The views keeping the hidden dim between the site's adds, in order (they apply to
        every term added before them, the all-reduce input included)."""
        own = set(self.lead) | {n for m in self.merged for n in m.views}
        return tuple(n for n in self.nodes if is_view(n) and n not in own)

    @property
    def start(self) -> fx.Node:
        """The node the residual add (or the norm) reads: the lead's last, else the sum."""
        return self.lead[-1] if self.lead else self.result  # type: ignore[return-value]


def rebind_outputs(
    graph: fx.Graph,
    site: Site,
    norm_out: fx.Node | None,
    residual_out: fx.Node,
    order: Callable[[fx.Node], float],
    *,
    inside: Collection[fx.Node] = (),
    replaced: Iterable[fx.Node] = (),
    new: Iterable[fx.Node] = (),
) -> None:
    """Hand the readers of a rewritten ``site`` the fused op's outputs, then erase what
    nothing reads any more.

    ``norm_out`` takes over :attr:`Site.out` (None: only nodes the op took over read it),
    ``residual_out`` :attr:`Site.total` and the host norm's in-place residual; readers in
    ``inside`` (default: the site's nodes) keep what they read, they are going. Then every
    node of ``replaced`` (default: the site's) and of ``new`` (the op's outputs) that nothing
    reads is erased, the last by ``order`` first."""
    taken = set(inside or site.nodes)
    if norm_out is not None:
        site.out.replace_all_uses_with(norm_out, delete_user_cb=lambda user: user not in taken)
    for node in site.host_norm.rebind if site.host_norm is not None else ():
        node.replace_all_uses_with(residual_out)  # a maybe-in-place op's residual: the new sum
    if site.total is not None:
        site.total.replace_all_uses_with(residual_out, delete_user_cb=lambda user: user not in taken)
    for node in (*sorted(set(replaced or site.nodes), key=order, reverse=True), *new):
        if not node.users:
            graph.erase_node(node)


@dataclasses.dataclass(frozen=True)
class Rejection:
    """An all-reduce that is not a site, and why."""

    all_reduce: fx.Node
    reason: str
    schema: bool = False
    """The dialect declined the op itself (a schema it would read wrongly), not this site:
    a cause the user must act on (see :func:`schema_declined`)."""
    matcher: bool = False
    """The matcher found no site at this all-reduce (its form, a kernel limit, an error
    matching it), as opposed to a site the pass chose to leave (it would not pay, its group
    spans hosts): such a rejection followed by a norm is a lost site (:mod:`.lost`)."""


def schema_declined(rejected: Sequence[Rejection]) -> str | None:
    """The reason(s) dialects declined ops for their schema among ``rejected`` (one line,
    each reason once), or None: a pass that fused nothing for this reason returns
    ``PassResult.declining(...)``, which the report marks ``declined`` and warns about."""
    reasons = list(dict.fromkeys(r.reason for r in rejected if r.schema))
    return "; ".join(reasons) if reasons else None


def candidates(
    graph: fx.Graph,
    *,
    kernel_limits: bool = True,
    fp8: bool = False,
    dialects: Sequence[Dialect] | None = None,
    norm: str = RMS,
) -> Iterator[Site | Rejection]:
    """Match each all-reduce of ``graph``, dialect by dialect and in graph order within
    one, lazily: the caller may replace a site before taking the next item (sites are
    disjoint, and a later site sees the earlier one's outputs where it used its nodes,
    e.g. as its residual). ``dialects``: default every registered one. An unexpected error
    matching one all-reduce rejects it with the error as the reason
    (:func:`.isolation.error_reason`); the others are still matched.
    ``kernel_limits``, ``fp8``, ``norm``: see :func:`match_site`."""
    present = _present(graph, dialects)
    for dialect in present:
        problems = dialect.schema_problems(graph)
        if problems:  # never read arguments at positions the op may no longer have
            reason = "; ".join(problems.values())
            for node, _, _ in list(dialect.ops_in(graph, dialect.ALL_REDUCE_OPS)):
                yield Rejection(node, reason, schema=True)
            continue
        merged: set[fx.Node] = set()
        later: list[Rejection] = []  # yielded at the end: a later site may merge them
        for found in dialect.all_reduces(graph):
            if _anchor(found) in merged or getattr(_anchor(found), "_erased", False):
                continue  # summed into an earlier site (see Site.merged)
            if isinstance(found, tuple):
                yield Rejection(*found)
                continue
            try:
                site = match_site(
                    found, dialect, kernel_limits=kernel_limits, fp8=fp8, norms=present, norm=norm
                )
                merged.update(m.all_reduce for m in site.merged)
                yield site
            except (Mismatch, Declined) as exc:
                later.append(Rejection(found.anchor, str(exc), matcher=True))
            except Exception as exc:  # passkit's bug at this site: the others still match
                later.append(Rejection(found.anchor, error_reason("matching", exc), matcher=True))
        # an all-reduce rejected on its own but summed into a later site (a gated shared
        # expert's, before the routed experts' in graph order) is that site's, not left
        yield from (r for r in later if r.all_reduce not in merged)


def _anchor(found: AllReduce | tuple[fx.Node, str]) -> fx.Node:
    return found.anchor if isinstance(found, AllReduce) else found[0]


def find_sites(
    graph: fx.Graph,
    *,
    kernel_limits: bool = True,
    fp8: bool = False,
    dialects: Sequence[Dialect] | None = None,
    norm: str = RMS,
) -> tuple[list[Site], list[Rejection]]:
    """Every site of ``graph`` and every rejected all-reduce, without changing the graph."""
    found = list(candidates(graph, kernel_limits=kernel_limits, fp8=fp8, dialects=dialects, norm=norm))
    return [c for c in found if isinstance(c, Site)], [c for c in found if isinstance(c, Rejection)]


def host_fusion_note(graph: fx.Graph, dialects: Sequence[Dialect] | None = None) -> str | None:
    """``"host already fused: N site(s) by vLLM's fuse_allreduce_rms (...)"`` and, for a host
    of another version than its dialect's, a line saying so; None when neither applies."""
    found: dict[str, int] = {}
    versions: list[str] = []
    for dialect in _present(graph, dialects):
        for label, n in dialect.host_fusions(graph).items():
            found[label] = found.get(label, 0) + n
        if note := dialect.version_note():
            versions.append(note)
    lines = versions
    if found:
        lines = [
            "host already fused: " + ", ".join(f"{n} site(s) by {label}" for label, n in found.items()),
            *lines,
        ]
    return "; ".join(lines) if lines else None


def count_all_reduces(graph: fx.Graph, dialects: Sequence[Dialect] | None = None) -> int:
    """The all-reduces in ``graph``, in every dialect present: what a fusion pass checks its
    report against after its rewrite (the graph, not the intent)."""
    count = 0
    for dialect in _present(graph, dialects):
        count += sum(1 for _ in dialect.ops_in(graph, dialect.ALL_REDUCE_OPS))
    return count


class CountMismatch(RuntimeError):
    """A pass reported more (or fewer) all-reduces rewritten than left its graph."""


def check_rewritten(pass_name: str, before: int, after: int, rewritten: int) -> None:
    """Raise :class:`CountMismatch` unless ``before - after == rewritten``: the pass's report
    says ``rewritten`` all-reduces were taken; the graph must have that many fewer. A mismatch
    is the pass's failure (its graph is restored, the reason recorded)."""
    if before - after != rewritten:
        raise CountMismatch(
            f"{pass_name} reports {rewritten} all-reduce(s) rewritten, but the graph went from "
            f"{before} to {after} all-reduce(s)"
        )


def _present(graph: fx.Graph, dialects: Sequence[Dialect] | None) -> list[Dialect]:
    if dialects is None:
        from ..dialects import registered

        dialects = registered()
    namespaces = {_namespace(n) for n in graph.nodes if n.op == "call_function"}
    return [d for d in dialects if namespaces & set(d.NAMESPACES)]


def _namespace(node: fx.Node) -> str | None:
    from ..dialects.base import node_op

    _, qualified, _ = node_op(node)
    return qualified.partition("::")[0] if qualified else None


def match_site(
    ar: AllReduce,
    dialect: Dialect,
    *,
    kernel_limits: bool = True,
    fp8: bool = False,
    norms: Sequence[Dialect] = (),
    norm: str = RMS,
) -> Site:
    """The site starting at the all-reduce ``ar`` (read by ``dialect``); raises
    :class:`Mismatch` (or :class:`~passkit_fusion.dialects.Declined`) with the reason if none.
    A :class:`Mismatch` names the chain of nodes the matcher walked and where it stopped
    (``all_reduce -> wait_tensor -> mul(·, 0.22) -> add -> relu: no RMSNorm after the
    all-reduce``).

    Between the sum and the residual add (or the norm) the matcher reads through views that
    keep the hidden dim and multiplications by constants (:mod:`.lead`); after the add,
    through further adds of same-shaped terms (a shared expert's output).

    ``norms``: the dialects whose norm ops may follow the all-reduce besides ``dialect``'s
    (vLLM on CPU: torch's all-reduce, vLLM IR's norms).

    ``kernel_limits=False`` drops the fused kernel's own limits (hidden size, world sizes
    2/4/8/16): for rewrites that keep the norm in torch (``sequence_parallel``).
    ``fp8=True`` also matches a static FP8 quantization of the norm output.

    ``norm``: the norm the site must end in, ``"rms"`` (RMSNorm, the default) or ``"layer"``
    (LayerNorm with weight and optional bias: :mod:`.layernorm`); the other kind is rejected
    with a reason naming the pass that takes it."""
    if norm not in NORM_KINDS:
        raise ValueError(f"norm must be one of {NORM_KINDS}, got {norm!r}")
    try:
        return _match_site(ar, dialect, kernel_limits=kernel_limits, fp8=fp8, norms=norms, kind=norm)
    except Mismatch as exc:
        no_norm = isinstance(exc, NoNorm) or NO_NORM_FOLLOWS in str(exc) or "also used outside" in str(exc)
        if no_norm and _ends_graph(ar):  # no norm here because it is in the next graph
            raise Mismatch(f"{_walked_chain(ar)}: {ends_graph_reason()}") from None
        if no_norm and _spread_over_streams(ar):
            raise Mismatch(f"{_walked_chain(ar)}: {HYPER_CONNECTIONS}") from None
        raise Mismatch(f"{_walked_chain(ar)}: {exc}") from None


ENDS_GRAPH = "ends its graph"
"""The reason given for an all-reduce whose sum is an output of its graph: its norm (if
any) is in the next graph, after a Dynamo graph break."""


def _stream(ar: AllReduce) -> list[fx.Node]:
    """The sum and what carries it on in the residual stream: its lead, views and adds
    (at most 64 nodes)."""
    seen: list[fx.Node] = []
    frontier = [ar.result]
    while frontier and len(seen) < 64:
        node = frontier.pop()
        seen.append(node)
        for user in node.users:
            lead = user.args and user.args[0] is node and is_lead_op(user, node)
            if is_view(user) or lead or user.target is aten.add.Tensor:
                frontier.append(user)
    return seen


def _ends_graph(ar: AllReduce) -> bool:
    """Whether the graph's output reads the sum (directly, or through its lead, views and
    residual adds)."""
    seen = _stream(ar)
    output = any(user.op == "output" for node in seen for user in node.users)
    # a norm in this graph reading one of them: not a graph boundary's doing
    return output and not any(_norm_follows(n) for n in seen)


HYPER_CONNECTIONS = (
    "no norm reads the sum plus a residual: it is spread over several residual streams "
    "(unsqueeze, then a per-stream scale or expand: hyper-connections, e.g. DeepSeek-V4's mHC) "
    "and the norms read a learned mix of the streams"
)
"""The reason given for an all-reduce whose sum is broadcast into hyper-connection streams
(no ``"; "`` in it: reports join reasons with it)."""


def _spread_over_streams(ar: AllReduce) -> bool:
    """Whether the sum (or its residual add) gains a dim (``unsqueeze``) and is then broadcast
    against more than one stream (``expand``, or a product or sum with more elements): the
    residual of hyper-connections, ``[..., streams, hidden]``."""
    rank = val(ar.result).dim()
    for node in _stream(ar):
        for user in node.users:
            if user.target is not aten.unsqueeze.default:
                continue
            for after in user.users:
                out = after.meta.get("val")
                if not isinstance(out, torch.Tensor) or out.dim() <= rank:
                    continue
                if after.target is aten.expand.default or (
                    after.target in (aten.mul.Tensor, aten.add.Tensor) and out.numel() > val(user).numel()
                ):
                    return True
    return False


def ends_graph_reason() -> str:
    """``"ends its graph: ... (Dynamo's graph break: <reason>)"``, with the break reasons
    Dynamo recorded in this process where it has any (``torch._dynamo.utils.counters``)."""
    text = (
        f"{ENDS_GRAPH}: the sum is an output of this graph, its norm (if any) is in the next one "
        "after a Dynamo graph break, and nothing fuses across graphs"
    )
    try:
        from torch._dynamo.utils import counters

        reasons = [r.strip().splitlines()[0][:160] for r in counters["graph_break"] if r.strip()]
    except Exception:  # Dynamo's counters are internal: the reason without them
        reasons = []
    if reasons:
        shown = " / ".join(list(dict.fromkeys(reasons))[:2])  # "; " separates a report's reasons
        text += f" (Dynamo's graph break: {shown})"
    return text


_WARNED_GRAPH_END = False


def warn_graph_ends(pass_name: str, rejected: Sequence[Rejection]) -> str | None:
    """Warn once per process when all-reduces end their graph (see :func:`ends_graph_reason`);
    returns the report note for ``rejected`` (None when none does)."""
    global _WARNED_GRAPH_END
    ends = sum(1 for r in rejected if ENDS_GRAPH in r.reason)
    if not ends:
        return None
    note = (
        f"{ends} all-reduce(s) end their graph: the model's graph breaks between an all-reduce "
        f"and its norm ({GRAPH_BREAK_ADVICE})"
    )
    if not _WARNED_GRAPH_END:
        _WARNED_GRAPH_END = True
        import warnings

        warnings.warn(f"passkit {pass_name}: {note}", stacklevel=2)
    return note


GRAPH_BREAK_ADVICE = (
    "with Hugging Face tp_plan='auto', transformers 5.17 registers module backward hooks that "
    "Dynamo breaks the graph at ('Module-level backwards hooks require compiled autograd'): "
    "use transformers 5.23.0 or later, which compiles the decoder as one graph"
)
"""What to do about graph breaks between the all-reduces and their norms."""


def _walked_chain(ar: AllReduce) -> str:
    """The nodes from the collective through the lead and the adds, then the users where
    the walk ended (see :func:`.lead.describe_chain`)."""
    nodes = list(dict.fromkeys(ar.nodes))
    lead = walk_lead(ar.result)
    nodes.extend(lead)
    node = lead[-1] if lead else ar.result
    while (user := sole_user(node)) is not None and (
        user.target is aten.add.Tensor or (is_view(user) and is_lead_op(user, node))
    ):
        nodes.append(user)
        node = user
    return describe_chain(nodes, node.users)


def _match_site(
    ar: AllReduce,
    dialect: Dialect,
    *,
    kernel_limits: bool,
    fp8: bool,
    norms: Sequence[Dialect],
    kind: str = RMS,
) -> Site:
    result = ar.result
    lead = walk_lead(result)
    start = lead[-1] if lead else result
    readers = [dialect, *(d for d in norms if d is not dialect)]
    host_norm = _host_norm(start, readers)
    residual: fx.Node | None = None
    shared: tuple[fx.Node, ...] = ()
    shared_views: tuple[tuple[fx.Node, ...], ...] = ()
    merged: tuple[Merged, ...] = ()
    rest: tuple[fx.Node, ...] = ()
    adds: tuple[fx.Node, ...] = ()
    if host_norm is not None and host_norm.kind == "fused_add":
        residual, total = host_norm.residual, host_norm.total
    elif host_norm is not None:
        total = start
    else:
        total, residual, rest, shared, adds = _residual_add(start)
        shared_views = _views_after_each(shared, adds)
        if residual is not None and not rest:
            shared, shared_views, merged, residual = _merge_terms(
                ar, dialect, shared, shared_views, residual, swap=kind == LAYER
            )
        host_norm = _host_norm(total, readers) if residual is not None and not rest else None
    dtype, shape = val(start).dtype, val(start).shape
    norm: RMSNorm | LayerNorm
    if host_norm is not None:
        if kind == LAYER:  # the hosts' norm ops are RMSNorms
            raise Mismatch(RMSNORM_NOT_HERE)
        norm = RMSNorm(host_norm.weight, host_norm.weight_bias, host_norm.eps, host_norm.out, host_norm.nodes)
    elif rest:
        if kind == LAYER:
            try:
                match_rmsnorm_fp32(rest[-1], total)  # type: ignore[arg-type]
            except Mismatch:
                raise Mismatch("residual added in fp32 before the norm (not a LayerNorm form)") from None
            raise Mismatch(RMSNORM_NOT_HERE)
        # the rounded sum (``residual = h.to(dtype)``) is absent where nothing reads it (the
        # model's final ``x, _ = norm(x, residual)``): the norm's dtype and shape are the sum's
        norm = match_rmsnorm_fp32(rest[-1], total if total is not None else start, rounded=total is not None)
    else:
        norm = _match_norm(total, after_all_reduce=residual is None, kind=kind)  # type: ignore[arg-type]
    if (
        residual is not None
        and not rest
        and total is not None  # None: a host's fused add+norm op whose residual output is unused
        and total.target is aten.add.Tensor
        and residual in total.args[:2]
    ):
        # what the residual is added to: the chain before the last add (its views included)
        _check_residual(start, residual, val(_other_operand(total, residual)).shape)
    else:
        _check_residual(start, residual, shape if residual is None or not shared_views else val(total).shape)
    merged_terms = {m.term for m in merged}
    shared_adds = [a for a in adds if not is_view(a) and not (set(a.args[:2]) & merged_terms)]
    for i, (term, add) in enumerate(zip(shared, shared_adds)):
        after = shared_views[i] if i < len(shared_views) else ()
        if kind == LAYER and _row_parallel_bias(start, term, after):
            continue  # joins the residual first: AR + (b + residual), broadcast over the rows
        _check_residual(start, term, val(add).shape)
    hidden = _check_supported(dtype, shape, kernel_limits)
    group_name = dialect.torch_group_name(ar.group)  # Declined: rejected with the reason
    world_size = _world_size(group_name, kernel_limits)
    # the all-reduce, the lead, then the residual add(s) (in fp32: the upcasts, the add, the
    # rounding); a host's fused add+norm op adds the residual itself (its nodes are the norm's)
    if not (host_norm is not None and host_norm.kind == "fused_add"):
        adds = (*rest, *adds, *((total,) if total is not None else ()))  # type: ignore[assignment]
    merged_nodes = [n for m in merged for n in (*m.nodes, *m.views)]
    head = tuple(dict.fromkeys((*ar.nodes, *lead, *merged_nodes, *adds)))
    quant, quant_skipped = None, None
    if fp8 and kind == RMS:
        try:
            quant = match_fp8_quant(norm.out, {ar.anchor, *head, *norm.nodes})
        except NoQuant:
            pass
        except Mismatch as exc:
            quant_skipped = str(exc)
    return Site(
        all_reduce=ar.anchor,
        x=ar.x,
        group_name=group_name,
        world_size=world_size,
        residual=residual,
        total=total,
        weight=norm.weight,
        weight_bias=norm.weight_bias,
        eps=norm.eps,
        out=norm.out,
        nodes=tuple(dict.fromkeys((*head, *norm.nodes))),
        hidden=hidden,
        dtype=dtype,
        module=module_path(norm.out),
        quant=quant,
        quant_skipped=quant_skipped,
        need_norm_out=quant is None or any(u is not quant.nodes[0] for u in norm.out.users),
        result=result,
        head=ar.nodes,
        dialect=dialect.name,
        host_group=ar.group,
        host_norm=host_norm,
        lead=lead,
        shared=shared,
        shared_views=shared_views,
        merged=merged,
        norm_kind=kind,
        bias=getattr(norm, "bias", None),
    )


def _host_norm(total: fx.Node, dialects: Sequence[Dialect]) -> HostNorm | None:
    for dialect in dialects:
        found = dialect.match_norm(total)
        if found is not None:
            return found
    return None


# ---------------------------------------------------------------------------------------
# the residual add


def _residual_add(
    result: fx.Node,
) -> tuple[fx.Node, fx.Node | None, tuple[fx.Node, ...], tuple[fx.Node, ...], tuple[fx.Node, ...]]:
    """``(total, residual, fp32_nodes, shared, inner_adds)`` after ``result`` (the sum, or
    the lead's last node):

    * ``(add, residual, (), (), ())`` when the sum's only use is ``add(result, residual)``
      (either order) in the activation dtype;
    * ``(add_n, residual, (), (s_1..s_n-1), (add_1..add_n-1))`` for a chain of such adds,
      each the only use of the one before: ``((result + s_1) + ...) + residual`` (a shared
      expert's output joins the residual);
    * ``(rounded, residual, (upcast, residual_upcast, h), (), ())`` when it is added in fp32:
      ``h = add(result.float(), residual.float())`` read by ``rounded = h.to(dtype)`` and
      the norm (SGLang's and vLLM's native RMSNorm with a residual); ``rounded`` is None
      when the graph does not compute it (nothing reads the new residual: the model's
      final ``x, _ = norm(x, residual)``);
    * else ``(result, None, (), (), ())``: the norm must then start at the result itself."""
    add = sole_user(result)
    if add is not None and cast_dtype(add) == torch.float32 and val(result).dtype != torch.float32:
        fp32 = _fp32_residual_add(result, add)
        if fp32 is not None:
            return (*fp32, (), ())
    terms: list[fx.Node] = []
    chain: list[fx.Node] = []  # the adds, and the views keeping H between them
    node = result
    while add is not None:
        if (term := _added_term(add, node)) is not None:
            terms.append(term)
        elif not (terms and is_view(add) and is_lead_op(add, node)):
            break
        chain.append(add)
        node = add
        add = sole_user(add)
    while chain and is_view(chain[-1]):  # the norm starts at the last add
        chain.pop()
    if not chain:
        return result, None, (), (), ()
    return chain[-1], terms[-1], (), tuple(terms[:-1]), tuple(chain[:-1])


def _other_operand(add: fx.Node, term: fx.Node) -> fx.Node:
    a, b = add.args[:2]
    return b if a is term else a  # type: ignore[return-value]


def _merge_terms(
    ar: AllReduce,
    dialect: Dialect,
    shared: tuple[fx.Node, ...],
    shared_views: tuple[tuple[fx.Node, ...], ...],
    residual: fx.Node,
    swap: bool = False,
) -> tuple[tuple[fx.Node, ...], tuple[tuple[fx.Node, ...], ...], tuple[Merged, ...], fx.Node | None]:
    """Merge the added terms that are other all-reduces' sums (:func:`_merge_all_reduces`).
    The last term (what the matcher took for the residual) is merged too when it is another
    all-reduce's sum and no other term stays: ``norm(AR(routed).view(...) + AR(shared))``
    without a residual (AXK1's and Kolibri1's post-MoE norm) is then one site without a
    residual, rather than a site whose residual is the second all-reduce. Returns
    ``(shared, shared_views, merged, residual)``."""
    if not shared and not _sum_of_another(ar, dialect, residual):
        return shared, shared_views, (), residual
    views = shared_views or ((),) * len(shared)
    kept, kept_views, merged = _merge_all_reduces(
        ar, dialect, (*shared, residual), (*views, ()), residual=residual, row_bias=swap
    )
    if kept and kept[-1] is residual:
        return kept[:-1], kept_views[:-1] if shared_views else (), merged, residual
    if not kept:
        return (), (), merged, None
    if swap and len(kept) == 1 and not any(kept_views[0]) and len(merged) == len(shared):
        # ``x + AR(attn) + AR(mlp)`` (Cohere's parallel block): the one term left is the
        # residual stream, added before the other all-reduce: AR(attn + mlp) + x
        # (allreduce_layernorm only: the RMSNorm passes keep their measured forms)
        return (), (), merged, kept[0]
    # a shared term would have to become the residual: leave the residual alone
    if not shared:
        return shared, shared_views, (), residual
    kept, kept_views, merged = _merge_all_reduces(
        ar, dialect, shared, views, residual=residual, row_bias=swap
    )
    return kept, kept_views if shared_views else (), merged, residual


def _sum_of_another(ar: AllReduce, dialect: Dialect, term: fx.Node) -> bool:
    """Cheap check before :func:`_merge_all_reduces`: ``term`` is (a lead of) a node produced
    by another collective of ``dialect``."""
    source = _lead_source(term)
    return any(
        isinstance(found, AllReduce) and found.anchor is not ar.anchor and found.result is source
        for found in dialect.all_reduces(ar.anchor.graph)
    )


def _lead_source(term: fx.Node) -> fx.Node:
    """Walk back from ``term`` through lead ops (views, sums over leading dims, constant
    scales) to the node they start from."""
    return _walk_back(term)[0]


_Gates = tuple[Sequence[fx.Node], Sequence[fx.Node], fx.Node]
"""What :func:`_gated` needs: the all-reduce inputs and sums of the group, the site's residual."""


def _walk_back(
    term: fx.Node, stop: object = (), gates: _Gates | None = None, row_bias: bool = False
) -> tuple[fx.Node, list[fx.Node]]:
    """``(source, nodes)``: the node ``term`` is computed from through lead ops and gates (and
    row-parallel bias adds with ``row_bias``), and those nodes in order (``source``'s user
    first)."""
    source, nodes = term, []
    while source not in stop and source.op == "call_function" and source.args:  # type: ignore[operator]
        previous = _lead_input(source, gates, row_bias)
        if previous is None:
            break
        nodes.insert(0, source)
        source = previous
    return source, nodes


def _lead_input(node: fx.Node, gates: _Gates | None, row_bias: bool = False) -> fx.Node | None:
    """The node ``node`` reads as a lead op (a view, a sum over leading dims, a constant scale,
    or a gate: ``sigmoid(g) * y``; with ``row_bias``, ``y + b`` for a row-parallel bias
    ``b``), or None."""
    first = node.args[0]
    if isinstance(first, fx.Node) and is_lead_op(node, first):
        return first
    if row_bias and (bias := _bias_of(node)) is not None:
        return _other_operand(node, bias)
    if node.target in (aten.mul.Tensor, aten.mul.Scalar):
        for operand in node.args[:2]:
            if isinstance(operand, fx.Node) and is_lead_op(node, operand):
                return operand
        if gates is not None and (gated := _gated(node, *gates)) is not None:
            return gated
    return None


_MATMULS = frozenset(
    {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.embedding.default}
)


def _gated(
    node: fx.Node, inputs: Sequence[fx.Node], sums: Sequence[fx.Node], residual: fx.Node | None
) -> fx.Node | None:
    """For ``node = y * gate`` (either order) with a per-row gate the same on every rank, ``y``;
    else None. Qwen3-Next's and Qwen3.5-MoE's shared expert: ``sigmoid(x @ w_gate) *
    AR(shared)``. The all-reduce is linear in ``y`` for a gate every rank computes alike, so
    ``AR(routed) + gate * AR(shared) = AR(routed + gate * shared)``.

    A gate is taken as the same on every rank when the graph shows it computed from the
    replicated stream: it reads no all-reduce input (a rank's partial sum) other than through
    an all-reduce (whose sum is replicated), and every matmul
    it shares with the all-reduce inputs' computation also feeds the site's residual (the
    replicated residual stream; a tensor-parallel shard's matmul does not). Without a
    residual, no gate is taken."""
    if node.target is not aten.mul.Tensor or residual is None:
        return None
    a, b = node.args[:2]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or a is b:
        return None
    for y, gate in ((a, b), (b, a)):
        yv, gv, out = y.meta.get("val"), gate.meta.get("val"), node.meta.get("val")
        if not all(isinstance(v, torch.Tensor) for v in (yv, gv, out)):
            continue
        if gv.dtype != yv.dtype or out.dtype != yv.dtype or gv.dim() != yv.dim() or yv.dim() == 0:
            continue
        if not (same_shape(gv.shape[-1:], (1,)) and same_shape(gv.shape[:-1], yv.shape[:-1])):
            continue
        if not same_shape(out.shape, yv.shape):
            continue
        # the all-reduces in question: the site's own and the one ``y`` is the sum of
        # (later layers' all-reduces read everything before them, this gate included)
        behind = _ancestors([y], frozenset(sums))
        local = [x for i, (x, total) in enumerate(zip(inputs, sums)) if i == 0 or total in behind]
        if _replicated(gate, local, sums, residual):
            return y
    return None


def _bias_of(add: fx.Node) -> fx.Node | None:
    """For ``add = y + b`` (either order, alpha 1) where ``b`` is a replicated bias of the
    hidden size (a graph input or attribute, ``[hidden]``, in ``y``'s dtype: a row-parallel
    projection's bias, added after its all-reduce on every rank), ``b``; else None."""
    if add.target is not aten.add.Tensor or add.kwargs.get("alpha", 1) != 1:
        return None
    a, b = add.args[:2]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or a is b:
        return None
    for y, bias in ((a, b), (b, a)):
        if bias.op not in ("placeholder", "get_attr"):
            continue
        yv, bv = y.meta.get("val"), bias.meta.get("val")
        if not (isinstance(yv, torch.Tensor) and isinstance(bv, torch.Tensor)) or yv.dim() == 0:
            continue
        if bv.dim() == 1 and bv.dtype == yv.dtype and same_shape(bv.shape, yv.shape[-1:]):
            return bias
    return None


def _ancestors(nodes: Sequence[fx.Node], stop: frozenset[fx.Node] = frozenset()) -> set[fx.Node]:
    """``nodes`` and what they are computed from (not looking behind the ``stop`` nodes)."""
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node not in stop:
            stack.extend(node.all_input_nodes)
    return seen


def _replicated(gate: fx.Node, inputs: Sequence[fx.Node], sums: Sequence[fx.Node], residual: fx.Node) -> bool:
    """See :func:`_gated` (``inputs``: the inputs of the all-reduces summed at the site)."""
    of_gate = _ancestors([gate], frozenset(sums))
    if any(x in of_gate for x in inputs):
        return False
    of_residual = _ancestors([residual])
    shared = of_gate & _ancestors(inputs)
    return all(n in of_residual for n in shared if n.op == "call_function" and n.target in _MATMULS)


def _merge_all_reduces(
    ar: AllReduce,
    dialect: Dialect,
    shared: tuple[fx.Node, ...],
    shared_views: tuple[tuple[fx.Node, ...], ...],
    *,
    residual: fx.Node | None = None,
    row_bias: bool = False,
) -> tuple[tuple[fx.Node, ...], tuple[tuple[fx.Node, ...], ...], tuple[Merged, ...]]:
    """Split the shared terms into those that are another all-reduce's sum (same dialect,
    group and sum; read only here, through views keeping the hidden dim), merged into the
    site, and the others. With ``row_bias`` and a residual, a row-parallel bias added after
    the other all-reduce is read through (it joins the residual). Returns ``(shared,
    shared_views, merged)``."""
    others = {
        found.result: found
        for found in dialect.all_reduces(ar.anchor.graph)
        if isinstance(found, AllReduce) and found.anchor is not ar.anchor and found.group == ar.group
    }
    kept: list[fx.Node] = []
    kept_views: list[tuple[fx.Node, ...]] = []
    merged: list[Merged] = []
    for term, after in zip(shared, shared_views):
        gates = (
            ([ar.x, *(o.x for o in others.values())], [ar.result, *others], residual)
            if residual is not None
            else None
        )
        source, views = _walk_back(term, others, gates, row_bias=row_bias and residual is not None)
        other = others.get(source)
        single_use = all(len(n.users) == 1 for n in (source, *views))
        if other is None or not single_use:
            kept.append(term)
            kept_views.append(after)
            continue
        bias_adds = tuple(n for n in views if n.target is aten.add.Tensor)
        merged.append(
            Merged(other.anchor, other.x, other.result, term, other.nodes, tuple(views), after, bias_adds)
        )
    return tuple(kept), tuple(kept_views), tuple(merged)


def _views_after_each(
    shared: tuple[fx.Node, ...], chain: tuple[fx.Node, ...]
) -> tuple[tuple[fx.Node, ...], ...]:
    """For each shared term (the i-th add of ``chain``), the views of ``chain`` after its add."""
    out: list[tuple[fx.Node, ...]] = []
    adds = [i for i, node in enumerate(chain) if not is_view(node)]
    for i in adds[: len(shared)]:
        out.append(tuple(n for n in chain[i + 1 :] if is_view(n)))
    return tuple(out)


def _added_term(add: fx.Node, node: fx.Node) -> fx.Node | None:
    """The other operand of ``add(node, other)`` (either order, alpha 1), if a node."""
    if add.target is not aten.add.Tensor or add.kwargs.get("alpha", 1) != 1:
        return None
    a, b = add.args[:2]
    other = b if a is node else a
    if not isinstance(other, fx.Node) or other is node:
        return None
    return other


def _fp32_residual_add(result: fx.Node, up: fx.Node) -> tuple[fx.Node, fx.Node, tuple[fx.Node, ...]] | None:
    h = sole_user(up)
    if h is None or h.target is not aten.add.Tensor or h.kwargs.get("alpha", 1) != 1:
        return None
    a, b = h.args[:2]
    other = b if a is up else a
    if not isinstance(other, fx.Node) or other is up or cast_dtype(other) != torch.float32:
        return None
    residual = other.args[0]
    if not isinstance(residual, fx.Node) or len(other.users) != 1:
        return None
    dtype = val(result).dtype
    rounded = [u for u in h.users if cast_dtype(u) == dtype]
    if len(rounded) > 1:
        return None
    if not rounded and not same_shape(val(residual).shape, val(result).shape):
        return None  # without the rounding, nothing else shows the sum's shape: no broadcast
    return (rounded[0] if rounded else None), residual, (up, other, h)


def _row_parallel_bias(result: fx.Node, term: fx.Node, after: Sequence[fx.Node]) -> bool:
    """Whether the added ``term`` is a row-parallel projection's bias, added after the
    all-reduce (Hugging Face's ``tp_plan`` for Starcoder2, GPT-NeoX, Phi...: ``AR(x @ w) +
    b``): ``[hidden]``, in the sum's dtype, followed only by copies (``clone``: dropout in
    eval), so ``b + residual`` broadcasts to the residual's shape. Taken by
    ``allreduce_layernorm`` only (its op adds the residual after the all-reduce; the bias
    joins the residual first, the sum rounded once less than eager's, as a shared term)."""
    tval, rval = val(term), val(result)
    if tval.dim() != 1 or tval.dtype != rval.dtype or not same_shape(tval.shape, rval.shape[-1:]):
        return False
    return all(n.target in (aten.clone.default, aten.alias.default) for n in after)


def _check_residual(result: fx.Node, residual: fx.Node | None, shape: torch.Size) -> None:
    """``residual`` is added to a tensor of ``shape`` (the sum's, or after views keeping
    the hidden dim): same shape (no broadcast), same dtype as the sum ``result``."""
    if residual is None:
        return
    rval, wval = val(residual), val(result)
    if rval.dtype != wval.dtype:
        raise Mismatch(f"residual is {dtype_str(rval.dtype)} but the all-reduce is {dtype_str(wval.dtype)}")
    if not (same_shape(rval.shape, shape) and same_shape(wval.shape[-1:], shape[-1:])):
        raise Mismatch(f"residual add broadcasts ({shape_str(shape)} + {shape_str(rval.shape)})")


# ---------------------------------------------------------------------------------------
# the RMSNorm (its forms: passkit_fusion.patterns.rmsnorm)


def _match_norm(total: fx.Node, *, after_all_reduce: bool, kind: str = RMS) -> RMSNorm | LayerNorm:
    """The norm of ``kind`` (RMSNorm or LayerNorm) whose input is ``total``. ``total``'s
    other users are fine (they will read ``residual_out``); every node inside the norm must
    be used only by the norm. A norm of the other kind is rejected with the reason naming
    the pass that fuses it."""
    match, other, taken = (
        (match_rmsnorm, match_layernorm, LAYERNORM_NOT_HERE)
        if kind == RMS
        else (match_layernorm, match_rmsnorm, RMSNORM_NOT_HERE)
    )
    try:
        return match(total)
    except NoNorm:
        if (through := _through_a_copy(total, match)) is not None:
            return through
        if _matches(other, total):
            raise Mismatch(taken) from None
        if any(_is_fused_site(u) for u in total.users):
            raise Mismatch(JOINS_A_FUSED_SITE) from None
        if _scaled_then_added(total):
            raise Mismatch(SCALED_AFTER_SUM) from None
        shared = after_all_reduce and len(total.users) > 1
        adds = [u for u in total.users if u.target is aten.add.Tensor]
        if shared and adds:
            if any(_norm_follows(add) for add in adds):
                raise Mismatch("all-reduce result is also used outside the residual add") from None
            # a post-norm model's embedding: read by the first layer and its residual add, and
            # no norm reads either (the norms are on the blocks' outputs)
            name = "RMSNorm" if kind == RMS else "LayerNorm"
            raise Mismatch(f"{NO_NORM_FOLLOWS} (no {name} reads the sum or its residual add)") from None
        raise


def _through_a_copy(total: fx.Node, match: Any) -> RMSNorm | LayerNorm | None:
    """The norm of a contiguous copy of ``total`` (``x.contiguous()`` before the norm, where
    the residual stream is not contiguous: a transposed input), the copy then one of the
    norm's nodes; None when no copy of ``total`` is read by a norm of ``match``'s kind alone."""
    for copy in list(total.users):
        if not (
            copy.target is aten.clone.default
            and copy.args[0] is total
            and not copy.kwargs.keys() - {"memory_format"}
            and copy.kwargs.get("memory_format", torch.contiguous_format) == torch.contiguous_format
        ):
            continue
        try:
            norm = match(copy)
        except Mismatch:
            continue
        if all(u in norm.nodes for u in copy.users):  # the copy is the norm's alone
            return dataclasses.replace(norm, nodes=(copy, *norm.nodes))
    return None


JOINS_A_FUSED_SITE = (
    "its sum is added into another site's residual, fused before it (not merged into that "
    "site: a term other than a view, a constant scale, a replicated gate or a row-parallel "
    "bias follows this all-reduce)"
)
"""The reason given for an all-reduce whose sum joins a site already fused without being
merged into it (GPT-NeoX's and Phi's parallel block with row-parallel biases, ``AR(attn) + b
+ AR(mlp) + b' + x``, is merged by ``allreduce_layernorm``; the RMSNorm passes take no
row-parallel bias)."""


def _is_fused_site(node: fx.Node) -> bool:
    target = getattr(node, "target", None)
    return getattr(target, "namespace", None) == "passkit_fusion" and "norm" in str(target)


NO_NORM_FOLLOWS = "no norm follows"
"""The reason given for an all-reduce whose sum no norm reads, not even after a residual add."""


SCALED_AFTER_SUM = (
    "a constant scale after the all-reduce's sum with another term, then the residual add and "
    "the norm ((AR + t) * c + residual: Granite's residual_multiplier after the MoE sum): "
    "this form is not taken"
)
"""The reason given where a sum is scaled between its add and the residual add that a norm reads."""


def _scaled_then_added(total: fx.Node) -> bool:
    """Whether ``total`` is only scaled by a constant, then (through views) added to (the
    residual), and a norm reads that add."""
    scale = sole_user(total)
    if scale is None or scale.target not in (aten.mul.Tensor, aten.mul.Scalar):
        return False
    if not any(isinstance(a, (int, float)) and not isinstance(a, bool) for a in scale.args[:2]):
        return False
    after = sole_user(scale)
    while after is not None and is_view(after):  # a reshape back to the stream's shape
        after = sole_user(after)
    return after is not None and after.target is aten.add.Tensor and _norm_follows(after)


def _norm_follows(add: fx.Node) -> bool:
    """Whether an RMSNorm or a LayerNorm reads ``add``."""
    return _matches(match_rmsnorm, add) or _matches(match_layernorm, add)


def _matches(match: object, node: fx.Node) -> bool:
    try:
        match(node)  # type: ignore[operator]
    except Mismatch:
        return False
    return True


# ---------------------------------------------------------------------------------------
# what the kernel supports


def _check_supported(dtype: torch.dtype, shape: torch.Size, kernel_limits: bool = True) -> int:
    if dtype not in SUPPORTED_DTYPES:
        raise Mismatch(f"dtype {dtype_str(dtype)} not supported by the fused kernel")
    hidden = shape[-1]
    if not kernel_limits:
        return hidden  # type: ignore[return-value]
    if not isinstance(hidden, int):
        raise Mismatch(f"hidden size {hidden} is symbolic")
    if hidden % HIDDEN_MULTIPLE:
        raise Mismatch(f"hidden size {hidden} is not a multiple of {HIDDEN_MULTIPLE}")
    if hidden > MAX_HIDDEN:
        raise Mismatch(f"hidden size {hidden} is above {MAX_HIDDEN}")
    return hidden


def _world_size(group_name: str, kernel_limits: bool = True) -> int:
    size = group_world_size(group_name)
    if kernel_limits and size not in SUPPORTED_WORLD_SIZES:
        sizes = ", ".join(map(str, SUPPORTED_WORLD_SIZES))
        raise Mismatch(f"world size {size} not supported by the fused kernel ({sizes})")
    return size
