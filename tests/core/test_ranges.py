"""Token-range specialization: passes declare where they apply, the backend compiles one
specialization per distinct set of passes and dispatches each call by its token count."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

import passkit
from passkit import TokenConstraint, TokenRange
from passkit._pipeline.build import Pipeline
from passkit._plugins.registry import get_plugins
from passkit.config import load_config
from passkit.errors import ConfigError
from passkit.tokens import PassRelations, plan_specializations, plan_static, split

from .test_integration import ROOT, _env

aten = torch.ops.aten


class _OpSwap(passkit.GraphPass):
    """Swap one ATen op for another (a visible rewrite: the numerics say where it ran)."""

    source: object = None
    target: object = None

    def run(self, gm, ctx):
        n = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=self.source)):
            node.target = self.target
            n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


class SmallRelu(_OpSwap):
    """relu -> sigmoid, only up to 16 tokens."""

    name = "small_relu"
    tokens = TokenConstraint(max_tokens=16)
    source, target = aten.relu.default, aten.sigmoid.default


class EvenTanh(_OpSwap):
    """tanh -> neg, only for even token counts from 8 on (a divisibility rule)."""

    name = "even_tanh"
    tokens = TokenConstraint(min_tokens=8, multiple_of=2)
    source, target = aten.tanh.default, aten.neg.default


class Everywhere(_OpSwap):
    name = "everywhere"
    source, target = aten.cos.default, aten.sin.default


def model(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) + torch.tanh(x) * 2 + torch.cos(x)


def expected(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    first = torch.sigmoid(x) if n <= 16 else torch.relu(x)
    second = -x if n >= 8 and n % 2 == 0 else torch.tanh(x)
    return first + second * 2 + torch.sin(x)


def backend(*passes: passkit.Pass, mode: str = "inductor", **config) -> passkit.Backend:
    pipeline = Pipeline(load_config(config), get_plugins(), list(passes))
    return passkit.Backend(pipeline=pipeline, mode=mode)


def compiled(b: passkit.Backend):
    return torch.compile(model, backend=b, dynamic=True)


# ------------------------------------------------------------------------ arithmetic


def test_split_cuts_after_each_end():
    assert split([16, 256]) == [TokenRange(1, 16), TokenRange(17, 256), TokenRange(257, None)]
    assert split([]) == [TokenRange(1, None)]
    assert str(TokenRange(17, 256)) == "tokens 17..256"
    assert str(TokenRange(2049)) == "tokens >= 2049"
    assert str(TokenRange(8, None, 2)) == "tokens >= 8, multiples of 2"


def test_equal_pass_sets_share_one_specialization():
    specs, rules = plan_specializations({"a": TokenConstraint(17, 256), "b": None})
    assert [(s.passes, s.label) for s in specs] == [
        (("b",), "tokens 1..16; tokens >= 257"),
        (("a", "b"), "tokens 17..256"),
    ]
    assert [(r.lo, r.hi, r.choice) for r in rules] == [
        (1, 16, {(): 0}),
        (17, 256, {(): 1}),
        (257, None, {(): 0}),
    ]


def test_user_ranges_always_compile_apart_and_divisors_pick_variants():
    specs, rules = plan_specializations(
        {"small": TokenConstraint(max_tokens=16), "even": TokenConstraint(multiple_of=4)}, [100]
    )
    labels = [(s.passes, s.label, s.divisible_by) for s in specs]
    assert labels == [
        (("small", "even"), "tokens 1..16, multiples of 4", (4,)),
        (("small",), "tokens 1..16", ()),
        (("even",), "tokens 17..100, multiples of 4", (4,)),
        ((), "tokens 17..100", ()),
        (("even",), "tokens >= 101, multiples of 4", (4,)),
        ((), "tokens >= 101", ()),
    ]
    assert rules[0].divisors == (4,) and rules[0].choice == {(True,): 0, (False,): 1}


def test_a_static_count_leaves_out_the_passes_that_do_not_admit_it():
    constraints = {
        "small": TokenConstraint(max_tokens=16),
        "even": TokenConstraint(min_tokens=8, multiple_of=2),
        "first": None,
        "second": None,
    }
    relations = PassRelations(shares_sites={"first": ("second",), "second": ("first",)})
    assert plan_static(constraints, 8, relations) == {
        "second": "its sites are taken by first, which runs first here (static tokens 8)"
    }
    assert plan_static(constraints, 9) == {
        "even": "static tokens 9 is not a multiple of 2 (its range: tokens >= 8, multiples of 2)"
    }
    assert plan_static(constraints, 40) == {"small": "static tokens 40 outside its range tokens 1..16"}
    assert list(plan_static(constraints, 1)) == ["even"]
    assert list(plan_static(constraints, 0)) == ["small", "even"]  # no constrained pass below 1


def test_impossible_divisibility_outcomes_compile_nothing():
    specs, _ = plan_specializations(
        {"by2": TokenConstraint(multiple_of=2), "by4": TokenConstraint(multiple_of=4)}
    )
    # a multiple of 4 is always a multiple of 2: three outcomes, not four
    assert sorted(s.passes for s in specs) == [(), ("by2",), ("by2", "by4")]


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (TokenConstraint(min_tokens=0), "min_tokens must be a positive integer, got 0"),
        (TokenConstraint(max_tokens=-3), "max_tokens must be a positive integer, got -3"),
        (TokenConstraint(multiple_of=0), "multiple_of must be a positive integer, got 0"),
        (
            TokenConstraint(min_tokens=32, max_tokens=16),
            "token constraint is empty: min_tokens=32 > max_tokens=16",
        ),
        (
            TokenConstraint(min_tokens=5, max_tokens=7, multiple_of=8),
            "no token count in 5..7 is a multiple of it",
        ),
        (TokenConstraint(max_tokens=2.5), "max_tokens must be a positive integer, got 2.5"),  # type: ignore[arg-type]
    ],
)
def test_bad_constraints_name_the_pass_and_the_field(constraint, message):
    class Bad(SmallRelu):
        name = "bad_range"
        tokens = constraint

    bad = Bad()  # a plugin's bug: isolated (the pass does not run), named
    assert bad.checked_token_constraint(passkit.CompileContext()) is None
    assert isinstance(bad.code_failure, passkit.PassCodeError)
    assert "token_constraint() returned an invalid constraint: pass 'bad_range': token constraint" in str(
        bad.code_failure
    )
    assert message in str(bad.code_failure)


def test_a_constraint_method_must_return_a_constraint():
    class Wrong(SmallRelu):
        name = "wrong_range"

        def token_constraint(self, ctx):
            return (1, 16)

    wrong = Wrong()
    assert wrong.checked_token_constraint(passkit.CompileContext()) is None
    assert "pass 'wrong_range' (" in str(wrong.code_failure)
    assert "token_constraint() must return a passkit.TokenConstraint or None, got tuple" in str(
        wrong.code_failure
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([16, 8], "boundaries must be strictly increasing"),
        ([16, 16], "boundaries must be strictly increasing"),
        ([0, 16], "every boundary must be a positive integer (not 0)"),
        (["a"], "compile_ranges"),
    ],
)
def test_bad_compile_ranges_are_config_errors(value, message):
    with pytest.raises(ConfigError, match="compile_ranges") as info:
        load_config({"compile_ranges": value})
    assert message in str(info.value)


def test_compile_ranges_from_the_environment(clean_env, monkeypatch):
    monkeypatch.setenv("PASSKIT_COMPILE_RANGES", "16, 256")
    assert load_config().compile_ranges == [16, 256]
    monkeypatch.setenv("PASSKIT_COMPILE_RANGES", "16,x")
    with pytest.raises(ConfigError, match="PASSKIT_COMPILE_RANGES='16,x': expected integers"):
        load_config()


def test_compile_range_rejects_bad_bounds():
    with pytest.raises(ConfigError, match=r"compile_range: empty range 9\.\.3"), passkit.compile_range(9, 3):
        pass
    with (
        pytest.raises(ConfigError, match="compile_range: lo must be a positive integer"),
        passkit.compile_range(0),
    ):
        pass


# ------------------------------------------------------------------------ compiled modules


@pytest.mark.parametrize("mode", ["inductor", "eager"])
def test_each_pass_runs_only_in_its_range_and_numerics_match(mode):
    b = backend(SmallRelu(), EvenTanh(), Everywhere(), mode=mode)
    f = compiled(b)
    sizes = [2, 3, 7, 8, 9, 15, 16, 17, 18, 31, 64, 65]  # every range and both sides of each bound
    for n in sizes:
        x = torch.randn(n, 4)
        torch.testing.assert_close(f(x), expected(x), msg=f"{n} tokens")
    by_range = {r.token_range: {rec.name: rec.status for rec in r.records} for r in b.reports}
    assert by_range == {
        # 1..7 and the odd counts of 8..16: one pass set, one compile
        "tokens 1..16": {"small_relu": "ran", "even_tanh": "skipped", "everywhere": "ran"},
        "tokens 8..16, multiples of 2": {"small_relu": "ran", "even_tanh": "ran", "everywhere": "ran"},
        "tokens >= 17, multiples of 2": {"small_relu": "skipped", "even_tanh": "ran", "everywhere": "ran"},
        "tokens >= 17": {"small_relu": "skipped", "even_tanh": "skipped", "everywhere": "ran"},
    }
    # each specialization compiled once: four reports for four pass sets
    assert len(b.reports) == 4
    skipped = next(r for r in b.reports if r.token_range == "tokens >= 17")["small_relu"]
    assert skipped.reason == "applies to tokens 1..16; this compile serves tokens >= 17"
    dispatcher = b.last_dispatcher
    assert dispatcher is not None
    served = {
        n: dispatcher.plan.specializations[dispatcher.index_for(n)].label for n in (3, 8, 9, 16, 17, 18)
    }
    assert served == {
        3: "tokens 1..16",
        8: "tokens 8..16, multiples of 2",
        9: "tokens 1..16",
        16: "tokens 8..16, multiples of 2",
        17: "tokens >= 17",
        18: "tokens >= 17, multiples of 2",
    }
    assert dispatcher.index_for(0) is None  # no range: the fallback compile


def test_equal_pass_sets_compile_once_and_mixed_sizes_never_recompile():
    b = backend(SmallRelu(), Everywhere(), compile_ranges=[64, 1024], compile_at="upfront")
    f = compiled(b)
    f(torch.randn(5, 4))
    assert sorted(r.token_range for r in b.reports) == [
        "tokens 1..16",
        "tokens 17..64",
        "tokens 65..1024",
        "tokens >= 1025",
    ]
    counters.clear()
    sizes = [(7 * i) % 1500 + 2 for i in range(50)]
    for n in sizes:
        x = torch.randn(n, 4)
        first = torch.sigmoid(x) if n <= 16 else torch.relu(x)
        torch.testing.assert_close(f(x), first + torch.tanh(x) * 2 + torch.sin(x))
    assert counters["stats"]["unique_graphs"] == 0, "a call re-traced"
    assert len(b.reports) == 4, "a call compiled again"


def test_no_declared_range_compiles_once_as_before():
    b = backend(Everywhere())
    f = compiled(b)
    for n in (3, 40):
        f(torch.randn(n, 4))
    (report,) = b.reports
    assert report.token_range is None and b.last_dispatcher is None


@pytest.mark.parametrize(
    ("tokens", "mode", "small_relu", "even_tanh"),
    [
        (8, "eager", None, None),  # inside both ranges
        (9, "eager", None, "static tokens 9 is not a multiple of 2 (its range: tokens >= 8, multiples of 2)"),
        (4, "eager", None, "static tokens 4 outside its range tokens >= 8, multiples of 2"),
        (40, "inductor", "static tokens 40 outside its range tokens 1..16", None),
    ],
)
def test_static_shapes_run_each_pass_only_if_its_constraint_admits_the_count(
    tokens, mode, small_relu, even_tanh
):
    """A graph compiled with static shapes serves one token count: each pass's constraint
    is checked against it (bounds and multiple_of), as the ranges of a dynamic graph are."""
    b = backend(SmallRelu(), EvenTanh(), Everywhere(), mode=mode)
    f = torch.compile(model, backend=b, dynamic=False)
    x = torch.randn(tokens, 4)
    torch.testing.assert_close(f(x), expected(x))
    (report,) = b.reports
    assert report.token_range == f"tokens = {tokens} (static shapes)"
    for name, reason in (("small_relu", small_relu), ("even_tanh", even_tanh), ("everywhere", None)):
        assert (report[name].status, report[name].reason) == ("ran" if reason is None else "skipped", reason)
    (note,) = report.notes
    assert f"it serves tokens = {tokens} (static shapes) (token count from input 0, dim 0)" in note
    assert f"a pass whose token constraint does not admit {tokens} is skipped" in note
    assert b.last_dispatcher is None  # one compile, no dispatch


def test_dynamos_1_token_recompile_applies_the_constraints_to_1_token():
    """After a dynamic compile, a call with 1 token makes Dynamo compile again with static
    shapes (it specializes size 1): that graph serves 1 token, and a pass from 8 up skips."""
    b = backend(SmallRelu(), EvenTanh(), mode="eager")
    f = torch.compile(model, backend=b)
    for tokens in (10, 1):
        x = torch.randn(tokens, 4)
        if tokens > 1:
            torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(f(x), expected(x) - torch.sin(x) + torch.cos(x))
    one = next(r for r in b.reports if r.token_range == "tokens = 1 (Dynamo's 1-token recompile)")
    assert one["small_relu"].status == "ran"
    assert one["even_tanh"].reason == "static tokens 1 outside its range tokens >= 8, multiples of 2"


@pytest.mark.parametrize(
    ("x", "why"),
    [
        (torch.tensor(3.0), "no tensor input besides parameters and buffers"),
        (
            torch.randn(2, 8, 4),  # (batch, seq, hidden)? (tokens, heads, head_dim)?
            "input 0, the first that is not a parameter, has shape (2, 8, 4): which of its "
            "dimensions counts the tokens is not known (config token_dim names it)",
        ),
    ],
)
def test_a_static_graph_without_a_clear_token_count_runs_every_pass_and_says_so(x, why):
    b = backend(SmallRelu(), mode="eager")
    f = torch.compile(lambda x: torch.relu(x) * 2, backend=b, dynamic=False)
    torch.testing.assert_close(f(x), torch.sigmoid(x) * 2)
    (report,) = b.reports
    assert report.token_range is None
    assert report["small_relu"].status == "ran"
    assert report.notes == [
        f"no dynamic token dimension in the graph's inputs and no static token count: {why}; "
        "compiled once, every pass runs: token ranges (compile_ranges, passes' token "
        "constraints) are not applied"
    ]


def test_a_static_token_count_is_read_where_token_dim_says():
    def two_inputs(a, b):
        return torch.relu(a) + b.sum()

    a, other = torch.randn(40, 4), torch.randn(8, 4)
    for config, status in (({}, "skipped"), ({"token_dim": {"input": 1, "dim": 0}}, "ran")):
        b = backend(SmallRelu(), mode="eager", **config)
        torch.compile(two_inputs, backend=b, dynamic=False)(a, other)
        (report,) = b.reports
        assert report["small_relu"].status == status, config
    assert report.token_range == "tokens = 8 (static shapes)"
    assert "(token count from input 1, dim 0 (config token_dim))" in report.notes[0]


@pytest.mark.parametrize(
    ("shape", "dim"),
    [((1, 40), 1), ((40, 1), 0), ((2, 20), None)],  # one sequence; one token of 40; ambiguous
)
def test_a_static_token_count_is_read_from_token_ids_with_one_dimension_above_1(shape, dim):
    embed = torch.nn.Embedding(16, 4)
    b = backend(SmallRelu(), mode="eager")
    ids = torch.randint(0, 16, shape)
    torch.compile(lambda ids: torch.relu(embed(ids)), backend=b, dynamic=False)(ids)
    (report,) = b.reports
    if dim is None:  # batch and sequence: which counts the tokens is not known
        assert report.token_range is None and report["small_relu"].status == "ran"
        assert f"has shape {shape}: which of its dimensions counts the tokens" in report.notes[0]
        return
    assert report.token_range == "tokens = 40 (static shapes)"
    assert f"(token count from input 1, dim {dim} (token ids))" in report.notes[0]
    assert report["small_relu"].reason == "static tokens 40 outside its range tokens 1..16"


def test_an_explicit_token_dim_is_used_and_checked():
    def two_inputs(a, b):
        return torch.relu(a) + b.sum()

    b = backend(SmallRelu(), token_dim={"input": 1, "dim": 0})
    f = torch.compile(two_inputs, backend=b, dynamic=True)
    a = torch.randn(40, 4)
    for tokens in (8, 30):  # read from input 1 (input 0 has 40 rows throughout)
        other = torch.randn(tokens, 4)
        first = torch.sigmoid(a) if tokens <= 16 else torch.relu(a)
        torch.testing.assert_close(f(a, other), first + other.sum())
    assert b.last_dispatcher.plan.token_dim.how.startswith("size argument")
    bad = backend(SmallRelu(), token_dim={"input": 5, "dim": 0})
    with pytest.raises(Exception, match=r"token_dim.input=5: the graph has 2 tensor input"):
        torch.compile(two_inputs, backend=bad, dynamic=True)(a, torch.randn(8, 4))


def test_install_with_a_framework_given_range():
    import torch._inductor.config as inductor_config

    passkit.register(_plugin(SmallRelu, Everywhere))
    patches: dict = {}
    pipeline = passkit.install(patches, passes=["small_relu", "everywhere"])
    x = torch.randn(40, 4)
    with inductor_config.patch(patches):
        for lo, hi in ((1, 16), (17, None)):
            torch._dynamo.reset()
            with passkit.compile_range(lo, hi):
                uuid = patches["post_grad_custom_post_pass"].uuid()
                torch.compile(model, dynamic=True)(x)
            assert uuid != pipeline.uuid()
    small, large = pipeline.reports[-2:]
    assert (small.token_range, small["small_relu"].status) == ("tokens 1..16", "ran")
    assert (large.token_range, large["small_relu"].status) == ("tokens >= 17", "skipped")
    fixed: dict = {}
    fixed_pipeline = passkit.install(fixed, passes=["small_relu"], token_range=(17, 256))
    assert fixed_pipeline.token_range == TokenRange(17, 256)


def _plugin(*classes):
    class Plugin:
        @passkit.hookimpl
        def passkit_register_passes(self):
            return list(classes)

    return Plugin()


def test_the_range_is_part_of_the_cache_identity():
    base = Pipeline(load_config({}), get_plugins(), [SmallRelu()])
    assert base.for_range(TokenRange(1, 16)).uuid() != base.for_range(TokenRange(17, None)).uuid()
    assert base.for_range(TokenRange(1, 16)).uuid() == base.for_range(TokenRange(1, 16)).uuid()

    class Wider(SmallRelu):
        tokens = TokenConstraint(max_tokens=32)

    assert Pipeline(load_config({}), get_plugins(), [Wider()]).uuid() != base.uuid()


@pytest.mark.slow  # two fresh processes compiling with Inductor: 100-140 s each on 2 cores
@pytest.mark.parametrize("aot_cache", [False, True], ids=["FX graph cache", "and AOTAutograd's"])
def test_fx_graph_cache_hits_per_range_in_a_fresh_process(tmp_path, aot_cache: bool):
    env = _env(
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"),
        TORCHINDUCTOR_FX_GRAPH_CACHE="1",
        TORCHINDUCTOR_AUTOGRAD_CACHE="1" if aot_cache else "0",
        PASSKIT_CACHE_DIR=str(tmp_path / "reports"),
    )

    def run():
        out = subprocess.run(
            [sys.executable, "-m", "tests.core.range_probe"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert (cold["miss"], cold["hit"]) == (2, 0)
    assert (warm["miss"], warm["hit"]) == (0, 2)
    assert warm["out"] == cold["out"]
    # warm reports are as readable as cold ones: each names its range and what ran there
    assert warm["reports"] == cold["reports"]
    assert warm["restored"] == 2 and cold["restored"] == 0
    # the second range compiled at its first use (compile_at="first_use"), cold and warm
    assert cold["late"] == warm["late"] == 1
    # with AOTAutograd's cache on, each range has its own compile_fx (not one shared trace,
    # which that cache cannot hold): a warm start traces nothing
    assert warm["aot_hit"] == (2 if aot_cache else 0)


def test_the_dispatcher_picks_by_count_and_divisibility_and_compiles_a_fallback_below_one():
    from passkit._compile.specialize import Dispatcher, Plan, TokenDimension

    specs, rules = plan_specializations(
        {
            "small": TokenConstraint(max_tokens=16),
            "by4": TokenConstraint(multiple_of=4),
            "by6": TokenConstraint(multiple_of=6),
        }
    )
    made: list[int] = []
    dispatcher = Dispatcher(
        Plan(specs, rules, TokenDimension(0, None, "")),
        [lambda *args, i=i: i for i in range(len(specs))],
        fallback=lambda: made.append(1) or (lambda *args: "fallback"),
    )
    for n in (1, 4, 6, 12, 16, 17, 20, 24, 4096, 4098):
        index = dispatcher(n)
        assert index == dispatcher.index_for(n)
        expected_passes = tuple(
            name
            for name, applies in (("small", n <= 16), ("by4", n % 4 == 0), ("by6", n % 6 == 0))
            if applies
        )
        assert specs[index].passes == expected_passes, n
    assert dispatcher(0) == dispatcher(0) == "fallback" and made == [1]


class _TwoLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _static_inputs_per_compile(backend, monkeypatch) -> list[list[int]]:
    """The static (parameter) input indices Inductor is told of, per compile."""
    import torch._inductor.compile_fx as compile_fx

    seen: list[list[int]] = []
    real = getattr(compile_fx.get_static_input_idxs, "__wrapped__", compile_fx.get_static_input_idxs)

    def spy(fixed):
        found = real(fixed)
        seen.append(list(found))
        return found

    spy.__wrapped__ = real  # type: ignore[attr-defined]
    monkeypatch.setattr(compile_fx, "get_static_input_idxs", spy)
    torch._dynamo.reset()
    x = torch.randn(32, 16)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        torch.compile(_TwoLinears(), backend=backend)(x)
    return seen


def test_each_specialization_keeps_the_parameters_static(monkeypatch) -> None:
    """Each token range compiles a copy of Dynamo's graph; AOTAutograd must still see which
    inputs are parameters (Dynamo's `_param_name_to_source` and placeholders'
    `_dynamo_source`), or Inductor's CUDA graphs copy every weight at each replay (what made
    passkit's `reduce-overhead` slower than Inductor's at TP=2)."""
    inductor = _static_inputs_per_compile("inductor", monkeypatch)
    ranged = _static_inputs_per_compile(
        passkit.backend(passes=["cleanup"], compile_ranges=[16, 256]), monkeypatch
    )
    assert len(inductor) == 1 and inductor[0], inductor
    # one AOTAutograd trace for the three ranges (passkit._compile.shared_trace), whose static inputs
    # every range's Inductor compile is given
    assert len(ranged) == 1, ranged
    assert {tuple(r) for r in ranged} == {tuple(inductor[0])}, (ranged, inductor)
