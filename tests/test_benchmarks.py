"""The benchmark scripts' CPU modes still run (their GPU results are recorded in
benchmarks/README.md; these smoke runs check the scripts, not speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a 2-rank gloo run of the benchmark: about 70 s on 2 cores
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


@pytest.mark.slow
def test_tuned_e2e_cpu_smoke_run_tunes_both_stacks_and_times_the_three_variants(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/tuned_e2e.py",
            "--cpu",
            "--mode",
            "eager",
            "--tokens",
            "2,8",
            "--budget",
            "300",
        ],
        cwd=ROOT,
        env={
            **os.environ,
            "PASSKIT_CACHE_DIR": str(tmp_path),
            "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
            "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
        },
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for stack in ("llama8b", "prefill70b"):
        assert f"## {stack}: 1 layers" in out.stdout
    assert out.stdout.count("| tokens | Inductor (us) | tabled (us) | tabled | tuned (us) | tuned |") == 2
    assert out.stdout.count("Tuning: ") == 2 and out.stdout.count("; decision: tokens ") == 2
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| 2 |", "| 8 |"))]
    assert len(rows) == 2 * 2 + 2 * 2  # the side-by-side tables and the tuning medians
    assert "- tuned, " in out.stdout and "- tabled, " in out.stdout
    # one file per stack: the stack's graph is the same on both ranks (no rank-dependent constants)
    assert len(list(tmp_path.joinpath("fusion-decisions").iterdir())) == 2


@pytest.mark.slow
def test_compile_modes_smoke_run_compares_the_modes():
    out = subprocess.run(
        [sys.executable, "benchmarks/compile_modes.py", "--smoke"],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for variant in ("| inductor reduce-overhead |", "| passkit reduce-overhead |"):
        assert variant in out.stdout
    assert "output identical to Inductor reduce-overhead: {1: True, 8: True}" in out.stdout


@pytest.mark.slow
def test_compile_bill_smoke_run_prints_the_table(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/compile_bill.py",
            "--smoke",
            "--models",
            "tiny",
            "--worlds",
            "1",
            "--out",
            str(tmp_path / "bill"),
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "bill.json").read_text())["rows"]
    assert {(r["cache"], r["variant"]) for r in rows} == {
        (cache, variant)
        for cache in ("cold", "warm")
        for variant in ("inductor", "passkit no pass", "passkit first_use")
    }
    assert all(r["start_s"] >= r["first_call_s"] for r in rows), rows
    # world size 1: no pass of the serving config can run, so no token range is cut
    assert all(r["compiles"] == 1 for r in rows if r["variant"] != "inductor"), rows


@pytest.mark.slow
def test_hf_tp_smoke_run_shows_sites_and_every_variant(tmp_path):
    """The gate's Hugging Face TP=2 run on 2 gloo processes, each variant in fresh processes
    that end through destroy_process_group(): every site fused in each compile, each variant
    timed, each rank's exit recorded, the targets checked (CPU timings mean nothing)."""
    pytest.importorskip("transformers")
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/hf_tp.py",
            "--smoke",
            "--only",
            "inductor",
            "passkit reduce-overhead",
            "--out",
            str(tmp_path / "hf"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,  # a hang bound: two fresh worlds compile a Llama on a loaded 2-core machine
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "allreduce_rmsnorm ran/2" in out.stdout
    for variant in ("| inductor |", "| passkit reduce-overhead |"):
        assert variant in out.stdout
    assert "each variant in fresh processes" in out.stdout
    assert "targets: " in out.stdout
    result = json.loads((tmp_path / "hf.json").read_text())
    assert result["world"] == 2
    # each variant ran in fresh processes that ended through destroy_process_group()
    assert set(result["exit_s"]) == set(result["ms"]) == {"inductor", "passkit reduce-overhead"}
    assert all(e is not None for exits in result["exit_s"].values() for e in exits), result["exit_s"]


def test_op_host_cost_cpu_mode_compares_the_two_op_registrations(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/op_host_cost.py",
            "--rounds",
            "2",
            "--calls",
            "20",
            "--out",
            str(tmp_path / "o"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| custom_op | Library | ratio |" in out.stdout
    result = json.loads((tmp_path / "o.json").read_text())
    assert set(result["dispatch_us"]) == {"custom_op", "library"}
    assert all(v > 0 for v in result["dispatch_us"].values())
