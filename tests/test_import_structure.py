"""The packages' import structure: no import circles, and every module imports on its own.

* The cycle check reads every module's imports with ``ast`` (nothing is imported): those at
  module level, those under ``if TYPE_CHECKING:`` and those inside functions all count, so
  a shared type gets a module of its own instead of a type-only import back up. A circle
  fails the test, named file by file with the names that tie it.
* Every module of passkit, passkit_fusion and passkit_testing imports in a fresh process, in
  a few different orders (modules whose import needs an absent host, vLLM or SGLang, are
  skipped with the reason).
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "passkit": ROOT / "passkit",
    "passkit_fusion": ROOT / "passkit_fusion/src/passkit_fusion",
    "passkit_testing": ROOT / "passkit_testing/src/passkit_testing",
}
OPTIONAL = {"vllm": "vLLM", "sglang": "SGLang", "flashinfer": "flashinfer"}
"""Top-level packages a module may need that the default test environment lacks."""


def _modules() -> dict[str, Path]:
    """Every module of the three packages, by dotted name."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> dict[str, set[str]]:
    """The modules of :data:`MODULES` that ``name`` imports, each with the names it takes
    (at any depth of the file: module level, ``if TYPE_CHECKING:``, inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: dict[str, set[str]] = {}

    def add(module: str, what: str) -> None:
        while module and module not in MODULES:  # a name inside a module: the module
            module = module.rpartition(".")[0]
        if module and module != name:
            out.setdefault(module, set()).add(what)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                add(submodule if submodule in MODULES else source, alias.name)
    return out


def _cycles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one
    circle through it: ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_circle_in(graph, set(c)) for c in components]


def _circle_in(graph: dict[str, dict[str, set[str]]], component: set[str]) -> list[str]:
    """One circle through the first module of ``component`` (breadth first: a short one)."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w == start:
                return [*paths[v], start]
            if w in component and w not in paths:
                paths[w] = [*paths[v], w]
                queue.append(w)
    raise AssertionError("a strongly connected component without a circle")


def test_the_cycle_check_finds_a_circle_and_names_it():
    graph = {"a": {"b": {"B"}}, "b": {"c": {"C"}}, "c": {"a": {"A"}}, "d": {"a": {"A"}}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b": {"B"}}, "b": {}}) == []


def test_no_import_circles():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    circles = _cycles(graph)
    described = [
        " -> ".join(circle)
        + "\n"
        + "\n".join(f"    {a} imports {sorted(graph[a][b])} from {b}" for a, b in itertools.pairwise(circle))
        for circle in circles
    ]
    assert not circles, "import circles:\n" + "\n".join(described)


def test_the_import_graph_is_read():
    """The reader resolves relative, package and ``TYPE_CHECKING`` imports (a check of the
    check: a reader that sees nothing finds no circle)."""
    pipeline = _imports("passkit._pipeline.run", MODULES["passkit._pipeline.run"])
    assert {"passkit._pipeline.inductor_state", "passkit.pipeline_plan", "passkit._plugins.hooks"} <= set(pipeline)
    assert "PipelinePlan" in pipeline["passkit.pipeline_plan"]
    hookspecs = _imports("passkit.hookspecs", MODULES["passkit.hookspecs"])  # type-only imports
    assert {"passkit.pipeline_plan", "passkit.report", "passkit.pass_base"} <= set(hookspecs)
    vllm = _imports("passkit.hosts.vllm", MODULES["passkit.hosts.vllm"])  # a function's import
    assert {"passkit.hosts", "passkit.hosts.vllm.ranges", "passkit.hosts.vllm.inductor_pass"} <= set(vllm)


def _missing_optional(path: Path) -> str | None:
    """Why ``path`` cannot be imported here: the optional host it imports at module level
    that is not installed, or None."""
    for node in ast.parse(path.read_text()).body:
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top in OPTIONAL and importlib.util.find_spec(top) is None:
                return f"imports {name}, and {OPTIONAL[top]} is not installed"
    return None


IMPORTABLE = [name for name, path in MODULES.items() if _missing_optional(path) is None]


def test_only_host_adapters_need_their_host_to_import():
    """Everything but a host adapter's ``InductorPass`` module imports without its host."""
    needs = {name for name, path in MODULES.items() if _missing_optional(path)}
    assert needs <= {"passkit.hosts.vllm.inductor_pass", "passkit.hosts.sglang.inductor_pass"}, needs


def _import_in_fresh_process(names: list[str]) -> None:
    code = textwrap.dedent(
        f"""
        import importlib, sys, traceback
        failed = []
        for name in {names!r}:
            try:
                importlib.import_module(name)
            except BaseException:
                failed.append(name + ":\\n" + traceback.format_exc(limit=-4))
        if failed:
            sys.exit("\\n".join(failed))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"in the order {names}:\n{proc.stderr[-6000:]}"


@pytest.mark.parametrize("order", ["sorted", "reversed", "shuffled"])
def test_every_module_imports_in_a_fresh_process(order):
    """All modules in one fresh interpreter, in sorted, reversed and a shuffled order (a
    circle that works only when one side is imported first fails one of them)."""
    names = sorted(IMPORTABLE)
    if order == "reversed":
        names.reverse()
    elif order == "shuffled":
        random.Random(30).shuffle(names)
    _import_in_fresh_process(names)


NEEDS_HOST = {name: why for name, path in MODULES.items() if (why := _missing_optional(path))}


@pytest.mark.parametrize("name", sorted(NEEDS_HOST) or ["(none)"])
def test_modules_of_an_absent_host_are_skipped(name):
    """The modules left out of the orders above, each skipped with why (where the host is
    installed, ``nox -s hosts``, they are in the orders and this has nothing to skip)."""
    if name in NEEDS_HOST:
        pytest.skip(f"{name} {NEEDS_HOST[name]}")


@pytest.mark.slow  # one interpreter per module: ~2 s each on a busy 2-core machine
@pytest.mark.parametrize("name", IMPORTABLE)
def test_each_module_imports_first(name):
    """Each module as the first and only import of a fresh interpreter."""
    _import_in_fresh_process([name])


def test_public_names_resolve():
    """Every name each package (and each public module with an ``__all__``) lists is there
    (lazy exports included), and what moved into the private wings is still where users
    import it from: the public modules' names, ``passkit.plugins`` for the plugin set."""
    code = textwrap.dedent(
        """
        import importlib
        for package in ("passkit", "passkit_fusion", "passkit_testing", "passkit.hosts.vllm",
                        "passkit.hosts.sglang", "passkit.plugins", "passkit.compiling"):
            module = importlib.import_module(package)
            missing = [n for n in module.__all__ if not hasattr(module, n)]
            assert not missing, f"{package}.__all__ names what it lacks: {missing}"
        import passkit, passkit.plugins, passkit.hook_failure, passkit.pipeline_plan
        assert passkit.hook_failure.HookFailure is passkit.HookFailure
        assert passkit.pipeline_plan.PipelinePlan is passkit.PipelinePlan
        assert passkit.plugins.PassNameClashWarning is passkit.PassNameClashWarning
        assert passkit.plugins.get_plugins is passkit.get_plugins
        for name in ("instantiate", "unknown_pass_message", "isolated"):
            assert callable(getattr(passkit.plugins, name)), name
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
