"""Every import of every ``tests/gpu`` module resolves on a machine without GPUs.

A GPU module skips itself (``pytest.skip(..., allow_module_level=True)``) before its imports
when no GPU is present, so a name removed from the project (or from a CPU test module that a
GPU module reuses) would break the GPU suite unseen until the next GPU run. This reads each
module's import statements, at any depth (functions too), and resolves them in a fresh
interpreter with the GPU suite's own ``sys.path`` additions (``tests/gpu`` and
``tests/fusion``): the module imported, each imported name an attribute or a submodule."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
GPU = TESTS / "gpu"
MODULES = sorted(GPU.glob("*.py"))

RESOLVE = r"""
import importlib, json, sys
sys.path[:0] = sys.argv[1:3]
failures = []
for key, module, names in json.loads(sys.stdin.read()):
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - every failure is reported by name
        failures.append([key, f"import {module}: {type(e).__name__}: {e}"])
        continue
    for name in names:
        if hasattr(mod, name):
            continue
        try:
            importlib.import_module(f"{module}.{name}")
        except Exception as e:  # noqa: BLE001
            failures.append([key, f"from {module} import {name}: {type(e).__name__}: {e}"])
print(json.dumps(failures))
"""


def imports_of(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, [names])`` for each import statement of ``path`` (``[]``: a plain import)."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            found.append((node.module or "", [a.name for a in node.names if a.name != "*"]))
    return found


@pytest.fixture(scope="module")
def failures() -> dict[str, list[str]]:
    """Each GPU module's unresolved imports, resolved in one fresh interpreter."""
    statements = [[path.name, module, names] for path in MODULES for module, names in imports_of(path)]
    out = subprocess.run(
        [sys.executable, "-c", RESOLVE, str(GPU), str(TESTS / "fusion")],
        input=json.dumps(statements),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=TESTS.parent,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found: dict[str, list[str]] = {}
    for key, failure in json.loads(out.stdout.strip().splitlines()[-1]):
        found.setdefault(key, []).append(failure)
    return found


def test_the_gpu_suite_has_modules_with_imports():
    assert len(MODULES) >= 8, MODULES
    assert all(imports_of(path) for path in MODULES), "a module without imports: the parser missed them"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_every_import_of_a_gpu_module_resolves_without_a_gpu(path, failures):
    assert failures.get(path.name, []) == [], f"{path.name}: " + "; ".join(failures[path.name])
