"""passkit's teardown order (:mod:`passkit.teardown`): the GPU idle, Inductor's CUDA graphs
destroyed, the resources passes registered freed (last first), and only then the process
group, whether the program calls ``dist.destroy_process_group()`` or just exits. Each case
is a fresh process (the guard wraps torch's function for the whole process)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from passkit_testing.programs import _free_port

import passkit.teardown as teardown

PROBE = Path(__file__).with_name("teardown_probe.py")
ORDER = ["GPU idle", "CUDA graphs", "symmetric memory", "workspaces"]


def probe(how: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, str(PROBE), how, str(_free_port())], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in done.stdout.splitlines() if line.startswith(("EVENTS", "AGAIN"))]


def test_destroy_process_group_runs_passkit_teardown_first():
    events, again = probe("destroy")
    assert events == f"EVENTS {[*ORDER, 'process group']}"
    # the frees ran once; a second world's destroy has nothing of passkit's left to free
    assert again == f"AGAIN {[*ORDER, 'process group', 'GPU idle', 'CUDA graphs', 'process group']}"


def test_interpreter_exit_runs_passkit_teardown():
    (events,) = probe("exit")
    assert events == f"EVENTS {ORDER}"


def test_a_failing_free_is_logged_and_the_rest_still_run(caplog, monkeypatch):
    monkeypatch.setattr(teardown, "_frees", {})
    monkeypatch.setattr(teardown, "_guarded", True)  # no wrapping of this process's torch
    ran = []

    def broken():
        raise RuntimeError("driver says no")

    teardown.on_teardown(lambda: ran.append("first"), "first")
    teardown.on_teardown(broken, "the broken thing")
    teardown.on_teardown(lambda: ran.append("last"), "last")
    with caplog.at_level("WARNING", logger="passkit"):
        teardown.teardown("the test")
    assert ran == ["last", "first"]
    assert "freeing the broken thing before the test failed: driver says no" in caplog.text


def test_graphs_are_left_alone_when_the_gpu_never_goes_idle(caplog, monkeypatch):
    monkeypatch.setattr(teardown, "recorded_cuda_graphs", lambda: 3)
    monkeypatch.setattr(teardown, "_gpu_idle", lambda timeout_s: False)
    import torch._inductor.cudagraph_trees as trees

    monkeypatch.setattr(
        trees, "reset_cudagraph_trees", lambda: pytest.fail("graphs destroyed under a running GPU")
    )
    with caplog.at_level("WARNING", logger="passkit"):
        assert teardown.release_cuda_graphs(timeout_s=0.01) == 0
    assert "the 3 CUDA graph(s) Inductor recorded are left alive" in caplog.text


def test_no_graphs_recorded_on_the_cpu():
    assert teardown.recorded_cuda_graphs() == 0
    assert teardown.release_cuda_graphs() == 0


def test_resources_are_created_on_another_thread_with_errors_raised_in_the_caller():
    from passkit_fusion.collective.resources import outside_graph_pools

    caller = threading.get_ident()
    assert outside_graph_pools(lambda: threading.get_ident(), "a probe") != caller
    assert outside_graph_pools(lambda: torch.ones(2), "a tensor").tolist() == [1.0, 1.0]

    def fail():
        raise ValueError("no room")

    with pytest.raises(ValueError, match="no room"):
        outside_graph_pools(fail, "a failing probe")
