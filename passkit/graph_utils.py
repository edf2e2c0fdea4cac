"""Small helpers on ``torch.fx`` graphs shared by the pass manager and passes."""

from __future__ import annotations

import difflib
import re

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
    nodes = list(graph.nodes)
    for node in nodes:  # a pass may have erased a node still in use: make users whole again
        for used in node._input_nodes:
            used.users.setdefault(node, None)
    for node in reversed(nodes):
        node.users.clear()
        graph.erase_node(node)
    graph._graph_namespace = type(graph._graph_namespace)()
    _copy_nodes(saved, graph)
    graph._codegen = saved._codegen


def _copy_nodes(src: torch.fx.Graph, dst: torch.fx.Graph) -> None:
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in src.nodes:
        env[node] = copied = dst.node_copy(node, lambda n: env[n])
        extra = getattr(node, "__dict__", None)
        if extra:  # attributes a tracer set on the node (Dynamo's ``_dynamo_source``)
            for name, value in extra.items():
                if name not in copied.__dict__:
                    setattr(copied, name, value)


def carry_node_attributes(graph: torch.fx.Graph, before: torch.fx.Graph) -> None:
    """Give the nodes of ``graph`` (a graph a pass installed in place of the one it got) the
    attributes a tracer set on the nodes of ``before`` (Dynamo's ``_dynamo_source`` on its
    placeholders, which AOTAutograd asserts) that they lack: placeholders by position (they
    are the inputs, in order), other nodes by name."""

    def extras(node: torch.fx.Node) -> dict[str, object]:
        return dict(getattr(node, "__dict__", None) or {})

    old_inputs = list(before.find_nodes(op="placeholder"))
    new_inputs = list(graph.find_nodes(op="placeholder"))
    pairs = list(zip(new_inputs, old_inputs))
    by_name = {n.name: n for n in before.nodes if n.op != "placeholder"}
    pairs += [(n, by_name[n.name]) for n in graph.nodes if n.op != "placeholder" and n.name in by_name]
    for new, old in pairs:
        for name, value in extras(old).items():
            if name not in extras(new):
                setattr(new, name, value)


def recorded_value(node: torch.fx.Node) -> object:
    """The value recorded on ``node``: ``meta["val"]`` (ATen graphs), else Dynamo's
    ``meta["example_value"]`` (the pre-grad stage's torch-level graph); None without either."""
    meta = node.meta
    return meta["val"] if "val" in meta else meta.get("example_value")


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


_ROOT = re.compile(r"""^(?:L|G)\[(['"])[^'"]*\1\]""")
_ATTR_CHAIN = re.compile(r"""\.__closure__\[\d+\]\.cell_contents|\.__self__|\.__func__|\.forward\b""")
_ITEM = re.compile(
    r"""\._(?:modules|parameters|buffers)\[(['"])([^'"]*)\1\]|\[(['"])([^'"]*)\3\]|\[(\d+)\]"""
)


def module_path_from_source(source: str) -> str:
    """The module path (``layers.1.mlp``) of a Dynamo source string naming a module.

    Dynamo names modules by how it reached them: ``L['self'].layers[1].mlp`` for a
    compiled module, ``L['fn'].__closure__[1].cell_contents.__self__.layers.1`` for a
    compiled bound method captured in a closure (SGLang's ``--enable-torch-compile``),
    ``L['self']._modules['layers']._modules['1']`` in older torch. Everything up to the
    module the compiled function belongs to (the root, closure cells, ``__self__``) is
    dropped and item accesses become dotted names; a string that is not a Dynamo source
    (``layers.1``, ``self.layers.1``) comes back without a leading ``self.``."""
    path = source.strip()
    root = _ROOT.match(path)
    if root:
        path = path[root.end() :]
    chain = list(_ATTR_CHAIN.finditer(path))
    if chain:
        path = path[chain[-1].end() :]
    path = _ITEM.sub(lambda m: "." + (m.group(2) or m.group(4) or m.group(5) or ""), path)
    path = path.lstrip(".")
    if path == "self" or path.startswith("self."):
        path = path[len("self") :].lstrip(".")
    return path


def module_path(node: torch.fx.Node) -> str:
    """The innermost module ``node`` was traced in, as a dotted path (``""`` if unknown):
    the last entry of its ``nn_module_stack``, through :func:`module_path_from_source`."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    entry = list(stack.values())[-1]
    source = entry[0] if isinstance(entry, (tuple, list)) else entry
    return module_path_from_source(str(source))
