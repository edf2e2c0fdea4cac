"""A pass that leaves a graph Inductor cannot compile never takes the compile down (issue 27):
the structural check catches schema mismatches right after the pass; a failure only Inductor
sees is traced back to the passes that changed the graph, which are left out of a second
compile (``on_error="skip"``) or named in a ``PassFailedError`` (``"raise"``). Real Inductor
compiles, through every door passkit has."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import passkit
from passkit.errors import PassFailedError

from . import broken_passes
from .support import PLUGIN as CORE_PLUGIN


@pytest.fixture(autouse=True)
def _plugins(clean_env):
    passkit.register(broken_passes.PLUGIN, name="broken-passes")
    passkit.register(CORE_PLUGIN, name="core-test-passes")
    return clean_env


def fn(x):
    return torch.relu(x * 3.0) + 1.0


def expected(x):
    return torch.relu(x * 2.0) + 1.0  # mul_to_scale's rewrite (factor 2) still applies


X = torch.randn(4, 8)


def test_relu_with_two_arguments_is_caught_by_the_structural_check():
    backend = passkit.backend(passes=["mul_to_scale", "relu_twice", "cleanup"])
    out = torch.compile(fn, backend=backend)(X)
    torch.testing.assert_close(out, expected(X))
    (report,) = backend.reports
    record = report["relu_twice"]
    assert record.status == "failed"
    assert "VerificationError: after pass 'relu_twice'" in record.reason
    assert "aten.relu.default(mul, mul): too many positional arguments" in record.reason
    assert "schema aten::relu(Tensor self)" in record.reason
    assert report["mul_to_scale"].status == "ran" and report["cleanup"].status == "ran"


def test_inductor_failure_compiles_the_graph_again_without_the_pass(tmp_path, caplog):
    backend = passkit.backend(passes=["mul_to_scale", "to_half_after_relu"], dump_dir=tmp_path)
    out = torch.compile(fn, backend=backend)(X)
    torch.testing.assert_close(out, expected(X))  # float32, the pass's float16 cast is gone
    (report,) = backend.reports  # the failed attempt leaves no report
    record = report["to_half_after_relu"]
    assert record.status == "failed"
    assert record.reason.startswith("Inductor failed on the graph this pass changed: AssertionError: ")
    assert "both a fallback and a decomp for same op: aten._to_copy.default" in record.reason
    assert record.reason.endswith("compiled again without to_half_after_relu")
    assert report["mul_to_scale"].status == "ran" and report["mul_to_scale"].matches == 1
    reproducer = Path(record.reproducer).read_text()
    assert "'to_half_after_relu' (in-process plugin 'broken-passes'; 1 match(es))" in reproducer
    assert "_to_copy.default(relu, dtype = torch.float16)" in reproducer  # the graph Inductor got
    written: dict = {}
    exec(reproducer, written)  # the graphs before the passes and the one Inductor failed on
    assert "3.0" in written["GRAPH_BEFORE_PASSES"] and "_to_copy" not in written["GRAPH_BEFORE_PASSES"]
    assert "torch.float16" in written["GRAPH_INDUCTOR_FAILED_ON"]
    warning = [r.getMessage() for r in caplog.records if "Inductor failed" in r.getMessage()]
    assert warning and "'to_half_after_relu'" in warning[0]


def test_inductor_failure_with_on_error_raise_names_the_pass():
    backend = passkit.backend(passes=["mul_to_scale", "to_half_after_relu"], on_error="raise")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as caught:
        torch.compile(fn, backend=backend)(X)  # Dynamo wraps what a backend object raises
    error = caught.value.inner_exception
    assert isinstance(error, PassFailedError)
    assert error.pass_name == "to_half_after_relu"
    message = str(error)
    assert message.startswith(
        "Inductor failed on the graph that pass(es) 'mul_to_scale' (in-process plugin "
        "'core-test-passes'; 1 match(es)), 'to_half_after_relu' (in-process plugin "
        "'broken-passes'; 1 match(es)) changed: AssertionError: both a fallback and a decomp"
    )
    assert error.ran_before == ["mul_to_scale"]
    cause = error.__cause__
    assert cause is error.inductor_error and type(cause).__name__ == "InductorError"
    assert "both a fallback and a decomp" in str(cause)


def test_inductor_failure_with_on_error_raise_under_the_named_backend(monkeypatch):
    """backend="passkit" raises passkit's error itself (first lines name the pass); torch.compile
    drops the ``__cause__`` of what it lets through, so Inductor's error is ``inductor_error``."""
    import passkit._compile.backend

    monkeypatch.setenv("PASSKIT_PASSES", "to_half_after_relu")
    monkeypatch.setenv("PASSKIT_ON_ERROR", "raise")
    passkit._compile.backend._default_backend.cache_clear()
    try:
        with pytest.raises(PassFailedError, match="pass\\(es\\) 'to_half_after_relu'") as caught:
            torch.compile(fn, backend="passkit")(X)
    finally:
        passkit._compile.backend._default_backend.cache_clear()
    assert "both a fallback and a decomp" in str(caught.value.inductor_error)


def test_inductor_failure_under_the_named_backend(monkeypatch):
    import passkit._compile.backend

    monkeypatch.setenv("PASSKIT_PASSES", "mul_to_scale,to_half_after_relu")
    passkit._compile.backend._default_backend.cache_clear()
    try:
        out = torch.compile(fn, backend="passkit")(X)
        reports = passkit._compile.backend._default_backend().reports
    finally:
        passkit._compile.backend._default_backend.cache_clear()
    torch.testing.assert_close(out, expected(X))
    assert [r["to_half_after_relu"].status for r in reports] == ["failed"]


def test_inductor_failure_through_install_with_the_framework_compile_guarded():
    """``passkit.install``: the framework calls Inductor; ``passkit.guard`` wraps its compile."""
    from torch._inductor.compile_fx import compile_fx

    inductor_config: dict = {}
    pipeline = passkit.install(inductor_config, passes=["mul_to_scale", "to_half_after_relu"])

    def framework_compile(gm, example_inputs):
        return compile_fx(gm, example_inputs, config_patches=dict(inductor_config))

    out = torch.compile(fn, backend=passkit.guard(framework_compile, pipeline))(X)
    torch.testing.assert_close(out, expected(X))
    (report,) = pipeline.reports
    assert report["to_half_after_relu"].status == "failed"
    assert "both a fallback and a decomp" in report["to_half_after_relu"].reason


def test_a_failure_no_pass_caused_goes_through_unchanged():
    """A user's own custom pass breaks the graph; passkit's passes changed nothing: Inductor's
    error is raised as is, not blamed on passkit's passes."""

    def users_pass(graph):
        for node in graph.find_nodes(op="call_function", target=torch.ops.aten.relu.default):
            node.args = (node.args[0], node.args[0])

    backend = passkit.backend(passes=["cleanup"], inductor_config={"post_grad_custom_post_pass": users_pass})
    with pytest.raises(Exception, match=r"aten::relu\(\) expected at most 1 argument") as caught:
        torch.compile(fn, backend=backend)(X)
    assert not isinstance(caught.value, passkit.PasskitError)


def test_structural_check_costs_little_on_an_unchanged_graph():
    """The check compares with the snapshot the pipeline takes anyway and binds changed
    nodes only: on a 2000-node graph a pass that changes nothing adds well under the
    snapshot's own cost."""
    import time

    from torch.fx.experimental.proxy_tensor import make_fx

    from passkit._pipeline import schema_check
    from passkit.graph_utils import snapshot

    def deep(x):
        for _ in range(1000):
            x = torch.relu(x) + 1.0
        return x

    gm = make_fx(deep)(torch.randn(4))
    start = time.perf_counter()
    saved = snapshot(gm.graph)
    snap = time.perf_counter() - start
    start = time.perf_counter()
    schema_check.check(gm.graph, saved, "noop")
    check = time.perf_counter() - start
    assert check < max(2 * snap, 0.05), (check, snap)
    node = next(iter(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.relu.default)))
    node.args = (node.args[0], 1)
    with pytest.raises(passkit.VerificationError, match="relu"):
        schema_check.check(gm.graph, saved, "breaks_one")


def test_eager_mode_structural_check():
    """``mode="eager"`` has no Inductor: the structural check alone keeps the graph runnable."""
    backend = passkit.backend(passes=["mul_to_scale", "relu_twice"], mode="eager")
    out = torch.compile(fn, backend=backend)(X)
    torch.testing.assert_close(out, expected(X))
    assert backend.reports[-1]["relu_twice"].status == "failed"
