"""The serving path in the users' order, on GPUs: each case a fresh program.

Each case runs ``users_order_case.py`` as every rank of an NCCL world (fresh interpreters,
as ``torchrun`` starts them): pass set (each fusion pass, the serving config) x mode (none,
``reduce-overhead``) x the token count of the first call (1, 16, 4096). The first call is
the process's first passkit compile in that mode; then the other counts; every output is
checked against the eager model; every pass in the set must have rewritten something; the
program ends with ``dist.destroy_process_group()`` and its normal exit, which must come
within :data:`EXIT_WITHIN_S` (a hang is killed at the case's timeout and fails it).

``GPU_WORLD_SIZE`` sets the world (default 2); with more GPUs than a world needs, cases run
by pytest-xdist workers use disjoint GPUs where they can (``-n``). Skipped without the GPUs
and flashinfer.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

WORLD = int(os.environ.get("GPU_WORLD_SIZE", "2"))
if torch.cuda.device_count() < WORLD or importlib.util.find_spec("flashinfer") is None:
    pytest.skip(f"needs {WORLD} CUDA GPUs and flashinfer", allow_module_level=True)

from users_order import COLD, check_case  # noqa: E402

from passkit_testing import run_world_program  # noqa: E402

pytestmark = pytest.mark.gpu
CASE = Path(__file__).with_name("users_order_case.py")
TIMEOUT_S = float(os.environ.get("USERS_ORDER_TIMEOUT_S", "420"))


def _gpus_for_this_worker() -> str:
    """The GPUs this xdist worker's world uses: disjoint blocks of WORLD where there are enough."""
    count = torch.cuda.device_count()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker.startswith("gw") else 0
    blocks = max(1, count // WORLD)
    first = (index % blocks) * WORLD
    return ",".join(str(first + i) for i in range(WORLD))


@pytest.mark.parametrize("first", [1, 16, 4096])
@pytest.mark.parametrize("mode", ["none", "reduce-overhead"])
@pytest.mark.parametrize("passes", ["allreduce_rmsnorm", "sequence_parallel", "async_tp", "serving"])
def test_first_call_and_exit_in_a_fresh_program(passes, mode, first):
    run = run_world_program(
        [str(CASE), "--passes", passes, "--mode", mode, "--first", str(first)],
        WORLD,
        timeout=TIMEOUT_S,
        env={"CUDA_VISIBLE_DEVICES": _gpus_for_this_worker(), **COLD},
        exit_within=("DESTROY-START", 60),  # a hung teardown fails in a minute, not at the timeout
    )
    results = check_case(run, passes, mode, gpu=True)
    exits = run.seconds_after("DESTROY-START")
    line = {
        "passes": passes,
        "mode": mode,
        "first": first,
        "world": WORLD,
        "exit_after_destroy_s": exits,
        "cuda_graphs": [r["cuda_graphs"] for r in results],
        "rel_diff": results[0]["rel_diff"],
        "calls_s": results[0]["calls_s"],
        "device": results[0]["device"],
        "torch": results[0]["torch"],
    }
    if os.environ.get("USERS_ORDER_LOG"):  # the gate's record (xdist workers' prints are not shown)
        with open(os.environ["USERS_ORDER_LOG"], "a") as log:
            log.write(json.dumps(line) + "\n")
