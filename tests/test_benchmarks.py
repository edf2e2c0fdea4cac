"""The benchmark scripts' CPU modes still run (their GPU results are recorded in
benchmarks/README.md; these smoke runs check the scripts, not speed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fusion_e2e_cpu_smoke_run_shows_the_token_ranges():
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/fusion_e2e.py",
            "--cpu",
            "--tokens",
            "4,8",
            "--layers",
            "1",
            "--max-tokens",
            "6",
            "--variants",
            "allreduce_rmsnorm,sp_async_tp",
        ],
        cwd=ROOT,
        env={**os.environ, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        "tokens 1..6: allreduce_rmsnorm ran (2 sites); tokens >= 7: allreduce_rmsnorm skipped (0 sites)"
        in out.stdout
    )
    assert "Process exit after the last result, per rank (s):" in out.stdout
