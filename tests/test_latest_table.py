"""``.ci/latest_table.py``, ``nox -s latest``'s bookkeeping: the newest release read from
``pip index versions``, torch's CPU build preferred where the indexes serve it, and one
table from every stack's recorded rows (a stack not run named with its command)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

INDEX = """torch (2.15.0)
Available versions: 2.15.0, 2.14.1, 2.13.0+cpu, 2.13.0
  INSTALLED: 2.13.0+cpu
  LATEST:    2.15.0
"""


@pytest.fixture(scope="module")
def latest_table():
    spec = importlib.util.spec_from_file_location("latest_table", ROOT / ".ci/latest_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_the_newest_release_and_its_cpu_build(latest_table):
    assert latest_table.newest(INDEX) == "2.15.0"
    assert latest_table.newest_cpu_build(INDEX, "2.15.0") is None  # only a CUDA build served
    assert latest_table.newest_cpu_build(INDEX, "2.13.0") == "2.13.0+cpu"
    assert latest_table.newest("ERROR: No matching distribution found for nothing") is None


def test_one_table_from_every_stack(latest_table, tmp_path: Path):
    row = {"package": "torch", "tested": "2.15.0", "newest": "2.15.0", "result": "dialect suite passed"}
    latest_table.write_rows(tmp_path, "torch", [row])
    text = latest_table.table(latest_table.read_rows(tmp_path, ["torch", "vllm"]))
    lines = text.splitlines()
    assert lines[0] == "| package | version tested | version newest | result |"
    assert lines[2] == "| torch | 2.15.0 | 2.15.0 | dialect suite passed |"
    assert lines[3].startswith("| vllm | - | - | not run (nox -s \"latest(stack='vllm')\")")
