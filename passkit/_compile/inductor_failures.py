"""When Inductor fails on a graph that passkit's passes changed.

Inductor runs passkit's passes inside its compile, then lowers the graph and generates code.
A pass can leave a graph that Inductor cannot lower (``aten::relu() expected at most 1
argument(s)``, ``both a fallback and a decomp for same op``): the error comes out of
``compile_fx``, long after the pass returned, and names no pass.

:func:`guarded` runs one compile (any callable that ends in Inductor: passkit's own
``compile_fx`` call, a framework's compile function, a host's) and watches the reports the
pipeline opens during it. When the compile raises and passes changed a graph in it:

* ``on_error = "skip"`` (the default): those passes are named in a warning, a reproducer
  goes to ``dump_dir`` and the compile runs again with them left out (:func:`left_out`). The
  report of the compile that succeeds records each of them ``failed``, with Inductor's
  message, the passes left out and the reproducer; the failed attempt leaves no report.
* ``on_error = "raise"``: :class:`~passkit.errors.PassFailedError` naming them (pass,
  distribution, what they matched), Inductor's error as its ``__cause__``.

A failure no pass can have caused (no pass changed the graph, or a passkit error such as
``PassFailedError`` raised by a pass) goes through unchanged.

Where passkit owns the compile (``backend="passkit"``, :func:`passkit.backend`) this is
automatic. With :func:`passkit.install` the framework calls Inductor itself: wrap its
compile function with :func:`guard` (``compile_fn = passkit.guard(compile_fn, pipeline)``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .. import logs
from .._pipeline.build import Pipeline
from .._pipeline.dump import graph_folder
from .._pipeline.inductor_state import LeftOut, leaving_out, left_out, opened, watching
from .._pipeline.run import RECENT_REPORTS
from ..dumps import AFTER, BEFORE, snapshots
from ..errors import PassFailedError, PasskitError, describe
from ..pass_base import Stage
from ..report import Report

T = TypeVar("T")

MAX_SINGLE_TRIALS = 3
"""When at most this many passes changed the graph Inductor failed on, each is tried alone
first (last one first), so that a pass that did nothing wrong stays in; otherwise, and when
no single one is the cause, all of them are left out."""


@dataclasses.dataclass(frozen=True)
class Culprit:
    """A pass that changed a graph Inductor then failed on."""

    name: str
    matches: int
    plugin: str | None
    distribution: str | None
    version: str | None

    def __str__(self) -> str:
        if self.distribution:
            origin = f"distribution {self.distribution} {self.version or ''}".strip()
        elif self.plugin:
            origin = f"in-process plugin {self.plugin!r}"
        else:
            origin = "in-process"
        return f"{self.name!r} ({origin}; {self.matches} match(es))"


def guarded(compile_fn: Callable[[], T], pipeline: Pipeline, what: str = "the graph") -> T:
    """Run ``compile_fn()`` (a compile that runs ``pipeline``'s passes inside Inductor);
    when it raises after passes changed the graph, name them and compile again without them
    (``on_error = "skip"``) or raise :class:`PassFailedError` (``"raise"``).

    Which passes are left out: with up to :data:`MAX_SINGLE_TRIALS` passes that changed the
    graph, each alone first (last first), then all of them; the first compile that succeeds
    is returned. A compile that still fails without every one of them fails as Inductor's own
    error."""
    first: _Failure | None = None
    trials: list[list[Culprit]] = []
    trial: list[Culprit] = []
    while True:
        watched: list[Report] = []
        parent = watching.get()
        token = watching.set(watched)
        try:
            with leaving_out(first.left_out(trial) if first else {}):
                result = compile_fn()
        except Exception as exc:
            own = _passkit_error(exc)
            if own is not None and own is not exc:
                raise own from own.__cause__  # a pass's PassFailedError (on_error="raise"), unwrapped
            if first is None:
                culprits = [] if own is not None else _changed_by(watched, pipeline)
                if not culprits:
                    raise
                first = _Failure(exc, culprits, _reproducer(exc, culprits, watched, pipeline))
                _forget(watched, pipeline)
                first.raise_or_warn(pipeline, what)
                trials = _trials(culprits)
            else:
                _forget(watched, pipeline)
                if not trials:
                    raise
            trial = trials.pop(0)
            continue
        finally:
            watching.reset(token)
            if parent is not None:  # a guarded compile inside another: the outer one watches too
                kept = {id(r) for r in pipeline.reports}
                parent.extend(r for r in watched if id(r) in kept)
        if first is not None:
            logs.log.warning("passkit: %s compiled without %s", what, ", ".join(repr(c.name) for c in trial))
        return result


def _trials(culprits: list[Culprit]) -> list[list[Culprit]]:
    """The sets of passes to leave out, in the order tried (see :func:`guarded`)."""
    if len(culprits) == 1 or len(culprits) > MAX_SINGLE_TRIALS:
        return [culprits]
    return [[c] for c in reversed(culprits)] + [culprits]


@dataclasses.dataclass
class _Failure:
    """Inductor's first failure in a guarded compile and the passes that changed the graph."""

    error: Exception
    culprits: list[Culprit]
    reproducer: str | None

    @property
    def message(self) -> str:
        return describe(_inner(self.error))

    def raise_or_warn(self, pipeline: Pipeline, what: str) -> None:
        names = ", ".join(str(c) for c in self.culprits)
        where = f"; reproducer: {self.reproducer}" if self.reproducer else ""
        if pipeline.config.on_error == "raise":
            error = PassFailedError(
                f"Inductor failed on the graph that pass(es) {names} changed: {self.message}{where}. "
                f"(with on_error='skip' passkit compiles the graph again without them)",
                pass_name=self.culprits[-1].name,
                ran_before=[c.name for c in self.culprits[:-1]],
            )
            error.inductor_error = self.error  # torch.compile drops __cause__ of what it re-raises
            raise error from self.error
        logs.log.warning(
            "passkit: Inductor failed on the graph that pass(es) %s changed: %s; compiling %s "
            "again without them%s",
            names,
            self.message,
            what,
            where,
        )

    def left_out(self, trial: list[Culprit]) -> dict[str, LeftOut]:
        """What the compile leaving out ``trial`` records for each of them."""
        together = [c.name for c in trial]
        out = {}
        for name in together:
            others = [n for n in together if n != name]
            with_others = f" (together with {', '.join(others)})" if others else ""
            reason = (
                f"Inductor failed on the graph this pass changed{with_others}: {self.message}; "
                f"compiled again without {', '.join(together)}"
            )
            out[name] = LeftOut(reason, self.reproducer)
        return out


def guard(compile_fn: Callable[..., T], pipeline: Pipeline) -> Callable[..., T]:
    """``compile_fn`` (a framework's compile, which runs Inductor with the config
    :func:`passkit.install` filled) as a function that is :func:`guarded` on each call."""

    @functools.wraps(compile_fn)
    def call(*args: Any, **kwargs: Any) -> T:
        return guarded(lambda: compile_fn(*args, **kwargs), pipeline)

    return call


def _passkit_error(exc: BaseException) -> PasskitError | None:
    """The error passkit raised on purpose that ``exc`` is or wraps (Inductor wraps what a
    custom pass raises in ``InductorError``), e.g. ``PassFailedError`` under
    ``on_error = "raise"``: not Inductor's failure. None otherwise."""
    current: BaseException | None = exc
    for _ in range(10):
        if current is None:
            return None
        if isinstance(current, PasskitError):
            return current
        current = getattr(current, "inner_exception", None) or current.__cause__
    return None


def _inner(exc: BaseException) -> BaseException:
    """The error under Inductor's ``InductorError`` / Dynamo's ``BackendCompilerFailed``."""
    inner = getattr(exc, "inner_exception", None)
    return inner if isinstance(inner, BaseException) else exc


def _changed_by(watched: list[Report], pipeline: Pipeline) -> list[Culprit]:
    """The passes that changed a graph in the watched reports, in run order."""
    found: dict[str, int] = {}
    for report in watched:
        for rec in report.records:
            if rec.status == "ran" and rec.modified:
                found[rec.name] = found.get(rec.name, 0) + rec.matches
    culprits = []
    for name, matches in found.items():
        running = [p for p in pipeline.passes if p.name == name]
        info = pipeline.plugins.info_for(running[0] if running else name)
        plugin = info.plugin if info is not None else None
        culprits.append(
            Culprit(
                name,
                matches,
                plugin.name if plugin else None,
                plugin.distribution if plugin else None,
                plugin.version if plugin else None,
            )
        )
    return culprits


def _forget(watched: list[Report], pipeline: Pipeline) -> None:
    """Drop the reports of the failed attempt (the compile that succeeds reports instead)."""
    gone = {id(r) for r in watched}
    pipeline.reports[:] = [r for r in pipeline.reports if id(r) not in gone]
    kept = [r for r in RECENT_REPORTS if id(r) not in gone]
    RECENT_REPORTS.clear()
    RECENT_REPORTS.extend(kept)


def _reproducer(
    exc: Exception, culprits: list[Culprit], watched: list[Report], pipeline: Pipeline
) -> str | None:
    """Write ``FAILED_inductor.repro.py`` next to the per-pass graph dumps of the graph
    Inductor failed on (the last one the attempt opened); None without ``dump_dir``."""
    if pipeline.config.dump_dir is None or not watched:
        return None
    folder = graph_folder(pipeline.config.dump_dir, watched[-1].graph_id)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # the post-grad graph's snapshots in compile order: the first before a pass, the last after
        shots = snapshots(folder / Stage.PRE.value, folder / Stage.POST.value)
        before = [p for p in shots if p.name.endswith(BEFORE)]
        after = [p for p in shots if p.name.endswith(AFTER)]
        path = folder / "FAILED_inductor.repro.py"
        tb = "".join(traceback.format_exception(_inner(exc), limit=-8))
        passes = [{"name": c.name, **_options(pipeline, c.name)} for c in culprits]
        path.write_text(
            '"""passkit reproducer: Inductor failed on the graph below, which these passes changed:\n'
            + "".join(f"  {c}\n" for c in culprits)
            + "\nRe-run: compile the model with passkit.backend(passes=PASSES, on_error='raise');\n"
            "the graph before the passes and after them are below (per-pass dumps are in this folder).\n\n"
            f'{tb.replace(chr(34) * 3, chr(39) * 3)}"""\n\n'
            f"PASSES = {passes!r}\n\n"
            f"GRAPH_BEFORE_PASSES = {_read(before[0]) if before else None!r}\n\n"
            f"GRAPH_INDUCTOR_FAILED_ON = {_read(after[-1]) if after else None!r}\n"
        )
        return str(path)
    except OSError as exc_io:
        logs.log.warning("passkit: could not write the reproducer in %s: %s", folder, exc_io)
        return None


def _read(path: Path) -> str:
    return path.read_text()


def _options(pipeline: Pipeline, name: str) -> dict[str, Any]:
    for p in pipeline.passes:
        if p.name == name:
            return dict(json.loads(p.options_json()))
    return {}


__all__ = ["Culprit", "LeftOut", "guard", "guarded", "leaving_out", "left_out", "opened"]
