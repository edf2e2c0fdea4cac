"""The sample report of the README and docs/torch-compile.md, generated from the real demo.

``python docs/_build/demo_report.py`` runs the core demo (``passkit demo --only core``: two
transformer blocks, ``noop_elimination`` and ``cleanup``, Inductor) and writes its report
into the fenced block that follows each ``<!-- demo-report -->`` marker of those pages.
``tests/test_readme.py`` runs the demo too and compares (the times masked: they vary).
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "docs/torch-compile.md"]
MARKER = "<!-- demo-report -->"
BLOCK = re.compile(re.escape(MARKER) + r"\n```\n(.*?)```\n", re.S)
GRAPH = re.compile(r"^(passkit report \(graph )\d+", re.M)
TIMES = re.compile(r" +\d+\.\d+(?= *(?:ms|s\b)| +\d+->)")
"""A time with the spaces before it: a right-aligned column is as wide for 12.34 ms as for
2.86 ms, so the padding varies with the time (a loaded machine made the test flaky)."""


def demo_report() -> str:
    """The report the core demo prints (title to ``total`` line), trailing spaces cut."""
    from passkit.demo import run_core_demo

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = run_core_demo(mode="inductor")
    if status:
        raise RuntimeError(f"the core demo failed:\n{out.getvalue()}")
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("passkit report"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("total "))
    return "\n".join(line.rstrip() for line in lines[start : end + 1]) + "\n"


def page_reports(page: Path) -> list[str]:
    """The generated blocks of ``page``."""
    return BLOCK.findall(page.read_text())


def masked(report: str) -> str:
    """``report`` with its times (ms per pass, total, whole compile) and its graph number (a
    count of the process's compiles) as ``#``."""
    return GRAPH.sub(r"\1#", TIMES.sub(" #", report))


def main() -> int:
    report = demo_report()
    for page in PAGES:
        text = page.read_text()
        if MARKER not in text:
            print(f"{page}: no {MARKER} marker", file=sys.stderr)
            return 1
        page.write_text(BLOCK.sub(lambda _m: f"{MARKER}\n```\n{report}```\n", text))
        print(f"wrote the demo's report into {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
