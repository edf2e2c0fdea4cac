"""MoE blocks whose expert all-reduces reach the norm in the forms of issue 39, in
``allreduce_rmsnorm`` and ``sequence_parallel``: graphs in a fake world, numerics against
eager on a 2-rank gloo world.

* ``reshaped``: ``(AR(routed) + AR(shared)).reshape(B, S, H) + residual`` (Ernie4.5-MoE,
  HunYuan-V3): the summed expert terms reshaped after their add;
* ``topk_sum``: ``AR(shared) + AR(routed).view(k, T, H).sum(0)`` (Llama-4: the experts'
  outputs all-reduced before their top-k sum);
* ``gated``: ``AR(routed) + sigmoid(x @ w_gate) * AR(shared)`` (Qwen3-Next, Qwen3.5-MoE);
* ``no_residual``: ``norm(AR(routed).view(B, S, H) + AR(shared))`` then ``residual + ...``
  (AXK1's and Kolibri1's post-MoE norm: two expert all-reduces into one norm).

Each layer's two expert all-reduces become one: ``allreduce_rmsnorm`` fuses one op per site,
``sequence_parallel`` reduce-scatters both terms and rewrites the norm once.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from sp_counts import reduce_scatters

import passkit
from passkit_testing import assert_close, count_ops, fake_world, gloo_world, run_passes

HIDDEN, INTER, TOKENS, TOP_K = 64, 32, (2, 4), 2
REFERENCE = {"name": "allreduce_rmsnorm", "implementation": "reference"}
SP = {"name": "sequence_parallel", "min_tokens": 1}
FUSED = "passkit_fusion.allreduce_rmsnorm.default"
ALL_REDUCE = "_c10d_functional.all_reduce.default"
ALL_GATHER = "_c10d_functional.all_gather_into_tensor.default"
FORMS = ("reshaped", "topk_sum", "gated", "no_residual")


def ar(x: torch.Tensor) -> torch.Tensor:
    return funcol.all_reduce(x, "sum", dist.group.WORLD)


def rms(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    dtype = h.dtype
    h = h.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)


class MoeBlock(torch.nn.Module):
    """Attention stand-in (one row-parallel all-reduce) then an MoE block with row-parallel
    routed and shared experts (two all-reduces) in the form ``form``, then a norm."""

    def __init__(self, rank: int, form: str, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.form = form
        own, same = torch.Generator().manual_seed(10 + rank), torch.Generator().manual_seed(0)

        def param(*shape: int, gen: torch.Generator) -> torch.nn.Parameter:
            return torch.nn.Parameter((torch.randn(shape, generator=gen) / shape[0] ** 0.5).to(dtype))

        self.attn_up, self.attn_down = param(HIDDEN, INTER, gen=own), param(INTER, HIDDEN, gen=own)
        self.up, self.down = param(HIDDEN, INTER, gen=own), param(INTER, HIDDEN, gen=own)
        self.shared_up, self.shared_down = param(HIDDEN, INTER, gen=own), param(INTER, HIDDEN, gen=own)
        self.gate = param(HIDDEN, 1, gen=same)  # replicated: the same on every rank
        self.norms = torch.nn.ParameterList(
            [torch.nn.Parameter((1 + 0.1 * torch.randn(HIDDEN, generator=same)).to(dtype)) for _ in range(4)]
        )

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = rms(h, self.norms[0])
        h = h + ar(torch.relu(y @ self.attn_up) @ self.attn_down)  # attention's site
        y = rms(h, self.norms[1])
        tokens = y.reshape(-1, HIDDEN)
        shared = ar(torch.relu(tokens @ self.shared_up) @ self.shared_down)
        if self.form == "topk_sum":  # each token once per chosen expert, summed after the all-reduce
            routed_in = tokens.repeat(TOP_K, 1) * torch.linspace(0.5, 1.5, TOP_K * tokens.shape[0])[:, None]
            routed = ar(torch.relu(routed_in @ self.up) @ self.down)
            out = shared + routed.reshape(TOP_K, -1, HIDDEN).sum(dim=0)
            h = h + out.view(h.shape)
        else:
            routed = ar(torch.relu(tokens @ self.up) @ self.down)
            if self.form == "reshaped":
                h = h + (routed + shared).reshape(h.shape)
            elif self.form == "gated":
                gated = torch.sigmoid(tokens @ self.gate) * shared
                h = h + (routed + gated).reshape(h.shape)
        return rms(h, self.norms[2]), h


def _input(rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # the residual stream is replicated: the same on every rank
    return torch.randn((*TOKENS, HIDDEN), generator=torch.Generator().manual_seed(100)).to(dtype)


class NoResidualBlock(MoeBlock):
    """Only the sandwich norm: ``h + norm(AR(routed).view(...) + AR(shared))``."""

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = rms(h, self.norms[1])
        tokens = y.reshape(-1, HIDDEN)
        routed = ar(torch.relu(tokens @ self.up) @ self.down).view(h.shape)
        shared = ar(torch.relu(y @ self.shared_up) @ self.shared_down)
        h = h + rms(routed + shared, self.norms[3])
        return rms(h, self.norms[2]), h


def _model(rank: int, form: str) -> torch.nn.Module:
    return NoResidualBlock(rank, form) if form == "no_residual" else MoeBlock(rank, form)


ALL_REDUCES = {"reshaped": 3, "topk_sum": 3, "gated": 3, "no_residual": 2}
SITES = {"reshaped": 2, "topk_sum": 2, "gated": 2, "no_residual": 1}


@pytest.mark.parametrize("form", FORMS)
def test_allreduce_rmsnorm_merges_the_expert_all_reduces(form: str):
    with fake_world(2):
        result = run_passes(_model(0, form), _input(0), passes=[REFERENCE])
    assert count_ops(result.graph_before, ALL_REDUCE) == ALL_REDUCES[form]
    assert count_ops(result.graph_after, ALL_REDUCE) == 0
    assert count_ops(result.graph_after, FUSED) == SITES[form]
    result.assert_matches("allreduce_rmsnorm", SITES[form])
    note = result.report["allreduce_rmsnorm"].notes[0]
    assert "1 all-reduce(s) merged into a site's" in note, note
    if form == "no_residual":
        assert note.startswith("1 site(s) -> reference op: 0 with residual, 1 without"), note


@pytest.mark.parametrize("form", FORMS)
def test_sequence_parallel_rewrites_each_norm_once(form: str):
    with fake_world(2):
        result = run_passes(_model(0, form), _input(0), passes=[SP])
    result.assert_matches("sequence_parallel", SITES[form])
    assert count_ops(result.graph_after, ALL_REDUCE) == 0
    assert reduce_scatters(result.graph_after) == ALL_REDUCES[form]
    note = result.report["sequence_parallel"].notes[0]
    assert "1 all-reduce(s) merged into a site's" in note, note


def test_a_gate_read_from_the_partial_sum_is_not_merged():
    """``sigmoid(partial @ w) * AR(shared)``: the gate differs per rank, so the all-reduce is
    not linear in it: the shared expert's all-reduce is left (the site still fuses)."""

    class PartialGate(MoeBlock):
        def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = rms(h, self.norms[1])
            tokens = y.reshape(-1, HIDDEN)
            partial = torch.relu(tokens @ self.shared_up) @ self.shared_down
            routed = ar(torch.relu(tokens @ self.up) @ self.down)
            gated = torch.sigmoid(partial @ self.gate) * ar(partial)
            h = h + (routed + gated).reshape(h.shape)
            return rms(h, self.norms[2]), h

    with fake_world(2):
        result = run_passes(PartialGate(0, "gated"), _input(0), passes=[REFERENCE])
    assert count_ops(result.graph_after, ALL_REDUCE) == 1
    note = result.report["allreduce_rmsnorm"].notes[0]
    assert "merged" not in note, note


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for form in FORMS:
        for label, passes in (("allreduce_rmsnorm", [REFERENCE]), ("sequence_parallel", [SP])):
            torch._dynamo.reset()
            model = _model(rank, form)
            backend = passkit.backend(passes=passes, mode="eager", verify=True, on_error="raise")
            with torch.no_grad():
                compiled = torch.compile(model, backend=backend, fullgraph=True)(_input(rank))
                eager = model(_input(rank))
            record = backend.reports[0][label]
            out[f"{form} {label}"] = {
                "compiled": compiled,
                "eager": eager,
                "status": record.status,
                "matches": record.matches,
            }
    return out


def test_every_form_matches_eager_on_gloo():
    ranks = gloo_world(_rank, 2, timeout=300)
    for rank in ranks:
        for label, result in rank.items():
            assert result["status"] == "ran", (label, result["status"])
            assert result["matches"] == SITES[label.split(" ")[0]], label
            for got, expected in zip(result["compiled"], result["eager"]):
                assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_report_that_does_not_match_the_graph_fails_the_pass(monkeypatch: pytest.MonkeyPatch):
    """The passes count the all-reduces left after their rewrite: a rewrite that leaves a site's
    all-reduce in the graph (here: one that does nothing) is the pass's failure, its graph
    restored, not a report of sites fused."""
    from passkit_fusion.allreduce_rmsnorm.pass_ import AllReduceRMSNorm

    monkeypatch.setattr(AllReduceRMSNorm, "_replace", lambda self, graph, site, position, impl: False)
    with fake_world(2):
        result = run_passes(_model(0, "reshaped"), _input(0), passes=[REFERENCE], on_error="skip")
    record = result.report["allreduce_rmsnorm"]
    assert record.status == "failed", record
    assert "reports 3 all-reduce(s) rewritten, but the graph went from 3 to 3" in record.reason
    assert count_ops(result.graph_after, ALL_REDUCE) == 3


def test_a_scale_after_the_expert_sum_is_named():
    """Granite's ``residual + (AR(shared) + moe) * residual_multiplier``: the scale sits
    between the expert sum and the residual add; the site is left with that reason (not "no
    RMSNorm after the all-reduce": one follows, after the scale and the add)."""

    class ScaledSum(MoeBlock):
        def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = rms(h, self.norms[1])
            tokens = y.reshape(-1, HIDDEN)
            shared = ar(torch.relu(tokens @ self.shared_up) @ self.shared_down)
            moe = tokens * self.norms[3]  # replicated: read from the replicated stream
            h = h + ((shared + moe) * 0.5).reshape(h.shape)
            return rms(h, self.norms[2]), h

    with fake_world(2):
        result = run_passes(ScaledSum(0, "scaled"), _input(0), passes=[REFERENCE])
    assert count_ops(result.graph_after, ALL_REDUCE) == 1
    reasons = " ".join(result.report["allreduce_rmsnorm"].notes)
    assert "a constant scale after the all-reduce's sum with another term" in reasons, reasons


def test_hyper_connection_streams_are_named():
    """DeepSeek-V4's mHC: the attention's sum is spread over ``S`` residual streams
    (``post.unsqueeze(-1) * AR(attn).unsqueeze(-2) + comb @ streams``) and the next norm reads
    a learned mix of the streams: no norm reads the sum plus a residual, and the reason says
    so (not "no RMSNorm after the all-reduce"); the benchmark's denominator leaves it out."""
    streams = 4

    class HyperConnections(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            gen = torch.Generator().manual_seed(0)
            self.up = torch.nn.Parameter(torch.randn(HIDDEN, INTER, generator=gen) / 8)
            self.down = torch.nn.Parameter(torch.randn(INTER, HIDDEN, generator=gen) / 8)
            self.post = torch.nn.Parameter(torch.rand(streams, generator=gen))
            self.comb = torch.nn.Parameter(torch.rand(streams, streams, generator=gen))
            self.mix = torch.nn.Parameter(torch.rand(streams, generator=gen))
            self.weight = torch.nn.Parameter(torch.ones(HIDDEN))

        def forward(self, h: torch.Tensor) -> torch.Tensor:  # h: [T, streams, H]
            x = rms((h * self.mix[:, None]).sum(-2), self.weight)
            out = ar(torch.relu(x @ self.up) @ self.down)
            h = self.post.unsqueeze(-1) * out.unsqueeze(-2) + self.comb.t() @ h
            return rms((h * self.mix[:, None]).sum(-2), self.weight)

    with fake_world(2):
        result = run_passes(HyperConnections(), torch.randn(4, streams, HIDDEN), passes=[REFERENCE])
    assert count_ops(result.graph_after, ALL_REDUCE) == 1
    reasons = " ".join(result.report["allreduce_rmsnorm"].notes)
    assert "spread over several residual streams" in reasons and reasons.count("; ") == 0, reasons
    assert "no RMSNorm after the all-reduce" not in reasons, reasons
