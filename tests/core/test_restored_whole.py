"""A failed pass leaves the model's outputs bit for bit as without it: the graph module is
restored whole (its tensor constants' values, its attributes, buffers and submodules), not
only its nodes, and ``verify = "numeric"`` runs the graph before a pass on values the pass
could not touch.

Before, only the nodes were snapshotted: a pass that wrote into a tensor constant, or rebound
one, and then raised was reported "failed (graph restored)" while the compiled model's output
was off by what it wrote (396 in the fault battery), and numeric verify, running the graph
before the pass on the module as the pass left it, could not see a value-only change.
"""

from __future__ import annotations

import pytest
import torch

import passkit
import passkit._pipeline.module_state as module_state

X = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        # a tensor built in forward: AOTAutograd lifts it into the graph module as a constant
        return self.lin(x) + torch.tensor([1.0, 2.0, 3.0, 4.0])


def _constants(gm):
    return [
        n.target
        for n in gm.graph.find_nodes(op="get_attr")
        if isinstance(getattr(gm, n.target), torch.Tensor)
    ]


def _real():
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


class WritesInPlaceThenRaises(passkit.GraphPass):
    name = "writes_in_place_then_raises"

    def run(self, gm, ctx):
        assert _constants(gm), "the test graph holds a tensor constant"
        with _real(), torch.no_grad():
            for target in _constants(gm):
                getattr(gm, target).add_(396)
        raise RuntimeError("gave up after writing into the constants")


class RebindsThenRaises(passkit.GraphPass):
    """Rebinds each constant, adds a buffer, an attribute and a submodule, then raises."""

    name = "rebinds_then_raises"

    def run(self, gm, ctx):
        with _real(), torch.no_grad():
            for target in _constants(gm):
                setattr(gm, target, getattr(gm, target) + 396)
            gm.register_buffer("_passkit_test_extra", torch.zeros(2))
            gm.add_module("_passkit_test_sub", torch.nn.Linear(2, 2))
            gm.passkit_test_flag = True
        raise RuntimeError("gave up after rebinding the constants")


class WritesInPlace(passkit.GraphPass):
    """Changes a constant's values only (no node changes) and says nothing changed."""

    name = "writes_in_place"

    def run(self, gm, ctx):
        with _real(), torch.no_grad():
            for target in _constants(gm):
                getattr(gm, target).mul_(-1)
        return passkit.PassResult.unchanged()


class Rebinds(passkit.GraphPass):
    name = "rebinds"

    def run(self, gm, ctx):
        with _real(), torch.no_grad():
            for target in _constants(gm):
                setattr(gm, target, getattr(gm, target) * -1)
        return passkit.PassResult.unchanged()


class Plugin:
    @passkit.hookimpl
    def passkit_register_passes(self):
        return [WritesInPlaceThenRaises, RebindsThenRaises, WritesInPlace, Rebinds]


@pytest.fixture(autouse=True)
def _plugin(clean_env):
    passkit.register(Plugin(), name="restore-test-passes")


def compiled(*passes, **config):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Model().eval()
    backend = passkit.backend(passes=["cleanup", *passes], compiler="aot_eager", **config)
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(X)
    return out, backend.last_report


@pytest.mark.parametrize("name", ["writes_in_place_then_raises", "rebinds_then_raises"])
def test_a_failed_pass_leaves_the_outputs_bit_for_bit_as_without_it(name):
    without, _ = compiled()
    out, report = compiled(name)
    assert report[name].status == "failed" and "gave up after" in report[name].reason
    assert torch.equal(out, without), (out - without).abs().max()


def test_what_a_failed_pass_added_to_the_module_is_gone():
    got = {}

    class Look(passkit.GraphPass):
        name = "look"

        def run(self, gm, ctx):
            got["buffers"] = [k for k, _ in gm.named_buffers()]
            got["modules"] = [k for k, _ in gm.named_modules()]
            got["flag"] = hasattr(gm, "passkit_test_flag")
            return passkit.PassResult.unchanged()

    class More:
        @passkit.hookimpl
        def passkit_register_passes(self):
            return [Look]

    passkit.register(More(), name="look-plugin")
    _, report = compiled("rebinds_then_raises", "look")
    assert report["look"].status == "ran"
    assert "_passkit_test_extra" not in got["buffers"] and got["buffers"]  # the constant is back
    assert got["modules"] == [""] and got["flag"] is False


@pytest.mark.parametrize("name", ["writes_in_place", "rebinds"])
def test_numeric_verify_sees_a_pass_that_changes_only_the_module(name):
    without, _ = compiled()
    out, report = compiled(name, verify="numeric")
    record = report[name]
    assert record.status == "failed", record
    assert record.reason.startswith(f"VerificationError: after pass {name!r}: output 0 differs"), (
        record.reason
    )
    assert torch.equal(out, without)


@pytest.mark.parametrize("name", ["writes_in_place", "rebinds"])
def test_a_pass_that_changes_only_the_module_is_recorded_modified(name):
    _, report = compiled(name)
    record = report[name]
    assert record.status == "ran" and record.modified
    assert any(n.startswith("changed the graph module, not its nodes: ") for n in record.notes), record.notes


def test_a_tensor_too_large_to_copy_written_in_place_stops_the_compile(monkeypatch):
    """No copy kept (over the size limit): the failure cannot be undone, so the compile stops
    with the tensor named, even with on_error = "skip" (never a model computing the pass's
    values under a report saying it was restored)."""
    monkeypatch.setattr(module_state, "COPY_TENSOR_BYTES", 0)
    with pytest.raises(Exception) as raised:  # Dynamo wraps what the backend raises
        compiled("writes_in_place_then_raises")
    error = getattr(raised.value, "inner_exception", raised.value)
    assert isinstance(error, passkit.PassFailedError), repr(raised.value)
    message = str(error)
    assert "NOT restored: it wrote in place into _tensor_constant0 (0.0 MiB)" in message, message
    assert "could not be restored, so the compile stops" in message


def test_copies_are_taken_once_while_the_tensors_do_not_change():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    first = module_state.ModuleState.take(gm)
    again = module_state.ModuleState.take(gm, first)
    assert [e.copy for e in again.tensors.values()] == [e.copy for e in first.tensors.values()]
    assert all(
        a is b
        for a, b in zip((e.copy for e in again.tensors.values()), (e.copy for e in first.tensors.values()))
    )
    with torch.no_grad():
        gm.weight.add_(1)
    assert again.changed(gm) == ["tensor 'weight' (written in place)"]
    third = module_state.ModuleState.take(gm, again)
    assert third.tensors[id(gm.weight)].copy is not again.tensors[id(gm.weight)].copy
    again.restore()
    assert torch.equal(gm.weight, first.tensors[id(gm.weight)].copy)
