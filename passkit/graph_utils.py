"""Small helpers on ``torch.fx`` graphs shared by the pass manager and passes."""

from __future__ import annotations

import difflib

import torch.fx


def snapshot(graph: torch.fx.Graph) -> torch.fx.Graph:
    """An independent copy of ``graph`` (nodes, names, shallow-copied meta)."""
    copy = torch.fx.Graph(owning_module=graph.owning_module, tracer_cls=graph._tracer_cls)
    _copy_nodes(graph, copy)
    copy._codegen = graph._codegen
    return copy


def restore(graph: torch.fx.Graph, saved: torch.fx.Graph) -> None:
    """Make ``graph`` (the same object) hold exactly the nodes of ``saved`` again.

    Names are restored too: the namespace is reset before copying, so generated code is
    identical to the code before the pass ran.
    """
    for node in reversed(list(graph.nodes)):
        node.users.clear()
        graph.erase_node(node)
    graph._graph_namespace = type(graph._graph_namespace)()
    _copy_nodes(saved, graph)
    graph._codegen = saved._codegen


def _copy_nodes(src: torch.fx.Graph, dst: torch.fx.Graph) -> None:
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in src.nodes:
        env[node] = dst.node_copy(node, lambda n: env[n])


def graph_code(gm_or_graph: torch.fx.GraphModule | torch.fx.Graph) -> str:
    """Readable Python for a graph (no strides/devices noise)."""
    graph = gm_or_graph.graph if isinstance(gm_or_graph, torch.fx.GraphModule) else gm_or_graph
    return graph.python_code(root_module="self", verbose=False).src.strip() + "\n"


def unified_diff(before: str, after: str, name: str) -> str:
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True),
            after.splitlines(keepends=True),
            fromfile=f"{name}/before",
            tofile=f"{name}/after",
        )
    )


def count_nodes(graph: torch.fx.Graph) -> int:
    return len(graph.nodes)
