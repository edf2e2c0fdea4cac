"""Where the microseconds go: the kernel timelines of ``hf_tp.py``'s variants, per rank, and
each variant's excess over the ceiling (every all-reduce removed) split by cause.

The same model, plan and variants as ``hf_tp.py`` (HF Llama, 8B-shaped layers, DTensor TP,
tokens dynamic), compiled in one process per rank. For every variant and token count:

* **timings**, variants interleaved round by round: ``aligned`` (the ranks meet at a barrier
  before each forward, as ``hf_tp.py`` times them), ``pipelined`` (``--chain`` forwards
  back to back, no barrier: a rank's late start is absorbed once per chain, as in a server
  whose GPU queue runs ahead of its host), the host's own microseconds per call (from the
  call to its return, nothing synchronised), and the ranks' skew after the barrier (the
  spread of their clocks as each leaves it: one host, one monotonic clock);
* **a profile** (torch.profiler, CUDA activities; ``--profile-forwards`` aligned forwards):
  on each rank, per forward, the GPU's first-kernel latency from the call, its busy time
  (the union of kernel intervals) and idle time inside the span, and the kernels' time by
  category (GEMM, attention, Triton, collective, copy, other), with every collective
  kernel's in-situ duration in order (the first site absorbs the ranks' skew; a site's
  duration above the op's own cost is waiting).

The attribution table splits ``variant - ceiling`` (aligned, median) into: the collectives'
own cost (their fastest in-situ site times the number of sites), waiting inside the
collectives (the rest of their in-situ time), other kernels' extra time (lost or split
fusions, copies), and the remainder (host-side launch and idle gaps). Rank 0 writes
``OUT.md`` and ``OUT.json`` (every rank's summaries); ``--trace-dir`` keeps the raw
Chrome traces (large).

    python3 benchmarks/hf_tp_profile.py --world 2 --out benchmarks/results/hf_tp_profile_h200x2_w2
    python3 benchmarks/hf_tp_profile.py --smoke          # CPU, gloo, a tiny Llama (plumbing only)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_tp

MODES = {
    "ro": ["inductor reduce-overhead", "passkit reduce-overhead", "ceiling reduce-overhead"],
    "default": ["inductor", "passkit", "ceiling"],
    "graph": ["inductor graph", "passkit graph", "ceiling graph"],
    "ro-skip": [
        "inductor reduce-overhead skip-guards",
        "passkit reduce-overhead skip-guards",
        "ceiling reduce-overhead skip-guards",
    ],
}
"""``--modes``: the three variants compared in each way of running (Inductor, passkit's
serving config, the ceiling): ``ro`` torch.compile's ``mode="reduce-overhead"`` (Inductor's
CUDA-graph trees), ``default`` its default mode, ``graph`` the default mode captured whole
into one CUDA graph per token count by the caller and replayed, as serving stacks run a
decode step (vLLM's and SGLang's full-graph capture): no Dynamo guards, no runtime wrappers,
no per-call input copies but the ids; ``ro-skip`` the ``ro`` variants called under
``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` once warm (Dynamo evaluates only
the guards that tell its cache entries apart: the host work a serving loop saves by calling
the compiled code without Dynamo's checks, as vLLM's dispatcher does)."""
GRAPH = " graph"
SKIP = " skip-guards"
"""The suffix of a variant called with Dynamo's guard evaluation skipped once warm."""
GRAPH_EXTRA = {
    "overlap-graph": "passkit overlap graph",
    "overlap4-graph": "passkit overlap4 graph",
    "overlap-nccl-graph": "passkit overlap nccl graph",
    "arn-graph": "passkit allreduce_rmsnorm graph",
}
"""``--variants`` names of captured variants beyond ``hf_tp.py``'s extras."""
"""The suffix of a variant captured whole (``"passkit graph"``: ``hf_tp.py``'s ``passkit``)."""

CATEGORIES = ("collective", "gemm", "attention", "triton", "copy", "other")
_COLLECTIVE = (
    "nccl",
    "allreduce",
    "all_reduce",
    "lamport",
    "reduce_scatter",
    "reducescatter",
    "all_gather",
    "allgather",
    "one_shot",
    "two_shot",
    "oneshot",
    "twoshot",
    "multimem",
    "symm",
    "ar_fusion",
)
_GEMM = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "wgmma", "gemv", "splitk")
_ATTENTION = ("flash", "fmha", "attention", "sdpa", "softmax")


def category(name: str, cat: str) -> str:
    """The kernel's category from its name (and the trace's own category for copies)."""
    low = name.lower()
    if cat in ("gpu_memcpy", "gpu_memset") or "memcpy" in low or "memset" in low:
        return "copy"
    if any(k in low for k in _COLLECTIVE):
        return "collective"
    if low.startswith("triton") or "triton_" in low:
        return "triton"
    if any(k in low for k in _ATTENTION):
        return "attention"
    if any(k in low for k in _GEMM):
        return "gemm"
    return "other"


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one interval."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize_trace(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Per forward (``pk_fwd`` annotations), what the GPU did in the window of its call."""
    events = trace.get("traceEvents", [])
    windows = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0.0))
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") == "pk_fwd"
    )
    launches = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0.0))
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") == "pk_launch"
    )
    kernels = sorted(
        (e["ts"], e.get("dur", 0.0), e.get("name", ""), e.get("cat", ""))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    out = []
    for w0, w1 in windows:
        inside = [k for k in kernels if w0 <= k[0] <= w1]
        launch = next((b - a for a, b in launches if w0 <= a <= w1), None)
        row: dict[str, Any] = {
            "window_us": w1 - w0,
            "host_launch_us": launch,
            "kernels": len(inside),
            "by_category_us": {c: 0.0 for c in CATEGORIES},
            "by_category_n": {c: 0 for c in CATEGORIES},
            "collectives_us": [],
            "collective_names": sorted({k[2][:80] for k in inside if category(k[2], k[3]) == "collective"}),
        }
        if inside:
            first = inside[0][0]
            last = max(k[0] + k[1] for k in inside)
            busy = union_us([(k[0], k[0] + k[1]) for k in inside])
            row.update(
                first_kernel_after_us=first - w0,
                span_us=last - first,
                busy_us=busy,
                idle_us=last - first - busy,
            )
            for _ts, dur, name, cat in inside:
                c = category(name, cat)
                row["by_category_us"][c] += dur
                row["by_category_n"][c] += 1
                if c == "collective":
                    row["collectives_us"].append(dur)
        out.append(row)
    return out


def median_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians of per-forward summaries (the first forward of a window left in)."""
    if not rows:
        return {}

    def med(key: str) -> float | None:
        """The median of ``key`` over the rows; None when a row has no value."""
        values = [r.get(key) for r in rows]
        return None if any(v is None for v in values) else statistics.median(values)

    n_sites = statistics.median(len(r["collectives_us"]) for r in rows)
    sites = [r["collectives_us"] for r in rows if len(r["collectives_us"]) == n_sites]
    per_site = [statistics.median(s[i] for s in sites) for i in range(int(n_sites))] if sites else []
    return {
        "forwards": len(rows),
        "window_us": med("window_us"),
        "host_launch_us": med("host_launch_us"),
        "first_kernel_after_us": med("first_kernel_after_us"),
        "span_us": med("span_us"),
        "busy_us": med("busy_us"),
        "idle_us": med("idle_us"),
        "kernels": med("kernels"),
        "by_category_us": {c: statistics.median(r["by_category_us"][c] for r in rows) for c in CATEGORIES},
        "by_category_n": {c: statistics.median(r["by_category_n"][c] for r in rows) for c in CATEGORIES},
        "collective_sites_us": per_site,
        "collective_names": sorted({n for r in rows for n in r["collective_names"]}),
    }


def time_variants(
    args: argparse.Namespace, compiled: dict[str, Any], inputs: dict[int, torch.Tensor], device: torch.device
) -> dict[str, dict[int, dict[str, Any]]]:
    """Aligned and pipelined timings, host time per call, and the barrier skew, variants
    interleaved round by round (the order alternating)."""
    cuda = device.type == "cuda"
    res: dict[str, dict[int, dict[str, list[float]]]] = {
        n: {t: {"aligned_ms": [], "pipelined_ms": [], "host_us": [], "leave_ns": []} for t in inputs}
        for n in compiled
    }

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for r in range(args.rounds):
        order = list(compiled) if r % 2 == 0 else list(reversed(compiled))
        for t, ids in inputs.items():
            for name in order:
                fn, cell = compiled[name], res[name][t]
                for _ in range(args.iters):  # aligned: as hf_tp.py times
                    dist.barrier()
                    cell["leave_ns"].append(time.monotonic_ns())
                    if cuda:
                        start, end = (
                            torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True),
                        )
                        start.record()
                        h0 = time.perf_counter()
                        fn(ids)
                        cell["host_us"].append((time.perf_counter() - h0) * 1e6)
                        end.record()
                        end.synchronize()
                        cell["aligned_ms"].append(start.elapsed_time(end))
                    else:
                        h0 = time.perf_counter()
                        fn(ids)
                        cell["host_us"].append((time.perf_counter() - h0) * 1e6)
                        cell["aligned_ms"].append(cell["host_us"][-1] / 1e3)
                dist.barrier()
                sync()
                t0 = time.perf_counter()  # pipelined: a chain of forwards, one wait at the end
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                for _ in range(args.chain):
                    fn(ids)
                if cuda:
                    end.record()
                    end.synchronize()
                    cell["pipelined_ms"].append(start.elapsed_time(end) / args.chain)
                else:
                    cell["pipelined_ms"].append((time.perf_counter() - t0) * 1e3 / args.chain)
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for name, per in res.items():
        out[name] = {}
        for t, cell in per.items():
            out[name][t] = {
                "aligned_ms": statistics.median(cell["aligned_ms"]),
                "pipelined_ms": statistics.median(cell["pipelined_ms"]),
                "host_us": statistics.median(cell["host_us"]),
                "leave_ns": cell["leave_ns"],
            }
    return out


def profile_variants(
    args: argparse.Namespace,
    compiled: dict[str, Any],
    inputs: dict[int, torch.Tensor],
    device: torch.device,
    rank: int,
) -> dict[str, dict[int, dict[str, Any]]]:
    """A profile per variant and token count: ``--profile-forwards`` aligned forwards, each
    summarised from the Chrome trace (kept under ``--trace-dir`` when given)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for name, fn in compiled.items():
        out[name] = {}
        for t, ids in inputs.items():
            for _ in range(2):  # the profiler's own start-up kept out of the window
                fn(ids)
            dist.barrier()
            with profile(activities=activities) as prof:
                for _ in range(args.profile_forwards):
                    dist.barrier()
                    with record_function("pk_fwd"):
                        with record_function("pk_launch"):
                            fn(ids)
                        if cuda:
                            torch.cuda.synchronize()
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "trace.json"
                prof.export_chrome_trace(str(path))
                trace = json.loads(path.read_text())
                if args.trace_dir and t in args.trace_tokens:
                    import gzip

                    args.trace_dir.mkdir(parents=True, exist_ok=True)
                    slug = name.replace(" ", "_").replace("-", "")
                    with gzip.open(args.trace_dir / f"{slug}_t{t}_r{rank}.json.gz", "wt") as f:
                        json.dump(trace, f)
            rows = summarize_trace(trace)
            out[name][t] = {"median": median_summary(rows), "forwards": rows}
    return out


def capture_whole(fn: Any, inputs: dict[int, torch.Tensor]) -> tuple[Any, dict[int, str]]:
    """``fn`` captured into one CUDA graph per token count (after a warm-up on a side
    stream), and a function that copies the ids into the graph's input and replays it. A
    count whose capture fails runs ``fn`` itself; its error is returned by count."""
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, Any]] = {}
    failed: dict[int, str] = {}
    for t, ids in inputs.items():
        static = ids.clone()
        if t > 1:  # the compiled entry's dynamic token dimension, as for the ids themselves
            torch._dynamo.mark_dynamic(static, 1)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn(static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn(static)
            graphs[t] = (graph, static, out)
        except Exception as e:
            failed[t] = f"{type(e).__name__}: {e}"[:300]
            torch.cuda.synchronize()

    def replay(ids: torch.Tensor) -> Any:
        entry = graphs.get(ids.shape[1])
        if entry is None:
            return fn(ids)
        graph, static, out = entry
        static.copy_(ids)
        graph.replay()
        return out

    return replay, failed


def skipping_guards(fn: Any) -> Any:
    """``fn`` called under ``set_stance(skip_guard_eval_unsafe=True)``: Dynamo runs only the
    guards that tell its cache entries apart (safe once every entry the calls need exists and
    the inputs keep their types, devices and dtypes, as a serving loop's do)."""

    def call(ids: torch.Tensor) -> Any:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return fn(ids)

    return call


def compile_all(
    rank: int, args: argparse.Namespace, model: Any, inputs: dict[int, torch.Tensor]
) -> tuple[
    dict[str, Any], dict[str, Any], dict[str, float], dict[str, dict[int, float]], dict[str, dict[int, str]]
]:
    """``hf_tp.compile_variants`` for the plain variants; a ``graph`` variant compiles its
    base variant in its own ``torch.compile`` and captures it whole per token count."""
    plain = [n for n in args.only if not n.endswith((GRAPH, SKIP))]
    captured = [n for n in args.only if n.endswith(GRAPH)]
    skipped = [n for n in args.only if n.endswith(SKIP)]
    needed = plain + [n[: -len(SKIP)] for n in skipped if n[: -len(SKIP)] not in plain]
    compiled, backends, compile_s, diff = hf_tp.compile_variants(rank, args, model, inputs, needed)
    failures: dict[str, dict[int, str]] = {}
    with torch.no_grad():
        for name in skipped:  # the same compiled function, its guards skipped: outputs must match
            base = name[: -len(SKIP)]
            compiled[name] = skipping_guards(compiled[base])
            for t, ids in inputs.items():
                want = compiled[base](ids).clone()
                got = compiled[name](ids).clone()
                if not torch.equal(want, got):
                    raise RuntimeError(f"{name}: output differs from {base}'s at {t} tokens")
            compile_s[name], diff[name] = compile_s[base], diff[base]
            if base in backends:
                backends[name] = backends[base]
    for base in [n for n in needed if n not in plain]:  # compiled only to be wrapped
        compiled.pop(base)
        backends.pop(base, None)
    if captured:
        bases = [n[: -len(GRAPH)] for n in captured]
        c2, b2, s2, d2 = hf_tp.compile_variants(rank, args, model, inputs, bases)
        with torch.no_grad():
            for name, base in zip(captured, bases):
                t0 = time.perf_counter()
                compiled[name], failures[name] = capture_whole(c2[base], inputs)
                compile_s[name] = s2[base] + time.perf_counter() - t0
                diff[name] = d2[base]
                if base in b2:
                    backends[name] = b2[base]
                if failures[name] and rank == 0:
                    print(f"{name}: not captured at {failures[name]}", file=sys.stderr, flush=True)
    return compiled, backends, compile_s, diff, failures


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any, only: list[str]) -> None:
    """One rank: compile, time and profile ``only``, hand the ranks' results to ``queue``
    (rank 0), drop the captured graphs, then end as a program does."""
    args.only = only
    device, model, vocab = hf_tp.setup_rank(rank, world, port, args)
    inputs = hf_tp.make_inputs(args.tokens, vocab, device)
    if device.type != "cuda":  # a CPU has no CUDA graph to capture: the graph variants run plain
        args.only = [n for n in args.only if not n.endswith(GRAPH)]
    compiled, backends, compile_s, diff, not_captured = compile_all(rank, args, model, inputs)
    hf_tp.warm_clocks(device)
    with torch.no_grad():
        timings = time_variants(args, compiled, inputs, device)
        if rank == 0:
            print("timed; profiling", file=sys.stderr, flush=True)
        profiles = profile_variants(args, compiled, inputs, device, rank)
    sites = {
        name: [
            {
                "range": r.token_range or ("cache hit" if r.cache_hit else "all sizes"),
                "passes": {p: [r[p].status, r[p].matches] for p in r.names() if p in hf_tp.PASSES},
            }
            for r in backend.reports
        ]
        for name, backend in backends.items()
    }
    mine = {"rank": rank, "timings": timings, "profiles": profiles}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        queue.put(
            {
                "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (gloo)",
                "torch": torch.__version__,
                "world": world,
                "layers": args.layers,
                "variants": args.only,
                "tokens": args.tokens,
                "ranks": gathered,
                "rel_diff_vs_eager": diff,
                "compile_and_warmup_s": compile_s,
                "sites": sites,
                "not_captured": not_captured,
                "op_paths": {
                    n: hf_tp.OP_PATHS.get(n.removesuffix(GRAPH).removesuffix(SKIP), {}) for n in args.only
                },
            }
        )
    sys.stdout.flush()
    # NCCL's communicator cannot be destroyed while a CUDA graph that captured it is alive
    # (destroy_process_group() waits for ever): the graphs go first, as a server drops them
    compiled.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.destroy_process_group()


def skew_us(res: dict[str, Any], name: str, t: int) -> float:
    """The median over aligned forwards of the spread of the ranks' barrier-leaving clocks."""
    per_rank = [r["timings"][name][t]["leave_ns"] for r in res["ranks"]]
    spreads = [(max(x) - min(x)) / 1e3 for x in zip(*per_rank)]
    return statistics.median(spreads)


def attribution(res: dict[str, Any], name: str, base: str, t: int, rank: int) -> dict[str, float] | None:
    """``name - base`` on one rank at ``t`` tokens (aligned, microseconds), split by cause."""
    r = res["ranks"][rank]
    a, b = r["profiles"][name][t]["median"], r["profiles"][base][t]["median"]
    if not a or not b or a.get("busy_us") is None or b.get("busy_us") is None:
        return None
    excess = (r["timings"][name][t]["aligned_ms"] - r["timings"][base][t]["aligned_ms"]) * 1e3
    sites = a["collective_sites_us"]
    coll = a["by_category_us"]["collective"] - b["by_category_us"]["collective"]
    own = (min(sites) * len(sites) if sites else 0.0) - (
        min(b["collective_sites_us"]) * len(b["collective_sites_us"]) if b["collective_sites_us"] else 0.0
    )
    other = sum(a["by_category_us"][c] - b["by_category_us"][c] for c in CATEGORIES if c != "collective")
    return {
        "excess_us": excess,
        "sites": len(sites),
        "own_us": own,
        "waiting_us": coll - own,
        "first_site_us": sites[0] if sites else 0.0,
        "other_kernels_us": other,
        "kernels_delta": (a["kernels"] or 0) - (b["kernels"] or 0),
        "rest_us": excess - coll - other,
    }


def _way(name: str) -> str:
    """How a variant runs: ``" graph"``, ``" reduce-overhead"`` or ``""`` (the default mode)."""
    return next((w for w in (GRAPH, " reduce-overhead" + SKIP, " reduce-overhead") if name.endswith(w)), "")


def _inductor_same_way(name: str, variants: list[str]) -> str | None:
    base = "inductor" + _way(name)
    return base if base in variants else None


def load(path: Path) -> dict[str, Any]:
    """A result written with ``--out``, its token keys made ints again (JSON keeps strings)."""
    res = json.loads(path.read_text())

    def ints(d: dict[str, Any]) -> dict[Any, Any]:
        return {int(k) if k.isdigit() else k: v for k, v in d.items()}

    for r in res["ranks"]:
        for part in ("timings", "profiles"):
            r[part] = {n: ints(per) for n, per in r[part].items()}
    res["skew_us"] = {n: ints(per) for n, per in res["skew_us"].items()}
    res["rel_diff_vs_eager"] = {n: ints(per) for n, per in res["rel_diff_vs_eager"].items()}
    return res


def render(res: dict[str, Any]) -> str:
    tokens, variants, world = res["tokens"], res["variants"], res["world"]
    lines = [
        f"# Where the microseconds go: HF Llama 8B-shaped, {res['layers']} layers, DTensor TP={world}",
        "",
        f"{res['device']}, torch {res['torch']}; tokens dynamic; variants interleaved in one process per rank. "
        "aligned: barrier before each forward (hf_tp.py's timing), CUDA events, median; pipelined: forwards back "
        "to back, per forward; host: the call's own time on the host (nothing synchronised); skew: spread of the "
        "ranks' clocks leaving the barrier. Profile columns are rank 0's medians over profiled aligned forwards "
        "(us): span = first kernel start to last kernel end, busy = union of kernels, idle = span - busy, "
        "lead = call to first kernel.",
        "",
        "| variant | tokens | aligned ms | pipelined ms | host us | skew us | lead us | span us | busy us | idle us "
        "| kernels | gemm | attention | triton | collective (n) | copy | other |",
        "|" + "---|" * 17,
    ]
    r0 = res["ranks"][0]
    for t in tokens:
        for n in variants:
            tm, pm = r0["timings"][n][t], r0["profiles"][n][t]["median"]
            cat = pm.get("by_category_us", {})
            cn = pm.get("by_category_n", {})
            f = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
            lines.append(
                f"| {n} | {t} | {tm['aligned_ms']:.3f} | {tm['pipelined_ms']:.3f} | {tm['host_us']:.0f} | "
                f"{res['skew_us'][n][t]:.0f} | {f(pm.get('first_kernel_after_us'))} | {f(pm.get('span_us'))} | "
                f"{f(pm.get('busy_us'))} | {f(pm.get('idle_us'))} | {f(pm.get('kernels'))} | "
                + " | ".join(
                    f"{cat.get(c, 0):.0f}" + (f" ({cn.get(c, 0):.0f})" if c == "collective" else "")
                    for c in ("gemm", "attention", "triton", "collective", "copy", "other")
                )
                + " |"
            )
    lines += [
        "",
        "## Speed-up over Inductor run the same way (aligned, rank 0; > 1: faster)",
        "",
        "| variant | " + " | ".join(f"{t} tok" for t in tokens) + " |",
        "|" + "---|" * (len(tokens) + 1),
    ]
    for n in variants:
        base = _inductor_same_way(n, variants)
        if base is None or base == n:
            continue
        cells = [
            f"{r0['timings'][base][t]['aligned_ms'] / r0['timings'][n][t]['aligned_ms']:.3f}x" for t in tokens
        ]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    for ceiling in [v for v in variants if v.startswith("ceiling")]:
        way = ceiling[len("ceiling") :]
        lines += [
            "",
            f"## Each variant's excess over `{ceiling}` (aligned, us), split by cause, per rank",
            "",
            "own: the collectives' own cost (the fastest in-situ site x the sites); waiting: the rest of their "
            "in-situ time (ranks arriving apart, polling); other kernels: the non-collective kernels' extra time "
            "(lost or split fusions, copies); rest: what no kernel accounts for (host launch, idle gaps).",
            "",
            "| variant | tokens | rank | excess | sites | own | waiting | first site | other kernels | kernels +/- | rest |",
            "|" + "---|" * 11,
        ]
        for t in tokens:
            for n in variants:
                if (
                    n.startswith("ceiling")
                    or not n.endswith(way)
                    or (not way and n.endswith((GRAPH, "overhead", SKIP)))
                ):
                    continue
                for rk in range(world):
                    a = attribution(res, n, ceiling, t, rk)
                    if a is None:
                        lines.append(f"| {n} | {t} | {rk} | (no kernels in the profile) |" + " |" * 7)
                        continue
                    lines.append(
                        f"| {n} | {t} | {rk} | {a['excess_us']:.0f} | {a['sites']} | {a['own_us']:.0f} | "
                        f"{a['waiting_us']:.0f} | {a['first_site_us']:.0f} | {a['other_kernels_us']:.0f} | "
                        f"{a['kernels_delta']:+.0f} | {a['rest_us']:.0f} |"
                    )
    lines += ["", "## Collective kernels in situ (rank 0, us per site, in order)", ""]
    for t in tokens:
        for n in variants:
            pm = r0["profiles"][n][t]["median"]
            if pm.get("collective_sites_us"):
                lines.append(
                    f"- {n}, {t} tokens: "
                    + ", ".join(f"{v:.1f}" for v in pm["collective_sites_us"])
                    + f" ({'; '.join(pm['collective_names'])[:200]})"
                )
    lines += ["", "sites per compile: " + json.dumps(res["sites"])[:3000]]
    if any(res.get("not_captured", {}).values()):
        lines.append("not captured (ran uncaptured): " + json.dumps(res["not_captured"])[:2000])
    lines += hf_tp.op_paths_lines(res)
    diffs = {n: max(v.values()) for n, v in res["rel_diff_vs_eager"].items()}
    lines.append("max |out - eager| / max |eager|: " + json.dumps({k: f"{v:.2e}" for k, v in diffs.items()}))
    lines.append(
        "compile + warm-up s: " + json.dumps({k: round(v, 1) for k, v in res["compile_and_warmup_s"].items()})
    )
    lines.append(
        "each rank's seconds from its results to its exit (None: hung, killed after "
        f"{hf_tp.EXIT_LIMIT_S:.0f} s): {res.get('exit_s')}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048, 8192])
    parser.add_argument("--modes", nargs="+", default=["ro"], choices=list(MODES), help="ro: reduce-overhead")
    parser.add_argument("--only", nargs="+", default=[], choices=list(hf_tp.VARIANTS), help="exactly these")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[],
        choices=[*hf_tp.EXTRA, *GRAPH_EXTRA],
        help="extras, beside --modes'",
    )
    parser.add_argument("--iters", type=int, default=10, help="aligned forwards per variant, size and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--chain", type=int, default=10, help="forwards per pipelined chain")
    parser.add_argument("--profile-forwards", type=int, default=6)
    parser.add_argument("--trace-dir", type=Path, default=None, help="keep the Chrome traces (gzip) here")
    parser.add_argument("--trace-tokens", type=int, nargs="+", default=[16])
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny Llama, few forwards")
    parser.add_argument("--out", type=Path, default=None, help="write OUT.md and OUT.json")
    parser.add_argument(
        "--render",
        type=Path,
        default=None,
        help="no run: print (and with --out write) the tables of a JSON result",
    )
    args = parser.parse_args()
    if args.render:
        text = render(load(args.render))
        print(text)
        if args.out:
            args.out.with_suffix(".md").write_text(text + "\n")
        return
    args.only = args.only or [v for m in args.modes for v in MODES[m]] + [
        hf_tp.EXTRA.get(v) or GRAPH_EXTRA[v] for v in args.variants
    ]
    if args.smoke:
        args.tokens, args.iters, args.rounds, args.layers, args.chain, args.profile_forwards = (
            [1, 8],
            2,
            2,
            1,
            2,
            2,
        )
    res, exits, failed = hf_tp.run_world(args, args.only, target=worker)
    res["exit_s"] = exits
    res["skew_us"] = {n: {t: skew_us(res, n, t) for t in res["tokens"]} for n in res["variants"]}
    for r in res["ranks"]:  # the barrier clocks are summarised by the skew
        for per in r["timings"].values():
            for cell in per.values():
                cell["leave_ns"] = len(cell["leave_ns"])
    if args.out:  # the numbers first: a rendering error must not lose a GPU run
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    text = render(res)
    print(text)
    if args.out:
        args.out.with_suffix(".md").write_text(text + "\n")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
