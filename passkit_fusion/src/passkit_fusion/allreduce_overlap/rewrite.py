"""Find ``mm -> (views) -> all_reduce -> wait_tensor`` and split it along the matmul's rows.

With ``transport="copy_engine"`` (:meth:`Rewriter.fuse`) the site becomes one op,
``passkit_fusion.matmul_all_reduce(a, b, group, chunks, ...)``, which chunks the rows itself
and moves each chunk on the copy engines (:mod:`.runtime`). Where the sum is followed by a
residual add and an RMSNorm (``allreduce_rmsnorm``'s sites, found by the same matcher,
:func:`passkit_fusion.patterns.sites.candidates`), :meth:`Rewriter.fuse_norm` makes the
site ``matmul_all_reduce_rmsnorm(a, b, residual, weight, eps, ...)`` instead: the partials'
sum is then never written on its own (:func:`norm_site_matmul` says which sites qualify). With ``transport="nccl"``
(:meth:`Rewriter.split`) ``y = all_reduce(mm(a, b))`` becomes, for ``k`` chunks of ``a``'s
rows (the tokens)::

    y_i = all_reduce(mm(a[i*c : (i+1)*c], b))      # i = 0..k-1, c = rows // k (the last
    y   = cat([wait(y_0), ..., wait(y_k-1)], 0)    #   chunk ends at the last row)

with the ``k`` matmuls and all-reduces first, in chunk order, and the waits where the first
reader of the old result was: chunk ``i``'s all-reduce (NCCL's stream) runs while chunk
``i+1``'s matmul runs on the compute stream. Row ``r`` of ``y`` is the same sum of the same
rows as before: only the matmul's work is split, not a reduction.

Only torch's functional all-reduce (``_c10d_functional.all_reduce``, sum) is read: the
graphs of plain ``torch.compile`` with DTensor or functional collectives. Hosts' own
collectives are left with a reason.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from ..patterns import marks
from ..patterns.sites import rebind_outputs
from .triton_kernel import MAX_HIDDEN

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


@dataclasses.dataclass
class Site:
    """One all-reduce of a matmul's output: ``mm`` -> ``views`` -> ``all_reduce`` -> ``wait``."""

    mm: fx.Node
    views: list[fx.Node]
    all_reduce: fx.Node
    wait: fx.Node


def _single_user(node: fx.Node) -> bool:
    return len(node.users) == 1


def _matmul_before(x: Any) -> tuple[fx.Node, list[fx.Node]] | str:
    """The ``aten.mm`` whose output reaches ``x`` through views read only there, and those
    views in order; or why not."""
    views: list[fx.Node] = []
    src = x
    while isinstance(src, fx.Node) and src.target in VIEWS and _single_user(src):
        views.insert(0, src)
        src = src.args[0]
    if not isinstance(src, fx.Node) or src.target is not aten.mm.default:
        what = src.target if isinstance(src, fx.Node) else type(src).__name__
        return f"its input is not a matmul's output ({what})"
    if not _single_user(src):
        return "the matmul's output is also read elsewhere"
    return src, views


def norm_site_matmul(site: Any) -> tuple[fx.Node, list[fx.Node]] | str | None:
    """For an ``all_reduce -> add residual -> RMSNorm`` site of
    :func:`passkit_fusion.patterns.sites.candidates`: the matmul (and the views after it)
    that ``matmul_all_reduce_rmsnorm`` can take the site from, why it cannot (the plain
    ``mm -> all_reduce`` rewrite may still take it), or None when no matmul feeds it (not
    this pass's site: the plain matcher says why)."""
    from ..patterns.lead import is_view
    from ..patterns.sites import RMS

    matmul = _matmul_before(site.x)
    if isinstance(matmul, str):
        return None

    if site.dialect != "torch" or site.host_norm is not None:
        return f"a {site.dialect} host's all-reduce or norm op"
    if site.norm_kind != RMS or site.quant is not None or site.merged or site.shared:
        return "not a plain residual add + RMSNorm (LayerNorm, FP8 output, merged or shared terms)"
    if site.residual is None or site.total is None or site.weight is None:
        return "no residual add read afterwards, or a norm without a weight"
    if not all(is_view(n) for n in (*site.lead, *site.chain_views)):
        return "a scale between the all-reduce and the residual add"
    if site.hidden > MAX_HIDDEN:
        return f"hidden size {site.hidden} above the norm kernel's {MAX_HIDDEN}"
    return matmul


def find(graph: fx.Graph) -> tuple[list[Site], list[str]]:
    """The sites of ``graph``, and a reason for each all-reduce that is not one."""
    sites: list[Site] = []
    reasons: list[str] = []
    for ar in graph.find_nodes(op="call_function", target=c10d.all_reduce.default):
        waits = [u for u in ar.users if u.target is c10d.wait_tensor.default]
        if len(ar.args) < 3 or ar.args[1] != "sum":
            reasons.append(f"{ar.name}: not a sum")
            continue
        if len(waits) != 1 or len(ar.users) != 1:
            reasons.append(f"{ar.name}: read other than through one wait_tensor")
            continue
        found = _matmul_before(ar.args[0])
        if isinstance(found, str):
            reasons.append(f"{ar.name}: {found}")
            continue
        sites.append(Site(found[0], found[1], ar, waits[0]))
    return sites, reasons


class Rewriter:
    """Rewrites the sites of one graph (``chunks`` each)."""

    def __init__(
        self,
        graph: fx.Graph,
        pass_name: str,
        chunks: int,
        max_tokens: int = 0,
        timeout_s: float = 180.0,
        lanes: int = 1,
    ):
        from torch._guards import detect_fake_mode

        self.graph = graph
        self.pass_name = pass_name
        self.chunks = chunks
        vals = [n.meta.get("val") for n in graph.nodes]
        self.fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
        if self.fake_mode is None:
            raise RuntimeError(f"{pass_name}: the graph's tensors carry no fake values")
        self._index = 0
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.lanes = lanes

    def _call(self, target: Any, args: tuple[Any, ...], like: fx.Node) -> fx.Node:
        node = self.graph.call_function(target, args)
        vals = map_arg(node.args, lambda a: a.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*vals)
        if "stack_trace" in like.meta:
            node.meta["stack_trace"] = like.meta["stack_trace"]
        marks.mark(node, self.pass_name, self._index)
        return node

    def fuse(self, site: Site) -> None:
        """Replace ``site`` by one ``passkit_fusion.matmul_all_reduce`` (copy-engine transport)."""
        from . import ops  # registers the op

        group = site.all_reduce.args[2]
        args = (
            site.mm.args[0],
            site.mm.args[1],
            group,
            self.chunks,
            self.lanes,
            self.max_tokens,
            self.timeout_s,
        )
        with self.graph.inserting_before(site.mm):
            out = self._call(ops.matmul_all_reduce_op(), args, like=site.all_reduce)
        with self.graph.inserting_after(out):
            for view in site.views:  # the old views, on the whole sum
                out = self._call(view.target, (out, *view.args[1:]), like=view)
        self._replace(site, out)

    def fuse_norm(self, site: Any, mm: fx.Node, views: list[fx.Node]) -> bool:
        """Replace an ``allreduce_rmsnorm``-style ``site`` (its all-reduce fed by ``mm``
        through ``views``) by one ``passkit_fusion.matmul_all_reduce_rmsnorm``; False: no
        topological sort needed (the op goes where the residual add was, after its inputs)."""
        from . import ops  # registers the op

        args = (
            mm.args[0], mm.args[1], site.residual, site.weight, site.eps, site.weight_bias,
            site.group_name, self.chunks, self.lanes, self.max_tokens, self.timeout_s,
        )  # fmt: skip
        with self.graph.inserting_before(site.total):
            fused = self._call(ops.matmul_all_reduce_rmsnorm_op(), args, like=site.out)
            norm_out = self._call(operator.getitem, (fused, 0), like=site.out)
            residual_out = self._call(operator.getitem, (fused, 1), like=site.total)
        rebind_outputs(
            self.graph,
            site,
            norm_out,
            residual_out,
            _position(self.graph),
            replaced=(*site.nodes, *views, mm),
        )
        if not getattr(site.all_reduce, "_erased", False):
            raise RuntimeError(f"{self.pass_name}: {site.all_reduce.name} is still read after the rewrite")
        self._index += 1
        return False

    def split(self, site: Site) -> None:
        """Replace ``site`` by its chunks."""
        a, b = site.mm.args[0], site.mm.args[1]
        rows = a.meta["val"].shape[0]
        reduce_op, group = site.all_reduce.args[1], site.all_reduce.args[2]
        with self.graph.inserting_before(site.mm):
            if isinstance(rows, int):
                size: Any = rows // self.chunks
                total: Any = rows
            else:
                total = self._call(aten.sym_size.int, (a, 0), like=site.mm)
                size = self._call(operator.floordiv, (total, self.chunks), like=site.mm)

            def row(k: int) -> Any:
                """The first row of chunk ``k`` (an int, or a node computing it)."""
                if k == 0:
                    return 0
                if k == self.chunks:  # the last chunk ends at the last row
                    return total
                return (
                    size * k if isinstance(size, int) else self._call(operator.mul, (size, k), like=site.mm)
                )

            from . import ops  # registers the plan-checked all-reduce

            plan = self._nccl_plan(b)
            reduced = []
            for i in range(self.chunks):
                start, end = row(i), row(i + 1)
                part = self._call(aten.slice.Tensor, (a, 0, start, end), like=site.mm)
                product = self._call(aten.mm.default, (part, b), like=site.mm)
                if i == 0:  # the ranks agree on the split before its first all-reduce
                    args = (product, reduce_op, group, plan, self.timeout_s)
                    reduced.append(self._call(ops.agreed_all_reduce_op(), args, like=site.all_reduce))
                    continue
                reduced.append(
                    self._call(c10d.all_reduce.default, (product, reduce_op, group), like=site.all_reduce)
                )
        first_reader = min(site.wait.users, key=_position(self.graph)) if site.wait.users else site.wait
        with self.graph.inserting_before(first_reader):
            waited = [self._call(c10d.wait_tensor.default, (r,), like=site.wait) for r in reduced]
            out = self._call(aten.cat.default, (waited, 0), like=site.wait)
            for view in site.views:  # the old views, on the whole sum
                out = self._call(view.target, (out, *view.args[1:]), like=view)
        self._replace(site, out)

    def _nccl_plan(self, b: fx.Node) -> str:
        """What every rank's split of a site must share (JSON): the transport, the chunks,
        the columns and dtype of the product."""
        import json

        val = b.meta["val"]
        return json.dumps(
            {
                "transport": "nccl",
                "chunks": self.chunks,
                "columns": str(val.shape[-1]),
                "dtype": str(val.dtype),
            },
            sort_keys=True,
        )

    def _replace(self, site: Site, out: fx.Node) -> None:
        site.wait.replace_all_uses_with(out)
        for node in (site.wait, site.all_reduce, *reversed(site.views), site.mm):
            self.graph.erase_node(node)
        self._index += 1


def _position(graph: fx.Graph) -> Any:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: order[n]
