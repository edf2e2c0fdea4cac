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
    "CHANGELOG.md": "changelog.md",
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


RESULT_KINDS = (
    # (file name prefix, group, what the file measures); the longest matching prefix wins
    ("hf_tp_profile", "Where the time goes", "HF Llama TP, time by cause"),
    ("hf_tp", "Model level", "HF Llama 8B-shaped, DTensor TP"),
    ("hf_tp_h200x2_overlap", "Model level: copy-engine overlap", "HF Llama TP, copy-engine overlap"),
    ("hf_tune", "Measured decisions", "HF Llama TP, tuned, stored, restored"),
    ("tuned_e2e", "Measured decisions", "Llama stack, tuned vs tabled"),
    ("fusion_e2e_fp8", "Model level", "Llama 8B-shaped stack, FP8 fusion"),
    ("fusion_e2e", "Model level", "Llama 8B-shaped stack, fusion passes"),
    ("coverage_decode", "Model level", "Qwen3-MoE-shaped decode"),
    ("allreduce_layernorm", "Op level", "All-reduce + add + LayerNorm"),
    ("fusion_op_fp8", "Op level", "All-reduce + RMSNorm + FP8 quant"),
    ("fusion_op", "Op level", "All-reduce + add + RMSNorm"),
    ("async_tp_op", "Op level", "MLP: TP, sequence parallel, async TP"),
    ("overlap_norm_kernel", "Op level", "Copy-engine overlap: its norm kernel vs Inductor"),
    ("overlap_op", "Op level", "Matmul + all-reduce on the copy engines"),
    ("overlap_host_cost", "Op level", "Copy-engine overlap: host time per call"),
    ("op_host_cost", "Op level", "Host time per fused call"),
    ("compile_modes", "Compile time", "torch.compile modes"),
    ("compile_bill", "Compile time", "Compile time bill"),
    ("warm_start", "Compile time", "Warm start at world size 1"),
    ("coverage_all", "Coverage on CPU", "Every family with a TP plan"),
    ("coverage_cpu_layernorm", "Coverage on CPU", "LayerNorm families"),
    ("coverage_cpu", "Coverage on CPU", "RMSNorm families"),
    ("coverage_gpu", "Coverage on GPUs", "Families with the GPU kernels"),
    ("core_overhead", "passkit overhead (CPU)", "Core overhead"),
    ("output_check", "passkit overhead (CPU)", "Checks after each pass"),
    ("range_dispatch", "passkit overhead (CPU)", "Token-range dispatch"),
    ("torch_versions", "Test runs", "Fusion tests on each torch"),
    ("stale_skip", "Test runs", "A skip after its cause is gone"),
    ("servers_cpu", "Test runs", "Real vLLM and SGLang servers, TP=2 on a CPU"),
    ("latest", "Test runs", "The newest releases (nox -s latest)"),
)
"""How the navigation groups and titles ``benchmarks/results/*.md``: by what they measure
and where (a new result file with a known prefix needs nothing here)."""
VARIANTS = {
    "sp4096": "SP from 4096 tokens",
    "with_torch_async_tp": "with torch's async TP",
    "fresh": "fresh processes",
    "first_use": "ranges at first use",
    "range_cache": "AOTAutograd cache per range",
    "gc": "garbage collector timed",
    "tiny": "tiny model",
    "warm": "warm",
    "warm3": "3 warm runs",
    "models": "two models",
    "pool": "compile worker pool",
    "best": "minimum",
    "quiet": "quiet machine",
    "graph_ro": "captured whole, reduce-overhead",
    "ro_default": "reduce-overhead, default mode",
    "ro": "reduce-overhead",
    "overlap": "allreduce_overlap, captured whole",
    "overlap_ce_ro": "copy-engine overlap, reduce-overhead",
    "overlap_norm_ro": "overlap + norm, reduce-overhead",
    "overlap_chunked_norm_ro": "overlap + norm per chunk, reduce-overhead",
    "ce_ro": "sum, then Inductor's norm",
    "norm": "norm in the op, 6 rounds",
    "norm_8l": "norm in the op, 8 layers",
    "whole_overlap_norm": "whole, with the norm-fused overlap",
    "8layers": "8 layers, captured whole",
    "ro_skip": "reduce-overhead, guards skipped",
    "ro_ceiling": "reduce-overhead and the ceiling",
    "llama8b": "8-layer decode",
    "llama8b_ro": "8-layer decode, reduce-overhead",
}
"""Words of a result file's name after its hardware, spelled out in its title."""
GPU = re.compile(r"\b(?:NVIDIA )?(H100|H200|A100|B200|L40S?)\b")


def result_title(stem: str, text: str) -> tuple[str, str]:
    """``(group, title)`` of the result file ``stem``: what it measures (:data:`RESULT_KINDS`),
    then where (``2x H200``, ``CPU``), then its variant (``run 3``)."""
    kind = max((k for k in RESULT_KINDS if stem.startswith(k[0])), key=lambda k: len(k[0]), default=None)
    if kind is None:  # an unknown kind: its first line, unless that is a table row
        first = next((line for line in text.splitlines() if line.strip()), "")
        title = first.lstrip("#").strip().split(" — ")[0]
        return "Other", (title[:60] if title and not title.startswith("|") else stem.replace("_", " "))
    prefix, group, what = kind
    words = [w for w in stem[len(prefix) :].split("_") if w]
    gpu = count = None
    head = "\n".join(text.splitlines()[:3])
    if found := GPU.search(head):
        gpu = found.group(1)
    rest: list[str] = []
    for word in words:
        if m := re.fullmatch(r"(h100|h200)(?:x(\d+))?", word):
            gpu, count = m.group(1).upper(), count or m.group(2)
        elif m := re.fullmatch(r"[wx](\d+)", word):
            count = m.group(1)  # the world size: the GPUs this run used
        elif word == "cpu":
            gpu = "CPU"
        elif m := re.fullmatch(r"(?:run|r)(\d+)", word):
            rest.append(f"run {m.group(1)}")
        elif m := re.fullmatch(r"tp(\d+)", word):
            rest.append(f"TP={m.group(1)}")
        elif m := re.fullmatch(r"dp(\d+)", word):
            rest.append(f"{m.group(1)} data-parallel replicas")
        else:
            rest.append(word)
    joined = "_".join(w for w in rest if not w.startswith(("run ", "TP=")))
    if joined in VARIANTS:  # a variant of several words (with_torch_async_tp)
        rest = [*(w for w in rest if w.startswith(("run ", "TP="))), VARIANTS[joined]]
    rest = [VARIANTS.get(w, w) for w in rest]
    if gpu and gpu != "CPU" and count is None and (m := re.search(rf"{gpu}[^,;)]*? x(\d+)|(\d+)x (?:NVIDIA )?{gpu}", head)):
        count = m.group(1) or m.group(2)
    if gpu is None and group in ("passkit overhead (CPU)", "Coverage on CPU", "Test runs"):
        gpu = "CPU"
    where = "CPU" if gpu == "CPU" else f"{count}x {gpu}" if gpu and count else gpu
    title = what + (f", {where}" if where else "") + (f" ({', '.join(rest)})" if rest else "")
    return group, title


def results_nav() -> list[dict[str, list[dict[str, str]]]]:
    """The navigation of :data:`RESULT_PAGES`: grouped (:data:`RESULT_KINDS`), each page titled
    by what it measures and on which hardware."""
    groups: dict[str, list[dict[str, str]]] = {g: [] for _, g, _ in RESULT_KINDS}
    groups["Other"] = []
    for repo_path, site_path in RESULT_PAGES.items():
        path = ROOT / repo_path
        group, title = result_title(path.stem, path.read_text())
        groups[group].append({title: site_path})
    return [{group: sorted(pages, key=lambda p: next(iter(p)))} for group, pages in groups.items() if pages]


def on_config(config: Any) -> Any:
    nav = config["nav"]
    at = next(i for i, item in enumerate(nav) if isinstance(item, dict) and "Benchmarks" in item)
    nav.insert(at + 1, {"Benchmark results": results_nav()})
    return config


def on_post_build(config: Any) -> None:
    """404.html links root-absolute (``/install.html``), as mkdocs renders it for a web
    server's root: relative ones work there too (the page is at the root) and from the file
    system (``file://.../site/404.html``)."""
    page = Path(config["site_dir"]) / "404.html"
    if page.is_file():
        text = page.read_text()
        text = re.sub(r'((?:href|src)=")/(?!/)', r"\1./", text)
        page.write_text(text.replace('"base": "/"', '"base": "."'))  # the theme's scripts too


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
