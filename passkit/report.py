"""Per-compile reports: what each pass did."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from .hook_failure import HookFailure

NOT_RESTORED = (
    "served from Inductor's cache, but passkit's report cache had no report of it: what the "
    "passes did to this graph is not known (the report cache was cleared, or is kept apart from "
    "Inductor's: PASSKIT_CACHE_DIR)"
)
"""The note of a cache hit whose report was not restored."""


def not_run(diagnostics: list[str]) -> str:
    """The note of a cache hit on what the config asked (``verify=numeric``, ``dump_dir=...``)."""
    return (
        f"not run for this graph: {', '.join(diagnostics)} (served from Inductor's cache: the passes "
        "did not run; it was built in this process, with them)"
    )


Status = Literal["ran", "skipped", "vetoed", "failed", "declined"]
"""``declined``: the pass ran but could not read the graph (an op schema or host version it
does not know) and changed nothing; :attr:`PassRecord.reason` says why."""


@dataclasses.dataclass
class PassRecord:
    name: str
    stage: str
    status: Status = "skipped"
    matches: int = 0
    modified: bool = False
    ms: float = 0.0
    """Time in the pass itself."""
    verify_ms: float = 0.0
    """Time verifying the graph after it (``verify = true``)."""
    nodes_before: int = 0
    nodes_after: int = 0
    reason: str | None = None
    """Why the pass was skipped, vetoed or declined, or the error message when it failed."""
    graph_kind: str | None = None
    """The graph the pass ran on (or was skipped on): ``"torch"`` (pre-grad: Dynamo's graph),
    ``"joint"``, ``"forward"``, ``"backward"`` or ``"inference"``; None where not known. A
    report spanning the forward and the backward graph (AOTAutograd compiles the backward
    with the forward when it saves symbolic sizes for it) holds a post-grad pass once per graph."""
    notes: list[str] = dataclasses.field(default_factory=list)
    reproducer: str | None = None
    """Path of the reproducer written for a failure, when a dump directory is set."""
    decision: str | None = None
    """Where the pass's token-range decision in this compile came from, as the pass says
    (:meth:`~passkit.Pass.decision_source`: a short word it defines, e.g. ``"table"`` or
    ``"stored"``), whether it ran or was skipped; None: the pass does not say. For tools
    that read reports; the details, for people, belong in its notes."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Report:
    """All pass records of one compiled graph, in run order: under passkit's backend, every
    stage's (``pre_grad`` on Dynamo's graph, ``joint``, then the post-grad stages on each
    graph AOTAutograd made of it: the inference graph, or the forward; a backward graph that
    AOTAutograd compiles at the first backward call has a report of its own, which names
    this one)."""

    graph_id: int = 0
    pipeline_uuid: str = ""
    mode: str = "inductor"
    records: list[PassRecord] = dataclasses.field(default_factory=list)
    cache_hit: bool = False
    """Inductor served this graph from its cache: the passes did not run again (their
    effect is in the cached code). ``records`` then holds what they did when the cached code
    was built, when passkit's own report cache still has it (``restored``), else nothing."""
    token_range: str | None = None
    """The token counts this compile serves (a specialization), or None: every size."""
    restored: bool = False
    """``records`` come from passkit's report cache (a cache hit), not from this process."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """Remarks on the compile as a whole (e.g. why it was not specialized by token count)."""
    hook_failures: list[HookFailure] = dataclasses.field(default_factory=list)
    """Plugin hookimpls that raised during this compile (each disabled afterwards; the
    compile went on without it)."""
    graph_kind: str | None = None
    """The graph the passes ran on: ``"inference"``, ``"training"`` (a joint graph and the
    forward and backward graphs made of it: each record says which,
    :attr:`PassRecord.graph_kind`), ``"torch"`` (only pre-grad passes ran: Dynamo's graph),
    or, in a host's report of one graph, ``"forward"``, ``"backward"`` or ``"joint"``; None
    where not known (a cache hit)."""
    compile_s: float | None = None
    """Wall-clock seconds of this graph's whole compile (tracing, passes, code generation),
    when passkit's backend compiled it."""

    def __getitem__(self, name: str) -> PassRecord:
        """The record of pass ``name`` (its first: in a training report a post-grad pass has
        one per graph, see :meth:`record`)."""
        return self.record(name)

    def record(self, name: str, graph_kind: str | None = None) -> PassRecord:
        """The record of pass ``name`` on the graph of ``graph_kind`` (None: its first)."""
        for rec in self.records:
            if rec.name == name and graph_kind in (None, rec.graph_kind):
                return rec
        if graph_kind is not None and name in self:
            kinds = [r.graph_kind for r in self.records if r.name == name]
            raise KeyError(
                f"pass {name!r} has no record on a {graph_kind} graph in this report (it has: {kinds})"
            )
        why = f" ({NOT_RESTORED})" if self.cache_hit and not self.restored else ""
        raise KeyError(f"no pass named {name!r} in this report (have: {self.names()}){why}")

    def __contains__(self, name: object) -> bool:
        return any(rec.name == name for rec in self.records)

    def names(self) -> list[str]:
        return [r.name for r in self.records]

    @property
    def total_ms(self) -> float:
        return sum(r.ms for r in self.records)

    @property
    def failed(self) -> list[PassRecord]:
        return [r for r in self.records if r.status == "failed"]

    @property
    def declined(self) -> list[PassRecord]:
        """Passes that could not read this graph (see :class:`~passkit.PassResult.declined`)."""
        return [r for r in self.records if r.status == "declined"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "graph_id": self.graph_id,
            "pipeline_uuid": self.pipeline_uuid,
            "mode": self.mode,
            "graph_kind": self.graph_kind,
            "cache_hit": self.cache_hit,
            "token_range": self.token_range,
            "restored": self.restored,
            "notes": list(self.notes),
            "hook_failures": [f.to_dict() for f in self.hook_failures],
            "compile_s": self.compile_s,
            "total_ms": round(self.total_ms, 3),
            "passes": [r.to_dict() for r in self.records],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        """The inverse of :meth:`to_dict`."""
        fields = {f.name for f in dataclasses.fields(PassRecord)}
        records = [PassRecord(**{k: v for k, v in r.items() if k in fields}) for r in data.get("passes", [])]
        return cls(
            graph_id=int(data.get("graph_id", 0)),
            pipeline_uuid=str(data.get("pipeline_uuid", "")),
            mode=str(data.get("mode", "inductor")),
            graph_kind=data.get("graph_kind"),
            records=records,
            cache_hit=bool(data.get("cache_hit", False)),
            token_range=data.get("token_range"),
            restored=bool(data.get("restored", False)),
            notes=list(data.get("notes", [])),
            hook_failures=[HookFailure.from_dict(f) for f in data.get("hook_failures", [])],
            compile_s=data.get("compile_s"),
        )

    def format(self) -> str:
        """A table, one row per pass; each column as wide as its widest cell (at least as
        wide as a typical report's, so that reports line up), a ``graph`` column where the
        report spans more than one post-grad graph (training: forward and backward)."""
        where = f", {self.token_range}" if self.token_range else ""
        kind = f", {self.graph_kind} graph" if self.graph_kind not in (None, "inference") else ""
        title = f"passkit report (graph {self.graph_id}, {self.mode}{kind}{where})"
        failures = [f"PLUGIN HOOK FAILED: {f}" for f in self.hook_failures]
        if self.cache_hit and not self.records:
            title += ": served from Inductor's cache; the passes' rewrite is in the cached code"
            skipped = [f"note: {n}" for n in self.notes if n.startswith("not run for this graph")]
            return "\n".join([title, *skipped, *failures])
        if self.cache_hit:
            title += ": served from Inductor's cache; what the passes did when they built it:"
        lines = [title, *(f"note: {n}" for n in self.notes)]
        lines += failures
        lines += _table(self.records)
        compiled = f"; whole compile {self.compile_s:.2f} s" if self.compile_s is not None else ""
        lines.append(f"total {self.total_ms:.2f} ms{compiled}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


_COLUMNS = (  # name, minimum width, right-aligned
    ("pass", 24, False),
    ("stage", 15, False),
    ("graph", 9, False),
    ("status", 8, False),
    ("matches", 7, True),
    ("ms", 9, True),
    ("nodes", 13, True),
)


def _table(records: list[PassRecord]) -> list[str]:
    """The header, its rule and one row per record; the note last, unpadded."""
    post_grad = {r.graph_kind for r in records if r.stage.startswith("post_grad")}
    with_graph = len(post_grad) > 1
    rows = []
    for r in records:
        note = r.reason or "; ".join(r.notes)
        if r.decision:
            note = f"{note} [decision: {r.decision}]".lstrip()
        nodes = f"{r.nodes_before}->{r.nodes_after}" if r.status == "ran" else "-"
        cells = [r.name, r.stage, r.graph_kind or "-", r.status, str(r.matches), f"{r.ms:.2f}", nodes]
        rows.append((cells, note))
    columns = [c for c in _COLUMNS if with_graph or c[0] != "graph"]
    if not with_graph:
        rows = [([c for i, c in enumerate(cells) if i != 2], note) for cells, note in rows]
    widths = [
        max([minimum, len(name), *(len(cells[i]) for cells, _ in rows)])
        for i, (name, minimum, _) in enumerate(columns)
    ]

    def line(cells: list[str], note: str) -> str:
        padded = [
            cell.rjust(width) if right else cell.ljust(width)
            for cell, width, (_, _, right) in zip(cells, widths, columns, strict=True)
        ]
        return f"{' '.join(padded)}  {note}"

    head = line([name for name, _, _ in columns], "note")
    return [head, "-" * len(head), *(line(cells, note) for cells, note in rows)]
