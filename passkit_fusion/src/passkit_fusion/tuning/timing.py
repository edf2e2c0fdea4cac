"""CUDA-graph timing: the median device time of a step, captured into a CUDA graph.

Both helpers warm the step up on a side stream, capture it into one CUDA graph and take
the median of per-replay CUDA event times, in microseconds. They differ in what a replay
measures, and each caller keeps the one it always used:

* :func:`graph_median_us` (tuning, ``benchmarks/fusion_op.py``): ``ops_per_graph`` steps
  per graph, replays issued back to back (no host synchronisation between them), the
  median divided by ``ops_per_graph``: the device time of one step.
* :func:`replay_median_us` (the demo, ``benchmarks/fusion_e2e.py``): one step per graph,
  the host waits for each replay before issuing the next: the latency of one launched
  replay (a decode step), launch included.

:func:`call_median_us` captures nothing: for a step that replays CUDA graphs of its own
(torch.compile's ``mode="reduce-overhead"``), which cannot be captured again, it times the
calls themselves, launch and host work included.

With collectives inside the step, every rank must call them in lock-step.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Literal

import torch

__all__ = ["call_median_us", "graph_median_us", "replay_median_us"]


def _capture(
    step: Callable[[], object],
    *,
    warmup: int,
    ops_per_graph: int,
    capture_error_mode: Literal["global", "thread_local", "relaxed"],
) -> torch.cuda.CUDAGraph:
    """Run ``step`` ``warmup`` times on a side stream, then capture it ``ops_per_graph``
    times into one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        for _ in range(ops_per_graph):
            step()
    return graph


def graph_median_us(
    step: Callable[[], object],
    *,
    ops_per_graph: int = 10,
    replays: int = 100,
    warmup: int = 3,
    reset: Callable[[], object] | None = None,
) -> float:
    """Median device time of one ``step()`` in microseconds, CUDA-graph timed.

    ``step`` is run ``warmup`` times eagerly, then captured ``ops_per_graph`` times into one
    graph, which is replayed ``replays`` times with events around each replay; the result
    is the median replay time divided by ``ops_per_graph``.  ``reset`` runs before each
    replay, outside the timed region (e.g. to restore a buffer that ``step`` reduces in
    place).  With collectives inside ``step``, every rank must call this in lock-step.
    """
    graph = _capture(step, warmup=warmup, ops_per_graph=ops_per_graph, capture_error_mode="thread_local")
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)
    ]
    graph.replay()  # first replay uploads the graph
    torch.cuda.synchronize()
    for start, end in events:
        if reset is not None:
            reset()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    del graph
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1000.0 / ops_per_graph


def replay_median_us(
    step: Callable[[], object],
    *,
    replays: int = 100,
    warmup: int = 3,
    before_replays: Callable[[], object] | None = None,
) -> float:
    """Median microseconds of one CUDA-graph replay of ``step()``, each replay waited for.

    ``step`` runs ``warmup`` times on a side stream (where a compiled function compiles
    and the fused op creates its workspace, outside capture), is captured once, then
    ``before_replays`` runs (e.g. ``dist.barrier`` to line the ranks up) and the graph is
    replayed ``replays`` times, the host synchronising on each replay's end event.
    """
    graph = _capture(step, warmup=warmup, ops_per_graph=1, capture_error_mode="global")
    if before_replays is not None:
        before_replays()
    return statistics.median(_waited_us(graph.replay) for _ in range(replays))


def call_median_us(
    step: Callable[[], object],
    *,
    calls: int = 100,
    warmup: int = 3,
    before_call: Callable[[], object] | None = None,
) -> float:
    """Median microseconds of one ``step()`` call, CUDA events around it, each waited for.

    ``step`` runs ``warmup`` times first (a compiled function with ``mode="reduce-overhead"``
    records its CUDA graphs in its first calls), then ``calls`` times, ``before_call`` (e.g.
    ``dist.barrier`` to line the ranks up) before each. The time covers the host's work in
    the call (guards, runtime wrappers, the graph's launch) and the device's.
    """
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        if before_call is not None:
            before_call()
        times.append(_waited_us(step))
    return statistics.median(times)


def _waited_us(run: Callable[[], object]) -> float:
    """Microseconds between CUDA events around ``run()``, the host waiting for the end."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3
