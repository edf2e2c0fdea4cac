"""mkdocs hooks of the documentation site (``mkdocs.yml``: ``hooks``).

* ``<!-- include: PATH -->`` on a line of its own puts the repository file ``PATH`` in the
  page (the README is the front page; passkit-fusion's, passkit-testing's and the
  benchmarks' READMEs are pages), its headings shifted with ``<!-- include: PATH shift=1 -->``.
* Links to repository files outside ``docs/`` are checked here (mkdocs checks only links
  between pages): a README that is a page becomes a link to that page, a file that exists
  becomes its path in code, a file that does not exist is an error of the build.
* ``<!-- config-schema -->`` becomes the JSON schema of ``passkit.Config``, generated now.
* ``benchmarks/results/*.png`` are served beside the benchmarks page, and every
  ``benchmarks/results/*.md`` is a page of the site (``results/NAME.md``, under "Benchmark
  results" in the navigation), so the docs' links to results are links.
* A fence ```` ```python file=PATH ```` (docs/writing-a-pass.md: the test suite checks that
  the block is that file) is shown with ``PATH`` as its title.
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.plugins.passkit")

ROOT = Path(__file__).resolve().parents[2]
PAGES = {
    "README.md": "index.md",
    "passkit_fusion/README.md": "fusion.md",
    "passkit_testing/README.md": "testing.md",
    "benchmarks/README.md": "benchmarks.md",
}
"""Repository files that are pages of the site, by the page they are."""
ASSETS = {
    f"benchmarks/results/{p.name}": f"results/{p.name}" for p in (ROOT / "benchmarks/results").glob("*.png")
}
"""Repository images served with the site, by their path in the site."""
RESULT_PAGES = {
    f"benchmarks/results/{p.name}": f"results/{p.name}"
    for p in sorted((ROOT / "benchmarks/results").glob("*.md"))
}
"""Result tables that are pages of the site, by the page they are (each includes its file)."""

INCLUDE = re.compile(r"^<!-- include: (\S+)(?: shift=(\d))? -->$", re.M)
LINK = re.compile(r"(!?\[[^\]\n]*\])\(([^)\s]+)\)")
HEADING = re.compile(r"^(#+) ", re.M)
FILE_FENCE = re.compile(r"^```(\w+) file=(\S+)$", re.M)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def results_nav() -> list[dict[str, str]]:
    """The navigation entries of :data:`RESULT_PAGES`, titled by each file's first line."""
    out = []
    for repo_path, site_path in RESULT_PAGES.items():
        first = (ROOT / repo_path).read_text().lstrip().splitlines()[:1] or [site_path]
        title = first[0].lstrip("#").strip() or site_path
        out.append({title.split(" — ")[0][:80]: site_path})
    return out


def on_config(config: Any) -> Any:
    nav = config["nav"]
    at = next(i for i, item in enumerate(nav) if isinstance(item, dict) and "Benchmarks" in item)
    nav.insert(at + 1, {"Benchmark results": results_nav()})
    return config


def on_files(files: Files, config: Any) -> Files:
    for repo_path, site_path in ASSETS.items():
        files.append(File.generated(config, site_path, abs_src_path=str(ROOT / repo_path)))
    for repo_path, site_path in RESULT_PAGES.items():
        files.append(File.generated(config, site_path, content=f"<!-- include: {repo_path} -->\n"))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    page_repo_path = f"docs/{page.file.src_uri}"
    markdown = _links(markdown, page_repo_path, page.file.src_uri)

    def include(match: re.Match[str]) -> str:
        path, shift = match.group(1), int(match.group(2) or 0)
        source = ROOT / path
        if not source.is_file():
            log.warning("%s: include of %s: no such file", page_repo_path, path)
            return ""
        text = _links(source.read_text(), path, page.file.src_uri)
        if shift:
            text = _outside_fences(text, lambda t: HEADING.sub(lambda m: "#" * shift + m.group(0), t))
        return text

    markdown = INCLUDE.sub(include, markdown)
    markdown = FILE_FENCE.sub(r'```\1 title="\2"', markdown)
    if "<!-- config-schema -->" in markdown:
        markdown = markdown.replace("<!-- config-schema -->", _config_schema())
    return markdown


def _links(text: str, repo_path: str, page_uri: str) -> str:
    """Rewrite the links of ``text`` (from the repository file ``repo_path``) for the page
    ``page_uri``: see the module docstring."""

    def rewrite(match: re.Match[str]) -> str:
        label, target = match.groups()
        if re.match(r"^[a-z]+:|^#|^/", target):
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(repo_path), path))
        page_dir = posixpath.dirname(page_uri)
        site_path = None
        if resolved.startswith("docs/"):
            site_path = resolved[len("docs/") :]
        elif resolved in PAGES:
            site_path = PAGES[resolved]
        elif resolved in ASSETS:
            site_path = ASSETS[resolved]
        elif resolved in RESULT_PAGES:
            site_path = RESULT_PAGES[resolved]
        if site_path is not None:
            relative = posixpath.relpath(site_path, page_dir or ".")
            return f"{label}({relative}{'#' + anchor if anchor else ''})"
        if not (ROOT / resolved).exists():
            log.warning("%s: link to %s, which is not in the repository", repo_path, target)
            return match.group(0)
        if label.startswith("!"):
            log.warning("%s: image %s is not served with the site (see ASSETS)", repo_path, target)
            return match.group(0)
        name = label[1:-1]
        if name.strip("`").rstrip("/") == resolved.rstrip("/"):
            return f"`{resolved}`"
        return f"{name} (`{resolved}`)"

    return _outside_fences(text, lambda t: LINK.sub(rewrite, t))


def _outside_fences(text: str, fn: Any) -> str:
    """Apply ``fn`` to the parts of ``text`` outside fenced code blocks."""
    out, last = [], 0
    for fence in FENCE.finditer(text):
        out += [fn(text[last : fence.start()]), fence.group(0)]
        last = fence.end()
    return "".join([*out, fn(text[last:])])


def _config_schema() -> str:
    import passkit

    schema = json.dumps(passkit.Config.model_json_schema(), indent=2)
    return f"```json\n{schema}\n```"
