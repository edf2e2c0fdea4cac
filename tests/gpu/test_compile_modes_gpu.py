"""torch.compile's modes through passkit on one GPU: Inductor's CUDA graphs and autotuning
with token-range specialization. Skipped without a CUDA GPU.

* ``reduce-overhead``: a model compiled through passkit with a pass that applies only up to
  16 tokens (two specializations) records a CUDA graph per range and token count, replays
  them, and returns what Inductor's own ``reduce-overhead`` returns; the pass ran in the
  small range only; the range dispatcher sits outside the graphs (a call of each range after
  the other still replays).
* ``max-autotune`` and ``max-autotune-no-cudagraphs``: Inductor's autotuning runs (the
  pass sees ``max_autotune`` on) and the output is right.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import passkit
from passkit import PassResult, TokenConstraint
from passkit._pipeline.build import Pipeline
from passkit._plugins.registry import get_plugins
from passkit.config import load_config

pytestmark = pytest.mark.gpu
aten = torch.ops.aten


class SmallSigmoid(passkit.GraphPass):
    """relu -> sigmoid up to 16 tokens (visible in the numbers)."""

    name = "small_sigmoid"
    tokens = TokenConstraint(max_tokens=16)

    def run(self, gm, ctx):
        n = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=aten.relu.default)):
            node.target = aten.sigmoid.default
            n += 1
        return PassResult(modified=n > 0, matches=n)


class Observer(passkit.GraphPass):
    """Runs in every specialization: records its range and Inductor's settings."""

    name = "observer"
    seen: list[tuple[str, bool, bool]] = []

    def run(self, gm, ctx):
        import torch._inductor.config as config

        Observer.seen.append((str(ctx.token_range), config.triton.cudagraphs, config.max_autotune))
        return PassResult()


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(256, 1024)
        self.down = torch.nn.Linear(1024, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))) + x


def _backend() -> passkit.Backend:
    return passkit.Backend(pipeline=Pipeline(load_config({}), get_plugins(), [SmallSigmoid(), Observer()]))


def _expected(model: Model, x: torch.Tensor) -> torch.Tensor:
    act = torch.sigmoid if x.shape[0] <= 16 else torch.relu
    return model.down(act(model.up(x))) + x


def _inputs() -> dict[int, torch.Tensor]:
    out = {}
    for n in (64, 8, 33, 16):
        x = torch.randn(n, 256, device="cuda")
        torch._dynamo.mark_dynamic(x, 0)
        out[n] = x
    return out


def test_reduce_overhead_records_and_replays_a_graph_per_range():
    from torch._inductor import cudagraph_trees as trees

    torch._dynamo.reset()
    Observer.seen = []
    model = Model().cuda().eval()
    counts = {"recorded": 0, "replayed": 0}
    record, replay = trees.CUDAGraphTreeManager.record_function, trees.CUDAGraphNode.run_graph

    def counted_record(*args, **kwargs):
        counts["recorded"] += 1
        return record(*args, **kwargs)

    def counted_replay(*args, **kwargs):
        counts["replayed"] += 1
        return replay(*args, **kwargs)

    trees.CUDAGraphTreeManager.record_function = counted_record
    trees.CUDAGraphNode.run_graph = counted_replay
    try:
        backend = _backend()
        compiled = torch.compile(model, backend=backend, mode="reduce-overhead")
        inputs = _inputs()
        with torch.no_grad():
            for _ in range(4):  # interleaved ranges: the dispatcher is outside the graphs
                for _n, x in inputs.items():
                    torch.testing.assert_close(compiled(x), _expected(model, x), rtol=2e-3, atol=2e-3)
    finally:
        trees.CUDAGraphTreeManager.record_function = record
        trees.CUDAGraphNode.run_graph = replay
        torch._dynamo.reset()
    reports = [(r.token_range, r.notes, r.compile_s) for r in backend.reports]
    assert sorted(Observer.seen) == [("tokens 1..16", True, False), ("tokens >= 17", True, False)], reports
    assert counts["recorded"] >= 4, counts  # one per token count, in two specializations
    assert counts["replayed"] >= 8, counts
    by_range = {r.token_range: r["small_sigmoid"].status for r in backend.reports}
    assert by_range == {"tokens 1..16": "ran", "tokens >= 17": "skipped"}


def test_reduce_overhead_equals_inductors_own():
    torch._dynamo.reset()
    model = Model().cuda().eval()
    x = torch.randn(8, 256, device="cuda")
    with torch.no_grad():
        ours = torch.compile(model, backend=passkit.backend(passes=["cleanup"]), mode="reduce-overhead")
        got = [ours(x).clone() for _ in range(3)]
        torch._dynamo.reset()
        theirs = torch.compile(model, mode="reduce-overhead")
        want = [theirs(x).clone() for _ in range(3)]
    torch._dynamo.reset()
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["max-autotune-no-cudagraphs", "max-autotune"])
def test_max_autotune_modes(mode):
    torch._dynamo.reset()
    Observer.seen = []
    model = Model().cuda().eval()
    compiled = torch.compile(model, backend=_backend(), mode=mode)
    with torch.no_grad():
        for _n, x in _inputs().items():
            for _ in range(2):
                torch.testing.assert_close(compiled(x), _expected(model, x), rtol=2e-2, atol=2e-2)
    torch._dynamo.reset()
    assert sorted(r for r, _, _ in Observer.seen) == ["tokens 1..16", "tokens >= 17"]
    assert all(autotune for _, _, autotune in Observer.seen)
    assert {cudagraphs for _, cudagraphs, _ in Observer.seen} == {mode == "max-autotune"}
