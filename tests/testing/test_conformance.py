"""Tests of passkit_testing.conformance: each property passes on a good pass and fails, with a
clear message, on a pass built to break it.

The passes are module-level so that the checker's fresh process can import them.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Annotated

import pydantic
import pytest
import torch

import passkit
from passkit_testing import PROPERTIES, ConformanceError, PassChecker, check_pass, conformance_tests

pytest_plugins = ["pytester"]

aten = torch.ops.aten


class Factor(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)
    factor: float = 2.0


class DoubleMuls(passkit.GraphPass):
    """Multiplies the scalar of every ``mul.Tensor(x, <scalar>)`` by ``factor``: it matches its
    own output again, so it is not idempotent."""

    name = "double_muls"
    Options = Factor

    def run(self, gm, ctx):
        n = 0
        for node in gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor):
            if isinstance(node.args[1], float):
                node.update_arg(1, node.args[1] * self.options.factor)
                n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


class NotIdempotentOnPurpose(DoubleMuls):
    name = "not_idempotent_on_purpose"
    idempotent = False


class InstanceIdentity(passkit.GraphPass):
    name = "instance_identity"

    def identity(self):
        return {**super().identity(), "instance": id(self)}


class ProcessIdentity(passkit.GraphPass):
    name = "process_identity"

    def identity(self):
        return {**super().identity(), "pid": os.getpid()}


class IgnoresOptions(DoubleMuls):
    name = "ignores_options"

    def identity(self):
        return {k: v for k, v in super().identity().items() if k != "options"}


class LossyOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)
    scale: Annotated[float, pydantic.PlainSerializer(int)] = 1.5


class LossyOptionsPass(passkit.GraphPass):
    name = "lossy_options"
    Options = LossyOptions


class LaxOptions(pydantic.BaseModel):
    scale: float = 1.0


class LaxOptionsPass(passkit.GraphPass):
    name = "lax_options"
    Options = LaxOptions


class SubToAdd(passkit.GraphPass):
    """Rewrites ``x - c`` into ``x + (-c)``: it touches graphs without its (intended) pattern."""

    name = "sub_to_add"

    def run(self, gm, ctx):
        n = 0
        for node in gm.graph.find_nodes(op="call_function", target=aten.sub.Tensor):
            if isinstance(node.args[1], float):
                node.target = aten.add.Tensor
                node.update_arg(1, -node.args[1])
                n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


class CorruptMeta(passkit.GraphPass):
    name = "corrupt_meta"

    def run(self, gm, ctx):
        node = next(n for n in gm.graph.nodes if n.op == "call_function")
        node.meta["val"] = node.meta["val"].new_empty((7,))
        return passkit.PassResult(modified=True, matches=1)


def scaled(x):
    return torch.relu(x * 3.0)


SAMPLE = (scaled, [torch.randn(8)])


def check(cls, name, **kwargs):
    return PassChecker(cls, **kwargs).check(name)


# -- a good pass -----------------------------------------------------------------------------


def test_builtin_pass_conforms():
    sample = (lambda x: x.view(8).view(2, 4) + 1, [torch.randn(2, 4)])
    results = check_pass("noop_elimination", sample=sample)
    assert [r.name for r in results] == list(PROPERTIES)
    assert {r.name: r.status for r in results if r.status != "passed"} == {"uuid-distinct": "skipped"}


def test_options_variants_with_different_uuids():
    checker = PassChecker(DoubleMuls, options_variants=[{}, {"factor": 3.0}], sample=SAMPLE)
    for name in ("uuid-stable", "uuid-distinct", "options-json", "options-reject-unknown", "lint"):
        assert checker.check(name).status == "passed", name


# -- each property fails when it should --------------------------------------------------------


def test_uuid_stable_fails_on_an_identity_with_object_ids():
    result = check(InstanceIdentity, "uuid-stable")
    assert result.status == "failed"
    assert "two instances with options {} have different pipeline uuids" in result.detail


def test_uuid_cross_process_fails_on_a_process_dependent_identity():
    result = check(ProcessIdentity, "uuid-cross-process")
    assert result.status == "failed"
    assert "a fresh process computes uuid" in result.detail
    assert "depends on process state" in result.detail
    assert check(ProcessIdentity, "imports-without-cuda").status == "passed"


def test_import_that_initialises_cuda_fails(tmp_path, monkeypatch):
    (tmp_path / "cuda_at_import.py").write_text(
        "import torch\n\nimport passkit\n\n"
        "torch.cuda.init()  # what a pass module must never do\n\n\n"
        "class CudaAtImport(passkit.GraphPass):\n"
        "    name = 'cuda_at_import'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cuda_at_import", raising=False)
    with monkeypatch.context() as patched:
        patched.setattr(torch.cuda, "init", lambda: None)  # so that it imports here
        module = importlib.import_module("cuda_at_import")

    result = check(module.CudaAtImport, "imports-without-cuda")
    assert result.status == "failed"
    assert "a fresh process failed to import and instantiate the pass" in result.detail
    assert "torch.cuda.init()" in result.detail


def test_uuid_distinct_fails_when_options_are_not_in_the_identity():
    result = check(IgnoresOptions, "uuid-distinct", options_variants=[{}, {"factor": 3.0}])
    assert result.status == "failed"
    assert 'options {"factor": 2.0} and {"factor": 3.0} give the same uuid' in result.detail


def test_uuid_distinct_is_skipped_without_two_different_variants():
    assert check(DoubleMuls, "uuid-distinct").detail == "give two or more different options_variants"
    same = [{}, {"factor": 2.0}]  # equal once validated
    assert check(DoubleMuls, "uuid-distinct", options_variants=same).status == "skipped"
    assert check(SubToAdd, "uuid-distinct").detail == "the pass has no options"


def test_options_json_fails_on_lossy_serialisation():
    result = check(LossyOptionsPass, "options-json")
    assert result.status == "failed"
    assert "do not survive JSON" in result.detail and '{"scale": 1}' in result.detail


def test_options_reject_unknown_fails_on_a_lax_model():
    result = check(LaxOptionsPass, "options-reject-unknown")
    assert result.status == "failed"
    assert "accepts the unknown option" in result.detail and "extra='forbid'" in result.detail


def test_neutral_graph_fails_when_the_pass_touches_it():
    result = check(SubToAdd, "neutral-graph")
    assert result.status == "failed"
    assert "on a graph without its pattern the pass reported 1 match(es), modified=True" in result.detail
    assert "+    sub = torch.ops.aten.add.Tensor(mm, -1.0)" in result.detail


def test_neutral_graph_can_be_replaced():
    neutral = (lambda x: x.cos() * 2.0, [torch.randn(4)])
    assert check(SubToAdd, "neutral-graph", neutral=neutral).status == "passed"


def test_idempotent_fails_when_the_pass_matches_its_own_output():
    result = check(DoubleMuls, "idempotent", sample=SAMPLE)
    assert result.status == "failed"
    assert "running the pass again on its own output reported 1 match(es); graph diff:" in result.detail


def test_idempotent_fails_on_a_sample_without_the_pattern():
    result = check(DoubleMuls, "idempotent", sample=(torch.cos, [torch.randn(4)]))
    assert result.status == "failed"
    assert "found nothing to do on the sample" in result.detail


def test_idempotent_is_skipped_when_not_declared_or_without_sample():
    assert check(NotIdempotentOnPurpose, "idempotent", sample=SAMPLE).detail == (
        "the pass declares idempotent = False"
    )
    assert check(DoubleMuls, "idempotent").status == "skipped"


def test_lint_fails_on_bad_metadata():
    result = check(CorruptMeta, "lint")
    assert result.status == "failed"
    assert "VerificationError" in result.detail and "metadata disagrees" in result.detail


def test_plugin_valid_is_skipped_for_an_unregistered_class():
    result = check(DoubleMuls, "plugin-valid")
    assert result.status == "skipped"
    assert result.detail == f"{__name__}.DoubleMuls is not provided by an installed plugin"


# -- check_pass and conformance_tests --------------------------------------------------------------


def test_check_pass_lists_every_failure():
    with pytest.raises(ConformanceError) as info:
        check_pass(LaxOptionsPass, options_variants=[{"scale": 2.0}])
    message = str(info.value)
    assert message.startswith("pass 'lax_options' fails 3 conformance properties:\n")
    for name in ("options-reject-unknown", "neutral-graph", "lint"):  # run() is not implemented
        assert f"\n- {name}: " in message
    assert "skipped: uuid-distinct (give two or more different options_variants)" in message
    assert len(info.value.results) == len(PROPERTIES)


def test_conformance_tests_make_one_test_per_property():
    test = conformance_tests(LaxOptionsPass)
    (mark,) = test.pytestmark
    assert mark.args == ("conformance_property", PROPERTIES)
    test("options-json")  # passes
    with pytest.raises(pytest.fail.Exception, match=r"lax_options: .*accepts the unknown option"):
        test("options-reject-unknown")
    with pytest.raises(pytest.skip.Exception, match=r"give two or more different options_variants"):
        test("uuid-distinct")


def test_conformance_tests_resolve_the_pass_when_run():
    test = conformance_tests("no_such_pass")
    with pytest.raises(passkit.ConfigError, match="unknown pass 'no_such_pass'"):
        test("uuid-stable")


def test_conformance_tests_ids(pytester):
    pytester.makepyfile(
        """
        import torch
        from passkit_testing import conformance_tests

        test_noop_conformance = conformance_tests("noop_elimination")
        """
    )
    result = pytester.runpytest("-v", "-p", "no:cacheprovider", "-k", "options")
    result.assert_outcomes(passed=2, deselected=len(PROPERTIES) - 2)
    result.stdout.fnmatch_lines(
        [
            "*test_noop_conformance[[]options-json[]] PASSED*",
            "*test_noop_conformance[[]options-reject-unknown[]] PASSED*",
        ]
    )


def test_bad_arguments():
    with pytest.raises(TypeError, match="by registered name or Pass class"):
        PassChecker(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="options_variants must not be empty"):
        PassChecker(DoubleMuls, options_variants=[])
    with pytest.raises(ValueError, match="unknown property 'speed'"):
        PassChecker(DoubleMuls).check("speed")
    with pytest.raises(passkit.ConfigError, match=r"passes\.double_muls\.factor"):
        PassChecker(DoubleMuls, options_variants=[{"factor": "big"}])
