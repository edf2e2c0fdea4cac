"""passkit-fusion's modules import each other as a DAG, and ``import passkit_fusion`` is light.

The check is static: every ``import`` / ``from ... import`` of a passkit_fusion module, at
module level or inside a function (a lazy import is still a dependency), is an edge. Two
graphs must be acyclic: the modules', and the components' (a subpackage or top-level module
of passkit_fusion: ``collective``, ``patterns``, ``tuning``, ``allreduce_rmsnorm``, ``plugin``,
...), so that a lower layer never reaches up into a pass, not even lazily (as ``tuning``
once did into ``runtime``, which imported it back).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import passkit_fusion

PACKAGE = "passkit_fusion"
ROOT = Path(passkit_fusion.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((PACKAGE, *parts))] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The passkit_fusion modules ``name`` imports (anywhere in its body)."""
    is_package = path.name == "__init__.py"
    edges: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            # ``from pkg import mod`` depends on the module pkg.mod where there is one
            targets = [
                f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names
            ]
        else:
            continue
        edges.update(t for t in targets if t in modules and t != name)
    return edges


def _component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for succ in sorted(graph.get(node, ())):
            if state.get(succ) == 1:
                return [*stack[stack.index(succ) :], succ]
            if succ not in state and (found := visit(succ)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _components(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between components (edges inside a component dropped)."""
    components: dict[str, set[str]] = {}
    for name, targets in graph.items():
        edges = components.setdefault(_component(name), set())
        edges.update(_component(t) for t in targets if _component(t) != _component(name))
    return components


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_static_import_check_sees_imports_and_cycles():
    graph = _graph()
    runtime = "passkit_fusion.allreduce_rmsnorm.runtime"
    assert "passkit_fusion.tuning.tables" in graph[runtime]
    assert runtime in graph["passkit_fusion.allreduce_rmsnorm.ops"]  # a lazy import counts
    assert "tuning" in _components(graph)["allreduce_rmsnorm"]
    # the old cycle, as it would come back: tuning reaching up, even lazily, into the runtime
    graph["passkit_fusion.tuning.cli"].add(runtime)
    assert _cycle(_components(graph)) == ["allreduce_rmsnorm", "tuning", "allreduce_rmsnorm"]


def test_modules_import_each_other_without_cycles():
    graph = _graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_components_form_layers():
    components = _components(_graph())
    assert _cycle(components) is None, " -> ".join(_cycle(components) or [])
    for base in ("collective", "patterns", "reference", "tuning"):
        assert not components[base] & {"allreduce_rmsnorm", "plugin", "demo"}, (base, components[base])


def test_import_passkit_fusion_is_light():
    code = (
        "import sys, passkit_fusion; "
        "heavy = [m for m in ('torch', 'torch.distributed', 'flashinfer', 'passkit') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
