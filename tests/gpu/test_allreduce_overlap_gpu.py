"""GPU tests of ``allreduce_overlap``'s copy-engine transport (``passkit_fusion.matmul_all_reduce``):
NCCL worlds of 2 and 4 ranks, symmetric memory with NVLink multicast off (forced by
passkit_testing's worlds). Skipped without enough CUDA GPUs.

One world per size runs every scenario in order, each rank returning a verdict per scenario:

* ``op``: the op at row counts that do and do not divide by the chunks (1, 7, 2048, 2049),
  2 and 4 chunks, against ``all_reduce(a @ b)`` by NCCL; every rank's output bit-identical
  to every other's (the partials are added in rank order everywhere);
* ``back_to_back``: 12 calls issued without a synchronisation between them, each on new
  inputs, checked after the last: the buffer a rank writes must not be overwritten while a
  peer still reads it (the opening barrier);
* ``compiled``: a row-parallel MLP (mm -> relu -> mm -> all_reduce, bf16) compiled by Inductor
  with the pass, tokens dynamic: fp64-referenced error within 1.25x (+ a floor) of the same
  bf16 computation without the pass; the report names the sites; the copy-engine path ran;
* ``cuda_graph``: that compiled MLP captured in a CUDA graph after a warm-up call, replayed on
  new inputs;
* ``capture_first``: the op called first inside a capture on a fresh group runs the
  functional all-reduce (capturable) and sets nothing up;
* ``norm_op``: ``matmul_all_reduce_rmsnorm`` (the partials, the residual and the RMSNorm in
  one Triton kernel) at the same row counts against NCCL's sum + the reference add and norm,
  its outputs bit-identical on every rank;
* ``compiled_norm``: a row-parallel MLP followed by a residual add and a Llama RMSNorm,
  compiled with the pass: the site becomes the norm op, it runs the copy engines, and both
  outputs' errors are within 1.25x (+ a floor) of the same bf16 computation without the pass.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

WORLDS = [w for w in (2, 4) if torch.cuda.device_count() >= w]
if not WORLDS:
    pytest.skip("needs >= 2 CUDA GPUs", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

import passkit  # noqa: E402
from passkit_testing import run_in_nccl_world  # noqa: E402

pytestmark = pytest.mark.gpu

H, F = 2048, 4096
BF16 = torch.bfloat16
ERROR_RATIO_LIMIT = 1.25
OP_ROWS = (1, 7, 2048, 2049)
TOKENS = (512, 2048, 3000)


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _identical_on_every_rank(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _nccl(a: torch.Tensor, b: torch.Tensor, group: str) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(a @ b, "sum", group))


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    from passkit_fusion.allreduce_overlap import ops, runtime

    warnings.simplefilter("ignore", FutureWarning)
    torch._dynamo.config.cache_size_limit = 64
    group = dist.group.WORLD.group_name
    op = ops.matmul_all_reduce_op()
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)  # each rank its own partials
    out: dict[str, Any] = {}

    # -- the op against NCCL ------------------------------------------------------------
    runtime.reset_stats()
    b = torch.randn(F // world, H, generator=gen, device="cuda", dtype=BF16) / 30
    checks = {}
    for rows in OP_ROWS:
        for chunks in (2, 4):
            a = torch.randn(rows, F // world, generator=gen, device="cuda", dtype=BF16)
            got = op(a, b, group, chunks, 2, 0, 60.0)
            checks[f"{rows}x{chunks}"] = {
                "rel_error": _rel_error(got, _nccl(a, b, group)),
                "identical": _identical_on_every_rank(got),
            }
    out["op"] = {"checks": checks, "stats": runtime.stats(), "reserved": runtime.reserved_bytes(group)}

    # -- many calls in flight: the buffer is not overwritten under a peer's copy ----------
    inputs = [torch.randn(2048, F // world, generator=gen, device="cuda", dtype=BF16) for _ in range(12)]
    results = [op(a, b, group, 4, 3, 0, 60.0) for a in inputs]  # no synchronisation in between
    torch.cuda.synchronize()
    out["back_to_back"] = [_rel_error(r, _nccl(a, b, group)) for r, a in zip(results, inputs, strict=True)]

    # -- compiled, dynamic token counts ---------------------------------------------------
    w_gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(H, F, generator=w_gen, device="cuda", dtype=torch.float64) / H**0.5
    w2 = torch.randn(F, H, generator=w_gen, device="cuda", dtype=torch.float64) / F**0.5
    w1s = w1.chunk(world, 1)[rank].to(BF16).contiguous()
    w2s = w2.chunk(world, 0)[rank].to(BF16).contiguous()

    def model(x):
        return funcol.wait_tensor(funcol.all_reduce(torch.relu(x @ w1s) @ w2s, "sum", group))

    def reference(x):
        return torch.relu(x @ w1) @ w2

    spec = {"name": "allreduce_overlap", "min_tokens": 1, "restrict_tokens": False, "chunks": 2}
    before = len(passkit._pipeline.run.RECENT_REPORTS)
    compiled = torch.compile(model, backend=passkit.backend(passes=[spec]), dynamic=True)
    runtime.reset_stats()
    errors = {}
    for tokens in TOKENS:
        x = torch.randn(
            tokens,
            H,
            generator=torch.Generator(device="cuda").manual_seed(tokens),
            device="cuda",
            dtype=torch.float64,
        )
        xs = x.to(BF16)
        errors[tokens] = {
            "compiled": _rel_error(compiled(xs), reference(x)),
            "eager": _rel_error(model(xs), reference(x)),
        }
    reports = list(passkit._pipeline.run.RECENT_REPORTS)[before:]
    records = [r["allreduce_overlap"] for r in reports if "allreduce_overlap" in r.names()]
    out["compiled"] = {
        "errors": errors,
        "stats": runtime.stats(),
        "records": [(rec.status, rec.matches, rec.reason, list(rec.notes)) for rec in records],
    }

    # -- CUDA graph capture and replay ------------------------------------------------------
    static_in = torch.randn(TOKENS[1], H, device="cuda", dtype=BF16)
    compiled(static_in)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = compiled(static_in)
    errs = []
    for seed in (11, 12):
        x = torch.randn(
            TOKENS[1],
            H,
            generator=torch.Generator(device="cuda").manual_seed(seed),
            device="cuda",
            dtype=torch.float64,
        )
        static_in.copy_(x.to(BF16))
        graph.replay()
        torch.cuda.synchronize()
        errs.append(_rel_error(static_out, reference(x)))
    out["cuda_graph"] = {"errors": errs}

    # -- first call inside a capture: functional all-reduce, nothing set up --------------------
    fresh = dist.new_group()
    dist.all_reduce(torch.zeros(1, device="cuda"), group=fresh)  # NCCL communicator up before capture
    runtime.reset_stats()
    a = torch.randn(256, F // world, device="cuda", dtype=BF16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, stream=stream):
        captured = op(a, b, fresh.group_name, 2, 1, 0, 60.0)
    g2.replay()
    torch.cuda.synchronize()
    out["capture_first"] = {
        "stats": runtime.stats(),
        "reserved": runtime.reserved_bytes(fresh.group_name),
        "rel_error": _rel_error(captured, _nccl(a, b, fresh.group_name)),
    }
    out["norm_op"] = _norm_op(group, world, b, gen)
    out["compiled_norm"] = _compiled_norm(group, rank, world)
    return out


def _norm_op(group: str, world: int, b: torch.Tensor, gen: torch.Generator) -> dict[str, Any]:
    from passkit_fusion.allreduce_overlap import ops, runtime

    from passkit_fusion import reference

    runtime.reset_stats()
    weight = (1 + torch.randn(H, generator=gen, device="cuda") / 10).to(BF16)
    dist.broadcast(weight, 0)  # the norm's weight is replicated
    checks = {}
    for rows in OP_ROWS:
        for chunks in (2, 4):
            a = torch.randn(rows, F // world, generator=gen, device="cuda", dtype=BF16)
            residual = torch.randn(1, rows, H, generator=gen, device="cuda", dtype=BF16)
            dist.broadcast(residual, 0)  # the residual stream is replicated too
            norm, total = ops.matmul_all_reduce_rmsnorm_op()(
                a, b, residual, weight, 1e-6, 0.0, group, chunks, 1, 0, 60.0
            )
            want_norm, want_total = reference.allreduce_rmsnorm(
                (a @ b).view(residual.shape), residual, weight, 1e-6, 0.0, group
            )
            checks[f"{rows}x{chunks}"] = {
                "norm_error": _rel_error(norm, want_norm),
                "residual_error": _rel_error(total, want_total),
                "shape": list(norm.shape) == list(total.shape) == list(residual.shape),
                "identical": _identical_on_every_rank(norm) and _identical_on_every_rank(total),
            }
    return {"checks": checks, "stats": runtime.stats()}


def _compiled_norm(group: str, rank: int, world: int) -> dict[str, Any]:
    from passkit_fusion.allreduce_overlap import runtime

    w_gen = torch.Generator(device="cuda").manual_seed(1)
    w1 = torch.randn(H, F, generator=w_gen, device="cuda", dtype=torch.float64) / H**0.5
    w2 = torch.randn(F, H, generator=w_gen, device="cuda", dtype=torch.float64) / F**0.5
    gamma = 1 + torch.randn(H, generator=w_gen, device="cuda", dtype=torch.float64) / 10
    w1s = w1.chunk(world, 1)[rank].to(BF16).contiguous()
    w2s = w2.chunk(world, 0)[rank].to(BF16).contiguous()
    gammas = gamma.to(BF16)

    def model(x, residual):
        # (one wait, as DTensor's graphs have: an explicit wait_tensor on top traces a second one)
        h = funcol.all_reduce(torch.relu(x @ w1s) @ w2s, "sum", group) + residual
        hs = h.float()
        return gammas * (hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF16), h

    def reference(x, residual):
        h = torch.relu(x @ w1) @ w2 + residual
        return gamma * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6), h

    spec = {"name": "allreduce_overlap", "min_tokens": 1, "restrict_tokens": False, "chunks": 4}
    before = len(passkit._pipeline.run.RECENT_REPORTS)
    compiled = torch.compile(model, backend=passkit.backend(passes=[spec]), dynamic=True)
    runtime.reset_stats()
    errors = {}
    for tokens in TOKENS:
        g = torch.Generator(device="cuda").manual_seed(tokens)
        x = torch.randn(tokens, H, generator=g, device="cuda", dtype=torch.float64)
        r = torch.randn(tokens, H, generator=g, device="cuda", dtype=torch.float64)
        want = reference(x, r)
        got, plain = compiled(x.to(BF16), r.to(BF16)), model(x.to(BF16), r.to(BF16))
        errors[tokens] = {
            "compiled": [_rel_error(o, w) for o, w in zip(got, want, strict=True)],
            "eager": [_rel_error(o, w) for o, w in zip(plain, want, strict=True)],
        }
    reports = list(passkit._pipeline.run.RECENT_REPORTS)[before:]
    records = [r["allreduce_overlap"] for r in reports if "allreduce_overlap" in r.names()]
    return {
        "errors": errors,
        "stats": runtime.stats(),
        "records": [(rec.status, rec.matches, rec.reason, list(rec.notes)) for rec in records],
    }


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def world(request) -> tuple[int, list[dict[str, Any]]]:
    results = run_in_nccl_world(_scenarios, request.param, timeout=420)
    for r in results:
        assert r.ok, r.describe()
    return request.param, [r.value for r in results]


def test_the_op_equals_nccls_sum_and_is_identical_on_every_rank(world):
    _, results = world
    for rank, r in enumerate(results):
        o = r["op"]
        assert o["stats"].get("copy_engine", 0) == len(OP_ROWS) * 2 and "fallback" not in o["stats"], o[
            "stats"
        ]
        assert o["reserved"] > 0
        for case, c in o["checks"].items():
            assert c["identical"], (rank, case)
            assert c["rel_error"] < 1e-2, (rank, case, c)


def test_calls_in_flight_do_not_overwrite_a_peers_chunks(world):
    _, results = world
    for r in results:
        assert max(r["back_to_back"]) < 1e-2, r["back_to_back"]


def test_compiled_mlp_runs_the_copy_engine_op_and_is_accurate(world):
    _, results = world
    for rank, r in enumerate(results):
        c = r["compiled"]
        assert c["records"], f"rank {rank}: no allreduce_overlap report"
        status, matches, reason, notes = c["records"][0]
        assert status == "ran" and matches == 1, (rank, status, reason, notes)
        assert c["stats"].get("copy_engine", 0) >= len(TOKENS) and "fallback" not in c["stats"], c["stats"]
        for tokens, e in c["errors"].items():
            assert e["compiled"] <= ERROR_RATIO_LIMIT * e["eager"] + 1e-3, (rank, tokens, e)


def test_cuda_graph_replay_is_accurate(world):
    _, results = world
    for r in results:
        assert max(r["cuda_graph"]["errors"]) < 1e-2, r["cuda_graph"]


def test_first_call_in_a_capture_runs_the_functional_all_reduce(world):
    _, results = world
    for r in results:
        cf = r["capture_first"]
        assert cf["stats"] == {"fallback": 1, "fallback:buffer_not_ready_in_capture": 1}, cf
        assert cf["reserved"] == 0
        assert cf["rel_error"] < 1e-2, cf


def test_the_norm_op_equals_nccl_and_the_reference_norm_on_every_rank(world):
    _, results = world
    for rank, r in enumerate(results):
        o = r["norm_op"]
        assert o["stats"].get("copy_engine", 0) == len(OP_ROWS) * 2 and "fallback" not in o["stats"], o[
            "stats"
        ]
        for case, c in o["checks"].items():
            assert c["shape"] and c["identical"], (rank, case, c)
            assert c["norm_error"] < 1e-2 and c["residual_error"] < 1e-2, (rank, case, c)


def test_compiled_residual_add_and_rmsnorm_run_in_the_norm_op_and_are_accurate(world):
    _, results = world
    for rank, r in enumerate(results):
        c = r["compiled_norm"]
        assert c["records"], f"rank {rank}: no allreduce_overlap report"
        status, matches, reason, notes = c["records"][0]
        assert status == "ran" and matches == 1 and "RMSNorm site(s)" in notes[0], (
            rank,
            status,
            reason,
            notes,
        )
        assert c["stats"].get("copy_engine", 0) >= len(TOKENS) and "fallback" not in c["stats"], c["stats"]
        for tokens, e in c["errors"].items():
            for got, plain in zip(e["compiled"], e["eager"], strict=True):
                assert got <= ERROR_RATIO_LIMIT * plain + 1e-3, (rank, tokens, e)
