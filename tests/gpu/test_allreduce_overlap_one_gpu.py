"""The copy-engine ops of ``allreduce_overlap`` on one GPU (an NCCL world of one rank): the
op's own machinery (its symmetric-memory buffer, barriers, side streams and kept events, the
Triton norm launched over row ranges) without peers, so that a machine with a single GPU
checks it too. The transfers between GPUs are checked by ``test_allreduce_overlap_gpu.py``
(2 and 4 GPUs). Skipped without a CUDA GPU.

* ``eager``: ``matmul_all_reduce`` and ``matmul_all_reduce_rmsnorm`` at row counts that do
  and do not divide by the chunks, against ``a @ b`` (and the reference residual add +
  RMSNorm of it), on the copy-engine path (no fallback);
* ``back_to_back``: 12 calls of each issued without a synchronisation between them: the
  events a call records again (kept per device) never let a later call's work pass an
  earlier one's;
* ``cuda_graph``: both ops captured after a warm-up call, replayed on new inputs copied into
  the captured ones, equal to eager calls on those inputs.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import torch.distributed as dist

from passkit_testing import run_in_nccl_world

pytestmark = pytest.mark.gpu

K, N = 1024, 2048
BF16 = torch.bfloat16
ROWS = (1, 7, 2048, 2049)
CLOSE = 1e-2  # bf16: the chunked matmul may round differently from the whole one


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    from passkit_fusion.allreduce_overlap import ops, runtime

    from passkit_fusion import reference

    warnings.simplefilter("ignore", FutureWarning)
    group = dist.group.WORLD.group_name
    plain, with_norm = ops.matmul_all_reduce_op(), ops.matmul_all_reduce_rmsnorm_op()
    gen = torch.Generator(device="cuda").manual_seed(7)
    b = torch.randn(K, N, generator=gen, device="cuda", dtype=BF16) / 30
    weight = (1 + torch.randn(N, generator=gen, device="cuda") / 10).to(BF16)

    def inputs(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(rows, K, generator=gen, device="cuda", dtype=BF16)
        return a, torch.randn(1, rows, N, generator=gen, device="cuda", dtype=BF16)

    def errors(a: torch.Tensor, residual: torch.Tensor, chunks: int) -> list[float]:
        """Both ops' errors against ``a @ b`` and its reference add + norm."""
        want = reference.allreduce_rmsnorm((a @ b).view(residual.shape), residual, weight, 1e-6, 0.0, group)
        got = with_norm(a, b, residual, weight, 1e-6, 0.0, group, chunks, 1, 0, 60.0)
        return [_rel_error(plain(a, b, group, chunks, 1, 0, 60.0), a @ b)] + [
            _rel_error(g, w) for g, w in zip(got, want, strict=True)
        ]

    out: dict[str, Any] = {}
    runtime.reset_stats()
    out["eager"] = {f"{rows}x{c}": errors(*inputs(rows), c) for rows in ROWS for c in (2, 4)}
    out["stats"] = runtime.stats()

    batch = [inputs(2048) for _ in range(12)]
    issued = [
        (plain(a, b, group, 4, 1, 0, 60.0), with_norm(a, b, r, weight, 1e-6, 0.0, group, 4, 1, 0, 60.0))
        for a, r in batch
    ]  # no synchronisation in between
    torch.cuda.synchronize()
    out["back_to_back"] = [
        max(
            _rel_error(p, a @ b),
            *(
                _rel_error(g, w)
                for g, w in zip(
                    n,
                    reference.allreduce_rmsnorm((a @ b).view(r.shape), r, weight, 1e-6, 0.0, group),
                    strict=True,
                )
            ),
        )
        for (p, n), (a, r) in zip(issued, batch, strict=True)
    ]

    static_a, static_r = inputs(3000)
    plain(static_a, b, group, 2, 1, 0, 60.0)  # warm-up outside the capture
    with_norm(static_a, b, static_r, weight, 1e-6, 0.0, group, 2, 1, 0, 60.0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_plain = plain(static_a, b, group, 2, 1, 0, 60.0)
        captured_norm = with_norm(static_a, b, static_r, weight, 1e-6, 0.0, group, 2, 1, 0, 60.0)
    replays = []
    for _ in range(2):
        a, r = inputs(3000)
        static_a.copy_(a)
        static_r.copy_(r)
        graph.replay()
        eager_plain = plain(a, b, group, 2, 1, 0, 60.0)
        eager_norm = with_norm(a, b, r, weight, 1e-6, 0.0, group, 2, 1, 0, 60.0)
        torch.cuda.synchronize()
        replays.append(
            [_rel_error(captured_plain, eager_plain)]
            + [_rel_error(c, e) for c, e in zip(captured_norm, eager_norm, strict=True)]
        )
    out["cuda_graph"] = replays
    return out


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    (result,) = run_in_nccl_world(_scenarios, 1, timeout=300)
    assert result.ok, result.describe()
    return result.value


def test_both_ops_equal_the_matmul_and_the_reference_norm_on_the_copy_engine_path(results):
    for case, errs in results["eager"].items():
        assert max(errs) < CLOSE, (case, errs)
    stats = results["stats"]
    assert stats.get("copy_engine", 0) == 2 * len(results["eager"]), stats
    assert not any(k.startswith("fallback") for k in stats), stats


def test_calls_issued_back_to_back_keep_their_order(results):
    assert max(results["back_to_back"]) < CLOSE, results["back_to_back"]


def test_cuda_graph_replays_equal_eager_calls(results):
    for replay in results["cuda_graph"]:
        assert max(replay) == 0.0, replay
