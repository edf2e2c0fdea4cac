"""passkit's public surface, read from the tree (nothing is imported).

* Every module of ``passkit`` outside its private wings (a path part that starts with an
  underscore: ``passkit/_compile/``, ``passkit/_pipeline/``, ``passkit/_plugins/``,
  ``_version``) is documented on an API page (``docs/reference/*.md``): the page names it,
  something in it, or a name ``passkit`` re-exports from it. A host adapter and the
  built-in passes are each one folder: their parts are documented with the folder
  (``::: passkit.hosts.vllm``, ``::: passkit.builtin``).
* No example, guide or package written as a third party writes it (passkit-fusion,
  passkit-testing, the example plugin, the guides and READMEs) imports a private module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "passkit"
REFERENCE = ROOT / "docs/reference"
THIRD_PARTY = [
    ROOT / "passkit_fusion",
    ROOT / "passkit_testing",
    ROOT / "examples",
    ROOT / "docs",
    ROOT / "README.md",
]
"""Written as a third party would write them: public names only."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["passkit", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _private(name: str) -> bool:
    return any(part.startswith("_") for part in name.split(".")[1:])


PUBLIC = sorted(name for name in MODULES if not _private(name))


def _documented() -> set[str]:
    """What the API pages render: the targets of their ``:::`` lines and the members they list."""
    targets = set()
    for page in REFERENCE.glob("*.md"):
        text = page.read_text()
        for match in re.finditer(r"^::: ([\w.]+)\n((?:    .*\n)*)", text, re.M):
            target, options = match.groups()
            targets.add(target)
            targets.update(f"{target}.{m}" for m in re.findall(r"^\s+- (\w+)$", options, re.M))
    return targets


def _reexported() -> dict[str, str]:
    """Each name ``passkit/__init__.py`` imports, with the module it is imported from (its
    ``if TYPE_CHECKING:`` imports included: the names it imports on first use)."""
    out = {}
    body = ast.parse(MODULES["passkit"].read_text()).body
    for node in [*body, *(n for top in body if isinstance(top, ast.If) for n in top.body)]:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            source = ".".join(["passkit", *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                out[alias.asname or alias.name] = sub if sub in MODULES else source
    return out


def test_the_tree_is_read():
    """A check of the check: the public modules, the wings and the pages are found."""
    assert {"passkit", "passkit.pass_base", "passkit.config", "passkit.hookspecs", "passkit.plugins"} <= set(
        PUBLIC
    )
    assert {"passkit._pipeline.build", "passkit._plugins.registry", "passkit._compile.backend"} <= set(
        MODULES
    )
    assert not set(PUBLIC) & {"passkit._pipeline.run", "passkit._version"}
    assert {"passkit.Config", "passkit.hookspecs", "passkit.hosts.vllm"} <= _documented()
    assert _reexported()["Config"] == "passkit.config"


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_module_is_on_an_api_page(name):
    documented = _documented()
    reexported = _reexported()
    by_name = {f"passkit.{n}" for n, source in reexported.items() if source == name}
    folder = re.match(r"passkit\.hosts\.\w+|passkit\.builtin", name)
    ok = (
        any(t == name or t.startswith(name + ".") for t in documented)
        or by_name & documented
        or (name == "passkit" and any(t.count(".") == 1 for t in documented))
        or (folder is not None and folder.group(0) in documented)
    )
    assert ok, (
        f"{name} is public (outside passkit's private wings) but no API page (docs/reference/) "
        "documents it: add it to a page, or move it into a wing if no pass author needs it"
    )


def _private_imports_in_python(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = (
                [node.module]
                if _imports_private(node.module)
                else [f"{node.module}.{a.name}" for a in node.names]
            )
        found += [f"{_shown(path)}:{node.lineno}: {n}" for n in names if _imports_private(n)]
    return found


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _imports_private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "passkit" and len(parts) > 1 and _private(dotted) and parts[1] != "__version__"


PRIVATE_IN_TEXT = re.compile(
    r"^\s*(?:from\s+passkit\.(_\w+)|from\s+passkit\s+import\s+(_\w+)|import\s+passkit\.(_\w+))", re.M
)


def test_no_third_party_code_imports_a_private_module():
    """Code (and code shown in guides) written as a third party would write it imports
    passkit's public modules only; tests of passkit itself may import the wings."""
    found = []
    for root in THIRD_PARTY:
        paths = [root] if root.is_file() else sorted(root.rglob("*"))
        for path in paths:
            if ".venv" in path.parts or "_build" in path.parts or not path.is_file():
                continue
            if path.suffix == ".py":
                found += _private_imports_in_python(path)
            elif path.suffix == ".md":
                for match in PRIVATE_IN_TEXT.finditer(path.read_text()):
                    line = path.read_text().count("\n", 0, match.start()) + 1
                    found.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0).strip()}")
    assert not found, "private passkit modules imported where a third party's code stands:\n" + "\n".join(
        found
    )


def test_the_check_finds_a_private_import(tmp_path):
    module = tmp_path / "plugin.py"
    module.write_text(
        "import passkit\nfrom passkit._plugins import registry\nfrom passkit import config, _compile\n"
    )
    assert _private_imports_in_python(module) == [
        "plugin.py:2: passkit._plugins",
        "plugin.py:3: passkit._compile",
    ]
    assert PRIVATE_IN_TEXT.search("```python\nfrom passkit._pipeline.run import Runner\n```")
    assert not PRIVATE_IN_TEXT.search("from passkit import Pipeline")
