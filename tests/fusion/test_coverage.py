"""Coverage of Hugging Face families (``passkit_fusion.coverage``, ``benchmarks/coverage.py``,
``passkit explain-hf``): configs read and shrunk, bad input named, and the all-reduce sites
of real architectures sharded with ``tp_plan="auto"`` on a 2-rank gloo world fused, with
the logits equal to eager. One family in the default suite, every family marked slow."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from passkit_fusion.coverage.configs import FAMILIES, ConfigError, load_config, small_config  # noqa: E402
from passkit_fusion.coverage.run import PASSES, check_model, format_report  # noqa: E402

from passkit import cli  # noqa: E402

REFERENCE_ONLY = {"allreduce_rmsnorm": PASSES["allreduce_rmsnorm"]}
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _benchmark() -> Any:
    """benchmarks/coverage.py as a module (not importable as ``coverage``: coverage.py's name)."""
    spec = importlib.util.spec_from_file_location("passkit_coverage_benchmark", BENCHMARKS / "coverage.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- configs ----------------------------------------------------------------------------------


def test_small_config_keeps_the_structure():
    small = small_config(load_config("Granite-MoE"))
    assert type(small).__name__ == "GraniteMoeConfig"
    assert (small.hidden_size, small.num_hidden_layers, small.num_local_experts) == (64, 2, 4)
    assert (small.residual_multiplier, small.embedding_multiplier) == (0.22, 12.0)  # kept
    deepseek = small_config(load_config("DeepseekV3Config"))
    assert (deepseek.n_routed_experts, deepseek.first_k_dense_replace, deepseek.n_group) == (4, 1, 1)
    assert deepseek.n_shared_experts == 1 and deepseek.head_dim == deepseek.qk_rope_head_dim


def test_loads_a_users_config_json(tmp_path: Path):
    config = transformers.Qwen3MoeConfig(num_experts=16, rms_norm_eps=1e-5)
    config.save_pretrained(tmp_path)
    for source in (tmp_path, tmp_path / "config.json"):
        loaded = load_config(source)
        assert type(loaded).__name__ == "Qwen3MoeConfig" and loaded.num_experts == 16
    assert small_config(loaded).rms_norm_eps == 1e-5


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("NoSuchConfig", "'NoSuchConfig' is neither a config file, a transformers config class"),
        ("missing/config.json", "missing/config.json: no such config file"),
    ],
)
def test_bad_config_names_the_problem(source: str, message: str):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")):
        load_config(source)


def test_config_json_without_model_type(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ConfigError, match="no 'model_type' key"):
        load_config(tmp_path)


def test_explain_hf_reports_a_bad_config(capsys: pytest.CaptureFixture[str]):
    assert cli.main(["explain-hf", "NoSuchConfig"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("passkit explain-hf: error: 'NoSuchConfig' is neither a config file"), err
    assert len(err.splitlines()) == 1
    assert cli.main(["explain-hf", "LlamaConfig", "--tp", "3", "--tokens", "8"]) == 2
    assert "passkit explain-hf: error: --tp must be >= 2 and divide --tokens" in capsys.readouterr().err


def test_explain_hf_suggests_a_close_family_or_config_class(capsys: pytest.CaptureFixture[str]):
    assert cli.main(["explain-hf", "Lama"]) == 2
    assert "did you mean 'Llama'" in capsys.readouterr().err
    assert cli.main(["explain-hf", "Qwen3MoeConfg"]) == 2  # Qwen3MoEConfig is read loosely: it runs
    assert "did you mean 'Qwen3MoeConfig'" in capsys.readouterr().err
    assert cli.main(["explain-hf", "Llama", "--passes", "allreduce_rmsnom"]) == 2
    assert "did you mean 'allreduce_rmsnorm'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "config_class"),
    [
        ("Glm4Moe", "Glm4MoeConfig"),
        ("glm4_moe", "Glm4MoeConfig"),
        ("Glm4MoeConfig", "Glm4MoeConfig"),
        ("qwen3-moe", "Qwen3MoeConfig"),
        ("HunYuanMoEV1", "HunYuanMoEV1Config"),
    ],
)
def test_any_family_name_or_model_type(name: str, config_class: str):
    assert type(load_config(name)).__name__ == config_class


def test_tp_families_are_the_causal_lms_with_a_plan():
    from passkit_fusion.coverage.configs import tp_families

    families = tp_families()
    assert {"llama", "qwen3_moe", "llama4_text", "kolibri1", "qwen3_next"} <= set(families)
    assert all(getattr(transformers, name).base_model_tp_plan for name in families.values())


@pytest.mark.parametrize(
    "name",
    [
        "Llama4TextConfig",
        "Gemma3nTextConfig",
        "GraniteMoeHybridConfig",
        "BailingHybridConfig",
        "KimiLinearConfig",
    ],
)
def test_shrinking_keeps_per_layer_lists_and_routing_consistent(name: str):
    """Per-layer lists cut to the layers kept, routing sizes within the shrunk experts: the
    small model builds and runs a forward (no tensor parallelism here)."""
    import torch

    small = small_config(load_config(name), layers=2)
    for key, value in small.to_dict().items():
        if isinstance(value, list) and key.endswith(("layer_types", "no_rope_layers")):
            assert len(value) == 2, (key, value)
    model = transformers.AutoModelForCausalLM.from_config(small, dtype=torch.float32)
    with torch.no_grad():
        assert model(torch.arange(8)[None] % small.vocab_size, use_cache=False).logits.shape[1] == 8


UNSET_DEFAULT_FAMILIES = {
    # family: what small_config fills that the family's default config leaves unusable
    "cohere_compass_text": "rope_parameters {} though its rotary embedding reads one per layer type",
    "dots1": "None expert count, experts per token and shared experts",
    "deepseek_v2": "None experts per token (torch.topk's k)",
    "lfm2_moe": "None layer_types, indexed per layer",
    "qwen4_exp_text": "None QSA indexer sizes of its indexed_attention layers",
}
"""Families whose default config does not build or run (transformers 5.23.0): the shrunk
config fills what they leave None or empty, and passkit fuses them (the slow test below)."""


@pytest.mark.parametrize("family", list(UNSET_DEFAULT_FAMILIES))
def test_shrinking_fills_what_a_default_config_leaves_unset(family: str):
    """The small config builds and runs a plain forward (no tensor parallelism here)."""
    import torch

    small = small_config(load_config(family))
    model = transformers.AutoModelForCausalLM.from_config(small, dtype=torch.float32)
    with torch.no_grad():
        assert model(torch.arange(8)[None] % small.vocab_size, use_cache=False).logits.shape[1] == 8


def test_a_recurrent_stack_runs_one_layer_as_many_times_as_the_layers_asked():
    """HRM runs ``num_layers_per_stack`` layers ``H_cycles * (L_cycles + 1)`` times: 128 layers
    unrolled at its defaults (a compile that did not end in 9 minutes); shrunk, one layer
    twice, like the other families' 2 layers."""
    hrm = small_config(load_config("hrm_text"))
    assert (hrm.num_layers_per_stack, hrm.H_cycles, hrm.L_cycles, hrm.num_hidden_layers) == (1, 1, 1, 2)
    assert small_config(load_config("hrm_text"), layers=4).L_cycles == 3


def test_a_none_routing_size_is_filled_only_in_an_moe_config():
    dots1 = small_config(load_config("dots1"))
    assert (dots1.n_routed_experts, dots1.num_experts_per_tok, dots1.n_shared_experts) == (4, 2, 1)
    assert small_config(load_config("deepseek_v2")).num_experts_per_tok == 2
    gemma4 = small_config(load_config("Gemma4TextConfig"))  # dense: its None experts stay so
    assert (gemma4.num_experts, gemma4.top_k_experts, gemma4.moe_intermediate_size) == (None, None, None)
    compass = small_config(load_config("cohere_compass_text"))
    assert set(compass.rope_parameters) == set(compass.layer_types) == {"full_attention"}
    gemma3 = small_config(load_config("Gemma3TextConfig"))  # per layer type already: kept
    assert gemma3.rope_parameters == load_config("Gemma3TextConfig").rope_parameters


def test_a_failing_rank_shows_its_own_error():
    from passkit_fusion.coverage.run import _rank_error
    from passkit_testing.worlds import GlooWorldError, RankResult

    ok = RankResult(rank=1, value=None)
    bad = RankResult(
        rank=0, error="ValueError: bad head", traceback="Traceback ...\n  File x\nValueError: bad head\n"
    )
    error = GlooWorldError([bad, ok])
    assert _rank_error(error, full=False) == "rank 0: ValueError: bad head"
    assert "File x" in _rank_error(error, full=True)


def test_an_eager_failure_under_tp_names_transformers_plan_when_the_plain_model_runs(tmp_path: Path):
    """The sharded model's eager forward failed, before any pass: the same model in one
    process decides whose failure it is (Doge's and Inkling's plans in transformers 5.23.0)."""
    import torch
    from passkit_fusion.coverage.run import _eager_failure

    torch.manual_seed(0)
    small = small_config(load_config("Llama"))
    transformers.AutoModelForCausalLM.from_config(small, dtype=torch.float32).save_pretrained(tmp_path)
    error = _eager_failure("the eager forward failed: RuntimeError: size mismatch", tmp_path, 8)
    assert error == (
        f"transformers {transformers.__version__}'s own tensor-parallel plan (tp_plan='auto') fails in "
        "eager, no passkit involved (the same model runs without it): RuntimeError: size mismatch"
    )
    assert "\n" not in error


def test_a_family_without_a_tp_plan_says_so():
    """A config whose TP plan is empty (gpt-oss's up to transformers 5.23; from 5.24 on it has
    one, so the test empties Llama's) is not run, and the report says why."""
    config = small_config(load_config("Llama"))
    config.base_model_tp_plan = {}
    report = check_model(config, name="Llama", passes=REFERENCE_ONLY)
    assert report.error and "has no tensor-parallel plan" in report.error
    assert "not run: LlamaConfig has no tensor-parallel plan" in format_report([report])


# -- families on a gloo world -------------------------------------------------------------------


def test_explain_hf_on_a_users_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """A user's Granite-MoE config.json: the embedding scaled by embedding_multiplier, each
    MoE output reshaped and scaled by residual_multiplier (up to transformers 5.24 its TP plan
    shards only the experts: 3 all-reduces; from 5.25 it shards attention, the experts by
    expert parallelism: 5): every all-reduce fused, logits equal to eager."""
    transformers.GraniteMoeConfig(residual_multiplier=0.22, embedding_multiplier=12.0).save_pretrained(
        tmp_path
    )
    assert cli.main(["explain-hf", str(tmp_path / "config.json"), "--passes", "allreduce_rmsnorm"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "| allreduce_rmsnorm |" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    n = "3" if _tp_plan_shards_experts() else "5"
    assert cells[3:6] == [n, n, "-"], out  # all-reduces, rewritten, why the rest were left
    assert float(cells[6]) < 1e-5, row
    assert f"allreduce_rmsnorm: {n} of {n} all-reduce(s) fused" in out


@pytest.mark.slow
def test_decode_benchmark_smoke_on_cpu(capsys: pytest.CaptureFixture[str]):
    """``benchmarks/coverage.py --decode --device cpu``: the two-GPU script's logic, tiny."""
    benchmark = _benchmark()
    args = ["--decode", "--device", "cpu", "--layers", "1", "--tokens", "1,2", "--replays", "1"]
    assert benchmark.main(args) == 0
    out = capsys.readouterr().out
    assert "| tokens | inductor (us) | allreduce_rmsnorm (us) |" in out, out
    # each mode's line: "sites fused per compiled graph: allreduce_rmsnorm: [3, 3]" (one count
    # per compiled graph, every one 3 of the layer's 3 sites)
    fused = re.findall(r"sites fused per compiled graph: allreduce_rmsnorm: (\[[^\]]*\])", out)
    assert len(fused) == 2, out
    assert all(counts == "[3, 3]" for counts in fused), fused
    assert "### mode default" in out and "### mode reduce-overhead" in out, out  # both modes, side by side


@pytest.mark.slow
def test_every_family_through_the_benchmark(tmp_path: Path):
    """``benchmarks/coverage.py`` over every family: >= 95% of the all-reduces followed by an
    RMSNorm rewritten by allreduce_rmsnorm and sequence_parallel, logits equal to eager."""
    benchmark = _benchmark()
    reports = [check_model(small_config(load_config(f)), name=f) for f in FAMILIES]
    ran = [r for r in reports if not r.error]
    assert len(ran) >= 12, format_report(reports)
    for label, total in benchmark.totals(ran).items():
        assert total["rewritten"] >= 0.95 * total["followed_by_norm"], (label, total, format_report(reports))
    for report in ran:
        for outcome in report.outcomes:
            assert outcome.max_error < 1e-4, (report.name, outcome)


def test_explain_hf_names_the_transformers_versions_that_break_graphs():
    from passkit_fusion.coverage.cli import graph_break_note
    from passkit_fusion.coverage.run import FamilyReport, PassOutcome

    reason = "all_reduce -> wait_tensor -> add -> output: ends its graph: the sum is an output of this graph"
    broken = PassOutcome("allreduce_rmsnorm", 2, 0, {reason: 2}, 0.0, 3, [])
    note = graph_break_note(FamilyReport("x", "XConfig", 2, [broken]))
    assert note is not None and "2 all-reduce(s) ended their graph" in note
    assert "transformers 5.17" in note and "5.23.0 or later" in note
    assert (
        graph_break_note(
            FamilyReport("x", "XConfig", 2, [PassOutcome("allreduce_rmsnorm", 2, 2, {}, 0, 1, [])])
        )
        is None
    )


def test_the_table_is_grouped_by_norm_kind_and_counts_only_sites_a_norm_follows():
    from passkit_fusion.coverage.run import FamilyReport, PassOutcome

    benchmark = _benchmark()
    rms = FamilyReport(
        "A",
        "AConfig",
        2,
        [PassOutcome("allreduce_rmsnorm", 5, 4, {"x: no norm follows (...)": 1}, 0, 1, [])],
        norm="RMSNorm",
    )
    layer = FamilyReport(
        "B",
        "BConfig",
        2,
        [PassOutcome("allreduce_rmsnorm", 3, 0, {"x: no RMSNorm after the all-reduce": 3}, 0, 1, [])],
        norm="LayerNorm",
    )
    totals = benchmark.totals([rms])["allreduce_rmsnorm"]
    assert totals == {"all_reduces": 5, "rewritten": 4, "followed_by_norm": 4}

    class Args:
        tp, tokens, mode = 2, 8, "eager"

    text = benchmark.render([layer, rms], Args(), 1.0)
    assert text.index("## RMSNorm families (1)") < text.index("## LayerNorm families (1)")
    # a line per family: rewritten / followed by its norm (+ the all-reduces no such norm follows)
    assert (
        "| RMSNorm | A | AConfig | **4/4 (+1)** |" not in text
        and "| RMSNorm | A | AConfig | 4/4 (+1) |" in text
    )
    assert "| LayerNorm | B | BConfig | 0/0 (+3) |" in text
    assert "| RMSNorm | allreduce_rmsnorm | 5 | 4 | 4 | 100.0% |" in text
    assert "| LayerNorm | allreduce_rmsnorm | 3 | 0 | 0 | - |" in text


ISSUE_39_FAMILIES = {
    # family: layers (Qwen3-Next at 4: its MoE and linear-attention layers alternate)
    "Ernie4_5_MoeConfig": 2,  # summed expert terms reshaped, then the residual
    "hy_v3": 2,  # HunYuan-V3: the same form
    "Qwen3NextConfig": 4,  # sigmoid(g) * AR(shared) before the add
    "Qwen3_5MoeTextConfig": 2,
    "Llama4TextConfig": 2,  # expert outputs all-reduced before their top-k sum
    "AXK1Config": 2,  # two expert all-reduces into one (sandwich) norm, no residual
    "Kolibri1Config": 2,
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(ISSUE_39_FAMILIES))
def test_the_moe_forms_of_issue_39_fuse_every_site(family: str):
    """Every all-reduce of these MoE families taken by allreduce_rmsnorm and
    sequence_parallel (the report's count is checked against the graph by the passes), the
    logits equal to eager."""
    passes = {k: PASSES[k] for k in ("allreduce_rmsnorm", "sequence_parallel")}
    config = small_config(load_config(family), layers=ISSUE_39_FAMILIES[family])
    report = check_model(config, name=family, passes=passes)
    assert not report.error, report.error
    for outcome in report.outcomes:
        assert outcome.rewritten == outcome.all_reduces, format_report([report])
        assert outcome.max_error < 1e-4, format_report([report])


@pytest.mark.slow
def test_every_family_with_a_tp_plan_runs_without_a_traceback(tmp_path: Path):
    """``benchmarks/coverage.py --all`` (about a minute a family on 2 cores): every family
    either runs or says why in one line; the logits of those that run equal eager's."""
    benchmark = _benchmark()
    assert benchmark.main(["--all", "--write-to", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "coverage_all.json").read_text())
    for report in data:
        assert "Traceback" not in (report["error"] or ""), report
        for outcome in report["outcomes"]:
            assert outcome["max_error"] < 1e-4, (report["name"], outcome)


def test_a_layernorm_family_fuses_with_allreduce_layernorm():
    """Starcoder2 (``nn.LayerNorm`` with bias, row-parallel biases after the all-reduce) at
    small sizes with ``tp_plan="auto"`` on 2 gloo ranks: every all-reduce taken by
    ``allreduce_layernorm`` (the graph-counted report), none by ``allreduce_rmsnorm``, which
    names the pass that takes them; logits equal to eager."""
    passes = {k: PASSES[k] for k in ("allreduce_rmsnorm", "allreduce_layernorm")}
    report = check_model(small_config(load_config("Starcoder2Config")), name="Starcoder2", passes=passes)
    assert not report.error, report.error
    assert report.norm == "LayerNorm"
    rms, layer = report.outcomes
    assert (layer.label, layer.all_reduces, layer.rewritten) == ("allreduce_layernorm", 5, 5), format_report(
        [report]
    )
    assert (rms.all_reduces, rms.rewritten) == (5, 0)
    assert all("allreduce_layernorm's site" in reason for reason in rms.reasons), rms.reasons
    assert layer.max_error < 1e-4 and rms.max_error < 1e-4
    benchmark = _benchmark()
    totals = benchmark.totals([report])
    assert totals["allreduce_layernorm"] == {"all_reduces": 5, "rewritten": 5, "followed_by_norm": 5}
    assert totals["allreduce_rmsnorm"]["followed_by_norm"] == 0  # LayerNorm sites are not its own


@pytest.mark.slow
@pytest.mark.parametrize("family", list(UNSET_DEFAULT_FAMILIES))
def test_families_with_unset_defaults_fuse_every_site(family: str):
    """The families of :data:`UNSET_DEFAULT_FAMILIES` shrunk, sharded on 2 gloo ranks:
    every all-reduce taken by the pass of their norm (Cohere-Compass: LayerNorm), logits
    equal to eager. Qwen4-Exp only runs: none of its 10 all-reduces is followed by a norm
    (hyper-connection mixes; one ends its graph at the QSA indexer's graph break)."""
    passes = {k: PASSES[k] for k in ("allreduce_rmsnorm", "allreduce_layernorm")}
    report = check_model(small_config(load_config(family)), name=family, passes=passes)
    assert not report.error, report.error
    if family != "qwen4_exp_text":  # its all-reduces feed hyper-connection mixes, no norm
        own = {"RMSNorm": "allreduce_rmsnorm", "LayerNorm": "allreduce_layernorm"}[report.norm]
        outcome = next(o for o in report.outcomes if o.label == own)
        assert outcome.all_reduces > 0 and outcome.rewritten == outcome.all_reduces, format_report([report])
    for outcome in report.outcomes:
        assert outcome.max_error < 1e-4, format_report([report])


def _gpt_neox_sites() -> int:
    """transformers 5.24 shards GPT-NeoX's embedding (``embed_in: embedding_rowwise`` in its TP
    plan): one more all-reduce, followed by layer 0's LayerNorm, a site without residual."""
    from packaging.version import Version

    return 5 if Version(transformers.__version__) >= Version("5.24") else 4


LAYERNORM_FAMILIES = {
    "CohereConfig": 5,
    "Cohere2Config": 5,
    "PhiConfig": 5,
    "GPTNeoXConfig": _gpt_neox_sites(),
    "OlmoConfig": 5,
    "NemotronConfig": 5,
}
"""allreduce_layernorm's sites per family at 2 layers (None: not pinned, only run)."""


@pytest.mark.slow
@pytest.mark.parametrize("family", list(LAYERNORM_FAMILIES))
def test_layernorm_families(family: str):
    report = check_model(
        small_config(load_config(family)),
        name=family,
        passes={"allreduce_layernorm": PASSES["allreduce_layernorm"]},
    )
    assert not report.error, report.error
    (outcome,) = report.outcomes
    if LAYERNORM_FAMILIES[family] is not None:
        assert outcome.rewritten == LAYERNORM_FAMILIES[family], format_report([report])
    assert outcome.max_error < 1e-4, format_report([report])


def test_no_reason_holds_the_separator_the_reports_join_reasons_with(monkeypatch: pytest.MonkeyPatch):
    """A pass's note joins its rejection reasons with ``"; "`` and the coverage table splits
    them on it to count each: a reason holding ``"; "`` would be counted as two (Dynamo's
    graph-break reasons included, two of them shown)."""
    from passkit_fusion.patterns import sites
    from torch._dynamo.utils import counters

    monkeypatch.setitem(counters, "graph_break", {"Dynamic shape operator": 2, "Unsupported method call": 1})
    reasons = [
        getattr(sites, name)
        for name in dir(sites)
        if name.isupper() and isinstance(getattr(sites, name), str)
    ]
    reasons += [sites.ends_graph_reason(), sites.GRAPH_BREAK_ADVICE]
    assert "Dynamic shape operator / Unsupported method call" in sites.ends_graph_reason()
    assert sites.HYPER_CONNECTIONS in reasons and sites.SCALED_AFTER_SUM in reasons
    for reason in reasons:
        assert "; " not in reason, reason


def test_a_pass_that_fails_with_passkits_own_error_is_reported_in_its_row():
    """A configuration failing with passkit's own error (a token range compiled at its first
    use guarding on a size the inputs do not carry, Qwen4-Exp's ``sequence_parallel``) is its
    row's "failed: ...", out of the totals; the family's other passes still report."""
    from passkit_fusion.coverage.run import FamilyReport, PassOutcome

    benchmark = _benchmark()
    report = FamilyReport(
        "Q",
        "QConfig",
        2,
        [
            PassOutcome("allreduce_rmsnorm", 3, 3, {}, 1e-7, 1, []),
            PassOutcome("sequence_parallel", 0, 0, {}, 0.0, 1, [], error="LateGuardError: set compile_at"),
        ],
        norm="RMSNorm",
    )
    assert benchmark.totals([report]) == {
        "allreduce_rmsnorm": {"all_reduces": 3, "rewritten": 3, "followed_by_norm": 3}
    }

    class Args:
        tp, tokens, mode = 2, 8, "eager"

    text = benchmark.render([report], Args(), 1.0)
    assert "| Q | QConfig | sequence_parallel | - | - | failed: LateGuardError: set compile_at | - |" in text
    assert "| RMSNorm | Q | QConfig | 3/3 | - | **failed** | 1.0e-07 |" in text
    assert (
        "1 pass configuration(s) failed with passkit's own error (in their rows): Q (sequence_parallel)."
        in text
    )
    assert benchmark.progress_line(report) == "allreduce_rmsnorm 3/3, sequence_parallel failed"


def test_a_table_gathered_from_several_runs_names_the_versions_of_each():
    """``--cache`` gathers reports of earlier runs, maybe made on another machine with
    another torch: the header says which versions made how many."""
    from passkit_fusion.coverage.run import FamilyReport, versions

    benchmark = _benchmark()
    here = FamilyReport("A", "AConfig", 2, [], error="x")
    assert here.versions == versions() and versions().startswith("torch ")
    there = FamilyReport("B", "BConfig", 2, [], error="x", versions="torch 2.11.0+cu130, transformers 5.23.0")

    class Args:
        tp, tokens, mode = 2, 8, "eager"

    assert "Reports made with" not in benchmark.render([here], Args(), 1.0)
    text = benchmark.render([here, there, there], Args(), 1.0, reused=2)
    assert (
        f"Reports made with: torch 2.11.0+cu130, transformers 5.23.0 (2 families); {versions()} (1 families)."
        in text
    )


def test_a_pass_counts_no_sites_in_a_family_without_its_norm():
    """Granite-hybrid's sites left by ``allreduce_layernorm`` for a scale (a reason that names
    no norm kind) are not LayerNorm sites: the family has RMSNorms only."""
    from passkit_fusion.coverage.run import FamilyReport, PassOutcome

    benchmark = _benchmark()
    scaled = {"x: a constant scale after the all-reduce's sum ...": 2}
    report = FamilyReport(
        "G",
        "GConfig",
        2,
        [
            PassOutcome("allreduce_rmsnorm", 3, 1, scaled, 0, 1, []),
            PassOutcome("allreduce_layernorm", 3, 0, scaled, 0, 1, []),
        ],
        norm="RMSNorm",
    )
    got = benchmark.totals([report])
    assert got["allreduce_rmsnorm"]["followed_by_norm"] == 3
    assert got["allreduce_layernorm"]["followed_by_norm"] == 0


def test_small_config_at_a_serving_width():
    """``hidden``: the residual stream that wide, the MLP twice it; attention keeps the small
    heads where the config names a head dim, else gets 128-wide heads (4 per KV head)."""
    llama = small_config(load_config("Llama"), layers=2, hidden=4096)
    assert (llama.hidden_size, llama.intermediate_size, llama.num_attention_heads, llama.head_dim) == (
        4096,
        8192,
        4,
        16,
    )
    qwen2 = small_config(load_config("Qwen2"), layers=2, hidden=4096)  # no head_dim: hidden / heads
    assert (qwen2.num_attention_heads, qwen2.num_key_value_heads) == (32, 8)
    assert qwen2.hidden_size // qwen2.num_attention_heads == 128
    with pytest.raises(ValueError, match="multiple of 128"):
        small_config(load_config("Llama"), hidden=100)


def test_gpu_table_reads_each_pass_of_the_pipeline():
    """``--gpu``'s table: one compile of the serving pipeline reported per pass (fused of the
    sites its norm follows, a skip's reason beside it), passkit's error beside Inductor's, a
    family that did not run with its reason."""
    import argparse

    from passkit_fusion.coverage.run import GPU_PASSES, FamilyReport, PassOutcome, _reported

    assert _reported("passkit", GPU_PASSES["passkit"]) == ["allreduce_rmsnorm", "allreduce_layernorm"]
    assert _reported("inductor", []) == ["inductor"]
    assert _reported("sequence_parallel+async_tp", PASSES["sequence_parallel+async_tp"]) == [
        "sequence_parallel+async_tp"
    ]
    skipped = "skipped: flashinfer is not installed"
    reports = [
        FamilyReport(
            "Llama",
            "LlamaConfig",
            2,
            [
                PassOutcome("inductor", 0, 0, {}, 0.066, 1, []),
                PassOutcome("allreduce_rmsnorm", 5, 4, {"why": 1}, 0.055, 1, [], statuses=["ran"]),
                PassOutcome("allreduce_layernorm", 0, 0, {}, 0.055, 1, [], statuses=[skipped]),
            ],
            norm="RMSNorm",
        ),
        FamilyReport("gpt-oss", "GptOssConfig", 2, [], error="no tensor-parallel plan"),
    ]
    args = argparse.Namespace(dp=1, tp=2, hidden=4096, layers=2, tokens=8)
    text = _benchmark().render_gpu(reports, args, 12.0)
    row = next(line for line in text.splitlines() if line.startswith("| RMSNorm | Llama |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:] == ["**4/5**", f"0/0 ({skipped})", "5.5e-02", "6.6e-02"], cells
    assert any(
        line.startswith("| ? | gpt-oss |") and "not run: no tensor-parallel plan" in line
        for line in text.splitlines()
    )


def _tp_plan_shards_experts() -> bool:
    """transformers up to 5.24 shards MoE experts in the TP plan; 5.25 only in the EP plan."""
    from packaging.version import Version

    return Version(transformers.__version__) < Version("5.25")


MOE_FAMILIES = {
    # family: (layers, all-reduces fused by allreduce_rmsnorm and sequence_parallel)
    "MixtralConfig": (2, 5),  # embedding, then attention + experts per layer
    "Qwen3MoeConfig": (2, 5),
    "OlmoeConfig": (2, 5),
    "Qwen3NextConfig": (4, 10),  # 6 sites: each MoE layer's shared-expert all-reduce merged
    "GptOssConfig": (2, 3),  # its TP plan shards only the embedding: attention is replicated
}
"""The MoE families whose expert all-reduces transformers 5.25's tp_plan='auto' no longer
makes (the experts moved to the EP plan): with the coverage run's layout
(:mod:`passkit_fusion.coverage.layout`) every site of 5.24 is there and fused on both releases
(GPT-OSS: its experts were never in its TP plan, so 5.24 also gains two sites)."""


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_the_moe_families_experts_are_sharded_on_the_installed_transformers(family: str):
    """The real config of the installed transformers: its experts sharded by its TP plan
    (up to 5.24) or, where the TP plan leaves them out (5.25; GPT-OSS on both), by expert
    parallelism over the TP group; never replicated on every rank."""
    from passkit_fusion.coverage.layout import distributed_layout, unsharded_experts

    config = small_config(load_config(family))
    layout = distributed_layout(config, 2)
    if unsharded_experts(config):
        assert layout.kwargs.get("ep_size") == 2, layout
        assert layout.note is not None and "experts sharded with ep_size=2" in layout.note
    else:
        assert family != "GptOssConfig" and _tp_plan_shards_experts(), (family, transformers.__version__)
        assert "ep_size" not in layout.kwargs


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_the_moe_families_fuse_every_site(family: str):
    """Sharded on 2 gloo ranks as the coverage run does: every all-reduce taken by
    allreduce_rmsnorm and sequence_parallel (counted against the graph by the passes), the
    count pinned, logits equal to eager."""
    layers, pinned = MOE_FAMILIES[family]
    passes = {k: PASSES[k] for k in ("allreduce_rmsnorm", "sequence_parallel")}
    report = check_model(small_config(load_config(family), layers=layers), name=family, passes=passes)
    assert not report.error, report.error
    for outcome in report.outcomes:
        assert (outcome.all_reduces, outcome.rewritten) == (pinned, pinned), format_report([report])
        assert outcome.max_error < 1e-4, format_report([report])
