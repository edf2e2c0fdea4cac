"""Tests of passkit_testing.harness: run_passes and HarnessResult's assertions."""

from __future__ import annotations

import pydantic
import pytest
import torch

import passkit
from passkit_testing import HarnessResult, assert_op_count, count_ops, run_passes

aten = torch.ops.aten


class ScaleOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)
    factor: float = 1.0


class ScaleMuls(passkit.GraphPass):
    """Multiply the scalar of every ``mul.Tensor(x, <scalar>)`` by ``factor`` (1.0: exact)."""

    name = "scale_muls"
    Options = ScaleOptions

    def run(self, gm, ctx):
        n = 0
        for node in gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor):
            if isinstance(node.args[1], float):
                node.update_arg(1, node.args[1] * self.options.factor)
                n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


class Explode(passkit.GraphPass):
    name = "explode"

    def run(self, gm, ctx):
        raise RuntimeError("boom")


class NeedsCuda(passkit.GraphPass):
    name = "needs_cuda"
    requires = passkit.Requirements(cuda=True)


class CorruptMeta(passkit.GraphPass):
    """Records a wrong shape on a node: verification must catch it."""

    name = "corrupt_meta"

    def run(self, gm, ctx):
        node = next(iter(gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor)))
        node.meta["val"] = node.meta["val"].new_empty((7,))
        return passkit.PassResult(modified=True, matches=1)


class PrePass(passkit.GraphPass):
    name = "pre_pass"
    stage = passkit.Stage.PRE

    def run(self, gm, ctx):
        return passkit.PassResult.unchanged()


def reshaped_scale(x):
    return x.view(8).view(2, 4) * 3.0 + 1.0


X = torch.arange(8.0).reshape(2, 4)


@pytest.fixture(scope="module")
def result() -> HarnessResult:
    """One eager run shared by the read-only tests below."""
    return run_passes(reshaped_scale, X, passes=["noop_elimination", ScaleMuls()])


# -- what run_passes captures ----------------------------------------------------------------


def test_outputs_report_and_eager_outputs(result):
    torch.testing.assert_close(result.outputs, reshaped_scale(X))
    torch.testing.assert_close(result.eager_outputs, reshaped_scale(X))
    assert result.report.names() == ["noop_elimination", "scale_muls"]
    assert result.report.mode == "eager"
    assert result.report["noop_elimination"].status == "ran"
    assert result.reference_outputs is None


def test_graphs_before_and_after_each_pass(result):
    noop = result.graphs["noop_elimination"]
    assert count_ops(noop.before, aten.view) == 2
    assert count_ops(noop.after, aten.view) == 0
    assert "-    view = torch.ops.aten.view.default" in noop.diff()
    before_scale, after_scale = result.graphs["scale_muls"]
    assert before_scale.code == noop.after.code
    assert after_scale is not None


def test_whole_pipeline_graphs(result):
    assert count_ops(result.graph_before, aten.view) == 2
    assert count_ops(result.graph_after, aten.view) == 0
    assert result.graph_after.code == result.graphs["scale_muls"].after.code


def test_graphs_are_independent_copies():
    result = run_passes(reshaped_scale, X, passes=["noop_elimination"])
    gm = result.graphs["noop_elimination"].before
    for node in gm.graph.find_nodes(op="call_function", target=aten.add.Tensor):
        node.target = aten.sub.Tensor
    gm.recompile()
    assert_op_count(result.graph_before, aten.add.Tensor, 1)


def test_pipeline_uuid_is_the_real_one(result):
    # the harness verifies numerically by default: part of the identity, as in a compile
    real = passkit.Pipeline(
        passkit.Config(verify="numeric"), passkit.get_plugins(), list(result.pipeline.passes)
    )
    assert result.pipeline.uuid() == real.uuid()
    assert result.report.pipeline_uuid == real.uuid()[:12]


def test_passes_by_name_dict_instance_and_class():
    r = run_passes(
        reshaped_scale,
        X,
        passes=[{"name": "noop_elimination"}, ScaleMuls(factor=1.0), PrePass],
    )
    assert r.report.names() == ["pre_pass", "noop_elimination", "scale_muls"]  # stages apply
    assert "scale_muls" not in passkit.get_plugins().passes  # instances need no plugin


def test_options_given_with_a_name(passkit_isolated_plugins):
    passkit.register(_plugin_with(ScaleMuls))
    r = run_passes(reshaped_scale, X, passes=[{"name": "scale_muls", "factor": 2.0}], verify=True)
    assert r.pipeline.passes[0].options.factor == 2.0


def _plugin_with(*classes):
    class Plugin:
        @passkit.hookimpl
        def passkit_register_passes(self):
            return list(classes)

    return Plugin()


def test_caches_are_off_inside_unless_asked_for():
    seen = []

    class Probe(passkit.GraphPass):
        name = "probe"

        def run(self, gm, ctx):
            seen.append(
                (torch._inductor.config.fx_graph_cache, torch._functorch.config.enable_autograd_cache)
            )
            return passkit.PassResult.unchanged()

    configured = (torch._inductor.config.fx_graph_cache, torch._functorch.config.enable_autograd_cache)
    run_passes(reshaped_scale, X, passes=[Probe])
    assert seen == [(False, False)]
    run_passes(reshaped_scale, X, passes=[Probe], caches=True)
    assert seen[-1] == configured


def test_inductor_mode_runs_both_stages():
    r = run_passes(reshaped_scale, X, passes=[PrePass, ScaleMuls(factor=1.0)], mode="inductor")
    assert r.report.mode == "inductor"
    assert [rec.status for rec in r.report.records] == ["ran", "ran"]
    assert r.graph_before.code == r.graphs["pre_pass"].before.code
    assert r.graph_after.code == r.graphs["scale_muls"].after.code
    r.assert_close()


def test_module_with_bf16_reference():
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    r = run_passes(model, x, passes=["noop_elimination"], reference="fp32")
    assert r.reference_outputs.dtype == torch.float32
    r.assert_close("reference")
    r.assert_no_worse_than_eager()


def test_reference_function():
    r = run_passes(
        reshaped_scale, X, passes=["noop_elimination"], reference=lambda x: x.reshape(2, 4) * 3 + 1
    )
    r.assert_close("reference")


# -- bad calls ---------------------------------------------------------------------------------


def test_unknown_name_suggests_close_ones():
    with pytest.raises(passkit.ConfigError, match="did you mean 'noop_elimination'"):
        run_passes(reshaped_scale, X, passes=["noop_elimination_"])


@pytest.mark.parametrize(
    ("passes", "error", "message"),
    [
        ([], ValueError, "at least one pass"),
        ([ScaleMuls(), ScaleMuls], ValueError, r"\['scale_muls'\] given more than once"),
        ([42], TypeError, "a pass is a name"),
    ],
)
def test_bad_pass_lists(passes, error, message):
    with pytest.raises(error, match=message):
        run_passes(reshaped_scale, X, passes=passes)


def test_bad_reference():
    with pytest.raises(ValueError, match="reference must be 'fp32'"):
        run_passes(reshaped_scale, X, passes=[PrePass], reference="fp64")


# -- failing passes ----------------------------------------------------------------------------


def test_failing_pass_raises_passkit_error_unwrapped():
    with pytest.raises(passkit.PassFailedError, match="pass 'explode' failed: RuntimeError: boom") as info:
        run_passes(reshaped_scale, X, passes=[Explode])
    assert isinstance(info.value.__cause__, RuntimeError)


def test_verification_catches_bad_metadata():
    with pytest.raises(passkit.PassFailedError, match="metadata disagrees"):
        run_passes(reshaped_scale, X, passes=[CorruptMeta])
    run_passes(reshaped_scale, X, passes=[CorruptMeta], verify=False)


def test_failing_pass_with_on_error_skip():
    r = run_passes(reshaped_scale, X, passes=[Explode, PrePass], on_error="skip")
    assert r.report["explode"].status == "failed"
    assert r.graphs["explode"].after is None
    assert r.graphs["explode"].after_code is None
    with pytest.raises(
        AssertionError, match=r"pass 'explode' did not run \(status failed: RuntimeError: boom\)"
    ):
        r.assert_matches("explode", 0)


# -- each assertion helper fails when it should --------------------------------------------------


def test_assert_matches(result):
    result.assert_matches("noop_elimination", 2)
    with pytest.raises(
        AssertionError, match=r"reported 2 match\(es\), expected 1\ngraph before 'noop_elimination':\n"
    ):
        result.assert_matches("noop_elimination", 1)
    with pytest.raises(
        AssertionError, match=r"'cleanup' is not in the report \(passes: \['noop_elimination'"
    ):
        result.assert_matches("cleanup", 0)


def test_assert_matches_on_a_skipped_pass():
    r = run_passes(reshaped_scale, X, passes=[NeedsCuda])
    with pytest.raises(AssertionError, match=r"did not run \(status skipped: needs CUDA tensors"):
        r.assert_matches("needs_cuda", 0)


def test_assert_close_against_eager():
    r = run_passes(reshaped_scale, X, passes=[ScaleMuls(factor=1.5)], verify=True)
    with pytest.raises(AssertionError, match="compiled outputs vs eager:\ntensors are not close"):
        r.assert_close()
    r.assert_close(atol=20.0)


def test_assert_close_against_reference_uses_the_output_dtype():
    x = torch.linspace(1, 2, 8, dtype=torch.bfloat16).reshape(2, 4)
    r = run_passes(reshaped_scale, x, passes=[ScaleMuls(factor=1.1)], reference="fp32", verify=True)
    with pytest.raises(
        AssertionError, match=r"(?s)compiled outputs vs reference:.*torch.float32, rtol=0.016"
    ):
        r.assert_close("reference")
    with pytest.raises(ValueError, match="against must be"):
        r.assert_close("fp32")


def test_assert_no_worse_than_eager():
    x = torch.linspace(1, 2, 8, dtype=torch.bfloat16).reshape(2, 4)
    r = run_passes(reshaped_scale, x, passes=[ScaleMuls(factor=1.1)], reference="fp32", verify=True)
    with pytest.raises(AssertionError, match="candidate is less accurate than allowed"):
        r.assert_no_worse_than_eager()


def test_reference_assertions_need_a_reference(result):
    with pytest.raises(ValueError, match=r"needs a reference: call run_passes\(..., reference='fp32'\)"):
        result.assert_close("reference")
    with pytest.raises(ValueError, match="needs a reference"):
        result.assert_no_worse_than_eager()


def test_the_harness_runs_the_numeric_check_by_default():
    """A rewrite that changes values only (every shape and dtype kept) fails the pass, named,
    in the harness (``verify="numeric"`` by default); ``verify=True`` lets it through."""
    with pytest.raises(
        passkit.PassFailedError, match=r"pass 'scale_muls' failed: VerificationError: .*output 0 differs"
    ):
        run_passes(reshaped_scale, X, passes=[ScaleMuls(factor=1.5)])
    run_passes(reshaped_scale, X, passes=[ScaleMuls(factor=1.0)])  # exact: passes
