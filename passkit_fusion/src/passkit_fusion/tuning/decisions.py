"""Measured fuse decisions: which fusion passes run in which token range, for one model.

The static tables (:mod:`.tables`) and the passes' default bounds were measured on one
stack; :func:`passkit_fusion.tuning.measure.tune_model` times the candidate pass sets on
the user's model and this machine, and :func:`decide` turns the medians into a
:class:`FuseDecision`: token ranges, each with the passes that run there and where that
came from (``"measured"``, or ``"table"`` where the time budget left a count unmeasured).

* The decision logic (:func:`choose`, :func:`decide`) is pure: per measured token count the
  fastest candidate, never one slower than Inductor (Inductor is a candidate), ties within
  ``margin`` going to fewer passes; then each pass must run in one interval of token counts
  (a pass declares one :class:`~passkit.TokenConstraint`), so when noise would split a pass's
  counts, the cheapest assignment that keeps every pass contiguous is taken instead.
* Storage: one JSON file per graph, world size and device in :func:`decisions_dir`, keyed by
  :class:`DecisionKey` (the graph's fingerprint, the passes with their versions, options and
  sources, world size, device model, torch and flashinfer versions). :func:`lookup` returns
  a decision only when every key field matches; a foreign, stale or corrupt file is ignored
  with a note (the tables then decide), never trusted.
* Use: the fusion passes derive from :class:`Tunable`; their ``token_constraint`` asks
  :meth:`Tunable.decided`, and their report records carry :meth:`Tunable.decision_note`
  (which decision each range used and where it came from: table, measured, stored) and,
  for tools, :meth:`Tunable.decision_source` (the record's ``decision``: one of
  :data:`SOURCES`, on skipped records too).

The graph being compiled comes from :func:`passkit.compiling.current` (opened by the
backend around each compile). Outside such a scope, and inside :func:`ignored`, the tables
decide. Nothing here imports a pass or flashinfer.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from passkit import TokenConstraint, compiling
from passkit.logs import log

if TYPE_CHECKING:
    from passkit import CompileContext

DECISION_FORMAT = "passkit-fusion-decision/1"
DEFAULT_MARGIN = 0.01
"""Candidates within this fraction of the fastest tie; the one with fewest passes wins."""
INDUCTOR = "inductor"
"""How the empty pass set (Inductor alone) is named in reports and files."""

SOURCES = ("table", "measured", "stored", "options")
"""Where a tunable pass's token ranges come from (:meth:`Tunable.decision_source`, its
report records' ``decision``): its tables and default bounds (nothing measured or stored for
this graph, decisions ignored, or a stored one ignored), a decision measured in this
process, a stored one, or its own options (bounds set explicitly)."""

Candidate = tuple[str, ...]
"""A set of tunable passes, in pipeline order (``()``: Inductor alone)."""


def decisions_dir() -> Path:
    """Where decisions are stored: ``fusion-decisions`` in ``$PASSKIT_CACHE_DIR`` when set
    (passkit's cache), else in ``$XDG_CACHE_HOME/passkit`` (``~/.cache/passkit``)."""
    explicit = os.environ.get("PASSKIT_CACHE_DIR")
    if explicit:
        return Path(explicit) / "fusion-decisions"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "passkit" / "fusion-decisions"


def label(candidate: Candidate) -> str:
    """``"inductor"`` for the empty set, else the pass names joined by ``+``."""
    return "+".join(candidate) if candidate else INDUCTOR


# ----------------------------------------------------------------------------------------
# The decision model
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecisionKey:
    """What a decision applies to; every field must match for it to be used."""

    graph: str
    passes: tuple[dict[str, Any], ...]
    world_size: int
    device: str
    torch: str
    flashinfer: str | None

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "passes": [dict(p) for p in self.passes]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DecisionKey:
        return cls(
            graph=str(data["graph"]),
            passes=tuple(dict(p) for p in data["passes"]),
            world_size=int(data["world_size"]),
            device=str(data["device"]),
            torch=str(data["torch"]),
            flashinfer=None if data["flashinfer"] is None else str(data["flashinfer"]),
        )

    def difference(self, other: DecisionKey) -> str | None:
        """The first field in which ``other`` (here) differs from this key (stored), said
        for a note, or None."""
        for field in ("graph", "world_size", "device", "torch", "flashinfer"):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                return f"{field} differs (stored {mine!r}, here {theirs!r})"
        if self.passes != other.passes:
            stored = {p["name"]: p for p in self.passes}
            here = {p["name"]: p for p in other.passes}
            if list(stored) != list(here):
                return f"passes differ (stored {list(stored)}, here {list(here)})"
            for name, p in stored.items():
                for part in ("version", "options", "source"):
                    if p.get(part) != here[name].get(part):
                        return f"pass {name!r}: {part} differs (stored {p.get(part)!r}, here {here[name].get(part)!r})"
            return "passes differ"
        return None


@dataclasses.dataclass(frozen=True)
class RangeDecision:
    """Token counts ``lo..hi`` (``hi=None``: no bound) run ``passes``; ``source`` is
    ``"measured"`` or ``"table"`` (not measured: the passes' tables decide there);
    ``detail`` says why, for reports."""

    lo: int
    hi: int | None
    passes: Candidate
    source: str = "measured"
    detail: str = ""

    def span(self) -> str:
        if self.hi is None:
            return f"tokens >= {self.lo}"
        return f"tokens {self.lo}" if self.lo == self.hi else f"tokens {self.lo}..{self.hi}"

    def overlaps(self, lo: int, hi: int | None) -> bool:
        return (hi is None or self.lo <= hi) and (self.hi is None or lo <= self.hi)


@dataclasses.dataclass(frozen=True)
class FuseDecision:
    """Token ranges covering ``1..`` with the passes each runs, for one :class:`DecisionKey`.

    ``medians_us``: the agreed medians per token count and candidate label; ``unmeasured``:
    what the time budget left out; ``tuned``: date, seconds, budget, margin, timer."""

    key: DecisionKey
    ranges: tuple[RangeDecision, ...]
    medians_us: Mapping[int, Mapping[str, float]] = dataclasses.field(default_factory=dict, compare=False)
    unmeasured: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    tuned: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        check_ranges(self.ranges)

    def passes_at(self, tokens: int) -> Candidate:
        for r in self.ranges:
            if r.overlaps(tokens, tokens):
                return r.passes
        return ()

    def interval(self, name: str) -> tuple[int, int | None] | None:
        """The token counts where pass ``name`` runs (one interval), or None: nowhere."""
        mine = [r for r in self.ranges if name in r.passes]
        return (mine[0].lo, mine[-1].hi) if mine else None

    def fingerprint(self) -> str:
        payload = json.dumps(
            [self.key.to_json(), [dataclasses.astuple(r) for r in self.ranges]], sort_keys=True, default=str
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def summary(self) -> str:
        return "; ".join(f"{r.span()}: {label(r.passes)}" for r in self.ranges)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": DECISION_FORMAT,
            "key": self.key.to_json(),
            "ranges": [
                {"lo": r.lo, "hi": r.hi, "passes": list(r.passes), "source": r.source, "detail": r.detail}
                for r in self.ranges
            ],
            "medians_us": {str(t): dict(m) for t, m in sorted(self.medians_us.items())},
            "unmeasured": list(self.unmeasured),
            "tuned": dict(self.tuned),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FuseDecision:
        """Parse :meth:`to_json`'s form; raises ValueError (or KeyError/TypeError) when invalid."""
        if data.get("format") != DECISION_FORMAT:
            raise ValueError(f"expected format {DECISION_FORMAT!r}, got {data.get('format')!r}")
        ranges = tuple(
            RangeDecision(
                int(r["lo"]),
                None if r["hi"] is None else int(r["hi"]),
                tuple(str(p) for p in r["passes"]),
                str(r.get("source", "measured")),
                str(r.get("detail", "")),
            )
            for r in data["ranges"]
        )
        return cls(
            key=DecisionKey.from_json(data["key"]),
            ranges=ranges,
            medians_us={
                int(t): {str(k): float(v) for k, v in m.items()} for t, m in data["medians_us"].items()
            },
            unmeasured=tuple(str(u) for u in data.get("unmeasured", ())),
            tuned=dict(data.get("tuned", {})),
        )


def check_ranges(ranges: Sequence[RangeDecision]) -> None:
    """Raise ValueError unless ``ranges`` cover ``1..`` in order without gaps and every
    pass runs in one interval of them."""
    if not ranges:
        raise ValueError("a decision needs at least one token range")
    expected = 1
    for i, r in enumerate(ranges):
        if r.lo != expected or (r.hi is not None and r.hi < r.lo):
            raise ValueError(f"range {i} ({r.span()}) does not continue at token count {expected}")
        if r.hi is None and i != len(ranges) - 1:
            raise ValueError(f"range {i} ({r.span()}) is open but not the last")
        if r.source not in ("measured", "table"):
            raise ValueError(f"range {i}: unknown source {r.source!r}")
        expected = (r.hi or 0) + 1
    if ranges[-1].hi is not None:
        raise ValueError(f"the last range ({ranges[-1].span()}) must be open (hi=None)")
    for name in {p for r in ranges for p in r.passes}:
        where = [i for i, r in enumerate(ranges) if name in r.passes]
        if where != list(range(where[0], where[-1] + 1)):
            raise ValueError(f"pass {name!r} runs in token ranges that are not contiguous: {where}")


# ----------------------------------------------------------------------------------------
# From medians to a decision (pure)
# ----------------------------------------------------------------------------------------


def choose(times: Mapping[Candidate, float], margin: float = DEFAULT_MARGIN) -> Candidate:
    """The fastest candidate, ties within ``margin`` going to fewer passes (then the
    faster). ``times`` must hold Inductor (``()``): the winner is never slower than it."""
    if () not in times:
        raise ValueError("choose() needs Inductor's time (the empty candidate)")
    best = min(times.values())
    within = [c for c, t in times.items() if t <= best * (1.0 + margin)]
    return min(within, key=lambda c: (len(c), times[c], c))


def decide(
    medians: Mapping[int, Mapping[Candidate, float]],
    token_counts: Sequence[int],
    table: Callable[[int], Candidate],
    margin: float = DEFAULT_MARGIN,
) -> tuple[RangeDecision, ...]:
    """Token ranges and their passes from agreed medians (microseconds).

    Token count ``t_i`` (sorted) stands for ``t_{i-1}+1..t_i``; the largest also for every
    larger count. A count without Inductor's median is unmeasured: the passes the tables
    run there (``table(t)``) keep it. Every pass is kept to one interval (see the module
    docstring); where that overrides the per-count winner, ``detail`` says so.
    """
    counts = sorted(set(token_counts))
    if not counts or counts[0] < 1:
        raise ValueError(f"token counts must be positive, got {counts}")
    options: list[dict[Candidate, float]] = []
    winners: list[Candidate] = []
    for t in counts:
        times = dict(medians.get(t, {}))
        if () not in times:
            fixed = table(t)
            options.append({fixed: 0.0, (): 1.0} if fixed else {(): 0.0})
            winners.append(fixed)
            continue
        win = choose(times, margin)
        winners.append(win)
        # never slower than Inductor; the winner costs nothing, a faster set with more
        # passes (a tie) nothing either; a slower one its relative loss
        allowed = {c: t_c for c, t_c in times.items() if t_c <= times[()]}
        options.append(
            {
                c: max(0.0, t_c / times[win] - 1.0) + 1e-6 * (len(c) - len(win)) * (c != win)
                for c, t_c in allowed.items()
            }
        )
    chosen = _contiguous(options)
    groups: list[tuple[int, int | None, Candidate, str, list[str]]] = []
    lo = 1
    for i, t in enumerate(counts):
        hi = None if i == len(counts) - 1 else t
        times = medians.get(t, {})
        source = "measured" if () in times else "table"
        if source == "measured":
            item = f"{t}: {times[()] / times[chosen[i]]:.2f}x"
            if chosen[i] != winners[i]:  # kept to one interval per pass
                item += f" (fastest {label(winners[i])}, {times[()] / times[winners[i]]:.2f}x)"
        else:
            item = str(t)
        if groups and groups[-1][2] == chosen[i] and groups[-1][3] == source:
            groups[-1] = (groups[-1][0], hi, chosen[i], source, [*groups[-1][4], item])
        else:
            groups.append((lo, hi, chosen[i], source, [item]))
        lo = t + 1
    out = []
    for lo, hi, passes, source, items in groups:
        if source == "measured":
            detail = "Inductor / this at " + ", ".join(items)
            if any("fastest" in i for i in items):
                detail += "; each pass keeps one token interval"
        else:
            detail = f"not measured at {', '.join(items)} (time budget): the tables' passes"
        out.append(RangeDecision(lo, hi, passes, source, detail))
    return tuple(out)


def _contiguous(options: Sequence[Mapping[Candidate, float]]) -> list[Candidate]:
    """Per position one candidate of its ``options`` (candidate -> cost), minimising the
    total cost subject to: every pass is chosen at contiguous positions. Deterministic."""
    # state: (passes of the last choice, passes that ran before and stopped) -> (cost, path)
    states: dict[tuple[frozenset[str], frozenset[str]], tuple[float, tuple[Candidate, ...]]] = {
        (frozenset(), frozenset()): (0.0, ())
    }
    for costs in options:
        nxt: dict[tuple[frozenset[str], frozenset[str]], tuple[float, tuple[Candidate, ...]]] = {}
        for (open_, closed), (cost, path) in sorted(states.items(), key=lambda kv: (kv[1][0], kv[1][1])):
            for cand, c in sorted(costs.items()):
                chosen = frozenset(cand)
                if chosen & closed:
                    continue
                key = (chosen, closed | (open_ - chosen))
                total = cost + c
                if key not in nxt or (total, (*path, cand)) < nxt[key]:
                    nxt[key] = (total, (*path, cand))
        states = nxt
    return list(min(states.values())[1])


# ----------------------------------------------------------------------------------------
# Storage and lookup
# ----------------------------------------------------------------------------------------


def device_name(device: str) -> str:
    """The device model a decision is measured on: the CUDA GPU's name, else the type."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return device


@functools.cache
def flashinfer_version() -> str | None:
    """The installed flashinfer's version (from package metadata, without importing it)."""
    for dist_name in ("flashinfer-python", "flashinfer"):
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def key_for(graph: str, passes: Sequence[Mapping[str, Any]], world_size: int, device: str) -> DecisionKey:
    """The key of a decision for ``graph`` compiled with ``passes`` on this machine."""
    return DecisionKey(
        graph=graph,
        passes=tuple(dict(p) for p in passes),
        world_size=world_size,
        device=device_name(device),
        torch=torch.__version__,
        flashinfer=flashinfer_version(),
    )


def path_for(key: DecisionKey) -> Path:
    """The file of ``key``'s decisions: one per graph, world size and device model."""
    slug = "-".join("".join(c if c.isalnum() else " " for c in key.device.lower()).split()) or "device"
    return decisions_dir() / f"{key.graph[:24]}_w{key.world_size}_{slug}.json"


def save(decision: FuseDecision, path: str | os.PathLike[str] | None = None) -> Path:
    """Write ``decision`` as JSON (atomically: ranks sharing a folder may all write it).
    A folder or file that cannot be written raises :class:`DecisionNotSaved` (an OSError)
    naming the file."""
    target = Path(path) if path is not None else path_for(decision.key)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(decision.to_json(), indent=2) + "\n")
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise DecisionNotSaved(target, exc) from None
    return target


class DecisionNotSaved(OSError):
    """:func:`save` could not write a decision file: ``path`` and why (``reason``)."""

    def __init__(self, path: Path, cause: OSError):
        self.path = path
        self.reason = cause.strerror or str(cause)
        super().__init__(cause.errno, f"cannot write the fuse decision {path}: {self.reason}")

    def __str__(self) -> str:
        return f"cannot write the fuse decision {self.path}: {self.reason}"


def load(path: str | os.PathLike[str]) -> FuseDecision:
    """Read a decision file; raises ValueError naming the file when it is not one: not a
    regular file (a FIFO, a folder: never opened to block), unreadable, or malformed in any
    way (whatever the parser raised, a too deeply nested document included)."""
    path = Path(path)
    try:
        return FuseDecision.from_json(json.loads(_read_regular(path)))
    except Exception as exc:  # every malformed entry alike: ignored with a note by lookups
        raise ValueError(f"{path}: not a valid fuse decision ({type(exc).__name__}: {exc})") from None


def _read_regular(path: Path) -> str:
    """The text of ``path`` when it is a regular file; opened without blocking (a FIFO
    with no writer would wait forever), checked on the opened file, not the name."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ValueError(f"not a regular file ({_kind(mode)})")
    with open(fd, "rb", closefd=True) as f:
        return f.read().decode("utf-8")


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a file"


@dataclasses.dataclass(frozen=True)
class Lookup:
    """What :func:`lookup` found: a decision (None: the tables decide), where it came from
    (``"measured"`` in this process, ``"stored"``, or ``"table"``) and a note for reports
    (the same on every rank, except naming a file that was ignored)."""

    decision: FuseDecision | None
    source: str
    note: str = ""


_measured: dict[Path, FuseDecision] = {}
"""Decisions :func:`~passkit_fusion.tuning.measure.tune_model` measured in this process."""
_enabled: contextvars.ContextVar[bool] = contextvars.ContextVar("passkit_fusion_decisions", default=True)
_file_cache: dict[Path, tuple[tuple[int, int], FuseDecision | str]] = {}
_warned: set[str] = set()


def remember(decision: FuseDecision, path: Path) -> None:
    """Record ``decision`` as measured in this process (lookups then say ``measured``)."""
    _measured[path] = decision


@contextlib.contextmanager
def ignored() -> Iterator[None]:
    """Within the block, compiles ignore measured and stored decisions (the tables decide)."""
    token = _enabled.set(False)
    try:
        yield
    finally:
        _enabled.reset(token)


def enabled() -> bool:
    """Whether decisions are consulted (not inside :func:`ignored`)."""
    return _enabled.get()


def lookup(ctx: CompileContext) -> Lookup:
    """The decision for the graph being compiled (:func:`passkit.compiling.current`) in
    ``ctx`` (world size, device), or why there is none."""
    current = compiling.current()
    if current is None or not enabled():
        return Lookup(None, "table", "")
    key = key_for(current.graph, current.passes, ctx.world_size, ctx.device)
    path = path_for(key)
    measured = _measured.get(path)
    if measured is not None and measured.key == key:
        return Lookup(measured, "measured", f"in this process, {_when(measured)}")
    found = _read(path)
    if found is None:
        return Lookup(None, "table", "no stored decision for this graph")
    if isinstance(found, str):
        return _ignored(path, found)
    difference = found.key.difference(key)
    if difference:
        return _ignored(path, f"{difference}; run the tuning again")
    return Lookup(found, "stored", f"{_when(found)}, in {path.parent}")


def _when(decision: FuseDecision) -> str:
    tuned = decision.tuned
    when = f" {tuned['date']}" if tuned.get("date") else ""
    took = f" in {tuned['seconds']:.0f} s" if "seconds" in tuned else ""
    return f"tuned{when}{took}"


def _ignored(path: Path, why: str) -> Lookup:
    note = f"stored decision {path} ignored: {why}"
    if note not in _warned:
        _warned.add(note)
        log.warning("passkit_fusion: %s; the tables decide", note)
    return Lookup(None, "table", note)


def _read(path: Path) -> FuseDecision | str | None:
    """The decision in ``path`` (memoised by modification time and size), a string saying
    why it is unusable, or None when there is no such file."""
    try:
        stat = path.stat()
    except OSError:
        return None
    stamp = (stat.st_mtime_ns, stat.st_size)
    cached = _file_cache.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    try:
        value: FuseDecision | str = load(path)
    except ValueError as exc:
        value = f"unreadable ({str(exc).removeprefix(f'{path}: ')})"
    _file_cache[path] = (stamp, value)
    return value


# ----------------------------------------------------------------------------------------
# What the passes use
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecidedConstraint(TokenConstraint):
    """A token constraint set by a measured or stored decision; ``source`` shows in
    reports (e.g. why a pass skips in a range)."""

    source: str = dataclasses.field(default="", compare=False)

    def __str__(self) -> str:
        return f"{super().__str__()} ({self.source} decision)" if self.source else super().__str__()


@dataclasses.dataclass(frozen=True)
class Applied:
    """A decision as it applies to one pass: its ``constraint`` (None with ``nowhere``:
    the pass runs in no range), and the :class:`Lookup` it came from."""

    constraint: DecidedConstraint | None
    nowhere: bool
    found: Lookup


class Tunable:
    """Mixin of the passes whose token ranges a measured decision may set.

    The pass keeps its own (tabled) bounds when no decision applies, or when its options
    set ``bounds_options`` explicitly (non-None, ``restrict_tokens=False``)."""

    bounds_options: ClassVar[tuple[str, ...]] = ("min_tokens", "max_tokens")

    def decided(self, ctx: CompileContext, multiple_of: int = 1) -> Applied | None:
        """The decision for this pass in ``ctx``, or None (the tables decide)."""
        if self._explicit_bounds():
            return None
        found = lookup(ctx)
        if found.decision is None:
            return None
        interval = found.decision.interval(self.name)  # type: ignore[attr-defined]
        if interval is None:
            return Applied(None, True, found)
        lo, hi = interval
        first = math.ceil(lo / multiple_of) * multiple_of
        if hi is not None and first > hi:  # no valid count in its interval
            return Applied(None, True, found)
        return Applied(DecidedConstraint(lo, hi, multiple_of, source=found.source), False, found)

    def nowhere_reason(self, ctx: CompileContext) -> str | None:
        """Why the decision leaves this pass out of every range, or None."""
        applied = self.decided(ctx)
        if applied is None or not applied.nowhere:
            return None
        return (
            f"the {applied.found.source} fuse decision runs it in no token range "
            f"({applied.found.decision.summary() if applied.found.decision else ''})"
        )

    def decision_source(self, ctx: CompileContext) -> str:
        """Where this pass's token ranges in ``ctx`` come from, for its report records
        (:attr:`passkit.PassRecord.decision`, ran or skipped): one of :data:`SOURCES`.
        ``"table"`` also when a stored decision was ignored (:meth:`decision_note` says why)."""
        if self._explicit_bounds():
            return "options"
        return lookup(ctx).source

    def decision_note(self, ctx: CompileContext) -> str | None:
        """Which decision this compile's range used and where it came from, for the pass's
        report record; None outside token ranges when nothing was stored or measured."""
        explicit = self._explicit_bounds()
        found = lookup(ctx)
        span = ctx.token_range
        if explicit:
            if found.decision is None:
                return None
            return f"fuse decision: own options ({', '.join(explicit)} set); the {found.source} decision is not applied"
        if found.decision is None:
            ignored = found.note.startswith("stored decision")
            if span is None and not ignored:
                return None  # one compile for every size, nothing tuned: nothing to say
            return "fuse decision: table" + (f" ({found.note})" if found.note else "")
        lo, hi = (span.lo, span.hi) if span is not None else (1, None)
        parts = [
            f"{r.span()}: {label(r.passes)} [{r.source}: {r.detail}]"
            for r in found.decision.ranges
            if r.overlaps(lo, hi)
        ]
        return f"fuse decision: {found.source} ({found.note}): " + "; ".join(parts)

    def decision_identity(self) -> str | None:
        """What the decision in effect adds to the pass's cache identity (None: nothing)."""
        current = compiling.current()
        if current is None or not enabled() or self._explicit_bounds():
            return None
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        states = []
        for path in sorted(decisions_dir().glob(f"{current.graph[:24]}_w{world}_*.json")):
            found = _measured.get(path) or _read(path)
            states.append(f"{path.name}:{found.fingerprint() if isinstance(found, FuseDecision) else found}")
        states += [
            f"{p.name}:{d.fingerprint()}" for p, d in _measured.items() if d.key.graph == current.graph
        ]
        return ",".join(sorted(set(states))) or None

    def identity(self) -> dict[str, Any]:
        ident = super().identity()  # type: ignore[misc]
        decision = self.decision_identity()
        if decision is not None:
            ident["fuse_decision"] = decision
        return ident

    @classmethod
    def unrestricted(cls, options: Mapping[str, Any], max_tokens: int) -> dict[str, Any]:
        """Options under which the pass applies at every token count it can (tuning
        compiles each candidate so); ``max_tokens``: the largest count measured. Nothing
        else changes: ``allreduce_rmsnorm``'s workspace keeps the size a decided range
        would give it (calls above it take the op's unfused path, measured as such)."""
        return {**options, "restrict_tokens": False}

    def _explicit_bounds(self) -> list[str]:
        options = self.options  # type: ignore[attr-defined]
        given = options.model_fields_set
        out = [f for f in self.bounds_options if f in given and getattr(options, f) is not None]
        if getattr(options, "restrict_tokens", True) is False:
            out.append("restrict_tokens=False")
        return out
