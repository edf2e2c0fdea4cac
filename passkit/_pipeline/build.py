"""Building a pipeline: from a config and the plugin set to the ordered, validated passes.

:func:`build_pipeline` loads the config (:func:`passkit.load_config`) and the plugin set it
allows, makes one pass object per enabled name with its options validated
(:func:`instantiate`), and returns a :class:`Pipeline`, which orders them by stage and
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

from .._plugins.checks import warn_mistakes
from .._plugins.registry import ENTRY_POINT_GROUP, PluginSet, normalize, owner, plugins_for
from ..config import Config, load_config, suggest
from ..errors import ConfigError, OrderError, cut_repr, describe, warn_config
from ..pass_base import POST_GRAD_STAGES, STAGE_ORDER, Pass, Stage, source_hash, validate_options
from ..report import Report
from ..tokens import PassRelations, TokenRange
from .run import Runner


def instantiate(config: Config, plugins: PluginSet) -> list[Pass]:
    """One pass object per enabled name, options validated, in config order."""
    warn_unknown_names(config, plugins)
    out: list[Pass] = []
    source = f"{config.passes_from}: " if config.passes_from else ""  # e.g. "PASSKIT_PASSES: "
    for entry in config.passes:
        info = plugins.lookup(entry.name)
        if info is None and entry.name in plugins.clashes:
            raise ConfigError(source + clash_message(entry.name, plugins))
        if info is None:
            raise ConfigError(source + unknown_pass_message(entry.name, plugins))
        try:
            options = validate_options(info.cls, entry.options, info.plugin.origin)
        except ConfigError as exc:
            raise ConfigError(f"{source}{exc}") from exc.__cause__
        try:
            instance = info.cls(options)
            instance.identity()  # the options' serialization is the pass's code too
        except Exception as exc:
            raise ConfigError(
                f"passes.{entry.name}: pass {entry.name!r} ({info.plugin.origin}) raised "
                f"{describe(exc)} when passkit set it up (a bug in the pass, not in your config)"
            ) from exc
        out.append(instance)
    return out


def warn_unknown_names(config: Config, plugins: PluginSet) -> None:
    """A ``disable`` entry no installed pass has, or a ``plugins`` / ``block_plugins`` entry
    no installed plugin or distribution has, does nothing: say so (a typo there lets the
    pass or plugin meant run)."""
    passes = {*plugins.passes, *plugins.clashes, *plugins.qualified}
    for name in config.disable:
        if name not in passes and plugins.lookup(name) is None:
            warn_config(
                f"disable: no installed pass is named {cut_repr(name)}{suggest(name, sorted(passes))}; "
                "the entry does nothing"
            )
    known = {p.name for p in plugins.plugins}
    for found in plugins.found[ENTRY_POINT_GROUP]:
        known.add(found.ep.name)
        if found.distribution:
            known.update((found.distribution, normalize(found.distribution)))
    for field, names in (("plugins", config.plugins or []), ("block_plugins", config.block_plugins)):
        for name in names:
            if name not in known:
                warn_config(
                    f"{field}: no installed plugin or distribution is named {cut_repr(name)}"
                    f"{suggest(name, sorted(known))}; the entry does nothing"
                )


def clash_message(name: str, plugins: PluginSet) -> str:
    """Why an enabled bare name that several distributions register is an error."""
    infos = plugins.clashes[name]
    who = "; ".join(f"{owner(i.plugin)} ({i.plugin.origin})" for i in infos)
    choices = " or ".join(repr(f"{owner(i.plugin)}:{name}") for i in infos)
    return (
        f"pass {name!r} is registered by more than one distribution ({who}); passkit does not "
        f"pick one (an installed package must not be able to replace another's pass): enable "
        f"{choices}, or block the plugin you do not want (block_plugins)"
    )


def unknown_pass_message(name: str, plugins: PluginSet) -> str:
    installed = sorted(plugins.passes)
    if ":" in name:  # a qualified name, or an option without a value (PASSKIT_PASSES)
        qualified = sorted(plugins.qualified)
        msg = (
            f"unknown pass {cut_repr(name)} in passes: no installed distribution "
            f"{cut_repr(name.rpartition(':')[0])} registers a pass {cut_repr(name.rpartition(':')[2])}"
            f"{suggest(name, qualified)} (an option is written name:option=value). "
            f"Installed passes: {', '.join(qualified) or '(none)'}."
        )
    else:
        msg = f"unknown pass {cut_repr(name)} in passes{suggest(name, installed)}. "
        msg += f"Installed passes: {', '.join(installed) or '(none)'}."
    if plugins.failures:
        msg += " Plugins that failed to load (see `passkit list`): "
        msg += ", ".join(sorted({f.name for f in plugins.failures})) + "."
    if plugins.mistakes:
        msg += " Plugins that loaded with a mistake: " + "; ".join(str(m) for m in plugins.mistakes) + "."
    return msg


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
    veto hookimpls), the token range and the passes left out of it."""
    parts: list[Any] = []
    for p in passes:
        ident = p.identity()
        info = plugins.info_for(p)
        ident["version"] = info.version if info else "in-process"
        parts.append(ident)
    # plugins that can change what runs (configure / veto) are part of the identity
    for hook in (plugins.hook.passkit_configure_pipeline, plugins.hook.passkit_before_pass):
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
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}:{source_hash(owner)}"  # type: ignore[arg-type]
    except TypeError:
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


class Pipeline(Runner):
    """Enabled passes, in order, plus the instrumentation that runs them on graphs
    (a :class:`~passkit._pipeline.run.Runner`).

    ``token_range``: the token counts the graphs it compiles serve (a specialization, or what
    a framework told :func:`passkit.install`); ``None``: every size, unless a
    :func:`compile_range` block says otherwise.
    """

    def __init__(
        self,
        config: Config,
        plugins: PluginSet,
        passes: list[Pass],
        *,
        token_range: TokenRange | None = None,
        range_label: str | None = None,
        reports: list[Report] | None = None,
        left_out: dict[str, str] | None = None,
    ):
        self.config = config
        self.plugins = plugins
        self.passes = order_passes(passes)
        self.relations = pass_relations(self.passes)
        self.left_out: dict[str, str] = dict(left_out or {})
        """Passes a specialization runs without, with why (decided by the token-range plan)."""
        self.token_range = token_range
        self.range_label = range_label or (str(token_range) if token_range else None)
        self.note: str | None = None
        """Added to the reports of the graphs compiled next (set by the backend)."""
        self.reports: list[Report] = reports if reports is not None else []
        self._uuid = self._compute_uuid()
        self._open: tuple[weakref.ref[torch.fx.GraphModule], Report] | None = None
        stages = [p.stage for p in self.passes]
        self.stages = [s for s in STAGE_ORDER if s in stages]
        self.driven: tuple[Stage, ...] = POST_GRAD_STAGES
        """The stages whoever drives this pipeline runs: the post-grad ones for a host
        (vLLM, SGLang, :func:`passkit.install`), every stage under passkit's own backend.
        A pass at another stage is reported skipped, with why."""
        self.host = "this host"
        """Who drives the pipeline, for the reason a pass at a stage it does not run gets."""

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
        the token-range plan leaves out of this compile, with why."""
        specialized = Pipeline(
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
    (:class:`passkit.PluginMistakeWarning`), before the passes are looked up."""
    cfg = load_config(config, **overrides)
    plugins = plugins_for(cfg)
    warn_mistakes(plugins.mistakes, stacklevel=2)
    passes = instantiate(cfg, plugins)
    return Pipeline(cfg, plugins, passes)
