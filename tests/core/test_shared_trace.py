"""Token-range specializations of an inference graph share one AOTAutograd trace
(passkit.shared_trace): one trace, one Inductor compile per range, the same numerics and
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
