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


def _allreduce_layernorm_benchmark():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "allreduce_layernorm_bench", ROOT / "benchmarks/allreduce_layernorm.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_allreduce_layernorm_arguments_table_and_verdict():
    bench = _allreduce_layernorm_benchmark()
    args = bench.parser().parse_args(
        ["--world", "2", "--out", "benchmarks/results/allreduce_layernorm_h200x2"]
    )
    assert args.tokens == [1, 2, 4, 8, 16, 32, 64, 128, 256] and args.hidden == [4096] and not args.cpu
    env = {"date": "d", "gpu": "NVIDIA H200", "world": 2, "torch": "2.11", "cuda": "13.0", "triton": "3.5",
           "dtype": "bfloat16", "eps": 1e-5, "max_bytes": 4 << 20, "timing": "t"}  # fmt: skip
    fast = {"inductor": 20.0, "fused": 10.0, "symm_torch": 15.0, "symm_inductor": None}
    rows = [bench.Row(4096, t, dict(fast), True, 0.0, "symm_mem") for t in (1, 256)]
    text = bench.render(rows, env)
    assert "| 4096 | 1 | 20.0 | 10.0 | 2.00x | 15.0 | 1.33x | - | - | symm_mem | exact | 0.00e+00 |" in text
    assert "verdict: PAYS: the smallest speedup is 2.00x" in text
    rows[1].us["fused"] = 19.5  # 1.03x at 256 tokens: below the gate
    assert "verdict: does not pay: the smallest speedup is 1.03x (hidden 4096, 256 tokens)" in bench.render(
        rows, env
    )


@pytest.mark.slow  # a 2-rank gloo run: about a minute on 2 cores
def test_allreduce_layernorm_cpu_smoke_run(tmp_path):
    out = subprocess.run(
        [sys.executable, "benchmarks/allreduce_layernorm.py", "--cpu", "--tokens", "1", "8", "--hidden", "64",
         "--out", str(tmp_path / "aln")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| 64 | 8 |" in out.stdout and "verdict: none (CPU smoke run" in out.stdout
    result = json.loads((tmp_path / "aln.json").read_text())
    assert [r["tokens"] for r in result["rows"]] == [1, 8]
    assert all(r["residual_exact"] for r in result["rows"])
    assert (tmp_path / "aln.md").read_text().startswith("# All-reduce + residual add + LayerNorm")


def test_no_benchmark_leaves_with_os_exit_outside_a_simulated_rank_failure():
    """A benchmark ends as users' programs do (``destroy_process_group()``, the interpreter's
    own exit): ``os._exit`` would hide a teardown that hangs. Only ``teardown.py`` kills a rank
    on purpose (its ``rank_failed`` scenarios)."""
    offenders = [
        f"{path.name}:{n}"
        for path in sorted((ROOT / "benchmarks").glob("*.py"))
        if path.name != "teardown.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "os._exit(" in line
    ]
    assert offenders == []


def test_hf_tune_reads_each_compiles_decision_from_the_records_field():
    """A compile found the stored decision when every pass record that names where its token
    range came from (``PassRecord.decision``, skipped ranges' records too) says ``stored``;
    the prose notes are not read."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_tune_bench", ROOT / "benchmarks/hf_tune.py")
    hf_tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_tune)
    stored = {"allreduce_rmsnorm": "stored", "sequence_parallel": "stored"}
    assert hf_tune.restored({"decision": "", "decision_sources": stored})  # a range both skip
    assert not hf_tune.restored({"decision_sources": {**stored, "sequence_parallel": "table"}})
    assert not hf_tune.restored({"decision_sources": {"allreduce_rmsnorm": "options"}})
    assert not hf_tune.restored({"decision_sources": {}})  # a cache hit without its records
    # the prose alone (a report of an earlier hf_tp.py) no longer counts
    assert not hf_tune.restored({"decision": "fuse decision: stored (tuned 2026-11-25 in 12 s, in /c)"})


def test_hf_tp_checks_passkits_exits_and_only_reports_the_baselines(monkeypatch):
    """The exit target is passkit's: a baseline (Inductor alone, torch's own teardown) still
    alive after the limit is reported on its own line, not as passkit's target missed."""
    import argparse
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("hf_tp_bench", ROOT / "benchmarks/hf_tp.py")
    hf_tp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_tp)
    names = ("inductor reduce-overhead", "passkit reduce-overhead")
    res = {
        "layers": 2, "world": 2, "device": "cpu", "torch": "x", "reports": {},
        "ms": {n: {"2048": 1.0} for n in names},
        "rel_diff_vs_eager": {n: {"2048": 0.01} for n in names},
        "compile_and_warmup_s": {n: 1.0 for n in names},
        "exit_s": {"inductor reduce-overhead": [None, None], "passkit reduce-overhead": [4.1, 4.3]},
    }  # fmt: skip
    args = argparse.Namespace(tokens=[2048], smoke=False, rounds=1, iters=1, one_process=False, repeats=1)
    text = hf_tp.render(res, args)
    assert "baselines over 10 s or hung (None, killed): {'inductor reduce-overhead': [None, None]}" in text
    assert "exits over" not in text.split("targets:")[1]
    res["exit_s"]["passkit reduce-overhead"] = [4.1, None]
    assert "exits over 10 s or hung (None): {'passkit reduce-overhead': [4.1, None]}" in hf_tp.render(res, args)


@pytest.mark.slow  # passkit tune-model, then a fresh program: about 5 minutes on 2 cores
def test_hf_tune_smoke_run_stores_and_restores_the_decision(tmp_path):
    """`passkit tune-model` on the HF Llama (2 gloo ranks, reference op), then a fresh
    hf_tp.py program: every compile's report names the stored decision, the 1-token
    recompile's included (CPU timings mean nothing)."""
    pytest.importorskip("transformers")
    out = _script("benchmarks/hf_tune.py", "--smoke", "--out-dir", tmp_path, "--cache", tmp_path / "c")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Every compile found the stored decision: yes." in out.stdout, out.stdout[-3000:]
    record = json.loads((tmp_path / "hf_tune_w2.json").read_text())
    assert [r["tokens"] for r in record["rows"]] == [1, 8]
    assert len(list((tmp_path / "c" / "fusion-decisions").glob("*.json"))) == 2  # the 1-token graph's too


@pytest.mark.slow
def test_hf_tp_profile_smoke_run_skips_guards_with_the_same_outputs(tmp_path):
    """The attribution script's `ro-skip` mode: the `ro` variants called with Dynamo's guard
    evaluation skipped once warm, checked equal to the plain calls, timed beside them."""
    pytest.importorskip("transformers")
    out = _script("benchmarks/hf_tp_profile.py", "--smoke", "--modes", "ro", "ro-skip", "--out", tmp_path / "p")
    assert out.returncode == 0, out.stderr[-3000:]
    for variant in ("passkit reduce-overhead skip-guards", "ceiling reduce-overhead skip-guards"):
        assert f"| {variant} | 8 |" in out.stdout
    assert "excess over `ceiling reduce-overhead skip-guards`" in out.stdout


def _script(*args: object) -> subprocess.CompletedProcess[str]:
    """A benchmark script run from the repo root, its output captured (2400 s: a hang bound
    for two gloo ranks compiling a Llama on a loaded 2-core machine)."""
    argv = [sys.executable, *map(str, args)]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=2400)


def _bench_module(name: str):
    """``benchmarks/NAME.py`` loaded as the scripts load it (``benchmarks/`` on ``sys.path``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / f"benchmarks/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shared_result_writer_prints_the_table_and_writes_both_files(tmp_path, capsys):
    write = _bench_module("results").write
    write(tmp_path / "new" / "r", "| a |\n|---|", {"k": [1]}, indent=1, json_newline=True)
    assert (tmp_path / "new/r.md").read_text() == "| a |\n|---|\n"
    assert (tmp_path / "new/r.json").read_text() == '{\n "k": [\n  1\n ]\n}\n'
    write(None, "only printed", {})
    assert capsys.readouterr().out == "| a |\n|---|\nonly printed\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["new", "r.json", "r.md"]


def test_worlds_times_each_ranks_exit_and_kills_one_that_outlives_the_limit():
    import time

    worlds = _bench_module("worlds")

    class Rank:  # a process that exits at once, or never
        def __init__(self, hangs: bool) -> None:
            self.alive, self.killed = hangs, False

        def join(self, timeout: float) -> None:
            if self.alive:
                time.sleep(min(timeout, 0.05))

        def is_alive(self) -> bool:
            return self.alive

        def kill(self) -> None:
            self.alive, self.killed = False, True

    ranks = [Rank(hangs=False), Rank(hangs=True)]
    exits = worlds.exit_times(ranks, time.monotonic(), limit=0.05)
    assert exits[0] is not None and exits[0] < 1.0 and exits[1] is None
    assert ranks[1].killed and not ranks[0].killed
    port = worlds.free_port()
    assert 0 < port < 65536
