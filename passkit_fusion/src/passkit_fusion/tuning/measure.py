"""Measuring fuse decisions on the user's model: :func:`tune_model`.

For a model, a function making its inputs for a token count, and the passes the user
compiles it with, :func:`tune_model` compiles every candidate set of the tunable passes
(Inductor alone, each pass alone, sequence_parallel+async_tp, all of them; see
:func:`default_candidates`) with each pass applying at every token count it can, times each
one at each token count with a :data:`Timer` (default: CUDA-graph replay medians on CUDA,
wall-clock medians on the CPU), takes each rank's median and agrees on the slowest rank's
through :func:`passkit_fusion.collective.exchange`, so every rank decides the same
(:func:`~.decisions.decide`, checked with :func:`~passkit_fusion.collective.agree`).

The decision is stored in :func:`~.decisions.decisions_dir` (every rank writes the same file
atomically) and used by later compiles of the same graph with the same passes, with no
timing. The measuring stops at the first unit (one compile, or one timing) that starts
after ``budget_s``; what was not measured is listed, and those token counts keep the
tables' passes. Collective: every rank of ``group`` calls it with the same arguments.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

import passkit
from passkit import compiling

from . import decisions
from .decisions import Candidate, FuseDecision, label
from .tables import DEFAULT_TUNE_TOKENS

__all__ = [
    "Target",
    "Timer",
    "Trial",
    "TuneResult",
    "cuda_call_timer",
    "cuda_graph_timer",
    "default_candidates",
    "gpu_timer",
    "tune_model",
    "wall_clock_timer",
]


@dataclasses.dataclass(frozen=True)
class Trial:
    """What one timing measures: ``candidate`` (pass names) at ``tokens``, on ``rank``."""

    candidate: Candidate
    tokens: int
    rank: int
    world_size: int


Timer = Callable[[Callable[[], object], Trial], float]
"""``timer(step, trial)`` -> this rank's median microseconds of ``step()`` (one forward of
the compiled candidate on the trial's inputs). Collective when ``step`` is: every rank
calls it in the same order."""


def wall_clock_timer(repeats: int = 5, warmup: int = 1) -> Timer:
    """Median wall-clock microseconds over ``repeats`` calls (CPU runs: tests, plumbing)."""

    def timer(step: Callable[[], object], trial: Trial) -> float:
        for _ in range(warmup):
            step()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)

    return timer


def cuda_graph_timer(replays: int = 100, group: Any = None) -> Timer:
    """Median microseconds of CUDA-graph replays of one step, the ranks lined up by a
    barrier before the replays (see :func:`~.timing.replay_median_us`)."""
    from .timing import replay_median_us

    def timer(step: Callable[[], object], trial: Trial) -> float:
        return replay_median_us(step, replays=replays, before_replays=_barrier(group, trial))

    return timer


def _barrier(group: Any, trial: Trial) -> Callable[[], object] | None:
    """What lines the ranks up before a timing: a barrier on ``group``, None for one rank."""
    import torch.distributed as dist

    return (lambda: dist.barrier(group=group)) if trial.world_size > 1 else None


def cuda_call_timer(calls: int = 100, group: Any = None) -> Timer:
    """Median microseconds of one call, the ranks lined up by a barrier before each (see
    :func:`~.timing.call_median_us`): for candidates compiled with a mode that records CUDA
    graphs itself (``"reduce-overhead"``), whose calls cannot be captured again."""
    from .timing import call_median_us

    def timer(step: Callable[[], object], trial: Trial) -> float:
        return call_median_us(step, calls=calls, before_call=_barrier(group, trial))

    return timer


def records_cuda_graphs(compile_mode: str | None) -> bool:
    """Whether torch.compile's ``mode`` makes Inductor record CUDA graphs (its
    ``triton.cudagraphs`` option: ``"reduce-overhead"``, ``"max-autotune"``)."""
    if compile_mode in (None, "default"):
        return False
    from torch._inductor import list_mode_options

    return bool(list_mode_options(compile_mode).get("triton.cudagraphs", False))


TIMINGS = ("graphs", "calls")


def gpu_timer(compile_mode: str | None, timing: str | None = None, group: Any = None) -> Timer:
    """The timer of candidates on GPUs. ``timing``:

    * ``"graphs"`` (the default without Inductor's CUDA graphs): each forward captured in a
      CUDA graph and replayed (:func:`cuda_graph_timer`): what a program pays that replays
      the compiled model in CUDA graphs of its own (a serving host's captured sizes); the
      host's time per call is not counted;
    * ``"calls"`` (the default with them): each call timed as it runs
      (:func:`cuda_call_timer`), its host time included: what a program pays that calls the
      compiled model without CUDA graphs (a host's prompts beyond its captured sizes), where
      a pass whose ops cost more host time than the graph saves on the GPU loses.

    ``"graphs"`` with a compile mode that records CUDA graphs is a ``ConfigError``: those
    calls replay their own graphs and cannot be captured again."""
    timing = resolve_timing(compile_mode, timing)
    return cuda_call_timer(group=group) if timing == "calls" else cuda_graph_timer(group=group)


def resolve_timing(compile_mode: str | None, timing: str | None) -> str:
    """``timing`` checked against ``compile_mode`` (None: the mode's default), as
    :func:`gpu_timer` takes it; a ``ConfigError`` naming the conflict otherwise."""
    records = records_cuda_graphs(compile_mode)
    if timing is None:
        return "calls" if records else "graphs"
    if timing not in TIMINGS:
        raise passkit.ConfigError(f"tune_model: timing must be one of {TIMINGS}, got {timing!r}")
    if timing == "graphs" and records:
        raise passkit.ConfigError(
            f"tune_model: timing='graphs' with compile_mode={compile_mode!r}: Inductor records CUDA graphs "
            "in that mode, which cannot be captured again; time 'calls' (the default for it)"
        )
    return timing


def default_candidates(tunable: Sequence[str]) -> list[Candidate]:
    """Inductor alone, the full set, each pass alone, and sequence_parallel+async_tp
    (the pair that pays together) when both are configured; in pipeline order."""
    order = {n: i for i, n in enumerate(tunable)}
    out: list[Candidate] = [(), tuple(tunable)]
    out += [(n,) for n in tunable]
    if "sequence_parallel" in order and "async_tp" in order:
        out.append(tuple(sorted(("sequence_parallel", "async_tp"), key=order.__getitem__)))
    seen: list[Candidate] = []
    for c in out:
        if c not in seen:
            seen.append(c)
    return seen


@dataclasses.dataclass
class Target:
    """What ``passkit tune-model`` tunes, built on each rank by the user's factory
    ``factory(rank, world_size, device) -> Target``: the (sharded) model, its inputs per
    token count, the pass list it is compiled with, and optionally how to mark the inputs'
    token dimensions dynamic (see :func:`tune_model`)."""

    model: Any
    inputs: Callable[[int], Sequence[Any]]
    passes: Sequence[str | Mapping[str, Any]]
    mark_dynamic: Callable[[Sequence[Any]], None] | None = None


@dataclasses.dataclass
class TuneResult:
    """What :func:`tune_model` measured and decided."""

    decision: FuseDecision
    paths: list[Path]
    medians_us: dict[int, dict[Candidate, float]]
    """Agreed (slowest rank's) medians per token count and candidate."""
    unmeasured: list[str]
    seconds: float
    candidates: list[Candidate]
    compile_s: dict[Candidate, float] = dataclasses.field(default_factory=dict)
    unsaved: dict[Path, str] = dataclasses.field(default_factory=dict)
    """The decision files that could not be written, and why: the decision still holds in
    this process, and was printed on stderr as the file's JSON."""

    def best(self, tokens: int) -> tuple[Candidate, float] | None:
        """The fastest measured candidate at ``tokens`` and its median."""
        times = self.medians_us.get(tokens)
        if not times:
            return None
        return min(times.items(), key=lambda kv: kv[1])

    def format(self) -> str:
        """The medians, one row per token count, and the decision."""
        names = [label(c) for c in self.candidates]
        head = "| tokens | " + " | ".join(names) + " | decision |"
        lines = [head, "|" + "---|" * (len(names) + 2)]
        for t in sorted(self.medians_us):
            times = self.medians_us[t]
            cells = [f"{times[c]:.1f}" if c in times else "-" for c in self.candidates]
            lines.append(f"| {t} | " + " | ".join(cells) + f" | {label(self.decision.passes_at(t))} |")
        lines += ["", f"decision: {self.decision.summary()}", f"tuning took {self.seconds:.1f} s"]
        if self.unmeasured:
            lines.append("not measured (time budget): " + "; ".join(self.unmeasured))
        return "\n".join(lines)


class _Budget:
    """Measuring units in order, stopping (on every rank alike) after ``budget_s``."""

    def __init__(
        self, budget_s: float, group: Any, units: int, progress: TextIO | None, clock: Callable[[], float]
    ):
        self.budget_s, self.group, self.units, self.progress = budget_s, group, units, progress
        self.clock = clock
        self.start = clock()
        self.done = 0
        self.spent = False
        self.agreed_elapsed = 0.0
        """The slowest rank's elapsed seconds at the last unit (the same on every rank)."""

    def elapsed(self) -> float:
        return self.clock() - self.start

    def agree(self, values: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Every rank's ``values`` plus its elapsed time; marks the budget spent when any
        rank's elapsed time is over it (so all ranks stop at the same unit)."""
        from ..collective import exchange

        mine = {**values, "elapsed": self.elapsed()}
        answers = exchange(self.group, "tune-model", mine) if self.group is not None else [mine]
        self.done += 1
        self.agreed_elapsed = max(a["elapsed"] for a in answers)
        if self.agreed_elapsed >= self.budget_s:
            self.spent = True
        return answers

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.write(
                f"passkit tune [{self.done:>3}/{self.units}] {self.elapsed():6.1f}/{self.budget_s:g} s  {text}\n"
            )
            self.progress.flush()


def tune_model(
    model: torch.nn.Module | Callable[..., Any],
    inputs: Callable[[int], Sequence[Any]],
    passes: Sequence[str | Mapping[str, Any]],
    *,
    token_counts: Sequence[int] = DEFAULT_TUNE_TOKENS,
    budget_s: float = 600.0,
    candidates: Sequence[Sequence[str]] | None = None,
    timer: Timer | None = None,
    margin: float = decisions.DEFAULT_MARGIN,
    mark_dynamic: Callable[[Sequence[Any]], None] | None = None,
    group: Any = None,
    mode: str = "inductor",
    compile_mode: str | None = None,
    timing: str | None = None,
    save: bool = True,
    progress: bool | TextIO = True,
    clock: Callable[[], float] = time.monotonic,
) -> TuneResult:
    """Measure the candidate pass sets on ``model`` and store the per-range decision.

    ``inputs(tokens)``: the model's positional arguments for a step of ``tokens`` tokens;
    ``mark_dynamic(args)`` marks their token dimensions dynamic before the compile (default:
    dim 0 of every tensor argument) — compile later with the same marks, or the graph (and
    so the decision's key) differs. ``passes``: the passkit pass list the model is compiled
    with later (entries as in ``passkit.backend(passes=...)``); its fusion passes are tuned,
    the others run in every candidate. ``candidates``: sets of tunable pass names (default
    :func:`default_candidates`). ``mode``: passkit's (``"inductor"`` or ``"eager"``);
    ``compile_mode``: torch.compile's for every candidate (``"reduce-overhead"``: Inductor's
    CUDA graphs; the default timer then times calls, :func:`cuda_call_timer`, instead of
    capturing them). ``timing``: how the default GPU timer times a candidate (see
    :func:`gpu_timer`): ``"graphs"``, ``"calls"``, None for the compile mode's own way.
    ``group``: the process group (default: the world when
    torch.distributed is initialised). ``progress``: a line per unit on rank 0's stderr
    (or the given stream). ``clock``: what the budget is measured with (seconds; tests
    inject one). Resets Dynamo between candidates.
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    if group is None and distributed:
        group = dist.group.WORLD
    rank = dist.get_rank(group) if distributed else 0
    world = dist.get_world_size(group) if distributed else 1
    counts = sorted(set(int(t) for t in token_counts))
    if not counts or counts[0] < 1:
        raise passkit.ConfigError(f"tune_model: token_counts must be positive integers, got {counts}")
    entries = [{"name": e} if isinstance(e, str) else dict(e) for e in passes]
    pipeline = passkit.build_pipeline(passes=entries)
    tunable = [p.name for p in pipeline.passes if isinstance(p, decisions.Tunable)]
    if not tunable:
        raise passkit.ConfigError(
            f"tune_model: none of the passes {pipeline.names()} is tunable "
            "(allreduce_rmsnorm, sequence_parallel, async_tp, allreduce_overlap)"
        )
    timing = resolve_timing(compile_mode, timing)  # checked on every device, before any compile
    cands = _candidates(candidates, tunable)
    device = _device(inputs(counts[0]))
    if timer is None and device == "cuda":
        timer = gpu_timer(compile_mode, timing, group)
    timer = timer or wall_clock_timer()
    stream = None if rank != 0 or progress is False else (sys.stderr if progress is True else progress)
    budget = _Budget(budget_s, group, len(cands) * (1 + len(counts)), stream, clock)
    multiple = world if "sequence_parallel" in tunable else 1
    medians: dict[int, dict[Candidate, float]] = {}
    unmeasured: dict[Candidate, list[int]] = {}
    compile_s: dict[Candidate, float] = {}
    failed: dict[Candidate, str] = {}
    graphs: list[str] = []
    classes = {p.name: type(p) for p in pipeline.passes}
    mark = mark_dynamic or _mark_dim0
    t0 = max(8 * world, 8)
    try:
        for cand in cands:
            if budget.spent:
                unmeasured[cand] = counts
                continue
            cand_entries = [
                classes[e["name"]].unrestricted({k: v for k, v in e.items() if k != "name"}, counts[-1])  # type: ignore[attr-defined]
                | {"name": e["name"]}
                if e["name"] in cand
                else e
                for e in entries
                if e["name"] in cand or e["name"] not in tunable
            ]
            start = time.monotonic()
            error = None
            try:
                fn, seen = _compile(model, cand_entries, mode, inputs(t0), mark, compile_mode)
            except Exception as exc:  # one candidate failing must not cost the others
                error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
                seen = []
            compile_s[cand] = time.monotonic() - start
            errors = [(r, a["error"]) for r, a in enumerate(budget.agree({"error": error})) if a["error"]]
            if errors:
                failed[cand] = f"rank {errors[0][0]}: {errors[0][1]}"
                budget.say(f"{label(cand)} failed to compile ({failed[cand]}): not measured")
                torch._dynamo.reset()
                continue
            budget.say(f"compiled {label(cand)} in {compile_s[cand]:.1f} s")
            for t in counts:
                if budget.spent:
                    unmeasured.setdefault(cand, []).append(t)
                    continue
                applicable = "sequence_parallel" not in cand or t % multiple == 0
                us = -1.0
                if applicable:
                    args = inputs(t)
                    with torch.no_grad():  # the timer warms up (lazy workspaces, recompiles)
                        us = float(timer(lambda fn=fn, args=args: fn(*args), Trial(cand, t, rank, world)))
                answers = budget.agree({"us": us})
                agreed = max(a["us"] for a in answers)
                if min(a["us"] for a in answers) >= 0:
                    medians.setdefault(t, {})[cand] = agreed
                    base = medians[t].get(())
                    ratio = f" ({base / agreed:.2f}x Inductor)" if base else ""
                    budget.say(f"{label(cand):<44} {t:>6} tokens {agreed:10.1f} us{ratio}")
                else:
                    budget.say(f"{label(cand):<44} {t:>6} tokens  n/a (not a multiple of {multiple})")
            # every graph Dynamo made, those of the sizes it specialized while timed too (a
            # 1-token call recompiles): each gets the decision, or its compiles find none
            graphs.extend(g for g in dict.fromkeys(seen) if g not in graphs)
            torch._dynamo.reset()
    except Exception as exc:  # the peers stop waiting for this rank at once
        if group is not None and world > 1:
            from ..collective import report_failure

            report_failure(group, f"tune_model failed: {type(exc).__name__}: {exc}")
        raise
    seconds = budget.agreed_elapsed
    table = _table_sets(pipeline, tunable, inputs(counts[0]))
    ranges = decisions.decide(medians, counts, table, margin)
    left = [f"{label(c)} at {_spans(ts)} tokens" for c, ts in unmeasured.items() if ts]
    left += [f"{label(c)}: failed to compile on {why}" for c, why in failed.items()]
    if not graphs:
        raise RuntimeError("tune_model: the model compiled no graph (nothing to key the decision by)")
    identities = compiling.pass_identities(pipeline)
    stored: list[FuseDecision] = []
    for g in graphs:
        key = decisions.key_for(g, identities, world, device)
        stored.append(
            FuseDecision(
                key,
                ranges,
                medians_us={t: {label(c): v for c, v in m.items()} for t, m in medians.items()},
                unmeasured=tuple(left),
                tuned={
                    "date": time.strftime("%Y-%m-%d"),
                    "seconds": round(seconds, 1),
                    "budget_s": budget_s,
                    "margin": margin,
                    "token_counts": counts,
                    "candidates": [label(c) for c in cands],
                    "timer": getattr(timer, "__qualname__", type(timer).__name__),
                },
            )
        )
    if group is not None and world > 1:
        from ..collective import agree

        # the graphs may differ per rank (rank-dependent constants): the rest must not
        key = {k: v for k, v in stored[0].key.to_json().items() if k != "graph"}
        agree(group, "tune-model-decision", {"ranges": stored[0].to_json()["ranges"], "key": key})
    paths = []
    unsaved: dict[Path, str] = {}
    for decision in stored:
        path = decisions.path_for(decision.key)
        if save:
            try:
                decisions.save(decision, path)
            except decisions.DecisionNotSaved as exc:  # the measurement stays usable: kept, said
                unsaved[path] = exc.reason
                sys.stderr.write(
                    f"passkit tune: rank {rank}: cannot write {path} ({exc.reason}); the decision holds "
                    "in this process only. To keep it, write this JSON to that file (or tune again with "
                    f"PASSKIT_CACHE_DIR set to a folder you can write):\n"
                    f"{json.dumps(decision.to_json(), indent=2)}\n"
                )
        decisions.remember(decision, path)
        paths.append(path)
    result = TuneResult(stored[0], paths, medians, left, seconds, cands, compile_s, unsaved)
    if stream is not None:
        stream.write(f"passkit tune: {stored[0].summary()} ({seconds:.1f} s)\n")
        if left:
            stream.write("passkit tune: not measured (time budget): " + "; ".join(left) + "\n")
        for path in paths if save else []:
            if path not in unsaved:
                stream.write(f"passkit tune: wrote {path}\n")
    return result


def _candidates(given: Sequence[Sequence[str]] | None, tunable: list[str]) -> list[Candidate]:
    if given is None:
        return default_candidates(tunable)
    order = {n: i for i, n in enumerate(tunable)}
    out: list[Candidate] = [()]
    for c in given:
        unknown = [n for n in c if n not in order]
        if unknown:
            raise passkit.ConfigError(
                f"tune_model: candidate {list(c)} names passes not in the tuned pipeline: {unknown} "
                f"(tunable here: {tunable})"
            )
        cand = tuple(sorted(set(c), key=order.__getitem__))
        if cand not in out:
            out.append(cand)
    return out


def _device(args: Sequence[Any]) -> str:
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type != "cpu":
            return a.device.type
    return "cpu"


def _mark_dim0(args: Sequence[Any]) -> None:
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            torch._dynamo.mark_dynamic(a, 0)


def _compile(
    model: Any,
    entries: list[dict[str, Any]],
    mode: str,
    example: Sequence[Any],
    mark: Callable[[Sequence[Any]], None],
    compile_mode: str | None = None,
) -> tuple[Callable[..., Any], list[str]]:
    """``model`` compiled with passkit and ``entries`` (stored decisions ignored) in
    torch.compile's ``compile_mode``, called once on ``example``; also the fingerprints of
    the graphs Dynamo handed the backend."""
    torch._dynamo.reset()
    backend = passkit.backend(passes=entries, mode=mode)
    seen: list[str] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        seen.append(compiling.fingerprint(gm, example_inputs))
        with decisions.ignored(), compiling.scope(gm, example_inputs, backend.pipeline):
            return backend(gm, example_inputs, **kwargs)

    fn = torch.compile(model, backend=capture, mode=compile_mode)
    mark(example)
    with torch.no_grad(), decisions.ignored():
        fn(*example)
    return fn, seen


def _table_sets(
    pipeline: passkit.Pipeline, tunable: list[str], example: Sequence[Any]
) -> Callable[[int], Candidate]:
    """Per token count, the tunable passes whose own (tabled) bounds include it."""
    ctx = passkit.CompileContext.detect(example)
    bounds = {}
    with decisions.ignored():
        for p in pipeline.passes:
            if p.name in tunable and not p.skip_reason(ctx):
                bounds[p.name] = p.token_constraint(ctx)

    def table(tokens: int) -> Candidate:
        return tuple(
            n
            for n in tunable
            if n in bounds
            and (
                bounds[n] is None
                or (
                    bounds[n].min_tokens <= tokens
                    and (bounds[n].max_tokens is None or tokens <= bounds[n].max_tokens)
                )
            )
        )

    return table


def _spans(counts: Sequence[int]) -> str:
    counts = sorted(counts)
    return f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}..{counts[-1]}"
