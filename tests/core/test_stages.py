"""Every hook point torch.compile has (issue 38): the ``pre_grad`` stage on Dynamo's graph,
the ``joint`` stage on the forward+backward graph before partitioning, the two post-grad
stages on each forward, backward and inference graph; under Inductor, ``aot_eager`` and a
custom AOTAutograd compiler; the graph kind each pass sees; hosts that run the post-grad
stages only report the others skipped."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

import passkit
from passkit import Pipeline, Stage
from passkit._plugins.registry import get_plugins
from passkit.config import load_config

aten = torch.ops.aten

SEEN: list[tuple[str, str | None, str | None, str]] = []


class Recorder(passkit.GraphPass):
    def run(self, gm, ctx):
        SEEN.append((self.name, ctx.stage, ctx.graph_kind, ctx.compiler))
        return passkit.PassResult.unchanged()


class AtPreGrad(Recorder):
    name = "rec_pre_grad"
    stage = "pre_grad"


class AtJoint(Recorder):
    name = "rec_joint"
    stage = Stage.JOINT


class AtPost(Recorder):
    name = "rec_post"


class TanhToSigmoidForm(passkit.GraphPass):
    """Pre-grad: ``torch.tanh(x)`` -> ``2 * sigmoid(2x) - 1`` (a visible torch-level rewrite:
    afterwards no graph holds tanh, the backward one included)."""

    name = "tanh_as_sigmoid"
    stage = Stage.PRE_GRAD

    def run(self, gm, ctx):
        n = 0
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is torch.tanh:
                with gm.graph.inserting_before(node):
                    two_x = gm.graph.call_function(operator.mul, (node.args[0], 2.0))
                    sig = gm.graph.call_function(torch.sigmoid, (two_x,))
                    scaled = gm.graph.call_function(operator.mul, (sig, 2.0))
                    new = gm.graph.call_function(operator.sub, (scaled, 1.0))
                node.replace_all_uses_with(new)
                gm.graph.erase_node(node)
                n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


class JointNegTwice(passkit.GraphPass):
    """Joint: ``aten.relu`` -> ``relu`` with a ``neg(neg(.))`` around its input (a visible,
    harmless joint-graph rewrite that lands in the forward graph)."""

    name = "joint_neg_twice"
    stage = Stage.JOINT

    def run(self, gm, ctx):
        n = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=aten.relu.default)):
            with gm.graph.inserting_before(node):
                a = gm.graph.call_function(aten.neg.default, (node.args[0],))
                b = gm.graph.call_function(aten.neg.default, (a,))
            a.meta["val"] = b.meta["val"] = node.args[0].meta["val"]  # the partitioner reads it
            node.update_arg(0, b)
            n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


class FailsAtPreGrad(passkit.GraphPass):
    name = "fails_pre_grad"
    stage = Stage.PRE_GRAD

    def run(self, gm, ctx):
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is torch.tanh:
                node.target = torch.sin  # a change, then a failure: must be rolled back
        raise RuntimeError("pre-grad boom")


class FailsAtJoint(passkit.GraphPass):
    name = "fails_joint"
    stage = Stage.JOINT

    def run(self, gm, ctx):
        gm.graph.erase_node(next(iter(gm.graph.find_nodes(op="output"))))
        raise RuntimeError("joint boom")


class ForwardOnly(Recorder):
    name = "forward_only"
    graph_kinds = ("forward", "inference")
    skip_graph_kinds_reason = "a test pass"


def make_backend(*passes: passkit.Pass, **kwargs) -> passkit.Backend:
    config = kwargs.pop("config", {})
    return passkit.Backend(pipeline=Pipeline(load_config(config), get_plugins(), list(passes)), **kwargs)


def fn(x, w):
    return torch.relu(torch.tanh(x @ w)).sum()


def inputs(grad: bool = True):
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g).requires_grad_(grad)


@pytest.fixture(autouse=True)
def _clear():
    SEEN.clear()


def _train(backend, f=fn):
    x, w = inputs()
    out = torch.compile(f, backend=backend)(x, w)
    out.backward()
    ref_w = w.detach().clone().requires_grad_(True)
    f(x, ref_w).backward()
    torch.testing.assert_close(w.grad, ref_w.grad)
    return out


def test_stages_are_ordered_and_old_names_stay():
    assert [s.value for s in passkit.Stage] == ["pre_grad", "joint", "post_grad_pre", "post_grad_post"]
    assert Stage("post_grad_pre") is Stage.PRE and Stage("post_grad_post") is Stage.POST
    # config order says post, joint, pre-grad: stage order wins
    pipeline = Pipeline(load_config({}), get_plugins(), [AtPost(), AtJoint(), AtPreGrad()])
    assert pipeline.names() == ["rec_pre_grad", "rec_joint", "rec_post"]


def test_a_bad_stage_or_graph_kind_names_the_pass_and_the_valid_values():
    with pytest.raises(TypeError) as err:

        class Bad(passkit.GraphPass):
            name = "bad_stage"
            stage = "pregrad"

    message = str(err.value)
    assert "'bad_stage'" in message and "'pregrad'" in message
    assert "'pre_grad'" in message and "'joint'" in message and "'post_grad_post'" in message
    with pytest.raises(TypeError, match=r"bad_kind.*'training'.*valid kinds: 'torch', 'joint'"):

        class BadKind(passkit.GraphPass):
            name = "bad_kind"
            graph_kinds = ("training",)


def test_before_after_across_stages_is_an_order_error():
    class Late(passkit.GraphPass):
        name = "late_pre_grad"
        stage = Stage.PRE_GRAD
        after = ("rec_post",)

        def run(self, gm, ctx):
            return passkit.PassResult.unchanged()

    with pytest.raises(
        passkit.errors.OrderError, match="stage pre_grad runs before stage post_grad_post whatever"
    ):
        Pipeline(load_config({}), get_plugins(), [AtPost(), Late()])


@pytest.mark.parametrize("compiler", ["aot_eager", "custom"])
def test_every_stage_runs_in_training_and_inference_with_other_compilers(compiler):
    received: list[tuple[str, list[str]]] = []

    def counting(gm, example_inputs):
        ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        kind = "backward" if any(n.name.startswith("tangents") for n in gm.graph.nodes) else "forward"
        received.append((kind, ops))
        return gm

    chosen = counting if compiler == "custom" else "aot_eager"
    name = "counting" if compiler == "custom" else "aot_eager"
    backend = make_backend(AtPreGrad(), AtJoint(), AtPost(), compiler=chosen)
    _train(backend)
    assert [
        ("rec_pre_grad", "pre_grad", "torch", name),
        ("rec_joint", "joint", "joint", name),
        ("rec_post", "post_grad_post", "forward", name),
        ("rec_post", "post_grad_post", "backward", name),
    ] == SEEN
    # one report of the compile (every stage up to the forward graph), one of the backward
    # graph, which AOTAutograd compiles at the first backward call
    compiled, backward = backend.reports
    assert [(r.stage, r.graph_kind) for r in compiled.records] == [
        ("pre_grad", "torch"),
        ("joint", "joint"),
        ("post_grad_post", "forward"),
    ]
    assert [(r.stage, r.graph_kind) for r in backward.records] == [("post_grad_post", "backward")]
    assert "training graph" in compiled.format() and "backward graph" in backward.format()
    assert f"the backward graph of graph {compiled.graph_id}" in backward.notes[0]
    if compiler == "custom":
        assert [k for k, _ in received] == ["forward", "backward"]
    SEEN.clear()
    torch._dynamo.reset()
    backend = make_backend(AtPreGrad(), AtJoint(), AtPost(), compiler=chosen)
    with torch.no_grad():
        torch.compile(fn, backend=backend)(*inputs())
    assert [(s, k) for _, s, k, _ in SEEN] == [
        ("pre_grad", "torch"),
        ("joint", "inference"),
        ("post_grad_post", "inference"),
    ]


def test_a_custom_compiler_gets_the_rewritten_graphs():
    received: list[list[str]] = []

    def counting(gm, example_inputs):
        received.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    _train(make_backend(TanhToSigmoidForm(), JointNegTwice(), compiler=counting))
    forward, backward = received
    assert "aten.tanh.default" not in forward and "aten.sigmoid.default" in forward
    assert not any("tanh" in op for op in backward)  # the backward of sigmoid, not of tanh
    assert forward.count("aten.neg.default") == 2  # the joint rewrite went to the forward half
    received.clear()
    torch._dynamo.reset()
    _train(passkit.backend(passes=[], compiler=counting))
    assert "aten.tanh.default" in received[0]  # without the passes: tanh


def test_inductor_runs_pre_grad_and_joint_and_knows_forward_from_backward():
    backend = make_backend(AtPreGrad(), TanhToSigmoidForm(), AtJoint(), AtPost())
    _train(backend)
    assert [(s, k, c) for _, s, k, c in SEEN] == [
        ("pre_grad", "torch", "inductor"),
        ("joint", "joint", "inductor"),
        ("post_grad_post", "forward", "inductor"),
        ("post_grad_post", "backward", "inductor"),
    ]
    assert backend.reports[0]["tanh_as_sigmoid"].matches == 1
    assert [r.graph_kind for r in backend.reports] == ["training", "backward"]
    assert [r.graph_kind for r in backend.reports[0].records] == ["torch", "torch", "joint", "forward"]


def test_failures_at_pre_grad_and_joint_are_isolated_and_named():
    backend = make_backend(FailsAtPreGrad(), FailsAtJoint(), AtPost(), compiler="aot_eager")
    _train(backend)  # gradients right: both graphs were restored
    pre_grad = joint = backend.reports[0]  # the compile's one report
    assert (
        pre_grad["fails_pre_grad"].status == "failed" and "pre-grad boom" in pre_grad["fails_pre_grad"].reason
    )
    assert joint["fails_joint"].status == "failed" and "joint boom" in joint["fails_joint"].reason
    strict = make_backend(FailsAtPreGrad(), config={"on_error": "raise"}, compiler="aot_eager")
    with pytest.raises(Exception, match="pass 'fails_pre_grad' failed"):
        torch.compile(fn, backend=strict)(*inputs())


def test_output_checks_hold_at_pre_grad():
    class DropsOutput(passkit.GraphPass):
        name = "drops_output"
        stage = Stage.PRE_GRAD

        def run(self, gm, ctx):
            out = gm.graph.output_node()
            (value,) = out.args
            x = next(iter(gm.graph.find_nodes(op="placeholder")))
            out.args = ((x, *value[1:]) if isinstance(value, (tuple, list)) else x,)
            return passkit.PassResult(modified=True)

    backend = make_backend(DropsOutput(), compiler="aot_eager")
    x, w = inputs(grad=False)
    torch.testing.assert_close(torch.compile(fn, backend=backend)(x, w), fn(x, w))
    assert backend.reports[0]["drops_output"].status == "failed"


def test_a_pass_skips_graph_kinds_it_does_not_handle_with_why():
    backend = make_backend(ForwardOnly(), compiler="aot_eager")
    _train(backend)
    forward, backward = backend.reports
    assert forward["forward_only"].status == "ran"
    assert backward["forward_only"].status == "skipped"
    assert backward["forward_only"].reason == (
        "runs on forward/inference graphs only; this is a backward graph: a test pass"
    )


def test_mode_eager_is_compiler_aot_eager_and_bad_compilers_are_named():
    assert passkit.backend(passes=[], mode="eager").compiler == "aot_eager"
    assert passkit.backend(passes=[], compiler="aot_eager").mode == "eager"
    with pytest.raises(ValueError, match="compiler must be one of"):
        passkit.backend(passes=[], compiler="tvm")
    with pytest.raises(ValueError, match="mode='eager' runs no Inductor"):
        passkit.backend(passes=[], mode="eager", compiler="inductor")
    with pytest.raises(ValueError, match="or a callable"):
        passkit.backend(passes=[], compiler=3)


def test_a_host_reports_the_stages_it_does_not_run_skipped():
    inductor_config: dict = {}
    pipeline = Pipeline(load_config({}), get_plugins(), [AtPreGrad(), AtJoint(), AtPost()])
    assert set(pipeline.inductor_patches()) == {"post_grad_custom_post_pass"}
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: torch.relu(x) + 1)(torch.randn(4))
    report = pipeline.run(gm)
    assert report["rec_post"].status == "ran"
    for name, stage in (("rec_pre_grad", "pre_grad"), ("rec_joint", "joint")):
        assert report[name].status == "skipped"
        assert report[name].reason.startswith(f"stage {stage} is not run by this host")
    assert SEEN == [("rec_post", "post_grad_post", "inference", "inductor")]
    passkit.install(inductor_config, passes=[])
    assert inductor_config == {}


def test_pre_grad_rewrite_reaches_silu_through_the_named_backend_style_pipeline():
    """A torch-level rewrite with F.silu: Dynamo's graph keeps ``x * torch.sigmoid(x)`` as
    written, and a pass at pre_grad sees it."""

    class Seen(passkit.GraphPass):
        name = "sees_torch_ops"
        stage = Stage.PRE_GRAD

        def run(self, gm, ctx):
            targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
            SEEN.append((self.name, ctx.stage, ctx.graph_kind, str(torch.sigmoid in targets)))
            return passkit.PassResult.unchanged()

    def swish(x):
        return x * torch.sigmoid(x) + F.relu(x)

    backend = make_backend(Seen(), compiler="aot_eager")
    torch.compile(swish, backend=backend)(torch.randn(4))
    assert SEEN == [("sees_torch_ops", "pre_grad", "torch", "True")]


def test_inductor_failing_on_a_pre_grad_rewrite_compiles_without_it():
    class BreaksInductor(passkit.GraphPass):
        """Adds a node whose op Inductor cannot lower (a Python function the tracer runs
        but that raises when AOTAutograd traces it)."""

        name = "breaks_inductor"
        stage = Stage.PRE_GRAD

        def run(self, gm, ctx):
            out = gm.graph.output_node()
            with gm.graph.inserting_before(out):
                (value,) = out.args
                first = value[0] if isinstance(value, (tuple, list)) else value
                bad = gm.graph.call_function(_raises_when_traced, (first,))
            bad.meta.update(first.meta)
            out.args = ((bad, *value[1:]) if isinstance(value, (tuple, list)) else bad,)
            return passkit.PassResult(modified=True, matches=1)

    backend = make_backend(BreaksInductor())
    x, w = inputs(grad=False)
    torch.testing.assert_close(torch.compile(fn, backend=backend)(x, w), fn(x, w))
    record = backend.last_report["breaks_inductor"]
    assert record.status == "failed" and "cannot trace this" in record.reason


def test_dumps_hold_the_pre_grad_and_joint_graphs(tmp_path):
    backend = make_backend(
        TanhToSigmoidForm(), JointNegTwice(), config={"dump_dir": str(tmp_path)}, compiler="aot_eager"
    )
    _train(backend)
    dumped = "\n".join(
        p.read_text() for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".py", ".txt")
    )
    assert "torch.tanh" in dumped and "torch.sigmoid" in dumped  # the pre-grad graph before and after
    assert "aten.relu" in dumped and "aten.neg" in dumped  # the joint graph


def _raises_when_traced(x):
    """Runs on fake tensors (passkit's output check), raises when AOTAutograd traces it."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if any("Proxy" in type(mode).__name__ for mode in _get_current_dispatch_mode_stack()):
        raise RuntimeError("cannot trace this")
    return x


def test_a_host_with_only_pre_grad_passes_still_reports_them():
    from torch.fx.experimental.proxy_tensor import make_fx

    pipeline = Pipeline(load_config({}), get_plugins(), [AtPreGrad()])
    patches = pipeline.inductor_patches()
    assert list(patches) == ["post_grad_custom_post_pass"]
    gm = make_fx(lambda x: torch.relu(x) + 1, tracing_mode="fake")(torch.randn(4))
    patches["post_grad_custom_post_pass"](gm.graph)
    report = pipeline.reports[-1]
    assert (
        report["rec_pre_grad"].status == "skipped" and "not run by this host" in report["rec_pre_grad"].reason
    )
    assert SEEN == []


def test_a_warm_start_restores_joint_and_forward_reports_beside_a_fresh_pre_grad_one():
    import torch._functorch.config
    import torch._inductor.config
    from torch._inductor.utils import fresh_cache

    passes = (TanhToSigmoidForm, AtJoint, AtPost)
    with (
        fresh_cache(),
        torch._inductor.config.patch(fx_graph_cache=True),
        torch._functorch.config.patch(enable_autograd_cache=True),
    ):
        cold = make_backend(*(p() for p in passes))
        _train(cold)
        torch._dynamo.reset()
        SEEN.clear()
        warm = make_backend(*(p() for p in passes))
        _train(warm)
    cold_kinds = [(r.graph_kind, r.cache_hit) for r in cold.reports]
    assert cold_kinds == [("training", False), ("backward", False)]  # the backward compiles later
    warm_report = warm.reports[0]  # the pre-grad records of this compile, the others restored
    assert warm_report.cache_hit and warm_report.restored
    assert warm_report["tanh_as_sigmoid"].matches == 1
    assert [(r.graph_kind, r.status) for r in warm_report.records] == [
        ("torch", "ran"),
        ("joint", "ran"),
        ("forward", "ran"),
    ]
    assert "the pre_grad stage(s) ran in this compile" in warm_report.notes[-1]


PLATFORM_COMPILER = """
RECEIVED = []


def compile_graph(gm, example_inputs):
    RECEIVED.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
    return gm


NOT_CALLABLE = 3
"""


def test_the_config_names_the_compiler_for_the_named_backend(clean_env, monkeypatch):
    """``compiler`` in the config (here ``PASSKIT_COMPILER``): a platform's compiler by import
    path, used by ``backend="passkit"`` and ``passkit.backend()`` where Python names none;
    Python's ``compiler=`` wins; a bad path is a ConfigError naming the key."""
    (clean_env / "platform_compiler.py").write_text(PLATFORM_COMPILER)
    monkeypatch.syspath_prepend(str(clean_env))
    import platform_compiler

    monkeypatch.setenv("PASSKIT_COMPILER", "platform_compiler:compile_graph")
    monkeypatch.setenv("PASSKIT_PASSES", "")
    passkit._compile.backend._default_backend.cache_clear()  # the named backend reads the config anew
    try:
        _train("passkit")
    finally:
        passkit._compile.backend._default_backend.cache_clear()
    forward, backward = platform_compiler.RECEIVED
    assert "aten.tanh.default" in forward and "aten.where.self" in backward  # relu's backward
    built = passkit.backend()
    assert built.compiler is platform_compiler.compile_graph and built.mode == "eager"
    assert passkit.backend(compiler="inductor").compiler == "inductor"  # Python wins
    monkeypatch.setenv("PASSKIT_COMPILER", "aot_eager")
    assert passkit.backend().compiler == "aot_eager"
    for spec, says in [
        ("tvm", "neither one of ['inductor', 'aot_eager'] nor 'package.module:name'"),
        ("no_such_module_xyz:fn", "cannot import 'no_such_module_xyz:fn' (ModuleNotFoundError"),
        ("platform_compiler:missing", "cannot import 'platform_compiler:missing' (AttributeError"),
        ("platform_compiler:NOT_CALLABLE", "is a int, not a compiler callable"),
    ]:
        monkeypatch.setenv("PASSKIT_COMPILER", spec)
        # the error names where the bad value came from: the environment variable and its key
        with pytest.raises(passkit.ConfigError, match=r"^PASSKIT_COMPILER \(compiler\): ") as err:
            passkit.backend()
        assert says in str(err.value), str(err.value)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_a_training_compile_with_only_pre_grad_passes_is_titled_training(compiler):
    """Passes at pre_grad only, in training: one report, titled ``training graph`` with a note
    saying why no backward report follows (the pass ran once, before autograd); the same
    compile under ``no_grad`` stays a ``torch graph``."""
    backend = make_backend(TanhToSigmoidForm(), compiler=compiler)
    _train(backend)
    (report,) = backend.reports
    assert [(r.name, r.stage, r.graph_kind, r.matches) for r in report.records] == [
        ("tanh_as_sigmoid", "pre_grad", "torch", 1)
    ]
    assert report.graph_kind == "training"
    assert "training graph" in report.format().splitlines()[0]
    assert "no backward report follows" in report.format()

    torch._dynamo.reset()
    inference = make_backend(TanhToSigmoidForm(), compiler=compiler)
    x, w = inputs(grad=False)
    with torch.no_grad():
        torch.compile(fn, backend=inference)(x, w)
    (report,) = inference.reports
    assert report.graph_kind == "torch" and "no backward report" not in report.format()
