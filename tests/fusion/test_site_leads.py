"""Sites whose all-reduce is not added to the residual directly, in all three passes.

A small hand-sharded TP block with each of the forms models write between the all-reduce
and the residual add / RMSNorm: the vocab-parallel embedding's sum times ``sqrt(hidden)``
(Gemma), an MoE block computed on ``[tokens, hidden]`` and reshaped back to ``[B, S, H]``
with a shared expert's output added before the residual (Qwen-MoE, DeepSeek), and a block
output times ``residual_multiplier`` (Granite). ``allreduce_rmsnorm`` fuses the three sites,
``sequence_parallel`` shards them, ``async_tp`` fuses what ``sequence_parallel`` leaves;
graphs in a fake world, numerics against eager on a 2-rank gloo world.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from sp_counts import reduce_scatters

import passkit
from passkit_testing import assert_close, count_ops, fake_world, gloo_world, run_passes

HIDDEN, INTER, TOKENS = 64, 32, (2, 4)
REFERENCE = {"name": "allreduce_rmsnorm", "implementation": "reference"}
SP = {"name": "sequence_parallel", "min_tokens": 1}
ATP = {"name": "async_tp", "implementation": "test_mode", "min_tokens": 1}
FUSED = "passkit_fusion.allreduce_rmsnorm.default"
ALL_REDUCE = "_c10d_functional.all_reduce.default"
TOKEN_SHARD = "passkit_fusion.token_shard.default"


def ar(x: torch.Tensor) -> torch.Tensor:
    return funcol.all_reduce(x, "sum", dist.group.WORLD)


def rms(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    dtype = h.dtype
    h = h.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)


class LeadsBlock(torch.nn.Module):
    """This rank's shard: column-parallel ``up`` weights, row-parallel ``down`` weights, a
    replicated shared expert and norm weights."""

    def __init__(self, rank: int, dtype: torch.dtype = torch.float32, sharded_shared: bool = False) -> None:
        super().__init__()
        self.sharded_shared = sharded_shared
        """DeepSeek's shared experts: row-parallel, their own all-reduce (summed into the site)"""
        own, same = torch.Generator().manual_seed(10 + rank), torch.Generator().manual_seed(0)

        def param(*shape: int, gen: torch.Generator) -> torch.nn.Parameter:
            return torch.nn.Parameter((torch.randn(shape, generator=gen) / shape[0] ** 0.5).to(dtype))

        self.up, self.down = param(HIDDEN, INTER, gen=own), param(INTER, HIDDEN, gen=own)
        self.up2, self.down2 = param(HIDDEN, INTER, gen=own), param(INTER, HIDDEN, gen=own)
        self.shared = param(HIDDEN, HIDDEN, gen=same)
        self.norms = torch.nn.ParameterList(
            [torch.nn.Parameter((1 + 0.1 * torch.randn(HIDDEN, generator=same)).to(dtype)) for _ in range(3)]
        )

    def forward(self, embedding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = ar(embedding) * HIDDEN**0.5  # vocab-parallel embedding, Gemma's scale
        y = rms(h, self.norms[0])
        tokens = y.reshape(-1, HIDDEN)  # the MoE block works on [tokens, hidden]
        routed = ar(torch.relu(tokens @ self.up) @ self.down).view(h.shape)
        if self.sharded_shared:  # AR(routed) + AR(shared): one all-reduce of the sum
            shared = ar(torch.relu(tokens @ self.up) @ self.shared[:INTER]).view(h.shape)
        else:  # replicated: the shared expert joins the residual
            shared = y @ self.shared
        h = routed + shared + h
        y = rms(h, self.norms[1])
        out = torch.relu(y.reshape(-1, HIDDEN) @ self.up2) @ self.down2
        h = h + ar(out).view(h.shape) * 0.22  # Granite's residual_multiplier
        return rms(h, self.norms[2]), h


def _embedding(rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn((*TOKENS, HIDDEN), generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def test_allreduce_rmsnorm_fuses_every_site():
    with fake_world(2):
        result = run_passes(LeadsBlock(0), _embedding(0), passes=[REFERENCE])
    assert count_ops(result.graph_before, ALL_REDUCE) == 3
    assert count_ops(result.graph_after, ALL_REDUCE) == 0
    assert count_ops(result.graph_after, FUSED) == 3
    assert (
        result.report["allreduce_rmsnorm"]
        .notes[0]
        .startswith("3 site(s) -> reference op: 2 with residual, 1 without")
    )


def test_sequence_parallel_shards_every_site():
    with fake_world(2):
        result = run_passes(LeadsBlock(0), _embedding(0), passes=[SP])
    result.assert_matches("sequence_parallel", 3)
    assert count_ops(result.graph_after, ALL_REDUCE) == 0
    assert reduce_scatters(result.graph_after) == 3
    assert count_ops(result.graph_after, TOKEN_SHARD) == 1  # the shared expert's output
    note = result.report["sequence_parallel"].notes[0]
    assert "0 residual(s) sliced (first), 2 already sharded (middle), 1 without residual" in note, note
    assert "1 shared term(s) sliced" in note, note


def test_a_summed_all_reduce_is_merged_into_the_site():
    """DeepSeek: ``AR(routed).view(...) + AR(shared) + residual`` -> one all-reduce of the sum."""
    with fake_world(2):
        fused = run_passes(LeadsBlock(0, sharded_shared=True), _embedding(0), passes=[REFERENCE])
        sharded = run_passes(LeadsBlock(0, sharded_shared=True), _embedding(0), passes=[SP])
    assert count_ops(fused.graph_before, ALL_REDUCE) == 4
    assert count_ops(fused.graph_after, ALL_REDUCE) == 0
    assert count_ops(fused.graph_after, FUSED) == 3
    assert "1 all-reduce(s) merged into a site's" in fused.report["allreduce_rmsnorm"].notes[0]
    sharded.assert_matches("sequence_parallel", 3)
    assert count_ops(sharded.graph_after, ALL_REDUCE) == 0
    assert reduce_scatters(sharded.graph_after) == 4  # the merged one reduce-scattered too
    assert count_ops(sharded.graph_after, TOKEN_SHARD) == 0
    assert "1 all-reduce(s) merged into a site's" in sharded.report["sequence_parallel"].notes[0]


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, passes, sharded_shared in (
        ("allreduce_rmsnorm", [REFERENCE], False),
        ("sequence_parallel", [SP], False),
        ("sequence_parallel+async_tp", [SP, ATP], False),
        ("allreduce_rmsnorm merged", [REFERENCE], True),
        ("sequence_parallel merged", [SP], True),
    ):
        torch._dynamo.reset()
        model = LeadsBlock(rank, sharded_shared=sharded_shared)
        backend = passkit.backend(passes=passes, mode="eager", verify=True, on_error="raise")
        with torch.no_grad():
            compiled = torch.compile(model, backend=backend, fullgraph=True)(_embedding(rank))
            eager = model(_embedding(rank))
        records = {rec.name: (rec.matches, rec.notes) for rec in backend.reports[0].records}
        out[label] = {"compiled": compiled, "eager": eager, "records": records}
    return out


def test_every_pass_matches_eager_on_gloo():
    ranks = gloo_world(_rank, 2, timeout=300)
    for rank in ranks:
        for label, result in rank.items():
            for got, expected in zip(result["compiled"], result["eager"]):
                assert_close(got, expected, rtol=1e-5, atol=1e-5)
            name = label.split("+")[0].split(" ")[0]
            assert result["records"][name][0] == 3, (label, result["records"])
        matches, notes = rank["sequence_parallel+async_tp"]["records"]["async_tp"]
        # all_gather -> mm: the two gathered norm outputs read by matmuls (up + shared, up2);
        # mm -> reduce_scatter: both row-parallel matmuls (the embedding's has no matmul)
        assert any(n.startswith("2 matmul -> reduce_scatter fused") for n in notes), notes
        assert any(n.startswith("2 all_gather -> matmul fused") for n in notes), notes
        assert matches == 4, notes
