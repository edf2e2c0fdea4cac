"""The cost of the checks passkit runs after every pass, on a real post-grad graph
of about 1,700 nodes (a decoder-like stack, as Inductor hands it to its custom passes).

Per pass, always (``verify`` off): the measured change (:func:`passkit._pipeline.graph_diff.measure`,
against the fingerprint of the pipeline's baseline, :mod:`passkit._pipeline.baseline`); when the graph
changed, the op-schema check of the changed nodes and the output/boundary check
(:func:`passkit._pipeline.output_check.check`), which re-runs the changed nodes on fake tensors. Three
passes: one that changes nothing, one that changes a constant of one node, one that rewrites
the node producing the output.

The baseline (a snapshot of the graph, its fingerprint and output signatures) is taken once
and kept while passes change nothing; after a pass that changed the graph, the next pass that
runs needs a new one: that cost is its own column (the snapshot is most of it).

Writes ``benchmarks/results/output_check_cpu.{json,md}``. Usage:
    python benchmarks/output_check.py [--layers 24] [--repeats 200]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RESULTS = HERE / "results"

from decoder import decoder_stack  # noqa: E402

import passkit  # noqa: E402
from passkit._pipeline import graph_diff, output_check, schema_check  # noqa: E402
from passkit.graph_utils import restore, snapshot  # noqa: E402

aten = torch.ops.aten
BEST = "--best" in sys.argv


def capture(layers: int) -> torch.fx.GraphModule:
    got: list[torch.fx.GraphModule] = []

    class Capture(passkit.GraphPass):
        name = "capture_graph"

        def run(self, gm, ctx):
            got.append(gm)
            return passkit.PassResult.unchanged()

    class Plugin:
        @passkit.hookimpl
        def passkit_register_passes(self):
            return [Capture]

    import torch._functorch.config
    import torch._inductor.config

    passkit.register(Plugin(), name="capture")
    model, x = decoder_stack(layers)
    with (
        torch.no_grad(),
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        torch.compile(model, backend=passkit.backend(passes=["capture_graph"]))(x)
    return got[-1]


def nothing(gm: torch.fx.GraphModule) -> None:
    pass


def one_constant(gm: torch.fx.GraphModule) -> None:
    """Changes a constant of one node in the middle of the graph (its shape stays)."""
    nodes = [
        n for n in gm.graph.nodes if n.op == "call_function" and any(isinstance(a, float) for a in n.args)
    ]
    node = nodes[len(nodes) // 2]
    i = next(i for i, a in enumerate(node.args) if isinstance(a, float))
    node.update_arg(i, node.args[i] + 1.0)


def output_producer(gm: torch.fx.GraphModule) -> None:
    """Puts ``clone`` between the output and the node producing it (a new node at the output)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    first = next(a for a in out.all_input_nodes)
    with gm.graph.inserting_before(out):
        clone = gm.graph.call_function(aten.clone.default, (first,))
    clone.meta = dict(first.meta)
    out.replace_input_with(first, clone)


def _median_ms(fn: Any, repeats: int) -> float:
    """Time of ``fn()`` in ms: the median over ``repeats`` batches of 10 calls (the minimum
    with ``--best``, for a loaded machine), the garbage collector paused (its pauses belong
    to whatever allocated before)."""
    gc.collect()
    gc.disable()
    try:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(10):
                fn()
            times.append((time.perf_counter() - t0) / 10)
    finally:
        gc.enable()
    return (min(times) if BEST else statistics.median(times)) * 1e3


def measure(gm: torch.fx.GraphModule, rewrite: Any, repeats: int) -> dict[str, float]:
    graph = gm.graph
    out: dict[str, float] = {}
    out["snapshot"] = _median_ms(lambda: snapshot(graph), max(3, repeats // 10))
    out["fingerprint"] = _median_ms(lambda: graph_diff.fingerprint(graph), repeats)
    out["outputs"] = _median_ms(lambda: output_check.outputs(graph), repeats)
    saved, before, outs = snapshot(graph), graph_diff.fingerprint(graph), output_check.outputs(graph)
    out["baseline"] = out["snapshot"] + out["fingerprint"] + out["outputs"]
    rewrite(gm)
    change = graph_diff.measure(graph, before, saved)
    out["diff"] = _median_ms(lambda: graph_diff.measure(graph, before, saved), repeats)
    if change.modified:
        out["schema"] = _median_ms(lambda: schema_check.check(graph, saved, "bench", change.changed), repeats)
        out["output_check"] = _median_ms(lambda: output_check.check(graph, outs, change, "bench"), repeats)
        restore(graph, saved)
    else:
        out["schema"] = out["output_check"] = 0.0
    out["checks_total"] = out["diff"] + out["schema"] + out["output_check"]
    out["next_baseline"] = out["baseline"] if change.modified else 0.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default="output_check_cpu")
    parser.add_argument("--best", action="store_true", help="the minimum of the batches, not the median")
    args = parser.parse_args()
    torch.manual_seed(0)
    gm = capture(args.layers)
    nodes = len(gm.graph.nodes)
    rows = {
        name: measure(gm, fn, args.repeats)
        for name, fn in [
            ("unchanged", nothing),
            ("one constant changed", one_constant),
            ("output producer rewritten", output_producer),
        ]
    }
    result = {
        "nodes": nodes,
        "layers": args.layers,
        "statistic": "min" if BEST else "median",
        "repeats": args.repeats,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
        "ms_median": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# Checks after each pass: {nodes}-node post-grad graph ({args.layers} layers), "
        f"{'minimum' if BEST else 'median'} of {args.repeats} batches of 10 calls, garbage "
        "collector paused (ms), "
        f"torch {torch.__version__}, CPU (`python benchmarks/output_check.py --layers {args.layers}`)",
        "",
        "| pass | change measured | op schemas | outputs + boundary | checks total "
        "| new baseline before the next pass (snapshot + fingerprint + outputs) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        baseline = (
            f"{r['next_baseline']:.3f} ({r['snapshot']:.3f} + {r['fingerprint']:.3f} + {r['outputs']:.3f})"
            if r["next_baseline"]
            else "none: the baseline is kept"
        )
        lines.append(
            f"| {name} | {r['diff']:.3f} | {r['schema']:.3f} | {r['output_check']:.3f} | "
            f"**{r['checks_total']:.3f}** | {baseline} |"
        )
    lines.append("")
    lines.append(
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} when written (a loaded "
        "machine inflates every column alike)."
    )
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
