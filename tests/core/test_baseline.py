"""The graph's baseline (snapshot, fingerprint, outputs) is kept across passes that change
nothing and retaken after a change, after a restore, or after a hook touched the graph."""

from __future__ import annotations

import pytest
import torch

import passkit
import passkit._pipeline.baseline
from passkit.graph_utils import graph_code

from .support import register_all, small_fn

aten = torch.ops.aten


def _nothing(name: str) -> type[passkit.GraphPass]:
    class Nothing(passkit.GraphPass):
        def run(self, gm, ctx):
            return passkit.PassResult.unchanged()

    Nothing.name = name
    return Nothing


class Nothings:
    @passkit.hookimpl
    def passkit_register_passes(self):
        return [_nothing(f"nothing_{i}") for i in range(1, 5)]


@pytest.fixture(autouse=True)
def _plugins(clean_env):
    register_all()
    passkit.register(Nothings(), name="baseline-test-passes")


@pytest.fixture
def snapshots(monkeypatch):
    """How many snapshots (copies of the graph) the pipeline takes."""
    taken: list[int] = []
    real = passkit._pipeline.baseline.snapshot

    def counted(graph):
        taken.append(len(graph.nodes))
        return real(graph)

    monkeypatch.setattr(passkit._pipeline.baseline, "snapshot", counted)
    return taken


def traced():
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        return make_fx(small_fn, tracing_mode="fake")(torch.randn(4, 8))


ORDER = ["nothing_1", "nothing_2", "mul_to_scale", "nothing_3", "halfway_then_fail", "nothing_4"]


def test_passes_that_change_nothing_share_one_snapshot(snapshots):
    gm = traced()
    before = graph_code(gm)
    report = passkit.build_pipeline(passes=ORDER).run(gm)
    assert [r.status for r in report.records] == ["ran", "ran", "ran", "ran", "failed", "ran"]
    # one before nothing_1 (kept through mul_to_scale), one after mul_to_scale's change
    # (kept through the failure and its restore)
    assert len(snapshots) == 2
    assert graph_code(gm) == before.replace("3.0", "2.0")  # the failure undone to mul_to_scale's graph


def test_a_graph_changed_by_a_hook_between_passes_is_the_one_restored(snapshots):
    """A hook that rewrites the graph before a pass: the pass that then fails is undone to the
    hook's graph, not to the baseline kept from before the hook."""

    class Retune:
        @passkit.hookimpl
        def passkit_before_pass(self, pass_, gm, context):
            if pass_.name == "halfway_then_fail":
                for node in gm.graph.find_nodes(op="call_function", target=aten.add.Tensor):
                    node.update_arg(1, 5.0)
                gm.recompile()

    passkit.register(Retune())
    gm = traced()
    before = graph_code(gm)
    report = passkit.build_pipeline(passes=["nothing_1", "halfway_then_fail", "nothing_2"]).run(gm)
    assert report["halfway_then_fail"].status == "failed"
    assert graph_code(gm) == before.replace("1.0", "5.0")
    assert len(snapshots) == 2  # the hook's change was measured: a new baseline


def test_passes_after_a_restore_measure_against_the_restored_graph():
    """After a failure is undone (new node objects), a pass that changes nothing is measured
    as unchanged, and one that changes the graph as changed."""
    gm = traced()
    report = passkit.build_pipeline(passes=["halfway_then_fail", "nothing_1", "mul_to_scale"]).run(gm)
    assert report["nothing_1"].status == "ran" and not report["nothing_1"].modified
    assert report["mul_to_scale"].modified and report["mul_to_scale"].matches == 1
