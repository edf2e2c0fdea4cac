"""CPU tests of passkit_fusion.allreduce_rmsnorm (runtime, tune) and passkit_fusion.tuning (no GPU, no flashinfer).

* Pure logic, in this process: tables (JSON round trip, lookups, conservative defaults,
  validation), ``choose_path`` (fused paths and every fallback reason), plan fingerprints
  and ``compare_plans``, configuration, which flashinfer API is selected and why the fused
  kernel is unavailable, ``choose`` / ``rules_from_measurements``.
* gloo worlds of 4 and 8 ranks, without CUDA: the unfused fallback against a float64
  single-process reference, the op falling back, the rank-consistency check raising when
  ranks disagree, ``tune`` refusing to run.
* A 2-rank gloo world with ``fake_flashinfer`` (a hand-written ``flashinfer.comm`` with
  flashinfer 0.7.2's signatures whose "kernels" all-reduce with gloo), ``torch.cuda``
  reporting an sm90 GPU and runtime's per-call check seeing CPU inputs as CUDA ones
  (``LooksCuda``): the fused paths through the unified API, the legacy API and two
  older API shapes, the arguments runtime passes to flashinfer, workspaces, the
  rank-consistency check, and ``tune`` with ``graph_median_us`` replaced by given medians.

Each world runs once (module-scoped fixtures); the tests read its ranks' results. Rank
functions are module-level so that the spawned ranks can import them.
"""

from __future__ import annotations

import inspect
import json
import math
import sys
import types
from typing import Any

import fake_flashinfer
import pytest
import torch
import torch.distributed as dist
from passkit_fusion.allreduce_rmsnorm import flashinfer_api, runtime, tune
from passkit_fusion.tuning import tables
from passkit_fusion.tuning.tables import UNFUSED, Decision, Entry, Measurement, Rule, Table, TableKey
from passkit_testing.worlds import gloo_world

from passkit_fusion import reference

ONESHOT, TWOSHOT = Decision(True, True), Decision(True, False)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
EPS = 1e-6
HIDDEN = 64
FAKE_GPU = "Fake GPU"

#: (rtol, atol) against the float64 reference: the sums over up to 8 ranks round at each step.
TOLERANCES = {FP32: (2e-6, 2e-6), FP16: (4e-3, 4e-3), BF16: (3e-2, 3e-2)}


# ============================================================================ helpers


def _inputs(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    world_size: int,
    *,
    residual: bool = True,
    weight_bias: float = 0.0,
    weight_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor]:
    """Every rank's ``x``, and the residual and weight shared by all ranks (deterministic)."""

    def randn(size: tuple[int, ...], s: int) -> torch.Tensor:
        return torch.randn(size, generator=torch.Generator().manual_seed(s))

    xs = [randn(shape, 1000 * seed + rank).to(dtype) for rank in range(world_size)]
    res = randn(shape, 1000 * seed + 999).to(dtype) if residual else None
    weight = (1.0 - weight_bias) + 0.1 * randn((shape[-1],), 1000 * seed + 998)
    return xs, res, weight.to(weight_dtype or dtype)


def _reference(
    xs: list[torch.Tensor], residual: torch.Tensor | None, weight: torch.Tensor, weight_bias: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm_out, residual_out)`` in float64, in one process."""
    summed = torch.stack([x.double() for x in xs]).sum(0)
    if residual is not None:
        summed = summed + residual.double()
    norm = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + EPS)
    return norm * (weight.double() + weight_bias), summed


def _assert_matches_reference(
    outputs: tuple[torch.Tensor, torch.Tensor],
    reference: tuple[torch.Tensor, torch.Tensor],
    dtype: torch.dtype,
) -> None:
    rtol, atol = TOLERANCES[dtype]
    for name, actual, expected in zip(("norm_out", "residual_out"), outputs, reference):
        assert actual.dtype == dtype, (name, actual.dtype)
        assert actual.shape == expected.shape, (name, actual.shape)
        torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol, msg=name)


LooksCuda = fake_flashinfer.LooksCuda
_clear_runtime_caches = fake_flashinfer.clear_runtime_caches


@pytest.fixture
def fresh_runtime():
    """Default runtime settings, empty caches and stats before and after the test."""
    _clear_runtime_caches()
    runtime.configure(
        max_tokens=None, check_rank_consistency=True, table=None, force=None, flashinfer_api="auto"
    )
    runtime.reset_stats()
    yield
    runtime.destroy_workspaces()
    runtime.configure(
        max_tokens=None, check_rank_consistency=True, table=None, force=None, flashinfer_api="auto"
    )
    runtime.reset_stats()
    _clear_runtime_caches()


@pytest.fixture
def fake_gpu(monkeypatch, fresh_runtime):
    """``torch.cuda`` reports one sm90 GPU; ``install(variant)`` puts a fake flashinfer in place."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: FAKE_GPU)

    def install(variant: str | None) -> types.ModuleType | None:
        _clear_runtime_caches()
        monkeypatch.delitem(sys.modules, "flashinfer.comm", raising=False)
        if variant is None:  # not installed
            monkeypatch.setitem(sys.modules, "flashinfer", None)
            return None
        flashinfer, comm = fake_flashinfer.make_modules(variant)
        monkeypatch.setitem(sys.modules, "flashinfer", flashinfer)
        monkeypatch.setitem(sys.modules, "flashinfer.comm", comm)
        return comm

    return install


# ============================================================================ tables


def test_table_save_load_round_trip(tmp_path):
    key2, key4 = TableKey("NVIDIA H200", 2, 4096, "bfloat16"), TableKey("NVIDIA H200", 4, 8192, "float16")
    table = Table(
        {
            key2: Entry((Rule(64, ONESHOT), Rule(1024, TWOSHOT)), {"measured": "2026-01-01"}),
            key4: Entry((Rule(16, UNFUSED), Rule(256, ONESHOT))),
        }
    )
    path = tmp_path / "sub" / "table.json"
    tables.save_table(table, path)
    data = json.loads(path.read_text())
    assert data["format"] == "passkit-fusion-table/1"
    assert [(e["world_size"], e["hidden"], e["dtype"]) for e in data["entries"]] == [
        (2, 4096, "bfloat16"),
        (4, 8192, "float16"),
    ]
    assert data["entries"][0]["rules"] == [
        {"max_tokens": 64, "fused": True, "oneshot": True},
        {"max_tokens": 1024, "fused": True, "oneshot": False},
    ]
    loaded = tables.load_table(path)
    assert loaded == table
    assert loaded.entries[key2].rules == (Rule(64, ONESHOT), Rule(1024, TWOSHOT))
    assert loaded.entries[key2].source == {"measured": "2026-01-01"}
    assert loaded.entries[key4].source == {}
    assert loaded != Table({key2: table.entries[key2]})


def test_table_lookup_bounds_are_inclusive_and_above_the_last_rule_is_unfused():
    key = TableKey("NVIDIA H200", 2, 4096, "bfloat16")
    table = Table({key: Entry((Rule(64, ONESHOT), Rule(128, UNFUSED), Rule(1024, TWOSHOT)))})
    expected = {
        1: ONESHOT,
        64: ONESHOT,
        65: UNFUSED,
        128: UNFUSED,
        129: TWOSHOT,
        1024: TWOSHOT,
        1025: UNFUSED,
    }
    for tokens, decision in expected.items():
        # dtype given as a torch.dtype, a plain name or torch's str()
        for dtype in (torch.bfloat16, "bfloat16", "torch.bfloat16"):
            assert table.lookup("NVIDIA H200", 2, 4096, dtype, tokens) == decision, (tokens, dtype)
    assert tables.lookup("NVIDIA H200", 2, 4096, BF16, 129, table=table) == TWOSHOT
    assert table.rules_for("NVIDIA H200", 2, 4096, FP16) is None
    # An entry with no rules never fuses, where the conservative default would.
    never = Table({key: Entry(())})
    assert never.resolve("NVIDIA H200", 2, 4096, BF16) == ()
    assert never.lookup("NVIDIA H200", 2, 4096, BF16, 1) == UNFUSED
    # merged(): the other table's entries win.
    merged = table.merged(never)
    assert merged.lookup("NVIDIA H200", 2, 4096, BF16, 1) == UNFUSED
    assert table.lookup("NVIDIA H200", 2, 4096, BF16, 1) == ONESHOT


@pytest.mark.parametrize(
    ("world_size", "hidden", "dtype", "expected"),
    [
        (2, 4096, BF16, (Rule(1024, ONESHOT),)),  # 8 MiB / (4096 * 2 bytes)
        (2, 8192, BF16, (Rule(512, ONESHOT),)),
        (2, 4096, FP32, (Rule(512, ONESHOT),)),
        (2, 4096, "float16", (Rule(1024, ONESHOT),)),
        (4, 4096, BF16, ()),  # only world size 2 fuses without a table
        (8, 4096, BF16, ()),
        (2, 0, BF16, ()),
        (2, 2**22 + 8, BF16, ()),  # one token is over 8 MiB
    ],
)
def test_conservative_rules(world_size, hidden, dtype, expected):
    assert tables.conservative_rules(world_size, hidden, dtype) == expected
    assert Table().resolve("Unknown GPU", world_size, hidden, dtype) == expected


def test_conservative_default_lookups_without_a_matching_entry():
    table = Table({TableKey("NVIDIA H200", 2, 4096, "bfloat16"): Entry((Rule(8, TWOSHOT),))})
    assert table.lookup("Other GPU", 2, 4096, BF16, 1024) == ONESHOT
    assert table.lookup("Other GPU", 2, 4096, BF16, 1025) == UNFUSED
    assert table.lookup("Other GPU", 4, 4096, BF16, 1) == UNFUSED
    assert table.lookup("NVIDIA H200", 2, 4096, FP16, 1024) == ONESHOT  # other dtype: default
    assert table.lookup("NVIDIA H200", 2, 4096, BF16, 9) == UNFUSED  # the entry, not the default


def test_shipped_tables():
    table = tables.default_table()
    assert len(table) >= 2
    for key, entry in table.entries.items():
        assert entry.rules, key
        assert entry.source.get("medians_us"), key  # provenance kept
    assert table.lookup("NVIDIA H200", 2, 4096, BF16, 4096) == ONESHOT
    assert table.lookup("NVIDIA H200", 2, 4096, BF16, 4097) == UNFUSED
    assert tables.lookup("cpu", 2, 4096, BF16, 1) == ONESHOT  # no entry: conservative
    assert tables.lookup("cpu", 8, 4096, BF16, 1) == UNFUSED


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"format": "passkit-fusion-table/0"}, "expected format"),
        ({"format": tables.TABLE_FORMAT, "entries": [{"gpu": "g"}]}, "entry 0 is invalid"),
        (
            {
                "format": tables.TABLE_FORMAT,
                "entries": [{"gpu": "g", "world_size": 2, "hidden": 8, "dtype": "floaty", "rules": []}],
            },
            "unknown dtype 'floaty'",
        ),
        (
            {
                "format": tables.TABLE_FORMAT,
                "entries": [
                    {
                        "gpu": "g",
                        "world_size": 2,
                        "hidden": 8,
                        "dtype": "bfloat16",
                        "rules": [{"max_tokens": 8, "fused": True}, {"max_tokens": 8, "fused": False}],
                    }
                ],
            },
            "strictly increasing",
        ),
        (
            {
                "format": tables.TABLE_FORMAT,
                "entries": [
                    {
                        "gpu": "g",
                        "world_size": 2,
                        "hidden": 8,
                        "dtype": "bfloat16",
                        "rules": [{"max_tokens": 0, "fused": True}],
                    }
                ],
            },
            "positive",
        ),
        (
            {
                "format": tables.TABLE_FORMAT,
                "entries": [
                    {"gpu": "g", "world_size": 2, "hidden": 8, "dtype": "bfloat16", "rules": []},
                    {"gpu": "g", "world_size": 2, "hidden": 8, "dtype": "torch.bfloat16", "rules": []},
                ],
            },
            "entry 1 repeats",
        ),
    ],
)
def test_invalid_tables_are_rejected_naming_the_file(tmp_path, data, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as info:
        tables.load_table(path)
    assert str(path) in str(info.value)


def test_table_constructor_validates_rules():
    with pytest.raises(ValueError, match="strictly increasing"):
        Table({TableKey("g", 2, 8, "bfloat16"): Entry((Rule(8, ONESHOT), Rule(4, ONESHOT)))})


# ============================================================================ choose_path

CALL = {"hidden": 4096, "dtype": BF16, "world_size": 2, "max_tokens": 2048}


@pytest.mark.parametrize(
    ("decision", "changes", "expected"),
    [
        (ONESHOT, {"tokens": 1}, "fused_oneshot"),
        (ONESHOT, {"tokens": 2048}, "fused_oneshot"),  # the workspace's capacity is inclusive
        (TWOSHOT, {"tokens": 3}, "fused_twoshot"),
        (TWOSHOT, {"tokens": 2}, "fused_oneshot"),  # two-shot needs tokens > world size
        (TWOSHOT, {"tokens": 8, "world_size": 8}, "fused_oneshot"),
        (TWOSHOT, {"tokens": 9, "world_size": 8}, "fused_twoshot"),
        (TWOSHOT, {"tokens": 100, "world_size": 16}, "fused_oneshot"),  # no two-shot at 16
        (ONESHOT, {"tokens": 1, "dtype": FP32, "hidden": 8}, "fused_oneshot"),
        (ONESHOT, {"tokens": 1, "dtype": FP16, "world_size": 4}, "fused_oneshot"),
    ],
)
def test_choose_path_fused(decision, changes, expected):
    assert runtime.choose_path(decision, **{**CALL, **changes}) == (expected, "")


@pytest.mark.parametrize(
    ("decision", "changes", "reason"),
    [
        (ONESHOT, {"tokens": 2049}, "over_workspace"),
        (TWOSHOT, {"tokens": 4096}, "over_workspace"),
        (ONESHOT, {"tokens": 1, "max_tokens": 0}, "over_workspace"),
        (ONESHOT, {"tokens": 1, "hidden": 4100}, "hidden_not_multiple_of_8"),
        (ONESHOT, {"tokens": 1, "hidden": 12}, "hidden_not_multiple_of_8"),
        (ONESHOT, {"tokens": 1, "dtype": torch.float64}, "dtype_unsupported"),
        (ONESHOT, {"tokens": 1, "dtype": torch.float8_e4m3fn}, "dtype_unsupported"),
        (ONESHOT, {"tokens": 1, "world_size": 1}, "world_size_unsupported"),
        (ONESHOT, {"tokens": 1, "world_size": 3}, "world_size_unsupported"),
        (ONESHOT, {"tokens": 1, "world_size": 32}, "world_size_unsupported"),
        (UNFUSED, {"tokens": 1}, "table"),
        (ONESHOT, {"tokens": 0}, "no_tokens"),
        (ONESHOT, {"tokens": 1, "unavailable": "flashinfer_missing"}, "flashinfer_missing"),
        (ONESHOT, {"tokens": 1, "unavailable": "cuda_unavailable"}, "cuda_unavailable"),
    ],
)
def test_choose_path_fallback_reasons(decision, changes, reason):
    assert runtime.choose_path(decision, **{**CALL, **changes}) == ("fallback", reason)


def test_choose_path_reason_precedence():
    """Why the kernel cannot run at all comes first, then the shape, the table, the tokens."""
    call: dict[str, Any] = {
        "tokens": 0,
        "hidden": 12,
        "dtype": torch.float64,
        "world_size": 3,
        "max_tokens": 0,
        "unavailable": "not_cuda",
    }
    assert runtime.choose_path(UNFUSED, **call) == ("fallback", "not_cuda")
    for field, value, reason in [
        ("unavailable", None, "world_size_unsupported"),
        ("world_size", 2, "dtype_unsupported"),
        ("dtype", BF16, "hidden_not_multiple_of_8"),
        ("hidden", 16, "table"),
    ]:
        call[field] = value
        assert runtime.choose_path(UNFUSED, **call) == ("fallback", reason), field
    assert runtime.choose_path(ONESHOT, **call) == ("fallback", "no_tokens")
    call["tokens"] = 1
    assert runtime.choose_path(ONESHOT, **call) == ("fallback", "over_workspace")
    call["max_tokens"] = 1
    assert runtime.choose_path(ONESHOT, **call) == ("fused_oneshot", "")


# ============================================================================ availability


def test_without_cuda_the_fused_kernel_is_unavailable(fresh_runtime, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime.unavailable_reason() == "cuda_unavailable"
    assert runtime._call_unavailable(torch.zeros(2, 8).as_subclass(LooksCuda), 0.0) == "cuda_unavailable"


def test_flashinfer_missing(fake_gpu):
    fake_gpu(None)
    assert runtime.unavailable_reason() == "flashinfer_missing"
    assert runtime.flashinfer_version() is None
    assert flashinfer_api.select_api("auto") is None
    with pytest.raises(RuntimeError, match="no usable flashinfer API: flashinfer_missing"):
        runtime._api()
    path = runtime.choose_path(
        ONESHOT,
        tokens=1,
        hidden=4096,
        dtype=BF16,
        world_size=2,
        max_tokens=1024,
        unavailable=runtime.unavailable_reason(),
    )
    assert path == ("fallback", "flashinfer_missing")


@pytest.mark.parametrize(
    ("variant", "preference", "api", "weight_bias", "metadata"),
    [
        ("0.7.2", "auto", "kernel", True, None),
        ("0.7.2", "kernel", "kernel", True, None),
        ("0.7.2", "unified", "unified", True, None),
        ("0.7.2", "legacy", "legacy", True, True),
        ("legacy-only", "auto", "legacy", False, False),
        ("legacy-only", "legacy", "legacy", False, False),
        ("legacy-only", "unified", None, None, None),
        ("legacy-only", "kernel", None, None, None),
        ("unified-no-weight-bias", "auto", "unified", False, None),
        ("unified-no-weight-bias", "legacy", None, None, None),
        ("unified-no-weight-bias", "kernel", None, None, None),
    ],
)
def test_flashinfer_api_selection(fake_gpu, variant, preference, api, weight_bias, metadata):
    fake_gpu(variant)
    runtime.configure(flashinfer_api=preference)
    selected = flashinfer_api.select_api(preference)
    assert runtime.flashinfer_version() == fake_flashinfer.VERSION
    if api is None:
        assert selected is None
        assert runtime.unavailable_reason() == f"flashinfer_api_missing:{preference}"
        return
    assert runtime.unavailable_reason() is None
    assert selected is runtime._api()
    assert selected.name == api
    assert selected.supports_weight_bias is weight_bias
    if metadata is not None:  # legacy: metadata is both made at creation and passed to runs
        assert selected._makes_metadata is metadata
        assert selected._takes_metadata is metadata
    # The per-call conditions: a CUDA input, and weight_bias support.
    x = torch.zeros(2, 8)
    assert runtime._call_unavailable(x, 0.0) == "not_cuda"
    assert runtime._call_unavailable(x, 1.0) == "not_cuda"
    x = x.as_subclass(LooksCuda)
    assert runtime._call_unavailable(x, 0.0) is None
    assert runtime._call_unavailable(x, 1.0) == (None if weight_bias else "weight_bias_unsupported")


@pytest.mark.parametrize(
    ("major", "reason"),
    [(8, "gpu_arch_unsupported"), (9, None), (10, None), (12, None), (7, "gpu_arch_unsupported")],
)
def test_gpu_architecture(fake_gpu, monkeypatch, major, reason):
    fake_gpu("0.7.2")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    assert runtime.unavailable_reason() == reason


def test_old_signatures_reject_the_new_keywords():
    """The fake's older variants really lack the parameters (runtime must not pass them)."""

    def call_with(fn, **extra):
        required = {
            name: None
            for name, p in inspect.signature(fn).parameters.items()
            if p.default is inspect.Parameter.empty
        }
        return fn(**required, **extra)

    _, comm = fake_flashinfer.make_modules("legacy-only")
    with pytest.raises(TypeError, match="unexpected keyword argument 'weight_bias'"):
        call_with(comm.trtllm_allreduce_fusion, weight_bias=1.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'metadata'"):
        call_with(comm.trtllm_allreduce_fusion, metadata={})
    with pytest.raises(TypeError, match="unexpected keyword argument 'create_metadata'"):
        call_with(comm.trtllm_create_ipc_workspace_for_all_reduce_fusion, create_metadata=True)
    assert not hasattr(comm, "allreduce_fusion")
    _, comm = fake_flashinfer.make_modules("unified-no-weight-bias")
    with pytest.raises(TypeError, match="unexpected keyword argument 'weight_bias'"):
        call_with(comm.allreduce_fusion, weight_bias=1.0)
    assert not hasattr(comm, "trtllm_allreduce_fusion")


# ============================================================================ plans


def test_plan_fingerprint():
    plan = {"world_size": 2, "max_tokens": 2048, "table": "abc", "force": None}
    reordered = dict(reversed(list(plan.items())))
    assert runtime.plan_fingerprint(plan) == runtime.plan_fingerprint(reordered)
    assert runtime.plan_fingerprint(plan) != runtime.plan_fingerprint({**plan, "max_tokens": 1024})
    assert runtime.plan_fingerprint(plan) != runtime.plan_fingerprint({**plan, "force": "unfused"})
    fingerprints = {runtime.plan_fingerprint({"n": n}) for n in range(1000)}
    assert len(fingerprints) == 1000
    assert all(0 <= f < 2**63 for f in fingerprints)  # fits an int64 tensor


def test_compare_plans_names_the_field_and_the_ranks():
    a = {"world_size": 4, "max_tokens": 2048, "api": "unified"}
    b = {**a, "max_tokens": 1024}
    c = {**a, "max_tokens": 1024, "api": "legacy"}
    assert runtime.compare_plans([]) is None
    assert runtime.compare_plans([a]) is None
    assert runtime.compare_plans([a, dict(a), dict(a), dict(a)]) is None
    assert runtime.compare_plans([a, b, a, b]) == (
        "field 'max_tokens' differs: 2048 on ranks 0, 2; 1024 on ranks 1, 3"
    )
    assert runtime.compare_plans([b, b, b, a]) == (
        "field 'max_tokens' differs: 1024 on ranks 0, 1, 2; 2048 on rank 3"
    )
    # The first differing field in rank 0's order.
    assert runtime.compare_plans([a, c]) == "field 'max_tokens' differs: 2048 on rank 0; 1024 on rank 1"
    assert runtime.compare_plans([b, c]) == ("field 'api' differs: 'unified' on rank 0; 'legacy' on rank 1")
    # A field that only some ranks have.
    assert runtime.compare_plans([a, {**a, "extra": 1}]) == (
        "field 'extra' differs: '<missing>' on rank 0; 1 on rank 1"
    )
    assert runtime.compare_plans([{**a, "flashinfer": None}, {**a, "flashinfer": "0.7.2"}]) == (
        "field 'flashinfer' differs: None on rank 0; '0.7.2' on rank 1"
    )


# ============================================================================ configuration


def test_configure_validates_and_forced_restores(fresh_runtime):
    with pytest.raises(ValueError, match="max_tokens"):
        runtime.configure(max_tokens=0)
    with pytest.raises(ValueError, match="flashinfer_api"):
        runtime.configure(flashinfer_api="newest")
    with pytest.raises(TypeError, match="Decision"):
        runtime.configure(force="fused")
    with pytest.raises(TypeError, match="Table"):
        runtime.configure(table={"entries": []})
    assert runtime.current_config() == runtime.RuntimeConfig()  # failed calls changed nothing
    config = runtime.configure(max_tokens=64, flashinfer_api="legacy")
    assert config is runtime.current_config()
    assert (config.max_tokens, config.flashinfer_api, config.force) == (64, "legacy", None)
    assert runtime.configure(force=TWOSHOT).max_tokens == 64  # unnamed settings are kept
    with runtime.forced(ONESHOT):
        assert runtime.current_config().force == ONESHOT
    assert runtime.current_config().force == TWOSHOT
    with pytest.raises(KeyError), runtime.forced(UNFUSED):
        raise KeyError
    assert runtime.current_config().force == TWOSHOT


def test_rmsnorm_in_float32_with_weight_bias():
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(0)).to(BF16)
    w = (0.1 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(1))).to(BF16)
    expected = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + EPS)
    out = reference.rms_norm(h, w, EPS, 1.0)
    assert out.dtype == BF16
    torch.testing.assert_close(out.double(), expected * (w.double() + 1.0), rtol=1.6e-2, atol=1e-2)
    assert (out.double() - expected * w.double()).abs().max() > 0.5  # the bias is applied


# ============================================================================ tuning rules


@pytest.mark.parametrize(
    ("measurement", "margin", "expected"),
    [
        (Measurement(8, 10.5, 10.0, None), 0.05, ONESHOT),  # exactly at the margin
        (Measurement(8, 10.49, 10.0, None), 0.05, UNFUSED),  # just short of it
        (Measurement(8, 10.0, 9.6, None), 0.05, UNFUSED),  # faster, but not by the margin
        (Measurement(8, 10.0, 9.6, None), 0.0, ONESHOT),
        (Measurement(8, 10.0, 9.6, None), 0.5, UNFUSED),
        (Measurement(8, 20.0, 12.0, 9.0), 0.05, TWOSHOT),  # the faster fused variant
        (Measurement(8, 20.0, 9.0, 12.0), 0.05, ONESHOT),
        (Measurement(8, 20.0, 30.0, 12.0), 0.05, TWOSHOT),
        (Measurement(8, 20.0, None, None), 0.05, UNFUSED),
        (Measurement(8, 5.0, 6.0, 7.0), 0.05, UNFUSED),
    ],
)
def test_choose_fuses_only_when_faster_by_the_margin(measurement, margin, expected):
    assert tables.choose(measurement, margin) == expected


def test_rules_from_measurements():
    measurements = [  # given out of order
        Measurement(4096, 150.0, 200.0, 149.0),  # twoshot not 5% faster: unfused (trailing)
        Measurement(1, 13.0, 6.0, None),
        Measurement(512, 41.0, 20.0, 18.0),
        Measurement(2, 13.0, 6.0, None),
        Measurement(4, 14.0, 6.0, 9.0),
        Measurement(2048, 99.0, 96.0, 86.0),
        Measurement(8192, 300.0, 400.0, 350.0),
    ]
    assert tables.rules_from_measurements(measurements, margin=0.05) == (
        Rule(4, ONESHOT),
        Rule(2048, TWOSHOT),
    )
    # With a 20% margin, 2048 tokens (86 vs 99: 15% faster) no longer fuses.
    assert tables.rules_from_measurements(measurements, margin=0.2) == (Rule(4, ONESHOT), Rule(512, TWOSHOT))
    # A non-trailing unfused run stays explicit, so the fused run above it keeps its bounds.
    gap = [
        Measurement(1, 10.0, 5.0, None),
        Measurement(2, 10.0, 11.0, None),
        Measurement(3, 10.0, 10.0, None),
        Measurement(4, 10.0, 5.0, 4.0),
    ]
    assert tables.rules_from_measurements(gap) == (Rule(1, ONESHOT), Rule(3, UNFUSED), Rule(4, TWOSHOT))
    assert tables.rules_from_measurements([Measurement(1, 5.0, 6.0, None)]) == ()
    assert tables.rules_from_measurements([]) == ()
    # The rules form a valid table entry.
    Table({TableKey("g", 2, 8, "bfloat16"): Entry(tables.rules_from_measurements(gap))})


def test_tuning_baselines_compute_the_same_add_rmsnorm():
    """The Inductor-compiled baseline the tables compare with is the op's computation."""
    reduced, residual = torch.randn(2, 5, 64).unbind(0)
    weight = 1 + 0.1 * torch.randn(64)
    compiled = tune._compiled_add_rmsnorm()(reduced, residual, weight, 1e-6)
    eager = tune._eager_add_rmsnorm(reduced, residual, weight, 1e-6)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want)


def test_tune_rejects_bad_token_counts():
    for counts in ([], [0, 8], [-1]):
        with pytest.raises(ValueError, match="token_counts"):
            tune.tune(None, HIDDEN, BF16, counts)


# ============================================================================ gloo worlds without CUDA

#: name: (shape, dtype, residual, weight_bias, weight dtype)
UNFUSED_CASES: dict[str, tuple[tuple[int, ...], torch.dtype, bool, float, torch.dtype]] = {
    "fp32": ((6, HIDDEN), FP32, True, 0.0, FP32),
    "fp32-no-residual-weight-bias": ((2, 3, HIDDEN), FP32, False, 1.0, FP32),
    "bf16-fp32-weight": ((7, HIDDEN), BF16, True, 0.0, FP32),
    "fp16-weight-bias": ((5, HIDDEN), FP16, True, 1.0, FP16),
}
OP_SHAPE = (2, 3, HIDDEN)
#: world size: ranks configured differently from rank 0 in the rank-consistency check
ODD_RANKS = {4: (1, 3), 8: (5,)}


def _case(name: str, world_size: int):
    shape, dtype, residual, weight_bias, weight_dtype = UNFUSED_CASES[name]
    xs, res, weight = _inputs(
        shape,
        dtype,
        world_size,
        residual=residual,
        weight_bias=weight_bias,
        weight_dtype=weight_dtype,
        seed=len(name),
    )
    return xs, res, weight, weight_bias


def _cpu_rank(rank: int, world_size: int, odd_ranks: tuple[int, ...]) -> dict[str, Any]:
    group = dist.group.WORLD
    name = group.group_name
    out: dict[str, Any] = {"unfused": {}}
    for case in UNFUSED_CASES:
        xs, res, weight, weight_bias = _case(case, world_size)
        out["unfused"][case] = runtime.unfused_allreduce_rmsnorm(
            xs[rank], res, weight, EPS, weight_bias, group
        )
    # The op itself: without CUDA it falls back to the same computation.
    xs, res, weight = _inputs(OP_SHAPE, BF16, world_size, seed=7)
    runtime.reset_stats()
    out["op"] = runtime.fused_allreduce_rmsnorm_cuda(xs[rank], res, weight, EPS, 0.0, name)
    out["op_record"] = runtime.last_decision()
    out["op_stats"] = runtime.stats()
    out["op_unfused"] = runtime.unfused_allreduce_rmsnorm(
        xs[rank].reshape(-1, HIDDEN), res.reshape(-1, HIDDEN), weight, EPS, 0.0, group
    )
    # Ranks that disagree on the plan raise, on every rank, before the collective.
    runtime.configure(max_tokens=101 if rank in odd_ranks else 100)
    try:
        runtime.fused_allreduce_rmsnorm_cuda(xs[rank], res, weight, EPS, 0.0, name)
        out["mismatch"] = None
    except RuntimeError as exc:
        out["mismatch"] = str(exc)
    runtime.configure(max_tokens=None)
    runtime.fused_allreduce_rmsnorm_cuda(xs[rank], res, weight, EPS, 0.0, name)
    out["after_mismatch"] = runtime.last_decision()
    try:
        tune.tune(group, HIDDEN, BF16, [1, 8])
        out["tune"] = None
    except RuntimeError as exc:
        out["tune"] = str(exc)
    out["prepare"] = runtime.prepare(name, HIDDEN, BF16)
    return out


@pytest.fixture(scope="module", params=[4, pytest.param(8, marks=pytest.mark.slow)], ids=["world4", "world8"])
def cpu_world(request) -> tuple[int, list[dict[str, Any]]]:
    world_size = request.param
    return world_size, gloo_world(_cpu_rank, world_size, args=(ODD_RANKS[world_size],), timeout=300)


@pytest.mark.parametrize("case", list(UNFUSED_CASES))
def test_unfused_fallback_matches_single_process_reference(cpu_world, case):
    world_size, ranks = cpu_world
    xs, res, weight, weight_bias = _case(case, world_size)
    reference = _reference(xs, res, weight, weight_bias)
    dtype = UNFUSED_CASES[case][1]
    for rank, out in enumerate(ranks):
        _assert_matches_reference(out["unfused"][case], reference, dtype)
        # Every rank holds the same result.
        assert torch.equal(out["unfused"][case][0], ranks[0]["unfused"][case][0]), rank
        assert torch.equal(out["unfused"][case][1], ranks[0]["unfused"][case][1]), rank


def test_op_falls_back_without_cuda(cpu_world):
    world_size, ranks = cpu_world
    xs, res, weight = _inputs(OP_SHAPE, BF16, world_size, seed=7)
    reference = _reference(xs, res, weight, 0.0)
    for out in ranks:
        norm, residual = out["op"]
        _assert_matches_reference((norm, residual), reference, BF16)
        assert torch.equal(norm.reshape(-1, HIDDEN), out["op_unfused"][0])
        assert torch.equal(residual.reshape(-1, HIDDEN), out["op_unfused"][1])
        assert out["op_record"] == runtime.CallRecord(
            "fallback", "cuda_unavailable", 6, HIDDEN, "bfloat16", world_size
        )
        assert out["op_stats"] == {"fallback": 1, "fallback:cuda_unavailable": 1}
        assert out["prepare"] == 0  # no workspace without CUDA


def test_rank_check_raises_on_every_rank_naming_the_field_and_ranks(cpu_world):
    world_size, ranks = cpu_world
    odd = ODD_RANKS[world_size]
    even = [r for r in range(world_size) if r not in odd]

    def ranks_text(rs):
        return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"

    expected = f"field 'max_tokens' differs: 100 on {ranks_text(even)}; 101 on {ranks_text(list(odd))}"
    for out in ranks:
        assert out["mismatch"] is not None
        assert expected in out["mismatch"], out["mismatch"]
        assert "hidden=64, dtype=bfloat16" in out["mismatch"]
        # Once the ranks agree again, the op runs.
        assert out["after_mismatch"].path == "fallback"


def test_tune_refuses_without_the_fused_kernel(cpu_world):
    _, ranks = cpu_world
    for out in ranks:
        assert out["tune"] == "cannot tune: the fused kernel is unavailable here (cuda_unavailable)"


# ============================================================================ 2-rank world with fake flashinfer


def _pretend_cuda() -> None:
    fake_flashinfer.pretend_gpu(FAKE_GPU)


def _summary(value: Any) -> Any:
    """A picklable summary of a flashinfer argument."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.dtype):
        return tables.dtype_name(value)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tables.dtype_name(value.dtype))
    if isinstance(value, dict):
        return {k: _summary(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_summary(v) for v in value]
    if isinstance(value, dist.ProcessGroup):
        return "group:" + value.group_name
    return type(value).__name__


def _calls() -> list[tuple[str, dict[str, Any]]]:
    calls = [(name, _summary(args)) for name, args in fake_flashinfer.CALLS]
    fake_flashinfer.reset()
    return calls


#: label: (shape, dtype, residual, weight_bias, forced decision)
FUSED_CALLS: dict[str, tuple[tuple[int, ...], torch.dtype, bool, float, Decision | None]] = {
    "one-token": ((1, HIDDEN), BF16, True, 0.0, None),
    "3d-weight-bias-no-residual": ((2, 3, HIDDEN), BF16, False, 1.0, None),
    "fp32": ((4, HIDDEN), FP32, True, 0.0, None),
    "over-workspace": ((600, HIDDEN), BF16, True, 0.0, None),
    "forced-twoshot-2-tokens": ((2, HIDDEN), BF16, True, 0.0, TWOSHOT),
    "forced-twoshot": ((3, HIDDEN), BF16, True, 0.0, TWOSHOT),
    "forced-twoshot-weight-bias": ((40, HIDDEN), BF16, False, 1.0, TWOSHOT),
    "forced-unfused": ((3, HIDDEN), BF16, True, 0.0, UNFUSED),
}
CAPACITY = 512


def _fused_inputs(label: str, world_size: int):
    shape, dtype, residual, weight_bias, _ = FUSED_CALLS[label]
    xs, res, weight = _inputs(
        shape,
        dtype,
        world_size,
        residual=residual,
        weight_bias=weight_bias,
        weight_dtype=FP32,
        seed=len(label),
    )
    return xs, res, weight, weight_bias


def _fused_scenario(rank: int, world_size: int, api: str) -> dict[str, Any]:
    name = dist.group.WORLD.group_name
    runtime.configure(flashinfer_api=api, max_tokens=CAPACITY)
    runtime.reset_stats()
    fake_flashinfer.reset()
    out: dict[str, Any] = {"api": runtime._api().name, "results": {}, "calls": {}}
    for label, (*_, force) in FUSED_CALLS.items():
        xs, res, weight, weight_bias = _fused_inputs(label, world_size)
        with runtime.forced(force):
            outputs = runtime.fused_allreduce_rmsnorm_cuda(xs[rank], res, weight, EPS, weight_bias, name)
        out["results"][label] = (outputs, runtime.last_decision())
        out["calls"][label] = _calls()
    out["stats"] = runtime.stats()
    # prepare(): a larger capacity replaces the workspace, a smaller one keeps it.
    out["prepare_grow"] = runtime.prepare(name, HIDDEN, BF16, max_tokens=1024)
    out["prepare_grow_calls"] = _calls()
    out["prepare_keep"] = runtime.prepare(name, HIDDEN, BF16, max_tokens=256)
    out["prepare_keep_calls"] = _calls()
    out["live_before_destroy"] = fake_flashinfer.live_workspaces()
    runtime.destroy_workspaces()
    out["destroy_calls"] = _calls()
    out["live_after_destroy"] = fake_flashinfer.live_workspaces()
    runtime.configure(flashinfer_api="auto", max_tokens=None)
    return out


def _mismatch(rank: int, world_size: int, **settings: Any) -> dict[str, Any]:
    """Configure rank 1 with ``settings``, call the op on both ranks; then agree and call again."""
    name = dist.group.WORLD.group_name
    xs, res, weight, _ = _fused_inputs("one-token", world_size)
    fake_flashinfer.reset()
    if rank == 1:
        runtime.configure(**settings)
    out: dict[str, Any] = {}
    try:
        runtime.fused_allreduce_rmsnorm_cuda(xs[rank], res, weight, EPS, 0.0, name)
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = str(exc)
    out["calls"] = _calls()  # nothing reached flashinfer
    runtime.configure(max_tokens=None, flashinfer_api="auto")
    runtime.fused_allreduce_rmsnorm_cuda(xs[rank], res, weight, EPS, 0.0, name)
    out["after"] = runtime.last_decision()
    runtime.destroy_workspaces()
    fake_flashinfer.reset()
    return out


def _repeat_scenario(rank: int, world_size: int) -> dict[str, Any]:
    """The same call three times (the route is kept after the first), then once more after
    ``configure`` (forgotten and routed again: the table now says unfused)."""
    name = dist.group.WORLD.group_name
    xs, res, weight, _ = _fused_inputs("one-token", world_size)
    runtime.configure(flashinfer_api="auto", max_tokens=CAPACITY)
    runtime.reset_stats()
    fake_flashinfer.reset()
    outputs = [runtime.fused_allreduce_rmsnorm_cuda(xs[rank], res, weight, EPS, 0.0, name) for _ in range(3)]
    out: dict[str, Any] = {"outputs": outputs, "routes": len(runtime._sites[(name, HIDDEN, BF16)].routes)}
    with runtime.forced(UNFUSED):
        out["forced"] = runtime.fused_allreduce_rmsnorm_cuda(xs[rank], res, weight, EPS, 0.0, name)
        out["forced_record"] = runtime.last_decision()
    out["stats"] = runtime.stats()
    out["runs"] = len(_runs(_calls()))
    runtime.destroy_workspaces()
    runtime.configure(flashinfer_api="auto", max_tokens=None)
    return out


def _captured_warnings():
    """Collect the warnings passkit_fusion logs (a list of messages) within the block."""
    import contextlib
    import logging

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                messages.append(record.getMessage())

    @contextlib.contextmanager
    def capture():
        logger = logging.getLogger("passkit_fusion")
        handler = Keep()
        logger.addHandler(handler)
        try:
            yield messages
        finally:
            logger.removeHandler(handler)

    return capture()


#: tokens: (unfused, oneshot, twoshot) medians in us; TUNE_RANK1 overrides rank 1's.
TUNE_MEDIANS = {
    1: (20.0, 5.0, None),
    2: (20.0, 5.0, None),
    4: (21.0, 6.0, 12.0),
    64: (24.0, 9.0, 14.0),
    256: (40.0, 38.5, 39.0),  # fused 3.75% faster: within the 5% margin, unfused
    512: (60.0, 50.0, 45.0),
    1024: (100.0, 120.0, 110.0),
}
TUNE_RANK1 = {(64, "oneshot"): 30.0, (512, "unfused"): 61.0}
TUNE_TOKENS: list[int] = []


def _tune_scenario(rank: int, world_size: int) -> dict[str, Any]:
    """tune() with the timing replaced: ``graph_median_us`` runs the step once and returns
    the median given for this rank, token count and variant."""
    seen: list[tuple[int, str, str | None]] = []

    def make_inputs(tokens, hidden, dtype, rank, seed=0):
        TUNE_TOKENS.append(tokens)
        cpu = torch.device("cpu")
        x = tune._randn((tokens, hidden), seed * 1000 + 17 + rank, dtype, cpu)
        residual = tune._randn((tokens, hidden), seed * 1000 + 3, dtype, cpu)
        weight = 1.0 + 0.1 * tune._randn((hidden,), seed * 1000 + 5, torch.float32, cpu)
        return x, residual, weight.to(dtype)

    def graph_median_us(step, *, ops_per_graph=10, replays=100, warmup=3, reset=None):
        tokens, force = TUNE_TOKENS[-1], runtime.current_config().force
        variant = "unfused" if force is None else ("oneshot" if force.oneshot else "twoshot")
        runtime.reset_stats()
        if reset is not None:
            reset()
        step()
        path = None if force is None else runtime.last_decision().path
        seen.append((tokens, variant, path))
        medians = dict(zip(("unfused", "oneshot", "twoshot"), TUNE_MEDIANS[tokens]))
        median = TUNE_RANK1.get((tokens, variant), medians[variant]) if rank == 1 else medians[variant]
        assert median is not None, f"{variant} measured at {tokens} tokens"
        return median

    tune.make_inputs = make_inputs
    tune.graph_median_us = graph_median_us
    tune._compiled_add_rmsnorm = lambda: tune._eager_add_rmsnorm  # no Inductor on a pretend GPU
    fake_flashinfer.reset()
    table = tune.tune(dist.group.WORLD, HIDDEN, BF16, sorted(TUNE_MEDIANS, reverse=True))
    create_calls = [c for c in _calls() if "create" in c[0]]
    runtime.destroy_workspaces()
    return {"table": table.to_json(), "seen": seen, "create_calls": create_calls}


def _fake_flashinfer_rank(rank: int, world_size: int) -> dict[str, Any]:
    _pretend_cuda()
    fake_flashinfer.install("0.7.2")
    out: dict[str, Any] = {"unavailable": runtime.unavailable_reason()}
    out["0.7.2/auto"] = _fused_scenario(rank, world_size, "auto")
    out["0.7.2/unified"] = _fused_scenario(rank, world_size, "unified")
    out["0.7.2/legacy"] = _fused_scenario(rank, world_size, "legacy")
    out["repeat"] = _repeat_scenario(rank, world_size)
    # an entry point without a parameter passkit passes: the unified API runs, with a warning
    entry = fake_flashinfer.get_trtllm_comm_module
    narrower = fake_flashinfer._without(fake_flashinfer._kernel_entry, "layout_code")
    sys.modules["flashinfer.comm"].trtllm_ar.get_trtllm_comm_module = lambda: types.SimpleNamespace(
        trtllm_allreduce_fusion=narrower
    )
    _clear_runtime_caches()
    with _captured_warnings() as logged:
        out["entry-point-mismatch/auto"] = _fused_scenario(rank, world_size, "auto")
    out["entry-point-mismatch/logged"] = logged
    sys.modules["flashinfer.comm"].trtllm_ar.get_trtllm_comm_module = entry
    _clear_runtime_caches()
    out["mismatch/max_tokens"] = _mismatch(rank, world_size, max_tokens=100)
    out["mismatch/api"] = _mismatch(rank, world_size, flashinfer_api="legacy")
    for variant in ("legacy-only", "unified-no-weight-bias"):
        fake_flashinfer.install(variant)
        _clear_runtime_caches()
        out[f"{variant}/auto"] = _fused_scenario(rank, world_size, "auto")
    fake_flashinfer.install("0.7.2")
    _clear_runtime_caches()
    out["tune"] = _tune_scenario(rank, world_size)
    return out


@pytest.fixture(scope="module")
def fake_world() -> list[dict[str, Any]]:
    return gloo_world(_fake_flashinfer_rank, 2, timeout=300)


SCENARIOS = [
    "0.7.2/auto",
    "0.7.2/unified",
    "0.7.2/legacy",
    "legacy-only/auto",
    "unified-no-weight-bias/auto",
    "entry-point-mismatch/auto",
]


def _api_of(scenario: str) -> str:
    """The adapter the scenario selects, and the API whose function its runs call."""
    if "legacy" in scenario:
        return "legacy"
    return "kernel" if scenario in ("0.7.2/auto", "entry-point-mismatch/auto") else "unified"


def _run_api(scenario: str) -> str:
    return "unified" if scenario == "entry-point-mismatch/auto" else _api_of(scenario)


def _expected_path(label: str, scenario: str) -> tuple[str, str]:
    """The path and fallback reason of call ``label`` in ``scenario``."""
    weight_bias_ok = scenario.startswith(("0.7.2", "entry-point"))  # the others lack the parameter
    with_bias = ("fused_oneshot", "") if weight_bias_ok else ("fallback", "weight_bias_unsupported")
    twoshot_with_bias = ("fused_twoshot", "") if weight_bias_ok else ("fallback", "weight_bias_unsupported")
    return {
        "one-token": ("fused_oneshot", ""),
        "3d-weight-bias-no-residual": with_bias,
        "fp32": ("fused_oneshot", ""),
        "over-workspace": ("fallback", "over_workspace"),
        "forced-twoshot-2-tokens": ("fused_oneshot", ""),
        "forced-twoshot": ("fused_twoshot", ""),
        "forced-twoshot-weight-bias": twoshot_with_bias,
        "forced-unfused": ("fallback", "table"),
    }[label]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fake_flashinfer_paths_and_results(fake_world, scenario):
    assert fake_world[0]["unavailable"] is None
    expected_api = _api_of(scenario)
    for rank, out in enumerate(fake_world):
        result = out[scenario]
        assert result["api"] == expected_api
        for label in FUSED_CALLS:
            (norm, residual), record = result["results"][label]
            assert (record.path, record.reason) == _expected_path(label, scenario), (rank, label)
            assert record.world_size == 2
            xs, res, weight, weight_bias = _fused_inputs(label, 2)
            reference = _reference(xs, res, weight, weight_bias)
            _assert_matches_reference((norm, residual), reference, FUSED_CALLS[label][1])
        expected_stats: dict[str, int] = {}
        for label in FUSED_CALLS:
            path, reason = _expected_path(label, scenario)
            for key in (path, f"{path}:{reason}") if reason else (path,):
                expected_stats[key] = expected_stats.get(key, 0) + 1
        assert result["stats"] == expected_stats


RUN_FUNCTIONS = {
    "kernel": "kernel:trtllm_allreduce_fusion",
    "unified": "allreduce_fusion",
    "legacy": "trtllm_allreduce_fusion",
}


def _runs(calls: list[tuple[str, dict[str, Any]]], api: str | None = None) -> list[dict[str, Any]]:
    names = (RUN_FUNCTIONS[api],) if api else tuple(RUN_FUNCTIONS.values())
    return [args for name, args in calls if name in names]


def _creates(calls: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [args for name, args in calls if "create" in name]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fake_flashinfer_receives_the_right_arguments(fake_world, scenario):
    legacy = "legacy" in scenario
    for rank, out in enumerate(fake_world):
        calls = out[scenario]["calls"]
        # Workspaces: one per (hidden, dtype), created at the first fused call, with the
        # configured capacity, this rank, and the trtllm backend.
        created = {label: _creates(calls[label]) for label in FUSED_CALLS}
        assert [label for label, c in created.items() if c] == ["one-token", "fp32"]
        for label, dtype in (("one-token", "bfloat16"), ("fp32", "float32")):
            (args,) = created[label]
            if legacy:
                assert (args["tp_rank"], args["tp_size"], args["max_token_num"], args["hidden_dim"]) == (
                    rank,
                    2,
                    CAPACITY,
                    HIDDEN,
                )
                assert args["use_fp32_lamport"] is (dtype == "float32")
                assert args["group"].startswith("group:")
                assert args.get("create_metadata", False) is (scenario == "0.7.2/legacy")
            else:
                assert args["backend"] == "trtllm"
                assert (
                    args["rank"],
                    args["world_size"],
                    args["max_token_num"],
                    args["hidden_dim"],
                    args["dtype"],
                ) == (rank, 2, CAPACITY, HIDDEN, dtype)
                assert args["group"].startswith("group:")
        for label in FUSED_CALLS:
            path, _ = _expected_path(label, scenario)
            runs = _runs(calls[label])
            if path == "fallback":
                assert runs == [], label  # nothing reached flashinfer
                continue
            (run,) = runs
            assert runs == _runs(calls[label], _run_api(scenario)), label
            shape, dtype, _, weight_bias, _ = FUSED_CALLS[label]
            tokens = math.prod(shape[:-1])
            assert run["use_oneshot"] is (path == "fused_oneshot"), label
            assert run["trigger_completion_at_end"] is True
            assert run["launch_with_pdl"] is False
            assert run["rms_eps"] == EPS
            assert run["rms_gamma"] == ("tensor", (HIDDEN,), tables.dtype_name(dtype))
            assert run.get("weight_bias") in ((weight_bias,) if weight_bias else (0.0, None)), label
            if legacy:
                assert run["pattern_code"] == fake_flashinfer.AllReduceFusionPattern.kARResidualRMSNorm
                assert (run["world_rank"], run["world_size"], run["token_num"], run["hidden_dim"]) == (
                    rank,
                    2,
                    tokens,
                    HIDDEN,
                )
                assert run["allreduce_in"] == ("tensor", (tokens * HIDDEN,), tables.dtype_name(dtype))
                has_metadata = scenario == "0.7.2/legacy"
                assert (run.get("metadata") is not None) is has_metadata, label
                if has_metadata:
                    assert run["metadata"]["max_token_num"] == CAPACITY
            elif _run_api(scenario) == "kernel":  # the entry point: 2-D tensors, the workspace's pointers
                assert run["pattern_code"] == fake_flashinfer.AllReduceFusionPattern.kARResidualRMSNorm
                assert (run["world_rank"], run["world_size"], run["token_num"], run["hidden_dim"]) == (
                    rank,
                    2,
                    tokens,
                    HIDDEN,
                )
                for name in ("allreduce_in", "residual_in", "residual_out", "norm_out"):
                    assert run[name] == ("tensor", (tokens, HIDDEN), tables.dtype_name(dtype)), name
                assert (run["allreduce_out"], run["quant_out"], run["scale_out"], run["layout_code"]) == (
                    None,
                    None,
                    None,
                    None,
                )
            else:
                assert run["pattern"] == fake_flashinfer.AllReduceFusionPattern.kARResidualRMSNorm
                assert run["input"] == ("tensor", (tokens, HIDDEN), tables.dtype_name(dtype))
                assert run["residual_in"] == ("tensor", (tokens, HIDDEN), tables.dtype_name(dtype))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_prepare_grows_workspaces_and_destroy_frees_them(fake_world, scenario):
    legacy = "legacy" in scenario
    for out in fake_world:
        result = out[scenario]
        assert result["prepare_grow"] == 1024
        names = [name for name, _ in result["prepare_grow_calls"]]
        if legacy:
            assert names == [
                "trtllm_destroy_ipc_workspace_for_all_reduce_fusion",
                "trtllm_create_ipc_workspace_for_all_reduce_fusion",
            ]
        else:
            assert names == ["TRTLLMAllReduceFusionWorkspace.destroy", "create_allreduce_fusion_workspace"]
        assert _creates(result["prepare_grow_calls"])[0]["max_token_num"] == 1024
        assert result["prepare_keep"] == 1024
        assert result["prepare_keep_calls"] == []
        assert result["live_before_destroy"] == 2  # bfloat16 and float32
        assert len(result["destroy_calls"]) == 2
        assert result["live_after_destroy"] == 0


@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        # rank 0 sizes workspaces from the (conservative) table: 8 MiB / (64 * 2 bytes)
        ("mismatch/max_tokens", "field 'max_tokens' differs: 65536 on rank 0; 100 on rank 1"),
        ("mismatch/api", "field 'api' differs: 'kernel' on rank 0; 'legacy' on rank 1"),
    ],
)
def test_rank_check_raises_in_a_2_rank_world(fake_world, scenario, expected):
    for out in fake_world:
        result = out[scenario]
        assert result["error"] is not None and expected in result["error"], result["error"]
        assert "group" in result["error"] and "hidden=64, dtype=bfloat16" in result["error"]
        assert result["calls"] == []  # raised before any workspace or kernel
        assert (result["after"].path, result["after"].reason) == ("fused_oneshot", "")


def test_tune_with_given_medians(fake_world):
    expected_rules = [
        {"max_tokens": 4, "fused": True, "oneshot": True},
        # rank 0 measured one-shot fastest at 64 tokens, rank 1 not: the maximum counts.
        {"max_tokens": 64, "fused": True, "oneshot": False},
        {"max_tokens": 256, "fused": False, "oneshot": False},
        {"max_tokens": 512, "fused": True, "oneshot": False},
        # 1024 tokens: unfused, implicit above the last rule
    ]
    tables = [out["tune"]["table"] for out in fake_world]
    assert tables[0] == tables[1]  # every rank gets the same table
    (entry,) = tables[0]["entries"]
    assert (entry["gpu"], entry["world_size"], entry["hidden"], entry["dtype"]) == (
        FAKE_GPU,
        2,
        HIDDEN,
        "bfloat16",
    )
    assert entry["rules"] == expected_rules
    assert entry["source"]["flashinfer"] == fake_flashinfer.VERSION
    medians = {m["tokens"]: m for m in entry["source"]["medians_us"]}
    assert sorted(medians) == sorted(TUNE_MEDIANS)
    for tokens, (unfused, oneshot, twoshot) in TUNE_MEDIANS.items():
        assert medians[tokens]["unfused_us"] == TUNE_RANK1.get((tokens, "unfused"), unfused)
        assert medians[tokens]["oneshot_us"] == TUNE_RANK1.get((tokens, "oneshot"), oneshot)
        assert medians[tokens]["twoshot_us"] == twoshot  # None where tokens <= world size
    table = Table.from_json(tables[0])
    assert table.lookup(FAKE_GPU, 2, HIDDEN, BF16, 3) == ONESHOT
    assert table.lookup(FAKE_GPU, 2, HIDDEN, BF16, 200) == UNFUSED
    assert table.lookup(FAKE_GPU, 2, HIDDEN, BF16, 1024) == UNFUSED
    for out in fake_world:
        result = out["tune"]
        # The workspace was sized for the largest token count, and each fused timing ran the
        # variant it claims (two-shot only where it is legal).
        assert [args["max_token_num"] for _, args in result["create_calls"]] == [1024]
        for tokens, variant, path in result["seen"]:
            if variant != "unfused":
                assert path == f"fused_{variant}", (tokens, variant, path)
        assert {(t, v) for t, v, _ in result["seen"] if v == "twoshot"} == {
            (t, "twoshot") for t in TUNE_MEDIANS if t > 2
        }


def test_a_kept_route_gives_the_same_results_and_configure_forgets_it(fake_world):
    xs, res, weight, _ = _fused_inputs("one-token", 2)
    reference = _reference(xs, res, weight, 0.0)
    for out in fake_world:
        result = out["repeat"]
        for norm_residual in result["outputs"]:
            _assert_matches_reference(norm_residual, reference, BF16)
        assert result["routes"] == 1  # one (tokens, weight bias, variant) kept
        assert (result["forced_record"].path, result["forced_record"].reason) == ("fallback", "table")
        _assert_matches_reference(result["forced"], reference, BF16)
        assert result["stats"] == {"fused_oneshot": 3, "fallback": 1, "fallback:table": 1}
        assert result["runs"] == 3  # every fused call reached the kernel


def test_an_entry_point_without_a_parameter_falls_back_to_the_unified_api_loudly(fake_world):
    for out in fake_world:
        logged = out["entry-point-mismatch/logged"]
        assert any("lacks layout_code" in m and "unified API" in m for m in logged), logged
