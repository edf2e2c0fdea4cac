"""docs/writing-a-pass.md's answers to three dead ends a pass author met, as the guide
tells them: which ops reach each stage (``stage_graphs``), a rewrite that is close but not
exact (``verify=True`` and the author's tolerance), a pass that only reads the graph
(``analysis_only = True`` in the conformance suite)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import passkit
from passkit_testing import PassChecker, count_ops, print_stage_graphs, stage_graphs

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs/writing-a-pass.md").read_text()
aten = torch.ops.aten


def gelu_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())


# -- which ops reach each stage ---------------------------------------------------------


def test_stage_graphs_show_gelu_decomposed_before_post_grad(capsys):
    assert "print_stage_graphs(model, torch.randn(4, 8))" in GUIDE
    model = gelu_model()
    graphs = stage_graphs(model, torch.randn(4, 8))
    assert list(graphs) == ["pre_grad", "post_grad_pre", "post_grad_post"]
    # as the model wrote it at pre-grad; decomposed by the post-grad stages
    pre_grad = [n.target for n in graphs["pre_grad"].graph.nodes if n.op == "call_function"]
    assert any("gelu" in str(t) for t in pre_grad)
    for stage in ("post_grad_pre", "post_grad_post"):
        assert count_ops(graphs[stage], aten.gelu) == 0
        assert count_ops(graphs[stage], aten.erf) == 1
    print_stage_graphs(model, torch.randn(4, 8), mode="eager")
    out = capsys.readouterr().out
    assert "# --- stage pre_grad ---" in out and "# --- stage post_grad_post ---" in out
    assert "torch.ops.aten.erf.default" in out


# -- a rewrite that is close, not exact -------------------------------------------------


class GeluTanh(passkit.GraphPass):
    """GELU's tanh approximation for its exact form, at pre-grad (where ``gelu`` still is)."""

    name = "gelu_tanh"
    stage = passkit.Stage.PRE_GRAD

    def run(self, gm, ctx):
        n = 0
        for node in gm.graph.nodes:
            if (
                node.op == "call_function"
                and "gelu" in str(node.target)
                and node.kwargs.get("approximate", "none") == "none"
            ):
                node.kwargs = {**node.kwargs, "approximate": "tanh"}
                n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


def test_a_close_rewrite_fails_the_default_check_and_passes_with_its_tolerance():
    assert 'passkit_harness(model, x, passes=["gelu_tanh"], verify=True)' in GUIDE
    from passkit_testing import run_passes as passkit_harness  # the fixture is this function

    model, x = gelu_model(), torch.randn(64, 8) * 3
    with pytest.raises(passkit.PassFailedError) as failed:  # the guide's message
        passkit_harness(model, x, passes=[GeluTanh])
    assert "VerificationError" in str(
        failed.value
    ) and "output 0 differs from the graph before the pass" in str(failed.value)
    result = passkit_harness(model, x, passes=[GeluTanh], verify=True)
    result.assert_matches("gelu_tanh", 1)
    with pytest.raises(AssertionError):
        result.assert_close()  # float32's tolerances: the approximation is further off
    result.assert_close(rtol=1e-3, atol=1e-3)


# -- a pass that only reads the graph ---------------------------------------------------


class CountMatmuls(passkit.GraphPass):
    """Counts the matrix products; rewrites nothing."""

    name = "count_matmuls"

    def run(self, gm, ctx):
        n = count_ops(gm, aten.mm) + count_ops(gm, aten.addmm)
        return passkit.PassResult(modified=False, matches=n, notes=[f"{n} matmul(s)"])


class CountMatmulsDeclared(CountMatmuls):
    name = "count_matmuls_declared"
    analysis_only = True


class ClaimsAnalysisButRewrites(passkit.GraphPass):
    name = "claims_analysis"
    analysis_only = True

    def run(self, gm, ctx):
        for node in gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor):
            node.target = aten.add.Tensor
            return passkit.PassResult(modified=True, matches=1)
        return passkit.PassResult.unchanged()


def sample(a, b):
    return (a @ b) * 2


SAMPLE = (sample, [torch.randn(4, 4), torch.randn(4, 4)])


def test_an_analysis_pass_declares_itself_and_idempotent_checks_it_leaves_the_graph():
    assert "`analysis_only = True` on the class" in GUIDE
    undeclared = PassChecker(CountMatmuls, sample=SAMPLE).check("idempotent")
    assert undeclared.status == "failed" and "reported 1 match(es)" in undeclared.detail
    declared = PassChecker(CountMatmulsDeclared, sample=SAMPLE).check("idempotent")
    assert declared.status == "passed", declared.detail
    lying = PassChecker(ClaimsAnalysisButRewrites, sample=SAMPLE).check("idempotent")
    assert (
        lying.status == "failed"
        and "declares analysis_only = True but changed the sample graph" in lying.detail
    )


def test_nothing_found_names_the_declaration():
    class CountsNothing(passkit.GraphPass):
        name = "counts_nothing"

        def run(self, gm, ctx):
            return passkit.PassResult.unchanged()

    result = PassChecker(CountsNothing, sample=SAMPLE).check("idempotent")
    assert result.status == "failed" and "analysis_only = True" in result.detail
