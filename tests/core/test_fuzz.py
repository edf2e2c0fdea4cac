"""Seeded fuzzing of every input and every plugin fault (fast: a few hundred cases each).

Inputs (Python configs, ``PASSKIT_*`` environments, TOML files): each is accepted or is a
:class:`passkit.ConfigError` whose message is at most 2000 characters, never anything else.
Faulty plugins (a raising or misbehaving hook of every kind, registration, pass): each is
isolated (the compile goes on and computes the right thing) and recorded, naming the plugin.
Invalid rewrites (a pass leaving a graph Inductor cannot compile): caught at the pass by the
structural check, or, where only Inductor can tell, left out of a second compile; named.
"""

from __future__ import annotations

import copy
import random
import string
from pathlib import Path
from typing import Any

import pytest
import torch

import passkit
import passkit._plugins.registry
from passkit import hookimpl
from passkit._pipeline.build import Pipeline
from passkit._plugins.registry import PluginInfo, PluginSet, instantiate
from passkit.config import load_config
from passkit.errors import MESSAGE_LIMIT

from .support import PLUGIN, HalfwayThenFail, MulToScale

SEED = 20261125
KEYS = [*passkit.Config.model_fields, "pases", "on-error", "tool", ""]
PASS_NAMES = ["noop_elimination", "cleanup", "reinplace", "mul_to_scale", "nope", "a" * 300]
ENV_SUFFIXES = [
    "PASSES",
    "DISABLE",
    "ON_ERROR",
    "DUMP_DIR",
    "VERIFY",
    "STRICT_PLUGINS",
    "PLUGINS",
    "BLOCK_PLUGINS",
    "DISABLE_PLUGIN_AUTOLOAD",
    "COMPILE_RANGES",
    "CONFIG",
    "VERIFYY",
]


@pytest.fixture(autouse=True)
def _env(clean_env):
    return clean_env


def text(rng: random.Random) -> str:
    """A string: short or huge, plain or with the separators the parsers split on."""
    kind = rng.random()
    if kind < 0.1:
        return rng.choice(["", " ", "1", "true", "raise", "skip", "0", "-1", "4096", "null", "[1,2]"])
    alphabet = string.ascii_letters + string.digits + ",:=._-/ \t\"'[]{}\\#" + "é\u2603\x00"
    n = rng.choice([1, 3, 10, 50, 300, 5000])
    return "".join(rng.choice(alphabet) for _ in range(n))


def value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.randint(-(2**70), 2**70) if rng.random() < 0.2 else rng.randint(-5, 5000)
    if kind == 1:
        return rng.choice([0.0, -1.5, 1e300, float("nan"), float("inf")])
    if kind == 2:
        return rng.random() < 0.5
    if kind == 3:
        return None
    if kind in (4, 5):
        return text(rng) if rng.random() < 0.5 else rng.choice(PASS_NAMES)
    if kind == 6:
        return [value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 7:
        return {
            rng.choice(["name", "options", "max_tokens", "x", text(rng)]): value(rng, depth + 1)
            for _ in range(3)
        }
    return [rng.choice(PASS_NAMES) for _ in range(rng.randrange(1, 4))]


def config(rng: random.Random) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for _ in range(rng.randrange(1, 4)):
        key = rng.choice(KEYS)
        if key == "passes" and rng.random() < 0.6:
            entries: list[Any] = []
            for _ in range(rng.randrange(4)):
                name = rng.choice(PASS_NAMES)
                entries.append(
                    name
                    if rng.random() < 0.5
                    else {"name": name, rng.choice(["limit", "factor", text(rng)[:20]]): value(rng)}
                )
            out[key] = entries
        else:
            out[key] = value(rng)
    return out


def check(outcome: Any) -> str:
    """``"ok"`` for a config, ``"error"`` for a ConfigError with a bounded message; any
    other exception fails the test (pytest shows it)."""
    if isinstance(outcome, passkit.ConfigError):
        assert len(str(outcome)) <= MESSAGE_LIMIT, str(outcome)[:300]
        return "error"
    assert isinstance(outcome, (passkit.Config, passkit.Pipeline))
    return "ok"


def attempt(fn, *args, **kwargs) -> str:
    try:
        return check(fn(*args, **kwargs))
    except passkit.ConfigError as exc:
        return check(exc)


def test_generated_python_configs(tmp_path):
    rng = random.Random(SEED)
    seen = {"ok": 0, "error": 0}
    for _ in range(300):
        cfg = config(rng)
        seen[attempt(load_config, cfg, environ={}, cwd=tmp_path)] += 1
        seen[attempt(passkit.build_pipeline, cfg)] += 1
    assert seen["ok"] > 20 and seen["error"] > 200, seen  # both outcomes are exercised


def test_generated_environments(tmp_path):
    rng = random.Random(SEED + 1)
    good = tmp_path / "good.toml"
    good.write_text('passes = ["cleanup"]\n')
    seen = {"ok": 0, "error": 0}
    for _ in range(400):
        environ = {}
        for _ in range(rng.randrange(1, 4)):
            suffix = rng.choice(ENV_SUFFIXES)
            raw = text(rng)
            if suffix == "CONFIG":
                raw = rng.choice([raw.replace("\x00", ""), str(good), str(tmp_path), "/" + "x" * 5000])
            elif suffix == "PASSES" and rng.random() < 0.5:
                raw = ",".join(
                    f"{rng.choice(PASS_NAMES)}:{rng.choice(['limit', 'x'])}={text(rng)[:30]}"
                    for _ in range(2)
                )
            environ["PASSKIT_" + suffix] = raw.replace("\x00", "")  # no real environment holds NUL
        seen[attempt(load_config, environ=environ, cwd=tmp_path)] += 1
    assert seen["ok"] > 20 and seen["error"] > 100, seen


def toml_text(rng: random.Random) -> str:
    """Valid TOML of a random config, then (often) damaged."""
    lines = []
    for key, val in config(rng).items():
        lines.append(f"{key or 'x'} = {toml_value(val)}")
    body = "\n".join(lines) + "\n"
    damage = rng.random()
    if damage < 0.3:
        return body
    if damage < 0.5:
        return body[: rng.randrange(len(body) + 1)]
    if damage < 0.7:
        i = rng.randrange(len(body) + 1)
        return body[:i] + rng.choice(["[", "]", '"', "=", "\n[tool]\n", "{", "\\u"]) + body[i:]
    if damage < 0.85:
        return "[tool.passkit]\n" + body
    return "passes = " + "[" * rng.choice([10, 2000]) + "]" * rng.choice([0, 10])


def toml_value(val: Any) -> str:
    if isinstance(val, bool):
        return "true" if val else "false"
    if isinstance(val, (int, float)):
        return repr(val) if val == val and abs(val) != float("inf") else "nan"
    if val is None:
        return '""'
    if isinstance(val, str):
        return (
            '"'
            + val.replace("\\", "\\\\")
            .replace('"', '\\"')
            .replace("\x00", "")
            .replace("\n", "\\n")
            .replace("\t", "\\t")
            + '"'
        )
    if isinstance(val, list):
        return "[" + ", ".join(toml_value(v) for v in val) + "]"
    return "{" + ", ".join(f'"{k}" = {toml_value(v)}' for k, v in val.items()) + "}"


def test_generated_toml_files(tmp_path):
    rng = random.Random(SEED + 2)
    seen = {"ok": 0, "error": 0}
    for i in range(300):
        body = toml_text(rng)
        path = tmp_path / f"c{i}.toml"
        path.write_text(body, encoding="utf-8") if rng.random() < 0.9 else path.write_bytes(
            body.encode()[:-1] + b"\xff"
        )
        seen[attempt(load_config, environ={"PASSKIT_CONFIG": str(path)}, cwd=tmp_path)] += 1
        project = tmp_path / f"p{i}"
        project.mkdir()
        (project / "pyproject.toml").write_text("[tool.passkit]\n" + body if rng.random() < 0.5 else body)
        seen[attempt(load_config, environ={}, cwd=project)] += 1
    assert seen["ok"] > 20 and seen["error"] > 100, seen


# -- faulty plugins --------------------------------------------------------------------------


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() of this exception raises")


ERRORS = [
    lambda: ValueError("bad value"),
    lambda: KeyError("missing"),
    lambda: AssertionError(),
    lambda: ZeroDivisionError("division by zero"),
    lambda: RuntimeError("x" * 100_000),
    lambda: Unprintable(),
    lambda: passkit.ConfigError("a plugin raising passkit's own error"),
    lambda: RecursionError("maximum recursion depth exceeded"),
]
HOOK_ARGS = {
    "passkit_configure_pipeline": ("plan", "context"),
    "passkit_before_pass": ("pass_", "gm", "context"),
    "passkit_after_pass": ("pass_", "gm", "result", "record"),
    "passkit_pass_failed": ("pass_", "gm", "error", "record"),
    "passkit_report": ("report",),
}


def faulty_plugin(rng: random.Random) -> tuple[str, object]:
    """``(where the fault is, a plugin object)``: a hook that raises (after doing part of
    its job, sometimes), a registration that raises or returns garbage, or a pass that
    raises, half-rewrites or returns garbage."""
    error = rng.choice(ERRORS)
    where = rng.choice([*HOOK_ARGS, "register", "register_garbage", "pass"])
    if where in HOOK_ARGS:
        half = rng.random() < 0.5

        def hook(*args):
            if half and args and isinstance(args[0], passkit.PipelinePlan):
                args[0].skip("cleanup", "half-done")
            raise error()

        hook.__name__ = where
        namespace = {where: hookimpl(specname=where)(_with_args(hook, HOOK_ARGS[where]))}
        return where, type("Faulty", (), namespace)()
    if where.startswith("register"):
        garbage = rng.choice([42, [int], ["cleanup"], "noop_elimination", {1: 2}])

        def register():
            if where == "register":
                raise error()
            return garbage

        return where, type("Faulty", (), {"passkit_register_passes": hookimpl(staticmethod(register))})()
    behaviour = rng.choice(["raise", "half", "none", "bad_notes", "bad_matches"])

    class FaultyPass(passkit.GraphPass):
        name = "faulty_pass"

        def run(self, gm, ctx):
            if behaviour == "half":
                return HalfwayThenFail.run(self, gm, ctx)
            if behaviour == "none":
                return None
            if behaviour == "bad_notes":
                return passkit.PassResult(notes=[1, object()])
            if behaviour == "bad_matches":
                return passkit.PassResult(matches="many")
            raise error()

    def register_pass():
        return [FaultyPass]

    return "pass", type("Faulty", (), {"passkit_register_passes": hookimpl(staticmethod(register_pass))})()


def _with_args(fn, names):
    """``fn(*args)`` as a function whose parameters are ``self`` + ``names`` (pluggy reads them)."""
    params = ", ".join(("self", *names))
    namespace: dict[str, Any] = {"fn": fn}
    exec(f"def wrapper({params}):\n    return fn({', '.join(names)})", namespace)
    return namespace["wrapper"]


@pytest.fixture(scope="module")
def graph():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        return torch.relu(x * 3.0) + 1.0

    with torch.no_grad():
        return make_fx(f, tracing_mode="fake")(torch.randn(4, 8))


def test_generated_faulty_plugins_are_isolated_and_recorded(graph):
    rng = random.Random(SEED + 3)
    x = torch.randn(4, 8)
    expected = torch.relu(x * 2.0) + 1.0  # mul_to_scale's rewrite, factor 2
    seen: dict[str, int] = {}
    base = PluginSet()
    base.load_entry_points(autoload=False)
    for case in range(300):
        where, plugin = faulty_plugin(rng)
        plugins = PluginSet()
        plugins.load_entry_points(autoload=False)
        plugins.add(PLUGIN, PluginInfo("core-test-passes", None, None, "tests"))
        loaded = plugins.add(plugin, PluginInfo(f"faulty-{case}", "acme-faulty", "0.1", "acme"))
        names = ["mul_to_scale", "cleanup"] + (["faulty_pass"] if where == "pass" else [])
        cfg = load_config(passes=names, environ={})
        gm = torch.fx.GraphModule(graph, copy.deepcopy(graph.graph))
        report = Pipeline(cfg, plugins, instantiate(cfg, plugins)).run(gm)
        torch.testing.assert_close(gm(x), expected)  # the compile went on, the rewrite is right
        assert report["mul_to_scale"].status == "ran"
        if where in HOOK_ARGS:
            assert loaded
            hook_failures = [f for f in report.hook_failures if f.plugin == f"faulty-{case}"]
            if where != "passkit_pass_failed":  # fires only when a pass failed: none did here
                (failure,) = hook_failures
                assert (failure.hook, failure.distribution) == (where, "acme-faulty")
                assert len(str(failure)) < 1000 and "PLUGIN HOOK FAILED" in report.format()
            assert report["cleanup"].status == "ran"  # a half-done plan change was undone
        elif where.startswith("register"):
            assert not loaded
            (failure,) = plugins.failures
            assert (failure.name, failure.stage, failure.distribution) == (
                f"faulty-{case}",
                "register",
                "acme-faulty",
            )
            assert len(str(failure)) < 1000
        else:
            record = report["faulty_pass"]
            assert record.status == "failed" and len(record.reason) < 1000, record.reason
        assert len(report.to_json()) < 20_000
        seen[where] = seen.get(where, 0) + 1
    assert set(seen) == {*HOOK_ARGS, "register", "register_garbage", "pass"}, seen


def test_pass_failed_hook_faults_are_recorded(graph):
    """The ``passkit_pass_failed`` hook fires only after a pass failed: with one that does."""
    rng = random.Random(SEED + 4)
    for case in range(20):
        error = rng.choice(ERRORS)

        class Faulty:
            @hookimpl
            def passkit_pass_failed(self, pass_, gm, error=error, record=None):
                raise error()

        plugins = PluginSet()
        plugins.load_entry_points(autoload=False)
        plugins.add(PLUGIN, PluginInfo("core-test-passes", None, None, "tests"))
        assert plugins.add(Faulty(), PluginInfo(f"faulty-{case}", "acme-faulty", "0.1", "acme"))
        cfg = load_config(passes=["mul_to_scale", "halfway_then_fail"], environ={})
        report = Pipeline(cfg, plugins, instantiate(cfg, plugins)).run(
            torch.fx.GraphModule(graph, copy.deepcopy(graph.graph))
        )
        (failure,) = report.hook_failures
        assert failure.hook == "passkit_pass_failed" and failure.plugin == f"faulty-{case}"
        assert report["halfway_then_fail"].status == "failed"


def test_the_fuzz_support_is_sound():
    """The generators produce what they claim (a broken generator would pass vacuously)."""
    assert MulToScale.name == "mul_to_scale"
    rng = random.Random(0)
    kinds = {faulty_plugin(rng)[0] for _ in range(200)}
    assert kinds == {*HOOK_ARGS, "register", "register_garbage", "pass"}
    assert Path(__file__).exists()


# -- invalid rewrites: graphs Inductor cannot compile ------------------------------------------


def test_generated_invalid_rewrites_are_caught_at_the_pass(graph):
    """Each rewrite that breaks an op's schema (extra, missing or unknown arguments, a
    non-tensor where a tensor goes, a target whose schema does not fit) is caught by the
    structural check right after the pass (verify off): recorded ``failed`` naming the pass and
    the node, the graph restored, the rest of the pipeline run."""
    from .broken_passes import CAUGHT_BY_SCHEMA, INVALID_KINDS, invalid_rewrite

    rng = random.Random(SEED + 5)
    x = torch.randn(4, 8)
    expected = torch.relu(x * 2.0) + 1.0
    seen: dict[str, int] = {}
    for case in range(200):
        kind, cls = invalid_rewrite(rng)
        plugins = PluginSet()
        plugins.load_entry_points(autoload=False)
        plugins.add(PLUGIN, PluginInfo("core-test-passes", None, None, "tests"))
        register = hookimpl(specname="passkit_register_passes")(lambda cls=cls: [cls])
        assert plugins.add(
            type("Rewrites", (), {"passkit_register_passes": staticmethod(register)})(),
            PluginInfo(f"rewrites-{case}", "acme-rewrites", "0.1", "acme"),
        )
        cfg = load_config(passes=["mul_to_scale", cls.name, "cleanup"], environ={})
        gm = torch.fx.GraphModule(graph, copy.deepcopy(graph.graph))
        report = Pipeline(cfg, plugins, instantiate(cfg, plugins)).run(gm)
        record = report[cls.name]
        if kind in CAUGHT_BY_SCHEMA:
            assert record.status == "failed", (kind, cls.__qualname__, record)
            assert record.reason.startswith(f"VerificationError: after pass {cls.name!r}: "), record.reason
            assert "schema" in record.reason and len(record.reason) < 1000
            torch.testing.assert_close(gm(x), expected)  # restored, later passes ran
        else:  # only Inductor rejects it (test_generated_invalid_rewrites_compile)
            assert record.status == "ran" and record.modified
        assert report["cleanup"].status == "ran"
        seen[kind] = seen.get(kind, 0) + 1
    assert set(seen) == set(INVALID_KINDS), seen


@pytest.mark.slow
def test_generated_invalid_rewrites_compile():
    """One generated rewrite of each kind in a real Inductor compile: the compile succeeds
    with the right output and names the pass (caught at the pass, or left out after Inductor
    failed on its graph)."""
    from .broken_passes import CAUGHT_BY_SCHEMA, INVALID_KINDS, invalid_rewrite

    rng = random.Random(SEED + 6)
    x = torch.randn(4, 8)
    for kind in INVALID_KINDS:
        _, cls = invalid_rewrite(rng, kind)
        with passkit._plugins.registry.isolated():
            passkit.register(PLUGIN, name="core-test-passes")
            register = hookimpl(specname="passkit_register_passes")(lambda cls=cls: [cls])
            passkit.register(
                type("Rewrites", (), {"passkit_register_passes": staticmethod(register)})(),
                name=f"rewrites-{kind}",
            )
            backend = passkit.backend(passes=["mul_to_scale", cls.name])
            torch._dynamo.reset()
            out = torch.compile(lambda t: torch.relu(t * 3.0) + 1.0, backend=backend)(x)
        torch.testing.assert_close(out, torch.relu(x * 2.0) + 1.0)
        (report,) = backend.reports
        record = report[cls.name]
        assert record.status == "failed", (kind, record)
        if kind in CAUGHT_BY_SCHEMA:
            assert record.reason.startswith(f"VerificationError: after pass {cls.name!r}")
        else:
            assert record.reason.startswith("Inductor failed on the graph this pass changed")


# -- mutations of real graphs: never a wrong output, never an unnamed abort -------------------
#
# A pass applies one random single-node mutation to a graph Inductor handed to its post-grad
# passes (a transformer block, an MLP with a norm) or to its joint passes (the block in
# training: forward outputs and gradients compared). Structural mutations (delete or retarget a
# node, drop or add an argument, change a shape, a dtype, an output; install a new graph object
# holding such a mutation; route a node through a method call; write to an input) must end
# either with the pass recorded ``failed`` (named, the graph restored: it computes what eager
# does) or with a graph that still computes what eager does (the mutation was harmless, e.g.
# on a dead node). Value-only mutations (``add`` -> ``sub``) keep every shape: only
# ``verify = "numeric"`` sees them, and it must.

from .mutations import MUTATION_KINDS, STRUCTURAL, capture_graphs, mutation_pass, outcome  # noqa: E402

MUTATION_SEED = SEED + 7


@pytest.fixture(scope="module")
def real_graphs():
    return capture_graphs()


def _mutation_cases(count: int, seed: int):
    rng = random.Random(seed)
    for case in range(count):
        yield case, rng.choice(MUTATION_KINDS), rng.choice([False, True, "numeric"]), rng.random()


def _check_mutations(real_graphs, count: int, seed: int) -> dict[str, int]:
    seen: dict[str, int] = {}
    for case, kind, verify, pick in _mutation_cases(count, seed):
        name, captured = real_graphs[int(pick * len(real_graphs))]
        stage = passkit.Stage.JOINT if name.endswith("_joint") else passkit.Stage.POST
        cls = mutation_pass(kind, random.Random(seed * 1000 + case), stage)
        result = outcome(captured, cls, verify)
        key = f"{kind}:{result.what}"
        seen[key] = seen.get(key, 0) + 1
        where = (case, name, kind, verify, result.detail)
        assert result.what in ("caught", "harmless", "no_site", "value_only"), where
        if result.what == "value_only":  # only a value changed: the numeric level must see it
            assert kind not in STRUCTURAL or result.values_only, where
            assert verify != "numeric", where
    return seen


def test_generated_mutations_of_real_graphs(real_graphs):
    """A fast sample (every kind, verify off, on and numeric)."""
    seen = _check_mutations(real_graphs, 240, MUTATION_SEED)
    kinds = {k.split(":")[0] for k in seen}
    assert kinds == set(MUTATION_KINDS), seen
    assert sum(v for k, v in seen.items() if k.endswith(":caught")) > 60, seen


@pytest.mark.slow
def test_thousands_of_generated_mutations_of_real_graphs(real_graphs):
    seen = _check_mutations(real_graphs, 3000, MUTATION_SEED + 1)
    assert sum(seen.values()) == 3000 and sum(v for k, v in seen.items() if k.endswith(":caught")) > 800, seen


@pytest.mark.slow
def test_generated_mutations_in_real_compiles():
    """Mutations applied in a real Inductor compile (verify off): the output equals eager,
    whatever the mutation, or the compile fails naming the pass (never: a wrong output)."""
    from .mutations import compile_case

    rng = random.Random(MUTATION_SEED + 2)
    for case in range(24):
        kind = MUTATION_KINDS[case % len(MUTATION_KINDS)]
        if kind not in STRUCTURAL:
            continue
        compile_case(mutation_pass(kind, random.Random(rng.random())))
