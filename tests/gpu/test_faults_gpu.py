"""The fault-injection scenarios of ``tests/fusion/test_faults.py`` that passkit itself
detects (plan check, rank never arriving, reported failure, an op raising before the
collective, mismatched token counts with ``check_calls``), in NCCL worlds of 2 and 4 GPUs.
Skipped without the GPUs. Set ``GPU_FAULT_WORLDS=2`` to run one size.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

WORLDS = [int(w) for w in os.environ.get("GPU_FAULT_WORLDS", "2 4").split()]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fusion"))
import test_faults as faults  # noqa: E402
from passkit_testing.worlds import run_in_nccl_world  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("world", WORLDS)
def test_passkit_detected_faults_in_an_nccl_world(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    results = run_in_nccl_world(faults._scenarios, world, args=(False,), timeout=240)
    for result in results:
        assert result.ok, result.describe()
    bundle = (world, results, 0.0)  # the faulty rank's own results are not checked
    for check in (
        faults.test_differing_plans_raise_on_every_rank,
        faults.test_a_missing_rank_is_named_after_the_timeout,
        faults.test_a_reported_failure_is_seen_at_once,
        faults.test_a_rank_raising_before_the_collective_is_named_by_the_others,
        faults.test_mismatched_token_counts_raise_with_check_calls,
    ):
        check(bundle)
