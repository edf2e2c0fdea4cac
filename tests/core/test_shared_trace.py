"""Token-range specializations of an inference graph share one AOTAutograd trace
(passkit._compile.shared_trace): one trace, one Inductor compile per range, the same numerics and
reports as compiling each range on its own; training graphs compile each range apart."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from .test_ranges import EvenTanh, Everywhere, SmallRelu, backend, compiled, expected

SIZES = (3, 8, 9, 16, 17, 18, 64)


@pytest.mark.parametrize("compile_at", ["upfront", "first_use"])
def test_inference_ranges_share_one_trace(compile_at: str):
    b = backend(SmallRelu(), EvenTanh(), Everywhere(), compile_at=compile_at)
    f = compiled(b)
    counters.clear()
    with torch.no_grad():
        for n in SIZES:
            x = torch.randn(n, 4)
            torch.testing.assert_close(f(x), expected(x), msg=f"{n} tokens")
    assert counters["aot_autograd"]["total"] == 1  # one trace for the four ranges
    assert b.last_dispatcher is not None and b.last_dispatcher.compiled_count == 4
    assert sorted(r.token_range for r in b.reports) == [
        "tokens 1..16",
        "tokens 8..16, multiples of 2",
        "tokens >= 17",
        "tokens >= 17, multiples of 2",
    ]
    assert all(r.compile_s is not None for r in b.reports)


def test_training_graphs_compile_each_range_apart():
    b = backend(SmallRelu(), EvenTanh(), Everywhere(), compile_at="upfront")
    f = compiled(b)
    counters.clear()
    for n in (3, 18):
        x = torch.randn(n, 4, requires_grad=True)
        out = f(x)
        torch.testing.assert_close(out, expected(x.detach()), msg=f"{n} tokens")
        out.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
    assert counters["aot_autograd"]["total"] == 4  # each range traced on its own
    assert len({r.token_range for r in b.reports}) == 4  # (a report per forward and backward)


@pytest.mark.parametrize(("compile_at", "traces"), [("first_use", 4), ("upfront", 1)])
def test_with_aotautograds_cache_on_ranges_at_first_use_compile_apart(
    tmp_path, monkeypatch, compile_at, traces
):
    """A shared trace cannot be stored in AOTAutograd's cache (its result is a dispatcher):
    with that cache on, each range compiled at its first use gets its own compile_fx, which
    the cache serves on a warm start; every range compiled at once still shares one trace."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    b = backend(SmallRelu(), EvenTanh(), Everywhere(), compile_at=compile_at)
    f = compiled(b)
    counters.clear()
    with (
        inductor_config.patch(fx_graph_cache=True),
        functorch_config.patch(enable_autograd_cache=True),
        torch.no_grad(),
    ):
        for n in SIZES:
            x = torch.randn(n, 4)
            torch.testing.assert_close(f(x), expected(x), msg=f"{n} tokens")
    assert counters["aot_autograd"]["total"] == traces
    assert b.last_dispatcher is not None and b.last_dispatcher.compiled_count == 4
