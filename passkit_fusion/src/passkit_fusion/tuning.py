"""Measuring decision tables on the GPUs at hand: :func:`tune` and ``passkit tune``.

:func:`tune` times the unfused path and flashinfer's one-shot and two-shot kernels per
token count on an initialised process group and turns the medians into a
:class:`~passkit_fusion.tables.Table`; :func:`run_tune` (the ``passkit tune`` command) runs
it on N local GPUs and stores the JSON where :func:`~passkit_fusion.tables.default_table`
finds it.  The table model itself lives in :mod:`passkit_fusion.tables`; its names are
re-exported here for convenience.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import socket
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import torch

from passkit import PasskitError

from .tables import (
    TABLE_FORMAT,
    TABLES_DIR,
    UNFUSED,
    USER_TABLES_DIR,
    Decision,
    Entry,
    Rule,
    Table,
    TableKey,
    conservative_rules,
    decide,
    default_table,
    dtype_name,
    load_table,
    lookup,
    max_fused_tokens,
    rules_fingerprint,
    save_table,
)

__all__ = [  # the table model is re-exported: passkit_fusion.tuning.Table etc. stay valid
    "DEFAULT_MARGIN",
    "DEFAULT_TUNE_TOKENS",
    "TABLES_DIR",
    "TABLE_FORMAT",
    "UNFUSED",
    "USER_TABLES_DIR",
    "Decision",
    "Entry",
    "Measurement",
    "Rule",
    "Table",
    "TableKey",
    "choose",
    "conservative_rules",
    "decide",
    "default_table",
    "dtype_name",
    "graph_median_us",
    "load_table",
    "lookup",
    "make_inputs",
    "max_fused_tokens",
    "measure",
    "rules_fingerprint",
    "rules_from_measurements",
    "run_tune",
    "save_table",
    "tune",
]

#: Fuse only where the fused median beats the unfused median by this fraction.
DEFAULT_MARGIN = 0.05
DEFAULT_TUNE_TOKENS = tuple(2**i for i in range(14))  # 1 .. 8192


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Median device time (microseconds) of each variant at one token count."""

    tokens: int
    unfused_us: float
    oneshot_us: float | None
    twoshot_us: float | None


def choose(measurement: Measurement, margin: float = DEFAULT_MARGIN) -> Decision:
    """Fuse only if the faster fused variant beats unfused by ``margin``; pick the faster one."""
    fused = [
        (t, oneshot)
        for t, oneshot in ((measurement.oneshot_us, True), (measurement.twoshot_us, False))
        if t is not None
    ]
    if not fused:
        return UNFUSED
    best_us, oneshot = min(fused, key=lambda f: (f[0], not f[1]))  # a tie goes to one-shot
    if best_us * (1.0 + margin) <= measurement.unfused_us:
        return Decision(True, oneshot)
    return UNFUSED


def rules_from_measurements(
    measurements: Iterable[Measurement], margin: float = DEFAULT_MARGIN
) -> tuple[Rule, ...]:
    """Turn per-token-count measurements into rules.

    A token count between two measured ones takes the decision measured at the larger;
    runs of equal decisions merge; token counts above the largest measured run unfused.
    """
    rules: list[Rule] = []
    for m in sorted(measurements, key=lambda m: m.tokens):
        decision = choose(m, margin)
        if rules and rules[-1].decision == decision:
            rules[-1] = Rule(m.tokens, decision)
        else:
            rules.append(Rule(m.tokens, decision))
    while rules and not rules[-1].decision.use_fused:
        rules.pop()  # trailing unfused rules are implicit
    return tuple(rules)


# ----------------------------------------------------------------------------------------
# Measuring (needs CUDA and an initialised process group)
# ----------------------------------------------------------------------------------------


def replays_for(tokens: int, hidden: int) -> int:
    """Graph replays per measurement, from the shape alone so all ranks agree."""
    numel = tokens * hidden
    if numel <= 2**20:
        return 200
    return 100 if numel <= 2**23 else 40


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
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(ops_per_graph):
            step()
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


def make_inputs(
    tokens: int, hidden: int, dtype: torch.dtype, rank: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``(x, residual, weight)`` on the current GPU.

    ``x`` differs per rank; ``residual`` and ``weight`` are identical on every rank, as in
    tensor parallelism (the fused kernel requires it).
    """
    device = torch.device("cuda", torch.cuda.current_device())
    x = _randn((tokens, hidden), seed * 1000 + 17 + rank, dtype, device)
    residual = _randn((tokens, hidden), seed * 1000 + 3, dtype, device)
    weight = 1.0 + 0.1 * _randn((hidden,), seed * 1000 + 5, torch.float32, device)
    return x, residual, weight.to(dtype)


def time_unfused_us(
    group: Any,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    replays: int = 100,
    norm: Literal["inductor", "eager"] = "inductor",
) -> float:
    """NCCL all-reduce (in place, as a compiled graph runs it), then add + RMSNorm as
    Inductor generates them (``norm="inductor"``, what the unfused graph runs when the pass
    leaves a site alone) or in eager torch (``"eager"``, the op's own fallback)."""
    import torch.distributed as dist

    buf = x.clone()
    add_norm = _compiled_add_rmsnorm() if norm == "inductor" else _eager_add_rmsnorm

    def step() -> None:
        dist.all_reduce(buf, group=group)
        add_norm(buf, residual, weight, eps)

    return graph_median_us(step, reset=lambda: buf.copy_(x), replays=replays)


def _eager_add_rmsnorm(
    reduced: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from .reference import rms_norm

    total = reduced + residual
    return rms_norm(total, weight, eps, 0.0), total


@functools.cache
def _compiled_add_rmsnorm() -> Callable[..., Any]:
    """Residual add + Llama's RMSNorm, compiled by Inductor for any token count."""

    def add_rmsnorm(
        reduced: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = reduced + residual
        h = total.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(total.dtype), total

    return torch.compile(add_rmsnorm, dynamic=True, fullgraph=True)


def time_fused_us(
    group_name: str,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    decision: Decision,
    replays: int = 100,
) -> float:
    """passkit's op with ``decision`` forced (it must have a prepared workspace)."""
    from . import runtime

    with runtime.forced(decision):
        return graph_median_us(
            lambda: runtime.fused_allreduce_rmsnorm_cuda(x, residual, weight, eps, 0.0, group_name),
            replays=replays,
        )


def measure(group: Any, hidden: int, dtype: torch.dtype, tokens: int, eps: float = 1e-6) -> Measurement:
    """Time unfused, fused one-shot and (where legal) fused two-shot at one token count.

    Collective: every rank of ``group`` calls it with the same arguments.  The medians are
    max-reduced over the ranks so that every rank returns the same measurement.
    """
    import torch.distributed as dist

    from .runtime import TWOSHOT_WORLD_SIZES

    world_size = dist.get_world_size(group)
    x, residual, weight = make_inputs(tokens, hidden, dtype, dist.get_rank(group))
    replays = replays_for(tokens, hidden)
    name = group.group_name
    times = [
        time_unfused_us(group, x, residual, weight, eps, replays),
        time_fused_us(name, x, residual, weight, eps, Decision(True, True), replays),
        time_fused_us(name, x, residual, weight, eps, Decision(True, False), replays)
        if tokens > world_size and world_size in TWOSHOT_WORLD_SIZES
        else -1.0,
    ]
    agreed = torch.tensor(times, dtype=torch.float64, device=x.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    unfused, oneshot, twoshot = agreed.tolist()
    return Measurement(tokens, unfused, oneshot, twoshot if twoshot >= 0 else None)


def tune(
    group: Any,
    hidden: int,
    dtype: torch.dtype,
    token_counts: Iterable[int] = DEFAULT_TUNE_TOKENS,
    *,
    margin: float = DEFAULT_MARGIN,
    eps: float = 1e-6,
) -> Table:
    """Measure the three variants on the current GPUs and return a one-entry table.

    Collective over ``group`` (every rank calls it with the same arguments and gets the
    same table).  Creates a workspace for ``max(token_counts)`` tokens through
    :func:`passkit_fusion.runtime.prepare`.
    """
    import torch.distributed as dist

    from . import runtime

    counts = sorted(set(token_counts))
    if not counts or counts[0] < 1:
        raise ValueError(f"token_counts must be positive integers, got {counts}")
    prepared = runtime.prepare(group.group_name, hidden, dtype, max_tokens=counts[-1])
    if prepared < counts[-1]:
        raise RuntimeError(
            f"cannot tune: the fused kernel is unavailable here ({runtime.unavailable_reason()})"
        )
    measurements = [measure(group, hidden, dtype, t, eps) for t in counts]
    key = TableKey(torch.cuda.get_device_name(), dist.get_world_size(group), hidden, dtype_name(dtype))
    source = {
        "measured": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "flashinfer": runtime.flashinfer_version(),
        "margin": margin,
        "medians_us": [dataclasses.asdict(m) for m in measurements],
    }
    return Table({key: Entry(rules_from_measurements(measurements, margin), source)})


TUNE_HELP = "Measure fused vs unfused all-reduce+RMSNorm on this machine's GPUs and store a decision table."


def run_tune(args: argparse.Namespace) -> int:
    """Run ``passkit tune`` with parsed arguments (see :func:`add_tune_arguments`)."""
    if args.output is None:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        slug = "-".join("".join(c if c.isalnum() else " " for c in gpu.lower()).split())
        args.output = USER_TABLES_DIR / f"{slug}_w{args.world_size or torch.cuda.device_count()}.json"
    available = torch.cuda.device_count()
    world_size = args.world_size or available
    if not 2 <= world_size <= available:
        raise PasskitError(
            f"needs 2 to {available} local CUDA GPUs (this machine has {available}); asked for {world_size}"
        )
    import torch.multiprocessing as mp

    mp.spawn(_tune_worker, args=(world_size, _free_port(), args), nprocs=world_size, join=True)
    print(f"wrote {args.output}")
    return 0


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=0, help="GPUs to use (default: all local GPUs)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TUNE_TOKENS))
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN)
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"table file (default: {USER_TABLES_DIR}/<gpu>_w<N>.json, "
        "which the fused op loads automatically)",
    )


def _tune_worker(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from . import runtime

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        device_id=torch.device("cuda", rank),
    )
    try:
        group = dist.group.WORLD
        table = Table()
        for hidden in args.hidden:
            table = table.merged(
                tune(group, hidden, getattr(torch, args.dtype), args.tokens, margin=args.margin)
            )
        if rank == 0:
            save_table(table, args.output)
    finally:
        runtime.destroy_workspaces()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _randn(shape: tuple[int, ...], seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
