"""GPU tests of passkit_fusion.allreduce_rmsnorm.runtime: 2 ranks, NCCL, flashinfer.  Skipped without them.

One pair of spawned processes runs every scenario in order (NCCL, flashinfer and the
workspaces start once), both ranks writing a verdict per scenario as it finishes; each test
below reports one scenario.  Every result is compared with a float64 reference computed
from all ranks' inputs, and fused errors must stay within 1.25x of the unfused path's.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import importlib.util
import json
import os
import socket
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

WORLD = int(os.environ.get("GPU_WORLD_SIZE", "2"))
"""Ranks (one GPU each); set GPU_WORLD_SIZE=4 or 8 on larger machines."""
if torch.cuda.device_count() < WORLD:
    pytest.skip(f"needs {WORLD} CUDA GPUs", allow_module_level=True)
if importlib.util.find_spec("flashinfer") is None:
    pytest.skip("needs flashinfer", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from passkit_fusion.allreduce_rmsnorm import runtime, tune  # noqa: E402
from passkit_fusion.tuning import tables  # noqa: E402

pytestmark = pytest.mark.gpu

EPS = 1e-6
BF16 = torch.bfloat16
ONESHOT, TWOSHOT = tables.Decision(True, True), tables.Decision(True, False)
ERROR_RATIO_LIMIT = 1.25
DEADLINE_S = 420
SCENARIO_STACKS_S = float(os.environ.get("GPU_SCENARIO_STACKS_S", "120"))
"""A scenario still running after this long prints every thread's stack (a hang shows where)."""


# ---------------------------------------------------------------------------- helpers --


def _group_name() -> str:
    assert dist.group.WORLD is not None
    return dist.group.WORLD.group_name


def _inputs(
    tokens: int,
    hidden: int,
    dtype: torch.dtype = BF16,
    seed: int = 0,
    weight_dtype: torch.dtype | None = None,
):
    """This rank's x, the shared residual and weight, and every rank's x (for references)."""
    rank = dist.get_rank()
    xs = [tune.make_inputs(tokens, hidden, dtype, r, seed)[0] for r in range(WORLD)]
    _, residual, weight = tune.make_inputs(tokens, hidden, dtype, rank, seed)
    if weight_dtype is not None:  # the same on every rank: seeded
        gen = torch.Generator(device=weight.device).manual_seed(seed + 99)
        weight = (
            1.0 + 0.1 * torch.randn(hidden, generator=gen, device=weight.device, dtype=torch.float32)
        ).to(weight_dtype)
    return xs[rank], residual, weight, xs


def _reference(xs, residual, weight, weight_bias=0.0):
    total = torch.stack([x.double() for x in xs]).sum(0)
    if residual is not None:
        total = total + residual.double()
    scale = weight.double() + weight_bias
    return total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS) * scale, total


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return float((out.double() - ref).norm() / ref.norm())


def _op(x, residual, weight, weight_bias=0.0, decision: tables.Decision | None = None):
    """Call the op, optionally with a forced decision; return (norm, residual_out, path)."""
    with runtime.forced(decision) if decision else contextlib.nullcontext():
        norm, res = runtime.fused_allreduce_rmsnorm_cuda(x, residual, weight, EPS, weight_bias, _group_name())
    record = runtime.last_decision()
    assert record is not None
    return norm, res, f"{record.path}:{record.reason}" if record.reason else record.path


def _check(
    x,
    residual,
    weight,
    xs,
    *,
    weight_bias=0.0,
    decision=ONESHOT,
    expect_path=None,
    ratio=ERROR_RATIO_LIMIT,
    dtype_floor=1e-2,
):
    """Run fused (``decision``) and unfused on the same inputs and compare both with float64."""
    norm_ref, res_ref = _reference(xs, residual, weight, weight_bias)
    unf_norm, unf_res, _ = _op(x, residual, weight, weight_bias, tables.UNFUSED)
    norm, res, path = _op(x, residual, weight, weight_bias, decision)
    assert norm.shape == x.shape and res.shape == x.shape and norm.dtype == x.dtype
    if expect_path is not None:
        assert path == expect_path, f"took {path}, expected {expect_path}"
    for label, out, unfused, ref in (
        ("norm_out", norm, unf_norm, norm_ref),
        ("residual_out", res, unf_res, res_ref),
    ):
        err, unf_err = _rel(out, ref), _rel(unfused, ref)
        assert unf_err < dtype_floor, f"unfused {label} error {unf_err:.2e} too large"
        assert err <= ratio * unf_err + 1e-7, (
            f"{path} {label}: error {err:.3e} > {ratio} x unfused {unf_err:.3e}"
        )
    return path


# ---------------------------------------------------------------------------- scenarios --


def scenario_numerics() -> None:
    """Fused one-shot and two-shot vs unfused vs float64, hidden 4096 and 8192."""
    for hidden in (4096, 8192):
        assert runtime.prepare(_group_name(), hidden, BF16, max_tokens=1024) == 1024
        for tokens in (1, 5, 128, 1000):
            x, residual, weight, xs = _inputs(tokens, hidden, seed=tokens)
            _check(x, residual, weight, xs, decision=ONESHOT, expect_path="fused_oneshot")
            if tokens > WORLD:
                _check(x, residual, weight, xs, decision=TWOSHOT, expect_path="fused_twoshot")


def scenario_variants() -> None:
    """3-D input, no residual, Gemma's (1 + w), an fp32 weight, fp16 and fp32 inputs."""
    x, residual, weight, xs = _inputs(6, 4096, seed=1)
    shaped = [t.view(2, 3, 4096) for t in xs]
    _check(shaped[dist.get_rank()], residual.view(2, 3, 4096), weight, shaped, expect_path="fused_oneshot")
    _check(x, None, weight, xs, decision=TWOSHOT, expect_path="fused_twoshot")
    _check(x, residual, weight, xs, weight_bias=1.0, expect_path="fused_oneshot")
    x, residual, weight32, xs = _inputs(6, 4096, seed=2, weight_dtype=torch.float32)
    # the kernel reads the weight rounded to bf16: one more bf16 rounding than unfused
    _check(x, residual, weight32, xs, expect_path="fused_oneshot", ratio=2.0)
    for dtype, floor in ((torch.float16, 2e-3), (torch.float32, 1e-5)):
        assert runtime.prepare(_group_name(), 4096, dtype, max_tokens=64) == 64
        x, residual, weight, xs = _inputs(40, 4096, dtype, seed=3)
        _check(x, residual, weight, xs, decision=ONESHOT, dtype_floor=floor, expect_path="fused_oneshot")
        _check(x, residual, weight, xs, decision=TWOSHOT, dtype_floor=floor, expect_path="fused_twoshot")


def scenario_cuda_graph() -> None:
    """Capture after prepare(): table, forced two-shot and fallback calls replay correctly."""
    hidden, tokens = 4096, 64
    assert runtime.prepare(_group_name(), hidden, BF16, max_tokens=256) >= 256
    x, residual, weight, _ = _inputs(tokens, hidden)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        captured = {
            "table": _op(x, residual, weight),
            "twoshot": _op(x, residual, weight, decision=TWOSHOT),
            "unfused": _op(x, residual, weight, decision=tables.UNFUSED),
        }
    assert captured["twoshot"][2] == "fused_twoshot"
    assert captured["unfused"][2] == "fallback:table"
    outs = {label: (norm, res) for label, (norm, res, _) in captured.items()}
    for seed in (11, 12, 13):
        _, fresh_residual, _, xs = _inputs(tokens, hidden, seed=seed)
        x.copy_(xs[dist.get_rank()])
        residual.copy_(fresh_residual)
        graph.replay()
        torch.cuda.synchronize()
        norm_ref, res_ref = _reference(xs, residual, weight)
        unf_err = _rel(outs["unfused"][0], norm_ref)
        assert unf_err < 1e-2
        for label in ("table", "twoshot"):
            norm, res = outs[label]
            assert _rel(norm, norm_ref) <= ERROR_RATIO_LIMIT * unf_err, label
            assert _rel(res, res_ref) <= ERROR_RATIO_LIMIT * _rel(outs["unfused"][1], res_ref)
    del graph


def scenario_over_workspace() -> None:
    """Tokens over the workspace fall back (correctly); up to it they fuse."""
    hidden = 2048
    assert runtime.prepare(_group_name(), hidden, BF16, max_tokens=64) == 64
    for tokens, path in (
        (64, "fused_oneshot"),
        (65, "fallback:over_workspace"),
        (3000, "fallback:over_workspace"),
    ):
        x, residual, weight, xs = _inputs(tokens, hidden, seed=tokens)
        _check(x, residual, weight, xs, decision=ONESHOT, expect_path=path)


def scenario_dynamic_tokens() -> None:
    """Changing token counts reuse one workspace, under the table and forced two-shot."""
    hidden = 4096
    capacity = runtime.prepare(_group_name(), hidden, BF16)
    for tokens in (1, 3, 17, 64, 100, 255, 33, 1000, 1024, 2):
        x, residual, weight, xs = _inputs(tokens, hidden, seed=tokens)
        _, _, path = _op(x, residual, weight)
        expected = runtime.choose_path(
            tables.lookup(torch.cuda.get_device_name(), WORLD, hidden, BF16, tokens),
            tokens=tokens,
            hidden=hidden,
            dtype=BF16,
            world_size=WORLD,
            max_tokens=capacity,
        )
        assert path == (f"{expected[0]}:{expected[1]}" if expected[1] else expected[0])
        _check(x, residual, weight, xs, decision=None, expect_path=path)
        _check(
            x,
            residual,
            weight,
            xs,
            decision=TWOSHOT,
            expect_path="fused_twoshot" if tokens > WORLD else "fused_oneshot",
        )
    assert runtime.prepare(_group_name(), hidden, BF16) == capacity


def scenario_capture_without_workspace() -> None:
    """A fused call first seen during capture raises a clear error; eager then works.

    ``max_tokens`` makes the call fused at every world size: without it, where no table
    fuses hidden 1024 (world size 4), the call took the unfused path, whose NCCL all-reduce
    capture succeeds, and the scenario tested nothing (this is how it once hung at 4 ranks:
    the assertion failure kept the graph alive, and NCCL waits for graphs holding its
    kernels before it destroys a communicator)."""
    runtime.destroy_workspaces()
    runtime.configure(max_tokens=64)
    hidden = 1024
    x, residual, weight, xs = _inputs(16, hidden)
    graph = torch.cuda.CUDAGraph()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The CUDA Graph is empty")  # the call raised first
            with (
                pytest.raises(RuntimeError, match=r"passkit_fusion\.prepare\("),
                torch.cuda.graph(graph, capture_error_mode="thread_local"),
            ):
                _op(x, residual, weight, decision=ONESHOT)
    finally:
        del graph
    torch.cuda.synchronize()
    _check(x, residual, weight, xs, decision=ONESHOT, expect_path="fused_oneshot")


def scenario_discarded_fallback_graph() -> None:
    """A graph that captured the unfused path (an NCCL all-reduce) and is dropped unreplayed
    leaves the communicator usable: eager fused and unfused calls work after it."""
    hidden, tokens = 2048, 32
    runtime.prepare(_group_name(), hidden, BF16, max_tokens=64)
    x, residual, weight, xs = _inputs(tokens, hidden, seed=5)
    _op(x, residual, weight, decision=tables.UNFUSED)  # eager first, as before any capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        _op(x, residual, weight, decision=tables.UNFUSED)
    del graph
    _check(x, residual, weight, xs, decision=ONESHOT, expect_path="fused_oneshot")


def scenario_rank_mismatch() -> None:
    """Ranks configured differently raise (all), naming the field, instead of hanging; the
    site works once they agree again."""
    runtime.configure(max_tokens=256 * (1 + dist.get_rank()))
    try:
        x, residual, weight, _ = _inputs(8, 1536)
        with pytest.raises(RuntimeError, match=r"'max_tokens' differs: 256 on rank 0; 512 on rank 1"):
            _op(x, residual, weight)
    finally:
        runtime.configure(max_tokens=None)
    # an explicit capacity: the tuned table of some world sizes fuses no 1536-wide call
    assert runtime.prepare(_group_name(), 1536, BF16, max_tokens=64) == 64
    x, residual, weight, xs = _inputs(8, 1536)
    _check(x, residual, weight, xs, decision=ONESHOT, expect_path="fused_oneshot")


def scenario_table_decision() -> None:
    """A configured table drives the per-call choice."""
    hidden = 4096
    key = tables.TableKey(torch.cuda.get_device_name(), WORLD, hidden, "bfloat16")
    table = tables.Table({key: tables.Entry((tables.Rule(8, ONESHOT), tables.Rule(64, TWOSHOT)))})
    runtime.configure(table=table)
    try:
        runtime.prepare(_group_name(), hidden, BF16, max_tokens=1024)
        for tokens, path in ((4, "fused_oneshot"), (32, "fused_twoshot"), (100, "fallback:table")):
            x, residual, weight, xs = _inputs(tokens, hidden, seed=tokens)
            _check(x, residual, weight, xs, decision=None, expect_path=path)
    finally:
        runtime.configure(table=None)


def scenario_legacy_api() -> None:
    """The deprecated trtllm_* API path gives the same results."""
    runtime.destroy_workspaces()
    runtime.configure(flashinfer_api="legacy")
    try:
        assert runtime.prepare(_group_name(), 4096, BF16, max_tokens=256) == 256
        x, residual, weight, xs = _inputs(100, 4096, seed=7)
        _check(x, residual, weight, xs, decision=ONESHOT, expect_path="fused_oneshot")
        _check(x, residual, weight, xs, decision=TWOSHOT, expect_path="fused_twoshot")
        _check(x, None, weight, xs, weight_bias=1.0, expect_path="fused_oneshot")
    finally:
        runtime.destroy_workspaces()
        runtime.configure(flashinfer_api="auto")


def scenario_kernel_entry_point_equals_unified_api() -> None:
    """The default API (the kernel's entry point, called directly) is the kernel the unified
    API runs, with the same arguments: bit-identical outputs, one-shot and two-shot, with and
    without a residual and a weight bias, and the FP8 pattern."""
    runtime.destroy_workspaces()
    outputs: dict[str, list[torch.Tensor]] = {}
    try:
        for api in ("auto", "unified"):
            runtime.configure(flashinfer_api=api)
            assert runtime._api().name == ("kernel" if api == "auto" else "unified")
            assert runtime.prepare(_group_name(), 4096, BF16, max_tokens=256) == 256
            got = outputs.setdefault(api, [])
            for tokens, decision, with_residual, weight_bias in (
                (1, ONESHOT, True, 0.0),
                (100, TWOSHOT, True, 0.0),
                (37, ONESHOT, False, 1.0),
            ):
                x, residual, weight, _ = _inputs(tokens, 4096, seed=tokens)
                norm, res, _ = _op(x, residual if with_residual else None, weight, weight_bias, decision)
                got += [norm, res]
            x, residual, weight, _ = _inputs(16, 4096, seed=3)
            scale = torch.tensor([0.05], device=x.device)
            group = _group_name()
            got += list(
                runtime.fused_allreduce_rmsnorm_fp8_cuda(x, residual, weight, EPS, 0.0, scale, group, True)
            )
            runtime.destroy_workspaces()
        for i, (a, b) in enumerate(zip(outputs["auto"], outputs["unified"], strict=True)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"output {i} differs"
    finally:
        runtime.destroy_workspaces()
        runtime.configure(flashinfer_api="auto")


SCENARIOS: dict[str, Callable[[], None]] = {
    name.removeprefix("scenario_"): fn for name, fn in globals().items() if name.startswith("scenario_")
}


# ------------------------------------------------------------------ process plumbing --


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        device_id=torch.device("cuda", rank),
        timeout=datetime.timedelta(seconds=120),
    )
    verdicts: dict[str, str] = {}
    path = Path(out_dir) / f"rank{rank}.json"
    try:
        for name, scenario in SCENARIOS.items():
            start = time.perf_counter()
            print(f"rank {rank}: {name} ...", flush=True)
            faulthandler.dump_traceback_later(SCENARIO_STACKS_S, exit=False)
            try:
                scenario()
                verdicts[name] = "ok"
            except (Exception, pytest.fail.Exception) as exc:  # pytest's Failed is a BaseException
                verdicts[name] = traceback.format_exc()
                # the frames may hold CUDA graphs that captured NCCL kernels; NCCL waits for
                # those graphs to die before it destroys its communicator (at the end)
                traceback.clear_frames(exc.__traceback__)
                del exc
            finally:
                runtime.configure(max_tokens=None, table=None, force=None, flashinfer_api="auto")
            print(
                f"rank {rank}: {name} {'ok' if verdicts[name] == 'ok' else 'FAILED'} "
                f"({time.perf_counter() - start:.1f} s)",
                flush=True,
            )
            path.write_text(json.dumps(verdicts))
    finally:
        faulthandler.cancel_dump_traceback_later()
        runtime.destroy_workspaces()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, str]]:
    """Run all scenarios on 2 ranks once; return each rank's verdict per scenario."""
    out = tmp_path_factory.mktemp("fusion_runtime_gpu")
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, str(out))) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + DEADLINE_S
    for proc in procs:
        proc.join(max(1.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    results = {}
    for rank in range(WORLD):
        path = out / f"rank{rank}.json"
        results[rank] = json.loads(path.read_text()) if path.exists() else {}
    results[-1] = {"exit_codes": str([p.exitcode for p in procs])}  # type: ignore[index]
    return results


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_scenario(verdicts: dict[int, dict[str, str]], scenario: str) -> None:
    for rank in range(WORLD):
        verdict = verdicts[rank].get(scenario)
        assert verdict is not None, (
            f"rank {rank} never finished {scenario!r} (a rank hung or crashed; "
            f"exit codes {verdicts[-1]['exit_codes']})"
        )
        assert verdict == "ok", f"rank {rank}:\n{verdict}"
