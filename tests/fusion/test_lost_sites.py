"""A lost site is loud: an all-reduce that a norm follows but that no pattern matched is
warned about (``LostSiteWarning``, once per process for each pass, layer and reason, and on
passkit's logger), naming the norm's module path and the matcher's reason; a graph whose
every site fused, an all-reduce that no norm follows and a LayerNorm left to the other pass
stay silent. Graphs in a fake 2-rank world (no collective runs)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from passkit_fusion.patterns.lost import LostSiteWarning, reset_lost_site_warnings

from passkit_testing import fake_world, run_passes

HIDDEN = 64
REFERENCE = {"name": "allreduce_rmsnorm", "implementation": "reference"}


def ar(x: torch.Tensor) -> torch.Tensor:
    return funcol.all_reduce(x, "sum", dist.group.WORLD)


class RMSNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


class Layer(torch.nn.Module):
    """Two row-parallel projections, each all-reduced, added to the residual and normed;
    ``planted``: a ``clamp`` (a node no lead form takes) between the second sum and its add."""

    def __init__(self, planted: bool, final: str = "rms") -> None:
        super().__init__()
        self.planted = planted
        self.w1 = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN) / 8)
        self.w2 = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN) / 8)
        self.input_norm = RMSNorm()
        self.post_norm = RMSNorm()
        self.final_norm = RMSNorm() if final == "rms" else torch.nn.LayerNorm(HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + ar(self.input_norm(h) @ self.w1)
        y = ar(self.post_norm(h) @ self.w2)
        if self.planted:
            y = torch.clamp(y, -1e4, 1e4)
        return self.final_norm(h + y)


def _compile(model: torch.nn.Module, passes: list) -> tuple[list[warnings.WarningMessage], object]:
    with fake_world(2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_passes(model, torch.randn(2, 4, HIDDEN), passes=passes)
    return [w for w in caught if issubclass(w.category, LostSiteWarning)], result


@pytest.fixture(autouse=True)
def _fresh() -> None:
    reset_lost_site_warnings()


def test_a_planted_unmatched_site_is_warned_about_with_its_layer_and_reason(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="passkit"):
        lost, result = _compile(Layer(planted=True), [REFERENCE])
    record = result.report["allreduce_rmsnorm"]
    assert record.matches == 1  # the first site still fused
    assert len(lost) == 1, [str(w.message) for w in lost]
    message = str(lost[0].message)
    assert message.startswith(
        "passkit: pass 'allreduce_rmsnorm' left 1 all-reduce(s) that a norm follows unfused"
    )
    assert "final_norm: all_reduce -> wait_tensor -> clamp" in message, message
    assert "PASSKIT_DUMP_DIR" in message
    assert any("final_norm" in r.getMessage() for r in caplog.records if r.name.startswith("passkit"))
    assert any(n.startswith("1 site(s) lost") and "final_norm" in n for n in record.notes), record.notes


def test_a_lost_site_is_warned_about_once_per_process():
    first, _ = _compile(Layer(planted=True), [REFERENCE])
    again, result = _compile(Layer(planted=True), [REFERENCE])
    assert len(first) == 1 and not again
    assert any(
        n.startswith("1 site(s) lost") for n in result.report["allreduce_rmsnorm"].notes
    )  # still noted


def test_sequence_parallel_warns_about_its_lost_site_too():
    lost, _ = _compile(Layer(planted=True), [{"name": "sequence_parallel", "min_tokens": 1}])
    assert len(lost) == 1 and "'sequence_parallel'" in str(lost[0].message)
    assert "final_norm" in str(lost[0].message)


def test_silent_when_every_site_fused():
    lost, result = _compile(Layer(planted=False), [REFERENCE])
    assert result.report["allreduce_rmsnorm"].matches == 2
    assert not lost, [str(w.message) for w in lost]


def test_silent_for_the_other_norm_passs_site():
    """A LayerNorm after the second all-reduce is allreduce_layernorm's (the reason says so):
    not a lost site of allreduce_rmsnorm."""
    lost, result = _compile(Layer(planted=False, final="layer"), [REFERENCE])
    assert result.report["allreduce_rmsnorm"].matches == 1
    assert not lost, [str(w.message) for w in lost]


class NoNormAfter(torch.nn.Module):
    """An all-reduce whose sum only feeds a matmul (no norm follows): not a site at all."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN) / 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(ar(h @ self.w)) @ self.w


def test_silent_where_no_norm_follows():
    lost, result = _compile(NoNormAfter(), [REFERENCE])
    assert result.report["allreduce_rmsnorm"].matches == 0
    assert not lost, [str(w.message) for w in lost]
