"""The fusion distribution's demos run as a user runs them (``passkit demo --only NAME``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_tp_passes_demo_specializes_by_token_range_and_matches_eager():
    out = subprocess.run(
        [sys.executable, "-m", "passkit.cli", "demo", "--only", "tp_passes"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    # 17..31 and the odd counts from 32 run no pass: one compile (async_tp acts only on
    # sequence_parallel's rewrite, so it does not split the odd counts off)
    assert "3 compiled specializations" in text
    for label in ("tokens 1..16", "tokens >= 17", "tokens >= 32, multiples of 2"):
        assert f"inductor, {label})" in text
    assert "64 tokens -> tokens >= 32, multiples of 2" in text
    assert "33 tokens -> tokens >= 17 " in text
    assert "4 tokens -> tokens 1..16" in text
    assert "numerics within 0.0001 of eager on every call and rank: True" in text
