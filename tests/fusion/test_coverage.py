"""Coverage of Hugging Face families (``passkit_fusion.coverage``, ``benchmarks/coverage.py``,
``passkit explain-hf``): configs read and shrunk, bad input named, and the all-reduce sites
of real architectures sharded with ``tp_plan="auto"`` on a 2-rank gloo world fused, with
the logits equal to eager. One family in the default suite, every family marked slow."""

from __future__ import annotations

import importlib.util
import json
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
    captured = capsys.readouterr()
    assert "error: 'NoSuchConfig' is neither a config file" in captured.err and not captured.out
    assert cli.main(["explain-hf", "LlamaConfig", "--tp", "3", "--tokens", "8"]) == 2
    assert "--tp must be >= 2 and divide --tokens" in capsys.readouterr().err


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


def test_a_family_without_a_tp_plan_says_so():
    report = check_model(small_config(load_config("gpt-oss")), name="gpt-oss", passes=REFERENCE_ONLY)
    if not report.error:
        pytest.skip(f"transformers {transformers.__version__} has a TP plan for gpt-oss")
    assert "has no tensor-parallel plan" in report.error
    assert "not run: GptOssConfig has no tensor-parallel plan" in format_report([report])


# -- families on a gloo world -------------------------------------------------------------------


def test_explain_hf_on_a_users_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """A user's Granite-MoE config.json: the embedding scaled by embedding_multiplier, each
    MoE output reshaped and scaled by residual_multiplier (its TP plan shards only the
    experts: 3 all-reduces): every all-reduce fused, logits equal to eager."""
    transformers.GraniteMoeConfig(residual_multiplier=0.22, embedding_multiplier=12.0).save_pretrained(
        tmp_path
    )
    assert cli.main(["explain-hf", str(tmp_path / "config.json"), "--passes", "allreduce_rmsnorm"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "| allreduce_rmsnorm |" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:6] == ["3", "3", "-"], out  # all-reduces, rewritten, why the rest were left
    assert float(cells[6]) < 1e-5, row
    assert "allreduce_rmsnorm: 3 of 3 all-reduce(s) fused" in out


@pytest.mark.slow
def test_decode_benchmark_smoke_on_cpu(capsys: pytest.CaptureFixture[str]):
    """``benchmarks/coverage.py --decode --device cpu``: the two-GPU script's logic, tiny."""
    benchmark = _benchmark()
    args = ["--decode", "--device", "cpu", "--layers", "1", "--tokens", "1,2", "--replays", "1"]
    assert benchmark.main(args) == 0
    out = capsys.readouterr().out
    assert "| tokens | inductor (us) | allreduce_rmsnorm (us) |" in out, out
    assert "allreduce_rmsnorm sites fused per compiled graph: [3" in out, out


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
