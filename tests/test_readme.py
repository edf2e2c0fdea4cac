"""The README (the front page) and the documentation pages cannot rot: the example plugin's
code they show is its real code, the README's example runs, the commands are CI's, every
link to a repository file points at one, and every config field and ``PASSKIT_*`` variable
is documented. (``nox -s docs`` checks links between pages and anchors too, with mkdocs.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from passkit import Config
from passkit.config import _ENV_FIELDS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples/passkit-example-plugin/src/passkit_example"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def python_blocks(text: str) -> list[str]:
    """Fenced ``python`` blocks (not those tagged ``file=``, which test_example_plugin checks)."""
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _without_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def test_pages_show_the_example_plugin_code_as_it_is():
    example = {p.name: p.read_text() for p in EXAMPLE.glob("*.py")}
    for page in PAGES:
        for block in python_blocks(page.read_text()):
            if "class FoldDoubleNeg" in block:
                assert block in example["fold_double_neg.py"], page
            if "def passkit_register_passes" in block and "FoldDoubleNeg" in block:
                body = "\n".join(line.split("#")[0].rstrip() for line in block.splitlines()) + "\n"
                assert body in example["plugin.py"], page


def test_readme_commands_are_the_ci_commands():
    readme = (ROOT / "README.md").read_text()
    assert "nox -s tests" in readme and "nox -s demo" in readme
    ci = (ROOT / ".ci/run").read_text()
    assert "nox -s tests" in ci
    assert "nox -s docs" in ci  # the documentation site is built in CI


def test_readme_is_a_front_page_linking_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 120, "the manual belongs in docs/, the README is the front page"
    linked = {m.group(1).partition("#")[0] for m in LINK.finditer(readme)}
    for page in ("docs/configuration.md", "docs/writing-a-pass.md", "docs/vllm.md", "docs/sglang.md"):
        assert page in linked, f"README links no {page}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_to_repository_files_exist(page):
    for match in LINK.finditer(_without_fences(page.read_text())):
        target = match.group(1)
        if re.match(r"^[a-z]+:|^#", target):
            continue
        path = (page.parent / target.partition("#")[0]).resolve()
        assert path.exists(), f"{page.relative_to(ROOT)}: link to {target}, which does not exist"


def test_every_config_field_and_environment_variable_is_documented():
    text = (ROOT / "docs/configuration.md").read_text()
    for field in Config.model_fields:
        assert re.search(rf"^{field} = ", text, flags=re.M), f"config field {field} is not in the example"
    for suffix in [*_ENV_FIELDS, "CONFIG", "CACHE_DIR"]:
        assert f"PASSKIT_{suffix}" in text, f"PASSKIT_{suffix} is not documented"


@pytest.mark.slow  # an Inductor compile in a fresh process: ~30 s on a busy 2-core machine
def test_the_readme_example_runs(tmp_path):
    """The ten lines of the front page, as written, in a fresh process."""
    block = next(b for b in python_blocks((ROOT / "README.md").read_text()) if "passkit.backend" in b)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PASSKIT_")}
    # caches of its own: a graph another passkit version put in a shared Inductor cache is
    # served without this version's report (the report cache keys the environment)
    env.update(
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), PASSKIT_CACHE_DIR=str(tmp_path / "reports")
    )
    proc = subprocess.run(
        [sys.executable, "-c", block], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "noop_elimination" in proc.stdout and "cleanup" in proc.stdout


def _demo_report_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_report", ROOT / "docs/_build/demo_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sample_report_is_the_demos():
    """The README's and docs/torch-compile.md's sample report is what ``passkit demo`` prints
    (times masked); ``python docs/_build/demo_report.py`` regenerates them."""
    demo = _demo_report_module()
    real = demo.masked(demo.demo_report())
    assert "noop_elimination" in real and "#" in real
    for page in demo.PAGES:
        (shown,) = demo.page_reports(page)
        assert demo.masked(shown) == real, f"{page.name}: run python docs/_build/demo_report.py"
