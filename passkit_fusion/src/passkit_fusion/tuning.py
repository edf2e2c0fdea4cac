"""When to fuse all-reduce + residual add + RMSNorm, and with which algorithm.

A :class:`Table` maps ``(gpu name, world size, hidden size, dtype)`` to a short list of
:class:`Rule` objects.  Each rule covers the token counts up to its ``max_tokens`` (from the
previous rule's bound, exclusive) and says whether to run flashinfer's fused kernel and,
if so, whether one-shot or two-shot.  Token counts above the last rule run unfused.

Tables ship as JSON files in ``passkit_fusion/tables/`` (one file per GPU and world size,
one entry per hidden size and dtype).  :func:`tune` measures the three variants on the GPUs
at hand and returns a table; :func:`run_tune` (the ``passkit tune`` command) runs it on N local GPUs and stores the JSON.

JSON format (``"format": "passkit-fusion-table/1"``)::

    {"format": "passkit-fusion-table/1",
     "entries": [{"gpu": "NVIDIA H200", "world_size": 2, "hidden": 4096,
                  "dtype": "bfloat16",
                  "rules": [{"max_tokens": 512, "fused": true, "oneshot": true},
                            {"max_tokens": 4096, "fused": true, "oneshot": false}],
                  "source": {"...": "free-form provenance, not used for decisions"}}]}

Every rank must take the same decision for the same call, so a decision depends only on
the table and the call's shape and dtype, never on rank-local timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import hashlib
import json
import os
import socket
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from passkit import PasskitError

TABLE_FORMAT = "passkit-fusion-table/1"
TABLES_DIR = Path(__file__).with_name("tables")
"""Tables shipped with passkit-fusion (measured by its developers)."""
USER_TABLES_DIR = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "passkit" / "fusion-tables"
)
"""Tables ``passkit tune`` measured on this machine; they win over shipped ones."""

#: Fuse only where the fused median beats the unfused median by this fraction.
DEFAULT_MARGIN = 0.05
#: Without a matching table, fuse (one-shot) messages up to this size, and only at world
#: size 2, where DESIGN.md's measurements show a clear win on Hopper (2.1x at 512 tokens,
#: 1.16x at 2048 tokens, hidden 4096, bf16): 8 MiB is 1024 tokens at hidden 4096 in bf16.
CONSERVATIVE_FUSE_BYTES = 8 * 2**20
CONSERVATIVE_WORLD_SIZES = frozenset({2})
DEFAULT_TUNE_TOKENS = tuple(2**i for i in range(14))  # 1 .. 8192


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to run for one call: the fused kernel (one-shot or two-shot) or the unfused path."""

    use_fused: bool
    oneshot: bool = True

    def label(self) -> str:
        """Short human-readable name: ``fused_oneshot``, ``fused_twoshot`` or ``unfused``."""
        if not self.use_fused:
            return "unfused"
        return "fused_oneshot" if self.oneshot else "fused_twoshot"


UNFUSED = Decision(use_fused=False, oneshot=False)


@dataclasses.dataclass(frozen=True)
class Rule:
    """Token counts up to ``max_tokens`` (inclusive) take ``decision``."""

    max_tokens: int
    decision: Decision


@dataclasses.dataclass(frozen=True)
class TableKey:
    """What a table entry applies to."""

    gpu: str
    world_size: int
    hidden: int
    dtype: str


@dataclasses.dataclass(frozen=True)
class Entry:
    """The rules for one key, plus free-form provenance (ignored by decisions)."""

    rules: tuple[Rule, ...]
    source: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Median device time (microseconds) of each variant at one token count."""

    tokens: int
    unfused_us: float
    oneshot_us: float | None
    twoshot_us: float | None


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16``, ``"torch.bfloat16"``, ``"bfloat16"`` or an alias such as
    ``"half"`` -> the canonical name (``"bfloat16"``, ``"float16"``)."""
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(resolved, torch.dtype):
            dtype = resolved
    return str(dtype).removeprefix("torch.")


def decide(rules: Sequence[Rule], tokens: int) -> Decision:
    """The decision of the first rule whose ``max_tokens`` covers ``tokens`` (else unfused)."""
    for rule in rules:
        if tokens <= rule.max_tokens:
            return rule.decision
    return UNFUSED


def conservative_rules(world_size: int, hidden: int, dtype: torch.dtype | str) -> tuple[Rule, ...]:
    """Rules used when no table entry matches: one-shot for small messages at world size 2."""
    if world_size not in CONSERVATIVE_WORLD_SIZES or hidden <= 0:
        return ()
    itemsize = getattr(torch, dtype_name(dtype)).itemsize
    max_tokens = CONSERVATIVE_FUSE_BYTES // (hidden * itemsize)
    return (Rule(max_tokens, Decision(True, True)),) if max_tokens >= 1 else ()


def max_fused_tokens(rules: Sequence[Rule]) -> int:
    """The largest token count any rule fuses (0 when none does)."""
    return max((r.max_tokens for r in rules if r.decision.use_fused), default=0)


def rules_fingerprint(rules: Sequence[Rule]) -> str:
    """A short stable hash of a rule list, for comparing plans across ranks."""
    payload = json.dumps([_rule_to_json(r) for r in rules], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


class Table:
    """Decision rules per (gpu, world size, hidden, dtype)."""

    def __init__(self, entries: Mapping[TableKey, Entry] | None = None) -> None:
        self._entries: dict[TableKey, Entry] = {}
        for key, entry in (entries or {}).items():
            self._entries[key] = Entry(_validated_rules(entry.rules, key), entry.source)

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Table) and self._entries == other._entries

    def __repr__(self) -> str:
        return f"Table({len(self)} entries)"

    @property
    def entries(self) -> Mapping[TableKey, Entry]:
        """A read-only view of the entries."""
        return dict(self._entries)

    def rules_for(
        self, gpu: str, world_size: int, hidden: int, dtype: torch.dtype | str
    ) -> tuple[Rule, ...] | None:
        """The rules of the exactly matching entry, or None."""
        entry = self._entries.get(TableKey(gpu, world_size, hidden, dtype_name(dtype)))
        return entry.rules if entry is not None else None

    def resolve(self, gpu: str, world_size: int, hidden: int, dtype: torch.dtype | str) -> tuple[Rule, ...]:
        """The matching entry's rules, or :func:`conservative_rules` when none matches."""
        rules = self.rules_for(gpu, world_size, hidden, dtype)
        return rules if rules is not None else conservative_rules(world_size, hidden, dtype)

    def lookup(
        self, gpu: str, world_size: int, hidden: int, dtype: torch.dtype | str, tokens: int
    ) -> Decision:
        """The decision for one call."""
        return decide(self.resolve(gpu, world_size, hidden, dtype), tokens)

    def merged(self, other: Table) -> Table:
        """A new table with ``other``'s entries added, replacing ours where keys collide."""
        return Table({**self._entries, **other._entries})

    def to_json(self) -> dict[str, Any]:
        """The JSON-serialisable form (see the module docstring)."""
        return {
            "format": TABLE_FORMAT,
            "entries": [
                _entry_to_json(key, entry)
                for key, entry in sorted(self._entries.items(), key=lambda kv: dataclasses.astuple(kv[0]))
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], origin: str = "<table>") -> Table:
        """Parse :meth:`to_json`'s form; errors name ``origin``."""
        if data.get("format") != TABLE_FORMAT:
            raise ValueError(f"{origin}: expected format {TABLE_FORMAT!r}, got {data.get('format')!r}")
        entries: dict[TableKey, Entry] = {}
        for i, raw in enumerate(data.get("entries", [])):
            try:
                key, entry = _entry_from_json(raw)
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{origin}: entry {i} is invalid: {exc}") from exc
            if key in entries:
                raise ValueError(f"{origin}: entry {i} repeats {key}")
            entries[key] = entry
        return cls(entries)


def load_table(path: str | os.PathLike[str]) -> Table:
    """Read one table JSON file."""
    path = Path(path)
    return Table.from_json(json.loads(path.read_text()), origin=str(path))


def save_table(table: Table, path: str | os.PathLike[str]) -> None:
    """Write ``table`` as JSON (creating parent folders)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table.to_json(), indent=2) + "\n")


@functools.cache
def default_table() -> Table:
    """The tables shipped in ``passkit_fusion/tables/``, then those ``passkit tune`` stored
    in :data:`USER_TABLES_DIR` (which replace shipped entries with the same key), merged and
    read once per process."""
    table = Table()
    for folder in (TABLES_DIR, USER_TABLES_DIR):
        for path in sorted(folder.glob("*.json")):
            table = table.merged(load_table(path))
    return table


def lookup(
    gpu: str,
    world_size: int,
    hidden: int,
    dtype: torch.dtype | str,
    tokens: int,
    table: Table | None = None,
) -> Decision:
    """The decision for one call, from ``table`` or the shipped defaults."""
    return (table or default_table()).lookup(gpu, world_size, hidden, dtype, tokens)


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
    group: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, replays: int = 100
) -> float:
    """NCCL all-reduce (in place, as a compiled graph would run it) + add + RMSNorm in torch."""
    import torch.distributed as dist

    from .reference import rms_norm

    buf = x.clone()

    def step() -> None:
        dist.all_reduce(buf, group=group)
        rms_norm(buf + residual, weight, eps, 0.0)

    return graph_median_us(step, reset=lambda: buf.copy_(x), replays=replays)


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


def _validated_rules(rules: Iterable[Rule], key: TableKey) -> tuple[Rule, ...]:
    rules = tuple(rules)
    bounds = [r.max_tokens for r in rules]
    if any(b < 1 for b in bounds) or bounds != sorted(set(bounds)):
        raise ValueError(f"{key}: rule bounds must be positive and strictly increasing, got {bounds}")
    return rules


def _rule_to_json(rule: Rule) -> dict[str, Any]:
    return {"max_tokens": rule.max_tokens, "fused": rule.decision.use_fused, "oneshot": rule.decision.oneshot}


def _entry_to_json(key: TableKey, entry: Entry) -> dict[str, Any]:
    data: dict[str, Any] = dataclasses.asdict(key)
    data["rules"] = [_rule_to_json(r) for r in entry.rules]
    if entry.source:
        data["source"] = dict(entry.source)
    return data


def _decision_from_json(rule: Mapping[str, Any]) -> Decision:
    fused, oneshot = rule["fused"], rule.get("oneshot", True)
    if not isinstance(fused, bool) or not isinstance(oneshot, bool):
        raise ValueError(f"'fused' and 'oneshot' must be true/false, got {dict(rule)}")
    return Decision(fused, oneshot) if fused else UNFUSED


def _entry_from_json(raw: Mapping[str, Any]) -> tuple[TableKey, Entry]:
    key = TableKey(str(raw["gpu"]), int(raw["world_size"]), int(raw["hidden"]), dtype_name(raw["dtype"]))
    if not isinstance(getattr(torch, key.dtype, None), torch.dtype):
        raise ValueError(f"unknown dtype {key.dtype!r}")
    rules = tuple(Rule(int(r["max_tokens"]), _decision_from_json(r)) for r in raw["rules"])
    return key, Entry(_validated_rules(rules, key), raw.get("source", {}))
