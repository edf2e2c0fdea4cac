"""The sequence-parallel rewrite of ``all_reduce -> (add residual) -> RMSNorm`` sites.

Per site (found by :mod:`passkit_fusion.patterns.sites` in any host's dialect, without the
fused kernel's limits)::

    x2   = reshape(x, [-1, H])                                  # 3-D: tokens B*S flattened
    part = wait_tensor(reduce_scatter_tensor(x2, "sum", W, g))  # this rank's T/W summed rows
    res  = <residual's shard>                                   # see below
    tot  = add(part, res)                                       # the residual stream, sharded
    n    = <the site's own RMSNorm nodes, copied, on tot>       # same ops: same numerics
    out  = wait_tensor(all_gather_into_tensor(n, W, g))         # [T, H], replicated again
    out  = reshape(out, x.shape)                                # 3-D only

Between the sum and the add (the site's lead), views keeping the hidden dim are the identity
on the ``[T / W, H]`` shard and constant scales are copied onto it (after the
reduce-scatter, as eager scales after the all-reduce: the same numerics); terms added before
the residual (a shared expert's output) are sliced like a first site's residual.

The residual's shard is the previous site's sharded sum when the residual is that site's
sum (middle sites: the residual stream stays sharded between layers), or that site's norm
output on the shard when the residual is that norm's output (a norm without a weight whose
output is the residual stream: nanochat's first norm, on the embedding), else
``token_shard(reshape(residual, [-1, H]), g)`` (first site: a replicated residual, sliced
without communication). Users of a site's sum other than the next site (the model's
output, a user outside any site: the last site) read an all-gather of the shard.

Symbolic token counts: the shard has ``T // W`` rows and the gather ``W * (T // W)``, which
the shape environment cannot prove equal to ``T`` without a guard (and a guard added here
would constrain every specialization sharing the environment). The gathered tensor is
therefore re-labelled ``[T, H]`` with ``as_strided`` (no copy; exact because the token
range of the compile guarantees ``T % W == 0``).

Matmuls reading the gathered rows (``mm`` on the 2-D ``[T, H]`` tensor, directly or through
reshapes such as 3-D ``[B, S, H] -> [B*S, H]``) are then re-routed to read the gathered tensor
itself, and the re-labelling moves after them, onto their ``[W * (T // W), N]`` result::

    g   = wait_tensor(all_gather_into_tensor(n, W, grp))   # [W*(T//W), H]
    y   = mm(g, w)                                         # what torch's matcher fuses
    y   = as_strided(y, [T, N], [N, 1])                    # symbolic T only

so that ``all_gather -> mm`` is what torch's micro-pipeline TP matcher (``async_tp``) sees,
for static and symbolic token counts, 2-D and 3-D alike. The other consumers keep reading
the re-labelled (and reshaped) gather. On the reduce-scatter side the all-reduce input is
taken 2-D where it is a reshape of a 2-D tensor (3-D: ``mm -> reshape [B, S, H]``), so the
reduce-scatter reads the matmul itself (``mm -> reduce_scatter``). Symbolic sizes the rewrite
needs are read from the graph's inputs (a SymInt placeholder, or ``sym_size`` of an input),
never from a matmul's result, which would give it a second user and stop that fusion.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.fx.node import map_arg

from ..patterns import marks
from ..patterns.lead import is_view, mixes_rows, replay_lead
from ..patterns.sites import Site
from . import ops as _ops  # registers torch.ops.passkit_fusion.token_shard, agreed_reduce_scatter

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
    shaped: fx.Node
    """A node with ``like``'s shape (the site's all-reduce input), for its symbolic dims
    when no graph input carries them."""
    gathered: fx.Node | None = None
    """For a norm output's shard: the node that replaced ``like`` (its gather)."""


@dataclasses.dataclass
class Gathered:
    """An all-gather the rewrite inserted, and the nodes standing for the replicated tensor."""

    node: fx.Node
    """``wait_tensor(all_gather_into_tensor(...))``: ``[W * (T // W), H]``"""
    out: fx.Node
    """What the replicated tensor's users read: ``node`` re-labelled and/or reshaped."""
    tokens: Any
    """``T``: an int, or the node of the symbolic token count when ``node`` is re-labelled."""
    relabelled: bool
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
    merged: int = 0
    """all-reduces summed into a site, reduce-scattered alongside it"""
    shared: int = 0
    """terms added before the residual (shared experts' outputs) sliced with ``token_shard``"""
    rerouted: int = 0
    """matmuls re-routed to read an all-gather directly (see the module docstring)"""


class Rewriter:
    """Rewrites sites of one graph; call :meth:`site` for each, in graph order, then
    :meth:`finish`."""

    def __init__(self, graph: fx.Graph, pass_name: str, plan: str = "", timeout_s: float = 0.0):
        from torch._guards import detect_fake_mode

        self.graph = graph
        self.pass_name = pass_name
        self.plan, self.timeout_s = plan, timeout_s
        """The pass's plan (JSON) the ranks agree on before each group's first reduce-scatter
        (``agreed_reduce_scatter``, see :mod:`.ops`), and the wait's bound; "": no agreement."""
        self._agreed_groups: set[str] = set()
        vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
        self.fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
        self.shards: dict[fx.Node, Shard] = {}
        self.norm_shards: dict[fx.Node, Shard] = {}
        """Each rewritten site's norm output on the shard, under the norm's output node and
        the gathered node that replaced it: a later site whose residual (or added term) it is
        reads the shard (a norm without a weight whose output is the residual stream:
        nanochat's first norm, on the embedding)."""
        self.gathers: list[Gathered] = []
        self.dead: set[fx.Node] = set()
        self.bypassed: set[fx.Node] = set()
        """3-D views the rewrite read through (erased if nothing else reads them)"""
        self._size_nodes: dict[Any, Any] = {}
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
        src = node.args[0] if node.target in _RESHAPES else None
        src_val = src.meta.get("val") if isinstance(src, fx.Node) else None
        rows = _product(val.shape[:-1])
        if (
            isinstance(src_val, torch.Tensor)
            and src_val.dim() == 2
            and _statically_equal(src_val.shape[0], rows)
            and _statically_equal(src_val.shape[1], val.shape[-1])
        ):
            # reshape(reshape(y, [B, S, H]), [-1, H]) is y: read y (a matmul, for async_tp)
            self.bypassed.add(node)
            return src  # type: ignore[return-value]
        return self._call(aten.reshape.default, (node, [-1, val.shape[-1]]), like=node)

    def _size(self, size: Any, fallback: fx.Node, dim: int) -> Any:
        """``size`` as a graph argument: an int, or a node computing the SymInt: a SymInt
        placeholder, ``sym_size`` of a graph input, a product of those, else
        ``sym_size(fallback, dim)`` (inserted at the current insertion point)."""
        if isinstance(size, int):
            return size
        expr = size.node.expr
        if expr.is_number:
            return int(expr)
        found = self._from_inputs(expr)
        if found is not None:
            return found
        return self._call(aten.sym_size.int, (fallback, dim))

    def _from_inputs(self, expr: Any) -> Any:
        if expr in self._size_nodes:
            return self._size_nodes[expr]
        found: Any = None
        placeholders = list(self.graph.find_nodes(op="placeholder"))
        first = next(n for n in self.graph.nodes if n.op != "placeholder")
        for node in placeholders:
            val = node.meta.get("val")
            if isinstance(val, torch.SymInt) and val.node.expr == expr:
                found = node
                break
        if found is None:
            for node in placeholders:
                val = node.meta.get("val")
                if not isinstance(val, torch.Tensor):
                    continue
                dims = [
                    i for i, s in enumerate(val.shape) if isinstance(s, torch.SymInt) and s.node.expr == expr
                ]
                if dims:
                    with self.graph.inserting_before(first):
                        found = self._call(aten.sym_size.int, (node, dims[0]))
                    break
        if found is None and isinstance(expr, sympy.Mul):  # B * S with both dims dynamic
            factors = [int(f) if f.is_number else self._from_inputs(f) for f in expr.args]
            if all(f is not None for f in factors):
                with self.graph.inserting_before(first):
                    found = factors[0]
                    for f in factors[1:]:
                        found = self._call(operator.mul, (found, f))
        self._size_nodes[expr] = found
        return found

    def _sizes(self, node: fx.Node, shape: Sequence[Any]) -> list[Any]:
        """``shape`` as reshape arguments: ints, and nodes for the symbolic dims (``node``'s
        shape is ``shape``: the fallback)."""
        return [self._size(s, node, i) for i, s in enumerate(shape)]

    # -- the rewrite --------------------------------------------------------------------
    def site(self, site: Site) -> None:
        """Replace ``site``: its norm's users read the gathered norm output; its sum stays
        sharded for the next site (and is gathered in :meth:`finish` for other users).

        Every node of the site after the all-reduce (the residual add, in the activation
        dtype or in fp32, and the norm: native nodes or the host's norm op) is copied onto
        the shard, reading the reduce-scatter for the sum and the residual's shard for the
        residual: the same ops, so the same numerics, in every dialect."""
        g, w = site.group_name, site.world_size
        assert site.result is not None
        with self.graph.inserting_before(site.out):
            skipped = set(site.head)
            # a lead that sums rows (Llama-4's top-k sum) is applied before the reduce-scatter
            x, first = site.x, site.result
            if mixes_rows(site.lead):
                x, first = replay_lead(self.graph, site.lead, site.result, site.x), site.lead[-1]
                skipped.update(site.lead)
            x2 = self._to_2d(x)
            part = self._reduce_scatter(x2, w, g, like=site.x)
            part = self._call(c10d.wait_tensor.default, (part,), like=site.x)
            env: dict[fx.Node, fx.Node] = {first: part}
            # on [T / W, H] rows a view keeping H is the identity
            views = {n for n in site.nodes if is_view(n)}
            for merged in site.merged:  # another all-reduce summed into the site: its shard
                mx, mfirst = merged.x, merged.result
                if any(not is_view(n) for n in merged.views):  # a sum, a gate, a scale: before
                    mx, mfirst = (
                        replay_lead(self.graph, merged.views, merged.result, merged.x),
                        merged.views[-1],
                    )
                    skipped.update(merged.views)
                other = self._reduce_scatter(self._to_2d(mx), w, g, like=merged.x)
                env[mfirst] = self._call(c10d.wait_tensor.default, (other,), like=merged.x)
                skipped.update(merged.nodes)
                self.outcome.merged += 1
            if site.residual is None:
                self.outcome.no_residual += 1
            else:
                env[site.residual] = self._residual_shard(site.residual, g, w)
            for term in site.shared:
                env[term] = self._term_shard(term, g)
            for node in (site.residual, *site.shared):  # an earlier site's norm output,
                if node in self.norm_shards:  # replaced by its gather, which the nodes read
                    env[self.norm_shards[node].gathered] = env[node]  # type: ignore[index]
            position = {n: i for i, n in enumerate(self.graph.nodes)}
            for node in sorted(set(site.nodes) - skipped, key=position.__getitem__):
                if node in views:
                    env[node] = env[node.args[0]]  # type: ignore[index]
                    continue
                copy = self.graph.node_copy(node, lambda a: env.get(a, a))
                if copy.target is aten.mean.dim:  # over the hidden dim, counted from the end
                    copy.args = (copy.args[0], [-1], *copy.args[2:])
                copy.meta = {k: v for k, v in node.meta.items() if k != "val"}
                self._propagate(copy, node)
                env[node] = copy
            normed = Shard(env[site.out], g, w, x2, site.out, self._site, site.x)
            out = self._gather(normed)
        site.out.replace_all_uses_with(out)
        normed.gathered = out
        self.norm_shards[site.out] = self.norm_shards[out] = normed
        if site.total is not None:
            self.shards[site.total] = Shard(env[site.total], g, w, x2, site.total, self._site, site.x)
        self.dead.update(site.nodes)
        self._site += 1

    def _reduce_scatter(self, x: fx.Node, world_size: int, group_name: str, like: fx.Node) -> fx.Node:
        """``reduce_scatter_tensor(x, "sum", W, g)``; a group's first one (sites are rewritten
        in graph order) is ``agreed_reduce_scatter``: the ranks agree on the plan before it."""
        if self.plan and group_name not in self._agreed_groups:
            self._agreed_groups.add(group_name)
            args = (x, "sum", world_size, group_name, self.plan, self.timeout_s)
            return self._call(_ops.agreed_reduce_scatter_op(), args, like=like)
        return self._call(c10d.reduce_scatter_tensor.default, (x, "sum", world_size, group_name), like=like)

    def _residual_shard(self, residual: fx.Node, group_name: str, world_size: int) -> fx.Node:
        source = residual  # a view of an earlier site's sum keeping H: the same rows
        while (
            source not in self.shards
            and source not in self.norm_shards
            and is_view(source)
            and isinstance(source.args[0], fx.Node)
        ):
            if source.args[0].meta["val"].shape[-1] != source.meta["val"].shape[-1]:
                break
            source = source.args[0]
        known = self.shards.get(source) or self.norm_shards.get(source)
        if known is not None and known.group_name == group_name:
            self.outcome.sharded += 1
            return known.node
        self.outcome.sliced += 1
        return self._call(torch.ops.passkit_fusion.token_shard.default, (self._to_2d(residual), group_name))

    def _term_shard(self, term: fx.Node, group_name: str) -> fx.Node:
        """This rank's rows of a term added before the residual (a shared expert's output,
        computed alike on every rank): sliced without communication."""
        known = self.shards.get(term) or self.norm_shards.get(term)
        if known is not None and known.group_name == group_name:
            return known.node
        self.outcome.shared += 1
        return self._call(torch.ops.passkit_fusion.token_shard.default, (self._to_2d(term), group_name))

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
        out, relabelled = gathered, not _statically_equal(rows, tokens)
        if relabelled:
            hidden = like.shape[-1]
            tokens = self._size(tokens, shard.rows, 0)
            out = self._call(
                aten.as_strided.default, (gathered, [tokens, hidden], [hidden, 1]), like=shard.like
            )
        if like.dim() != 2:
            out = self._call(
                aten.reshape.default, (out, self._sizes(shard.shaped, like.shape)), like=shard.like
            )
        self.gathers.append(Gathered(gathered, out, tokens, relabelled, shard.site))
        return out

    def _reroute_matmuls(self, gathered: Gathered) -> None:
        """``mm(view of the re-labelled gather as [T, H], w)`` -> ``relabel(mm(gather, w))``:
        the matmul reads the all-gather itself (see the module docstring)."""
        self._site = gathered.site
        views: list[fx.Node] = []
        for mm, view in _matmuls_reading(gathered.out, gathered.node, gathered.tokens, views):
            if view is gathered.node:
                continue  # already all_gather -> mm
            with self.graph.inserting_before(mm):
                new = self._call(aten.mm.default, (gathered.node, mm.args[1]), like=mm)
                if gathered.relabelled:
                    n = new.meta["val"].shape[-1]
                    new = self._call(aten.as_strided.default, (new, [gathered.tokens, n], [n, 1]), like=mm)
            mm.replace_all_uses_with(new)
            self.graph.erase_node(mm)
            self.outcome.rerouted += 1
        position = {n: i for i, n in enumerate(self.graph.nodes)}
        erased: set[fx.Node] = set()
        for node in sorted({*views, gathered.out}, key=position.__getitem__, reverse=True):
            _erase_chain(self.graph, node, gathered.node, erased)

    def finish(self) -> None:
        """Gather the sharded sums that other nodes still read, re-route the matmuls reading
        gathers, erase the replaced nodes."""
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
        for gathered in self.gathers:
            self._reroute_matmuls(gathered)
        position = {n: i for i, n in enumerate(self.graph.nodes)}
        for node in sorted(self.dead, key=position.__getitem__, reverse=True):
            if not node.users:
                self.graph.erase_node(node)
        for node in [*self.bypassed, *(n for n in self._size_nodes.values() if isinstance(n, fx.Node))]:
            if not node.users and node.op == "call_function":
                self.graph.erase_node(node)
        from torch._inductor.pattern_matcher import stable_topological_sort

        stable_topological_sort(self.graph)


_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def _matmuls_reading(
    node: fx.Node, gathered: fx.Node, tokens: Any, views: list[fx.Node]
) -> list[tuple[fx.Node, fx.Node]]:
    """``(mm, A)`` for the ``aten.mm`` nodes whose first operand ``A`` is ``node`` or a chain
    of reshapes of it, ``A`` of ``gathered``'s hidden size and ``T`` rows: the re-labelled
    gather, row for row. ``views`` collects the reshapes walked through."""
    hidden = gathered.meta["val"].shape[-1]
    rows = tokens.meta["val"] if isinstance(tokens, fx.Node) else tokens
    found: list[tuple[fx.Node, fx.Node]] = []
    val = node.meta.get("val")
    if (
        isinstance(val, torch.Tensor)
        and val.dim() == 2
        and _statically_equal(val.shape[0], rows)
        and _statically_equal(val.shape[1], hidden)
    ):
        found += [(u, node) for u in node.users if u.target is aten.mm.default and u.args[0] is node]
    for user in list(node.users):
        if user.target in _RESHAPES and user.args[0] is node:
            views.append(user)
            found += _matmuls_reading(user, gathered, tokens, views)
    return found


def _erase_chain(graph: fx.Graph, node: fx.Node, stop: fx.Node, erased: set[fx.Node]) -> None:
    """Erase ``node`` if unused, then its unused inputs up to ``stop`` (a view chain)."""
    while node is not stop and node not in erased and not node.users and node.op == "call_function":
        inputs = list(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node)
        nxt = [
            a for a in inputs if a.op == "call_function" and a.target in (*_RESHAPES, aten.as_strided.default)
        ]
        if len(nxt) != 1:
            return
        node = nxt[0]


def _product(sizes: Sequence[Any]) -> Any:
    out: Any = 1
    for size in sizes:
        out = out * size
    return out


def _statically_equal(a: Any, b: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


# ---------------------------------------------------------------------------------------
# token counts


def token_count(site: Site) -> Any:
    """The site's token count: the product of every dim but the last (an int or SymInt)."""
    count: Any = 1
    for size in site.start.meta["val"].shape[:-1]:  # after the lead (a top-k sum has fewer rows)
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
