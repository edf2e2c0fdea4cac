"""Plugin discovery and the pass registry.

Plugins come from the ``passkit.passes`` entry-point group (loaded once per process) and
from :func:`register` (in-process). Each plugin loads in isolation: an import error, a
hookimpl that fails validation, a registration hook that raises or a duplicate pass name is
recorded as a :class:`PluginFailure` naming the plugin's distribution and version, and the
other plugins load (``strict_plugins`` raises instead). A plugin that loads but is
likely a mistake (``passkit_*`` functions without ``@passkit.hookimpl``, or no hook at all)
is recorded as a :class:`~passkit._plugins.checks.PluginMistake`
(:mod:`passkit._plugins.checks`). Hooks called later (at compile and
CLI time) are isolated too, by :mod:`passkit._plugins.hooks`, through :meth:`PluginSet.call`.

A config's pass names are resolved here too: :func:`passes_for`, all that building a
pipeline asks of the plugin wing, gives the plugin set a config allows and one pass object
per enabled name (:func:`instantiate`: options validated; an unknown or clashing name is a
:class:`~passkit.errors.ConfigError` that says why, a ``disable`` or plugin entry that names
nothing a warning).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import threading
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import pluggy

from .. import hookspecs, logs
from ..errors import ConfigError, PluginError, cut_repr, describe, suggest, warn_config
from ..names import normalize_distribution, pass_name_problem, split_pass_name
from ..pass_base import Pass, validate_options
from . import hooks, interrupts
from .checks import PluginMistake, find_mistakes, warn_mistakes

if TYPE_CHECKING:
    from ..config import Config

ENTRY_POINT_GROUP = "passkit.passes"
HOOKSPECS_GROUP = "passkit.hookspecs"
"""Entry points naming modules of extra hook specifications (made with ``passkit.hookspec``)
that a distribution adds to passkit's plugin manager before any plugin loads, so that
plugins can implement them (e.g. passkit-fusion's ``passkit_fusion_dialects``)."""
CLI_ENTRY_POINT_GROUP = "passkit.cli"
"""Entry points naming light modules of command-line hookimpls (``passkit_cli_commands``,
``passkit_demos``): the command line loads these alone, without the pass plugins, to build
its parser, so ``passkit --help`` and a usage error import no torch. The full plugin set
loads them too (one module named in both groups is registered once)."""
CORE_DISTRIBUTION = "passkit"


@dataclasses.dataclass(frozen=True)
class PluginInfo:
    """A plugin that loaded."""

    name: str
    distribution: str | None
    version: str | None
    module: str

    @property
    def origin(self) -> str:
        if self.distribution:
            return f"plugin {self.name!r} from distribution {self.distribution} {self.version}"
        return f"in-process plugin {self.name!r}"


@dataclasses.dataclass(frozen=True)
class PluginFailure:
    """A plugin (or one of its passes) that was skipped, and why."""

    name: str
    distribution: str | None
    version: str | None
    stage: str
    """``hookspecs``, ``import``, ``validate``, ``register`` or ``duplicate``."""
    error: str
    detail: str = ""

    def __str__(self) -> str:
        who = f"plugin {self.name!r}"
        if self.distribution:
            who += f" (distribution {self.distribution} {self.version})"
        return f"{who} failed at {self.stage}: {self.error}"


@dataclasses.dataclass(frozen=True)
class PassInfo:
    """A pass class and where it came from."""

    cls: type[Pass]
    plugin: PluginInfo

    @property
    def name(self) -> str:
        return self.cls.name

    @property
    def version(self) -> str:
        return self.plugin.version or "0"


class PassNameClashWarning(UserWarning):
    """Two distributions (or a distribution and passkit itself) register the same pass name:
    neither is used under that bare name; the name must be chosen as ``distribution:pass``."""


def owner(info: PluginInfo) -> str:
    """Who owns a pass name: the distribution (normalized: ``aaa_Hijack`` is
    ``aaa-hijack``), or ``in-process:<plugin name>``."""
    if info.distribution:
        return normalize(info.distribution)
    return f"in-process:{info.name}"


normalize = normalize_distribution
"""A distribution's name as PEP 503 compares it (:func:`passkit.names.normalize_distribution`)."""


class PluginSet:
    """A pluggy manager with its plugins loaded, and the passes they registered.

    Pass names are owned: :attr:`passes` maps each name registered by one owner (a
    distribution, or one in-process plugin) to its pass; a name that two owners register is
    in :attr:`clashes` instead (never resolved by load order or alphabetically) and every
    pass is in :attr:`qualified` as ``owner:name``."""

    def __init__(self, *, cli_only: bool = False) -> None:
        self.cli_only = cli_only
        """Only the :data:`CLI_ENTRY_POINT_GROUP` entry points (and in-process plugins)
        load, and no extra hookspecs (their modules may import torch): the command line's
        parser, which calls passkit's own CLI hooks only."""
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginInfo] = []
        self.failures: list[PluginFailure] = []
        self.passes: dict[str, PassInfo] = {}
        self.mistakes: list[PluginMistake] = []
        """Plugins that loaded with a mistake (see :mod:`passkit._plugins.checks`)."""
        self.qualified: dict[str, PassInfo] = {}
        """Every pass as ``owner:name`` (``passkit:cleanup``, ``acme-passes:my_pass``)."""
        self.clashes: dict[str, list[PassInfo]] = {}
        """Pass names registered by more than one owner: not in :attr:`passes`."""
        self.hook_failures: list[hooks.HookFailure] = []
        """Hookimpls that raised when called (each then disabled), oldest first."""
        self.disabled_hooks: set[tuple[str, int]] = set()
        """``(hook name, id(plugin object))`` of the hookimpls disabled after raising."""
        self._info: dict[int, PluginInfo] = {}
        self._strict = False
        self._found: dict[str, list[Found]] | None = None
        if not cli_only:
            self._add_extra_hookspecs()

    @property
    def found(self) -> dict[str, list[Found]]:
        """The installed entry points of passkit's groups (one scan per plugin set)."""
        if self._found is None:
            self._found = discover((HOOKSPECS_GROUP, ENTRY_POINT_GROUP, CLI_ENTRY_POINT_GROUP))
        return self._found

    def _add_extra_hookspecs(self) -> None:
        """Add the hook specifications of the ``passkit.hookspecs`` entry points; one that
        fails to import is recorded as a failure (stage ``hookspecs``), the others load."""
        for found in self.found[HOOKSPECS_GROUP]:
            info = PluginInfo(found.ep.name, found.distribution, found.version, found.ep.value)
            try:
                with interrupts.watch_sigint() as arrived:
                    self.pm.add_hookspecs(found.ep.load())
            except BaseException as exc:  # sys.exit() at import too
                _reraise_ctrl_c(exc, arrived, f"importing the hook specifications of {_who(info)}")
                self.failures.append(self._failure(info, "hookspecs", exc))

    @property
    def hook(self) -> Any:
        """pluggy's hook relay (calls are not isolated: use :meth:`call`)."""
        return self.pm.hook

    def call(
        self,
        hook: str,
        strict: bool = False,
        during: str | None = None,
        checkpoint: Any = None,
        check: Any = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Call ``hook`` with ``kwargs``, each plugin's hookimpl in isolation: one that raises
        is disabled and recorded in :attr:`hook_failures` (``during``: what was under way,
        for its message), or raises with ``strict``; returns the non-``None`` results
        (``checkpoint``, ``check``: see :func:`passkit._plugins.hooks.call`)."""
        return hooks.call(
            self, hook, kwargs, strict=strict, during=during, checkpoint=checkpoint, check=check
        )

    def info_of(self, plugin: object) -> PluginInfo | None:
        """The :class:`PluginInfo` a registered plugin object was added with."""
        return self._info.get(id(plugin))

    # -- loading ---------------------------------------------------------------------
    def _fail(self, failure: PluginFailure) -> None:
        if self._strict:
            raise PluginError(str(failure) + (f"\n{failure.detail}" if failure.detail else ""))
        self.failures.append(failure)

    def add(self, plugin: object, info: PluginInfo) -> bool:
        """Register one plugin object and collect its passes, in isolation."""
        try:
            self.pm.register(plugin, name=info.name)
            self.pm.check_pending()
            _reject_wrappers(self.pm, plugin)
        except Exception as exc:  # pluggy.PluginValidationError and friends
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            self._fail(self._failure(info, "validate", exc))
            return False
        for message in find_mistakes(self.pm, plugin):
            mistake = PluginMistake(info.name, info.distribution, info.version, message)
            if self._strict:
                self.pm.unregister(plugin)
                raise PluginError(str(mistake))
            self.mistakes.append(mistake)
        impls = [i for i in self.pm.hook.passkit_register_passes.get_hookimpls() if i.plugin is plugin]
        collected: list[type[Pass]] = []
        for impl in impls:
            try:
                with interrupts.watch_sigint() as arrived:
                    collected.extend(_check_pass_list(impl.function()))
            except BaseException as exc:  # sys.exit() too
                _reraise_ctrl_c(exc, arrived, f"registering the passes of {_who(info)}")
                self.pm.unregister(plugin)
                self._fail(self._failure(info, "register", exc))
                return False
        for cls in collected:
            self._claim(PassInfo(cls, info))
        self.plugins.append(info)
        self._info[id(plugin)] = info
        return True

    def _claim(self, new: PassInfo) -> None:
        """Record ``new`` under its owner's qualified name, and its bare name unless another
        owner has it (then the name clashes: loud, and neither is enabled by it)."""
        name, key = new.name, f"{owner(new.plugin)}:{new.name}"
        if key in self.qualified:  # the same owner twice: the first stays
            other = self.qualified[key].plugin
            self._fail(
                self._failure(
                    new.plugin,
                    "duplicate",
                    f"pass name {name!r} is already registered by {other.origin}; "
                    f"this plugin's {new.cls.__module__}.{new.cls.__qualname__} is skipped",
                )
            )
            return
        self.qualified[key] = new
        if name in self.clashes:
            self.clashes[name].append(new)
        elif name in self.passes:
            first = self.passes.pop(name)
            self.clashes[name] = [first, new]
        else:
            self.passes[name] = new
            return
        owners = [f"{owner(i.plugin)} ({i.plugin.origin})" for i in self.clashes[name]]
        message = (
            f"pass name {name!r} is registered by more than one distribution: "
            f"{'; '.join(owners)}. Neither runs under the bare name (enabling {name!r} is an "
            f"error); enable one by its qualified name: "
            f"{' or '.join(repr(f'{owner(i.plugin)}:{name}') for i in self.clashes[name])}"
        )
        if self._strict:
            raise PluginError(message)
        logs.log.warning("passkit: %s", message)
        warnings.warn(message, PassNameClashWarning, stacklevel=2)

    def lookup(self, name: str) -> PassInfo | None:
        """The pass enabled by ``name``: a bare name one owner registers, or ``owner:name``
        (the owner's distribution name, any spelling: ``Acme_Passes:x`` is ``acme-passes:x``)."""
        who, bare = split_pass_name(name)
        if who is not None:
            return self.qualified.get(f"{who}:{bare}")
        return self.passes.get(name)

    def info_for(self, pass_: Pass | type[Pass] | str) -> PassInfo | None:
        """Where a pass (object, class or bare name) came from, clashing names included."""
        if isinstance(pass_, str):
            found = self.passes.get(pass_)
            return found
        cls = pass_ if isinstance(pass_, type) else type(pass_)
        found = self.passes.get(cls.name)
        if found is not None and found.cls is cls:
            return found
        for info in self.clashes.get(cls.name, ()):
            if info.cls is cls:
                return info
        return found

    @staticmethod
    def _failure(info: PluginInfo, stage: str, exc: BaseException | str) -> PluginFailure:
        if isinstance(exc, BaseException):
            err = describe(exc)
            detail = hooks._traceback(exc)
        else:
            err, detail = exc, ""
        return PluginFailure(info.name, info.distribution, info.version, stage, err, detail)

    def load_entry_points(
        self,
        *,
        autoload: bool = True,
        allow: Iterable[str] | None = None,
        block: Iterable[str] = (),
        strict: bool = False,
    ) -> None:
        self._strict = strict
        # a distribution however it is spelled (PEP 503): `passkit list` prints the normalized name
        allow_set = {normalize(a) for a in allow} if allow is not None else None
        block_set = {normalize(b) for b in block}
        groups = [CLI_ENTRY_POINT_GROUP] if self.cli_only else [ENTRY_POINT_GROUP, CLI_ENTRY_POINT_GROUP]
        for group, found in [(g, f) for g in groups for f in self.found.get(g, [])]:
            ep, dist_name = found.ep, found.distribution
            names = _plugin_keys(ep.name, dist_name)
            if not autoload and dist_name != CORE_DISTRIBUTION:
                continue
            if names & block_set:
                continue
            if allow_set is not None and not (names & allow_set) and dist_name != CORE_DISTRIBUTION:
                continue
            # a distribution may name its passes and its commands alike (pluggy wants one name each)
            label = ep.name if group == ENTRY_POINT_GROUP else f"{ep.name} (commands)"
            info = PluginInfo(label, dist_name, found.version, ep.value)
            try:
                with interrupts.watch_sigint() as arrived:
                    plugin = ep.load()
            except BaseException as exc:  # sys.exit() at import too: isolated, named
                _reraise_ctrl_c(exc, arrived, f"importing {_who(info)}")
                self._fail(self._failure(info, "import", exc))
                continue
            if self.pm.is_registered(plugin):  # named in both groups: registered once
                continue
            self.add(plugin, info)
        self._strict = False


def _plugin_keys(entry_point: str, distribution: str | None) -> set[str]:
    """The names a ``plugins`` / ``block_plugins`` entry matches an installed plugin by, as
    :func:`normalize` spells them: its entry point's and its distribution's."""
    return {normalize(entry_point), *([normalize(distribution)] if distribution else [])}


def _who(info: PluginInfo) -> str:
    return f"plugin {info.name!r} (distribution {info.distribution!r}, {info.module})"


def _reraise_ctrl_c(exc: BaseException, arrived: Any, what: str) -> None:
    """Re-raise ``exc`` when it is Ctrl-C (see :mod:`.interrupts`), naming ``what`` it
    stopped on stderr; a ``KeyboardInterrupt`` the plugin raised itself returns, to be
    recorded as the plugin's failure like any other exception."""
    if isinstance(exc, KeyboardInterrupt) and interrupts.from_the_user(arrived):
        interrupts.say_interrupted(what)
        raise exc


def _reject_wrappers(pm: pluggy.PluginManager, plugin: object) -> None:
    """passkit calls each hookimpl on its own (to isolate it), so hook wrappers, which wrap
    the others, are not supported."""
    for caller in pm.get_hookcallers(plugin) or []:
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin and (impl.hookwrapper or getattr(impl, "wrapper", False)):
                raise TypeError(
                    f"hookimpl {caller.name} is a hook wrapper; passkit hooks do not support "
                    f"wrapper=True / hookwrapper=True"
                )


def _check_pass_list(result: Any) -> list[type[Pass]]:
    if result is None:
        return []
    if not isinstance(result, (list, tuple)):
        raise TypeError(f"passkit_register_passes must return a list of Pass classes, got {result!r}")
    out = []
    for cls in result:
        if not (isinstance(cls, type) and issubclass(cls, Pass)):
            raise TypeError(f"passkit_register_passes returned {cls!r}, which is not a Pass subclass")
        if not cls.name or not isinstance(cls.name, str):
            raise TypeError(f"pass class {cls.__qualname__} has no name")
        problem = pass_name_problem(cls.name)
        if problem:
            raise TypeError(f"pass class {cls.__qualname__}: name {cut_repr(cls.name)} {problem}")
        out.append(cls)
    return out


@dataclasses.dataclass(frozen=True)
class Found:
    """An installed entry point and the distribution that declares it."""

    ep: importlib.metadata.EntryPoint
    distribution: str | None
    version: str | None


def discover(groups: Iterable[str]) -> dict[str, list[Found]]:
    """The entry points of ``groups``, by group: one scan of the installed distributions,
    each one's metadata read once (``EntryPoint.dist.name`` parses it at every access), one
    entry per (distribution, name) (editable installs can list a distribution twice), sorted
    by distribution and name."""
    wanted = set(groups)
    out: dict[str, list[Found]] = {group: [] for group in wanted}
    seen: set[tuple[str, str | None, str]] = set()
    for dist in importlib.metadata.distributions():
        eps = [ep for ep in dist.entry_points if ep.group in wanted]
        if not eps:
            continue
        metadata = dist.metadata
        name, version = metadata["Name"], metadata["Version"]
        for ep in eps:
            key = (ep.group, name, ep.name)
            if key not in seen:
                seen.add(key)
                out[ep.group].append(Found(ep, name, version))
    for found in out.values():
        found.sort(key=lambda f: (f.distribution or "", f.ep.name))
    return out


# ---------------------------------------------------------------------------------------
# the process-wide plugin set

_lock = threading.RLock()
_cache: dict[tuple[Any, ...], PluginSet] = {}
_in_process: list[tuple[object, str]] = []


def register(plugin: object, name: str | None = None) -> None:
    """Register a plugin in-process (no entry point needed): a module or an object with
    ``passkit.hookimpl`` functions. Affects pipelines built afterwards."""
    with _lock:
        label = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        if any(p is plugin for p, _ in _in_process):
            return
        _in_process.append((plugin, label))
        _cache.clear()


def unregister(plugin: object) -> None:
    """Undo :func:`register`."""
    with _lock:
        _in_process[:] = [(p, n) for p, n in _in_process if p is not plugin]
        _cache.clear()


def get_plugins(
    *,
    autoload: bool = True,
    allow: Iterable[str] | None = None,
    block: Iterable[str] = (),
    strict: bool = False,
    cli_only: bool = False,
) -> PluginSet:
    """The loaded plugins for these settings; entry points are loaded once per process.
    ``cli_only``: the command line's light set (see :attr:`PluginSet.cli_only`)."""
    key = (
        cli_only,
        autoload,
        tuple(sorted(allow)) if allow is not None else None,
        tuple(sorted(block)),
        strict,
        tuple(id(p) for p, _ in _in_process),
    )
    with _lock:
        found = _cache.get(key)
        if found is None:
            found = PluginSet(cli_only=cli_only)
            found.load_entry_points(autoload=autoload, allow=allow, block=block, strict=strict)
            found._strict = strict
            for plugin, label in _in_process:
                found.add(plugin, PluginInfo(label, None, None, getattr(plugin, "__name__", label)))
            found._strict = False
            _cache[key] = found
        return found


def plugins_for(config: Config, cli_only: bool = False) -> PluginSet:
    """The plugin set ``config`` allows (its ``autoload``, ``plugins``, ``block_plugins``
    and ``strict_plugins``); ``cli_only``: the command line's light set."""
    return get_plugins(
        autoload=config.autoload,
        allow=config.plugins,
        block=config.block_plugins,
        strict=config.strict_plugins,
        cli_only=cli_only,
    )


def passes_for(config: Config, stacklevel: int = 2) -> tuple[PluginSet, list[Pass]]:
    """The plugin set ``config`` allows and the pass objects its entries name in it
    (:func:`instantiate`): what a pipeline is built from. Plugins that loaded with a
    mistake are warned of first, once per process (:class:`passkit.PluginMistakeWarning`,
    attributed as :func:`~passkit._plugins.checks.warn_mistakes`'s ``stacklevel`` says,
    counted from the caller: 2, the caller's caller)."""
    plugins = plugins_for(config)
    warn_mistakes(plugins.mistakes, stacklevel=stacklevel + 1)
    return plugins, instantiate(config, plugins)


def instantiate(config: Config, plugins: PluginSet) -> list[Pass]:
    """One pass object per enabled name, options validated, in config order."""
    warn_unknown_names(config, plugins)
    out: list[Pass] = []
    source = f"{config.passes_from}: " if config.passes_from else ""  # e.g. "PASSKIT_PASSES: "
    spelled: dict[int, str] = {}  # id(PassInfo) -> the entry that enabled it first
    for entry in config.passes:
        info = plugins.lookup(entry.name)
        if info is None and entry.name in plugins.clashes:
            raise ConfigError(source + clash_message(entry.name, plugins))
        if info is None:
            raise ConfigError(source + unknown_pass_message(entry.name, plugins))
        first = spelled.setdefault(id(info), entry.name)
        if first != entry.name:  # "cleanup" and "passkit:cleanup": one pass, run twice otherwise
            raise ConfigError(
                f"{source}passes: pass {cut_repr(info.cls.name)} is listed twice (as {cut_repr(first)} "
                f"and {cut_repr(entry.name)}: the bare and the qualified name of one pass)"
            )
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
    known = {normalize(p.name) for p in plugins.plugins}
    for found in (*plugins.found[ENTRY_POINT_GROUP], *plugins.found[CLI_ENTRY_POINT_GROUP]):
        known.update(_plugin_keys(found.ep.name, found.distribution))
    for field, names in (("plugins", config.plugins or []), ("block_plugins", config.block_plugins)):
        for name in names:
            if normalize(name) not in known:
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


def reset() -> None:
    """Forget loaded plugins (tests); the next :func:`get_plugins` rediscovers them."""
    with _lock:
        _cache.clear()


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """Run a block with no in-process registrations but its own, restoring the previous
    ones afterwards; plugin discovery is redone on entry and exit (tests, notebooks)."""
    with _lock:
        saved = list(_in_process)
        _in_process.clear()
        _cache.clear()
    try:
        yield
    finally:
        with _lock:
            _in_process[:] = saved
            _cache.clear()
