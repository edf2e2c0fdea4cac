"""A pass package costs nothing until one of its passes runs (issue 28).

Loading passkit-fusion's plugin imports its pass classes only: no custom-op definitions,
no matcher, no runtime, no torch private modules. A backend with no pass, the named backend
with no config, and the serving config at world size 1 (where none of the fusion passes can
run) build and compile without them, each in a fresh process. Inductor itself is imported
when a backend is built (as ``torch.compile(backend="inductor")`` imports it inside
``torch.compile``), not inside Dynamo's compile of the first call, where the same import made
a warm start about 0.4 s slower; the named backend, built at its first compile, imports it
there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("import_probe.py")
FUSION_MODULES = (
    "passkit_fusion.allreduce_rmsnorm.ops",
    "passkit_fusion.allreduce_rmsnorm.runtime",
    "passkit_fusion.sequence_parallel.ops",
    "passkit_fusion.sequence_parallel.rewrite",
    "passkit_fusion.async_tp.ops",
    "passkit_fusion.async_tp.runtime",
    "passkit_fusion.async_tp.host",
    "passkit_fusion.allreduce_overlap.ops",
    "passkit_fusion.allreduce_overlap.runtime",
    "passkit_fusion.patterns.sites",
    "passkit_fusion.collective",
    "passkit_fusion.tuning.tables",
    "flashinfer",
)


def _probe(variant: str, tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PASSKIT_", "TORCH_LOGS"))}
    env.update(
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        PASSKIT_CACHE_DIR=str(tmp_path / "reports"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run(
        [sys.executable, str(PROBE), variant],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a fresh process compiling with Inductor each: 50-60 s on 2 cores
@pytest.mark.parametrize("variant", ["none", "named", "serving"])
def test_backend_without_a_runnable_fusion_pass_imports_none_of_its_modules(variant: str, tmp_path: Path):
    result = _probe(variant, tmp_path)
    at_init = result["at_init"]
    assert [m for m in at_init if not m.startswith("torch.")] == [], "imported when the backend was built"
    assert ("torch._inductor.compile_fx" in at_init) == (variant != "named")
    assert [m for m in result["after_compile"] if m in FUSION_MODULES] == []
    assert result["ran"] == (["cleanup"] if variant == "serving" else [])
