"""The sequence-parallel rewrite of ``all_reduce -> (add residual) -> RMSNorm`` sites.

Per site (found by :mod:`passkit_fusion.allreduce_rmsnorm.matcher`, without the fused kernel's limits)::

    x2   = reshape(x, [-1, H])                                  # 3-D: tokens B*S flattened
    part = wait_tensor(reduce_scatter_tensor(x2, "sum", W, g))  # this rank's T/W summed rows
    res  = <residual's shard>                                   # see below
    tot  = add(part, res)                                       # the residual stream, sharded
    n    = <the site's own RMSNorm nodes, copied, on tot>       # same ops: same numerics
    out  = wait_tensor(all_gather_into_tensor(n, W, g))         # [T, H], replicated again
    out  = reshape(out, x.shape)                                # 3-D only

The residual's shard is the previous site's sharded sum when the residual is that site's
sum (middle sites: the residual stream stays sharded between layers), else
``token_shard(reshape(residual, [-1, H]), g)`` (first site: a replicated residual, sliced
without communication). Users of a site's sum other than the next site (the model's
output, a user outside any site: the last site) read an all-gather of the shard.

Symbolic token counts: the shard has ``T // W`` rows and the gather ``W * (T // W)``, which
the shape environment cannot prove equal to ``T`` without a guard (and a guard added here
would constrain every specialization sharing the environment). The gathered tensor is
therefore re-labelled ``[T, H]`` with ``as_strided`` (no copy; exact because the token
range of the compile guarantees ``T % W == 0``). Static token counts need no re-labelling:
``all_gather -> (reshape ->) mm`` stays what torch's micro-pipeline TP matcher looks for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.fx.node import map_arg

from ..allreduce_rmsnorm.matcher import Site
from ..patterns import marks
from . import ops as _ops  # noqa: F401  (registers torch.ops.passkit_fusion.token_shard)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclasses.dataclass
class Shard:
    """A site's sharded sum and what is needed to gather it again."""

    node: fx.Node
    """``[T / W, H]``"""
    group_name: str
    world_size: int
    rows: fx.Node
    """A 2-D ``[T, H]`` node (the site's ``x2``), for the symbolic token count ``T``."""
    like: fx.Node
    """The replicated node the shard stands for (its shape is restored on gathers)."""
    site: int


@dataclasses.dataclass
class Outcome:
    sliced: int = 0
    """sites whose replicated residual was sliced with ``token_shard`` (first sites)"""
    sharded: int = 0
    """sites whose residual was already sharded (middle sites)"""
    no_residual: int = 0
    gathered: int = 0
    """residual sums gathered for users outside the sites (last sites, other users)"""


class Rewriter:
    """Rewrites sites of one graph; call :meth:`site` for each, in graph order, then
    :meth:`finish`."""

    def __init__(self, graph: fx.Graph, pass_name: str):
        from torch._guards import detect_fake_mode

        self.graph = graph
        self.pass_name = pass_name
        vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
        self.fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
        self.shards: dict[fx.Node, Shard] = {}
        self.dead: set[fx.Node] = set()
        self.outcome = Outcome()
        self._site = 0

    # -- node creation ----------------------------------------------------------------
    def _call(self, target: Any, args: tuple[Any, ...], like: fx.Node | None = None) -> fx.Node:
        node = self.graph.call_function(target, args)
        self._propagate(node, like)
        return node

    def _propagate(self, node: fx.Node, like: fx.Node | None) -> None:
        vals = map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
        if self.fake_mode is None:
            raise RuntimeError("sequence_parallel: the graph's tensors carry no fake values")
        with self.fake_mode:
            node.meta["val"] = node.target(*vals[0], **vals[1])  # type: ignore[operator]
        if like is not None and "stack_trace" in like.meta:
            node.meta["stack_trace"] = like.meta["stack_trace"]
        marks.mark(node, self.pass_name, self._site)

    def _to_2d(self, node: fx.Node) -> fx.Node:
        val = node.meta["val"]
        if val.dim() == 2:
            return node
        return self._call(aten.reshape.default, (node, [-1, val.shape[-1]]), like=node)

    def _sizes(self, node: fx.Node, shape: Sequence[Any]) -> list[Any]:
        """``shape`` as reshape arguments: ints, and ``sym_size`` nodes of ``node`` for the
        symbolic dims (``node``'s shape is ``shape``)."""
        return [
            s if isinstance(s, int) else self._call(aten.sym_size.int, (node, i)) for i, s in enumerate(shape)
        ]

    # -- the rewrite --------------------------------------------------------------------
    def site(self, site: Site) -> None:
        """Replace ``site``: its norm's users read the gathered norm output; its sum stays
        sharded for the next site (and is gathered in :meth:`finish` for other users)."""
        g, w = site.group_name, site.world_size
        with self.graph.inserting_before(site.out):
            x2 = self._to_2d(site.x)
            part = self._call(c10d.reduce_scatter_tensor.default, (x2, "sum", w, g), like=site.x)
            part = self._call(c10d.wait_tensor.default, (part,), like=site.x)
            if site.residual is None:
                total = part
                self.outcome.no_residual += 1
            else:
                res = self._residual_shard(site.residual, g, w)
                a = site.total.args[0]  # keep the add's operand order
                total = self._call(
                    aten.add.Tensor, (part, res) if a is not site.residual else (res, part), like=site.total
                )
            env: dict[fx.Node, fx.Node] = {site.total: total}
            head = site.nodes.index(site.total)
            norm_nodes = site.nodes[head + 1 :]
            position = {n: i for i, n in enumerate(self.graph.nodes)}
            for node in sorted(norm_nodes, key=position.__getitem__):
                copy = self.graph.node_copy(node, lambda a: env.get(a, a))
                if copy.target is aten.mean.dim:  # over the hidden dim, counted from the end
                    copy.args = (copy.args[0], [-1], *copy.args[2:])
                copy.meta = {k: v for k, v in node.meta.items() if k != "val"}
                self._propagate(copy, node)
                env[node] = copy
            out = self._gather(Shard(env[site.out], g, w, x2, site.out, self._site))
        site.out.replace_all_uses_with(out)
        self.shards[site.total] = Shard(total, g, w, x2, site.total, self._site)
        self.dead.update(site.nodes)
        self._site += 1

    def _residual_shard(self, residual: fx.Node, group_name: str, world_size: int) -> fx.Node:
        known = self.shards.get(residual)
        if known is not None and known.group_name == group_name:
            self.outcome.sharded += 1
            return known.node
        self.outcome.sliced += 1
        return self._call(torch.ops.passkit_fusion.token_shard.default, (self._to_2d(residual), group_name))

    def _gather(self, shard: Shard) -> fx.Node:
        """All-gather ``shard`` and give it ``shard.like``'s shape. Inserted at the current
        insertion point."""
        like = shard.like.meta["val"]
        gathered = self._call(
            c10d.all_gather_into_tensor.default,
            (shard.node, shard.world_size, shard.group_name),
            like=shard.like,
        )
        gathered = self._call(c10d.wait_tensor.default, (gathered,), like=shard.like)
        rows = gathered.meta["val"].shape[0]
        tokens = shard.rows.meta["val"].shape[0]
        if not _statically_equal(rows, tokens):
            hidden = like.shape[-1]
            t = self._call(aten.sym_size.int, (shard.rows, 0))
            gathered = self._call(
                aten.as_strided.default, (gathered, [t, hidden], [hidden, 1]), like=shard.like
            )
        if like.dim() != 2:
            sizes = self._sizes(_producer_with_shape(shard), like.shape)
            gathered = self._call(aten.reshape.default, (gathered, sizes), like=shard.like)
        return gathered

    def finish(self) -> None:
        """Gather the sharded sums that other nodes still read, erase the replaced nodes."""
        for total, shard in self.shards.items():
            outside = [u for u in total.users if u not in self.dead]
            if not outside:
                continue
            self._site = shard.site
            with self.graph.inserting_after(shard.node):
                full = self._gather(shard)
            for user in outside:
                user.replace_input_with(total, full)
            self.outcome.gathered += 1
        position = {n: i for i, n in enumerate(self.graph.nodes)}
        for node in sorted(self.dead, key=position.__getitem__, reverse=True):
            if not node.users:
                self.graph.erase_node(node)
        from torch._inductor.pattern_matcher import stable_topological_sort

        stable_topological_sort(self.graph)


def _producer_with_shape(shard: Shard) -> fx.Node:
    """A node with ``shard.like``'s shape defined before the gather: ``rows`` is the 2-D view
    of the site's all-reduce input, whose shape is the sum's; its argument is that input."""
    rows = shard.rows
    if rows.target is aten.reshape.default and isinstance(rows.args[0], fx.Node):
        return rows.args[0]
    return rows


def _statically_equal(a: Any, b: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


# ---------------------------------------------------------------------------------------
# token counts


def token_count(site: Site) -> Any:
    """The site's token count: the product of every dim but the last (an int or SymInt)."""
    count: Any = 1
    for size in site.total.meta["val"].shape[:-1]:
        count = count * size
    return count


def token_symbol(graph: fx.Graph) -> sympy.Symbol | None:
    """The symbol of the token dimension as passkit's backend finds it: the first dynamic
    dim of the graph's tensor inputs (None for static graphs)."""
    for node in graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for size in val.shape:
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                return size.node.expr
    return None


def divisible_by_token_symbol(count: Any, symbol: sympy.Symbol | None) -> bool:
    """Whether ``count`` (symbolic) is ``symbol`` times an integer polynomial: then every
    token count that is a multiple of W makes ``count`` one too."""
    if symbol is None or not isinstance(count, torch.SymInt):
        return False
    expr = count.node.expr
    if symbol not in expr.free_symbols or expr.subs(symbol, 0) != 0:
        return False
    try:
        poly = sympy.Poly(expr, *sorted(expr.free_symbols, key=str))
    except sympy.PolynomialError:
        return False
    return all(c.is_integer for c in poly.coeffs())
