"""Building a pipeline: from a config and the plugin set to the ordered, validated passes.

:func:`build_pipeline` loads the config (:func:`passkit.load_config`), asks the plugin wing
once for the plugin set it allows and one pass object per enabled name, options validated
(:func:`~passkit._plugins.registry.passes_for`), and returns a :class:`Pipeline`, which orders them by stage and
checks their ``before``/``after``/``depends_on`` constraints (:func:`order_passes`),
collects their ``depends_on``/``shares_sites_with`` relations (:func:`pass_relations`) and
computes the cache identity Inductor keys its FX graph cache by (:func:`pipeline_identity`).
Running the passes on graphs is the :class:`~passkit._pipeline.run.Runner`'s, which a
pipeline is.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import weakref
from typing import Any

import torch.fx

from .._plugins.registry import PluginSet, passes_for, plugins_for
from ..code_identity import code_hash
from ..config import Config, load_config
from ..errors import OrderError
from ..pass_base import POST_GRAD_STAGES, STAGE_ORDER, Pass, Stage, source_hash
from ..report import Report
from ..tokens import PassRelations, TokenRange
from .run import Runner


def order_passes(passes: list[Pass]) -> list[Pass]:
    """Stage order (pre-grad, joint, post-grad pre, post-grad post), config order within a stage; check constraints."""
    by_name = {p.name: p for p in passes}
    edges: dict[str, set[str]] = {p.name: set() for p in passes}  # a -> b: a runs before b
    for p in passes:
        edges[p.name].update(b for b in p.before if b in by_name)
        for a in (*p.after, *p.depends_on):
            if a in by_name:
                edges[a].add(p.name)
    cycle = _find_cycle(edges)
    if cycle:
        raise OrderError("pass ordering constraints form a cycle: " + " -> ".join(cycle))
    stage_rank = {s: i for i, s in enumerate(STAGE_ORDER)}
    ordered = sorted(passes, key=lambda p: stage_rank[p.stage])  # stable: keeps config order
    position = {p.name: i for i, p in enumerate(ordered)}
    for a, targets in edges.items():
        for b in sorted(targets):
            if position[a] > position[b]:
                why = _constraint_owner(by_name[a], by_name[b])
                stages = ""
                if by_name[a].stage != by_name[b].stage:
                    stages = f" ({a} is in stage {by_name[a].stage.value}, {b} in {by_name[b].stage.value})"
                    raise OrderError(
                        f"pass {a!r} must run before {b!r} ({why}), but stage "
                        f"{by_name[b].stage.value} runs before stage {by_name[a].stage.value} "
                        f"whatever the configured order{stages}: no order of `passes` can satisfy it"
                    )
                raise OrderError(
                    f"pass {a!r} must run before {b!r} ({why}) but the configured order runs it "
                    f"after{stages}. Reorder `passes` so that {a!r} comes first."
                )
    return ordered


def _constraint_owner(a: Pass, b: Pass) -> str:
    if b.name in a.before:
        return f"{a.name} declares before={list(a.before)}"
    if a.name in b.after:
        return f"{b.name} declares after={list(b.after)}"
    return f"{b.name} declares depends_on={list(b.depends_on)}"


def pass_relations(passes: list[Pass]) -> PassRelations:
    """``depends_on`` / ``shares_sites_with`` among ``passes`` (those present only)."""
    names = {p.name for p in passes}
    shares: dict[str, set[str]] = {}
    for p in passes:
        for other in p.shares_sites_with:
            if other in names and other != p.name:
                shares.setdefault(p.name, set()).add(other)
                shares.setdefault(other, set()).add(p.name)
    return PassRelations(
        depends_on={p.name: deps for p in passes if (deps := tuple(d for d in p.depends_on if d in names))},
        shares_sites={name: tuple(sorted(others)) for name, others in shares.items()},
    )


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges[n]):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def pipeline_identity(
    passes: list[Pass], plugins: PluginSet, token_range: TokenRange | None, left_out: dict[str, str]
) -> str:
    """The cache identity of a pipeline of ``passes`` (in run order): every pass's name,
    options, version and source hash, the plugins that can change what runs (configure /
    veto hookimpls) or the graph (``passkit_after_pass``, whose changes are kept when they
    pass the checks), the token range and the passes left out of it."""
    parts: list[Any] = []
    for p in passes:
        ident = p.identity()
        info = plugins.info_for(p)
        ident["version"] = info.version if info else "in-process"
        parts.append(ident)
    # plugins that can change what runs (configure / veto) or the graph are part of the identity
    hooks = (
        plugins.hook.passkit_configure_pipeline,
        plugins.hook.passkit_before_pass,
        plugins.hook.passkit_after_pass,
    )
    for hook in hooks:
        for impl in hook.get_hookimpls():
            parts.append(_function_identity(impl.function))
    parts.append({"token_range": str(token_range) if token_range else None})
    parts.append({"left_out": sorted(left_out)})
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def _function_identity(fn: Any) -> str:
    module = inspect.getmodule(fn)
    owner = module if module is not None else fn
    try:
        code = code_hash(fn)  # what changes with the hook's code where its file cannot be read
        return (
            f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}:{source_hash(owner)}:{code}"  # type: ignore[arg-type]
        )
    except TypeError:
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


class Pipeline(Runner):
    """Enabled passes, in order, plus the instrumentation that runs them on graphs
    (a :class:`~passkit._pipeline.run.Runner`).

    ``token_range``: the token counts the graphs it compiles serve (a specialization, or what
    a framework told :func:`passkit.install`); ``None``: every size, unless a
    :func:`compile_range` block says otherwise.

    ``plugins`` None (an empty pipeline :func:`build_pipeline` made): the plugin set the config
    allows, loaded at its first use, and the cache identity computed then.
    """

    def __init__(
        self,
        config: Config,
        plugins: PluginSet | None,
        passes: list[Pass],
        *,
        token_range: TokenRange | None = None,
        range_label: str | None = None,
        reports: list[Report] | None = None,
        left_out: dict[str, str] | None = None,
    ):
        self.config = config
        self._plugins = plugins
        self.passes = order_passes(passes)
        self.relations = pass_relations(self.passes)
        self.left_out: dict[str, str] = dict(left_out or {})
        """Passes a specialization runs without, with why (decided by the token-range plan)."""
        self.token_range = token_range
        self.range_label = range_label or (str(token_range) if token_range else None)
        self.note: str | None = None
        """Added to the reports of the graphs compiled next (set by the backend)."""
        self.reports: list[Report] = reports if reports is not None else []
        self._identity = self._compute_uuid() if plugins is not None else None
        self._open: tuple[weakref.ref[torch.fx.GraphModule], Report] | None = None
        stages = [p.stage for p in self.passes]
        self.stages = [s for s in STAGE_ORDER if s in stages]
        self.driven: tuple[Stage, ...] = POST_GRAD_STAGES
        """The stages whoever drives this pipeline runs: the post-grad ones for a host
        (vLLM, SGLang, :func:`passkit.install`), every stage under passkit's own backend.
        A pass at another stage is reported skipped, with why."""
        self.host = "this host"
        """Who drives the pipeline, for the reason a pass at a stage it does not run gets."""

    @property
    def plugins(self) -> PluginSet:  # type: ignore[override]
        if self._plugins is None:
            self._plugins = plugins_for(self.config)
        return self._plugins

    @property
    def _uuid(self) -> str:  # type: ignore[override]
        if self._identity is None:
            self._identity = self._compute_uuid()
        return self._identity

    def _compute_uuid(self) -> str:
        return pipeline_identity(self.passes, self.plugins, self.token_range, self.left_out)

    def for_range(
        self,
        token_range: TokenRange,
        label: str | None = None,
        note: str | None = None,
        left_out: dict[str, str] | None = None,
    ) -> Pipeline:
        """The same passes, compiling for ``token_range`` (``label`` names it in reports,
        ``note`` is added to them; reports go to this pipeline's list); ``left_out``: passes
        the token-range plan leaves out of this compile, with why. A subclass's are of its
        class."""
        specialized = type(self)(
            self.config,
            self.plugins,
            self.passes,
            token_range=token_range,
            range_label=label,
            reports=self.reports,
            left_out=left_out,
        )
        specialized.note = note
        specialized.driven, specialized.host = self.driven, self.host
        return specialized

    @property
    def enabled(self) -> bool:
        return bool(self.passes)

    def names(self) -> list[str]:
        return [p.name for p in self.passes]


def build_pipeline(config: Config | dict[str, Any] | None = None, **overrides: Any) -> Pipeline:
    """Resolve the config from every source, load plugins, validate and order the passes.
    Plugins that loaded with a mistake are warned of here, once per process
    (:class:`passkit.PluginMistakeWarning`), before the passes are looked up. A config that
    enables no pass and names no plugin loads none (see :func:`_runs_nothing`)."""
    cfg = load_config(config, **overrides)
    if _runs_nothing(cfg):
        return Pipeline(cfg, None, [])
    plugins, passes = passes_for(cfg)
    _warn_unmatched_dump_passes(cfg, passes)
    return Pipeline(cfg, plugins, passes)


def _warn_unmatched_dump_passes(cfg: Config, passes: list[Pass]) -> None:
    """A ``dump_passes`` entry naming no enabled pass dumps nothing: said, with the names."""
    from ..errors import cut_repr, warn_config

    enabled = sorted(p.name for p in passes)
    for name in cfg.dump_passes:
        if name.rsplit(":", 1)[-1] not in enabled:
            warn_config(
                f"dump_passes: {cut_repr(name)} is not an enabled pass (enabled: "
                f"{', '.join(enabled) or 'none'}); the entry dumps nothing"
            )


def _runs_nothing(cfg: Config) -> bool:
    """Whether ``cfg`` enables no pass and asks nothing of the plugin set that loading it
    would check (``disable`` / ``plugins`` / ``block_plugins`` entries naming something,
    ``strict_plugins``): its pipeline runs nothing, so no plugin is imported for it (a
    compile with no pass costs what Inductor's does); they load if the pipeline's
    :attr:`~Pipeline.plugins` is asked for."""
    return not (
        cfg.passes or cfg.disable or cfg.plugins is not None or cfg.block_plugins or cfg.strict_plugins
    )
