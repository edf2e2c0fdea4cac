"""Host collectives around PyTorch's async-TP matcher.

PyTorch's micro-pipeline TP matcher reads torch's functional collectives only
(``wait_tensor(all_gather_into_tensor(...))``, ``wait_tensor(reduce_scatter_tensor(...))``).
vLLM and SGLang write their own (``vllm.all_gather``, ``sglang.reg_all_gather_into_tensor``
functionalized...). :func:`to_torch` rewrites each host all-gather / reduce-scatter along
dim 0 that a dialect reads (:meth:`passkit_fusion.dialects.Dialect.collectives`) into
torch's form, on the torch process group the dialect resolves, and takes the host's nodes
out of the graph (torch's matcher wants the matmul's result read by the collective only);
after torch's pass, :func:`settle` puts a copy of the host's op back wherever torch did
not fuse (the host keeps its own communication path: custom all-reduce, PyNccl, graph
capture).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..dialects import Collective, Declined, Dialect, registered
from ..patterns.graph import group_world_size

c10d = torch.ops._c10d_functional


@dataclasses.dataclass
class Rewritten:
    """A host collective read as torch's: ``collective`` -> ``wait`` stand for ``host``."""

    host: Collective
    dialect: str
    collective: fx.Node
    wait: fx.Node
    saved: list[tuple[fx.Node, object, tuple, dict, dict]] = dataclasses.field(default_factory=list)
    """``(node, target, args, kwargs, meta)`` of the host's nodes taken out (erasing a
    node clears its arguments)."""


@dataclasses.dataclass
class HostCollectives:
    rewritten: list[Rewritten] = dataclasses.field(default_factory=list)
    left: list[str] = dataclasses.field(default_factory=list)
    """Why host collectives stay out of torch's matcher (``"node: reason"``)."""
    restored: int = 0
    fused: int = 0
    declined: list[str] = dataclasses.field(default_factory=list)
    """Dialects that declined their ops' schemas (also in :attr:`left`): a cause the user
    must act on, reported as the pass's ``declined`` status when nothing was fused."""


def to_torch(graph: fx.Graph, dialects: list[Dialect] | None = None) -> HostCollectives:
    """Rewrite the host collectives of ``graph`` to torch's functional form (see module)."""
    out = HostCollectives()
    for dialect in dialects if dialects is not None else registered():
        if dialect.name == "torch" or not dialect.present(graph):
            continue
        problems = dialect.schema_problems(graph)
        if problems:
            out.left.extend(problems.values())
            out.declined.extend(problems.values())
            continue
        for found in list(dialect.collectives(graph)):
            if isinstance(found, tuple):
                out.left.append(f"{found[0].name}: {found[1]}")
                continue
            try:
                group = dialect.torch_group_name(found.group)
            except Declined as exc:
                out.left.append(f"{found.anchor.name}: {exc}")
                continue
            out.rewritten.append(_rewrite(graph, found, group, dialect.name))
    return out


def _rewrite(graph: fx.Graph, host: Collective, group: str, dialect: str) -> Rewritten:
    size = host.world_size or group_world_size(group)
    with graph.inserting_after(host.anchor):
        if host.kind == "all_gather":
            collective = graph.call_function(c10d.all_gather_into_tensor.default, (host.x, size, group))
        else:
            collective = graph.call_function(c10d.reduce_scatter_tensor.default, (host.x, "sum", size, group))
    with graph.inserting_after(collective):
        wait = graph.call_function(c10d.wait_tensor.default, (collective,))
    value = host.result.meta.get("val")
    for node in (collective, wait):
        node.meta.update(
            {k: v for k, v in host.anchor.meta.items() if k in ("stack_trace", "nn_module_stack")}
        )
        if value is not None:
            node.meta["val"] = value
    host.result.replace_all_uses_with(wait)
    saved = [(n, n.target, n.args, dict(n.kwargs), dict(n.meta)) for n in _own(host)]
    for node in reversed(_own(host)):  # saved for settle() to put back
        graph.erase_node(node)
    return Rewritten(host, dialect, collective, wait, saved)


def _own(host: Collective) -> list[fx.Node]:
    """The host's collective and its result node (an output buffer stays in the graph)."""
    return list(dict.fromkeys((host.anchor, host.result)))


def settle(graph: fx.Graph, found: HostCollectives) -> None:
    """After torch's pass: the host's op back where torch left the collective; where it
    fused it, the host's output buffer (if any) erased."""
    alive = set(graph.nodes)
    for item in found.rewritten:
        own = _own(item.host)
        if item.collective in alive:
            copies: dict[fx.Node, fx.Node] = {}
            with graph.inserting_before(item.wait):
                for node, target, args, kwargs, meta in item.saved:
                    args, kwargs = fx.node.map_arg((args, kwargs), lambda a, c=copies: c.get(a, a))
                    copies[node] = graph.call_function(target, args, kwargs)  # type: ignore[arg-type]
                    copies[node].meta.update(meta)
            item.wait.replace_all_uses_with(copies[item.host.result])
            graph.erase_node(item.wait)
            graph.erase_node(item.collective)
            found.restored += 1
            continue
        for node in item.host.nodes:
            if node not in own and node in alive and not node.users:
                graph.erase_node(node)
        found.fused += 1


def notes(found: HostCollectives) -> list[str]:
    """Report notes about the host collectives (none when there were none)."""
    out = []
    if found.rewritten:
        dialects = sorted({r.dialect for r in found.rewritten})
        out.append(
            f"{len(found.rewritten)} host collective(s) ({', '.join(dialects)} dialect) read as torch's "
            f"for its matcher: {found.fused} fused, {found.restored} put back as the host's op"
        )
    if found.left:
        out.append(f"{len(found.left)} host collective(s) left in the host's form: " + "; ".join(found.left))
    return out
