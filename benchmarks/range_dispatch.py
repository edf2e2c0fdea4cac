"""Cost of token-range dispatch per call, side by side with a plain compiled call.

1. The dispatcher alone: ``passkit._compile.specialize.Dispatcher`` in front of a function that does
   nothing, vs calling that function directly (the difference is what dispatch adds).
2. A small compiled module (CPU, Inductor): one compile with no token ranges vs the same
   module with a range-restricted pass (two specializations, dispatched per call).
3. Extra compile time: the module compiled once vs compiled per range.

Medians of many timed batches. Run: python benchmarks/range_dispatch.py [--calls 20000]
Writes range_dispatch.{md,json} to $OUT (when set) and benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

import passkit
from passkit._compile.specialize import Dispatcher, Plan, TokenDimension
from passkit._pipeline.build import Pipeline
from passkit._plugins.registry import get_plugins
from passkit.config import load_config
from passkit.tokens import plan_specializations

HERE = Path(__file__).resolve().parent


def per_call_us(fn, args, calls: int, batches: int = 15) -> float:
    """Median over ``batches`` of the mean time of ``calls`` calls, in microseconds."""
    fn(*args)
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def dispatcher_alone(calls: int) -> dict[str, float]:
    def nothing(*args):
        return None

    specs, rules = plan_specializations(
        {"small": passkit.TokenConstraint(max_tokens=16), "even": passkit.TokenConstraint(multiple_of=2)},
        [256, 2048],
    )
    dispatcher = Dispatcher(
        Plan(specs, rules, TokenDimension(0, None, "")), [nothing] * len(specs), lambda: nothing
    )
    args = (1000, None)  # a token count Dynamo passes as an argument, and a tensor
    return {
        "direct_us": per_call_us(nothing, args, calls),
        "dispatched_us": per_call_us(dispatcher, args, calls),
        "ranges": len(rules),
        "specializations": len(specs),
    }


class SmallOnly(passkit.GraphPass):
    """Declares it applies up to 16 tokens; rewrites nothing (isolates dispatch cost)."""

    name = "small_only"
    tokens = passkit.TokenConstraint(max_tokens=16)

    def run(self, gm, ctx):
        return passkit.PassResult.unchanged()


class Noop(passkit.GraphPass):
    name = "noop"

    def run(self, gm, ctx):
        return passkit.PassResult.unchanged()


def compiled_module(calls: int) -> dict[str, float]:
    def model(x):
        return torch.relu(x) * 2 + 1

    torch.compile(lambda x: x.sin() + 1, dynamic=True)(torch.randn(4, 4))  # Inductor's own warm-up
    out: dict[str, float] = {}
    for label, pass_ in (("one_compile", Noop()), ("ranges", SmallOnly())):
        torch._dynamo.reset()
        backend = passkit.Backend(pipeline=Pipeline(load_config({}), get_plugins(), [pass_]))
        fn = torch.compile(model, backend=backend, dynamic=True)
        x = torch.randn(64, 8)
        start = time.perf_counter()
        fn(x)
        out[f"{label}_compile_s"] = time.perf_counter() - start
        out[f"{label}_compiles"] = len(backend.reports)
        out[f"{label}_fn"] = fn  # type: ignore[assignment]
    x = torch.randn(64, 8)
    for _ in range(2):  # alternate, to even out drift
        for label in ("one_compile", "ranges"):
            out.setdefault(f"{label}_runs", []).append(per_call_us(out[f"{label}_fn"], (x,), calls // 10))  # type: ignore[attr-defined]
    for label in ("one_compile", "ranges"):
        out[f"{label}_us"] = min(out.pop(f"{label}_runs"))  # type: ignore[type-var]
        del out[f"{label}_fn"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False):
        alone = dispatcher_alone(args.calls)
        module = compiled_module(args.calls)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"
    md = "\n".join(
        [
            f"# Token-range dispatch cost ({machine})",
            "",
            "| measure | plain | with ranges | difference |",
            "|---|---|---|---|",
            f"| dispatcher alone, per call ({alone['ranges']} ranges, {alone['specializations']} specializations) "
            f"| {alone['direct_us']:.3f} us | {alone['dispatched_us']:.3f} us "
            f"| {alone['dispatched_us'] - alone['direct_us']:.3f} us |",
            f"| compiled module, per call (CPU) | {module['one_compile_us']:.2f} us | {module['ranges_us']:.2f} us "
            f"| {module['ranges_us'] - module['one_compile_us']:.2f} us |",
            f"| first call (compile), {module['one_compile_compiles']} vs {module['ranges_compiles']} compiles "
            f"| {module['one_compile_compile_s']:.2f} s | {module['ranges_compile_s']:.2f} s "
            f"| {module['ranges_compile_s'] - module['one_compile_compile_s']:.2f} s |",
            "",
        ]
    )
    print(md)
    for folder in filter(None, [os.environ.get("OUT"), str(HERE / "results")]):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "range_dispatch.md").write_text(md)
        (Path(folder) / "range_dispatch.json").write_text(
            json.dumps({"alone": alone, "module": module, "machine": machine}, indent=1)
        )


if __name__ == "__main__":
    main()
