"""One report per compiled graph, saying what every stage's passes did, as a new user sees
it: pre-grad and post-grad passes on one model give one report, which
``passkit.last_report()`` returns; a warm start of a pre-grad-only config reports the
pre-grad work without a warning; the named backend with no pass says so once, naming where
passkit looked; the table makes room for a long pass name."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import passkit
from passkit.report import PassRecord, Report

pytest.importorskip("passkit_example", reason="the example plugin is installed by `nox -s tests`")


def swish(x):
    return x * torch.sigmoid(x) + 1


def test_pre_grad_and_post_grad_passes_give_one_report_that_last_report_returns():
    backend = passkit.backend(passes=["silu_from_sigmoid", "cleanup"])
    with torch.no_grad():
        x = torch.randn(8)
        torch.testing.assert_close(torch.compile(swish, backend=backend)(x), swish(x))
    (report,) = backend.reports
    assert passkit.last_report() is report and backend.last_report is report
    assert [(r.name, r.stage, r.graph_kind, r.status) for r in report.records] == [
        ("silu_from_sigmoid", "pre_grad", "torch", "ran"),
        ("cleanup", "post_grad_post", "inference", "ran"),
    ]
    assert report["silu_from_sigmoid"].matches == 1
    assert report.graph_kind == "inference" and report.compile_s is not None
    text = report.format()
    assert text.startswith(f"passkit report (graph {report.graph_id}, inductor)\n")
    assert "silu_from_sigmoid" in text and "cleanup" in text


def test_a_training_compile_is_one_report_of_every_stage_on_every_graph():
    backend = passkit.backend(passes=["silu_from_sigmoid", "fold_double_neg_joint", "cleanup"], mode="eager")

    def fn(x, w):
        y = x @ w
        return torch.neg(torch.neg(y * torch.sigmoid(y))).sum()

    w = torch.randn(8, 8, requires_grad=True)
    torch.compile(fn, backend=backend)(torch.randn(4, 8), w).backward()
    # the compile's report, then the backward graph's: AOTAutograd compiles it at the first
    # backward call, after the compile returned
    report, backward = backend.reports
    assert report.graph_kind == "training" and backward.graph_kind == "backward"
    assert [(r.name, r.graph_kind) for r in report.records] == [
        ("silu_from_sigmoid", "torch"),
        ("fold_double_neg_joint", "joint"),
        ("cleanup", "forward"),
    ]
    assert report["silu_from_sigmoid"].matches == 1 and report["fold_double_neg_joint"].matches == 2
    assert backward.record("cleanup", "backward").status == "ran"
    assert passkit.last_report() is backward
    assert f"the backward graph of graph {report.graph_id}" in backward.format()
    with pytest.raises(KeyError, match="no record on a inference graph"):
        report.record("cleanup", "inference")


def test_a_report_spanning_forward_and_backward_has_a_graph_column():
    records = [
        PassRecord(name="cleanup", stage="post_grad_post", status="ran", graph_kind=kind)
        for kind in ("forward", "backward")
    ]
    header, _, *rows = Report(records=records, graph_kind="training").format().splitlines()[1:-1]
    assert header.split()[:3] == ["pass", "stage", "graph"]
    assert [row.split()[2] for row in rows] == ["forward", "backward"]


def test_a_long_pass_name_widens_its_column():
    name = "a_pass_with_a_long_name_x"  # 25 characters
    report = Report(
        records=[
            PassRecord(
                name=name, stage="post_grad_post", status="ran", matches=3, nodes_before=9, nodes_after=7
            ),
            PassRecord(name="cleanup", stage="pre_grad", status="skipped", reason="why"),
        ]
    )
    header, rule, *rows, _total = report.format().splitlines()[1:]
    assert len(rule) == len(header)
    for column in ("stage", "status", "matches", "nodes", "note"):
        at = header.index(column)
        assert header[at - 1] == " ", column
    stage_at = header.index("stage")
    assert rows[0][:stage_at] == f"{name} " and rows[0][stage_at:].startswith("post_grad_post ")
    assert rows[1][stage_at:].startswith("pre_grad ")
    assert rows[0].index("9->7") + len("9->7") == header.index("nodes") + len("nodes")


def test_a_warm_start_of_a_pre_grad_only_config_reports_its_work_without_a_warning(
    monkeypatch, tmp_path, caplog
):
    """A second compile served from Inductor's cache (the kernel is test 1's: compiled once)."""
    import torch._functorch.config
    import torch._inductor.config
    from torch._dynamo.utils import counters

    monkeypatch.setenv("PASSKIT_CACHE_DIR", str(tmp_path / "reports"))
    for start in ("cold", "warm"):
        torch._dynamo.reset()
        hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
        backend = passkit.backend(passes=["silu_from_sigmoid"])
        with (
            torch._inductor.config.patch(fx_graph_cache=True),
            torch._functorch.config.patch(enable_autograd_cache=True),
            torch.no_grad(),
            caplog.at_level("WARNING", logger="passkit"),
        ):
            torch.compile(swish, backend=backend)(torch.randn(8))
        (report,) = backend.reports
        assert passkit.last_report() is report, start
        assert [(r.name, r.status, r.matches) for r in report.records] == [("silu_from_sigmoid", "ran", 1)]
        assert "report cache has no report" not in caplog.text, start
    served = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    assert served > hits, "the second compile was not served from Inductor's cache"


# -- a fresh process: the named backend's first compile ----------------------------------------

NAMED_NO_PASS = """
import torch, passkit

for fn in (lambda x: torch.relu(x) + 1, lambda x: torch.tanh(x) * 2):
    torch.compile(fn, backend="passkit")(torch.randn(8))
print("last_report:", passkit.last_report())
"""


def _run(code: str, cwd, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PASSKIT_")}
    clean.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        env=clean,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )


def test_the_named_backend_with_no_pass_says_so_once_and_where_it_looked(tmp_path):
    proc = _run(NAMED_NO_PASS, tmp_path, PASSKIT_COMPILER="aot_eager")  # a config, but no passes
    assert proc.returncode == 0, proc.stderr
    assert "last_report: None" in proc.stdout
    said = [line for line in proc.stderr.splitlines() if "no pass is enabled" in line]
    assert len(said) == 2, proc.stderr  # the log line and the ConfigWarning, once each
    for where in (
        "no config source sets `passes`",
        "passkit.toml",
        "pyproject.toml [tool.passkit]",
        str(tmp_path),
        "PASSKIT_COMPILER",
        "backend's arguments (given: none)",
    ):
        assert where in said[0], (where, said[0])


def test_an_explicitly_empty_pass_list_is_no_mistake(clean_env, recwarn):
    passkit.backend(passes=[])
    assert not [w for w in recwarn if "no pass is enabled" in str(w.message)]
    (clean_env / "passkit.toml").write_text("passes = []\n")
    with pytest.warns(passkit.ConfigWarning, match=r"`passes` from .*passkit.toml is empty"):
        passkit.backend()
