"""Will passkit fuse this model? Build a Hugging Face architecture at laptop sizes with
``tp_plan="auto"`` on a gloo world of TP processes (CPU), compile it with each
tensor-parallel pass, and report per pass: the all-reduces in the graph, the sites
rewritten, why the rest were left (the node chain that stopped the matcher) and the largest
difference from eager.

:func:`check_model` does it for one config; ``passkit explain-hf`` (:mod:`.cli`) and
``benchmarks/coverage.py`` print :func:`format_report`'s table. Random weights, fp32,
``passkit.backend(mode="eager")`` (the passes' rewrite without Inductor code generation;
``mode="inductor"`` compiles it), the reference all-reduce op and ``async_tp``'s test mode:
what is measured is which sites the passes take, not speed.

On GPUs (``world="nccl"``, :data:`GPU_PASSES`): the same model at serving sizes in bf16, the
GPU kernels (flashinfer's fused all-reduce + RMSNorm, the symmetric-memory LayerNorm op) in one
pipeline compiled by Inductor, next to Inductor alone: sites fused per pass and each one's
error against eager beside Inductor's (``benchmarks/coverage.py --gpu``).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from .layout import distributed_layout
from .passes import PASSES

__all__ = ["GPU_PASSES", "PASSES", "FamilyReport", "PassOutcome", "check_model", "format_report"]

GPU_PASSES: dict[str, list[Any]] = {
    "inductor": [],
    "passkit": ["allreduce_rmsnorm", "allreduce_layernorm", "cleanup"],
}
"""The GPU configurations: Inductor alone, and the serving pipeline (each norm pass with its
GPU kernel, ``implementation="auto"``) reported per pass from its one compile."""

_REPORTED_ALONE = ("cleanup",)
"""Passes of a pipeline not reported as a row of their own (they take no all-reduce site)."""

_REJECTED = re.compile(r"^(\d+) candidate\(s\) rejected: (.*)$")
_MERGED = re.compile(r"; (\d+) all-reduce\(s\) merged into a site's")
_COUNTED = re.compile(r"^(.*) \(x(\d+)\)$")


@dataclasses.dataclass
class PassOutcome:
    """One pass configuration on one model (rank 0's view; the ranks agree by construction)."""

    label: str
    all_reduces: int
    """All-reduces the pass saw (its sites plus its rejected candidates), over every graph."""
    rewritten: int
    """All-reduces the pass took: its sites and the all-reduces merged into them
    (``async_tp``: collective + matmul pairs fused)."""
    reasons: dict[str, int]
    """Why the others were left, with counts: the node chain and what stopped the match."""
    max_error: float
    """Largest absolute difference of the logits from eager, over the ranks."""
    graphs: int
    notes: list[str]
    error: str | None = None
    """passkit's own error when this configuration failed (the other passes still report;
    the counts and ``max_error`` are then 0 and mean nothing)."""
    statuses: list[str] = dataclasses.field(default_factory=list)
    """The pass's status in each graph's report (``ran``, ``skipped: flashinfer is not
    installed``...), distinct values in order; empty for Inductor alone."""


@dataclasses.dataclass
class FamilyReport:
    name: str
    config_class: str
    tp: int
    outcomes: list[PassOutcome]
    error: str | None = None
    """Why the model could not be built or run (then ``outcomes`` is empty)."""
    note: str | None = None
    """How the run differed from the defaults (expert parallelism where transformers' TP plan
    leaves the experts out: :mod:`.layout`; eager attention where SDPA did not compile)."""
    norm: str = "?"
    """The kind of norm of its decoder layers: ``RMSNorm``, ``LayerNorm``, both, or ``?``."""
    dp: int = 1
    """Data-parallel replicas (``dp`` groups of ``tp`` ranks each; 1: one TP group)."""
    versions: str = dataclasses.field(default_factory=lambda: versions())
    """The torch and transformers it was checked with (a table may gather reports of several
    runs: ``benchmarks/coverage.py --cache``)."""


def versions() -> str:
    """``"torch 2.13.0+cpu, transformers 5.23.0"``: this process's."""
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


def check_model(
    config: Any,
    *,
    name: str | None = None,
    tp: int = 2,
    tokens: int = 8,
    passes: dict[str, list[Any]] | None = None,
    mode: str = "eager",
    timeout: float = 900.0,
    tracebacks: bool = False,
    world: str = "gloo",
    dtype: str = "float32",
    dp: int = 1,
) -> FamilyReport:
    """Build ``config`` (a small ``PretrainedConfig``: see :func:`.configs.small_config`)
    with random weights, shard it with ``tp_plan="auto"`` on ``tp`` gloo processes and run
    each of ``passes`` (default :data:`PASSES`) on ``tokens`` tokens against eager.
    ``tracebacks``: a rank's error in full rather than its first line.

    ``world="nccl"``: on ``dp * tp`` GPUs (one process each) in ``dtype`` (``"bfloat16"``),
    as ``dp`` data-parallel replicas of a TP group of ``tp`` ranks
    (``DistributedConfig(dp_replicate_size=dp)``); pass :data:`GPU_PASSES`."""
    from ..demo import run_world

    if tp < 2 and dp < 2:
        raise ValueError(f"tp must be >= 2 (got {tp}): the passes rewrite tensor-parallel all-reduces")
    if world not in ("gloo", "nccl"):
        raise ValueError(f"world must be 'gloo' (CPU) or 'nccl' (GPUs), not {world!r}")
    if tokens % tp:
        raise ValueError(f"tokens ({tokens}) must be a multiple of tp ({tp}) for sequence_parallel")
    label = name or type(config).__name__
    folder = Path(tempfile.mkdtemp(prefix="passkit-coverage-"))
    norm = "?"
    try:
        try:
            norm = _save_random_model(config, folder, getattr(torch, dtype))
        except Exception as exc:  # an architecture this transformers cannot build or shard
            error = str(exc) if _without_a_tp_plan(config) else f"cannot build it: {_short(exc)}"
            return FamilyReport(label, type(config).__name__, tp, [], error=error)
        plans = passes or PASSES
        try:
            ranks = run_world(
                _rank,
                world,
                tp * dp,
                args=(str(folder), plans, tokens, mode, tracebacks, dtype, dp),
                timeout=timeout,
            )
        except Exception as exc:
            return FamilyReport(
                label, type(config).__name__, tp, [], error=_rank_error(exc, tracebacks), norm=norm
            )
        errors = [r["error"] for r in ranks if r.get("error")]
        if errors:
            error = errors[0]
            if error.startswith(_EAGER_FAILED):  # before any pass: whose failure is it?
                error = _eager_failure(error, folder, tokens)
            return FamilyReport(label, type(config).__name__, tp, [], error=error, norm=norm)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    outcomes = []
    for i, first in enumerate(ranks[0]["outcomes"]):
        first.max_error = max(r["outcomes"][i].max_error for r in ranks)
        outcomes.append(first)
    return FamilyReport(label, type(config).__name__, tp, outcomes, note=_note(ranks[0]), norm=norm, dp=dp)


_EAGER_FAILED = "the eager forward failed: "


def _eager_failure(error: str, folder: Path, tokens: int) -> str:
    """The sharded model's eager forward (no pass, no compile) failed with ``error``: say
    whether the same model runs in one process without tensor parallelism (then the failure
    is transformers' own tensor-parallel plan's) or fails there too (the model's own)."""
    import transformers

    detail = error.removeprefix(_EAGER_FAILED)
    version = transformers.__version__
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ids = torch.randint(
            0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0)
        )
        with torch.no_grad():
            model(ids, use_cache=False)
    except Exception as exc:
        return f"the model's eager forward fails even without tensor parallelism (no passkit involved): {_short(exc)}"
    return (
        f"transformers {version}'s own tensor-parallel plan (tp_plan='auto') fails in eager, no passkit "
        f"involved (the same model runs without it): {detail}"
    )


def _rank_error(exc: BaseException, full: bool) -> str:
    """A failed world's error as its first failing rank gave it (its exception's last line;
    ``full``: its whole traceback), not only the world's ``2 of 2 ranks failed``."""
    results = getattr(exc, "results", None)
    failed = [r for r in results or () if not getattr(r, "ok", True)]
    if not failed:
        return _short(exc, full=full)
    rank = failed[0]
    if full:
        return rank.describe()
    lines = [t for t in (rank.traceback or "").splitlines() if t.strip() and not t.startswith(" ")]
    return f"rank {rank.rank}: {lines[-1] if lines else rank.error}"


def _save_random_model(config: Any, folder: Path, dtype: torch.dtype = torch.float32) -> str:
    """Build ``config`` with random weights (in ``dtype``) into ``folder``; returns its norm kind."""
    import transformers

    torch.manual_seed(0)
    if why := _without_a_tp_plan(config):
        raise RuntimeError(why)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    return norm_kind(model)


def norm_kind(model: torch.nn.Module) -> str:
    """``RMSNorm``, ``LayerNorm`` or ``RMSNorm+LayerNorm``: the norms of ``model``'s modules,
    by class (``nn.LayerNorm`` and classes named ``*LayerNorm`` without ``RMS``; ``nn.RMSNorm``
    and ``*RMSNorm``/``*RmsNorm``); ``?`` when it has neither."""
    kinds = set()
    for module in model.modules():
        name = type(module).__name__.lower()
        if isinstance(module, torch.nn.RMSNorm) or "rmsnorm" in name:
            kinds.add("RMSNorm")
        elif isinstance(module, torch.nn.LayerNorm) or name.endswith("layernorm"):
            kinds.add("LayerNorm")
    return "+".join(sorted(kinds, reverse=True)) or "?"


def _without_a_tp_plan(config: Any) -> str | None:
    """Why ``tp_plan="auto"`` will not shard ``config``'s decoder, or None."""
    import transformers

    if getattr(config, "base_model_tp_plan", None):
        return None
    return (
        f"{type(config).__name__} has no tensor-parallel plan in transformers {transformers.__version__} "
        "(base_model_tp_plan is empty): tp_plan='auto' shards none of its layers"
    )


def _rank(
    rank: int,
    world_size: int,
    folder: str,
    plans: dict[str, list[Any]],
    tokens: int,
    mode: str,
    full: bool,
    dtype: str = "float32",
    dp: int = 1,
) -> dict:
    """Load the sharded model and run every plan; when ``torch.compile`` fails with the
    default attention (SDPA), once more with eager attention (the all-reduce sites do not
    depend on it), saying so."""
    import os

    os.environ.setdefault("WORLD_SIZE", str(world_size))
    os.environ.setdefault("LOCAL_RANK", str(rank))  # one host: transformers binds GPU LOCAL_RANK
    shape = _Shape(world_size // dp, dp, getattr(torch, dtype))
    first = _run_plans(shape, folder, plans, tokens, mode, full, attention=None)
    if "compile_error" not in first:
        return first
    second = _run_plans(shape, folder, plans, tokens, mode, full, attention="eager")
    if "compile_error" in second:
        return {"error": first["compile_error"]}
    second["attention"] = f"eager attention: with SDPA {first['compile_error']}"
    return second


def _note(rank: dict) -> str | None:
    """How the run differed from the defaults: the experts' layout, eager attention."""
    parts = [rank.get("layout"), rank.get("attention")]
    return "; ".join(p for p in parts if p) or None


@dataclasses.dataclass(frozen=True)
class _Shape:
    """How a rank loads the model: its TP group's size, the data-parallel replicas, the dtype."""

    tp: int
    dp: int
    dtype: torch.dtype


def _run_plans(
    shape: _Shape,
    folder: str,
    plans: dict[str, list[Any]],
    tokens: int,
    mode: str,
    full: bool,
    attention: str | None,
) -> dict:
    import transformers

    import passkit

    layout = distributed_layout(transformers.AutoConfig.from_pretrained(folder), shape.tp, shape.dp)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder,
            distributed_config=transformers.DistributedConfig(**layout.kwargs),
            dtype=shape.dtype,
            **({"attn_implementation": attention} if attention else {}),
        ).eval()
    except Exception as exc:
        return {"error": f"tp_plan='auto' failed: {_short(exc, full=full)}"}
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(next(model.parameters()).device)
    outcomes = []
    with torch.no_grad():
        try:
            eager = model(ids, use_cache=False).logits
        except Exception as exc:
            return {"error": _EAGER_FAILED + _short(exc, full=full)}
        for label, passes in plans.items():
            torch._dynamo.reset()
            backend = passkit.backend(passes=passes, mode=mode, on_error="raise")
            try:
                got = torch.compile(model, backend=backend)(ids, use_cache=False).logits
            except Exception as exc:
                if isinstance(exc, passkit.PasskitError) or isinstance(exc.__cause__, passkit.PasskitError):
                    # passkit's own error for this configuration (its message says what to do):
                    # reported in its row, the other configurations still run
                    failed = PassOutcome(
                        label, 0, 0, {}, 0.0, len(backend.reports), [], error=_short(exc, full=full)
                    )
                    outcomes.append(failed)
                    continue
                return {"compile_error": f"torch.compile failed ({label}): {_short(exc, full=full)}"}
            error = (got.float() - eager.float()).abs().max().item()
            outcomes.extend(_outcome(name, passes, backend, error) for name in _reported(label, passes))
    return {"outcomes": outcomes, "layout": layout.note}


def _pass_names(passes: list[Any]) -> list[str]:
    """The names of a configuration's passes (a name, or a dict with ``"name"``)."""
    return [p if isinstance(p, str) else p["name"] for p in passes]


def _reported(label: str, passes: list[Any]) -> list[str]:
    """The rows a configuration gives: the pass it is named after (the last of
    ``sequence_parallel+async_tp``), each site-taking pass of a pipeline (:data:`GPU_PASSES`'
    ``passkit``), or the label alone for no pass (Inductor)."""
    names = _pass_names(passes)
    if not names or label in names or "+" in label:
        return [label]
    return [n for n in names if n not in _REPORTED_ALONE]


def _outcome(label: str, passes: list[Any], backend: Any, error: float) -> PassOutcome:
    """Read the pass reports of every graph: the pass named ``label`` (a pass of
    ``passes``), else the last pass of ``passes`` (``async_tp`` after ``sequence_parallel``);
    with no passes, only the error (Inductor alone)."""
    if not passes:
        return PassOutcome(label, 0, 0, {}, error, len(backend.reports), [])
    names = _pass_names(passes)
    name = label if label in names else names[-1]
    seen = rewritten = 0
    reasons: dict[str, int] = {}
    notes: list[str] = []
    statuses: list[str] = []
    for report in backend.reports:
        for record in report.records:
            if record.name != name:
                continue
            status = record.status + (f": {record.reason}" if getattr(record, "reason", None) else "")
            if status not in statuses:
                statuses.append(status)
            rewritten += record.matches
            notes.extend(record.notes)
            for note in record.notes:
                if merged := _MERGED.search(note):  # summed into another site: taken too
                    rewritten += int(merged.group(1))
                if match := _REJECTED.match(note):
                    seen += int(match.group(1))
                    for reason in match.group(2).split("; "):
                        counted = _COUNTED.match(reason)
                        text, n = (counted.group(1), int(counted.group(2))) if counted else (reason, 1)
                        reasons[text] = reasons.get(text, 0) + n
    if name != "async_tp":
        seen += rewritten
    return PassOutcome(label, seen, rewritten, reasons, error, len(backend.reports), notes, statuses=statuses)


def _short(exc: BaseException, limit: int = 300, full: bool = False) -> str:
    """The exception's first line, and its cause's (dynamo wraps the real error); the whole
    traceback with ``full``."""
    import traceback

    if full:
        return "".join(traceback.format_exception(exc))
    parts = []
    for err in (exc, exc.__cause__):
        if err is None:
            continue
        lines = [t.strip() for t in str(err).splitlines() if t.strip()]
        parts.append(f"{type(err).__name__}: {lines[0] if lines else _where(err)}".rstrip(": "))
    line = " <- ".join(parts)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _where(exc: BaseException) -> str:
    """For an exception without a message (a bare ``AssertionError``): the model's line it
    came through, ``"in modeling_inkling.py:114 (forward)"``, else ``""``."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/transformers/" in f.filename]
    if not frames:
        return ""
    frame = frames[-1]
    return f"in {Path(frame.filename).name}:{frame.lineno} ({frame.name})"


def format_report(reports: list[FamilyReport]) -> str:
    """A Markdown table: one row per family and pass."""
    lines = [
        "| family | config | pass | all-reduces | rewritten | why the rest were left | max abs error vs eager |",
        "|---|---|---|---|---|---|---|",
    ]
    for report in reports:
        if report.error:
            lines.append(
                f"| {report.name} | {report.config_class} | - | - | - | not run: {report.error} | - |"
            )
            continue
        for o in report.outcomes:
            if o.error:
                lines.append(
                    f"| {report.name} | {report.config_class} | {o.label} | - | - | failed: {o.error} | - |"
                )
                continue
            if o.label.endswith("async_tp"):
                lines.append(
                    f"| {report.name} | {report.config_class} | {o.label} | - | {o.rewritten} | "
                    f"{async_tp_summary(o.notes)} | {o.max_error:.2e} |"
                )
                continue
            why = "; ".join(f"{r} (x{n})" if n > 1 else r for r, n in o.reasons.items()) or "-"
            lines.append(
                f"| {report.name} | {report.config_class} | {o.label} | {o.all_reduces} | {o.rewritten} | "
                f"{why} | {o.max_error:.2e} |"
            )
    notes = [f"* {r.name}: {r.note}" for r in reports if r.note]
    return "\n".join(lines + (["", *notes] if notes else []))


_FUSED = re.compile(r"^(\d+) (all_gather -> matmul|matmul -> reduce_scatter) fused")
_LEFT = re.compile(r"^(\d+) candidate\(s\) left: (.*)$")


def async_tp_summary(notes: list[str]) -> str:
    """``"4 all_gather -> matmul, 2 matmul -> reduce_scatter fused; left: its input is not a
    matmul's output (x3)"``: ``async_tp``'s notes without node names."""
    fused = [f"{m.group(1)} {m.group(2)}" for n in notes if (m := _FUSED.match(n))]
    left: dict[str, int] = {}
    for note in notes:
        if m := _LEFT.match(note):
            for item in m.group(2).split("; "):
                reason = item.split(": ", 1)[-1]
                left[reason] = left.get(reason, 0) + 1
    text = (", ".join(fused) + " fused") if fused else "nothing fused"
    if left:
        text += "; left: " + "; ".join(f"{r} (x{n})" if n > 1 else r for r, n in left.items())
    return text
