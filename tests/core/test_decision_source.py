"""A pass says where its token-range decision came from (``Pass.decision_source``): every
record of it carries that word (``PassRecord.decision``), ran or skipped, in ``report.json``,
in the printed report, in passkit's report cache, and in the report of a compile the host
ran without the passes. Which words exist is the pass's business, never the core's."""

from __future__ import annotations

import json

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import passkit
from passkit import TokenConstraint, TokenRange
from passkit._compile import report_cache
from passkit._pipeline.build import Pipeline
from passkit._plugins.registry import get_plugins
from passkit.config import load_config

aten = torch.ops.aten


class Decides(passkit.GraphPass):
    """relu -> sigmoid up to 16 tokens; its bound came from ``source`` (it says so)."""

    name = "decides"
    tokens = TokenConstraint(max_tokens=16)
    source = "stored"

    def decision_source(self, ctx):
        return self.source

    def run(self, gm, ctx):
        n = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=aten.relu.default)):
            node.target = aten.sigmoid.default
            n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


class DecidesOnCuda(Decides):
    """The same, needing CUDA: skipped on this CPU graph, still saying where its range came from."""

    name = "decides_on_cuda"
    requires = passkit.Requirements(cuda=True)
    source = "table"


class Silent(passkit.GraphPass):
    """Says nothing about a decision (the default)."""

    name = "silent"

    def run(self, gm, ctx):
        return passkit.PassResult.unchanged("nothing to do")


def pipeline(token_range: TokenRange | None = None) -> Pipeline:
    built = Pipeline(load_config({}), get_plugins(), [Decides(), DecidesOnCuda(), Silent()])
    return built.for_range(token_range, label=str(token_range)) if token_range else built


def graph() -> torch.fx.GraphModule:
    with torch.no_grad():
        return make_fx(lambda x: torch.relu(x) + 1, tracing_mode="fake")(torch.randn(4, 8))


def test_every_record_says_where_the_pass_range_came_from_ran_or_skipped(clean_env):
    report = pipeline().run(graph())
    assert [(r.name, r.status, r.decision) for r in report.records] == [
        ("decides", "ran", "stored"),
        ("decides_on_cuda", "skipped", "table"),
        ("silent", "ran", None),
    ]
    # a compile for counts the pass does not apply to: skipped for the range, the word kept
    report = pipeline(TokenRange(17, None)).run(graph())
    decides = report["decides"]
    assert decides.status == "skipped" and "applies to tokens 1..16" in decides.reason
    assert decides.decision == "stored"


def test_the_decision_is_in_report_json_and_read_back(clean_env):
    report = pipeline().run(graph())
    data = json.loads(report.to_json())
    assert [p["decision"] for p in data["passes"]] == ["stored", "table", None]
    again = passkit.Report.from_dict(data)
    assert [r.decision for r in again.records] == ["stored", "table", None]
    # a report written before the field existed reads as "not said"
    for p in data["passes"]:
        del p["decision"]
    assert [r.decision for r in passkit.Report.from_dict(data).records] == [None, None, None]


def test_the_printed_report_shows_it(clean_env):
    lines = pipeline().run(graph()).format().splitlines()
    row = {
        line.split()[0]: line for line in lines if line.split() and line.split()[0] in ("decides", "silent")
    }
    assert row["decides"].endswith("[decision: stored]")
    assert "[decision:" not in row["silent"] and row["silent"].endswith("nothing to do")
    cuda = next(line for line in lines if line.startswith("decides_on_cuda"))
    assert cuda.endswith("needs CUDA tensors (graph is on cpu) [decision: table]")


def test_the_report_cache_keeps_it(clean_env, tmp_path, monkeypatch):
    monkeypatch.setenv("PASSKIT_CACHE_DIR", str(tmp_path))
    report = pipeline().run(graph())
    names = report.names()
    report_cache.save("k", [report], names)
    (restored,) = report_cache.load("k", names)
    assert [r.decision for r in restored.records] == ["stored", "table", None]


def test_a_compile_the_host_ran_without_the_passes_carries_it_too(clean_env):
    report = pipeline(TokenRange(17, 64)).record_not_run("no enabled pass applies")
    assert report["decides"].reason == "applies to tokens 1..16; this compile serves tokens 17..64"
    assert [r.decision for r in report.records] == ["stored", "table", None]
