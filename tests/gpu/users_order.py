"""What every users'-order case must show (``users_order_case.py``), on GPUs and on the CPU."""

from __future__ import annotations

from typing import Any

from users_order_case import PASS_SETS

from passkit_testing import ProgramRun

COLD = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
"""Each case compiles cold, as a first run does (cases share the graphs, and a cache hit
runs no pass)."""
EXIT_WITHIN_S = 10.0
"""On GPUs, from ``DESTROY-START`` (just before ``dist.destroy_process_group()``) to the
process's exit. Not checked on the CPU, where a loaded 2-core machine takes seconds to leave
any interpreter that ran Inductor (its worker pool); there a hang fails the case at its
timeout."""
TOLERANCE = {True: 3e-2, False: 1e-4}
"""Largest ``max |out - eager| / max |eager|``: bf16 on GPUs (the fused kernel sums in
another order), fp32 on the CPU."""


def check_case(run: ProgramRun, passes: str, mode: str, *, gpu: bool) -> list[dict[str, Any]]:
    """Assert the case ran right on every rank and ended in time; return each rank's result."""
    assert run.ok, run.describe()
    results = run.json_lines("CASE-RESULT")
    for r in results:
        worst = max(r["rel_diff"].values())
        assert worst < TOLERANCE[gpu], (f"rank {r['rank']}: output differs from eager", r["rel_diff"])
        for name in PASS_SETS[passes]:
            rewrote = [
                rep["range"]
                for rep in r["reports"]
                if name in rep["passes"] and rep["passes"][name][0] == "ran" and rep["passes"][name][1] > 0
            ]
            assert rewrote, f"rank {r['rank']}: {name} rewrote nothing in any compile: {r['reports']}"
        if gpu and mode != "none":
            assert r["cuda_graphs"], f"rank {r['rank']}: no CUDA graph recorded ({r['cuda_graphs']!r})"
    run.json_lines("DESTROYED")  # every rank came back from destroy_process_group()
    exits = run.seconds_after("DESTROY-START")
    assert all(e is not None and (not gpu or e <= EXIT_WITHIN_S) for e in exits), (exits, run.describe())
    return results
