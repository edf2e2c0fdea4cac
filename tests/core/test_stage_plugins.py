"""Third-party passes at the pre-grad and joint stages (issue 38), as a user gets them: the
example plugin (``examples/passkit-example-plugin``, installed with pip, found through its
``passkit.passes`` entry point) enabled by name, in plain torch.compile (inference and
training), under ``compiler="aot_eager"`` and a custom compiler, and through the named
``passkit`` backend."""

from __future__ import annotations

import json

import pytest
import torch

import passkit

pytest.importorskip("passkit_example", reason="the example plugin is installed by `nox -s tests`")

aten = torch.ops.aten


def swish_mlp(x, w):
    y = x @ w
    return (y * torch.sigmoid(y)).sum()


def double_neg(x, w):
    return torch.neg(torch.neg(torch.tanh(x @ w))).sum()


def inputs(grad: bool):
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g).requires_grad_(grad)


def train(fn, backend):
    x, w = inputs(grad=True)
    torch.compile(fn, backend=backend)(x, w).backward()
    ref = w.detach().clone().requires_grad_(True)
    fn(x, ref).backward()
    torch.testing.assert_close(w.grad, ref.grad)


def by_kind(backend: passkit.Backend, name: str) -> dict[str | None, tuple[str, int]]:
    """Per graph the pass ran on (each record says which): its status and matches."""
    return {
        rec.graph_kind: (rec.status, rec.matches)
        for r in backend.reports
        for rec in r.records
        if rec.name == name
    }


def test_the_pre_grad_pass_is_installed_with_its_stage():
    info = passkit.get_plugins().passes["silu_from_sigmoid"]
    assert info.plugin.distribution == "passkit-example-plugin"
    assert info.cls.stage is passkit.Stage.PRE_GRAD
    assert passkit.get_plugins().passes["fold_double_neg_joint"].cls.stage is passkit.Stage.JOINT


def test_list_shows_each_pass_stage(capsys):
    from passkit.cli import main

    main(["list", "--json"])
    listed = json.loads(capsys.readouterr().out)
    rows = listed["passes"] if isinstance(listed, dict) else listed
    stages = {row["name"]: row["stage"] for row in rows}
    assert stages["silu_from_sigmoid"] == "pre_grad"
    assert stages["fold_double_neg_joint"] == "joint"
    assert stages["fold_double_neg"] == "post_grad_post"


def test_inductor_inference_and_training_by_name():
    backend = passkit.backend(passes=["silu_from_sigmoid", "fold_double_neg_joint"])
    x, w = inputs(grad=False)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(swish_mlp, backend=backend)(x, w), swish_mlp(x, w))
    assert by_kind(backend, "silu_from_sigmoid") == {"torch": ("ran", 1)}
    torch._dynamo.reset()
    backend = passkit.backend(passes=["silu_from_sigmoid", "fold_double_neg_joint"])
    train(swish_mlp, backend)
    assert by_kind(backend, "silu_from_sigmoid") == {"torch": ("ran", 1)}
    assert by_kind(backend, "fold_double_neg_joint") == {"joint": ("ran", 0)}
    torch._dynamo.reset()
    backend = passkit.backend(passes=["fold_double_neg_joint"])
    train(double_neg, backend)
    assert by_kind(backend, "fold_double_neg_joint") == {"joint": ("ran", 2)}  # forward's and backward's


@pytest.mark.parametrize("compiler", ["aot_eager", "custom"])
def test_other_compilers_get_the_rewritten_graphs(compiler):
    received: list[list[str]] = []

    def counting(gm, example_inputs):
        received.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    chosen = counting if compiler == "custom" else "aot_eager"
    backend = passkit.backend(passes=["silu_from_sigmoid", "fold_double_neg_joint"], compiler=chosen)
    train(swish_mlp, backend)
    assert by_kind(backend, "silu_from_sigmoid") == {"torch": ("ran", 1)}
    torch._dynamo.reset()
    backend = passkit.backend(passes=["silu_from_sigmoid", "fold_double_neg_joint"], compiler=chosen)
    train(double_neg, backend)
    assert by_kind(backend, "fold_double_neg_joint") == {"joint": ("ran", 2)}
    with torch.no_grad():
        torch._dynamo.reset()
        backend = passkit.backend(passes=["silu_from_sigmoid"], compiler=chosen)
        x, w = inputs(grad=False)
        torch.testing.assert_close(torch.compile(swish_mlp, backend=backend)(x, w), swish_mlp(x, w))
        assert by_kind(backend, "silu_from_sigmoid") == {"torch": ("ran", 1)}
    if compiler == "custom":
        swish_forward, _swish_backward, neg_forward, neg_backward, inference = received
        assert "aten.neg.default" not in neg_forward + neg_backward  # folded in both halves
        # Inductor's decompositions (also used here) spell silu as x / (1 + exp(-x)): no sigmoid
        assert "aten.sigmoid.default" not in swish_forward + inference


def test_without_the_pass_the_custom_compiler_sees_the_original():
    received: list[list[str]] = []

    def counting(gm, example_inputs):
        received.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    train(swish_mlp, passkit.backend(passes=[], compiler=counting))
    assert "aten.sigmoid.default" in received[0]


def test_the_named_backend(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PASSKIT_PASSES", "silu_from_sigmoid")
    from passkit._compile.backend import _default_backend

    _default_backend.cache_clear()
    try:
        x, w = inputs(grad=True)
        torch.compile(swish_mlp, backend="passkit")(x, w).backward()
        reports = _default_backend().reports
        assert [
            (r.graph_kind, r["silu_from_sigmoid"].matches) for r in reports if "silu_from_sigmoid" in r
        ] == [("training", 1)]  # a pre-grad-only config in training: one report, titled so
    finally:
        _default_backend.cache_clear()


def test_a_host_reports_the_pre_grad_pass_skipped():
    from torch.fx.experimental.proxy_tensor import make_fx

    pipeline = passkit.install({}, passes=["silu_from_sigmoid", "fold_double_neg"])
    gm = make_fx(lambda x: torch.neg(torch.neg(x)) * torch.sigmoid(x), tracing_mode="fake")(torch.randn(4))
    report = pipeline.run(gm)
    assert report["fold_double_neg"].status == "ran"
    assert report["silu_from_sigmoid"].status == "skipped"
    assert "not run by this host" in report["silu_from_sigmoid"].reason
