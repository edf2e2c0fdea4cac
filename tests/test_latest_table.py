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


PIP_FAILED = """Collecting flashinfer-python==0.7.3 (from vllm==0.34.0)
ERROR: Could not find a version that satisfies the requirement flashinfer-python==0.7.3 (from vllm) (from versions: 0.7.2, 0.7.4)
ERROR: No matching distribution found for flashinfer-python==0.7.3 (from vllm)
"""


def test_a_host_pin_the_registry_does_not_serve_is_named_and_moved(latest_table):
    """vLLM 0.34.0 pins flashinfer-python 0.7.3, which the registry here does not serve (it
    has 0.7.4): the session names the pin and installs the served release in its place."""
    assert latest_table.unserved_pin(PIP_FAILED) == "flashinfer-python==0.7.3"
    assert latest_table.unserved_pin("ERROR: ResolutionImpossible: conflicting pins") is None
    assert (
        latest_table.pinned_name("flashinfer_python==0.7.3; sys_platform == 'linux'") == "flashinfer_python"
    )
    requires = ["torch==2.11.0", "flashinfer_python==0.7.3; sys_platform == 'linux'", "numba==0.65.0"]
    assert latest_table.replace_pin(requires, "flashinfer-python==0.7.3", "flashinfer-python==0.7.4") == [
        "torch==2.11.0",
        "flashinfer-python==0.7.4; sys_platform == 'linux'",
        "numba==0.65.0",
    ]


def test_pip_check_may_complain_only_about_the_moved_pin(latest_table):
    moved = "flashinfer-python==0.7.3"
    said = "vllm 0.34.0 has requirement flashinfer-python==0.7.3, but you have flashinfer-python 0.7.4.\n"
    assert latest_table.other_complaints(said, moved) == []
    other = "vllm 0.34.0 has requirement numba==0.65.0, but you have numba 0.64.0.\n"
    assert latest_table.other_complaints(said + other, moved) == [other.strip()]
    assert latest_table.other_complaints(said, None) == [said.strip()]
    assert latest_table.other_complaints("No broken requirements found.\n", None) == []
