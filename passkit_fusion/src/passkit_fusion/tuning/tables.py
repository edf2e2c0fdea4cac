"""Decision tables: when to fuse all-reduce + residual add + RMSNorm, and how.

A :class:`Table` maps ``(gpu name, world size, hidden size, dtype)`` to a short list of
:class:`Rule` objects.  Each rule covers the token counts up to its ``max_tokens`` (from the
previous rule's bound, exclusive) and says whether to run flashinfer's fused kernel and,
if so, whether one-shot or two-shot.  Token counts above the last rule run unfused.

Tables ship as JSON files in ``passkit_fusion/tuning/tables/`` (one file per GPU and world
size, one entry per hidden size and dtype); ``passkit tune`` (:mod:`passkit_fusion.tuning.cli`)
measures new ones and stores them in :data:`USER_TABLES_DIR`. :func:`rules_from_measurements`
turns timed variants (:class:`Measurement`) into rules.

JSON format (``"format": "passkit-fusion-table/1"``)::

    {"format": "passkit-fusion-table/1",
     "entries": [{"gpu": "NVIDIA H200", "world_size": 2, "hidden": 4096,
                  "dtype": "bfloat16",
                  "rules": [{"max_tokens": 512, "fused": true, "oneshot": true},
                            {"max_tokens": 4096, "fused": true, "oneshot": false}],
                  "source": {"...": "free-form provenance, not used for decisions"}}]}

Every rank must take the same decision for the same call, so a decision depends only on
the table and the call's shape and dtype, never on rank-local timing.  This module is pure
data and logic: it imports neither torch.distributed nor a pass's runtime.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

TABLE_FORMAT = "passkit-fusion-table/1"
TABLES_DIR = Path(__file__).with_name("tables")
"""Tables shipped with passkit-fusion (measured by its developers)."""
USER_TABLES_DIR = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "passkit" / "fusion-tables"
)
"""Tables ``passkit tune`` measured on this machine; they win over shipped ones."""

#: Without a matching table, fuse (one-shot) messages up to this size, and only at world
#: size 2, where DESIGN.md's measurements show a clear win on Hopper (2.1x at 512 tokens,
#: 1.16x at 2048 tokens, hidden 4096, bf16): 8 MiB is 1024 tokens at hidden 4096 in bf16.
CONSERVATIVE_FUSE_BYTES = 8 * 2**20
CONSERVATIVE_WORLD_SIZES = frozenset({2})
CONSERVATIVE_PLAN_HIDDEN = 4096
"""The hidden size the token-range plan assumes for :func:`conservative_rules` (the plan is
made before the graph's hidden size is known; the op still decides per call)."""


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


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16``, ``"torch.bfloat16"``, ``"bfloat16"`` or an alias such as
    ``"half"`` -> the canonical name (``"bfloat16"``, ``"float16"``)."""
    if isinstance(dtype, str):
        import torch  # here: the command line's parser reads this module's defaults

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
    import torch  # here: the command line's parser imports this module without torch

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

    def largest_fused(self, gpu: str, world_size: int, dtype: torch.dtype | str) -> int | None:
        """The largest token count any entry for this GPU, world size and dtype fuses (any
        hidden size), 0 when none fuses, None when there is no such entry."""
        found = [
            max_fused_tokens(entry.rules)
            for key, entry in self._entries.items()
            if (key.gpu, key.world_size, key.dtype) == (gpu, world_size, dtype_name(dtype))
        ]
        return max(found) if found else None

    def planned_bound(self, gpu: str, world_size: int, dtype: torch.dtype | str) -> int | None:
        """The largest token count worth compiling the fused op for: :meth:`largest_fused`,
        or, where no entry matches this GPU (the op then follows :func:`conservative_rules`),
        the conservative bound at :data:`CONSERVATIVE_PLAN_HIDDEN`. Above it the op would
        only fall back to its unfused path, slower than what Inductor generates (measured on
        2x H100, hidden 4096: 0.82x at 2048 tokens, `benchmarks/results/hf_tp_h100x2_run2.md`),
        so those sizes compile without the pass. None: no bound (nothing fuses here)."""
        found = self.largest_fused(gpu, world_size, dtype)
        if found is not None:
            return found
        return max_fused_tokens(conservative_rules(world_size, CONSERVATIVE_PLAN_HIDDEN, dtype)) or None

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
    """The tables shipped in ``passkit_fusion/tuning/tables/``, then those ``passkit tune`` stored
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
    import torch

    key = TableKey(str(raw["gpu"]), int(raw["world_size"]), int(raw["hidden"]), dtype_name(raw["dtype"]))
    if not isinstance(getattr(torch, key.dtype, None), torch.dtype):
        raise ValueError(f"unknown dtype {key.dtype!r}")
    rules = tuple(Rule(int(r["max_tokens"]), _decision_from_json(r)) for r in raw["rules"])
    return key, Entry(_validated_rules(rules, key), raw.get("source", {}))


# ----------------------------------------------------------------------------------------
# From measurements to rules (``passkit tune``)
# ----------------------------------------------------------------------------------------

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
