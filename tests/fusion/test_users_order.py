"""The users'-order program of ``tests/gpu/test_users_order_gpu.py`` on the CPU: fresh
processes of a gloo world, the first call the process's first passkit compile, every output
against eager, every pass rewriting something, and the program's own end
(``dist.destroy_process_group()`` through passkit's teardown, then the interpreter's exit).
Inductor records no CUDA graphs on the CPU; the GPU suite runs the pools and NCCL."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

GPU_TESTS = Path(__file__).resolve().parents[1] / "gpu"
sys.path.insert(0, str(GPU_TESTS))
from users_order import COLD, check_case  # noqa: E402

from passkit_testing import run_world_program  # noqa: E402

TIMEOUT_S = 600.0  # a hang bound, not a speed check: a loaded 2-core machine compiles slowly


def run_case(passes: str, mode: str, first: int, tokens: tuple[int, ...] = (1, 16, 4096)):
    run = run_world_program(
        [
            str(GPU_TESTS / "users_order_case.py"),
            "--cpu",
            *("--passes", passes, "--mode", mode, "--first", str(first)),
            *("--tokens", *map(str, tokens)),
            *("--hang-dump-s", str(TIMEOUT_S - 30)),
        ],
        2,
        timeout=TIMEOUT_S,
        env={"OMP_NUM_THREADS": "1", **COLD},
        exit_within=("DESTROY-START", 180),
    )
    return check_case(run, passes, mode, gpu=False)


def test_fused_all_reduce_first_call_in_reduce_overhead_mode_and_clean_exit():
    run_case("allreduce_rmsnorm", "reduce-overhead", 1, tokens=(1, 16))


@pytest.mark.slow
def test_serving_config_first_call_in_reduce_overhead_mode_and_clean_exit():
    results = run_case("serving", "reduce-overhead", 16)
    ranges = {rep["range"] for rep in results[0]["reports"]}
    assert len(ranges) >= 2, ranges  # several token ranges compiled, each at its first call


@pytest.mark.slow
@pytest.mark.parametrize("first", [1, 4096])
def test_async_tp_first_call_and_clean_exit(first):
    run_case("async_tp", "reduce-overhead", first)
