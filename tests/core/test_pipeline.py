"""The pass manager: ordering, instrumentation, isolation, dumps, verification, uuid."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import passkit
from passkit._pipeline.dump import graph_folder
from passkit.graph_utils import graph_code

from .support import register_all, small_fn

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _plugins(clean_env):
    register_all()


def traced(fn=small_fn, *args):
    """An ATen graph module with fake-tensor meta, as Inductor hands to post-grad passes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    args = args or (torch.randn(4, 8),)
    with torch.no_grad():
        gm = make_fx(fn, tracing_mode="fake")(*args)
    return gm, args


def test_order_follows_config_within_stage_and_pre_first():
    p = passkit.build_pipeline(passes=["cleanup", "pre_pass", "noop_elimination"])
    assert p.names() == ["pre_pass", "cleanup", "noop_elimination"]
    assert [s.value for s in p.stages] == ["post_grad_pre", "post_grad_post"]


def test_order_violation_is_an_error():
    with pytest.raises(
        passkit.OrderError, match=r"'first' must run before 'second' .first declares before=.'second'.."
    ):
        passkit.build_pipeline(passes=["second", "first"])
    assert passkit.build_pipeline(passes=["first", "second"]).names() == ["first", "second"]


def test_cycle_is_an_error(monkeypatch):
    from .support import Second

    monkeypatch.setattr(Second, "before", ("first",))
    with pytest.raises(passkit.OrderError, match=r"cycle: first -> second -> first"):
        passkit.build_pipeline(passes=["first", "second"])


def test_report_records_status_matches_nodes_and_time():
    gm, (x,) = traced()
    pipeline = passkit.build_pipeline(passes=["pre_pass", "mul_to_scale", "needs_cuda", "cleanup"])
    report = pipeline.run(gm)
    assert report.names() == ["pre_pass", "mul_to_scale", "needs_cuda", "cleanup"]
    rec = report["mul_to_scale"]
    assert rec.status == "ran" and rec.matches == 1 and rec.modified and rec.ms > 0
    assert rec.nodes_before == rec.nodes_after > 0
    assert report["needs_cuda"].status == "skipped" and "needs CUDA" in report["needs_cuda"].reason
    assert report["pre_pass"].notes == ["pre stage ran"]
    torch.testing.assert_close(gm(x)[0] if isinstance(gm(x), tuple) else gm(x), torch.relu(x * 2.0) + 1.0)
    assert json.loads(report.to_json())["passes"][1]["matches"] == 1
    assert passkit.last_report() is report


def test_failing_pass_is_rolled_back_exactly_and_the_rest_runs(tmp_path):
    gm, (_x,) = traced()
    before = graph_code(gm)
    pipeline = passkit.build_pipeline(passes=["halfway_then_fail", "mul_to_scale"], dump_dir=tmp_path)
    report = pipeline.run(gm)
    failed = report["halfway_then_fail"]
    assert failed.status == "failed" and "boom in the middle" in failed.reason
    assert report["mul_to_scale"].status == "ran"
    assert graph_code(gm) == before.replace("3.0", "2.0")  # only the second pass's change
    repro = graph_folder(tmp_path, report.graph_id) / "FAILED_01_halfway_then_fail.repro.py"
    assert failed.reproducer == str(repro)
    text = repro.read_text()
    assert "PASS_NAME = 'halfway_then_fail'" in text and "boom in the middle" in text
    assert "torch.ops.aten.relu.default" in text  # the pre-pass graph is in it
    compile(text, str(repro), "exec")


def test_on_error_raise_names_pass_and_predecessors():
    gm, _ = traced()
    before = graph_code(gm)
    pipeline = passkit.build_pipeline(passes=["mul_to_scale", "halfway_then_fail"], on_error="raise")
    with pytest.raises(passkit.PassFailedError) as exc:
        pipeline.run(gm)
    assert exc.value.pass_name == "halfway_then_fail" and exc.value.ran_before == ["mul_to_scale"]
    assert "Passes that ran before it: ['mul_to_scale']" in str(exc.value)
    assert graph_code(gm) == before.replace("3.0", "2.0")


def test_dumps_before_after_diff_and_report(tmp_path):
    gm, _ = traced()
    report = passkit.build_pipeline(passes=["mul_to_scale"], dump_dir=tmp_path).run(gm)
    folder = graph_folder(tmp_path, report.graph_id)  # <dump_dir>/run-...-pid<PID>/graph_NNN
    assert folder.parent.parent == tmp_path and folder.parent.name.startswith("run-")
    stage = folder / "post_grad_post"  # one folder per stage, one file per snapshot
    assert "3.0" in (stage / "01_mul_to_scale.before.py").read_text()
    assert "2.0" in (stage / "01_mul_to_scale.after.py").read_text()
    diff = (stage / "01_mul_to_scale.diff").read_text()
    assert "-" in diff and "+" in diff and "2.0" in diff
    assert json.loads((folder / "report.json").read_text())["passes"][0]["name"] == "mul_to_scale"


def test_dumps_are_a_tree_of_stages_with_each_snapshot_once(tmp_path):
    """One folder per stage, one file per snapshot: a pass whose graph before it is the
    previous pass's graph after gets no ``.before.py`` of its own; where the filters left the
    previous pass out, it does. :func:`passkit.dumps.pass_graphs` reads either."""
    gm, _ = traced()
    passes = ["pre_pass", "mul_to_scale", "cleanup"]
    report = passkit.build_pipeline(passes=passes, dump_dir=tmp_path / "all").run(gm)
    folder = graph_folder(tmp_path / "all", report.graph_id)
    tree = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert tree == [
        "post_grad_post/02_mul_to_scale.after.py",
        "post_grad_post/02_mul_to_scale.before.py",
        "post_grad_post/02_mul_to_scale.diff",
        "post_grad_post/03_cleanup.after.py",
        "post_grad_post/03_cleanup.diff",
        "post_grad_pre/01_pre_pass.after.py",
        "post_grad_pre/01_pre_pass.before.py",
        "post_grad_pre/01_pre_pass.diff",
        "report.json",
    ]
    scaled = (folder / "post_grad_post/02_mul_to_scale.after.py").read_text()
    assert passkit.dumps.pass_graphs(folder, "cleanup")[0] == scaled
    assert "3.0" in passkit.dumps.pass_graphs(folder, "mul_to_scale")[0] and "2.0" in scaled

    gm, _ = traced()
    only = passkit.build_pipeline(passes=passes, dump_dir=tmp_path / "one", dump_passes=["cleanup"]).run(gm)
    folder = graph_folder(tmp_path / "one", only.graph_id)
    assert sorted(p.name for p in (folder / "post_grad_post").iterdir()) == [
        "03_cleanup.after.py",
        "03_cleanup.before.py",
        "03_cleanup.diff",
    ]
    assert passkit.dumps.pass_graphs(folder, "cleanup")[0] == scaled
    with pytest.raises(FileNotFoundError, match="no snapshot of pass 'mul_to_scale'"):
        passkit.dumps.pass_graphs(folder, "mul_to_scale")


def _dumped(folder):
    """The graph folder's entries (reproducers) and its stage folders' snapshot files."""
    stages = [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("FAILED_")]
    top = [p.name for p in folder.iterdir() if p.name != "report.json" and p not in stages]
    return sorted(top + [f.name for stage in stages for f in stage.iterdir()])


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({}, ["01_mul_to_scale", "02_first", "FAILED_03_halfway_then_fail"]),
        ({"dump_when": "changed"}, ["01_mul_to_scale", "FAILED_03_halfway_then_fail"]),
        ({"dump_when": "failed"}, ["FAILED_03_halfway_then_fail"]),
        ({"dump_passes": ["first"]}, ["02_first"]),
        (
            {"dump_passes": ["mul_to_scale", "halfway_then_fail"], "dump_when": "changed"},
            ["01_mul_to_scale", "FAILED_03_halfway_then_fail"],
        ),
    ],
)
def test_dump_filters_choose_which_passes_are_dumped(tmp_path, settings, expected):
    gm, _ = traced()
    pipeline = passkit.build_pipeline(
        passes=["mul_to_scale", "first", "halfway_then_fail"], dump_dir=tmp_path, **settings
    )
    report = pipeline.run(gm)
    folder = graph_folder(tmp_path, report.graph_id)
    stems = sorted({name.split(".")[0] for name in _dumped(folder)})
    assert stems == expected, _dumped(folder)
    assert (folder / "report.json").exists()  # whatever the filters say


def test_dump_filters_from_the_environment_and_an_unmatched_name_warns(clean_env, monkeypatch):
    monkeypatch.setenv("PASSKIT_DUMP_WHEN", "changed")
    monkeypatch.setenv("PASSKIT_DUMP_PASSES", "mul_to_scale,mul_to_sacle")
    cfg = passkit.load_config()
    assert (cfg.dump_when, cfg.dump_passes) == ("changed", ["mul_to_scale", "mul_to_sacle"])
    with pytest.warns(
        passkit.ConfigWarning,
        match=r"dump_passes: 'mul_to_sacle' is not an enabled pass \(enabled: mul_to_scale\)",
    ):
        passkit.build_pipeline(passes=["mul_to_scale"])
    monkeypatch.setenv("PASSKIT_DUMP_WHEN", "sometimes")
    with pytest.raises(passkit.ConfigError, match=r"PASSKIT_DUMP_WHEN .*'always', 'changed' or 'failed'"):
        passkit.load_config()  # the config's own wording for a field of choices


def test_verify_catches_wrong_metadata():
    gm, _ = traced()
    report = passkit.build_pipeline(passes=["bad_meta"], verify=True).run(gm)
    rec = report["bad_meta"]
    assert rec.status == "failed" and "VerificationError" in rec.reason and "relu" in rec.reason
    # and the graph's meta was restored along with the graph
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    assert tuple(relu.meta["val"].shape) == (4, 8)


def test_verify_passes_on_correct_rewrites():
    gm, _ = traced()
    report = passkit.build_pipeline(passes=["mul_to_scale", "noop_elimination", "cleanup"], verify=True).run(
        gm
    )
    assert not report.failed


def test_hooks_veto_after_and_failed_and_report():
    seen = []

    class Spy:
        @passkit.hookimpl
        def passkit_before_pass(self, pass_, gm, context):
            return "vetoed by spy" if pass_.name == "cleanup" else None

        @passkit.hookimpl
        def passkit_after_pass(self, pass_, gm, result, record):
            seen.append(("after", pass_.name, result.matches))

        @passkit.hookimpl
        def passkit_pass_failed(self, pass_, gm, error, record):
            seen.append(("failed", pass_.name, type(error).__name__))

        @passkit.hookimpl
        def passkit_report(self, report):
            seen.append(("report", tuple(report.names())))

        @passkit.hookimpl
        def passkit_configure_pipeline(self, plan, context):
            plan.set_options("mul_to_scale", factor=7.0)

    passkit.register(Spy())
    gm, (_x,) = traced()
    report = passkit.build_pipeline(passes=["mul_to_scale", "halfway_then_fail", "cleanup"]).run(gm)
    assert report["cleanup"].status == "vetoed" and report["cleanup"].reason == "vetoed by spy"
    assert seen == [
        ("after", "mul_to_scale", 1),
        ("failed", "halfway_then_fail", "RuntimeError"),
        ("report", ("mul_to_scale", "halfway_then_fail", "cleanup")),
    ]
    assert "7.0" in graph_code(gm)


def test_configure_hook_can_skip_with_reason():
    class Skipper:
        @passkit.hookimpl
        def passkit_configure_pipeline(self, plan, context):
            if context.world_size == 1:
                plan.skip("mul_to_scale", "single process")

    passkit.register(Skipper())
    gm, _ = traced()
    rec = passkit.build_pipeline(passes=["mul_to_scale"]).run(gm)["mul_to_scale"]
    assert rec.status == "skipped" and rec.reason == "single process"


def _uuid(**cfg):
    return passkit.build_pipeline(**cfg).custom_pass(passkit.Stage.POST).uuid()


def test_uuid_stable_and_sensitive():
    a = _uuid(passes=["mul_to_scale", "cleanup"])
    assert a == _uuid(passes=["mul_to_scale", "cleanup"])
    assert a != _uuid(passes=[{"name": "mul_to_scale", "factor": 3.0}, "cleanup"])  # options
    assert a != _uuid(passes=["cleanup", "mul_to_scale"])  # order
    assert a != _uuid(passes=["mul_to_scale"])  # passes
    # asked diagnostics are identity (with the process): never served from a compile without them
    assert a != _uuid(passes=["mul_to_scale", "cleanup"], dump_dir="x")
    assert a != _uuid(passes=["mul_to_scale", "cleanup"], verify=True)


def test_uuid_changes_with_distribution_version(monkeypatch):
    import dataclasses

    p = passkit.build_pipeline(passes=["cleanup"])
    info = p.plugins.passes["cleanup"]
    monkeypatch.setitem(
        p.plugins.passes,
        "cleanup",
        dataclasses.replace(info, plugin=dataclasses.replace(info.plugin, version="9.9")),
    )
    assert passkit.Pipeline(p.config, p.plugins, list(p.passes)).uuid() != p.uuid()


def test_uuid_changes_with_source(monkeypatch):
    from passkit import pass_base

    p = passkit.build_pipeline(passes=["cleanup"])
    monkeypatch.setattr(pass_base, "source_hash", lambda cls: "edited")
    assert passkit.Pipeline(p.config, p.plugins, list(p.passes)).uuid() != p.uuid()


def test_uuid_is_computed_once_not_per_call(monkeypatch):
    p = passkit.build_pipeline(passes=["cleanup"])
    stage = p.custom_pass(passkit.Stage.POST)
    calls = []
    monkeypatch.setattr(p, "_compute_uuid", lambda: calls.append(1) or "x")
    for _ in range(100):
        stage.uuid()
    assert calls == []


def test_uuid_equal_across_processes():
    code = "import passkit;print(passkit.build_pipeline(passes=['noop_elimination','cleanup']).uuid())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == passkit.build_pipeline(passes=["noop_elimination", "cleanup"]).uuid()


def test_no_pass_means_nothing_installed():
    p = passkit.build_pipeline()
    assert not p.enabled and p.inductor_patches() == {}
