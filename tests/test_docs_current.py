"""The user docs state where things stand: no project issue numbers, no session dates, no
path outside the repository (history goes to CHANGELOG.md and benchmarks/HISTORY.md), and
every speed-up the benchmarks' README quotes is in the result file its row links. A cheap
text scan, no imports of passkit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
USER_DOCS = sorted(
    {
        ROOT / "README.md",
        ROOT / "passkit_fusion/README.md",
        ROOT / "passkit_testing/README.md",
        ROOT / "benchmarks/README.md",
        *(ROOT / "docs").glob("**/*.md"),
        *(ROOT / "examples").glob("**/README.md"),
    }
)
"""What a user reads: the front page, the pages of the site, the distributions' READMEs."""
USER_CODE = sorted(
    p
    for folder in ("passkit", "passkit_fusion/src", "passkit_testing/src", "benchmarks")
    for p in (ROOT / folder).glob("**/*")
    if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts
)
"""Where CLI help, error messages and the scripts' usage come from."""
ISSUE = re.compile(r"\bissues? #?\d+|\bissue\s*#\d+|\(#\d+\)", re.I)
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w.])/work/")
CODE = re.compile(r"^(```|~~~).*?^\1|`[^`]+`", re.M | re.S)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _findings(pattern: re.Pattern[str], text: str) -> list[str]:
    return [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in pattern.finditer(text)]


@pytest.mark.parametrize("page", USER_DOCS, ids=_rel)
def test_user_docs_cite_no_issue_number_date_or_outside_path(page):
    text = page.read_text()
    # a date in code is sample output (a report's "tuned 2026-11-25"), not when a doc was written
    prose = CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    found = _findings(ISSUE, text) + _findings(DATE, prose) + _findings(OUTSIDE, text)
    assert not found, f"{_rel(page)}: {found} (history goes to CHANGELOG.md)"


def test_user_docs_link_nothing_outside_the_repository():
    link = re.compile(r"\]\(([^)\s#]+)")
    outside = [
        f"{_rel(page)}: {target}"
        for page in USER_DOCS
        for target in link.findall(page.read_text())
        if not re.match(r"^[a-z]+:", target) and not (page.parent / target).resolve().is_relative_to(ROOT)
    ]
    assert not outside, outside


def test_code_users_read_cites_no_issue_number_or_outside_path():
    found = [
        f"{_rel(path)} {hit}"
        for path in USER_CODE
        for hit in _findings(ISSUE, path.read_text()) + _findings(OUTSIDE, path.read_text())
    ]
    assert not found, found


def test_the_scan_finds_what_it_is_for():
    outside = "../" + "shared/device/x.sh"  # spelled apart: no tracked file names the path
    text = f"See issue 44; measured 2026-11-28 (`tuned 2026-11-25`); run {outside}\n"
    prose = CODE.sub(lambda m: " " * len(m.group(0)), text)
    assert [m.group(0) for m in ISSUE.finditer(text)] == ["issue 44"]
    assert [m.group(0) for m in DATE.finditer(prose)] == ["2026-11-28"]
    assert [m.group(0) for m in OUTSIDE.finditer(text)] == [outside[:9]]
    assert not ISSUE.search("the issue's table; reissue 3 tokens") and not OUTSIDE.search("a/work/b")


# -- the benchmarks' README: each quoted speed-up is in its result file ----------------------

BENCH_README = ROOT / "benchmarks/README.md"
RESULT_LINK = re.compile(r"\]\((results/[\w.-]+\.md)\)")
SPEEDUP = re.compile(r"(?<![\w.])\d+\.\d+x\b")


def _result_rows() -> list[str]:
    """The README's table rows that quote a speed-up (headers and separators excluded)."""
    rows = [line for line in BENCH_README.read_text().splitlines() if line.startswith("|")]
    return [row for row in rows if SPEEDUP.search(row)]


def test_benchmarks_readme_is_short_and_current():
    text = BENCH_README.read_text()
    assert len(text.splitlines()) < 300, "history goes to benchmarks/HISTORY.md"
    headings = re.findall(r"^## (.+)$", text, re.M)
    for question in (
        "How much faster",
        "GPUs and TP",
        "compile mode",
        "compile costs",
        "Op-level",
        "How to run",
    ):
        assert any(question.lower() in h.lower() for h in headings), f"no section on {question!r}: {headings}"
    assert headings.index(next(h for h in headings if "How to run" in h)) > 3, (
        "results first, then how to run"
    )


def missing_figures(row: str, base: Path) -> list[str]:
    """The speed-ups of a table row that none of the result files it links holds (all of
    them when it links none)."""
    texts = [(base / link).read_text() for link in RESULT_LINK.findall(row)]
    return [
        f for f in SPEEDUP.findall(row) if not any(re.search(rf"(?<![\w.]){re.escape(f)}", t) for t in texts)
    ]


def test_every_speedup_the_benchmarks_readme_quotes_is_in_the_file_its_row_links():
    rows = _result_rows()
    assert len(rows) >= 20, rows
    for row in rows:
        assert RESULT_LINK.search(row), f"a row quotes a speed-up and links no result file: {row}"
        assert not missing_figures(row, BENCH_README.parent), (
            f"{missing_figures(row, BENCH_README.parent)}: {row}"
        )


def test_the_figure_check_catches_a_figure_not_in_its_file(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results/r.md").write_text("| 1 | 1.19x | 2.5x |\n")
    assert missing_figures("| x | 1.19x | 11.19x | [r](results/r.md) |", tmp_path) == ["11.19x"]
    assert missing_figures("| x | 1.19x |", tmp_path) == ["1.19x"]  # no file linked


SUPPORTED = re.compile(r"Supported: (.*?transformers [^(]*\([^)]*\))", re.S)
"""The supported-versions statement: from ``Supported:`` to the transformers releases tested."""


def test_one_supported_versions_statement_on_every_page_that_gives_one():
    """README.md, docs/install.md and docs/development.md say the same Python, torch and
    transformers ranges, word for word (whitespace aside)."""
    statements = {}
    for page in ("README.md", "docs/install.md", "docs/development.md"):
        found = SUPPORTED.search((ROOT / page).read_text())
        assert found, f"{page}: no 'Supported: ... transformers ... (...)' statement"
        statements[page] = " ".join(found.group(1).split())
    assert len(set(statements.values())) == 1, statements
    assert "torch 2.10 to 2.15" in statements["README.md"]
