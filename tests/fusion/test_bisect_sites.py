"""passkit-fusion's passes ask passkit's rewrite counter per all-reduce site: with
``bisect_limit`` = k, the first k sites are fused and the rest declined, the graph left as
it was there (fake world, in-process; ``tests/core/test_bisect.py`` bisects a real one)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import passkit
from passkit import rewrite_counter
from passkit_testing import fake_world, op_counts

FUSED = "passkit_fusion.allreduce_rmsnorm.default"


class Block(torch.nn.Module):
    def __init__(self, sites: int = 4, hidden: int = 16):
        super().__init__()
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(hidden, hidden)) for _ in range(sites))

    def forward(self, x):
        residual = x
        for w in self.w:
            residual = funcol.all_reduce(x @ w, "sum", dist.group.WORLD) + residual
            h = residual.float()
            x = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(residual.dtype)
        return x


def _compile(limit):
    rewrite_counter.reset()
    torch._dynamo.reset()
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    b = passkit.backend(
        passes=[{"name": "allreduce_rmsnorm", "implementation": "reference"}],
        compiler=keep,
        bisect_limit=limit,
    )
    with torch.no_grad():
        torch.compile(Block(), backend=b)(torch.randn(4, 16))
    return b.reports[-1]["allreduce_rmsnorm"], graphs[-1]


def test_allreduce_rmsnorm_fuses_the_sites_the_limit_allows(clean_env):
    with fake_world(2):
        record, graph = _compile(3)
    assert record.matches == 3
    assert op_counts(graph)[FUSED] == 3
    assert any("refused by bisect_limit" in note for note in record.notes), record.notes
    counted = rewrite_counter.counted_rewrites()
    assert [r.allowed for r in counted] == [True, True, True, False]
    assert counted[0].site.startswith("allreduce_rmsnorm at all-reduce ")
    rewrite_counter.reset()
