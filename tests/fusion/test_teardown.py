"""Teardown cannot hang: every exit order of a process that used passkit-fusion ends
within seconds of its last line (CPU: gloo, fake flashinfer, pretend GPU).

Runs ``benchmarks/teardown.py``'s scenarios, the same code that measures the exit times on
the GPU machine (see its docstring for the orders). ``peer_died`` makes the GPU never go
idle (``torch.cuda.synchronize`` blocks forever, as with a fused kernel whose peer died):
the workspace is then left allocated after ``teardown_timeout_s`` and the process still
exits.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from pathlib import Path

import pytest
import torch
from passkit_fusion.allreduce_rmsnorm import runtime, workspaces
from passkit_fusion.collective import resources

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("teardown_bench", ROOT / "benchmarks" / "teardown.py")
assert _spec is not None and _spec.loader is not None
teardown = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(teardown)

HANG_LIMIT_S = 300.0
"""A rank still running this long after its start hung: it is killed and reported. A hang
timeout, not a stopwatch: how long a healthy exit takes depends on the machine's load (a
loaded 2-core machine takes over 7 s to exit a gloo world), so the test asserts only that
every rank exits on its own, and (for ``peer_died``) that it took the bounded path."""


@pytest.mark.parametrize(
    ("world", "scenario"),
    [(2, s) for s in teardown.SCENARIOS] + [(4, s) for s in ("explicit", "atexit", "peer_died")],
)
def test_every_teardown_order_exits_promptly(world, scenario):
    result = teardown.run_scenario(scenario, world, limit=HANG_LIMIT_S, cpu=True)
    for rank in result["ranks"]:
        killed_on_purpose = scenario in ("rank_failed", "peer_died", "peer_died_exit") and rank["rank"] == 1
        assert not rank["hung"], rank["output_tail"]
        assert rank["exit_code"] == (3 if killed_on_purpose else 0), rank["output_tail"]
        if not killed_on_purpose:
            assert rank["reached_last_line"], rank["output_tail"]
    if scenario.startswith("peer_died"):
        assert "did not finish within 3 s; skipped" in result["ranks"][0]["output_tail"]


def test_destroy_workspaces_is_bounded_when_the_gpu_never_goes_idle(monkeypatch, caplog):
    """In process: a workspace whose kernel never finishes is left allocated, not freed
    under it, and destroy_workspaces() returns after teardown_timeout_s."""
    destroyed = []

    class Api:
        name = "stub"

        def destroy(self, handle):
            destroyed.append(handle)

    site = runtime._Site(None, "g", 0, 2, 64, torch.bfloat16)  # type: ignore[arg-type]
    site.workspace = workspaces.Workspace(Api(), "handle", 16)
    stuck = threading.Event()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: stuck.wait())
    monkeypatch.setitem(runtime._sites, ("g", 64, torch.bfloat16), site)
    runtime.configure(teardown_timeout_s=0.5)
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="passkit_fusion"):
            runtime.destroy_workspaces()
        # the 0.5 s bound, not the stuck synchronize (which never returns): a hang limit
        assert time.monotonic() - start < 60
        assert destroyed == []
        assert resources.leaked[-1].handle == "handle"
        assert "waiting for the GPU before freeing the workspace of group 'g', hidden 64 did not " in (
            caplog.text
        )
        assert "did not finish within 0.5 s; skipped" in caplog.text
        stuck.set()  # the "kernel" finishes: a later destroy frees nothing twice
        runtime.destroy_workspaces()
        assert destroyed == []
    finally:
        stuck.set()
        resources.leaked.clear()
        runtime.configure(teardown_timeout_s=10.0)
