"""Issue 48: an unexpected error at one site declines that site with the error as its
reason; the other sites still fuse. The pass fails only when the error leaves the graph
changed (passkit then restores it).

The errors are injected into the matcher and the rewrite of the second of vLLM IR's three
sites (fake world; :func:`test_dialects.vllm_block`)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from passkit_fusion.allreduce_rmsnorm import pass_ as rms_pass
from passkit_fusion.patterns import sites as sites_mod
from test_dialects import FUSED, REFERENCE, inputs, vllm_block

from passkit_testing import fake_world, op_counts, run_passes

ALL_REDUCE = "vllm.all_reduce.default"


def _fail_on_call(monkeypatch, owner, name: str, nth: int, exc: Exception, after: bool = False) -> list[int]:
    """Make ``owner.name`` raise ``exc`` on its ``nth`` call (1-based), before or after
    running the original."""
    original = getattr(owner, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth and not after:
            raise exc
        out = original(*args, **kwargs)
        if calls[0] == nth and after:
            raise exc
        return out

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def _notes(result) -> str:
    return " | ".join(result.report["allreduce_rmsnorm"].notes)


def test_a_matcher_error_rejects_its_site_only(monkeypatch) -> None:
    _fail_on_call(
        monkeypatch, sites_mod, "_match_site", 2, AttributeError("'NoneType' object has no attribute 'x'")
    )
    with fake_world(2) as world, pytest.warns(RuntimeWarning, match="internal error matching this site"):
        result = run_passes(vllm_block(world.group_name), *inputs(), passes=[REFERENCE])
    result.assert_matches("allreduce_rmsnorm", 2)
    after = op_counts(result.graph_after)
    assert after[FUSED] == 2 and after[ALL_REDUCE] == 1
    notes = _notes(result)
    assert (
        "internal error matching this site (AttributeError: 'NoneType' object has no attribute 'x'" in notes
    )
    assert "at sites.py:" in notes  # where it was raised (the innermost passkit_fusion frame)


def test_a_rewrite_error_before_any_change_declines_its_site_only(monkeypatch) -> None:
    """The error after the fused op was inserted (its fake call) but before any use was
    redirected: the inserted nodes are removed, the site stays as it was."""
    _fail_on_call(monkeypatch, rms_pass, "_fake_call", 2, ValueError("no fake value"))
    with fake_world(2) as world, pytest.warns(RuntimeWarning, match="internal error rewriting this site"):
        result = run_passes(vllm_block(world.group_name), *inputs(), passes=[REFERENCE])
    result.assert_matches("allreduce_rmsnorm", 2)
    after = op_counts(result.graph_after)
    assert after[FUSED] == 2 and after[ALL_REDUCE] == 1
    assert after["vllm_ir.fused_add_rms_norm.default"] == 1  # the declined site, intact
    assert "internal error rewriting this site (ValueError: no fake value" in _notes(result)
    # nothing of the failed rewrite is left: every getitem reads a fused op or a host norm
    for node in result.graph_after.graph.nodes:
        assert node.users or node.op == "output", node.format_node()


def test_a_rewrite_error_after_the_graph_changed_fails_the_pass(monkeypatch) -> None:
    """Once the rewrite redirected uses, the graph cannot be trusted: the pass fails and
    passkit restores the graph (every site unfused), the error as the reason."""
    _fail_on_call(monkeypatch, fx.Node, "replace_all_uses_with", 3, RuntimeError("half done"), after=True)
    with fake_world(2) as world:
        result = run_passes(vllm_block(world.group_name), *inputs(), passes=[REFERENCE], on_error="skip")
    record = result.report["allreduce_rmsnorm"]
    assert record.status == "failed"
    assert "failed after it changed the graph (RuntimeError: half done)" in record.reason
    after = op_counts(result.graph_after)
    assert after.get(FUSED, 0) == 0 and after[ALL_REDUCE] == 3


def test_the_matcher_raises_nothing_on_the_unused_residual() -> None:
    """The issue's own site, without isolation: vLLM IR's final fused_add_rms_norm whose
    residual output is unused is a site (no error, no rejection)."""
    from test_dialects import vllm_final_norm

    with fake_world(2) as world:
        result = run_passes(vllm_final_norm(world.group_name), *inputs(), passes=["cleanup"])
        found, rejected = sites_mod.find_sites(result.graph_after.graph)
    assert not rejected
    assert [s.total is None for s in found] == [False, True]
    assert isinstance(found[1].out, torch.fx.Node)
