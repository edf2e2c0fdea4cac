"""torch.compile's modes and options through passkit, and what a compile costs.

* ``mode=`` and ``options=`` reach every compile (each token-range specialization too) as
  they would with ``backend="inductor"``: the passes observe Inductor's config while they run.
* Passkit's custom-pass slots are composed with a user's pass, never overwritten; an option
  set twice with different values, an unknown option or mode are named errors.
* The token axis is cut only where a pass that can run in this context changes; passes
  acting on another's rewrite (``depends_on``) and passes whose sites an earlier pass takes
  (``shares_sites_with``) merge ranges.
* ``compile_at``: every specialization at the first call, or each at first use.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch._inductor.config as inductor_config

import passkit
from passkit import PassResult, Requirements, TokenConstraint
from passkit._pipeline.build import Pipeline
from passkit._pipeline.dump import graph_folder
from passkit._plugins.registry import get_plugins
from passkit.config import load_config
from passkit.errors import ConfigError
from passkit.tokens import PassRelations, TokenRange, plan_specializations

from .test_ranges import EvenTanh, Everywhere, SmallRelu, expected, model


class SeesConfig(passkit.GraphPass):
    """Records the Inductor settings in force while it runs (inside ``compile_fx``)."""

    name = "sees_config"
    seen: list[dict] = []

    def run(self, gm, ctx):
        SeesConfig.seen.append(
            {
                "cudagraphs": inductor_config.triton.cudagraphs,
                "max_autotune": inductor_config.max_autotune,
                "coordinate_descent_tuning": inductor_config.coordinate_descent_tuning,
                "epilogue_fusion": inductor_config.epilogue_fusion,
                "range": str(ctx.token_range) if ctx.token_range else None,
            }
        )
        return PassResult()


def make_backend(*passes: passkit.Pass, **config) -> passkit.Backend:
    return passkit.Backend(pipeline=Pipeline(load_config(config), get_plugins(), list(passes)))


@pytest.fixture(autouse=True)
def _fresh():
    SeesConfig.seen = []
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


MODES = {
    "reduce-overhead": {"cudagraphs": True, "max_autotune": False},
    "max-autotune-no-cudagraphs": {"cudagraphs": False, "max_autotune": True},
    "default": {"cudagraphs": False, "max_autotune": False},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_reaches_every_specialization(mode):
    b = make_backend(SmallRelu(), SeesConfig())
    f = torch.compile(model, backend=b, mode=mode, dynamic=True)
    for n in (3, 40):
        x = torch.randn(n, 4)
        want = torch.relu(x) + torch.tanh(x) * 2 + torch.cos(x)
        if n <= 16:
            want = torch.sigmoid(x) + torch.tanh(x) * 2 + torch.cos(x)
        torch.testing.assert_close(f(x), want)
    seen = {s["range"]: (s["cudagraphs"], s["max_autotune"]) for s in SeesConfig.seen}
    expect = (MODES[mode]["cudagraphs"], MODES[mode]["max_autotune"])
    assert seen == {"tokens 1..16": expect, "tokens >= 17": expect}
    assert inductor_config.triton.cudagraphs is False  # patched per compile, never globally


def test_options_reach_the_compile_and_the_named_backend_takes_them(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    b = make_backend(SeesConfig())
    f = torch.compile(model, backend=b, options={"epilogue_fusion": False, "max_autotune": True})
    x = torch.randn(5, 4)
    torch.testing.assert_close(f(x), torch.relu(x) + torch.tanh(x) * 2 + torch.cos(x))
    assert SeesConfig.seen[-1]["epilogue_fusion"] is False and SeesConfig.seen[-1]["max_autotune"] is True

    # the named backend accepts mode/options (config from the environment: no pass enabled)
    monkeypatch.setenv("PASSKIT_PASSES", "noop_elimination")
    from passkit._compile.backend import _default_backend

    _default_backend.cache_clear()
    try:
        g = torch.compile(model, backend="passkit", mode="max-autotune-no-cudagraphs")
        torch.testing.assert_close(g(x), torch.relu(x) + torch.tanh(x) * 2 + torch.cos(x))
        assert passkit.last_report() is not None and "noop_elimination" in passkit.last_report()
    finally:
        _default_backend.cache_clear()


def test_a_users_custom_pass_is_composed_not_overwritten():
    calls = []

    def user_pass(graph: torch.fx.Graph) -> None:
        calls.append(len(graph.nodes))

    b = make_backend(SeesConfig())
    f = torch.compile(model, backend=b, options={"post_grad_custom_post_pass": user_pass})
    f(torch.randn(5, 4))
    assert calls and SeesConfig.seen, "both the user's pass and passkit's ran"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"mode": "reduce_overhead"},
            "mode='reduce_overhead' is not a mode (did you mean 'reduce-overhead'?)",
        ),
        (
            {"options": {"max_autotun": True}},
            "'max_autotun' is not an Inductor option (did you mean 'max_autotune'",
        ),
        ({"options": {"max_autotune": "yes"}}, "Unexpected type of attr max_autotune"),
        ({"options": {"post_grad_custom_post_pass": 3}}, "holds 3, not a graph pass"),
        (
            {"options": {"epilogue_fusion": True}},
            "'epilogue_fusion' is set twice: torch.compile(options=...) gives True",
        ),
    ],
)
def test_bad_modes_and_options_are_named(kwargs, message):
    b = passkit.Backend(
        pipeline=Pipeline(load_config({}), get_plugins(), [SeesConfig()]),
        inductor_config={"epilogue_fusion": False},
    )
    gm = torch.fx.symbolic_trace(model)
    with pytest.raises(ConfigError) as err:
        b(gm, [torch.randn(4, 4)], **kwargs)
    assert message in str(err.value)


def test_eager_mode_refuses_inductor_modes_by_name():
    b = passkit.backend(passes=["noop_elimination"], mode="eager")
    gm = torch.fx.symbolic_trace(model)
    with pytest.raises(ConfigError, match="does not run"):
        b(gm, [torch.randn(4, 4)], mode="reduce-overhead")


def test_a_bad_option_out_of_torch_compile_is_passkits_config_error():
    """docs/configuration.md: passkit's own ConfigError, not Dynamo's BackendCompilerFailed
    wrapping it, through torch.compile of a ``passkit.backend(...)`` object."""
    compiled = torch.compile(
        model, backend=passkit.backend(passes=["cleanup"]), options={"max_autotun": True}
    )
    with pytest.raises(ConfigError) as err:
        compiled(torch.randn(4, 4))
    assert not isinstance(err.value, torch._dynamo.exc.BackendCompilerFailed)
    assert "'max_autotun' is not an Inductor option (did you mean 'max_autotune'" in str(err.value)


# ------------------------------------------------------------------------ fewer cuts


class NeedsTwoRanks(SmallRelu):
    """Only useful at world size >= 2: at world size 1 its bounds must not cut the axis."""

    name = "needs_two_ranks"
    requires = Requirements(min_world_size=2)


def test_a_pass_that_cannot_run_here_does_not_cut_the_token_axis():
    b = make_backend(NeedsTwoRanks(), Everywhere())
    f = torch.compile(model, backend=b, dynamic=True)
    for n in (3, 40):
        f(torch.randn(n, 4))
    assert b.last_dispatcher is None and len(b.reports) == 1
    report = b.reports[0]
    assert report.token_range is None
    assert report["needs_two_ranks"].reason == "needs world size >= 2 (got 1)"
    assert report.compile_s is not None and report.compile_s > 0


class Rewrites(SmallRelu):
    """Stands for sequence_parallel: makes the sites a dependent pass acts on."""

    name = "rewrites"
    tokens = TokenConstraint(min_tokens=8, multiple_of=2)
    source, target = torch.ops.aten.tanh.default, torch.ops.aten.neg.default


class ActsOnRewrite(passkit.GraphPass):
    """Stands for async_tp: acts on what ``rewrites`` made (neg -> abs∘neg, visible)."""

    name = "acts_on_rewrite"
    depends_on = ("rewrites",)
    tokens = TokenConstraint(min_tokens=8)
    runs: list[str] = []

    def run(self, gm, ctx):
        ActsOnRewrite.runs.append(str(ctx.token_range))
        return PassResult(matches=1)


class SameSites(SmallRelu):
    """Stands for allreduce_rmsnorm, whose sites sequence_parallel rewrites too."""

    name = "same_sites"
    tokens = TokenConstraint(max_tokens=32)


class RewritesSameSites(Rewrites):
    name = "rewrites"
    shares_sites_with = ("same_sites",)


SERVING = {  # the world-2 H200 serving config's constraints, in its pass order
    "rewrites": TokenConstraint(min_tokens=2048, multiple_of=2),  # sequence_parallel
    "acts_on_rewrite": TokenConstraint(min_tokens=2048),  # async_tp
    "same_sites": TokenConstraint(max_tokens=4096),  # allreduce_rmsnorm
}
RELATIONS = PassRelations(
    depends_on={"acts_on_rewrite": ("rewrites",)},
    shares_sites={"rewrites": ("same_sites",), "same_sites": ("rewrites",)},
)


def test_plan_merges_ranges_a_dependent_or_site_sharing_pass_would_split():
    plain, _ = plan_specializations(SERVING)
    assert len(plain) == 5  # what the world-2 serving config compiled before
    specs, rules = plan_specializations(SERVING, relations=RELATIONS)
    assert [(s.passes, s.label) for s in specs] == [
        (("same_sites",), "tokens 1..4096"),  # and the odd counts of 2048..4096
        (("rewrites", "acts_on_rewrite"), "tokens >= 2048, multiples of 2"),
        ((), "tokens >= 4097"),
    ]
    left = dict(specs[0].left_out)
    assert "acts on the rewrite of rewrites, which does not run here" in left["acts_on_rewrite"]
    taken = dict(specs[1].left_out)["same_sites"]
    assert "its sites are taken by rewrites, which runs first here" in taken
    # the dispatch table has no rule that changes nothing
    assert [(r.lo, r.hi, r.divisors) for r in rules] == [
        (1, 2047, ()),
        (2048, 4096, (2,)),
        (4097, None, (2,)),
    ]


def test_the_configured_order_decides_who_takes_shared_sites():
    reordered = {name: SERVING[name] for name in ("same_sites", "rewrites", "acts_on_rewrite")}
    specs, _ = plan_specializations(reordered, relations=RELATIONS)
    assert [(s.passes, s.label) for s in specs] == [
        (("same_sites",), "tokens 1..4096"),
        (("rewrites", "acts_on_rewrite"), "tokens >= 4097, multiples of 2"),
        ((), "tokens >= 4097"),
    ]


def test_dependent_and_site_sharing_passes_at_run_time():
    ActsOnRewrite.runs = []
    b = make_backend(RewritesSameSites(), ActsOnRewrite(), SameSites())
    f = torch.compile(lambda x: torch.relu(x) + torch.tanh(x) * 2, backend=b, dynamic=True)
    for n in (3, 9, 10, 40, 41):
        x = torch.randn(n, 4)
        first = torch.sigmoid(x) if n <= 32 and not (n >= 8 and n % 2 == 0) else torch.relu(x)
        second = -x if n >= 8 and n % 2 == 0 else torch.tanh(x)
        torch.testing.assert_close(f(x), first + second * 2, msg=f"{n} tokens")
    labels = sorted(r.token_range for r in b.reports)
    assert labels == ["tokens 1..32", "tokens >= 33", "tokens >= 8, multiples of 2"]
    assert ActsOnRewrite.runs == ["tokens >= 8, multiples of 2"]
    even = next(r for r in b.reports if r.token_range == "tokens >= 8, multiples of 2")
    assert "its sites are taken by rewrites" in even["same_sites"].reason


def test_a_dependent_pass_skips_a_graph_its_dependency_left_unchanged():
    ActsOnRewrite.runs = []
    b = make_backend(Rewrites(), ActsOnRewrite())
    f = torch.compile(lambda x: torch.relu(x) * 2, backend=b, dynamic=True)  # no tanh: nothing to rewrite
    f(torch.randn(10, 4))
    f(torch.randn(11, 4))
    even = next(r for r in b.reports if r.token_range == "tokens >= 8, multiples of 2")
    assert even["rewrites"].status == "ran" and not even["rewrites"].modified
    assert (
        even["acts_on_rewrite"].reason == "acts on the rewrite of rewrites, which did not change this graph"
    )
    assert ActsOnRewrite.runs == []


def test_depends_on_orders_the_passes():
    from passkit.errors import OrderError

    with pytest.raises(OrderError, match="acts_on_rewrite declares depends_on"):
        make_backend(ActsOnRewrite(), Rewrites())


# ------------------------------------------------------------------------ when ranges compile


@pytest.mark.parametrize("compile_at", ["upfront", "first_use"])
def test_compile_at_first_call_or_first_use(compile_at, tmp_path):
    b = make_backend(SmallRelu(), EvenTanh(), Everywhere(), compile_at=compile_at, dump_dir=str(tmp_path))
    f = torch.compile(model, backend=b, dynamic=True)
    x = torch.randn(3, 4)
    torch.testing.assert_close(f(x), expected(x))
    dispatcher = b.last_dispatcher
    assert dispatcher is not None and len(dispatcher.plan.specializations) == 4
    assert dispatcher.compiled_count == (4 if compile_at == "upfront" else 1)
    for n in (8, 9, 17, 18, 64, 65, 2):
        x = torch.randn(n, 4)
        torch.testing.assert_close(f(x), expected(x), msg=f"{n} tokens")
    assert dispatcher.compiled_count == 4 and len(b.reports) == 4
    for report in b.reports:
        assert report.compile_s is not None and report.compile_s > 0
        saved = json.loads((graph_folder(tmp_path, report.graph_id) / "report.json").read_text())
        assert saved["compile_s"] == report.compile_s and saved["token_range"] == report.token_range
        assert "whole compile" in report.format()


def test_compile_at_is_validated_and_read_from_the_environment(monkeypatch):
    with pytest.raises(ConfigError, match="compile_at"):
        load_config({"compile_at": "later"})
    monkeypatch.setenv("PASSKIT_COMPILE_AT", "first_use")
    assert load_config({}).compile_at == "first_use"


def test_a_framework_range_applies_dependencies_too():
    """passkit.install + compile_range (a framework's own ranges): the same relations."""
    pipeline = Pipeline(load_config({}), get_plugins(), [RewritesSameSites(), ActsOnRewrite(), SameSites()])
    gm = torch.fx.symbolic_trace(lambda x: torch.tanh(x))
    from passkit.context import CompileContext

    small = pipeline.for_range(TokenRange(1, 7))
    skips = small._range_skips(CompileContext.from_graph(gm, token_range=TokenRange(1, 7)))
    assert set(skips) == {"rewrites", "acts_on_rewrite"}
    big = pipeline.for_range(TokenRange(8, 32, 2))
    skips = big._range_skips(CompileContext.from_graph(gm, token_range=TokenRange(8, 32, 2)))
    assert list(skips) == ["same_sites"] and skips["same_sites"].startswith("its sites are taken by rewrites")
