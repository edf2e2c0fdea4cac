"""Issue 36: no silent wrong output, no hijacked pass, no cache that breaks a compile.

Each case of the issue's fault battery: before the fix it compiled a wrong result silently,
let an installed package replace a pass, or aborted the compile (or the process); now it is
isolated, named, and the compile goes on with the right output.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import passkit
import passkit._plugins.registry
from passkit._pipeline.build import Pipeline
from passkit._plugins.registry import Found, PassNameClashWarning, PluginInfo, PluginSet, instantiate
from passkit.config import load_config
from passkit.errors import ConfigWarning

from .support import PLUGIN as CORE_PLUGIN

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _env(clean_env):
    return clean_env


def fn(x):
    return torch.relu(x * 3.0) + 1.0


X = torch.randn(8, 4)


@pytest.fixture(scope="module")
def graph():
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        return make_fx(fn, tracing_mode="fake")(torch.randn(8, 4))


def _output_entries(gm):
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat = out.args[0]
    return out, flat if isinstance(flat, (list, tuple)) else (flat,)


def _set_output(out, old, new):
    out.args = tree = torch.fx.node.map_arg(out.args, lambda n: new if n is old else n)
    return tree


class HalveOutput(passkit.GraphPass):
    """Slices the graph's output to half its rows, copying the old output's metadata (so the
    recorded value still says the old shape) and saying it changed nothing."""

    name = "halve_output"

    def run(self, gm, ctx):
        out, entries = _output_entries(gm)
        first = entries[0]
        with gm.graph.inserting_before(out):
            half = gm.graph.call_function(aten.slice.Tensor, (first, 0, 0, 4))
        half.meta = dict(first.meta)
        _set_output(out, first, half)
        return passkit.PassResult(modified=False)


class DropOutput(passkit.GraphPass):
    """Returns one value more than the graph did."""

    name = "extra_output"

    def run(self, gm, ctx):
        out, entries = _output_entries(gm)
        out.args = ((*entries, entries[0]),)
        return passkit.PassResult(modified=True)


class EraseInUseThenRaise(passkit.GraphPass):
    """Removes ``relu`` while ``add`` still uses it, then raises."""

    name = "erase_in_use_then_raise"
    then_raise = True

    def run(self, gm, ctx):
        (relu,) = gm.graph.find_nodes(op="call_function", target=aten.relu.default)
        relu.users.clear()
        gm.graph.erase_node(relu)
        if self.then_raise:
            raise RuntimeError("gave up halfway")
        return passkit.PassResult(modified=True)


class EraseInUse(EraseInUseThenRaise):
    name = "erase_in_use"
    then_raise = False


class QuietHalfCast(passkit.GraphPass):
    """Casts relu's result to float16 and back (Inductor rejects the graph), and returns
    ``modified=False``: the blame must not trust the flag."""

    name = "quiet_half_cast"

    def run(self, gm, ctx):
        for node in list(gm.graph.find_nodes(op="call_function", target=aten.relu.default)):
            with gm.graph.inserting_after(node):
                half = gm.graph.call_function(aten._to_copy.default, (node,), {"dtype": torch.float16})
            with gm.graph.inserting_after(half):
                back = gm.graph.call_function(aten._to_copy.default, (half,), {"dtype": torch.float32})
            node.replace_all_uses_with(back, delete_user_cb=lambda user, h=half: user is not h)
        return passkit.PassResult(modified=False)


class Exits(passkit.GraphPass):
    name = "exits"

    def run(self, gm, ctx):
        raise SystemExit(3)


class AddToSub(passkit.GraphPass):
    """``add`` -> ``sub``: every shape and dtype stays, only values change."""

    name = "add_to_sub"

    def run(self, gm, ctx):
        for node in gm.graph.find_nodes(op="call_function", target=aten.add.Tensor):
            node.target = aten.sub.Tensor
        return passkit.PassResult(modified=True, matches=1)


class ReluToClamp(passkit.GraphPass):
    """``relu(x)`` -> ``clamp_min(x, 0)``: a rewrite that keeps every value."""

    name = "relu_to_clamp"

    def run(self, gm, ctx):
        for node in gm.graph.find_nodes(op="call_function", target=aten.relu.default):
            node.target, node.args = aten.clamp_min.default, (node.args[0], 0.0)
        return passkit.PassResult(modified=True, matches=1)


PASSES = [
    HalveOutput,
    DropOutput,
    EraseInUseThenRaise,
    EraseInUse,
    QuietHalfCast,
    Exits,
    AddToSub,
    ReluToClamp,
]


class Faults:
    @passkit.hookimpl
    def passkit_register_passes(self):
        return list(PASSES)


def run_pipeline(graph, names, **config):
    plugins = PluginSet()
    plugins.load_entry_points(autoload=False)
    plugins.add(Faults(), PluginInfo("faults", "acme-faults", "0.1", "acme"))
    plugins.add(CORE_PLUGIN, PluginInfo("core-test-passes", None, None, "tests"))
    cfg = load_config(passes=names, environ={}, **config)
    gm = torch.fx.GraphModule(graph, copy.deepcopy(graph.graph))
    report = Pipeline(cfg, plugins, instantiate(cfg, plugins)).run(gm)
    return gm, report


def _out(gm, x=X):
    out = gm(x)
    return out[0] if isinstance(out, (list, tuple)) else out


def compile_with(*names, **config):
    passkit.register(Faults(), name="faults")
    passkit.register(CORE_PLUGIN, name="core-test-passes")
    backend = passkit.backend(passes=list(names), **config)
    return torch.compile(fn, backend=backend), backend


# -- 1. outputs checked after every pass ---------------------------------------------------


@pytest.mark.parametrize("verify", [False, True])
def test_a_pass_that_changes_an_output_shape_fails_named_and_the_graph_is_restored(graph, verify):
    gm, report = run_pipeline(graph, ["halve_output", "cleanup"], verify=verify)
    record = report["halve_output"]
    assert record.status == "failed"
    assert record.reason.startswith("VerificationError: after pass 'halve_output': output 0"), record.reason
    assert "[4, 4]" in record.reason and "[8, 4]" in record.reason
    torch.testing.assert_close(_out(gm), fn(X))
    assert report["cleanup"].status == "ran"


def test_a_pass_that_changes_the_output_count_fails_named(graph):
    gm, report = run_pipeline(graph, ["extra_output"])
    assert report["extra_output"].status == "failed"
    assert "the graph returns 2 value(s), it returned 1 before the pass" in report["extra_output"].reason
    torch.testing.assert_close(_out(gm), fn(X))


def test_output_shape_change_in_a_real_compile_with_verify_off():
    compiled, backend = compile_with("halve_output")
    out = compiled(X)
    assert out.shape == (8, 4)
    torch.testing.assert_close(out, fn(X))
    (report,) = backend.reports
    assert report["halve_output"].status == "failed" and "output 0" in report["halve_output"].reason


# -- 3. changes measured, not declared -----------------------------------------------------


def test_modified_is_measured_not_taken_from_the_pass(graph):
    _, report = run_pipeline(graph, ["mul_to_scale"])
    assert report["mul_to_scale"].modified

    # a pass that says modified=True and changes nothing: recorded unchanged, with a note
    class Claims(passkit.GraphPass):
        name = "claims"

        def run(self, gm, ctx):
            return passkit.PassResult(modified=True)

    Faults_plus = type("F", (), {"passkit_register_passes": passkit.hookimpl(staticmethod(lambda: [Claims]))})
    plugins = PluginSet()
    plugins.load_entry_points(autoload=False)
    plugins.add(Faults_plus(), PluginInfo("claims", None, None, "x"))
    cfg = load_config(passes=["claims"], environ={})
    report = Pipeline(cfg, plugins, instantiate(cfg, plugins)).run(
        torch.fx.GraphModule(graph, copy.deepcopy(graph.graph))
    )
    assert not report["claims"].modified
    assert "returned modified=True, but the graph did not change" in report["claims"].notes


def test_inductor_failure_is_blamed_on_a_pass_that_said_modified_false():
    compiled, backend = compile_with("quiet_half_cast")
    torch.testing.assert_close(compiled(X), fn(X))
    (report,) = backend.reports
    record = report["quiet_half_cast"]
    assert record.status == "failed"
    assert record.reason.startswith("Inductor failed on the graph this pass changed")


# -- 5. passkit's restore, SystemExit, stages ------------------------------------------------


@pytest.mark.parametrize(
    "name,verify", [("erase_in_use_then_raise", False), ("erase_in_use", True), ("erase_in_use", False)]
)
def test_a_node_removed_while_in_use_is_restored(graph, name, verify):
    gm, report = run_pipeline(graph, [name, "mul_to_scale"], verify=verify)
    record = report[name]
    assert record.status == "failed", record
    assert (
        ("gave up halfway" in record.reason) or ("still in use" in record.reason) or ("lint" in record.reason)
    ), record.reason
    gm.graph.lint()
    torch.testing.assert_close(_out(gm), torch.relu(X * 2.0) + 1.0)


@pytest.mark.parametrize("verify", [False, True])
def test_a_node_removed_while_in_use_then_raise_in_a_real_compile(verify):
    compiled, backend = compile_with("erase_in_use_then_raise", verify=verify)
    torch.testing.assert_close(compiled(X), fn(X))
    (report,) = backend.reports
    assert report["erase_in_use_then_raise"].status == "failed"


def test_a_pass_raising_system_exit_is_isolated_and_named(graph):
    gm, report = run_pipeline(graph, ["exits", "mul_to_scale"])
    record = report["exits"]
    assert record.status == "failed" and record.reason.startswith("SystemExit: 3"), record.reason
    torch.testing.assert_close(_out(gm), torch.relu(X * 2.0) + 1.0)
    compiled, backend = compile_with("exits")
    torch.testing.assert_close(compiled(X), fn(X))
    assert backend.reports[0]["exits"].status == "failed"


def test_system_exit_with_on_error_raise_is_a_named_pass_failure(graph):
    with pytest.raises(passkit.PassFailedError, match="pass 'exits' failed: SystemExit: 3"):
        run_pipeline(graph, ["exits"], on_error="raise")


def test_a_plugin_calling_sys_exit_at_import_is_isolated_and_named(monkeypatch, capsys):
    class _EntryPoint:
        name, value = "exiter", "acme_exit:plugin"

        def load(self):
            sys.exit("acme-exit cannot run here")

    real = passkit._plugins.registry.discover

    def discover(groups):
        found = real(groups)
        found[passkit._plugins.registry.ENTRY_POINT_GROUP].insert(0, Found(_EntryPoint(), "acme-exit", "2.0"))
        return found

    monkeypatch.setattr(passkit._plugins.registry, "discover", discover)
    passkit._plugins.registry.reset()
    plugins = passkit.get_plugins()
    (failure,) = [f for f in plugins.failures if f.distribution == "acme-exit"]
    assert failure.stage == "import" and "SystemExit: acme-exit cannot run here" in failure.error
    assert "cleanup" in plugins.passes  # the others loaded
    from passkit.cli import main

    assert main(["list"]) == 0
    shown = capsys.readouterr()
    assert "acme-exit" in shown.out + shown.err
    compiled = torch.compile(fn, backend=passkit.backend(passes=["cleanup"]))
    torch.testing.assert_close(compiled(X), fn(X))


def _with_entry_point(monkeypatch, load, name="interrupter", dist="acme-interrupt"):
    class _EntryPoint:
        value = f"{dist.replace('-', '_')}:plugin"

        def __init__(self):
            self.name = name

        def load(self):
            return load()

    real = passkit._plugins.registry.discover

    def discover(groups):
        found = real(groups)
        found[passkit._plugins.registry.ENTRY_POINT_GROUP].insert(0, Found(_EntryPoint(), dist, "1.0"))
        return found

    monkeypatch.setattr(passkit._plugins.registry, "discover", discover)
    passkit._plugins.registry.reset()


def test_a_plugin_raising_keyboard_interrupt_itself_at_import_is_its_load_failure(monkeypatch, capsys):
    """No key pressed: every compile of the process raised a bare KeyboardInterrupt and
    ``passkit list`` exited 130 with a traceback, the plugin unnamed. The plugin's own
    KeyboardInterrupt is its bug: recorded like any failure to import, the others load."""

    def load():
        raise KeyboardInterrupt("acme-interrupt gives up")

    _with_entry_point(monkeypatch, load)
    plugins = passkit.get_plugins()
    (failure,) = [f for f in plugins.failures if f.distribution == "acme-interrupt"]
    assert failure.stage == "import" and failure.error == "KeyboardInterrupt: acme-interrupt gives up"
    assert "cleanup" in plugins.passes
    from passkit.cli import main

    assert main(["list"]) == 0
    shown = capsys.readouterr()
    assert "interrupter" in shown.out + shown.err and "acme-interrupt" in shown.out + shown.err
    assert "Traceback" not in shown.out + shown.err
    compiled = torch.compile(fn, backend=passkit.backend(passes=["cleanup"]))
    torch.testing.assert_close(compiled(X), fn(X))


def test_ctrl_c_while_a_plugin_imports_stops_the_program_naming_the_plugin(monkeypatch, capsys):
    """A real SIGINT during the import: re-raised (Ctrl-C must stop), the plugin named."""
    import signal
    import time

    def load():
        os.kill(os.getpid(), signal.SIGINT)  # as if Ctrl-C were pressed during a slow import
        time.sleep(5)  # the handler runs at the next bytecode; never reached
        raise AssertionError("SIGINT did not interrupt the import")

    _with_entry_point(monkeypatch, load)
    with pytest.raises(KeyboardInterrupt):
        passkit.get_plugins()
    assert capsys.readouterr().err == (
        "passkit: interrupted while importing plugin 'interrupter' (distribution 'acme-interrupt', "
        "acme_interrupt:plugin)\n"
    )
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    from passkit.cli import main

    passkit._plugins.registry.reset()
    assert main(["list"]) == 130  # the CLI: one line each, no traceback
    err = capsys.readouterr().err
    assert err.endswith("acme_interrupt:plugin)\npasskit: interrupted\n") and "Traceback" not in err, err


def test_an_invalid_stage_names_the_pass_and_the_valid_stages():
    with pytest.raises(TypeError) as caught:

        class Nonsense(passkit.GraphPass):
            name = "nonsense"
            stage = "nonsense_stage"

    message = str(caught.value)
    assert "Nonsense" in message and "'nonsense'" in message and "'nonsense_stage'" in message
    assert "'post_grad_pre'" in message and "'post_grad_post'" in message


# -- 2. pass names are owned ----------------------------------------------------------------


class HijackCleanup(passkit.GraphPass):
    """A plugin's ``cleanup`` that computes something else."""

    name = "cleanup"

    def run(self, gm, ctx):
        for node in gm.graph.find_nodes(op="call_function", target=aten.relu.default):
            node.target = aten.neg.default
        return passkit.PassResult(modified=True)


class Hijack:
    @passkit.hookimpl
    def passkit_register_passes(self):
        return [HijackCleanup]


@pytest.fixture
def hijacked(monkeypatch):
    """An installed distribution ``aaa-hijack`` (sorted before ``passkit``) registering a
    pass named ``cleanup``."""

    class _EntryPoint:
        name, value = "hijack", "aaa_hijack:plugin"

        def load(self):
            return Hijack()

    real = passkit._plugins.registry.discover

    def discover(groups):
        found = real(groups)
        found[passkit._plugins.registry.ENTRY_POINT_GROUP].insert(
            0, Found(_EntryPoint(), "aaa-hijack", "6.6.6")
        )
        return found

    monkeypatch.setattr(passkit._plugins.registry, "discover", discover)
    passkit._plugins.registry.reset()
    yield
    passkit._plugins.registry.reset()


def test_a_pass_name_clash_warns_at_discovery_naming_both_distributions(hijacked):
    with pytest.warns(PassNameClashWarning) as caught:
        plugins = passkit.get_plugins()
    message = str(caught[0].message)
    assert "'cleanup'" in message and "aaa-hijack" in message and "distribution passkit" in message
    assert "cleanup" not in plugins.passes and {
        i.plugin.distribution for i in plugins.clashes["cleanup"]
    } == {
        "passkit",
        "aaa-hijack",
    }


def test_enabling_a_clashing_name_is_an_error_and_a_qualified_name_chooses(hijacked):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PassNameClashWarning)
        with pytest.raises(passkit.ConfigError) as caught:
            passkit.build_pipeline(passes=["cleanup"])
        message = str(caught.value)
        assert "aaa-hijack" in message and "passkit" in message
        assert "'passkit:cleanup'" in message and "'aaa-hijack:cleanup'" in message
        backend = passkit.backend(passes=["passkit:cleanup"])
        out = torch.compile(fn, backend=backend)(X)
        torch.testing.assert_close(out, fn(X))  # passkit's cleanup ran, not the hijacker's
        (report,) = backend.reports
        assert report["cleanup"].status == "ran"
        # the other owner, chosen on purpose (in the environment too), distribution spelt any way
        pipeline = passkit.build_pipeline(load_config(environ={"PASSKIT_PASSES": "AAA_Hijack:cleanup"}))
        assert [type(p) for p in pipeline.passes] == [HijackCleanup]
        assert pipeline.plugins.info_for(pipeline.passes[0]).plugin.distribution == "aaa-hijack"


def test_pass_names_with_a_colon_are_refused():
    class Colon(passkit.GraphPass):
        name = "a:b"

    plugins = PluginSet()
    ok = plugins.add(
        type("P", (), {"passkit_register_passes": passkit.hookimpl(staticmethod(lambda: [Colon]))})(),
        PluginInfo("colon", "acme", "1", "acme"),
    )
    assert not ok and "contains ':'" in plugins.failures[0].error


# -- 4. caches and dumps fail soft ------------------------------------------------------------


@pytest.mark.parametrize(
    "content", ["[1,2]", '{"a":1}', '[{"passes":[1]}]', '[{"passes":[{"name":"a","stage":"s","ms":"fast"}]}]']
)
def test_a_report_cache_entry_of_the_wrong_shape_is_a_miss_with_a_warning(tmp_path, monkeypatch, content):
    from passkit._compile import report_cache

    monkeypatch.setenv("PASSKIT_CACHE_DIR", str(tmp_path))
    (tmp_path / "k.json").write_text(content)
    with pytest.warns(ConfigWarning, match="is not a passkit report"):
        assert report_cache.load("k") is None


def test_a_bad_report_cache_entry_does_not_break_a_warm_compile(tmp_path):
    """A real warm start (Inductor's FX graph cache hit) whose report-cache entries were
    replaced by JSON of the wrong shape: the compile succeeds."""
    env = _subprocess_env(tmp_path)
    code = (
        "import torch, passkit\n"
        "from tests.core.test_no_silent_faults import fn, X\n"
        "b = passkit.backend(passes=['cleanup'])\n"
        "torch.testing.assert_close(torch.compile(fn, backend=b)(X), fn(X))\n"
        "print(b.reports[-1].cache_hit)\n"
    )
    cold = _run(code, env)
    for path in (tmp_path / "reports").glob("*.json"):
        path.write_text('[{"passes":[1]}]')
    warm = _run(code, env)
    assert cold.strip().endswith("False") and warm.strip().endswith("True")


@pytest.mark.parametrize("kind", ["file", "unwritable"])
def test_an_unwritable_dump_dir_warns_once_and_the_compile_goes_on(tmp_path, monkeypatch, kind):
    import passkit._pipeline.dump

    monkeypatch.setattr(passkit._pipeline.dump, "_unwritable", set())
    target = tmp_path / "dumps"
    if kind == "file":
        target.write_text("a file, not a folder")
    else:
        target.mkdir()
        real = type(target).mkdir

        def mkdir(self, *args, **kwargs):
            if str(self).startswith(str(target)):
                raise OSError(30, "Read-only file system", str(self))
            return real(self, *args, **kwargs)

        monkeypatch.setattr(type(target), "mkdir", mkdir)
    monkeypatch.setenv("PASSKIT_DUMP_DIR", str(target))
    with pytest.warns(ConfigWarning, match="cannot be written") as caught:
        compiled, backend = compile_with("mul_to_scale", "cleanup")
        torch.testing.assert_close(compiled(X), torch.relu(X * 2.0) + 1.0)
        torch._dynamo.reset()
        torch.compile(lambda t: t * 3.0, backend=backend)(X)
    assert len([w for w in caught if "cannot be written" in str(w.message)]) == 1
    assert all(r.status == "ran" for r in backend.reports[0].records)


def _subprocess_env(tmp_path, **extra):
    from .test_integration import _env

    return _env(
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"),
        TORCHINDUCTOR_FX_GRAPH_CACHE="1",
        TORCHINDUCTOR_AUTOGRAD_CACHE="0",
        PASSKIT_CACHE_DIR=str(tmp_path / "reports"),
        **extra,
    )


def _run(code, env, *args):
    from .test_integration import ROOT

    argv = [sys.executable, "-c", code] if code else [sys.executable, "-m", *args]
    out = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_a_warm_start_restores_a_ranges_records_whatever_the_first_calls_count(tmp_path):
    env = _subprocess_env(tmp_path)
    cold = json.loads(_run(None, env, "tests.core.range_count_probe", "10").splitlines()[-1])
    warm = json.loads(_run(None, env, "tests.core.range_count_probe", "12").splitlines()[-1])
    assert (cold["miss"], warm["hit"]) == (1, 1)
    assert warm["restored"] == 1
    assert warm["reports"] == cold["reports"] and cold["reports"][0][1]  # records, not empty


def test_threads_arriving_at_a_range_not_compiled_yet_compile_it_once():
    from .test_ranges import Everywhere, SmallRelu, backend, compiled

    def expected(x):  # above 16 tokens: small_relu does not apply, everywhere does
        return torch.relu(x) + torch.tanh(x) * 2 + torch.sin(x)

    b = backend(SmallRelu(), Everywhere())
    f = compiled(b)
    f(torch.randn(4, 3))  # 1..16 compiles now; > 16 at its first use
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def call(n):
        try:
            barrier.wait()
            x = torch.randn(n, 3)
            torch.testing.assert_close(f(x), expected(x))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(n,)) for n in (20, 24, 30, 40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert b.last_dispatcher.late_compiles == 1
    late = [r for r in b.reports if r.token_range and "17" in r.token_range]
    # compiled, not served from Inductor's on-disk cache: the threads compile under this
    # test's config (no FX-graph cache), see the test below (issue 46: flaky before)
    assert len(late) == 1 and late[0].records and not late[0].cache_hit, late


def test_a_range_compiled_late_in_another_thread_compiles_under_the_backend_calls_config():
    """Issue 46: torch keeps Inductor's config per thread (a patch or an assignment is a
    context variable), so a range compiled at its first use in a server's worker thread
    compiled with that thread's config, not the one the graph's first range compiled with:
    the suite's ``fx_graph_cache=False`` did not reach it, it hit Inductor's on-disk cache of
    an earlier run, and its report said ``cache_hit`` with no records. The late compile now
    runs in the context of the backend call."""
    import torch._inductor.config as inductor_config

    from .test_ranges import Everywhere, SmallRelu, backend, compiled

    seen: list[bool] = []

    class Watching(Everywhere):
        def run(self, gm, ctx):
            seen.append(inductor_config.fx_graph_cache)
            return super().run(gm, ctx)

    b = backend(SmallRelu(), Watching())
    f = compiled(b)
    with inductor_config.patch(fx_graph_cache=False):  # (the conftest's too) not the default
        f(torch.randn(4, 3))  # 1..16 compiles now
    assert seen == [False]
    thread = threading.Thread(target=f, args=(torch.randn(20, 3),))  # > 16: compiles there
    thread.start()
    thread.join()
    assert b.last_dispatcher.late_compiles == 1
    assert seen == [False, False], seen


# -- quietly ignored: now loud ---------------------------------------------------------------


def test_an_empty_dump_dir_variable_warns_and_writes_nothing(clean_env, monkeypatch):
    import passkit.errors

    monkeypatch.setattr(passkit.errors, "_warned", set())
    with pytest.warns(ConfigWarning, match="PASSKIT_DUMP_DIR is set but empty"):
        cfg = load_config(environ={"PASSKIT_DUMP_DIR": ""})
    assert cfg.dump_dir is None
    with pytest.raises(passkit.ConfigError, match="dump_dir"):
        load_config(dump_dir="", environ={})
    monkeypatch.setenv("PASSKIT_DUMP_DIR", "")
    compiled = torch.compile(fn, backend=passkit.backend(passes=["cleanup"]))
    compiled(X)
    assert not any(p.name.startswith(("graph_", "run-")) for p in clean_env.iterdir())


def test_a_passkit_yaml_is_named_as_not_read(clean_env):
    (clean_env / "passkit.yaml").write_text("passes: [cleanup]\n")
    with pytest.warns(ConfigWarning, match=r"passkit.yaml is not read: passkit reads passkit.toml"):
        load_config(environ={}, cwd=clean_env)


def test_a_lower_case_variable_is_an_error_naming_the_right_one():
    with pytest.raises(passkit.ConfigError, match="did you mean PASSKIT_PASSES"):
        load_config(environ={"PASSKIT_passes": "cleanup"})
    with pytest.raises(passkit.ConfigError, match="did you mean PASSKIT_VERIFY"):
        load_config(environ={"passkit_verify": "1"})


@pytest.mark.parametrize(
    "config,field",
    [
        ({"disable": ["cleanupp"]}, "disable"),
        ({"plugins": ["passkit-fusoin"]}, "plugins"),
        ({"block_plugins": ["no-such-plugin"]}, "block_plugins"),
    ],
)
def test_unknown_names_in_disable_and_plugin_lists_warn(config, field):
    with pytest.warns(ConfigWarning, match=rf"{field}: no installed .* is named"):
        passkit.build_pipeline(passes=["noop_elimination"], **config)


# -- 6. the numeric verify level -------------------------------------------------------------


def test_numeric_verify_catches_a_value_only_rewrite(graph):
    gm, report = run_pipeline(graph, ["add_to_sub"], verify=True)
    assert report["add_to_sub"].status == "ran"  # no structural check can see it
    gm, report = run_pipeline(graph, ["add_to_sub", "relu_to_clamp"], verify="numeric")
    record = report["add_to_sub"]
    assert record.status == "failed" and "differs from the graph before the pass" in record.reason
    assert report["relu_to_clamp"].status == "ran"  # a rewrite that keeps values passes
    assert report["relu_to_clamp"].modified
    torch.testing.assert_close(_out(gm), fn(X))


def test_numeric_verify_from_the_environment():
    assert load_config(environ={"PASSKIT_VERIFY": "numeric"}).verify == "numeric"
    assert load_config(environ={"PASSKIT_VERIFY": "1"}).verify is True
    assert os.environ.get("PASSKIT_VERIFY") is None
