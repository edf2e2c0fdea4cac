"""Running a pipeline: the passes on each graph Inductor (or the backend) compiles.

:class:`Runner` is what a :class:`passkit.Pipeline` does once built (built by
:mod:`passkit._pipeline.build`): per stage, the plan hook, then each pass under
instrumentation (hooks, skips, the checks that follow the graph, dumps, failures
isolated), and one report per graph. It gives Inductor one ``CustomGraphPass`` per stage
(:class:`StagePass`); all share the pipeline's ``uuid()``, computed once from every pass's
identity, so Inductor's FX graph cache stays correct and cheap.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import itertools
import time
import weakref
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from .. import logs, rewrite_counter
from .._plugins import hooks
from .._plugins.hook_returns import veto_reason
from ..context import CompileContext, Mode, graph_kind_of
from ..errors import ConfigError, PassFailedError, VerificationError, cut_repr, describe
from ..graph_utils import carry_node_attributes, count_nodes, graph_code, recorded_value, restore
from ..names import same_pass
from ..pass_base import Pass, PassResult, Stage, stage_phase
from ..pipeline_plan import PipelinePlan
from ..report import NOT_RESTORED, PassRecord, Report, not_run
from ..tokens import PassRelations, TokenRange
from . import (
    graph_diff,
    inductor_state,
    input_mutation,
    module_state,
    numeric_check,
    output_check,
    schema_check,
)
from .baseline import Baseline, Baselines
from .declined import warn_declined, warn_skipped
from .dump import Dumper
from .verify import verify_graph

if TYPE_CHECKING:
    from .._plugins.registry import PluginSet
    from ..config import Config

_graph_ids = itertools.count(1)
RECENT_REPORTS: deque[Report] = deque(maxlen=64)
"""The reports of the last compiled graphs in this process, newest last."""


def last_report() -> Report | None:
    """The report of the most recently compiled graph in this process (under passkit's
    backend: every stage's records of that compile); None when no graph was compiled with a
    pass enabled (the backend warns once when none is)."""
    return RECENT_REPORTS[-1] if RECENT_REPORTS else None


# ---------------------------------------------------------------------------------------
# the pipeline


_framework_range: contextvars.ContextVar[TokenRange | None] = contextvars.ContextVar(
    "passkit_compile_range", default=None
)


@contextlib.contextmanager
def compile_range(lo: int, hi: int | None = None, multiple_of: int = 1) -> Iterator[TokenRange]:
    """Within the block, compiles through passkit serve token counts ``lo..hi`` only
    (``hi=None``: no upper bound): passes whose token constraint does not hold there skip.

    For frameworks with their own backend that compile per size or range (piecewise CUDA
    graphs): wrap each range's compile in it; the pipeline's cache identity includes it.
    """
    token_range = TokenRange(lo, hi, multiple_of)
    for field, value in (("lo", lo), ("multiple_of", multiple_of)) + (
        (("hi", hi),) if hi is not None else ()
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"compile_range: {field} must be a positive integer, got {value!r}")
    if hi is not None and hi < lo:
        raise ConfigError(f"compile_range: empty range {lo}..{hi}")
    reset = _framework_range.set(token_range)
    try:
        yield token_range
    finally:
        _framework_range.reset(reset)


class Runner:
    """What a built pipeline does with graphs: runs its passes on each, stage by stage,
    with the instrumentation around them. :class:`passkit.Pipeline` is one; it sets the
    attributes below when it is built."""

    config: Config
    plugins: PluginSet
    passes: list[Pass]
    relations: PassRelations
    left_out: dict[str, str]
    token_range: TokenRange | None
    range_label: str | None
    note: str | None
    reports: list[Report]
    stages: list[Stage]
    driven: tuple[Stage, ...]
    host: str
    _uuid: str
    _open: tuple[weakref.ref[torch.fx.GraphModule], Report] | None
    _compile_report: Report | None = None
    """The one report of the backend compile under way (:meth:`collecting`), else None."""

    # -- identity --------------------------------------------------------------------
    def uuid(self) -> str:
        """The cache identity: passes, their versions and options, the token range, and the
        passes this compile runs without because they failed (their own code raised, or
        Inductor failed on the graph they changed)."""
        framework = _framework_range.get() if self.token_range is None else None
        uuid = (
            self._uuid
            if framework is None
            else hashlib.sha256(f"{self._uuid}:{framework}".encode()).hexdigest()
        )
        failed = sorted({*inductor_state.left_out(), *(p.name for p in self.passes if p.code_failure)})
        if failed:
            uuid = hashlib.sha256(f"{uuid}:failed:{','.join(failed)}".encode()).hexdigest()
        if self.config.bisect_limit is not None:  # what a compile does depends on what came before it
            limit = f"{uuid}:bisect:{self.config.bisect_limit}:{rewrite_counter.NONCE}"
            uuid = hashlib.sha256(limit.encode()).hexdigest()
        diagnostics = self.diagnostics()
        if diagnostics:  # asked for in this process: done here, never served from another's compile
            asked = f"{uuid}:diagnostics:{','.join(diagnostics)}:{rewrite_counter.NONCE}"
            uuid = hashlib.sha256(asked.encode()).hexdigest()
        return uuid

    def diagnostics(self) -> list[str]:
        """The checks and dumps this config asks of every compile (``verify``, ``dump_dir``):
        part of the cache identity with the process, so a compile is never served from a
        cache (Inductor's, AOTAutograd's, a host's) filled by a process that did not do them;
        a graph served from this process's own cache says they did not run again
        (:meth:`record_cache_hit`)."""
        asked = []
        if self.config.verify:
            asked.append(f"verify={self.config.verify}")
        if self.config.dump_dir is not None:
            asked.append(f"dump_dir={self.config.dump_dir}")
        return asked

    def current_range(self) -> TokenRange | None:
        """The token range of the compile under way (own, or a framework's)."""
        return self.token_range if self.token_range is not None else _framework_range.get()

    def _range_label(self) -> str | None:
        if self.token_range is not None:
            return self.range_label
        framework = _framework_range.get()
        return str(framework) if framework else None

    # -- Inductor integration ----------------------------------------------------------
    def custom_pass(self, stage: Stage) -> StagePass:
        return StagePass(self, stage)

    def inductor_patches(self, joint: bool = False) -> dict[str, Any]:
        """Inductor config entries that install this pipeline (empty when no pass): its
        post-grad stages, and with ``joint`` its joint stage (``joint_custom_pre_pass``).
        The pre-grad stage is never installed in Inductor: passkit's backend runs it."""
        keys = {Stage.PRE: "post_grad_custom_pre_pass", Stage.POST: "post_grad_custom_post_pass"}
        if joint:
            keys[Stage.JOINT] = "joint_custom_pre_pass"
        return {keys[s]: self.custom_pass(s) for s in self.host_stages(joint) if s in keys}

    def host_stages(self, joint: bool = False) -> list[Stage]:
        """The stages a host installs (post-grad, and with ``joint`` the joint one). With
        none but passes at stages the host does not run, ``post_grad_post`` all the same:
        its report says why those passes are skipped, instead of dropping them silently."""
        wanted = [s for s in self.stages if stage_phase(s) == "post_grad" or (joint and s is Stage.JOINT)]
        if not self.stages_of("post_grad") and any(p.stage not in self.driven for p in self.passes):
            wanted.append(Stage.POST)
        return wanted

    def stages_of(self, phase: str) -> list[Stage]:
        """This pipeline's stages that run on the graph of ``phase`` (see
        :func:`passkit.pass_base.stage_phase`)."""
        return [s for s in self.stages if stage_phase(s) == phase]

    # -- running -----------------------------------------------------------------------
    def run(
        self, gm: torch.fx.GraphModule, mode: Mode = "inductor", *, graph_kind: str | None = None, **ctx: Any
    ) -> Report:
        """Run the post-grad stages on ``gm`` (hosts, the eager path and tests); passes at
        a stage the driver of this pipeline does not run are reported skipped."""
        report: Report | None = None
        for stage in self.stages_of("post_grad"):
            report = self.run_stage(gm, stage, mode=mode, graph_kind=graph_kind, **ctx)
        if report is None and not any(p.stage not in self.driven for p in self.passes):
            return Report(mode=mode, graph_kind=graph_kind)  # no post-grad pass, nothing to say
        if report is None:  # only passes at stages the host does not run: say so
            report = self._report_for(gm, Stage.POST, mode, graph_kind or graph_kind_of(gm))
            self._not_driven(report)
            self._finish(report, None)
        return report

    def run_stage(
        self,
        gm: torch.fx.GraphModule,
        stage: Stage,
        mode: Mode = "inductor",
        *,
        graph_kind: str | None = None,
        example_inputs: Any = None,
        compiler: str | None = None,
    ) -> Report:
        """Run the passes of ``stage`` on ``gm``; ``graph_kind`` (else read from the graph,
        see :func:`passkit.context.graph_kind_of`), ``example_inputs`` (else the
        placeholders' fake values) and ``compiler`` go to the passes' context."""
        phase = stage_phase(stage)
        if graph_kind is None:
            graph_kind = "torch" if phase == "pre_grad" else graph_kind_of(gm, joint=phase == "joint")
        report = self._report_for(gm, stage, mode, graph_kind)
        if phase == "pre_grad" and _trains(gm):
            report.graph_kind = "training"  # autograd follows: the title says so
            if not self.stages_of("joint") + self.stages_of("post_grad"):
                report.notes.append(PRE_GRAD_ONLY_TRAINING)
        fields: dict[str, Any] = {"graph_kind": graph_kind, "stage": stage.value}
        fields["compiler"] = compiler or ("inductor" if mode == "inductor" else "aot_eager")
        if example_inputs is not None:
            ctx = CompileContext.detect(example_inputs, mode=mode, token_range=self.current_range(), **fields)
        else:
            ctx = CompileContext.from_graph(gm, mode=mode, token_range=self.current_range(), **fields)
        plan = PipelinePlan([p for p in self.passes if p.stage == stage])
        self._hook("passkit_configure_pipeline", report, None, plan.checkpoint, plan=plan, context=ctx)
        dumper = Dumper(self.config.dump_dir, report.graph_id) if self.config.dump_dir else None
        skipped = self._range_skips(ctx)
        baselines = Baselines(gm, recheck=self._hooks_between_passes())
        for p in plan.passes:
            record = self._run_one(p, gm, ctx, plan, report, dumper, skipped, baselines)
            report.records.append(record)
        if stage == (self.stages_of(phase) or [stage])[-1]:
            if phase == "post_grad":
                self._not_driven(report)
            self._finish(report, dumper)
        return report

    def _not_driven(self, report: Report) -> None:
        """Record the passes at a stage the driver of this pipeline does not run."""
        for p in self.passes:
            if p.stage not in self.driven and p.name not in report:
                report.records.append(
                    PassRecord(
                        name=p.name,
                        stage=p.stage.value,
                        reason=f"stage {p.stage.value} is not run by {self.host}, which runs the "
                        "post-grad stages only; pre_grad and joint passes run under passkit's own "
                        "backend (passkit.backend(...) or backend='passkit')",
                    )
                )

    def _report_for(
        self, gm: torch.fx.GraphModule, stage: Stage, mode: Mode, graph_kind: str | None
    ) -> Report:
        """The report of this compile of ``gm``: the report of the :meth:`collecting` block
        under way, else the one a stage before ``stage`` of the same phase opened (keyed by the
        module: a pass may have installed a new graph in it), else a new one."""
        if self._compile_report is not None:
            return self._compile_report
        phase_stages = self.stages_of(stage_phase(stage))
        first = phase_stages[0] if phase_stages else stage
        if stage != first and self._open is not None and self._open[0]() is gm:
            return self._open[1]
        report = self._new_report(mode, graph_kind=graph_kind)
        self._open = (weakref.ref(gm), report)
        inductor_state.opened(report)
        forward = _COMPILE_REPORTS.get(_compile_id() or "") if graph_kind == "backward" else None
        if forward is not None:
            report.notes.append(
                f"the backward graph of graph {forward}: AOTAutograd compiles it at its first "
                f"backward call, after graph {forward}'s report was made"
            )
        return report

    def _range_skips(self, ctx: CompileContext) -> dict[str, str]:
        """Passes that do not run in this compile because of its token range, with why:
        what the token-range plan left out, else (a framework's range) each pass's own
        constraint, then passes whose sites an earlier pass takes or without the rewrite they
        act on."""
        if self.left_out or ctx.token_range is None:
            return dict(self.left_out)
        outside = {p.name: why for p in self.passes if (why := _outside_range(p, ctx))}
        runnable = [
            p.name for p in self.passes if p.name not in outside and p.checked_skip_reason(ctx) is None
        ]
        _, dropped = self.relations.effective(runnable)
        return {**outside, **{n: f"{why} (tokens {ctx.token_range})" for n, why in dropped.items()}}

    def _nothing_to_act_on(self, p: Pass, report: Report) -> str | None:
        """Why ``p`` (which acts on another pass's rewrite) has nothing to do on this graph."""
        deps = self.relations.depends_on.get(p.name)
        if not deps or any(r.name in deps and r.modified for r in report.records):
            return None
        return f"acts on the rewrite of {' or '.join(deps)}, which did not change this graph"

    def _run_one(
        self,
        p: Pass,
        gm: torch.fx.GraphModule,
        ctx: CompileContext,
        plan: PipelinePlan,
        report: Report,
        dumper: Dumper | None,
        range_skips: dict[str, str],
        baselines: Baselines,
    ) -> PassRecord:
        record = PassRecord(
            name=p.name,
            stage=p.stage.value,
            graph_kind=ctx.graph_kind,
            decision=p.checked_decision_source(ctx),
        )
        dropped = inductor_state.left_out().get(p.name)
        if dropped is not None:  # Inductor failed on the graph it changed: compiled without it
            record.status, record.reason, record.reproducer = "failed", dropped.reason, dropped.reproducer
            return record
        chosen = plan.skipped.get(p.name) or p.graph_kind_skip(ctx) or range_skips.get(p.name)
        own = None if chosen else p.checked_skip_reason(ctx)  # the pass's own: every graph alike
        reason = chosen or own or self._nothing_to_act_on(p, report)
        if p.code_failure is not None:  # its skip_reason, token_constraint or decision_source raised
            before_code = graph_code(gm) if dumper else ""
            return self._failed(
                p, gm, p.code_failure, record, report, dumper, len(report.records) + 1, before_code
            )
        if reason:
            record.reason = reason
            if own:
                warn_skipped(p.name, self._origin(p), own)
            logs.log.info("passkit: %s skipped: %s", p.name, reason)
            return record
        answers = self._hook("passkit_before_pass", report, p, None, pass_=p, gm=gm, context=ctx)
        vetoes = [why for why in map(veto_reason, answers) if why]
        if vetoes:  # every plugin's: one plugin's "no veto" hides no other's
            record.status, record.reason = "vetoed", "; ".join(vetoes)
            return record
        record.nodes_before = count_nodes(gm.graph)
        baseline = baselines.before_pass()  # kept from the last pass if it changed nothing
        saved = baseline.saved
        before_code = graph_code(gm) if dumper else ""
        index = len(report.records) + 1
        start = time.perf_counter()
        limit = self.config.bisect_limit
        scope = None
        try:
            if limit is None or p.required:  # a required pass's rewrites are never counted nor refused
                result = _as_result(p.run(gm, ctx), p)
            else:
                with rewrite_counter.counting(
                    limit, p.name, p.stage.value, _graph_label(report, ctx.graph_kind), gm=gm
                ) as scope:
                    result = _as_result(p.run(gm, ctx), p)
            record.ms = (time.perf_counter() - start) * 1e3
            # the graph the module holds now: a pass may have installed a new one
            graph = gm.graph
            if graph is not baselines.graph_object:
                carry_node_attributes(graph, saved)  # Dynamo's node attributes, which it lacks
            change = graph_diff.measure(graph, baseline.fingerprint, saved)  # never the pass's own flag
            module_change = baseline.module.changed(gm)  # attributes, buffers, constants
            whole = scope is not None and change.modified and not scope.asked  # counted as one rewrite
            if whole and scope is not None and not rewrite_counter.count_whole_pass(scope).allowed:
                baselines.restore()
                record.status, record.matches = "ran", 0
                record.notes = [_refused_note(scope)]
                record.nodes_after = record.nodes_before
                return record
            verified = time.perf_counter()
            result.notes.extend(self._guards(gm, baseline, change, p.name, bool(module_change)))
            if self.config.verify:
                record.verify_ms = (time.perf_counter() - verified) * 1e3
        except BaseException as exc:  # SystemExit too: a pass must not end the process
            if isinstance(exc, KeyboardInterrupt):
                raise
            record.ms = record.ms or (time.perf_counter() - start) * 1e3
            lost = baselines.restore()  # the module's state, the graph object and the code that runs
            return self._failed(p, gm, exc, record, report, dumper, index, before_code, ctx, lost)
        baselines.after_pass(change, bool(module_change))
        if change.modified:
            gm.recompile()
        modified = change.modified or bool(module_change)
        if module_change and not change.modified:
            result.notes.append(f"changed the graph module, not its nodes: {', '.join(module_change[:5])}")
        if modified != result.modified:
            result.notes.append(
                f"returned modified={result.modified}, but the graph "
                + ("changed" if modified else "did not change")
            )
            result.modified = modified
        if scope is not None and scope.refused:
            result.notes.append(_refused_note(scope))
        record.status = "ran"
        record.matches, record.modified, record.notes = result.matches, result.modified, result.notes
        if result.declined:
            record.status, record.reason = "declined", str(result.declined)
            warn_declined(p.name, self._origin(p), record.reason)
        record.nodes_after = count_nodes(graph)
        if dumper and self._dumped(p, changed=record.modified):
            dumper.pass_graphs(index, p.name, p.stage.value, before_code, graph_code(gm))
        self._after_pass(p, gm, result, record, report)
        logs.log.debug("passkit: %s ran: %d matches in %.2f ms", p.name, record.matches, record.ms)
        return record

    def _guards(
        self,
        gm: torch.fx.GraphModule,
        baseline: Baseline,
        change: Any,
        name: str,
        module_changed: bool = False,
    ) -> list[str]:
        """The checks of a change to ``gm``'s graph (and, ``module_changed``, its module's
        state) since ``baseline`` (made by pass ``name``, or in a plugin's
        ``passkit_after_pass`` after it): raises :class:`VerificationError` on the first that
        fails; returns notes of checks that could not run (never silent)."""
        graph, saved = gm.graph, baseline.saved
        if change.dangling:
            raise VerificationError(
                f"after pass {name!r}: node(s) still in use were removed from the graph "
                f"(user -> removed: {', '.join(change.dangling[:5])})"
            )
        if change.modified:  # cheap: the nodes it changed and the outputs only
            schema_check.check(graph, saved, name, change.changed)
            output_check.check(graph, baseline.outputs, change, name)
            input_mutation.check(graph, saved, change.changed, name)
        notes = []
        if self.config.verify:
            verify_graph(gm, name)
            if self.config.verify == "numeric" and (change.modified or module_changed):
                not_run = numeric_check.check(gm, saved, name, baseline.module)
                if not_run:  # never silence: the report says the check did not run
                    notes.append(not_run)
        return notes

    def _after_pass(
        self, p: Pass, gm: torch.fx.GraphModule, result: PassResult, record: PassRecord, report: Report
    ) -> None:
        """Call ``passkit_after_pass``; a graph a hookimpl changes goes through the guards a
        pass's change does (:meth:`_guards`): one that fails them is that plugin's failure
        (named, disabled, its change undone), one that passes is kept and noted on the
        record as the plugin's (the record counts as modified: a guarded compile that
        Inductor fails on leaves the pass, and with it the hook's change, out)."""
        if not self.plugins.hook.passkit_after_pass.get_hookimpls():
            return
        taken: list[tuple[torch.fx.Graph, Baseline]] = []

        def checkpoint() -> Any:
            graph = gm.graph
            taken[:] = [(graph, Baseline.take(gm))]

            def undo() -> None:
                restore(graph, taken[0][1].saved)
                if gm.graph is not graph:
                    gm.graph = graph  # the setter recompiles
                else:
                    gm.recompile()

            return undo

        def check(plugin: object, value: Any) -> None:
            graph, before = taken[0]
            if gm.graph is not graph:
                carry_node_attributes(gm.graph, before.saved)
            change = graph_diff.measure(gm.graph, before.fingerprint, before.saved)
            if not change.modified and not change.dangling:
                return
            info = self.plugins.info_of(plugin)
            who = f"plugin {info.name!r}" if info is not None else "a plugin"
            try:
                notes = self._guards(gm, before, change, p.name)
            except VerificationError as exc:
                raise VerificationError(
                    f"the graph it changed in passkit_after_pass fails passkit's checks (undone): {exc}"
                ) from exc
            gm.recompile()
            record.modified = True
            record.nodes_after = count_nodes(gm.graph)
            record.notes.append(
                f"{who} changed the graph in passkit_after_pass ({len(change.changed)} node(s) changed)"
            )
            record.notes.extend(notes)

        self._hook(
            "passkit_after_pass",
            report,
            p,
            checkpoint,
            pass_=p,
            gm=gm,
            result=result,
            record=record,
            check=check,
        )

    def _dumped(self, p: Pass, *, changed: bool = False, failed: bool = False) -> bool:
        """Whether ``dump_dir`` gets this pass run's graphs (``dump_passes``, ``dump_when``)."""
        names = self.config.dump_passes
        if names and not any(same_pass(n, p.name) for n in names):
            return False
        when = self.config.dump_when
        return failed or when == "always" or (when == "changed" and changed)

    def _hooks_between_passes(self) -> bool:
        """Whether a plugin implements a hook that runs between passes (and may change the
        graph there): then a kept baseline is checked before it is reused."""
        hook = self.plugins.hook
        return any(
            getattr(hook, name).get_hookimpls() for name in ("passkit_before_pass", "passkit_after_pass")
        )

    def _origin(self, p: Pass) -> str:
        """``distribution version`` of the plugin that registered ``p`` (for messages)."""
        info = self.plugins.info_for(p)
        return info.plugin.origin if info is not None else "in-process"

    def _failed(
        self,
        p: Pass,
        gm: torch.fx.GraphModule,
        exc: BaseException,
        record: PassRecord,
        report: Report,
        dumper: Dumper | None,
        index: int,
        before_code: str,
        ctx: CompileContext | None = None,
        lost: list[str] | None = None,
    ) -> PassRecord:
        record.status = "failed"
        record.reason = describe(exc)
        if not isinstance(exc, Exception):  # SystemExit and friends, raised by a pass
            record.reason += " (isolated: a pass must not end the process)"
            exc = _contained(exc)
        if lost:  # the compile must not go on with values the pass wrote and nothing can undo
            record.reason += (
                f"; NOT restored: it wrote in place into {', '.join(lost)}, of which passkit keeps no "
                f"copy (tensors over {module_state.COPY_TENSOR_BYTES >> 20} MiB)"
            )
        record.nodes_before = record.nodes_after = count_nodes(gm.graph)
        if dumper and self._dumped(p, failed=True):
            written = dumper.reproducer(index, p, before_code, exc)
            record.reproducer = str(written) if written is not None else None
            if ctx is not None:  # the graph is restored: what the pass saw
                dumper.replay(index, p, gm, ctx, exc)
        self._hook("passkit_pass_failed", report, p, None, pass_=p, gm=gm, error=exc, record=record)
        if not lost:
            logs.log.warning("passkit: pass %s failed (graph restored): %s", p.name, record.reason)
        if self.config.on_error == "raise" or lost:
            ran = [r.name for r in report.records if r.status == "ran"]
            report.records.append(record)
            self._finish(report, dumper)
            where = f"; reproducer: {record.reproducer}" if record.reproducer else ""
            restored = (
                f"The graph was restored to its state before {p.name!r}"
                if not lost
                else "The graph module could not be restored, so the compile stops"
            )
            raise PassFailedError(
                f"pass {p.name!r} failed: {record.reason}. Passes that ran before it: "
                f"{ran or 'none'}. {restored}{where}.",
                pass_name=p.name,
                ran_before=ran,
            ) from exc
        return record

    def record_cache_hit(
        self, mode: Mode = "inductor", restored: list[PassRecord] | None = None, graph_kind: str | None = None
    ) -> Report:
        """Report a graph Inductor served from its cache (no pass ran for it); ``restored``:
        what the passes did when they built the cached code, from passkit's report cache;
        ``graph_kind``: the graph they ran on then."""
        report = Report(
            graph_id=next(_graph_ids),
            pipeline_uuid=self.uuid()[:12],
            mode=mode,
            graph_kind=graph_kind,
            cache_hit=True,
            token_range=self._range_label(),
            notes=([self.note] if self.note else [])
            + ([] if restored else [NOT_RESTORED])
            + ([not_run(self.diagnostics())] if self.diagnostics() else []),
            records=list(restored or []),
            restored=bool(restored),
        )
        self._finish(report, None)
        return report

    def _new_report(self, mode: Mode, graph_kind: str | None = None) -> Report:
        """A new report of this pipeline: the next graph id, the pipeline's identity, the
        token range being compiled and the pipeline's note."""
        return Report(
            graph_id=next(_graph_ids),
            pipeline_uuid=self.uuid()[:12],
            mode=mode,
            graph_kind=graph_kind,
            token_range=self._range_label(),
            notes=[self.note] if self.note else [],
        )

    def record_not_run(self, reason: str, mode: Mode = "inductor") -> Report:
        """Report a compile the host ran without calling the pipeline (e.g. vLLM asked
        ``is_applicable_for_range`` and was told no pass applies): every pass skipped, with
        why (its token constraint, else ``reason``)."""
        ctx = CompileContext(mode=mode, token_range=self.current_range())
        report = self._new_report(mode)
        for p in self.passes:
            why = _outside_range(p, ctx) or reason
            decision = p.checked_decision_source(ctx)
            report.records.append(PassRecord(name=p.name, stage=p.stage.value, reason=why, decision=decision))
        self._finish(report, None)
        return report

    def record_compile_time(self, report: Report, seconds: float) -> None:
        """Add the whole compile's wall-clock time to a finished report (and its
        ``report.json`` in the dump directory)."""
        report.compile_s = round(seconds, 3)
        where = f" ({report.token_range})" if report.token_range else ""
        logs.log.info("passkit: graph %d%s compiled in %.2f s", report.graph_id, where, seconds)
        if self.config.dump_dir:
            Dumper(self.config.dump_dir, report.graph_id).report(report)

    @contextlib.contextmanager
    def collecting(self, mode: Mode = "inductor") -> Iterator[Report]:
        """Within the block, every stage run on any graph of this pipeline records into one
        report (the backend's compile of one Dynamo graph: its pre-grad, joint and post-grad
        stages, on each graph AOTAutograd makes of it), which is not published: the caller
        hands it to :meth:`publish_compile` once the compile is done. A graph compiled after
        the block (a backward compiled at its first call) gets a report of its own."""
        report = self._new_report(mode)
        inductor_state.opened(report)  # a guarded compile watches it (its passes' changes)
        compile_id = _compile_id()
        if compile_id is not None:  # its backward, compiled at its first call, names it
            _COMPILE_REPORTS[compile_id] = report.graph_id
            while len(_COMPILE_REPORTS) > 256:
                _COMPILE_REPORTS.pop(next(iter(_COMPILE_REPORTS)))
        outer, self._compile_report = self._compile_report, report
        try:
            yield report
        finally:
            self._compile_report = outer
            self._open = None

    def publish_compile(self, report: Report, seconds: float) -> None:
        """Publish the report :meth:`collecting` filled, with the whole compile's time: its
        graph kind is that of the graphs its records ran on."""
        report.graph_kind = _compiled_kind(report)
        self._publish(report, None)
        self.record_compile_time(report, seconds)

    def _finish(self, report: Report, dumper: Dumper | None) -> None:
        self._open = None
        if report is self._compile_report:  # published once, when the whole compile is done
            return
        self._publish(report, dumper)

    def _publish(self, report: Report, dumper: Dumper | None) -> None:
        self.reports.append(report)
        RECENT_REPORTS.append(report)
        # before the dump and the log: a failure of the hook is in the report they show
        self._hook("passkit_report", report, None, None, report=report)
        if dumper:
            dumper.report(report)
        logs.log.info("%s", report.format())
        logs.artifact("passkit_report", report.to_json)

    def _hook(
        self,
        hook: str,
        into: Report,
        p: Pass | None,
        checkpoint: Any,
        /,
        check: Any = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Call a plugin hook for this compile, each hookimpl isolated (:mod:`passkit._plugins.hooks`):
        one that raises is recorded on ``into`` and disabled, or raises a named error with
        ``strict_plugins`` / ``on_error = "raise"``; ``check``: see :func:`hooks.call`."""
        return hooks.call(
            self.plugins,
            hook,
            kwargs,
            strict=self.config.strict_plugins or self.config.on_error == "raise",
            during=f"pass {p.name!r}" if p is not None else f"the compile of graph {into.graph_id}",
            record=into.hook_failures,
            checkpoint=checkpoint,
            check=check,
        )


def _graph_label(report: Report, graph_kind: str | None) -> str:
    """How a counted rewrite names its graph: ``3 (forward, tokens 1..16)`` (the kind of the
    graph the pass runs on: one report spans a compile's stages and graphs)."""
    details = [d for d in (graph_kind, f"tokens {report.token_range}" if report.token_range else "") if d]
    return f"{report.graph_id} ({', '.join(details)})" if details else str(report.graph_id)


def _refused_note(scope: rewrite_counter._Scope) -> str:
    return f"bisect_limit {scope.limit}: {scope.refused} of {max(scope.asked, 1)} rewrite(s) refused"


_COMPILE_REPORTS: dict[str, int] = {}
"""torch.compile's compile id -> the graph id of its report (the last 256 compiles)."""


def _compile_id() -> str | None:
    """torch.compile's id of the compile under way (a backward compiled at its first call
    gets its forward's), or None."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return None if compile_id is None else str(compile_id)


PRE_GRAD_ONLY_TRAINING = (
    "a training compile with passes at pre_grad only: they ran once, on the graph before "
    "autograd (the forward and backward are derived from it), so no backward report follows"
)


def _trains(gm: torch.fx.GraphModule) -> bool:
    """Whether autograd follows this pre-grad graph: grad mode on and a parameter or an
    input (Dynamo's ``example_value``) that requires grad."""
    if not torch.is_grad_enabled():
        return False
    if any(p.requires_grad for p in gm.parameters()):
        return True
    placeholders = gm.graph.find_nodes(op="placeholder")
    return any(getattr(recorded_value(n), "requires_grad", False) for n in placeholders)


def _compiled_kind(report: Report) -> str | None:
    """The graph kind of a compile's report from its records': ``"training"`` (a joint,
    forward or backward graph), ``"inference"``, ``"torch"`` (pre-grad passes only), or the
    report's own where no record says."""
    kinds = {r.graph_kind for r in report.records}
    if kinds & {"joint", "forward", "backward"}:
        return "training"
    if "inference" in kinds:
        return "inference"
    if "torch" in kinds and report.graph_kind != "training":
        return "torch"
    return report.graph_kind


def _outside_range(p: Pass, ctx: CompileContext) -> str | None:
    """Why ``p`` must not run in a compile serving ``ctx.token_range``, or None."""
    if ctx.token_range is None:
        return None
    constraint = p.checked_token_constraint(dataclasses.replace(ctx, token_range=None))
    if constraint is None or constraint.holds_for(ctx.token_range):
        return None
    return f"applies to {constraint}; this compile serves {ctx.token_range}"


def _contained(exc: BaseException) -> Exception:
    """An ``Exception`` standing for a ``BaseException`` a pass raised (``SystemExit(3)``),
    so that hooks, reports and ``on_error = "raise"`` handle it as any other failure."""
    contained = RuntimeError(f"the pass raised {describe(exc)} (isolated: a pass must not end the process)")
    contained.__cause__ = exc
    return contained


def _as_result(value: Any, p: Pass) -> PassResult:
    if not isinstance(value, PassResult):
        raise TypeError(f"pass {p.name!r}: run() must return a PassResult, got {type(value).__name__}")
    matches, notes = value.matches, value.notes
    if isinstance(matches, bool) or not isinstance(matches, int) or matches < 0:
        raise TypeError(f"pass {p.name!r}: PassResult.matches must be an int >= 0, got {cut_repr(matches)}")
    if not isinstance(notes, (list, tuple)) or not all(isinstance(n, str) for n in notes):
        raise TypeError(f"pass {p.name!r}: PassResult.notes must be a list of str, got {cut_repr(notes)}")
    value.modified, value.notes = bool(value.modified), list(notes)
    return value


class StagePass:
    """What Inductor calls: one stage of a :class:`Pipeline`.

    It is an Inductor ``CustomGraphPass`` (registered as a virtual subclass on first use,
    so that importing passkit does not import Inductor).
    """

    def __init__(self, pipeline: Runner, stage: Stage):
        _register_custom_pass_type(StagePass)
        self.pipeline = pipeline
        self.stage = stage

    def __call__(self, graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        if not isinstance(gm, torch.fx.GraphModule):
            raise TypeError("passkit: Inductor passed a graph without an owning GraphModule")
        self.pipeline.run_stage(gm, self.stage)

    def uuid(self) -> str:
        return f"passkit:{self.stage.value}:{self.pipeline.uuid()}"

    def __deepcopy__(self, memo: dict[int, Any]) -> StagePass:
        """Inductor deep-copies its config (which holds this pass) per compile: share it,
        as the pipeline holds plugins and reports that must stay one."""
        return self


def _register_custom_pass_type(cls: type) -> None:
    """Make ``cls`` an Inductor ``CustomGraphPass`` (isinstance checks) without importing
    Inductor when passkit is imported."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    if not issubclass(cls, CustomGraphPass):
        CustomGraphPass.register(cls)
