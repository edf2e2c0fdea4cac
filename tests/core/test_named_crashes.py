"""Issue 45: crashes that named neither the pass nor the compiler now name them.

On c84528f each of these ended in an error of torch's that named no pass or compiler (or a
silent "no passes"): a joint rewrite that breaks AOTAutograd's partitioner under
``aot_eager``, an inserted op with no CPU kernel (failing at the first call), a ``compiler``
module calling ``sys.exit()`` on import, a compiler returning ``None`` (``'NoneType' object
is not callable`` at the first call), a compiler that raises (named
``<passkit._compile.backend.Backend object at 0x...>``), ``PASSKIT_PASSES=",,,"``.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import passkit
from passkit import Stage
from passkit.config import load_config

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _env(clean_env):
    return clean_env


def fn(x):
    return torch.relu(x * 3.0) + 1.0


class JointNoMeta(passkit.GraphPass):
    """Joint: ``relu``'s input goes through ``neg(neg(.))`` with no recorded values (the
    partitioner reads them)."""

    name = "joint_no_meta"
    stage = Stage.JOINT

    def run(self, gm, ctx):
        n = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=aten.relu.default)):
            with gm.graph.inserting_before(node):
                a = gm.graph.call_function(aten.neg.default, (node.args[0],))
                b = gm.graph.call_function(aten.neg.default, (a,))
            node.update_arg(0, b)
            n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


_lib = torch.library.Library("passkit_t45", "FRAGMENT")
_lib.define("cuda_only(Tensor x) -> Tensor")
_lib.impl("cuda_only", lambda x: x.clone(), "CUDA")
torch.library.register_fake("passkit_t45::cuda_only", lambda x: x.new_empty(x.shape), lib=_lib)


class CudaOnlyOp(passkit.GraphPass):
    """Wraps relu's result in an op that has a CUDA kernel only."""

    name = "cuda_only_op"

    def run(self, gm, ctx):
        (relu,) = gm.graph.find_nodes(op="call_function", target=aten.relu.default)
        with gm.graph.inserting_after(relu):
            new = gm.graph.call_function(torch.ops.passkit_t45.cuda_only.default, (relu,))
        new.meta["val"] = relu.meta["val"]
        relu.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
        return passkit.PassResult(modified=True, matches=1)


class Plugin:
    @passkit.hookimpl
    def passkit_register_passes(self):
        return [JointNoMeta, CudaOnlyOp]


@pytest.mark.parametrize("compiler", ["aot_eager", "custom"])
def test_a_joint_rewrite_that_breaks_the_partitioner_is_named_and_left_out(compiler):
    from torch._dynamo.backends.debugging import boxed_nop

    passkit.register(Plugin(), name="named-crashes")
    backend = passkit.backend(passes=["joint_no_meta"], compiler=boxed_nop if compiler == "custom" else "aot_eager")
    x = torch.randn(8, 4, requires_grad=True)
    out = torch.compile(fn, backend=backend)(x)
    out.sum().backward()
    y = x.detach().clone().requires_grad_(True)
    fn(y).sum().backward()
    torch.testing.assert_close(x.grad, y.grad)
    (record,) = [r["joint_no_meta"] for r in backend.reports if "joint_no_meta" in r]
    assert record.status == "failed", record
    assert "partitioner failed on the joint graph it changed" in record.reason, record.reason


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
def test_an_inserted_op_without_a_cpu_kernel_fails_at_the_pass_named(compiler):
    passkit.register(Plugin(), name="named-crashes")
    backend = passkit.backend(passes=["cuda_only_op"], compiler=compiler)
    x = torch.randn(8, 4)
    torch.testing.assert_close(torch.compile(fn, backend=backend)(x), fn(x))
    record = backend.reports[-1]["cuda_only_op"]
    assert record.status == "failed" and "has no CPU kernel" in record.reason, record


def _module(tmp_path, monkeypatch, body):
    (tmp_path / "t45_compilers.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("t45_compilers", None)


def test_a_compiler_module_that_exits_on_import_is_a_config_error(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "import sys\nsys.exit(3)\n")
    with pytest.raises(passkit.ConfigError, match=r"config key compiler: cannot import 't45_compilers:c'.*SystemExit"):
        passkit.Backend(load_config(passes=["cleanup"], compiler="t45_compilers:c", environ={}))


def test_a_compiler_that_returns_none_is_named(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "def c(gm, inputs):\n    return None\n")
    backend = passkit.Backend(load_config(passes=["cleanup"], compiler="t45_compilers:c", environ={}))
    expected = r"compiler 't45_compilers:c' returned NoneType for the inference graph"
    with pytest.raises(Exception, match=expected), torch.no_grad():
        torch.compile(fn, backend=backend)(torch.randn(8, 4))


def test_a_compiler_that_raises_is_named_by_its_config_key(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "def c(gm, inputs):\n    raise ValueError('no luck')\n")
    backend = passkit.Backend(load_config(passes=["cleanup"], compiler="t45_compilers:c", environ={}))
    with pytest.raises(Exception) as caught, torch.no_grad():
        torch.compile(fn, backend=backend)(torch.randn(8, 4))
    message = str(caught.value)
    assert "compiler 't45_compilers:c' raised compiling the inference graph: ValueError: no luck" in message
    assert "Backend object at 0x" not in message


@pytest.mark.parametrize("value", [",,,", " , "])
def test_passes_that_are_only_separators_are_an_error(value):
    with pytest.raises(passkit.ConfigError, match=r"PASSKIT_PASSES=.* names no pass"):
        load_config(environ={"PASSKIT_PASSES": value})
