"""flashinfer's Python API as its wheels define it, read without importing flashinfer.

flashinfer imports need CUDA; its wheels (``flashinfer-python``, pure Python: the kernels are
compiled at run time or come from ``flashinfer-cubin``) hold the source of every function
passkit calls. :func:`wheel` fetches one release's wheel into :data:`CACHE` (``pip download
--no-deps``, once; later runs read the cache), and :class:`WheelApi` reads the signatures in
it with :mod:`ast`.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
import zipfile
from pathlib import Path

CACHE = Path(
    os.environ.get("PASSKIT_FLASHINFER_WHEELS", Path.home() / ".cache" / "passkit" / "flashinfer-wheels")
)
"""Where the wheels are kept (``PASSKIT_FLASHINFER_WHEELS`` overrides)."""

FETCH_TIMEOUT_S = 300


def wheel(version: str) -> Path | str:
    """The wheel of ``flashinfer-python==version`` in :data:`CACHE`, fetched when absent;
    a one-line reason when it cannot be had (no registry reachable)."""
    found = sorted(CACHE.glob(f"flashinfer_python-{version}-*.whl"))
    if found:
        return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", str(CACHE)]
    try:
        done = subprocess.run(
            [*cmd, f"flashinfer-python=={version}"], capture_output=True, text=True, timeout=FETCH_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return f"pip download flashinfer-python=={version} took over {FETCH_TIMEOUT_S} s"
    found = sorted(CACHE.glob(f"flashinfer_python-{version}-*.whl"))
    if done.returncode or not found:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"pip download flashinfer-python=={version} failed: {last}"
    return found[0]


@dataclasses.dataclass(frozen=True)
class Signature:
    """A function's parameters as its source declares them."""

    names: tuple[str, ...]
    required: tuple[str, ...]
    """Parameters without a default (every call must pass them)."""
    var_keyword: bool
    """It takes ``**kwargs`` (any keyword is accepted)."""
    positional: int
    """How many of :attr:`names` may be passed by position (the first ones)."""

    def accepts(self, keyword: str) -> bool:
        return self.var_keyword or keyword in self.names


def signature_of(fn: ast.FunctionDef) -> Signature:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaulted = {p.arg for p in positional[len(positional) - len(a.defaults) :]}
    defaulted |= {p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None}
    names = [p.arg for p in (*positional, *a.kwonlyargs) if p.arg != "self"]
    required = tuple(n for n in names if n not in defaulted)
    by_position = len([p for p in positional if p.arg != "self"])
    return Signature(tuple(names), required, a.kwarg is not None, by_position)


class WheelApi:
    """``flashinfer.comm`` of one wheel: what it exports and the functions' signatures."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._zip = zipfile.ZipFile(path)
        self._trees: dict[str, ast.Module] = {}

    def tree(self, module: str) -> ast.Module:
        """The parsed source of ``flashinfer.comm.<module>`` (``__init__`` for the package)."""
        if module not in self._trees:
            self._trees[module] = ast.parse(self._zip.read(f"flashinfer/comm/{module}.py"))
        return self._trees[module]

    def has_module(self, module: str) -> bool:
        return f"flashinfer/comm/{module}.py" in self._zip.namelist()

    def exports(self) -> dict[str, tuple[str, str]]:
        """``{name: (submodule, name there)}`` that ``flashinfer/comm/__init__.py`` imports
        from its submodules."""
        found: dict[str, tuple[str, str]] = {}
        for node in self.tree("__init__").body:
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                for alias in node.names:
                    found[alias.asname or alias.name] = (node.module, alias.name)
        return found

    def function(self, module: str, name: str, within: str | None = None) -> Signature | None:
        """The signature of ``module``'s top-level function ``name`` (or of the function
        ``name`` defined inside the top-level function ``within``), None when absent."""
        scope: list[ast.stmt] = self.tree(module).body
        if within is not None:
            outer = [n for n in scope if isinstance(n, ast.FunctionDef) and n.name == within]
            if not outer:
                return None
            scope = list(ast.walk(outer[0]))[1:]  # type: ignore[arg-type]
        for node in scope:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return signature_of(node)
        return None

    def exported_function(self, name: str) -> Signature | None:
        """The signature of ``flashinfer.comm.<name>``, followed to the submodule defining it."""
        where = self.exports().get(name)
        return None if where is None else self.function(*where)

    def class_members(self, module: str, name: str) -> set[str]:
        """What a class of ``module`` holds: the names its body assigns or defines, and the
        attributes its methods assign on ``self``."""
        for node in self.tree(module).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                members = set()
                for stmt in node.body:
                    if isinstance(stmt, ast.FunctionDef):
                        members.add(stmt.name)
                    elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                        members |= {t.id for t in targets if isinstance(t, ast.Name)}
                for sub in ast.walk(node):
                    stored = isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                    if stored and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        members.add(sub.attr)
                return members
        return set()
