"""passkit's own overhead, measured side by side in one run (CPU is enough).

(a) import passkit + plugin discovery + config resolution, beyond importing torch itself;
(b) the pipeline's ``uuid()`` (what Inductor's cache calls on every compile);
(c) compile time of a 32-layer decoder-like graph: Inductor alone vs Inductor + passkit
    with the built-in passes, each compile in a fresh process with caches off.

Writes ``benchmarks/results/core_overhead.{json,md}``. Usage:
    python benchmarks/core_overhead.py [--layers 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
BUILTINS = ["noop_elimination", "cleanup", "reinplace"]

IMPORT_PROBE = """
import time, json
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import pydantic
class _Warm(pydantic.BaseModel):
    x: int = 0
t2 = time.perf_counter()
import passkit
t3 = time.perf_counter()
cfg = passkit.load_config(passes={passes!r})
pipeline = passkit.build_pipeline(cfg)
t4 = time.perf_counter()
print(json.dumps({{"torch_s": t1 - t0, "pydantic_s": t2 - t1, "import_s": t3 - t2, "discovery_s": t4 - t3}}))
"""

COMPILE_PROBE = """
import json, sys, time
import torch
sys.path.insert(0, {here!r})
from decoder import decoder_stack
import passkit
layers, use_passkit = {layers}, {use_passkit}
torch.manual_seed(0)
model, x = decoder_stack(layers)
backend = passkit.backend(passes={passes!r}) if use_passkit else "inductor"
t0 = time.perf_counter()
with torch.no_grad():
    torch.compile(model, backend=backend)(x)
elapsed = time.perf_counter() - t0
pass_ms = sum(r.total_ms for r in backend.reports) if use_passkit else 0.0
nodes = max((rec.nodes_before for r in backend.reports for rec in r.records), default=0) if use_passkit else 0
print(json.dumps({{"compile_s": elapsed, "pass_ms": pass_ms, "graph_nodes": nodes}}))
"""


PROBE_TIMEOUT_S = 900


def run_probe(code: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PASSKIT_")}
    env.update(TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0", OMP_NUM_THREADS="1")
    try:  # one probe compiles a small model: minutes at most on a loaded machine
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            check=False,
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise SystemExit(f"probe still running after {PROBE_TIMEOUT_S} s: killed") from None
    if out.returncode != 0:
        raise SystemExit(f"probe failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_import(repeats: int) -> dict:
    runs = [run_probe(IMPORT_PROBE.format(passes=BUILTINS)) for _ in range(repeats)]
    med = {k: statistics.median(r[k] for r in runs) * 1e3 for k in runs[0]}
    return {
        "torch_import_ms": med["torch_s"],
        "pydantic_import_ms": med["pydantic_s"],
        "passkit_import_ms": med["import_s"],
        "discovery_config_ms": med["discovery_s"],
        "passkit_import_discovery_config_ms": med["pydantic_s"] + med["import_s"] + med["discovery_s"],
        "plugins": sorted(__import__("passkit").get_plugins().passes),
    }


def bench_uuid() -> dict:
    import passkit

    t0 = time.perf_counter()
    pipeline = passkit.build_pipeline(passes=BUILTINS)
    build_ms = (time.perf_counter() - t0) * 1e3
    stage = pipeline.custom_pass(passkit.Stage.POST)
    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        stage.uuid()
    per_call_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    pipeline._compute_uuid()
    first_ms = (time.perf_counter() - t0) * 1e3
    return {"uuid_call_us": per_call_us, "uuid_first_compute_ms": first_ms, "pipeline_build_ms": build_ms}


def bench_compile(layers: int, repeats: int) -> dict:
    base, with_pk, pass_ms, nodes = [], [], [], 0
    for _ in range(repeats):  # alternate so drift hits both sides equally
        base.append(
            run_probe(
                COMPILE_PROBE.format(here=str(HERE), layers=layers, use_passkit=False, passes=BUILTINS)
            )["compile_s"]
        )
        r = run_probe(COMPILE_PROBE.format(here=str(HERE), layers=layers, use_passkit=True, passes=BUILTINS))
        with_pk.append(r["compile_s"])
        pass_ms.append(r["pass_ms"])
        nodes = r["graph_nodes"]
    b, p = statistics.median(base), statistics.median(with_pk)
    return {
        "layers": layers,
        "graph_nodes": nodes,
        "inductor_s": b,
        "inductor_plus_passkit_s": p,
        "added_pct": (p - b) / b * 100,
        "passkit_pass_ms": statistics.median(pass_ms),
        "pass_time_pct_of_inductor": statistics.median(pass_ms) / 1e3 / b * 100,
        "inductor_runs_s": base,
        "passkit_runs_s": with_pk,
    }


def machine() -> str:
    import torch

    return (
        f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}, torch {torch.__version__}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    res = {"machine": machine(), "date": time.strftime("%Y-%m-%d")}
    res["import"] = bench_import(args.repeats * 2)
    res["uuid"] = bench_uuid()
    res["compile"] = bench_compile(args.layers, args.repeats)
    i, u, c = res["import"], res["uuid"], res["compile"]
    rows = [
        (
            "(a) import passkit + discovery + config (beyond torch)",
            f"{i['passkit_import_discovery_config_ms']:.1f} ms",
            "<= 50 ms",
        ),
        ("    of which: import pydantic (a core dependency)", f"{i['pydantic_import_ms']:.1f} ms", ""),
        ("    of which: import passkit", f"{i['passkit_import_ms']:.1f} ms", ""),
        (
            f"    of which: discovery ({len(i['plugins'])} passes) + config",
            f"{i['discovery_config_ms']:.1f} ms",
            "",
        ),
        ("    (import torch itself)", f"{i['torch_import_ms']:.0f} ms", ""),
        ("(b) pipeline uuid() per call", f"{u['uuid_call_us']:.2f} us", "<= 1 ms"),
        ("    uuid first computation (once per pipeline)", f"{u['uuid_first_compute_ms']:.3f} ms", ""),
        (
            f"(c) compile, {c['layers']} layers ({c['graph_nodes']} nodes): Inductor alone",
            f"{c['inductor_s']:.2f} s",
            "",
        ),
        ("    Inductor + passkit built-ins", f"{c['inductor_plus_passkit_s']:.2f} s", ""),
        ("    difference (wall clock, median)", f"{c['added_pct']:+.2f} %", "<= 3 %"),
        (
            "    time inside passkit's passes",
            f"{c['passkit_pass_ms']:.1f} ms = {c['pass_time_pct_of_inductor']:.2f} %",
            "<= 3 %",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"passkit core overhead — {res['machine']} — {res['date']}", ""]
    lines += ["| measure | result | target |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {t} |" for a, b, t in rows]
    md = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "core_overhead.json").write_text(json.dumps(res, indent=2))
    (RESULTS / "core_overhead.md").write_text(md)
    for a, b, t in rows:
        print(f"{a:<{width}}  {b:>22}  {t}")


if __name__ == "__main__":
    main()
