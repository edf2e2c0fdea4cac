"""A restored report describes the code that runs (issue 27): two environments (here two
"torch versions": torch's source hash, which Inductor's cache key holds, patched per process)
share one Inductor cache folder and one passkit report cache; each is served its own code from
Inductor's cache and its own report from passkit's. Keyed by the pipeline and the graph alone,
the third run printed the second's report ("declined") over the first's fused code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_each_environment_restores_its_own_report(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PASSKIT_", "TORCHINDUCTOR_"))}
    env.update(
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
        PASSKIT_CACHE_DIR=str(tmp_path / "reports"),
        OMP_NUM_THREADS="1",
    )

    def run(version):
        out = subprocess.run(
            [sys.executable, "-m", "tests.core.env_cache_probe", version],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    new, old = run("2.14"), run("2.11")
    assert (new["hit"], new["matches"], old["hit"], old["matches"]) == (0, 1, 0, 0)
    assert new["out"] != old["out"]  # the rewrite ran in one environment only
    new_again, old_again = run("2.14"), run("2.11")
    for again, first in ((new_again, new), (old_again, old)):
        assert again["hit"] > 0 and again["restored"]  # Inductor's cache served it; no pass ran
        assert again["out"] == first["out"]
        assert (again["matches"], again["notes"]) == (first["matches"], first["notes"])
