"""What a compile costs through passkit vs Inductor alone: cold and warm starts, side by side.

For each model (``--models``: the Llama-style module of the tests, ``tiny``, and a Hugging
Face Llama, ``hf-llama``), each world size (``--worlds``: 1, where the serving passes cannot
run; 2, a TP=2 world where the three fusion passes run) and each variant (Inductor alone;
passkit with no pass; passkit with the serving config, compiling each token range at its
first use, the default, or every range at the first call, ``upfront``), fresh processes compile the model with a dynamic token
dimension and call it at token counts that visit every range passkit plans.

Cold: an empty Inductor cache directory (one per variant). Warm: the same directory again
(FX-graph and AOTAutograd caches hit), ``--warm`` times. The variants alternate in every
round (cold round, then each warm round), so drift hits each alike; cells are medians
(``--repeats`` cold rounds, ``--repeats * --warm`` warm ones). Printed per cell:

* **start s**: from the moment the process asks for a compile (before ``import passkit``
  and the backend, then ``torch.compile``) to the first call's output: what a serving
  process waits for. ``torch.compile(backend="inductor")`` imports Inductor itself (Dynamo
  asks it for its config), a custom backend at its first compile: this column holds both.
* **first call s**: the first call alone (the column of earlier runs; it leaves out
  Inductor's import for ``backend="inductor"`` but not for passkit).
* **every size s**: the first call plus one call per further token count.

    python benchmarks/compile_bill.py                       # CPU: tiny + small HF Llama, worlds 1 2
    python benchmarks/compile_bill.py --device cuda --models hf-llama --worlds 1 --warm 3
    python benchmarks/compile_bill.py --smoke               # tiny, for the test suite

``--baseline-tree DIR``: a checkout of an earlier passkit (``git archive <commit> | tar -x -C
DIR``); each passkit variant also runs from it (``... [before]``), alternating with the
others, so before and after are measured side by side.

``--profile DIR``: after the timed rounds, one more warm run per variant under cProfile (the
start window: backend, ``torch.compile``, first call), written as pstats text summaries
(cumulative and own time) with the modules imported in that window, to ``DIR``.
Results: benchmarks/results/compile_bill_<device>.md/.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
SERVING = ["sequence_parallel", "async_tp", "allreduce_rmsnorm", "cleanup"]
VARIANTS = ("inductor", "passkit no pass", "passkit first_use", "passkit upfront")
DEFAULT_VARIANTS = ("inductor", "passkit no pass", "passkit first_use")
EARLIER_NAMES = {"upfront": "first_call"}
"""``compile_at`` values under their earlier names, for ``--baseline-tree`` checkouts."""


def passes_for(device: str) -> list[Any]:
    """The serving config; on CPU the fusion ops' reference / test-mode implementations,
    with allreduce_rmsnorm bounded as the world-2 H200 table bounds it."""
    if device == "cuda":
        return list(SERVING)
    return [
        "sequence_parallel",
        {"name": "async_tp", "implementation": "test_mode"},
        {"name": "allreduce_rmsnorm", "implementation": "reference", "max_tokens": 4096},
        "cleanup",
    ]


def hf_llama(hidden: int, layers: int, device: Any, dtype: Any) -> tuple[Any, int]:
    """A Hugging Face Llama with random weights: 8B-shaped at hidden 4096, else small (hidden
    ``hidden``, 64-wide heads, 2 KV heads, MLP 2x, vocabulary 1000), no KV cache."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden == 4096:
        shape = dict(intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)
    else:
        heads = max(hidden // 64, 2)
        shape = dict(
            intermediate_size=2 * hidden, num_attention_heads=heads, num_key_value_heads=2, vocab_size=1000
        )
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, max_position_embeddings=8192, **shape)
    with torch.device(device):  # initialized where it runs: seconds on a GPU, a minute on its host
        model = LlamaForCausalLM(cfg).to(dtype=dtype).eval()
    model.config.use_cache = False
    return (lambda ids: model(input_ids=ids, use_cache=False).logits), cfg.vocab_size


def build_model(args: argparse.Namespace, rank: int, world: int) -> tuple[Any, int, Any]:
    import torch

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    if args.model == "hf-llama":
        if world > 1:
            raise SystemExit("--models hf-llama runs at world size 1 only (it is not sharded)")
        model, vocab = hf_llama(args.hidden, args.layers, device, dtype)
        return model, vocab, device
    from passkit_fusion.model import LlamaConfig as TinyConfig
    from passkit_fusion.model import TinyLlama, shard_functional

    cfg = TinyConfig(
        hidden=args.hidden, layers=args.layers, intermediate=2 * args.hidden, heads=4, kv_heads=2
    )
    model = TinyLlama(cfg).to(device=device, dtype=dtype).eval()
    if world > 1:
        import torch.distributed as dist

        model = shard_functional(model, dist.group.WORLD, rank, world)
    return model, cfg.vocab, device


BEFORE = " [before]"


def _backend(variant: str, device: str) -> Any:
    """The variant's backend; for passkit, ``import passkit`` happens here (timed)."""
    before = variant.endswith(BEFORE)
    variant = variant.removesuffix(BEFORE)
    if variant == "inductor":
        return "inductor"
    import passkit

    if variant == "passkit no pass":
        return passkit.backend(passes=[])
    compile_at = variant.split()[1]
    if before:
        compile_at = EARLIER_NAMES.get(compile_at, compile_at)
    return passkit.backend(passes=passes_for(device), compile_at=compile_at)


def measure(rank: int, world: int, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One variant's compile in this process: the start (backend + torch.compile + first
    call), then each further size."""
    import torch
    from torch._dynamo.utils import counters

    model, vocab, device = build_model(args, rank, world)
    sizes = [int(t) for t in args.tokens]
    inputs = []
    for t in sizes:
        ids = torch.randint(0, vocab, (1, t), device=device)
        torch._dynamo.mark_dynamic(ids, 1)
        inputs.append(ids)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    profiler = _Profiler(args.profile_to if rank == 0 else None)
    times = []
    with torch.no_grad():
        sync()
        with profiler, _GcClock() as gc_clock:
            start, cpu_start = time.perf_counter(), time.process_time()
            backend = _backend(variant, args.device)
            backend_at = time.perf_counter()
            compiled = torch.compile(model, backend=backend)
            compiled_at = time.perf_counter()
            compiled(inputs[0])
            sync()
            end, cpu_end = time.perf_counter(), time.process_time()
        times.append(end - compiled_at)
        for ids in inputs[1:]:
            sync()
            t0 = time.perf_counter()
            compiled(ids)
            sync()
            times.append(time.perf_counter() - t0)
    out: dict[str, Any] = {
        "start_s": end - start,
        "cpu_s": cpu_end - cpu_start,
        "backend_s": backend_at - start,
        "first_call_s": times[0],
        "all_sizes_s": (compiled_at - start) + sum(times),
        "gc_s": gc_clock.seconds,
        "gc_full": gc_clock.full,
        "sizes": sizes,
        "cache": {
            "fxgraph_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
            "fxgraph_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
            "autograd_hit": int(counters["aot_autograd"]["autograd_cache_hit"]),
        },
    }
    if variant == "inductor" or variant.startswith("passkit no pass"):
        out["compiles"] = int(counters["stats"]["unique_graphs"]) or 1
    else:
        out["compiles"] = len(backend.reports)
        out["ranges"] = sorted({r.token_range or "every size" for r in backend.reports})
        out["passkit_compile_s"] = [r.compile_s for r in backend.reports]
    profiler.write(f"{variant}: start {out['start_s']:.2f} s, first call {out['first_call_s']:.2f} s")
    return out


class _GcClock:
    """Seconds the garbage collector ran in the start window, and its full (generation 2)
    collections: a process holding torch's millions of objects pays ~0.1-0.2 s per full
    collection, and a few more allocations can bring one forward into the window."""

    def __init__(self) -> None:
        self.seconds, self.full, self._t0 = 0.0, 0, 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.full += info.get("generation") == 2

    def __enter__(self) -> _GcClock:
        import gc

        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        import gc

        gc.callbacks.remove(self._callback)


class _Profiler:
    """cProfile of the start window plus the modules imported in it (``--profile``)."""

    def __init__(self, path: str | None):
        self.path = path
        self.profile: Any = None
        self.before: set[str] = set()
        self.new: list[str] = []

    def __enter__(self) -> _Profiler:
        if self.path:
            import cProfile

            self.before = set(sys.modules)
            self.profile = cProfile.Profile()
            self.profile.enable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.profile is not None:
            self.profile.disable()
            self.new = sorted(set(sys.modules) - self.before)

    def write(self, title: str) -> None:
        if self.profile is None or self.path is None:
            return
        import io
        import pstats

        text = io.StringIO()
        text.write(f"{title}\n\n== by cumulative time ==\n")
        stats = pstats.Stats(self.profile, stream=text)
        stats.sort_stats("cumulative").print_stats(70)
        text.write("\n== by own time ==\n")
        stats.sort_stats("tottime").print_stats(40)
        tops: dict[str, int] = {}
        for name in self.new:
            top = ".".join(name.split(".")[:2])
            tops[top] = tops.get(top, 0) + 1
        text.write(f"\n== {len(self.new)} modules imported in the window, by package ==\n")
        text.writelines(f"{n:5d} {top}\n" for top, n in sorted(tops.items(), key=lambda kv: -kv[1]))
        text.write("\n== every module imported in the window ==\n" + "\n".join(self.new) + "\n")
        Path(self.path).write_text(text.getvalue())


def _child(args: argparse.Namespace) -> None:
    """Run one variant (in a fresh process); print its JSON result on the last line."""
    world, variant = args.world, args.variant
    if world == 1:
        result = measure(0, 1, variant, args)
    else:
        from passkit_testing import gloo_world, nccl_world

        run = nccl_world if args.device == "cuda" else gloo_world
        result = run(measure, world, args=(variant, args), timeout=args.limit)[0]
    print(json.dumps(result))


def run_variant(
    args: argparse.Namespace, model: str, world: int, variant: str, cache_dir: str, profile_to: str = ""
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--world",
        str(world),
        "--variant",
        variant,
        "--device",
        args.device,
        "--model",
        model,
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.hidden),
        "--limit",
        str(args.limit),
        "--tokens",
        *map(str, args.tokens),
    ]
    if profile_to:
        cmd += ["--profile-to", profile_to]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "PYTHONUNBUFFERED": "1"}
    if variant.endswith(BEFORE):
        tree = args.baseline_tree.resolve()
        paths = [tree, tree / "passkit_fusion/src", tree / "passkit_testing/src"]
        paths.append(tree / "examples/passkit-example-plugin/src")
        env["PYTHONPATH"] = os.pathsep.join(map(str, paths))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.limit + 60)
    if done.returncode != 0:
        raise SystemExit(f"{variant} ({model}, world {world}) failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def byte_compile(baseline_tree: Path | None) -> str:
    """Byte-compile passkit's packages (and the baseline tree's) before timing, as installing
    a wheel does: torch's modules come byte-compiled, and an editable checkout in a process
    that cannot write ``__pycache__`` (``PYTHONDONTWRITEBYTECODE``) would compile passkit's
    source at every start, about 50 ms that a user's install never pays."""
    import compileall
    import importlib.util

    dirs = []
    for name in ("passkit", "passkit_fusion", "passkit_testing"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs += list(spec.submodule_search_locations)
    if baseline_tree is not None:
        dirs.append(str(baseline_tree))
    ok = all(compileall.compile_dir(d, quiet=1) for d in dirs)
    return f"passkit byte-compiled before the runs ({len(dirs)} trees{'' if ok else ', with errors'})"


def _rounds(args: argparse.Namespace, model: str, world: int, variants: list[str]) -> list[dict[str, Any]]:
    """Every cold and warm run of one model and world size, variants alternating."""
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {
        (v, c): [] for v in variants for c in ("cold", "warm")
    }
    label = f"[{model}, world {world}]"
    with tempfile.TemporaryDirectory(prefix="passkit-compile-bill-") as root:
        for repeat in range(args.repeats):
            caches = {v: os.path.join(root, f"r{repeat}-{i}") for i, v in enumerate(variants)}
            for round_ in range(1 + args.warm):
                temperature = "cold" if round_ == 0 else "warm"
                order = variants if (repeat + round_) % 2 == 0 else list(reversed(variants))
                for variant in order:
                    print(f"{label} {variant}: {temperature} ...", file=sys.stderr, flush=True)
                    result = run_variant(args, model, world, variant, caches[variant])
                    if temperature == "warm" and result["cache"]["fxgraph_miss"]:
                        print(f"{label} {variant}: warm run missed the FX graph cache", file=sys.stderr)
                    runs[(variant, temperature)].append(result)
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
            for variant in variants:
                name = f"{model}_w{world}_{variant.replace(' ', '_')}_warm.txt"
                print(f"{label} {variant}: profiled warm run -> {name}", file=sys.stderr, flush=True)
                run_variant(args, model, world, variant, caches[variant], str(args.profile / name))
    rows = []
    for (variant, temperature), results in runs.items():
        if not results:  # --warm 0
            continue
        rows.append(
            {
                "model": model,
                "world": world,
                "cache": temperature,
                "variant": variant,
                "compiles": results[0]["compiles"],
                "ranges": results[0].get("ranges"),
                "start_s": statistics.median(r["start_s"] for r in results),
                "best_start_s": min(r["start_s"] for r in results),
                "first_call_s": statistics.median(r["first_call_s"] for r in results),
                "all_sizes_s": statistics.median(r["all_sizes_s"] for r in results),
                "samples_start_s": [round(r["start_s"], 3) for r in results],
                "gc_s": statistics.median(r.get("gc_s", 0.0) for r in results),
                "gc_full": statistics.median(r.get("gc_full", 0) for r in results),
                "samples": len(results),
            }
        )
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | world | cache | variant | compiles | start s (samples) | vs Inductor "
        "| best start s | vs Inductor | first call s | vs Inductor | every size s | vs Inductor "
        "| GC s (full collections) in the start |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for row in rows:
        base = next(
            r
            for r in rows
            if (r["model"], r["world"], r["cache"]) == (row["model"], row["world"], row["cache"])
            and r["variant"] == "inductor"
        )
        samples = ", ".join(f"{s:.2f}" for s in row["samples_start_s"])
        lines.append(
            f"| {row['model']} | {row['world']} | {row['cache']} | {row['variant']} | {row['compiles']} | "
            f"{row['start_s']:.2f} ({samples}) | {row['start_s'] / base['start_s']:.2f}x | "
            f"{row['best_start_s']:.2f} | {row['best_start_s'] / base['best_start_s']:.2f}x | "
            f"{row['first_call_s']:.2f} | {row['first_call_s'] / base['first_call_s']:.2f}x | "
            f"{row['all_sizes_s']:.2f} | {row['all_sizes_s'] / base['all_sizes_s']:.2f}x | "
            f"{row.get('gc_s', 0.0):.2f} ({row.get('gc_full', 0):g}) |"
        )
    return "\n".join(lines)


def _load() -> str:
    try:
        return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average unknown"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--models", nargs="+", choices=["tiny", "hf-llama"], default=["tiny", "hf-llama"])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=None, help="default: 4096 on cuda, 256 on cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 7, 2048, 2049, 4098, 4099])
    parser.add_argument("--repeats", type=int, default=1, help="cold runs per cell (each with its warm runs)")
    parser.add_argument("--warm", type=int, default=3, help="warm runs per cold run")
    parser.add_argument(
        "--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS, metavar="VARIANT"
    )
    parser.add_argument("--limit", type=float, default=900.0, help="seconds per variant run")
    parser.add_argument("--profile", type=Path, default=None, help="write profiles of a warm start here")
    parser.add_argument(
        "--baseline-tree", type=Path, default=None, help="also run passkit from this checkout"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one layer (for tests)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="inductor", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="tiny", help=argparse.SUPPRESS)
    parser.add_argument("--profile-to", dest="profile_to", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hidden is None:
        args.hidden = 4096 if args.device == "cuda" else 256
    if args.child:
        _child(args)
        return
    if args.smoke:
        args.layers, args.hidden, args.tokens, args.warm = 1, 64, [16, 7, 2048, 2049], 1
    variants = [v for v in VARIANTS if v in args.variants]
    if args.baseline_tree:
        variants += [v + BEFORE for v in variants if v != "inductor"]
    compiled = byte_compile(args.baseline_tree)
    load_before = _load()
    rows: list[dict[str, Any]] = []
    for model in args.models:
        for world in args.worlds:
            if model == "hf-llama" and world > 1:
                print(f"[{model}] world {world} skipped: the HF Llama is not sharded", file=sys.stderr)
                continue
            rows += _rounds(args, model, world, variants)
    rows.sort(
        key=lambda r: (
            args.models.index(r["model"]),
            r["world"],
            r["cache"] != "cold",
            VARIANTS.index(r["variant"].removesuffix(BEFORE)),
            r["variant"].endswith(BEFORE),
        )
    )
    table = render(rows)
    import platform

    import torch

    machine = f"{platform.node()} ({os.cpu_count()} CPUs), torch {torch.__version__}, device {args.device}"
    if args.device == "cuda":
        machine += f" ({torch.cuda.get_device_name()})"
    title = (
        f"compile bill: models {args.models}, {args.layers} layers, hidden {args.hidden}, tokens {args.tokens}; "
        f"{args.repeats} cold + {args.repeats * args.warm} warm runs per cell, variants alternating; "
        f"{machine}; {load_before} before, {_load()} after; {compiled}"
    )
    print(title)
    print(table)
    for row in rows:
        if row["ranges"] and row["cache"] == "cold":
            print(f"{row['model']} world {row['world']} {row['variant']}: ranges {row['ranges']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(f"{title}\n\n{table}\n")
        args.out.with_suffix(".json").write_text(json.dumps({"title": title, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
