"""The documentation site shows what it should (no mkdocs needed; ``nox -s docs`` builds it):

* every public name of the three distributions (each package's ``__all__``) has an entry on
  an API reference page, passkit-fusion's lazy names included;
* the reST of the docstrings (literal blocks ``::``, definition lists) becomes Markdown
  (``docs/_build/griffe_roles.py``);
* every guide has headings (a table of contents);
* the benchmark result pages the docs link to are pages of the site.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "passkit": ROOT / "passkit",
    "passkit_fusion": ROOT / "passkit_fusion/src/passkit_fusion",
    "passkit_testing": ROOT / "passkit_testing/src/passkit_testing",
}
ALIASES = {"registered_dialects": "registered"}
"""passkit_fusion's names whose object has another name (its ``__getattr__`` says so)."""
DIRECTIVE = re.compile(r"^::: (\S+)\n((?:[ \t]+.*\n?)*)", re.M)


def _module_file(dotted: str) -> Path | None:
    package, *rest = dotted.split(".")
    base = PACKAGES.get(package)
    if base is None:
        return None
    path = base.joinpath(*rest)
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _public_names(path: Path) -> set[str]:
    """``__all__`` of a module, read without importing it."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value:
                try:
                    return {n for n in ast.literal_eval(node.value) if isinstance(n, str)}
                except ValueError:
                    return set()
    return set()


def _documented() -> set[str]:
    """Dotted names the API pages render: ``::: target`` (with its ``members:`` if listed;
    a whole module renders its ``__all__``)."""
    out: set[str] = set()
    for page in sorted((ROOT / "docs/reference").glob("*.md")):
        for target, options in DIRECTIVE.findall(page.read_text()):
            members = re.findall(r"^\s+- (\w+)\s*$", options, re.M)
            if members:
                out.update(f"{target}.{m}" for m in members)
                continue
            out.add(target)
            path = _module_file(target)
            if path is not None and "members: false" not in options:
                out.update(f"{target}.{name}" for name in _public_names(path))
    return out


def _exported(package: str) -> set[str]:
    path = PACKAGES[package] / "__init__.py"
    names = _public_names(path)
    if package == "passkit_fusion":  # __all__ = ["__version__", *_LAZY]
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_LAZY":
                names |= set(ast.literal_eval(node.value))
    if package == "passkit_testing":  # __all__ = sorted(_WHERE), from _EXPORTS
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "_EXPORTS":
                for group in ast.literal_eval(node.value).values():
                    names |= set(group)
    assert names, f"{package}: no public names found"
    return names - {"__version__"}


@pytest.mark.parametrize("package", list(PACKAGES))
def test_every_public_name_is_on_an_api_page(package):
    documented = _documented()
    missing = sorted(
        name
        for name in _exported(package)
        if f"{package}.{ALIASES.get(name, name)}" not in documented
        and not any(
            d.startswith(f"{package}.") and d.rsplit(".", 1)[-1] == ALIASES.get(name, name)
            for d in documented
        )
    )
    assert not missing, f"{package}: names with no entry on docs/reference/*.md: {missing}"


def _griffe_roles() -> types.ModuleType:
    sys.modules.setdefault("griffe", types.SimpleNamespace(Extension=object))  # type: ignore[arg-type]
    spec = importlib.util.spec_from_file_location("griffe_roles", ROOT / "docs/_build/griffe_roles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rest_literal_blocks_and_definition_lists_become_markdown():
    convert = _griffe_roles().rest_to_markdown
    text = "Raise, listing every one that fails::\n\n    check_pass(x)\n    more(y)\n\nAfter.\n"
    assert convert(text) == (
        "Raise, listing every one that fails:\n\n```python\ncheck_pass(x)\nmore(y)\n```\n\nAfter."
    )
    assert "::" not in convert("Intro.\n\n::\n\n    code()\n")
    listing = "Properties:\n\n``uuid-stable``\n    Two instances\n    agree.\n``lint``\n    It lints.\n"
    assert "- `uuid-stable`: Two instances agree.\n- `lint`: It lints." in convert(listing)
    google = "Args:\n    x: a value.\n\nReturns:\n    y."
    assert convert(google) == google


@pytest.mark.parametrize(
    "module",
    [
        "passkit_testing/src/passkit_testing/conformance.py",
        "passkit_testing/src/passkit_testing/worlds.py",
        "passkit_testing/src/passkit_testing/harness.py",
        "passkit/hosts/vllm/__init__.py",
        "passkit/hosts/sglang/__init__.py",
    ],
)
def test_the_pages_reported_raw_render_without_rest_markup(module):
    convert = _griffe_roles().rest_to_markdown
    docstring = ast.get_docstring(ast.parse((ROOT / module).read_text()), clean=True) or ""
    rendered = convert(docstring)
    outside_code = re.sub(r"```.*?```", "", rendered, flags=re.S)
    assert not re.search(r"::\s*$", outside_code, re.M), outside_code
    assert not re.search(r"^``[^`]+``$", outside_code, re.M), outside_code  # a bare reST term


def _guides() -> list[Path]:
    return sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "index.md")


@pytest.mark.parametrize("page", _guides(), ids=lambda p: p.name)
def test_every_guide_has_headings(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    if "<!-- include:" in text:
        return  # the included README is the page
    assert text.startswith("# "), f"{page.name}: no title"
    assert re.search(r"^## ", text, re.M), f"{page.name}: no section headings (empty table of contents)"


def _hooks() -> types.ModuleType:
    """docs/_build/hooks.py without mkdocs (only its pure functions are used)."""
    files = types.ModuleType("mkdocs.structure.files")
    files.File = files.Files = object  # type: ignore[attr-defined]
    for name in ("mkdocs", "mkdocs.structure"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules.setdefault("mkdocs.structure.files", files)
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs/_build/hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_result_pages_the_docs_link_to_are_on_the_site():
    hooks = _hooks()
    linked = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks/README.md"]:
        text = page.read_text()
        linked |= set(re.findall(r"\((?:\.\./)*(benchmarks/results/[\w.-]+\.md)(?:#[\w-]*)?\)", text))
        linked |= {"benchmarks/" + m for m in re.findall(r"\((results/[\w.-]+\.md)(?:#[\w-]*)?\)", text)}
    assert linked, "no result page linked: the test reads links wrongly"
    nav = {p for item in hooks.results_nav() for entries in item.values() for e in entries for p in e.values()}
    for path in sorted(linked):
        assert (ROOT / path).is_file(), path
        assert path in hooks.RESULT_PAGES, f"{path} is linked but is no page of the site"
        assert hooks.RESULT_PAGES[path] in nav, f"{path} is a page outside the navigation"
    # the link becomes a link to the page, not plain text
    rewritten = hooks._links("[coverage](benchmarks/results/coverage_cpu.md)", "README.md", "index.md")
    assert rewritten == "[coverage](results/coverage_cpu.md)", rewritten


def test_result_pages_are_titled_by_what_and_where_and_grouped():
    """Issue 46: 46 entries in one list, truncated near-identical titles (five "HF Llama
    8B-shaped ... NVIDIA H100 80GB HBM"), one titled by a raw table row."""
    hooks = _hooks()
    nav = hooks.results_nav()
    groups = {group: [next(iter(entry)) for entry in entries] for item in nav for group, entries in item.items()}
    titles = [t for entries in groups.values() for t in entries]
    assert len(titles) == len(hooks.RESULT_PAGES), "a result page is missing from the navigation"
    assert len(set(titles)) == len(titles), sorted(t for t in titles if titles.count(t) > 1)
    assert {"Model level", "Op level"} <= set(groups) and "Other" not in groups, list(groups)
    assert all(len(entries) <= 20 for entries in groups.values()), {g: len(e) for g, e in groups.items()}
    for path, site_path in hooks.RESULT_PAGES.items():
        title = next(t for item in nav for entries in item.values() for e in entries for t, p in e.items() if p == site_path)
        assert not title.startswith("|") and len(title) <= 80, title
        if re.search(r"h100|h200", path) or re.search(r"NVIDIA H\d00", (ROOT / path).read_text()[:400]):
            assert re.search(r"H100|H200", title), (path, title)  # which GPU
    assert "HF Llama 8B-shaped, DTensor TP, 2x H100 (run 1)" in titles
    assert "All-reduce + RMSNorm + FP8 quant, 2x H200" in titles  # the one titled by a table row


def test_mkdocs_serves_pages_as_files():
    """Issue 46: directory URLs (``install/``) open a directory listing from ``file://``."""
    text = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^use_directory_urls: false$", text, re.M)


HREF = re.compile(r"""\b(?:href|src)=["']([^"']*)["']""")


def broken_links(site: Path) -> list[str]:
    """Links of the built site that do not open a file from ``file://``: a missing file, a
    folder (a directory URL: a listing, not a page) or a root-absolute path."""
    broken = []
    for page in sorted(site.rglob("*.html")):
        for target in HREF.findall(page.read_text(errors="replace")):
            if not target or re.match(r"^[a-z][a-z0-9+.-]*:|^#|^//", target):
                continue  # external, an anchor of the page itself, data:, mailto:
            path = target.split("#")[0].split("?")[0]
            where = f"{page.relative_to(site)}: {target}"
            if path.startswith("/"):
                broken.append(f"{where} (root-absolute)")
                continue
            resolved = (page.parent / path).resolve()
            if resolved.is_dir() or not resolved.exists():
                broken.append(f"{where} ({'a folder' if resolved.is_dir() else 'no such file'})")
    return broken


@pytest.fixture(scope="module")
def site() -> Path:
    """The built site: ``$DOCS_SITE_DIR`` (``nox -s docs`` sets it after building)."""
    import os

    where = os.environ.get("DOCS_SITE_DIR")
    if not where:
        pytest.skip("the site is not built here: `nox -s docs` builds it and runs these tests")
    path = Path(where) if Path(where).is_absolute() else ROOT / where
    assert (path / "index.html").is_file(), f"{path}: no built site"
    return path


def test_every_link_of_the_built_site_opens_a_file(site):
    broken = broken_links(site)
    assert not broken, f"{len(broken)} broken link(s), e.g.: " + "; ".join(broken[:10])


def test_the_link_checker_finds_what_the_issue_found(tmp_path):
    (tmp_path / "install").mkdir()
    (tmp_path / "index.html").write_text('<a href="install/">x</a><a href="/install.html">y</a><a href="a.html#z">')
    (tmp_path / "a.html").write_text('<a href="https://x.org/"><a href="#top"><img src="index.html">')
    assert broken_links(tmp_path) == [
        "index.html: install/ (a folder)",
        "index.html: /install.html (root-absolute)",
    ]
