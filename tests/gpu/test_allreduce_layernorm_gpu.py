"""GPU test of ``allreduce_add_layernorm`` (``impl="symm_mem"``): 2 ranks, NCCL, symmetric
memory, Triton. Skipped without 2 GPUs, Triton or torch's symmetric-memory op.

One pair of spawned processes runs every scenario; each rank writes its verdicts to a JSON
file. Against the reference op (NCCL's functional all-reduce + add + ``F.layer_norm``):
``residual_out`` exact (at world 2 both sum two values, rounded once), ``norm_out`` within
bf16's tolerance (Triton) or exact (``norm_kernel="torch"``); the fallback above
``max_bytes``; a CUDA-graph capture and replay; a LayerNorm decoder compiled with the pass
(Inductor) against eager.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import traceback
from pathlib import Path

import pytest
import torch

WORLD = 2
if torch.cuda.device_count() < WORLD:
    pytest.skip(f"needs {WORLD} CUDA GPUs", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)
if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
    pytest.skip("needs torch.ops.symm_mem.one_shot_all_reduce_copy_out", allow_module_level=True)

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent
EPS = 1e-5


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _check(results: dict, name: str, fn) -> None:  # type: ignore[no-untyped-def]
    try:
        fn()
        results[name] = "ok"
    except Exception:
        results[name] = traceback.format_exc()[-2000:]


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        device_id=torch.device("cuda", rank),
    )
    from passkit_fusion.allreduce_layernorm import ops, runtime  # noqa: F401

    group = dist.group.WORLD.group_name
    op = torch.ops.passkit_fusion.allreduce_add_layernorm
    results: dict[str, str] = {}

    def inputs(tokens: int, hidden: int, dtype=torch.bfloat16):  # type: ignore[no-untyped-def]
        rep = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(100 + rank)).to(dtype).cuda()
        r = torch.randn(tokens, hidden, generator=rep).to(dtype).cuda()
        w = (1 + 0.1 * torch.randn(hidden, generator=rep)).to(dtype).cuda()
        b = (0.1 * torch.randn(hidden, generator=rep)).to(dtype).cuda()
        return x, r, w, b

    def matches_reference() -> None:
        for tokens in (1, 7, 64, 256):
            for hidden in (4096, 8192, 1000):
                x, r, w, b = inputs(tokens, hidden)
                for res, bias in ((r, b), (None, None), (r, None)):
                    want = op(x, res, w, bias, EPS, group, "reference")
                    for kernel in ("triton", "torch"):
                        runtime.reset_stats()
                        got = op(x, res, w, bias, EPS, group, "symm_mem", kernel)
                        assert runtime.stats().get("symm_mem") == 1, runtime.stats()
                        assert torch.equal(got[1], want[1]), (tokens, hidden, kernel, "residual_out")
                        tol = 0 if kernel == "torch" else 2e-2
                        torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)

    def falls_back_above_max_bytes() -> None:
        x, r, w, b = inputs(64, 4096)
        runtime.reset_stats()
        got = op(x, r, w, b, EPS, group, "symm_mem", "triton", 1024)
        assert runtime.stats().get("fallback:above_max_bytes") == 1, runtime.stats()
        want = op(x, r, w, b, EPS, group, "reference")
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)

    def replays_in_a_cuda_graph() -> None:
        x, r, w, b = inputs(16, 4096)
        runtime.prepare(group, x.dtype, 4 * 2**20)
        op(x, r, w, b, EPS, group, "symm_mem", "triton")  # warm-up: Triton compiles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            norm, total = op(x, r, w, b, EPS, group, "symm_mem", "triton")
        for scale in (1.0, 2.0):
            x.mul_(scale)
            graph.replay()
            torch.cuda.synchronize()
            want = op(x, r, w, b, EPS, group, "reference")
            assert torch.equal(total, want[1])
            torch.testing.assert_close(norm, want[0], rtol=2e-2, atol=2e-2)
        del graph

    def compiled_decoder_matches_eager() -> None:
        import passkit

        sys.path.insert(0, str(HERE.parent / "fusion"))
        from layernorm_models import make_decoder

        model = make_decoder(True, torch.bfloat16, rank).cuda()
        x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).cuda()
        torch._dynamo.reset()
        backend = passkit.backend(passes=["allreduce_layernorm"], on_error="raise")
        with torch.no_grad():
            eager = model(x)
            got = torch.compile(model, backend=backend)(x)
        record = backend.last_report["allreduce_layernorm"]
        assert record.matches == 4, record.notes
        torch.testing.assert_close(got, eager, rtol=5e-2, atol=5e-2)

    try:
        for name, fn in (
            ("matches_reference", matches_reference),
            ("falls_back_above_max_bytes", falls_back_above_max_bytes),
            ("replays_in_a_cuda_graph", replays_in_a_cuda_graph),
            ("compiled_decoder_matches_eager", compiled_decoder_matches_eager),
        ):
            _check(results, name, fn)
            Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        runtime.destroy_buffers()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("aln")
    mp.start_processes(_rank, args=(_port(), str(out)), nprocs=WORLD, join=True, start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize(
    "scenario",
    [
        "matches_reference",
        "falls_back_above_max_bytes",
        "replays_in_a_cuda_graph",
        "compiled_decoder_matches_eager",
    ],
)
def test_scenario(verdicts: list[dict[str, str]], scenario: str):
    for rank, results in enumerate(verdicts):
        assert results.get(scenario) == "ok", f"rank {rank}: {results.get(scenario)}"
