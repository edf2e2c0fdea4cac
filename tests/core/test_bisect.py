"""The rewrite counter (``bisect_limit``) in-process, and ``passkit bisect`` end to end.

The planted passes (``bisect_support/planted_passes.py``) are a third-party plugin: the
end-to-end tests install it into a throw-away site folder with an entry point, run
``passkit bisect`` on ``bisect_support/bisect_model.py`` in fresh processes, and run the
reproducer it writes from another folder with only that site folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import passkit
from passkit import rewrite_counter
from passkit.cli import main

HERE = Path(__file__).resolve().parent
SUPPORT = HERE / "bisect_support"
N_SITES = 9
sys.path.insert(0, str(SUPPORT))
import bisect_model  # noqa: E402
import planted_passes  # noqa: E402

sys.path.remove(str(SUPPORT))


@pytest.fixture
def planted(clean_env):
    rewrite_counter.reset()
    passkit.register(planted_passes)
    yield
    rewrite_counter.reset()


def _compile(passes, limit):
    """Compile the model (same input each time) with a fresh count; (outputs, report, eager)."""
    rewrite_counter.reset()
    torch._dynamo.reset()
    torch.manual_seed(0)
    fn, example = bisect_model.make()
    b = passkit.backend(passes=passes, compiler="aot_eager", bisect_limit=limit)
    with torch.no_grad():
        out = torch.compile(fn, backend=b)(*example)
    return out, b.reports[-1], fn(*example)


# -- the counter, in-process (cheap) ----------------------------------------------------


def test_graph_pass_rewrites_up_to_the_limit_and_logs_each(planted, caplog):
    caplog.set_level(logging.INFO, logger="passkit")
    out, report, expected = _compile(["planted_graph"], 3)
    record = report["planted_graph"]
    assert record.matches == 3
    assert "bisect_limit 3: 6 of 9 rewrite(s) refused" in record.notes
    counted = rewrite_counter.counted_rewrites()
    assert [r.index for r in counted] == list(range(1, N_SITES + 1))
    assert [r.allowed for r in counted] == [True] * 3 + [False] * 6
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        re.match(
            r"passkit bisect: rewrite 1: pass=planted_graph, stage=post_grad_post, graph=\d+ \(inference\), site=neg neg$",
            line,
        )
        for line in lines
    ), lines
    assert any("rewrite 3: " in line and "the last allowed: limit 3" in line for line in lines), lines
    assert any("limit 3 reached: rewrite 4 REFUSED" in line for line in lines), lines
    # the planted wrong site is the 6th: refused, so the output is right
    torch.testing.assert_close(out, expected)


def test_a_counted_rewrite_carries_its_sites_source_location(planted):
    _compile(["planted_graph"], 6)
    counted = rewrite_counter.counted_rewrites()
    line = next(
        i
        for i, text in enumerate(Path(bisect_model.__file__).read_text().splitlines(), 1)
        if "torch.neg(" in text
    )
    assert {r.location for r in counted} == {f"{bisect_model.__file__}:{line} in f"}, counted[0]


def test_the_limit_moves_the_output_at_the_planted_site(planted):
    assert torch.allclose(_compile(["planted_graph"], 5)[0][0], _compile(["planted_graph"], 0)[0][0])
    wrong, _, expected = _compile(["planted_graph"], 6)
    assert not torch.allclose(wrong[0], expected[0])


def test_pattern_pass_counts_each_match_without_author_code(planted):
    _, report, _ = _compile(["planted_pattern"], 4)
    assert report["planted_pattern"].matches == 4
    counted = rewrite_counter.counted_rewrites()
    assert len(counted) == N_SITES
    assert all(r.site.startswith("pattern 'relu_scale' at ") for r in counted)


def test_a_pass_that_never_asks_is_counted_once(planted):
    (doubled,), report, (expected,) = _compile(["planted_whole"], 1)
    torch.testing.assert_close(doubled, expected * 2)
    (kept,), report, (expected,) = _compile(["planted_whole"], 0)
    torch.testing.assert_close(kept, expected)  # refused: the graph as it was
    record = report["planted_whole"]
    assert (record.status, record.matches, record.modified) == ("ran", 0, False)
    assert record.notes == ["bisect_limit 0: 1 of 1 rewrite(s) refused"]
    (whole,) = rewrite_counter.counted_rewrites()
    assert whole.site.startswith("the whole pass") and not whole.allowed


def test_a_required_pass_is_never_refused_nor_counted(planted):
    (out,), report, (expected,) = _compile(["planted_required"], 0)
    assert report["planted_required"].matches == N_SITES and not report["planted_required"].notes
    assert rewrite_counter.counted_rewrites() == []
    assert not torch.allclose(out, expected)  # its planted wrong site made even at limit 0
    (out,), report, (expected,) = _compile(["planted_graph"], 0)  # the same rewrite, not required
    assert report["planted_graph"].matches == 0 and len(rewrite_counter.counted_rewrites()) == N_SITES
    torch.testing.assert_close(out, expected)


def test_unset_limit_counts_nothing(planted):
    _, report, _ = _compile(["planted_graph", "planted_pattern"], None)
    assert report["planted_graph"].matches == N_SITES and report["planted_pattern"].matches == N_SITES
    assert rewrite_counter.counted_rewrites() == []
    assert passkit.may_rewrite("anything") is True  # outside a pass: always


def test_a_limit_changes_the_cache_identity(planted):
    plain = passkit.build_pipeline(passes=["planted_graph"])
    limited = passkit.build_pipeline(passes=["planted_graph"], bisect_limit=3)
    other = passkit.build_pipeline(passes=["planted_graph"], bisect_limit=4)
    assert len({plain.uuid(), limited.uuid(), other.uuid()}) == 3
    assert plain.uuid() == passkit.build_pipeline(passes=["planted_graph"]).uuid()


@pytest.mark.parametrize("value", ["abc", "-1", "1.5"])
def test_bad_environment_limit_is_one_line(planted, monkeypatch, value):
    monkeypatch.setenv("PASSKIT_BISECT_LIMIT", value)
    with pytest.raises(passkit.ConfigError, match="PASSKIT_BISECT_LIMIT") as err:
        passkit.load_config()
    assert "Traceback" not in str(err.value)


def test_environment_limit_applies(planted, monkeypatch):
    monkeypatch.setenv("PASSKIT_BISECT_LIMIT", "2")
    assert passkit.load_config().bisect_limit == 2


def test_a_pass_that_raises_with_dump_dir_writes_a_replayable_reproducer(planted, tmp_path):
    from passkit_testing import load_graph, make_inputs, replay_pass

    fn, example = bisect_model.make()
    b = passkit.backend(passes=["planted_raise"], compiler="aot_eager", dump_dir=tmp_path / "dumps")
    with torch.no_grad():
        torch.compile(fn, backend=b)(*example)
    assert b.reports[-1]["planted_raise"].status == "failed"
    (folder,) = (tmp_path / "dumps").glob("run-*/graph_*/FAILED_01_planted_raise.repro")
    assert {p.name for p in folder.iterdir()} >= {"graph.py", "repro.json", "test_repro.py"}
    spec = json.loads((folder / "repro.json").read_text())
    assert spec["pass"] == {"name": "planted_raise", "wrong_site": 5}
    assert spec["error"].startswith("RuntimeError: planted failure at neg_5")
    gm = load_graph(folder)  # the graph the pass raised on: it raises there again, at the node
    with pytest.raises(RuntimeError, match=r"planted failure at neg_5$"):  # of the same name
        replay_pass(
            gm, spec["pass"], inputs=make_inputs(spec["inputs"], spec["seed"]), context=spec["context"]
        )


def test_the_crash_reproducer_leaves_a_dynamic_graph_dynamic(planted, tmp_path):
    """Writing the reproducer of a pass that raised reads the graph's sizes without guarding
    on them: ``int()`` of its SymInt once specialized the graph being compiled to one size (a
    host compiling per batch size, SGLang, then served one size's code to every size)."""
    fn, _ = bisect_model.make()
    b = passkit.backend(passes=["planted_raise"], compiler="aot_eager", dump_dir=tmp_path / "dumps")
    compiled = torch.compile(fn, backend=b, dynamic=True)
    with torch.no_grad():
        for rows in (8, 16, 24):
            (out,) = compiled(torch.randn(rows))
            assert out.shape == (rows,)
    assert len(b.reports) == 1, "a size the first compile guarded on was compiled again"
    (folder,) = (tmp_path / "dumps").glob("run-*/graph_*/FAILED_01_planted_raise.repro")
    spec = json.loads((folder / "repro.json").read_text())
    assert [i.get("shape", i.get("value")) for i in spec["inputs"][:2]] == [8, [8]], spec["inputs"]


def test_a_pre_grad_reproducer_records_dynamos_example_values(planted, tmp_path):
    """A pre-grad graph's placeholders carry ``meta["example_value"]``, not ``meta["val"]``:
    the inputs are recorded from it (they were all null), with which want a gradient."""
    from passkit._bisect.repro import Capture

    rewrite_counter.reset()
    torch._dynamo.reset()
    capture = Capture(6)
    capture.install()
    fn, (x,) = bisect_model.make_training()
    b = passkit.backend(passes=["planted_detach"], compiler="aot_eager", bisect_limit=100)
    torch.compile(fn, backend=b)(x.requires_grad_(True)).sum().backward()
    command = capture.write(
        tmp_path / "repro", {"check": "grad", "atol": 1e-5, "rtol": 1e-4, "seed": 0, "target": "t"}
    )
    spec = json.loads((tmp_path / "repro" / "repro.json").read_text())
    assert spec["context"]["stage"] == "pre_grad"
    by_label = {i["label"]: i for i in spec["inputs"]}
    assert by_label["L['self']._parameters['w']"] == {
        "name": "l_self_parameters_w_", "label": "L['self']._parameters['w']", "shape": [8], "dtype": "float32",
        "requires_grad": True,
    }  # fmt: skip
    assert by_label["L['x']"]["shape"] == [4, 8]
    assert command == f"python -m pytest {(tmp_path / 'repro' / 'test_repro.py').resolve()}"
    assert f"Run: {command}\n" in (tmp_path / "repro" / "test_repro.py").read_text()


def test_a_graph_calling_a_submodule_is_refused_in_one_line(tmp_path):
    from passkit._bisect.repro import ReproRefused, write

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.block(x)

    gm = torch.fx.symbolic_trace(Outer())
    ctx = passkit.CompileContext(stage="pre_grad", graph_kind="torch")
    found = {"gm": gm, "pass": planted_passes.PlantedDetach(), "context": ctx, "rewrites": 1, "error": None}
    with pytest.raises(ReproRefused) as err:
        write(tmp_path / "r", found, {"check": "grad", "atol": 0, "rtol": 0, "seed": 0, "target": "t"})
    assert str(err.value) == (
        "stage pre_grad: the graph calls the model's submodule 'block' (Linear), whose code a reproducer does not hold"
    )
    assert not (tmp_path / "r").exists()  # nothing half-written


# -- the command line's refusals (no probe starts) --------------------------------------

TARGET = "bisect_model:make"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--check", "outputs"], "invalid choice: 'outputs'"),
        (["--atol", "-1"], "argument --atol: -1.0 is not >= 0"),
        (["--rtol", "nan"], "argument --rtol: nan is not >= 0"),
        (["--world-size", "0"], "argument --world-size: 0 is not >= 1"),
        (["--world-size", "4096"], "--world-size 4096: more ranks than this machine's"),
        (["--max-compiles", "1"], "--max-compiles 1: a bisect needs at least 2"),
        (["--timeout", "0"], "argument --timeout: 0 is not >= 1"),
        (["--passes", "planted_grpah"], "did you mean 'planted_graph'"),
        (["--repro", "{full}"], "not empty"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(planted, monkeypatch, capsys, tmp_path, extra, expected):
    monkeypatch.syspath_prepend(str(SUPPORT))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    code = main(["bisect", TARGET, *[e.format(full=tmp_path / "full") for e in extra]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and expected in err, err


# -- the driver's conclusions, on canned probes (no process starts) --------------------


def _canned(monkeypatch, results):
    """``Search.probe`` answering from ``results`` (limit -> the probe's dict, merged with
    the defaults a probe returns); the limits asked, in order."""
    from passkit._bisect import COUNT_ALL, search

    asked = []

    def probe(self, limit, **kwargs):
        self.compiles += 1
        asked.append((limit, kwargs))
        base = {"bad": False, "detail": "", "eager_diff": "", "nondeterministic": "", "has_parameters": False}
        base["rewrites"] = [
            {
                "pass_name": "p",
                "stage": "post_grad_post",
                "graph": "1 (inference)",
                "site": f"s{i}",
                "allowed": True,
            }
            for i in range(results.get("n", 0))
        ]
        answer = results.get(limit, results.get("bad_from", None))
        if limit == COUNT_ALL:
            answer = results.get("full", {})
        elif isinstance(answer, int):
            answer = {
                "bad": limit >= answer,
                "detail": "output 0 differs by up to 1" if limit >= answer else "",
            }
        return {**base, **(answer or {})}

    monkeypatch.setattr(search.Search, "probe", probe)
    return asked


def _args(**over):
    import argparse

    base = dict(
        target="t:f",
        passes=None,
        check="output",
        atol=1e-5,
        rtol=1e-4,
        seed=0,
        world_size=1,
        repro=None,
        max_compiles=64,
        timeout=600,
    )
    return argparse.Namespace(**{**base, **over})


def _drive(args, tmp_path, capsys):
    from passkit._bisect import search

    code = search._search(search.Search(args, tmp_path))
    return code, capsys.readouterr().out


def test_zero_rewrites_with_a_bad_check_is_one_line_not_an_index_error(monkeypatch, tmp_path, capsys):
    _canned(monkeypatch, {"n": 0, "full": {"bad": True, "detail": "output 0 differs by up to 3"}})
    code, out = _drive(_args(), tmp_path, capsys)
    assert code == 1
    (line,) = [x for x in out.splitlines() if x.startswith("no culprit")]
    assert line.startswith("no culprit: the passes made no rewrite (0 counted): the check fails with none"), (
        out
    )


def test_a_second_process_that_differs_says_the_target_is_not_deterministic(monkeypatch, tmp_path, capsys):
    asked = _canned(
        monkeypatch, {"n": 9, "full": {"bad": True, "nondeterministic": "output 0 differs by up to 2.5"}}
    )
    code, out = _drive(_args(), tmp_path, capsys)
    assert code == 1 and "culprit: rewrite" not in out
    assert "no culprit: the target is not deterministic: built and run eagerly in two processes" in out, out
    assert asked[1][1] == {"determinism": True}  # the all-rewrites probe checks it


def test_right_outputs_with_parameters_suggest_check_grad(monkeypatch, tmp_path, capsys):
    _canned(monkeypatch, {"n": 9, 0: {"has_parameters": True}})
    code, out = _drive(_args(), tmp_path, capsys)
    assert code == 1
    assert (
        "no culprit: the outputs are right with and without the 9 rewrite(s); the target has parameters: "
        in out
    )
    assert "--check grad" in out and "output wrong without any rewrite" not in out
    _canned(monkeypatch, {"n": 9})
    _, out = _drive(_args(), tmp_path, capsys)
    assert "nothing to bisect with --check output" in out and "--check grad" not in out.split("\n", 1)[1]


def test_the_culprit_ends_with_the_manual_limit_line_and_counts_the_repro_probe(
    monkeypatch, tmp_path, capsys
):
    asked = _canned(monkeypatch, {"n": 9, "full": {"bad": True, "detail": "d"}, "bad_from": 6})
    code, out = _drive(_args(repro=str(tmp_path / "r")), tmp_path, capsys)
    assert code == 0
    assert re.search(r"^culprit: rewrite 6 of 9: pass=p, .*site=s5$", out, re.M), out
    assert out.rstrip().splitlines()[-1] == (
        "by hand (a server, a script): PASSKIT_BISECT_LIMIT=6 makes the culprit rewrite, "
        "PASSKIT_BISECT_LIMIT=5 stops just before it"
    )
    assert f"{len(asked)} compiles" in out and asked[-1][1].get("repro")  # the repro probe counted


def test_a_refused_reproducer_is_one_line_and_exit_1(monkeypatch, tmp_path, capsys):
    _canned(monkeypatch, {"n": 9, "full": {"bad": True, "detail": "d"}, "bad_from": 6})
    from passkit._bisect import search

    real = search.Search.probe

    def probe(self, limit, **kwargs):
        out = real(self, limit, **kwargs)
        return {**out, "repro_refused": "stage pre_grad: why"} if kwargs.get("repro") else out

    monkeypatch.setattr(search.Search, "probe", probe)
    code, out = _drive(_args(repro=str(tmp_path / "r")), tmp_path, capsys)
    assert code == 1 and "no reproducer written: stage pre_grad: why\n" in out, out


@pytest.mark.parametrize("passes", ["planted_grpah", "planted_graph:wrong=1"])
def test_passes_mistakes_read_the_same_in_bisect_and_explain(planted, monkeypatch, capsys, passes):
    monkeypatch.syspath_prepend(str(SUPPORT))
    lines = []
    for command in ("bisect", "explain"):
        assert main([command, TARGET, "--passes", passes]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        lines.append(line.removeprefix(f"passkit {command}: error: "))
    assert lines[0] == lines[1] and lines[0].startswith(f"--passes: unknown pass {passes!r}"), lines


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["bisect"], "give the target MODULE:FUNCTION, or --run CMD"),
        (["bisect", TARGET, "--run", "true"], "--run and a target (bisect_model:make) both given"),
        (["bisect", "--run", " "], "--run ' ': empty"),
        (["bisect", "--run", "true", "--repro", "r"], "--repro does not apply with --run"),
        (["bisect", "--run", "true", "--world-size", "2"], "--world-size does not apply with --run"),
        (["bisect", "--run", "true", "--passes", "cleanup"], "--passes does not apply with --run"),
        (["bisect", "--run", "true", "--check", "grad"], "--check does not apply with --run"),
        (["bisect", "--run", "true", "--timeout", "0"], "argument --timeout: 0 is not >= 1"),
        (["bisect", "--run"], "argument --run: expected one argument"),
    ],
)
def test_bad_run_options_are_one_line_and_exit_2(planted, monkeypatch, capsys, argv, expected):
    monkeypatch.syspath_prepend(str(SUPPORT))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and expected in err, err


def test_run_kills_the_commands_process_group_past_its_timeout(monkeypatch, capsys, tmp_path):
    """A command that hangs (and leaves a child behind) is ended, children too, at
    ``--timeout``: one line, exit 2."""
    pid_file = tmp_path / "child.pid"
    command = f"sleep 300 & echo $! > {pid_file}; wait"
    start = __import__("time").monotonic()
    assert main(["bisect", "--run", command, "--timeout", "1"]) == 2
    assert __import__("time").monotonic() - start < 30
    err = capsys.readouterr().err
    assert "ran past --timeout 1 s at PASSKIT_BISECT_LIMIT=0 (its process group was killed)" in err, err
    child = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_run_with_a_command_that_makes_no_rewrite_says_so(monkeypatch, capsys):
    assert main(["bisect", "--run", "true"]) == 1
    out = capsys.readouterr().out
    assert "no culprit: the command made no rewrite" in out and "1 runs" in out, out


# -- end to end: fresh processes --------------------------------------------------------


@pytest.fixture
def site(tmp_path):
    """The planted plugin installed (a module and its dist-info entry point) in a folder of
    its own; returns that folder."""
    folder = tmp_path / "site"
    info = folder / "planted_passes-0.1.dist-info"
    info.mkdir(parents=True)
    (folder / "planted_passes.py").write_text((SUPPORT / "planted_passes.py").read_text())
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: planted-passes\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[passkit.passes]\nplanted = planted_passes\n")
    return folder


def _env(site: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PASSKIT_")}
    env.update(PYTHONPATH=str(site), **extra)
    return env


def _bisect(site: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "passkit.cli", "bisect", *args],
        cwd=SUPPORT,
        env=_env(site, **env),
        capture_output=True,
        text=True,
        timeout=1500,
    )


def _culprit(done: subprocess.CompletedProcess[str]) -> tuple[re.Match[str], int]:
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.search(
        r"^culprit: rewrite (\d+) of (\d+): pass=(\S+), stage=(\S+), graph=(.+?), site=(.+?)(?:, source=(.+))?$",
        done.stdout,
        re.M,
    )
    compiles = re.search(r"^(\d+) compiles$", done.stdout, re.M)
    assert found and compiles, done.stdout
    return found, int(compiles.group(1))


def _budget(n: int) -> int:
    return math.ceil(math.log2(n + 1)) + 2


@pytest.mark.slow
def test_bisect_names_the_planted_site_of_a_graph_pass(site):
    done = _bisect(site, TARGET, PASSKIT_PASSES="planted_graph", PASSKIT_COMPILER="aot_eager")
    found, compiles = _culprit(done)
    assert found.group(1, 2, 3, 4) == ("6", str(N_SITES), "planted_graph", "post_grad_post"), done.stdout
    assert found.group(6) == "neg neg_5"
    assert compiles <= _budget(N_SITES)


def _run_repro(folder: Path, site: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder / "test_repro.py")],
        cwd=cwd,
        env=_env(site),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_bisect_names_the_planted_match_of_a_pattern_pass_and_writes_a_repro(site, tmp_path):
    repro = tmp_path / "repro"
    done = _bisect(
        site, TARGET, "--repro", str(repro), PASSKIT_PASSES="planted_pattern", PASSKIT_COMPILER="aot_eager"
    )
    found, compiles = _culprit(done)
    # Inductor's matcher walks the graph from its end: the 6th scale's site is the 4th match
    assert found.group(1, 3) == ("4", "planted_pattern"), done.stdout
    assert found.group(6).startswith("pattern 'relu_scale' at ")
    assert compiles <= _budget(N_SITES)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    failing = _run_repro(repro, site, elsewhere)
    assert failing.returncode == 1 and "1 failed" in failing.stdout, failing.stdout + failing.stderr
    plugin = site / "planted_passes.py"
    plugin.write_text(plugin.read_text().replace("PLANTED = True", "PLANTED = False"))
    passing = _run_repro(repro, site, elsewhere)
    assert passing.returncode == 0 and "1 passed" in passing.stdout, passing.stdout + passing.stderr


@pytest.mark.slow
def test_bisect_check_compile_finds_the_rewrite_inductor_rejects(site, tmp_path):
    repro = tmp_path / "repro"
    done = _bisect(site, TARGET, "--check", "compile", "--repro", str(repro), PASSKIT_PASSES="planted_crash")
    found, compiles = _culprit(done)
    assert found.group(1, 3) == ("6", "planted_crash"), done.stdout
    assert "Inductor failed on the graph this pass changed" in done.stdout
    assert compiles <= _budget(N_SITES)
    failing = _run_repro(repro, site, tmp_path)  # lowered by Inductor: rejected as in the model
    assert failing.returncode == 1 and "is not an OpOverload" in failing.stdout, failing.stdout
    plugin = site / "planted_passes.py"
    plugin.write_text(plugin.read_text().replace("PLANTED = True", "PLANTED = False"))
    passing = _run_repro(repro, site, tmp_path)
    assert passing.returncode == 0, passing.stdout + passing.stderr


@pytest.mark.slow
def test_the_crash_reproducer_of_a_pass_that_raised_runs_on_its_own(site, tmp_path):
    """A user's program compiles with a pass that raises and ``dump_dir`` set: the pass is left
    out (the program runs on), and the reproducer written beside the dumps fails with the
    pass's error from a folder without the model, then passes once the bug is removed."""
    dumps = tmp_path / "dumps"
    program = (
        "import torch, passkit, bisect_model\n"
        "fn, example = bisect_model.make()\n"
        "with torch.no_grad():\n"
        "    torch.compile(fn, backend=passkit.backend(compiler='aot_eager'))(*example)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        cwd=SUPPORT,
        env=_env(site, PASSKIT_PASSES="planted_raise", PASSKIT_DUMP_DIR=str(dumps)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    (folder,) = dumps.glob("**/FAILED_01_planted_raise.repro")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    failing = _run_repro(folder, site, elsewhere)
    assert failing.returncode == 1 and "planted failure at neg_5" in failing.stdout, failing.stdout
    plugin = site / "planted_passes.py"
    plugin.write_text(plugin.read_text().replace("PLANTED = True", "PLANTED = False"))
    passing = _run_repro(folder, site, elsewhere)
    assert passing.returncode == 0 and "1 passed" in passing.stdout, passing.stdout + passing.stderr


GRADIENT_ONLY = [  # the planted pass, its stage, what its graph is called in the culprit line
    ("planted_detach", "pre_grad", "(torch)"),
    ("planted_joint", "joint", "(joint)"),
    ("planted_grad", "post_grad_post", "(backward)"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("pass_name", "stage", "kind"), GRADIENT_ONLY, ids=[g[1] for g in GRADIENT_ONLY])
def test_bisect_check_grad_writes_a_repro_of_a_gradient_only_bug(site, tmp_path, pass_name, stage, kind):
    """A rewrite whose forward is exact and one gradient wrong, at each stage: ``--check grad``
    names it and the gradient; the reproducer fails on its own, from a folder without the
    model, and passes once the planted bug is removed."""
    repro = tmp_path / "repro"
    done = _bisect(
        site,
        "bisect_model:make_training",
        "--check",
        "grad",
        "--repro",
        str(repro),
        PASSKIT_PASSES=pass_name,
        PASSKIT_COMPILER="aot_eager",
    )
    found, compiles = _culprit(done)
    assert found.group(3, 4) == (pass_name, stage) and kind in found.group(5), done.stdout
    assert "with it: the gradient of parameter 'w' differs by up to" in done.stdout, done.stdout
    assert compiles <= _budget(2 * N_SITES) + 1  # the reproducer's probe counted
    limit = int(found.group(1))
    assert f"PASSKIT_BISECT_LIMIT={limit} makes the culprit rewrite" in done.stdout
    spec = json.loads((repro / "repro.json").read_text())
    assert spec["context"]["stage"] == stage and spec["check"] == "grad"
    assert all(i.get("shape") is not None for i in spec["inputs"]), spec["inputs"]  # no nulls
    test = (repro / "test_repro.py").read_text()
    assert f"Run: python -m pytest {repro.resolve() / 'test_repro.py'}\n" in test, test[:600]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    failing = _run_repro(repro, site, elsewhere)
    assert failing.returncode == 1 and "1 failed" in failing.stdout, failing.stdout + failing.stderr
    assert "the gradient of " in failing.stdout, failing.stdout  # the tensor named
    plugin = site / "planted_passes.py"
    plugin.write_text(plugin.read_text().replace("PLANTED = True", "PLANTED = False"))
    passing = _run_repro(repro, site, elsewhere)
    assert passing.returncode == 0 and "1 passed" in passing.stdout, passing.stdout + passing.stderr


@pytest.mark.slow
def test_check_output_on_a_gradient_only_bug_suggests_check_grad(site):
    done = _bisect(
        site, "bisect_model:make_training", PASSKIT_PASSES="planted_detach", PASSKIT_COMPILER="aot_eager"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "no culprit: the outputs are right with and without the 9 rewrite(s); the target has parameters: "
        "a pass wrong only in gradients shows with --check grad"
    ) in done.stdout, done.stdout
    assert "output wrong without any rewrite" not in done.stdout


@pytest.mark.slow
def test_bisect_says_a_target_that_draws_unseeded_weights_is_not_deterministic(site):
    done = _bisect(
        site,
        "bisect_model:make_unseeded",
        "--check",
        "grad",
        PASSKIT_PASSES="planted_detach",
        PASSKIT_COMPILER="aot_eager",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("no culprit")]
    assert "the target is not deterministic" in line and "the gradient of" in line, done.stdout
    assert "culprit: rewrite" not in done.stdout and "2 compiles" in done.stdout


@pytest.mark.slow
def test_bisect_with_no_rewrite_says_so_in_one_line(site):
    """No site of the pass in the target: 0 rewrites counted (this ended in an IndexError when
    the check failed with all of them)."""
    done = _bisect(
        site, "bisect_model:make_training", PASSKIT_PASSES="planted_graph", PASSKIT_COMPILER="aot_eager"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no culprit: the passes made no rewrite (0 counted)" in done.stdout, done.stdout
    assert "Traceback" not in done.stdout + done.stderr


@pytest.mark.slow
def test_bisect_run_finds_the_planted_culprit_through_a_shell_command(site):
    """``--run`` over a user's check script (exit 0 when the compiled output equals eager's):
    the planted 6th site named, from the command's own warnings, and the manual line."""
    done = _bisect(
        site,
        "--run",
        f"{sys.executable} run_check.py",
        "--timeout",
        "300",
        PASSKIT_PASSES="planted_graph",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(
        r"^culprit: rewrite 6: pass=planted_graph, stage=post_grad_post, graph=.*, site=neg neg_5$",
        done.stdout,
        re.M,
    ), done.stdout
    assert f"by hand: PASSKIT_BISECT_LIMIT=6 {sys.executable} run_check.py fails" in done.stdout
    runs = int(re.search(r"^(\d+) runs$", done.stdout, re.M).group(1))
    assert runs <= 2 * math.ceil(math.log2(N_SITES)) + 1, done.stdout


@pytest.mark.slow
def test_bisect_says_when_no_rewrite_is_the_cause(site):
    done = _bisect(site, TARGET, PASSKIT_PASSES="planted_graph:wrong_site=99", PASSKIT_COMPILER="aot_eager")
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "no culprit: the outputs are right with and without the 9 rewrite(s): nothing to bisect with --check output"
    ) in done.stdout, done.stdout
    assert "2 compiles" in done.stdout


@pytest.mark.slow
def test_bisect_names_the_wrong_site_of_allreduce_rmsnorm_in_a_gloo_world(site):
    """passkit-fusion's pass asks per all-reduce site; the target plants a wrong result in
    the fused op's reference path at its 6th site, and two gloo ranks run each probe."""
    done = _bisect(
        site,
        "tp_model:make",
        "--world-size",
        "2",
        PASSKIT_PASSES='allreduce_rmsnorm:implementation="reference"',
        PASSKIT_COMPILER="aot_eager",
    )
    found, compiles = _culprit(done)
    assert found.group(1, 2, 3) == ("6", "8", "allreduce_rmsnorm"), done.stdout
    assert found.group(6) == "allreduce_rmsnorm at all-reduce all_reduce_5"
    assert compiles <= _budget(8)
