"""The install commands the docs give work where the user stands: every ``pip install -e``
path of README.md and docs/install.md is a distribution of this repository with the extras
named, the README's commands run nox from a virtual environment (PEP 668), the CPU torch is
named, and ``nox -s build``'s command makes the three wheels with their dependencies, extras
and entry points."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "docs/install.md", ROOT / "docs/writing-a-pass.md"]
EDITABLE = re.compile(r"-e\s+'?([\w./-]+?)(?:\[(\w+)\])?'?(?=\s|$)")


def _commands(page: Path) -> list[str]:
    blocks = re.findall(r"```(?:bash)?\n(.*?)```", page.read_text(), flags=re.S)
    return [line.split("#")[0] for block in blocks for line in block.splitlines() if "pip install" in line]


def test_every_editable_install_is_a_distribution_with_its_extras():
    seen = 0
    for page in PAGES:
        for command in _commands(page):
            for path, extra in EDITABLE.findall(command):
                if path.startswith("path/to/") or path == ".":
                    path = path.removeprefix("path/to/passkit").lstrip("/") or "."
                pyproject = ROOT / path / "pyproject.toml"
                assert pyproject.is_file(), f"{page.name}: `pip install -e {path}`: no distribution there"
                project = tomllib.loads(pyproject.read_text())["project"]
                if extra:
                    extras = project.get("optional-dependencies", {})
                    assert extra in extras, f"{page.name}: {project['name']} has no extra [{extra}]"
                seen += 1
    assert seen >= 8, "the pages name fewer installs than expected: the test reads them wrongly"


def test_the_hf_extra_brings_what_explain_hf_needs():
    project = tomllib.loads((ROOT / "passkit_fusion/pyproject.toml").read_text())["project"]
    hf = " ".join(project["optional-dependencies"]["hf"])
    assert "transformers" in hf and "accelerate" in hf


def test_the_readme_installs_in_a_virtual_environment_with_the_cpu_torch():
    readme = (ROOT / "README.md").read_text()
    assert "python3 -m pip install nox" not in readme  # PEP 668: refused by Debian's python3
    # nox installed before the CPU index is exported: its install does not try that index
    commands = readme[readme.index("the two commands") :].split("```")[1]
    assert commands.index("python3 -m venv .venv && .venv/bin/pip install nox") < commands.index(
        "export PIP_EXTRA_INDEX_URL"
    )
    assert "\n.venv/bin/nox -s demo" in commands
    assert ".venv/bin/nox -s tests" in readme
    assert "https://download.pytorch.org/whl/cpu" in readme
    assert "pip install passkit passkit-fusion" not in readme  # not on PyPI
    ci = (ROOT / ".ci/run").read_text()
    assert "python3 -m venv" in ci and "-m pip install -q nox" in ci


def test_nox_build_makes_the_three_wheels(tmp_path):
    noxfile = (ROOT / "noxfile.py").read_text()
    assert "def build(session" in noxfile
    (distributions,) = [
        ast.literal_eval(node.value)
        for node in ast.parse(noxfile).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "DISTRIBUTIONS"
    ]
    done = subprocess.run(  # the build session's command
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(tmp_path), *distributions],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    wheels = {w.name.split("-")[0]: w for w in tmp_path.glob("*.whl")}
    assert set(wheels) == {"passkit", "passkit_fusion", "passkit_testing"}, wheels

    def metadata(name: str) -> tuple[str, str]:
        with zipfile.ZipFile(wheels[name]) as z:
            names = z.namelist()
            meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
            entry = next((n for n in names if n.endswith(".dist-info/entry_points.txt")), None)
            return meta, z.read(entry).decode() if entry else ""

    meta, entry_points = metadata("passkit_fusion")
    assert "Requires-Dist: passkit>=0.1" in meta and "Provides-Extra: hf" in meta
    assert "fusion = passkit_fusion.plugin" in entry_points
    meta, entry_points = metadata("passkit")
    assert "passkit = passkit.cli:main" in entry_points and "builtin = passkit.builtin.plugin" in entry_points
    meta, entry_points = metadata("passkit_testing")
    assert "Requires-Dist: passkit" in meta and "passkit = passkit_testing.pytest_plugin" in entry_points
