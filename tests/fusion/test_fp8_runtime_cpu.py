"""The FP8 variant of the runtime (``fused_allreduce_rmsnorm_fp8_cuda``) on the CPU, with
``fake_flashinfer`` (flashinfer 0.7.2's signatures; its "kernel" all-reduces with gloo and
quantizes as the CUDA kernel does) in a 2-rank gloo world on a pretend sm90 GPU.

What flashinfer receives (pattern code, ``quant_out`` dtype and shape, ``scale_factor`` as a
one-element fp32 tensor, ``norm_out`` only when needed), through the unified and the legacy
API and the kernel's entry point; that the FP8 op shares the unquantized op's workspace (one creation per group, hidden
size and dtype); the fallback paths (over the workspace, forced unfused, a flashinfer without
the FP8 patterns); and the results against a float64 reference, within one FP8 step.
"""

from __future__ import annotations

from typing import Any

import fake_flashinfer
import pytest
import torch
import torch.distributed as dist
from passkit_fusion.allreduce_rmsnorm import runtime
from passkit_fusion.tuning.tables import UNFUSED, Decision
from passkit_testing.worlds import gloo_world

BF16, FP16 = torch.bfloat16, torch.float16
E4M3 = torch.float8_e4m3fn
HIDDEN, EPS, CAPACITY = 64, 1e-6, 512
TWOSHOT = Decision(True, False)

#: label: (shape, dtype, residual, need_norm_out, scale shape and dtype, forced decision)
CALLS: dict[
    str, tuple[tuple[int, ...], torch.dtype, bool, bool, tuple[tuple[int, ...], torch.dtype], Any]
] = {
    "fp8-one-token": ((1, HIDDEN), BF16, True, False, ((), torch.float32), None),
    "fp8+norm-3d-no-residual": ((2, 3, HIDDEN), BF16, False, True, ((1,), torch.float32), None),
    "fp8-fp16-bf16-scale": ((4, HIDDEN), FP16, True, False, ((1, 1), BF16), None),
    "fp8-twoshot": ((40, HIDDEN), BF16, True, False, ((), torch.float32), TWOSHOT),
    "fp8-over-workspace": ((600, HIDDEN), BF16, True, True, ((), torch.float32), None),
    "fp8-forced-unfused": ((3, HIDDEN), BF16, True, False, ((), torch.float32), UNFUSED),
}
SCALE = 0.0371


def _inputs(label: str, world_size: int):
    shape, dtype, residual, need_norm_out, (scale_shape, scale_dtype), _ = CALLS[label]
    seed = len(label)

    def randn(size, s):
        return torch.randn(size, generator=torch.Generator().manual_seed(s))

    xs = [randn(shape, 100 * seed + rank).to(dtype) for rank in range(world_size)]
    res = randn(shape, 100 * seed + 99).to(dtype) if residual else None
    weight = (1.0 + 0.1 * randn((shape[-1],), 100 * seed + 98)).to(dtype)
    return xs, res, weight, torch.full(scale_shape, SCALE, dtype=scale_dtype), need_norm_out


def _reference(xs, res, weight, scale):
    summed = torch.stack([x.double() for x in xs]).sum(0)
    if res is not None:
        summed = summed + res.double()
    norm = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    return (norm / scale.double().reshape(())).clamp(-448, 448), norm, summed


def _summary(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype).removeprefix("torch."))
    if isinstance(value, dict):
        return {k: _summary(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_summary(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return type(value).__name__


def _calls() -> list[tuple[str, Any]]:
    calls = [(name, _summary(args)) for name, args in fake_flashinfer.CALLS]
    fake_flashinfer.reset()
    return calls


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).clone() if t.dtype == E4M3 else t


def _scenario(rank: int, world_size: int, api: str) -> dict[str, Any]:
    name = dist.group.WORLD.group_name
    runtime.configure(flashinfer_api=api, max_tokens=CAPACITY)
    runtime.reset_stats()
    fake_flashinfer.reset()
    out: dict[str, Any] = {"results": {}, "calls": {}}
    # the unquantized op first: the FP8 op must reuse its workspace
    xs, res, weight, _, _ = _inputs("fp8-one-token", world_size)
    runtime.fused_allreduce_rmsnorm_cuda(xs[rank], res, weight, EPS, 0.0, name)
    out["plain_calls"] = _calls()
    for label, (*_, force) in CALLS.items():
        xs, res, weight, scale, need_norm_out = _inputs(label, world_size)
        with runtime.forced(force):
            q, norm, total = runtime.fused_allreduce_rmsnorm_fp8_cuda(
                xs[rank], res, weight, EPS, 0.0, scale, name, need_norm_out
            )
        out["results"][label] = ((_bits(q), norm, total), runtime.last_decision())
        out["calls"][label] = _calls()
    out["stats"] = runtime.stats()
    runtime.destroy_workspaces()
    fake_flashinfer.reset()
    return out


def _without_fp8_patterns(rank: int, world_size: int) -> dict[str, Any]:
    comm = fake_flashinfer.install("0.7.2")
    comm.AllReduceFusionPattern = type(
        "AllReduceFusionPattern", (), {"kAllReduce": 0, "kARResidualRMSNorm": 1}
    )
    fake_flashinfer.clear_runtime_caches()
    xs, res, weight, scale, _ = _inputs("fp8-one-token", world_size)
    q, _, _ = runtime.fused_allreduce_rmsnorm_fp8_cuda(
        xs[rank], res, weight, EPS, 0.0, scale, dist.group.WORLD.group_name, False
    )
    out = {"record": runtime.last_decision(), "q": _bits(q), "calls": _calls()}
    runtime.destroy_workspaces()
    return out


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    fake_flashinfer.pretend_gpu("Fake GPU")
    fake_flashinfer.install("0.7.2")
    out = {api: _scenario(rank, world_size, api) for api in ("auto", "unified", "legacy")}
    out["no-fp8"] = _without_fp8_patterns(rank, world_size)
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return gloo_world(_rank, 2, timeout=300)


EXPECTED_PATH = {
    "fp8-one-token": ("fused_oneshot", ""),
    "fp8+norm-3d-no-residual": ("fused_oneshot", ""),
    "fp8-fp16-bf16-scale": ("fused_oneshot", ""),
    "fp8-twoshot": ("fused_twoshot", ""),
    "fp8-over-workspace": ("fallback", "over_workspace"),
    "fp8-forced-unfused": ("fallback", "table"),
}


def _assert_one_step(q_bits: torch.Tensor, expected: torch.Tensor) -> None:
    got = q_bits.view(E4M3).double()
    step = torch.where(
        expected.abs() < 2**-6, torch.tensor(2.0**-9, dtype=torch.float64), expected.abs() * 2**-3
    )
    assert ((got - expected).abs() <= step).all()


@pytest.mark.parametrize("api", ["auto", "unified", "legacy"])
def test_fp8_paths_and_results(world, api):
    for out in world:
        for label, ((q, norm, total), record) in out[api]["results"].items():
            assert (record.path, record.reason) == EXPECTED_PATH[label], label
            shape, dtype, _, need_norm_out, _, _ = CALLS[label]
            assert record.variant == ("fp8+norm" if need_norm_out else "fp8")
            xs, res, weight, scale, _ = _inputs(label, 2)
            q_ref, norm_ref, total_ref = _reference(xs, res, weight, scale)
            assert q.shape == shape and total.shape == shape and total.dtype == dtype
            if record.path == "fallback":  # the unfused path normalises the rounded sum
                q_ref = _reference([total], None, weight, scale)[0]
            _assert_one_step(q, q_ref)
            tol = dict(rtol=3e-2, atol=3e-2) if dtype == BF16 else dict(rtol=4e-3, atol=4e-3)
            torch.testing.assert_close(total.double(), total_ref, **tol)
            if need_norm_out:
                assert norm.shape == shape and norm.dtype == dtype
                torch.testing.assert_close(norm.double(), norm_ref, **tol)
            else:
                assert norm.shape == (0,)
    for label in CALLS:  # every rank computes the same bits
        assert torch.equal(world[0][api]["results"][label][0][0], world[1][api]["results"][label][0][0])
    stats = world[0][api]["stats"]
    assert (stats["fp8:fused_oneshot"], stats["fp8+norm:fused_oneshot"], stats["fp8:fused_twoshot"]) == (
        2,
        1,
        1,
    )
    assert (stats["fp8+norm:fallback"], stats["fp8:fallback"]) == (1, 1)


@pytest.mark.parametrize("api", ["auto", "unified", "legacy"])
def test_fp8_flashinfer_arguments(world, api):
    patterns = fake_flashinfer.AllReduceFusionPattern
    for _rank, out in enumerate(world):
        result = out[api]
        creates = [c for c in result["plain_calls"] if "create" in c[0]]
        assert len(creates) == 1  # the unquantized op's call created the bf16 workspace ...
        for label in CALLS:
            calls = result["calls"][label]
            created = [c for c in calls if "create" in c[0]]
            assert len(created) == (label == "fp8-fp16-bf16-scale"), label  # ... which the FP8 op reuses
            run_function = {
                "auto": "kernel:trtllm_allreduce_fusion",  # auto: the kernel's entry point
                "unified": "allreduce_fusion",
                "legacy": "trtllm_allreduce_fusion",
            }[api]
            runs = [args for name, args in calls if name == run_function]
            if EXPECTED_PATH[label][0] == "fallback":
                assert runs == [], label
                continue
            (run,) = runs
            shape, _dtype, _, need_norm_out, _, _ = CALLS[label]
            tokens = 1
            for n in shape[:-1]:
                tokens *= n
            expected = (
                patterns.kARResidualRMSNormOutFP8Quant
                if need_norm_out
                else patterns.kARResidualRMSNormFP8Quant
            )
            assert run["pattern" if api == "unified" else "pattern_code"] == expected
            assert run["scale_factor"] == ("tensor", (1,), "float32")
            quant_shape = (tokens * HIDDEN,) if api == "legacy" else (tokens, HIDDEN)
            assert run["quant_out"] == ("tensor", quant_shape, "float8_e4m3fn")
            assert (run["norm_out"] is not None) is need_norm_out
            assert run["trigger_completion_at_end"] is True and run["launch_with_pdl"] is False
            assert run["use_oneshot"] is (EXPECTED_PATH[label][0] == "fused_oneshot")


def test_flashinfer_without_fp8_patterns_falls_back(world):
    for out in world:
        record = out["no-fp8"]["record"]
        assert (record.path, record.reason) == ("fallback", "fp8_unsupported")
        assert not [c for c in out["no-fp8"]["calls"] if "allreduce_fusion" in c[0]]
        xs, res, weight, scale, _ = _inputs("fp8-one-token", 2)
        _assert_one_step(out["no-fp8"]["q"], _reference(xs, res, weight, scale)[0])
