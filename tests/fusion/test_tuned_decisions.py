"""Measured fuse decisions: the pure decision logic, storage (foreign, stale and corrupt
files ignored with a note), how a decision sets the passes' token ranges, and the reports
saying where each range's decision came from. The gloo worlds are in test_tuned_worlds.py."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import random

import pytest
import torch
import torch.distributed as dist
from passkit_fusion.allreduce_rmsnorm import AllReduceRMSNorm
from passkit_fusion.async_tp import AsyncTP
from passkit_fusion.model import LlamaConfig, TinyLlama, shard_functional
from passkit_fusion.sequence_parallel import SequenceParallel
from passkit_fusion.tuning import decisions, measure
from passkit_fusion.tuning.decisions import DecidedConstraint, FuseDecision, RangeDecision

import passkit
from passkit import compiling
from passkit_testing import fake_world

AR = ("allreduce_rmsnorm",)
SP_ATP = ("sequence_parallel", "async_tp")
ALL = ("sequence_parallel", "async_tp", "allreduce_rmsnorm")
PASSES = [
    {"name": "sequence_parallel"},
    {"name": "async_tp", "implementation": "test_mode"},
    {"name": "allreduce_rmsnorm", "implementation": "reference"},
    "cleanup",
]
CTX = passkit.CompileContext(device="cpu", world_size=2)


def no_table(tokens: int) -> tuple[str, ...]:
    return ()


# ---------------------------------------------------------------------------- pure logic


def test_choose_takes_the_fastest_and_ties_go_to_fewer_passes():
    assert decisions.choose({(): 10.0, AR: 6.0, ALL: 7.0}) == AR
    assert decisions.choose({(): 10.0, AR: 6.0, ALL: 5.95}, margin=0.02) == AR  # a tie: fewer passes
    assert decisions.choose({(): 10.0, AR: 6.0, ALL: 5.0}, margin=0.02) == ALL
    assert decisions.choose({(): 10.0, AR: 9.9}, margin=0.02) == ()  # within noise of Inductor
    with pytest.raises(ValueError, match="Inductor"):
        decisions.choose({AR: 1.0})


def test_the_choice_is_never_slower_than_inductor():
    rng = random.Random(0)
    cands = [(), AR, SP_ATP, ALL]
    for _ in range(2000):
        times = {c: rng.uniform(1.0, 2.0) for c in cands}
        win = decisions.choose(times, margin=rng.choice([0.0, 0.02, 0.1]))
        assert times[win] <= times[()]


def test_decide_cuts_ranges_at_the_measured_counts_and_extends_the_largest():
    medians = {
        1: {(): 10, AR: 6},
        2: {(): 10, AR: 6, SP_ATP: 12, ALL: 11},
        4: {(): 10, AR: 9.95, SP_ATP: 12, ALL: 11},
        8: {(): 20, AR: 18, SP_ATP: 15, ALL: 15.1},
        16: {(): 40, AR: 41, SP_ATP: 30, ALL: 29.9},
    }
    ranges = decisions.decide(medians, [1, 2, 4, 8, 16], no_table)
    assert [(r.lo, r.hi, r.passes, r.source) for r in ranges] == [
        (1, 2, AR, "measured"),
        (3, 4, (), "measured"),  # 9.95 vs 10: noise, Inductor
        (5, None, SP_ATP, "measured"),  # 15 vs 15.1, 30 vs 29.9: ties go to fewer passes
    ]
    assert ranges[0].detail == "Inductor / this at 1: 1.67x, 2: 1.67x"


def test_decide_keeps_each_pass_to_one_interval():
    # allreduce_rmsnorm measured faster at 1, 2 and 8 but slower at 4: a pass runs in one
    # token interval, so the cheaper of the two pieces is given up, never a range made
    # slower than Inductor
    medians = {1: {(): 10, AR: 6}, 2: {(): 10, AR: 6}, 4: {(): 10, AR: 10.5}, 8: {(): 20, AR: 15}}
    ranges = decisions.decide(medians, [1, 2, 4, 8], no_table)
    assert [(r.lo, r.hi, r.passes) for r in ranges] == [(1, 2, AR), (3, None, ())]
    assert "8: 1.00x (fastest allreduce_rmsnorm, 1.33x)" in ranges[1].detail
    assert "each pass keeps one token interval" in ranges[1].detail
    # the other way round, the larger piece wins
    medians = {1: {(): 10, AR: 9}, 2: {(): 10, AR: 11}, 4: {(): 10, AR: 5}, 8: {(): 20, AR: 10}}
    ranges = decisions.decide(medians, [1, 2, 4, 8], no_table)
    assert [(r.lo, r.hi, r.passes) for r in ranges] == [(1, 2, ()), (3, None, AR)]


def test_unmeasured_counts_keep_the_tables_passes():
    medians = {1: {(): 10, AR: 6}, 2: {(): 10, AR: 6}}
    ranges = decisions.decide(medians, [1, 2, 4, 8], lambda t: AR if t <= 4 else SP_ATP)
    assert [(r.lo, r.hi, r.passes, r.source) for r in ranges] == [
        (1, 2, AR, "measured"),
        (3, 4, AR, "table"),
        (5, None, SP_ATP, "table"),
    ]
    assert ranges[1].detail == "not measured at 4 (time budget): the tables' passes"


def test_a_decision_must_cover_every_count_with_one_interval_per_pass():
    key = _key()
    with pytest.raises(ValueError, match="does not continue at token count 3"):
        FuseDecision(key, (RangeDecision(1, 2, AR), RangeDecision(4, None, ())))
    with pytest.raises(ValueError, match="must be open"):
        FuseDecision(key, (RangeDecision(1, 2, AR),))
    with pytest.raises(ValueError, match="not contiguous"):
        FuseDecision(key, (RangeDecision(1, 2, AR), RangeDecision(3, 4, ()), RangeDecision(5, None, AR)))


def test_default_candidates():
    assert measure.default_candidates(list(ALL)) == [
        (),
        ALL,
        ("sequence_parallel",),
        ("async_tp",),
        AR,
        SP_ATP,
    ]
    assert measure.default_candidates(["allreduce_rmsnorm"]) == [(), AR]


# ---------------------------------------------------------------------------- storage


def _key(**changes) -> decisions.DecisionKey:
    base = decisions.key_for(
        "g" * 32, [{"name": "allreduce_rmsnorm", "version": "1", "options": {}}], 2, "cpu"
    )
    return dataclasses.replace(base, **changes)


def _decision(key: decisions.DecisionKey) -> FuseDecision:
    return FuseDecision(
        key,
        (RangeDecision(1, 64, AR, "measured", "Inductor / this at 64: 1.50x"), RangeDecision(65, None, ())),
        medians_us={64: {"inductor": 15.0, "allreduce_rmsnorm": 10.0}},
        tuned={"date": "2026-11-25", "seconds": 12.0},
    )


@pytest.fixture
def isolated(clean_env, monkeypatch):
    """No config files or PASSKIT_* variables; decisions stored under the test's folder."""
    monkeypatch.setenv("PASSKIT_CACHE_DIR", str(clean_env / "cache"))
    yield clean_env
    decisions._measured.clear()


@pytest.fixture
def graph_scope(isolated):
    """A compile scope for a small graph with the pipeline PASSES: lookups see its key."""
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    pipeline = passkit.build_pipeline(passes=PASSES)
    with compiling.scope(gm, (torch.randn(4),), pipeline) as current:
        yield current


def _stored_for(current: compiling.Compiling, **changes) -> FuseDecision:
    key = decisions.key_for(current.graph, current.passes, 2, "cpu")
    key = dataclasses.replace(key, **changes)
    return FuseDecision(
        key,
        (
            RangeDecision(1, 64, AR, "measured", "Inductor / this at 64: 1.50x"),
            RangeDecision(65, 4096, (), "measured", "Inductor / this at 4096: 1.00x"),
            RangeDecision(4097, None, SP_ATP, "measured", "Inductor / this at 8192: 1.10x"),
        ),
        tuned={"date": "2026-11-25", "seconds": 12.0},
    )


def test_a_decision_round_trips_through_its_file(tmp_path):
    decision = _decision(_key())
    path = decisions.save(decision, tmp_path / "d.json")
    loaded = decisions.load(path)
    assert loaded == decision
    assert loaded.medians_us == {64: {"inductor": 15.0, "allreduce_rmsnorm": 10.0}}
    assert loaded.fingerprint() == decision.fingerprint()


def test_a_stored_decision_sets_the_passes_token_ranges(graph_scope, isolated):
    decision = _stored_for(graph_scope)
    path = decisions.save(decision)
    assert path.parent == isolated / "cache" / "fusion-decisions"
    found = decisions.lookup(CTX)
    assert (found.source, found.decision) == ("stored", decision)
    arrms = AllReduceRMSNorm(implementation="reference")
    constraint = arrms.token_constraint(CTX)
    assert isinstance(constraint, DecidedConstraint)
    assert (constraint.min_tokens, constraint.max_tokens, constraint.multiple_of) == (1, 64, 1)
    assert str(constraint) == "tokens 1..64 (stored decision)"
    sp = SequenceParallel().token_constraint(CTX)
    assert (sp.min_tokens, sp.max_tokens, sp.multiple_of) == (4097, None, 2)
    assert AsyncTP(implementation="test_mode").token_constraint(CTX).min_tokens == 4097
    # options that set the bounds win over the decision
    assert AllReduceRMSNorm(implementation="reference", max_tokens=8).token_constraint(CTX) == (
        passkit.TokenConstraint(max_tokens=8)
    )
    note = AllReduceRMSNorm(implementation="reference", max_tokens=8).decision_note(CTX)
    assert note == "fuse decision: own options (max_tokens set); the stored decision is not applied"
    assert arrms.decision_source(CTX) == "stored"
    assert AllReduceRMSNorm(implementation="reference", max_tokens=8).decision_source(CTX) == "options"
    assert (
        AllReduceRMSNorm(implementation="reference", restrict_tokens=False).decision_source(CTX) == "options"
    )
    # outside the compile scope, or with decisions ignored: the tables
    with decisions.ignored():
        assert arrms.token_constraint(CTX) is None
        assert arrms.decision_source(CTX) == "table"
    assert decisions.lookup(CTX).source == "stored"


def test_a_pass_the_decision_never_runs_is_skipped_with_the_reason(graph_scope):
    decision = _stored_for(graph_scope)
    decisions.save(
        FuseDecision(
            decision.key, (RangeDecision(1, 8, AR), RangeDecision(9, None, ())), tuned=decision.tuned
        )
    )
    assert SequenceParallel().token_constraint(CTX) is None
    assert SequenceParallel().skip_reason(CTX) == (
        "the stored fuse decision runs it in no token range (tokens 1..8: allreduce_rmsnorm; tokens >= 9: inductor)"
    )
    assert SequenceParallel().decision_source(CTX) == "stored"


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"torch": "2.9.0"}, "torch differs (stored '2.9.0', here"),
        ({"flashinfer": "0.1"}, "flashinfer differs (stored '0.1', here None)"),
        ({"device": "NVIDIA H200"}, None),  # another device's file: another name, not found
        ({"world_size": 4}, None),
    ],
)
def test_a_foreign_or_stale_decision_is_ignored_with_a_note(graph_scope, change, why):
    stale = _stored_for(graph_scope, **change)
    path = decisions.save(stale, decisions.path_for(_stored_for(graph_scope).key))
    found = decisions.lookup(CTX)
    assert found.decision is None and found.source == "table"
    if why is None:  # the key's device/world size is in the file name: ignored all the same
        why = f"{'device' if 'device' in change else 'world_size'} differs"
    assert found.note.startswith(f"stored decision {path} ignored: ")
    assert why in found.note
    assert AllReduceRMSNorm(implementation="reference").token_constraint(CTX) is None


def test_a_decision_for_other_pass_options_is_ignored(graph_scope):
    decision = _stored_for(graph_scope)
    passes = [dict(p) for p in graph_scope.passes]
    passes[2] = {**passes[2], "options": {**passes[2]["options"], "fuse_fp8_quant": False}}
    decisions.save(FuseDecision(dataclasses.replace(decision.key, passes=tuple(passes)), decision.ranges))
    note = decisions.lookup(CTX).note
    assert "ignored: pass 'allreduce_rmsnorm': options differs (stored {" in note
    assert "'fuse_fp8_quant': False" in note


def test_a_corrupt_decision_file_is_ignored_with_a_note(graph_scope):
    path = decisions.path_for(_stored_for(graph_scope).key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"format": "passkit-fusion-decision/1", "key": {')
    found = decisions.lookup(CTX)
    assert found.decision is None
    assert found.note.startswith(
        f"stored decision {path} ignored: unreadable (not a valid fuse decision (JSONDecodeError"
    )
    # a valid JSON file with a broken decision (a pass in two pieces) is no better
    data = _stored_for(graph_scope).to_json()
    data["ranges"][2]["passes"] = ["allreduce_rmsnorm"]
    path.write_text(json.dumps(data))
    assert (
        "pass 'allreduce_rmsnorm' runs in token ranges that are not contiguous" in decisions.lookup(CTX).note
    )
    assert AllReduceRMSNorm(implementation="reference").token_constraint(CTX) is None


def test_no_file_means_the_tables_with_a_note(graph_scope):
    found = decisions.lookup(CTX)
    assert (found.decision, found.source) == (None, "table")
    assert found.note == "no stored decision for this graph"
    assert (
        AllReduceRMSNorm(implementation="reference").decision_note(
            passkit.CompileContext(world_size=2, token_range=passkit.TokenRange(1, 8))
        )
        == f"fuse decision: table ({found.note})"
    )


# ------------------------------------------------------- the records' decision (structured)


def _run_with(passes, store=None, token_range=None):
    """The report of ``passes`` run on a small graph in a fake 2-rank world, compiling for
    ``token_range``; ``store(current)`` first stores or remembers a decision for the graph."""
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    pipeline = passkit.build_pipeline(passes=passes)
    if token_range is not None:
        pipeline = pipeline.for_range(token_range, label=str(token_range))
    with fake_world(2), compiling.scope(gm, (torch.randn(4),), pipeline) as current:
        if store is not None:
            store(current)
        return pipeline.run(gm)


def _nowhere(current):
    """A stored decision that runs allreduce_rmsnorm up to 8 tokens, the others nowhere."""
    decision = _stored_for(current)
    decisions.save(FuseDecision(decision.key, (RangeDecision(1, 8, AR), RangeDecision(9, None, ()))))


def _corrupt(current):
    path = decisions.path_for(_stored_for(current).key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{")


@pytest.mark.parametrize(
    ("store", "token_range", "expected"),
    [
        # stored: the range a pass runs in, and the ranges it is skipped in, say so alike
        (lambda c: decisions.save(_stored_for(c)), passkit.TokenRange(1, 64), ("skipped", "skipped", "ran")),
        (lambda c: decisions.save(_stored_for(c)), passkit.TokenRange(65, 4096), ("skipped",) * 3),
        (
            lambda c: decisions.save(_stored_for(c)),
            passkit.TokenRange(4098, None, 2),
            ("ran", "skipped", "skipped"),
        ),
        # every size at once: the decision runs sequence_parallel (and so async_tp) nowhere
        (_nowhere, None, ("skipped", "skipped", "ran")),
    ],
)
def test_every_record_names_the_stored_decision_ran_or_skipped(isolated, store, token_range, expected):
    report = _run_with(PASSES, store, token_range)
    tuned = [report[name] for name in ALL]
    assert tuple(r.status for r in tuned) == expected
    assert [r.decision for r in tuned] == ["stored"] * 3
    assert report["cleanup"].decision is None  # not a tunable pass: it says nothing
    if store is _nowhere:
        assert report["sequence_parallel"].reason.startswith(
            "the stored fuse decision runs it in no token range"
        )
    data = json.loads(report.to_json())
    assert {p["name"]: p["decision"] for p in data["passes"]} == {
        "sequence_parallel": "stored",
        "async_tp": "stored",
        "allreduce_rmsnorm": "stored",
        "cleanup": None,
    }


def test_the_records_decision_says_measured_table_ignored_or_options(isolated):
    arrms = [{"name": "allreduce_rmsnorm", "implementation": "reference"}, "cleanup"]
    small = passkit.TokenRange(1, 4)

    def measured(current):
        decision = _stored_for(current)
        decisions.remember(decision, decisions.path_for(decision.key))

    record = _run_with(PASSES, measured, passkit.TokenRange(65, 4096))["allreduce_rmsnorm"]
    assert (record.status, record.decision) == ("skipped", "measured")
    assert record.reason.endswith("(measured decision); this compile serves tokens 65..4096")
    decisions._measured.clear()
    # nothing stored: the tables
    record = _run_with(arrms, None, small)["allreduce_rmsnorm"]
    assert (record.status, record.decision) == ("ran", "table")
    assert record.notes[-1] == "fuse decision: table (no stored decision for this graph)"
    # a corrupt file is ignored: the tables decide, and the record says table; the note says why
    record = _run_with(arrms, _corrupt, small)["allreduce_rmsnorm"]
    assert (record.status, record.decision) == ("ran", "table")
    assert record.notes[-1].startswith("fuse decision: table (stored decision ")
    assert " ignored: unreadable (" in record.notes[-1]
    # own bounds win over a stored decision
    own = [{"name": "allreduce_rmsnorm", "implementation": "reference", "max_tokens": 2}, "cleanup"]
    record = _run_with(own, lambda c: decisions.save(_stored_for(c)), small)["allreduce_rmsnorm"]
    assert (record.status, record.decision) == ("skipped", "options")
    assert record.reason == "applies to tokens 1..2; this compile serves tokens 1..4"


# ---------------------------------------------------------------------------- tune + compile


def _fake_timer(step, trial):
    """allreduce_rmsnorm twice as fast up to 4 tokens, slower above; rank-independent."""
    step()
    base = 10.0 * trial.tokens
    if trial.candidate == AR:
        return base * (0.5 if trial.tokens <= 4 else 1.2)
    return base


def _tiny(world) -> tuple[torch.nn.Module, object, object]:
    cfg = LlamaConfig(layers=1)
    model = shard_functional(TinyLlama(cfg).eval(), dist.group.WORLD, 0, world.world_size)

    def inputs(t):
        return (torch.randint(0, cfg.vocab, (1, t), generator=torch.Generator().manual_seed(t)),)

    def mark(args):
        torch._dynamo.mark_dynamic(args[0], 1)

    return model, inputs, mark


def _compile_reports(model, inputs, mark, passes, tokens=8):
    torch._dynamo.reset()
    backend = passkit.backend(passes=passes, mode="eager", compile_at="upfront")  # every range's report
    fn = torch.compile(model, backend=backend)
    args = inputs(tokens)
    mark(args)
    with torch.no_grad():
        fn(*args)
    return {r.token_range: r for r in backend.reports}


def test_tuning_then_compiling_uses_the_decision_and_reports_its_source(isolated):
    """Tune (fake 2-rank world, injected timer), then compile again: measured in this
    process, stored in a fresh one (simulated by forgetting), ignored -> the tables."""
    passes = [{"name": "allreduce_rmsnorm", "implementation": "reference"}, "cleanup"]
    with fake_world(2) as world:
        model, inputs, mark = _tiny(world)
        stream = io.StringIO()
        result = measure.tune_model(
            model, inputs, passes, token_counts=[2, 4, 16], timer=_fake_timer, mark_dynamic=mark,
            mode="eager", progress=stream,
        )  # fmt: skip
        assert result.decision.summary() == "tokens 1..4: allreduce_rmsnorm; tokens >= 5: inductor"
        assert result.unmeasured == []
        assert result.medians_us[4] == {(): 40.0, AR: 20.0}
        (path,) = result.paths
        assert path.exists() and path.parent == decisions.decisions_dir()
        lines = stream.getvalue().splitlines()
        assert lines[0].startswith("passkit tune [  1/8]") and "compiled inductor in" in lines[0]
        assert any(
            "allreduce_rmsnorm" in line and "4 tokens" in line and "(2.00x Inductor)" in line
            for line in lines
        )
        assert lines[-1] == f"passkit tune: wrote {path}"

        reports = _compile_reports(model, inputs, mark, passes)
        small, large = reports["tokens 1..4"], reports["tokens >= 5"]
        assert (small["allreduce_rmsnorm"].status, small["allreduce_rmsnorm"].matches) == ("ran", 3)
        note = small["allreduce_rmsnorm"].notes[-1]
        assert note.startswith("fuse decision: measured (in this process, tuned ")
        assert note.endswith(
            "): tokens 1..4: allreduce_rmsnorm [measured: Inductor / this at 2: 2.00x, 4: 2.00x]"
        )
        assert large["allreduce_rmsnorm"].reason == (
            "applies to tokens 1..4 (measured decision); this compile serves tokens >= 5"
        )
        assert [r["allreduce_rmsnorm"].decision for r in (small, large)] == ["measured", "measured"]

        decisions._measured.clear()  # as in a new process: read from the file
        reports = _compile_reports(model, inputs, mark, passes)
        note = reports["tokens 1..4"]["allreduce_rmsnorm"].notes[-1]
        assert note.startswith("fuse decision: stored (tuned ")
        assert f", in {path.parent}): tokens 1..4: allreduce_rmsnorm [measured: " in note
        assert {r.token_range: r["allreduce_rmsnorm"].decision for r in reports.values()} == {
            "tokens 1..4": "stored",
            "tokens >= 5": "stored",  # skipped there, by the stored decision
        }

        # another pass configuration of the same model: the decision is not for it
        other = [
            {"name": "allreduce_rmsnorm", "implementation": "reference", "fuse_fp8_quant": False},
            "cleanup",
        ]
        reports = _compile_reports(model, inputs, mark, other)
        (only,) = reports.values()
        assert only.token_range is None  # the reference op has no tabled bound: one compile
        assert (
            only["allreduce_rmsnorm"]
            .notes[-1]
            .startswith(f"fuse decision: table (stored decision {path} ignored")
        )
        assert only["allreduce_rmsnorm"].decision == "table"


def test_a_graph_dynamo_specializes_while_timed_gets_the_decision_too(isolated):
    """Timing 1 token recompiles (Dynamo specializes a size of 1): that graph is stored with
    the decision as the dynamic one is, so a program's 1-token compile finds it too (it found
    none when only the first compile's graphs were kept)."""
    passes = [{"name": "allreduce_rmsnorm", "implementation": "reference"}, "cleanup"]
    with fake_world(2) as world:
        model, inputs, mark = _tiny(world)
        result = measure.tune_model(
            model, inputs, passes, token_counts=[1, 4, 16], timer=_fake_timer, mark_dynamic=mark,
            mode="eager", progress=False,
        )  # fmt: skip
        assert len(set(result.paths)) == 2, result.paths  # the dynamic graph and the 1-token one
        decisions._measured.clear()  # as in a new process: read from the files
        torch._dynamo.reset()
        backend = passkit.backend(passes=passes, mode="eager")
        fn = torch.compile(model, backend=backend)
        with torch.no_grad():
            fn(*inputs(1))  # unmarked, as a program's first 1-token call is
        notes = [n for r in backend.reports for n in r["allreduce_rmsnorm"].notes]
        assert any(n.startswith("fuse decision: stored (tuned ") for n in notes), notes
        assert [r["allreduce_rmsnorm"].decision for r in backend.reports] == ["stored"] * len(backend.reports)


def test_a_static_compile_follows_the_stored_decision_at_its_token_count(isolated, monkeypatch):
    """A graph compiled with static shapes (``dynamic=False``; Dynamo's 1-token recompile
    too) serves one token count: the stored decision for that graph applies at that count.
    The token count of the model's ``(1, tokens)`` ids is their dimension 1."""
    passes = [{"name": "allreduce_rmsnorm", "implementation": "reference"}, "cleanup"]
    keys = []
    real_lookup = decisions.lookup

    def spy(ctx):  # the key each static graph's decision is stored under
        current = compiling.current()
        keys.append(decisions.key_for(current.graph, current.passes, ctx.world_size, ctx.device))
        return real_lookup(ctx)

    counts = (1, 3, 8)
    with fake_world(2) as world:
        model, inputs, _ = _tiny(world)

        def reports() -> dict[int, passkit.Report]:
            torch._dynamo.reset()
            backend = passkit.backend(passes=passes, mode="eager")
            fn = torch.compile(model, backend=backend, dynamic=False)
            with torch.no_grad():
                for tokens in counts:
                    fn(*inputs(tokens))
            return dict(zip(counts, backend.reports))

        monkeypatch.setattr(decisions, "lookup", spy)
        reports()
        monkeypatch.setattr(decisions, "lookup", real_lookup)
        ranges = (RangeDecision(1, 1, ()), RangeDecision(2, 4, AR), RangeDecision(5, None, ()))
        for key in {decisions.path_for(k): k for k in keys}.values():  # one file per graph
            decisions.save(FuseDecision(key, ranges, tuned={"date": "2026-11-25", "seconds": 1.0}))
        found = reports()
    assert [found[t].token_range for t in counts] == [
        "tokens = 1 (Dynamo's 1-token recompile)",
        "tokens = 3 (static shapes)",
        "tokens = 8 (static shapes)",
    ]
    records = {t: found[t]["allreduce_rmsnorm"] for t in counts}
    assert (records[3].status, records[3].matches) == ("ran", 3)
    assert records[3].notes[-1].startswith("fuse decision: stored (tuned 2026-11-25")
    for t in (1, 8):
        assert (records[t].status, records[t].reason) == (
            "skipped",
            f"static tokens {t} outside its range tokens 2..4 (stored decision)",
        )


def test_the_budget_stops_measuring_and_says_what_was_not_measured(isolated):
    clock = itertools.count()  # one second per unit measured (compiles cost nothing)
    now = [0.0]

    def timer(step, trial):
        now[0] = float(next(clock) + 1)
        return _fake_timer(step, trial)

    passes = [{"name": "allreduce_rmsnorm", "implementation": "reference"}]
    with fake_world(2) as world:
        model, inputs, mark = _tiny(world)
        stream = io.StringIO()
        result = measure.tune_model(
            model, inputs, passes, token_counts=[2, 4, 16], timer=timer, mark_dynamic=mark, mode="eager",
            budget_s=2.0, clock=lambda: now[0], progress=stream, save=False,
        )  # fmt: skip
    assert result.medians_us == {2: {(): 20.0}, 4: {(): 40.0}}
    assert result.unmeasured == ["inductor at 16 tokens", "allreduce_rmsnorm at 2..16 tokens"]
    assert [(r.lo, r.hi, r.passes, r.source) for r in result.decision.ranges] == [
        (1, 4, (), "measured"),
        (5, None, AR, "table"),  # the reference op's own bounds: none on the CPU, it runs everywhere
    ]
    assert result.decision.unmeasured == ("inductor at 16 tokens", "allreduce_rmsnorm at 2..16 tokens")
    assert (
        "passkit tune: not measured (time budget): inductor at 16 tokens; allreduce_rmsnorm at 2..16 tokens"
        in (stream.getvalue())
    )
    assert result.paths and not result.paths[0].exists()  # save=False


def test_a_candidate_that_fails_to_compile_is_skipped_and_listed(isolated, monkeypatch):
    """One process, no process group; the allreduce_rmsnorm candidate's compile raises."""
    real = measure._compile

    def failing(model, entries, *args):
        if any(e["name"] == "allreduce_rmsnorm" for e in entries):
            raise RuntimeError("no kernel for this shape\nmore lines")
        return real(model, entries, *args)

    monkeypatch.setattr(measure, "_compile", failing)

    def model(x):
        return torch.nn.functional.rms_norm(x * 2, (x.shape[-1],))

    stream = io.StringIO()
    result = measure.tune_model(
        model, lambda t: (torch.randn(t, 8),), [{"name": "allreduce_rmsnorm", "implementation": "reference"}],
        token_counts=[4, 16], timer=_fake_timer, mode="eager", progress=stream,
    )  # fmt: skip
    assert result.unmeasured == [
        "allreduce_rmsnorm: failed to compile on rank 0: RuntimeError: no kernel for this shape"
    ]
    assert result.medians_us == {4: {(): 40.0}, 16: {(): 160.0}}
    assert result.decision.summary() == "tokens >= 1: inductor"
    assert result.decision.key.world_size == 1
    assert (
        "allreduce_rmsnorm failed to compile (rank 0: RuntimeError: no kernel for this shape): not measured"
        in (stream.getvalue())
    )


def tune_then_print(step: str) -> None:
    """Run in a fresh process by the test below: ``tune`` stores a decision, ``compile``
    compiles the same model and prints the note of its first range's record."""
    passes = [{"name": "allreduce_rmsnorm", "implementation": "reference"}, "cleanup"]
    with fake_world(2) as world:
        model, inputs, mark = _tiny(world)
        if step == "tune":
            measure.tune_model(
                model, inputs, passes, token_counts=[2, 4, 16], timer=_fake_timer, mark_dynamic=mark,
                mode="eager", progress=False,
            )  # fmt: skip
        else:
            reports = _compile_reports(model, inputs, mark, passes, tokens=24)
            print(reports["tokens 1..4"]["allreduce_rmsnorm"].notes[-1])


@pytest.mark.slow
def test_a_fresh_process_uses_the_stored_decision(isolated):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    run = [sys.executable, "-c", "import sys, test_tuned_decisions as t; t.tune_then_print(sys.argv[1])"]
    for step in ("tune", "compile"):
        out = subprocess.run([*run, step], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
    (path,) = (isolated / "cache" / "fusion-decisions").iterdir()
    note = out.stdout.strip().splitlines()[-1]
    assert note.startswith("fuse decision: stored (tuned ") and f", in {path.parent}): tokens 1..4: " in note


@pytest.mark.parametrize(
    "compile_mode, records",
    [(None, False), ("default", False), ("reduce-overhead", True), ("max-autotune-no-cudagraphs", False)],
)
def test_a_compile_mode_that_records_cuda_graphs_is_timed_per_call(compile_mode, records):
    """Candidates compiled with Inductor's CUDA graphs replay their own graphs, which cannot
    be captured again: the default GPU timer for them times calls."""
    assert measure.records_cuda_graphs(compile_mode) is records


@pytest.mark.parametrize(
    "compile_mode, timing, timer",
    [
        (None, None, "cuda_graph_timer"),
        ("reduce-overhead", None, "cuda_call_timer"),
        (None, "calls", "cuda_call_timer"),
        ("max-autotune-no-cudagraphs", "calls", "cuda_call_timer"),
        ("default", "graphs", "cuda_graph_timer"),
    ],
)
def test_the_gpu_timer_follows_the_timing_asked_for(compile_mode, timing, timer):
    """``timing="calls"`` counts each call's host time (a program without CUDA graphs: a
    pass whose ops cost more on the host than they save on the GPU must lose the tuning)."""
    assert measure.gpu_timer(compile_mode, timing).__qualname__ == f"{timer}.<locals>.timer"


@pytest.mark.parametrize(
    "compile_mode, timing, words",
    [("reduce-overhead", "graphs", "cannot be captured again"), (None, "wall", "must be one of")],
)
def test_a_timing_that_cannot_be_is_a_config_error(compile_mode, timing, words):
    import passkit

    with pytest.raises(passkit.ConfigError, match=words):
        measure.resolve_timing(compile_mode, timing)


def test_tune_model_cli_refuses_a_conflicting_timing_before_starting_ranks(capsys):
    from passkit.cli import main

    code = main(
        ["tune-model", "passkit_fusion.model:tuning_target", "--cpu", "--timing", "graphs",
         "--compile-mode", "reduce-overhead"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "timing='graphs'" in err and "Traceback" not in err


def test_tune_model_checks_the_timing_on_every_device_before_compiling():
    import passkit

    with pytest.raises(passkit.ConfigError, match="must be one of"):
        measure.tune_model(
            torch.nn.Linear(4, 4), lambda t: (torch.randn(t, 4),), ["allreduce_rmsnorm"], timing="wall",
            save=False, progress=False,
        )  # fmt: skip


# ------------------------------------ cache entries that are no decision, a folder that takes none


def _with_timeout(fn, seconds=30.0):
    """``fn()`` in a daemon thread (in this context: the compile scope); fails the test
    (instead of hanging it) past ``seconds``."""
    import contextvars
    import threading

    out: dict[str, object] = {}
    context = contextvars.copy_context()

    def target():
        try:
            out["value"] = context.run(fn)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"blocked for {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_decision_path_that_is_a_named_pipe_is_ignored_without_blocking(graph_scope):
    import os

    path = decisions.path_for(_stored_for(graph_scope).key)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)  # no writer ever opens it: reading it would block forever
    found = _with_timeout(lambda: decisions.lookup(CTX))
    assert (found.decision, found.source) == (None, "table")
    assert found.note == (
        f"stored decision {path} ignored: unreadable (not a valid fuse decision "
        "(ValueError: not a regular file (a named pipe)))"
    )
    with pytest.raises(ValueError, match="not a regular file"):
        _with_timeout(lambda: decisions.load(path))
    # the pass's identity (which globs the folder) does not block on it either
    arrms = AllReduceRMSNorm(implementation="reference")
    with fake_world(2):
        assert "not a regular file" in _with_timeout(arrms.decision_identity)


def test_a_decision_path_that_is_a_folder_is_ignored_with_a_note(graph_scope):
    path = decisions.path_for(_stored_for(graph_scope).key)
    path.mkdir(parents=True)
    assert "not a regular file (a folder)" in decisions.lookup(CTX).note


def test_deeply_nested_json_is_ignored_like_any_malformed_entry(graph_scope):
    """``RecursionError`` escaped ``load()``: every tunable pass then failed instead of
    leaving the decision to the tables."""
    path = decisions.path_for(_stored_for(graph_scope).key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[" * 100_000 + "]" * 100_000)
    found = decisions.lookup(CTX)
    assert (found.decision, found.source) == (None, "table")
    assert found.note.startswith(
        f"stored decision {path} ignored: unreadable (not a valid fuse decision (RecursionError"
    )
    arrms = AllReduceRMSNorm(implementation="reference")
    assert arrms.token_constraint(CTX) is None  # the tables decide, no exception


def _nested(current):
    path = decisions.path_for(_stored_for(current).key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"a": ' * 100_000 + "1" + "}" * 100_000)


def test_a_deeply_nested_entry_leaves_the_pass_running_on_its_tables(isolated):
    arrms = [{"name": "allreduce_rmsnorm", "implementation": "reference"}, "cleanup"]
    record = _run_with(arrms, _nested, passkit.TokenRange(1, 4))["allreduce_rmsnorm"]
    assert (record.status, record.decision) == ("ran", "table"), record
    assert " ignored: unreadable (not a valid fuse decision (RecursionError" in record.notes[-1]


def test_a_folder_that_cannot_be_written_keeps_the_measured_decision_and_says_where(isolated, capsys):
    """``decisions.save`` raised a raw ``OSError [Errno 30]`` after everything was measured,
    and the decision was lost."""
    import os

    if os.geteuid() == 0:  # root writes any folder: a file where the folder would be instead
        blocker = isolated / "cache"
        blocker.write_text("not a folder")
    else:
        (isolated / "cache").mkdir()
        os.chmod(isolated / "cache", 0o500)
    passes = [{"name": "allreduce_rmsnorm", "implementation": "reference"}, "cleanup"]
    with fake_world(2) as world:
        model, inputs, mark = _tiny(world)
        stream = io.StringIO()
        result = measure.tune_model(
            model, inputs, passes, token_counts=[2, 4, 16], timer=_fake_timer, mark_dynamic=mark,
            mode="eager", progress=stream,
        )  # fmt: skip
        # the decision still serves this process's compiles
        reports = _compile_reports(model, inputs, mark, passes)
        assert reports["tokens 1..4"]["allreduce_rmsnorm"].decision == "measured"
    (path,) = result.paths
    assert not path.exists() and list(result.unsaved) == [path]
    err = capsys.readouterr().err
    assert f"passkit tune: rank 0: cannot write {path} (" in err
    assert "the decision holds in this process only" in err
    printed = json.loads(err[err.index("{") : err.rindex("}") + 1])
    assert FuseDecision.from_json(printed).summary() == result.decision.summary()
    assert result.decision.summary() == "tokens 1..4: allreduce_rmsnorm; tokens >= 5: inductor"
    assert "passkit tune: wrote" not in stream.getvalue()
    with pytest.raises(decisions.DecisionNotSaved, match=f"cannot write the fuse decision {path}"):
        decisions.save(result.decision, path)
