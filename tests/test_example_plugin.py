"""The example third-party plugin, as a user gets it: installed from examples/, discovered
through its entry point, enabled by name, its own tests green, and shown as it is by
docs/writing-a-pass.md. And a broken plugin distribution, reported while the others load.

Everything that needs a freshly installed distribution runs in a subprocess: an editable
install made by this process is not importable in it (``.pth`` files are read at start-up).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "passkit-example-plugin"
BROKEN = ROOT / "examples" / "passkit-broken-plugin"
GUIDE = ROOT / "docs" / "writing-a-pass.md"


def _project(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())["project"]


def _installed_from(distribution: str) -> str | None:
    """The ``file://`` URL ``distribution`` was installed from, or ``None``."""
    try:
        direct_url = importlib.metadata.distribution(distribution).read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return None
    return json.loads(direct_url or "{}").get("url")


def _pip_install(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"


def _python(code: str, *, cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run ``code`` in a fresh interpreter without PASSKIT_* settings; return its stdout."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PASSKIT_")}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**clean, **(env or {})},
        timeout=300,
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def example() -> dict:
    """The example distribution, installed (editable) from this checkout unless it already is."""
    project = _project(EXAMPLE)
    if _installed_from(project["name"]) != EXAMPLE.as_uri():
        _pip_install("-e", str(EXAMPLE))
    return project


def test_example_tests_pass(example):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        cwd=EXAMPLE,
        timeout=600,
    )
    assert proc.returncode == 0, f"the example's tests failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert re.search(r"\b\d+ passed\b", proc.stdout)


def test_discovered_listed_and_compiled_by_name(example, tmp_path):
    out = _python(
        """
        import json, torch, passkit
        from passkit.cli import main

        main(["list"])
        passes = passkit.get_plugins().passes
        origins = {n: [passes[n].plugin.distribution, passes[n].plugin.version] for n in ("fold_double_neg", "fuse_addcmul")}
        backend = passkit.backend(passes=["fold_double_neg", {"name": "fuse_addcmul", "min_numel": 8}])

        def fn(a, b, c):
            return a + b * c * 0.25 + torch.neg(torch.neg(a))

        args = [torch.randn(4, 8) for _ in range(3)]
        torch.testing.assert_close(torch.compile(fn, backend=backend)(*args), fn(*args))
        matches = {r.name: r.matches for r in backend.last_report.records}
        print(json.dumps({"origins": origins, "matches": matches}))
        """,
        cwd=tmp_path,
        env={"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"},  # a hit runs no pass
    )
    *listing, last = out.strip().splitlines()
    facts = json.loads(last)
    origin = [example["name"], example["version"]]
    assert facts["origins"] == {"fold_double_neg": origin, "fuse_addcmul": origin}
    assert facts["matches"] == {"fold_double_neg": 1, "fuse_addcmul": 1}
    assert any(re.match(rf"fuse_addcmul\s.*{example['name']} {example['version']}", line) for line in listing)


def test_broken_plugin_is_reported_while_the_others_load(tmp_path):
    source, site = tmp_path / "source", tmp_path / "site"
    shutil.copytree(BROKEN, source)  # building writes build/ and *.egg-info next to the sources
    _pip_install("--target", str(site), str(source))  # never into the environment
    pythonpath = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    out = _python(
        """
        import json
        from passkit._plugins.registry import get_plugins
        from passkit_broken.well_formed import WellFormed
        from passkit_testing import PassChecker

        import passkit
        import torch
        from torch.fx.experimental.proxy_tensor import make_fx

        plugins = get_plugins()
        gm = make_fx(lambda x: torch.relu(x.view(8).view(2, 4)), tracing_mode="fake")(torch.randn(2, 4))
        report = passkit.build_pipeline(passes=["noop_elimination", "cleanup"]).run(gm)
        print(json.dumps({
            "failures": {f.name: [f.distribution, f.version, f.stage, f.error] for f in plugins.failures},
            "passes": sorted(plugins.passes),
            "plugin_valid": str(PassChecker(WellFormed).check("plugin-valid")),
            "ran": [(r.name, r.status) for r in report.records],
            "hook_failures": [[f.plugin, f.distribution, f.version, f.hook, f.error] for f in report.hook_failures],
            "table": report.format(),
        }))
        """,
        cwd=tmp_path,
        env={"PYTHONPATH": pythonpath},
    )
    facts = json.loads(out.strip().splitlines()[-1])
    broken = _project(BROKEN)
    dist = [broken["name"], broken["version"]]
    failures = facts["failures"]
    assert failures["raises_on_import"] == [
        *dist,
        "import",
        "RuntimeError: passkit-broken-plugin fails on import on purpose",
    ]
    assert failures["bad_signature"][:3] == [*dist, "validate"]
    assert "Argument(s) {'config'} are declared in the hookimpl" in failures["bad_signature"][3]
    assert {"noop_elimination", "cleanup"} <= set(facts["passes"])
    assert "well_formed" not in facts["passes"]
    assert facts["plugin_valid"].startswith(
        "plugin-valid: failed: the plugins of its distribution fail to load"
    )
    assert f"(distribution {broken['name']} {broken['version']}) failed at validate" in facts["plugin_valid"]
    # the plugin that loads but raises in its hooks: the compile goes on, the report names it
    assert "raises_in_hooks" not in failures
    assert facts["ran"] == [["noop_elimination", "ran"], ["cleanup", "ran"]]
    assert facts["hook_failures"] == [
        [
            "raises_in_hooks",
            *dist,
            "passkit_before_pass",
            "RuntimeError: passkit-broken-plugin's before-pass hook fails on purpose (noop_elimination)",
        ],
        [
            "raises_in_hooks",
            *dist,
            "passkit_report",
            'KeyError: "passkit-broken-plugin\'s report hook fails on purpose"',
        ],
    ]
    assert (
        f"PLUGIN HOOK FAILED: hook passkit_before_pass of plugin 'raises_in_hooks' (distribution {broken['name']} {broken['version']})"
        in facts["table"]
    )


def test_guide_shows_the_example_files_as_they_are():
    shown = re.findall(r"^```\w+ file=(\S+)\n(.*?)^```$", GUIDE.read_text(), flags=re.MULTILINE | re.DOTALL)
    for path, code in shown:
        assert (ROOT / path).read_text() == code, f"{GUIDE.name}: the block for {path} differs from the file"
    files = [
        EXAMPLE / "pyproject.toml",
        *EXAMPLE.glob("src/passkit_example/*.py"),
        *EXAMPLE.glob("tests/*.py"),
    ]
    every_file = {str(f.relative_to(ROOT)) for f in files if f.name != "__init__.py"}
    assert {path for path, _ in shown} == every_file
