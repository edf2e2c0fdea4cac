"""The passkit configuration: schema and sources.

Sources, highest precedence first:

1. Python: a :class:`Config` object and/or keyword arguments
   (``passkit.backend(passes=[...])``). Only fields set explicitly count.
2. Environment: ``PASSKIT_PASSES=a,b`` (options inline: ``a,b:max_tokens=4096``), ``PASSKIT_DISABLE=c``, ``PASSKIT_ON_ERROR=raise``,
   ``PASSKIT_DUMP_DIR=dir``, ``PASSKIT_VERIFY=1``, ``PASSKIT_STRICT_PLUGINS=1``,
   ``PASSKIT_PLUGINS=a,b`` (allow list), ``PASSKIT_BLOCK_PLUGINS=a,b``,
   ``PASSKIT_DISABLE_PLUGIN_AUTOLOAD=1``, ``PASSKIT_COMPILE_RANGES=16,256,2048``, ``PASSKIT_BISECT_LIMIT=N``, ``PASSKIT_CONFIG=path`` naming the TOML file
   to use instead of ``passkit.toml``. (``PASSKIT_CACHE_DIR`` is no config field: where
   passkit keeps its report cache.)
3. ``passkit.toml`` (keys at top level) in the working directory or the nearest parent.
4. ``[tool.passkit]`` in the nearest ``pyproject.toml``.

A field set by a higher source replaces it whole (lists are not concatenated), except
``disable``: a pass disabled by any source does not run, whichever source enables it
(``PASSKIT_DISABLE=x`` switches off a pass the application enables in Python: the switch
users reach for to rule a pass out, without editing code). A warning names both sources.
"""

from __future__ import annotations

import difflib
import errno
import json
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, cast

import pydantic
import tomllib

from . import logs
from .errors import ConfigError, cut, cut_repr, warn_config
from .errors import suggest as suggest  # re-exported: passkit.config.suggest
from .names import same_pass
from .pass_base import format_validation_error
from .tokens import check_boundaries

ENV_PREFIX = "PASSKIT_"
ENV_ORIGIN = "environment (PASSKIT_*)"
"""How errors name the environment as a config source (each error names its variable too)."""


class PassEntry(pydantic.BaseModel):
    """One enabled pass: its name and raw options (validated later by the pass's model).

    Written in config as a bare name (``"cleanup"``) or a table with ``name`` and the
    options inline (``{name = "allreduce_rmsnorm", max_tokens = 4096}``).
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    name: str
    options: dict[str, Any] = pydantic.Field(default_factory=dict)

    @pydantic.model_validator(mode="before")
    @classmethod
    def _coerce(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"name": value}
        if isinstance(value, Mapping) and "name" in value:
            rest = {k: v for k, v in value.items() if k != "name"}
            if set(rest) == {"options"} and isinstance(rest["options"], Mapping):
                rest = dict(rest["options"])
            return {"name": value["name"], "options": rest}
        return value


class TokenDim(pydantic.BaseModel):
    """Where the token count is: dimension ``dim`` of the ``input``-th tensor input of the
    compiled graph (both counted from 0)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    input: int = pydantic.Field(ge=0)
    dim: int = pydantic.Field(ge=0)


class Config(pydantic.BaseModel):
    """What passes run and how the pipeline behaves."""

    model_config = pydantic.ConfigDict(extra="forbid")

    passes: list[PassEntry] = pydantic.Field(default_factory=list)
    """Enabled passes, in run order (within each stage)."""
    disable: list[str] = pydantic.Field(default_factory=list)
    """Passes never to run, whichever source enables them (a higher-precedence one included)."""
    on_error: Literal["raise", "skip"] = "skip"
    """A failing pass: ``skip`` restores the graph and continues; ``raise`` stops the compile."""
    dump_dir: Path | None = None
    """Where to write graphs before/after each pass, diffs, reproducers and the report."""
    dump_when: Literal["always", "changed", "failed"] = "always"
    """Which pass runs ``dump_dir`` gets the graphs of: every one (``always``), those that
    changed the graph (``changed``), or only those that failed (``failed``: their
    reproducers). A failed pass's reproducer and the report are written whatever this says."""
    dump_passes: list[str] = pydantic.Field(default_factory=list)
    """Only these passes' graphs and reproducers are dumped (bare or qualified names; empty:
    every pass's)."""
    verify: bool | Literal["numeric"] = False
    """After each pass: lint the graph and re-propagate fake tensors to check metadata
    (``true``); ``"numeric"`` also runs the graph before and after the pass on the same
    random inputs and compares the outputs (tolerances per dtype). The cheap checks (op
    schemas of the changed nodes, the graph's outputs) run whatever this says."""
    compiler: str = "inductor"
    """What compiles the graphs after the passes when nothing in Python says (the named
    ``backend="passkit"``, or ``passkit.backend()`` without ``compiler=``): ``"inductor"``,
    ``"aot_eager"``, or ``"package.module:name"``, an AOTAutograd compiler callable
    ``(gm, example_inputs) -> callable`` a platform ships (imported at backend creation)."""
    strict_plugins: bool = False
    """A plugin that fails to load raises instead of being reported and skipped."""
    plugins: list[str] | None = None
    """Allow list of plugins (entry-point or distribution names); ``None`` allows all."""
    block_plugins: list[str] = pydantic.Field(default_factory=list)
    """Plugins (entry-point or distribution names) never to load."""
    autoload: bool = True
    """Load plugins from the ``passkit.passes`` entry points at all."""
    compile_ranges: list[int] | None = None
    """Token counts after which a new compile range starts (``[16, 256, 2048]``: 1..16,
    17..256, 257..2048, >= 2049). Each range compiles on its own; passes' token constraints
    add more boundaries where they change which passes apply."""
    token_dim: TokenDim | None = None
    """Where the token count is, when the default (the first dynamic dimension of the graph's
    inputs) is wrong."""
    compile_at: Literal["first_use", "upfront", "first_call"] = "first_use"
    """When a graph specialized by token range compiles its ranges. ``first_use`` (the
    default): the graph's first call compiles the range its token count falls in (inside
    Dynamo's compile, as ``backend="inductor"`` compiles its one graph) and every other range
    compiles the first time a call's token count lands in it, as Dynamo's own recompiles do;
    ``upfront`` compiles every range at the graph's first call (``first_call``: the same,
    its earlier name).

    Why ``first_use`` serves: a server's first call (start-up, health check) waits for one
    range, not all of them; its warm-up (the profiling run at the largest batch, the CUDA
    graph capture at each capture size) visits the ranges it will serve, so each compiles
    there, once, and a range no request reaches (sequence parallelism from 2048 tokens on a
    server that batches 512) never compiles. With a warm Inductor cache a range compiled at
    first use is a cache hit. Every rank of a tensor-parallel group sees the same token count
    on the same call, so all ranks compile the same range at the same call and their
    collectives stay in step. Choose ``upfront`` when no request may ever wait for a compile
    and the warm-up does not visit every range."""

    bisect_limit: int | None = pydantic.Field(default=None, ge=0)
    """Allow only the first N rewrites of the process (counted in compile order across
    graphs, stages, token ranges and passes; each logged) and refuse every later one
    (:mod:`passkit.rewrite_counter`): what ``passkit bisect`` searches. Unset: every rewrite
    runs and nothing is counted. Set, compiles bypass the caches."""

    _passes_from: str | None = pydantic.PrivateAttr(default=None)
    """Which source set ``passes`` (a file, an environment variable, ``Python config``), for
    errors found once the passes are known (unknown names, options)."""

    @pydantic.field_validator("dump_dir", mode="before")
    @classmethod
    def _dump_dir(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():
            raise ValueError("empty: name a folder, or leave dump_dir unset for no dumps")
        return value

    @pydantic.field_validator("compile_at")
    @classmethod
    def _upfront(cls, value: str) -> str:
        return "upfront" if value == "first_call" else value

    @pydantic.field_validator("compile_ranges")
    @classmethod
    def _check_ranges(cls, value: list[int] | None) -> list[int] | None:
        return None if value is None else check_boundaries(value)

    @pydantic.field_validator("passes")
    @classmethod
    def _check_twice(cls, value: list[PassEntry]) -> list[PassEntry]:
        seen: set[str] = set()
        for entry in value:
            if entry.name in seen:
                raise ValueError(f"pass {cut_repr(entry.name)} is listed twice")
            seen.add(entry.name)
        return value

    @pydantic.model_validator(mode="after")
    def _check_names(self) -> Config:
        both = [
            name if name == off else f"{name} (disable: {off})"
            for name in self.pass_names
            if (off := disabled_by(name, self.disable)) is not None
        ]
        if both:
            raise ValueError(f"pass(es) {cut(both)} are both enabled (passes) and disabled (disable)")
        return self

    _origins: dict[str, str] = pydantic.PrivateAttr(default_factory=dict)
    """The source that set each field (:func:`merge`), for errors found after validation."""

    def source_of(self, field: str) -> str:
        """How an error names where ``field`` was set: ``PASSKIT_COMPILER (compiler)``,
        ``passkit.toml: config key compiler``, or ``config key compiler`` (Python, a
        default, or not known)."""
        origin = self._origins.get(field)
        if origin == ENV_ORIGIN:
            variable = next((s for s, (f, _) in _ENV_FIELDS.items() if f == field), None)
            if variable is not None:
                return f"{ENV_PREFIX}{variable} ({field})"
        if origin and origin != "Python config":
            return f"{cut(origin)}: config key {field}"
        return f"config key {field}"

    @property
    def passes_from(self) -> str | None:
        """The source that set ``passes`` (None: not known, e.g. a Config built directly)."""
        return self._passes_from

    @property
    def pass_names(self) -> list[str]:
        return [p.name for p in self.passes]

    def options_for(self, name: str) -> dict[str, Any]:
        """The options of the enabled pass ``name`` (bare or qualified: :func:`passkit.names.same_pass`)."""
        for p in self.passes:
            if same_pass(p.name, name):
                return dict(p.options)
        return {}


def disabled_by(name: str, disable: Iterable[str]) -> str | None:
    """The ``disable`` entry that rules out the pass spelled ``name``, or None: the one
    normalization point of pass names in a config (:func:`passkit.names.same_pass`:
    ``cleanup`` and ``passkit:cleanup`` are one pass, in either list)."""
    return next((off for off in disable if same_pass(name, off)), None)


# ---------------------------------------------------------------------------------------
# validation helpers


def _validate(data: Mapping[str, Any], origin: str) -> Config:
    """One source's config, validated alone; errors name the source and the field (from
    the environment: the variable too, ``PASSKIT_ON_ERROR (on_error)``)."""
    rename = None
    if origin == ENV_ORIGIN:
        rename = {field: f"{ENV_PREFIX}{suffix} ({field})" for suffix, (field, _) in _ENV_FIELDS.items()}
    try:
        return Config.model_validate(dict(data))
    except pydantic.ValidationError as exc:
        msg = format_validation_error(exc, "", Config, what="config key", rename=rename)
        raise ConfigError(f"{cut(origin)}: {msg}") from None


# ---------------------------------------------------------------------------------------
# sources


def _find_upwards(filename: str, start: Path, strict: bool = True) -> Path | None:
    """The nearest ``filename`` in ``start`` or a parent. A name there that is not a
    readable regular file (a folder, a named pipe, a dangling symlink, a symlink loop) is a
    :class:`ConfigError` naming it, not "no config file": passkit would otherwise run with
    no pass and say nothing (``strict=False``: such a name is passed over)."""
    for folder in (start, *start.parents):
        candidate = folder / filename
        try:
            os.lstat(candidate)
        except OSError:  # nothing by that name (or a folder passkit may not look into)
            continue
        problem = not_a_config_file(candidate)
        if problem and not strict:
            continue
        if problem:
            raise ConfigError(f"config file {cut(candidate)}: {problem}")
        return candidate
    return None


def not_a_config_file(path: Path) -> str | None:
    """Why ``path`` (which exists, as a name) cannot be read as a config file, or None: it
    is a regular file (or a symlink to one). Never opens it (a named pipe would block)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if os.path.islink(path):
            loop = exc.errno == errno.ELOOP
            return "a symlink loop" if loop else f"a dangling symlink (to {cut(os.readlink(path))})"
        return f"cannot be read: {_why(exc)}"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder, not a file"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO), not a file"
    return "not a regular file"


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{cut(path)}: malformed TOML: {cut(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{cut(path)}: malformed TOML: nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{cut(path)}: malformed TOML: not UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read config file {cut(path)}: {_why(exc)}") from None


def _why(exc: BaseException) -> str:
    return str(getattr(exc, "strerror", None) or exc)


def file_source(path: Path) -> dict[str, Any]:
    """Read a passkit config file: ``passkit.toml`` (top-level keys) or ``pyproject.toml``."""
    data = read_toml(path)
    if path.name == "pyproject.toml":
        tool = data.get("tool", {})
        data = tool.get("passkit", {}) if isinstance(tool, dict) else {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: [tool.passkit] must be a table")
    return data


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"environment variable {name}={cut_repr(value)}: expected 1/0, true/false, yes/no")


def _verify(name: str, value: str) -> bool | str:
    if value.strip().lower() == "numeric":
        return "numeric"
    return _bool(name, value)


def _text(name: str, value: str) -> str:
    return value.strip()


def _names(name: str, value: str) -> list[str]:
    return _split(value)


def _pass_entries(name: str, value: str) -> list[Any]:
    """``a,b:key=value:key2=value2`` -> ``["a", {"name": "b", "key": value, ...}]``.

    Values are read as JSON where they parse (``4096``, ``true``), else as strings. Commas
    and spaces only (``",,,"``: a list that lost its names) are an error, not "no passes"."""
    entries: list[Any] = []
    if value.strip() and not _split(value):
        raise ConfigError(
            f"environment variable {name}={cut_repr(value)} names no pass (only separators): give "
            f"pass names ({name}=cleanup,mul_to_scale), or leave {name} unset for the config files' passes"
        )
    for item in _split(value):
        pass_name, *pairs = item.split(":")
        if pairs and "=" not in pairs[0]:  # a qualified name: acme-passes:my_pass
            pass_name += ":" + pairs.pop(0)
        if not pairs:
            entries.append(pass_name)
            continue
        options: dict[str, Any] = {"name": pass_name}
        for pair in pairs:
            key, sep, raw = pair.partition("=")
            if not sep or not key:
                raise ConfigError(
                    f"{name}={cut_repr(value)}: expected name:option=value, got {cut_repr(item)}"
                )
            try:
                options[key] = json.loads(raw)
            except (ValueError, RecursionError):
                options[key] = raw
        entries.append(options)
    return entries


def _ints(name: str, value: str) -> list[int]:
    try:
        return [int(v) for v in _split(value)]
    except ValueError:
        raise ConfigError(
            f"environment variable {name}={cut_repr(value)}: expected integers separated by commas"
        ) from None


def _int(name: str, value: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise ConfigError(
            f"environment variable {name}={cut_repr(value)}: expected an integer >= 0"
        ) from None


def _not(name: str, value: str) -> bool:
    return not _bool(name, value)


# PASSKIT_<suffix> -> (config field, parser(variable name, raw value))
_ENV_FIELDS: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "PASSES": ("passes", _pass_entries),
    "DISABLE": ("disable", _names),
    "ON_ERROR": ("on_error", _text),
    "DUMP_DIR": ("dump_dir", _text),
    "DUMP_WHEN": ("dump_when", _text),
    "DUMP_PASSES": ("dump_passes", _names),
    "VERIFY": ("verify", _verify),
    "STRICT_PLUGINS": ("strict_plugins", _bool),
    "PLUGINS": ("plugins", _names),
    "BLOCK_PLUGINS": ("block_plugins", _names),
    "DISABLE_PLUGIN_AUTOLOAD": ("autoload", _not),
    "COMPILE_RANGES": ("compile_ranges", _ints),
    "COMPILE_AT": ("compile_at", _text),
    "COMPILER": ("compiler", _text),
    "BISECT_LIMIT": ("bisect_limit", _int),
}


def env_source(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for suffix, (field, parse) in _ENV_FIELDS.items():
        name = ENV_PREFIX + suffix
        if name in environ:
            out[field] = parse(name, environ[name])
    if out.get("dump_dir") == "":
        del out["dump_dir"]
        warn_config(
            f"{ENV_PREFIX}DUMP_DIR is set but empty: no dumps are written (unset it, or name a folder)"
        )
    known = set(CORE_VARIABLES)
    strange = [n for n in environ if n not in known and n[: len(ENV_PREFIX)].upper() == ENV_PREFIX]
    if strange:  # the variables installed distributions declare, asked only when needed
        known |= set(_declared_variables())
    for name in strange:
        if name not in known and name.upper() in known:
            raise ConfigError(
                f"environment variable {cut(name)}: passkit's variables are upper case "
                f"(did you mean {name.upper()}?)"
            )
        if name.startswith(ENV_PREFIX) and name not in known and name.isupper():
            close = difflib.get_close_matches(name[:100], sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(
                f"unknown environment variable {cut(name)}{hint} (passkit's own and those its "
                "installed distributions declare are known: `passkit list` shows them)"
            )
    return out


CORE_VARIABLES = frozenset(
    {ENV_PREFIX + s for s in _ENV_FIELDS} | {ENV_PREFIX + "CONFIG", ENV_PREFIX + "CACHE_DIR"}
)
"""The ``PASSKIT_*`` variables the core reads."""


def _declared_variables() -> dict[str, str]:
    """The ``PASSKIT_*`` variables installed distributions declare (``passkit_environment_variables``)."""
    from ._plugins.env_variables import declared_variables

    return declared_variables(reserved=CORE_VARIABLES)


def sources(
    cwd: Path | None = None, environ: Mapping[str, str] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """Config sources below Python, lowest precedence first, as ``(origin, data)``."""
    environ = os.environ if environ is None else environ
    cwd = Path.cwd() if cwd is None else cwd
    found: list[tuple[str, dict[str, Any]]] = []
    pyproject = _find_upwards("pyproject.toml", cwd)
    if pyproject is not None:
        data = file_source(pyproject)
        if data:
            found.append((f"{pyproject} [tool.passkit]", data))
    explicit = environ.get(ENV_PREFIX + "CONFIG")
    if explicit:
        path = _explicit_file(explicit)
        found.append((str(path), file_source(path)))
    else:
        toml = _find_upwards("passkit.toml", cwd)
        if toml is not None:
            found.append((str(toml), file_source(toml)))
    for other in _UNREAD:
        unread = _find_upwards(other, cwd, strict=False)
        if unread is not None:
            warn_config(f"{unread} is not read: passkit reads passkit.toml (TOML) and [tool.passkit]")
    env = env_source(environ)
    if env:
        found.append((ENV_ORIGIN, env))
    return found


_UNREAD = ("passkit.yaml", "passkit.yml", "passkit.json", ".passkit.toml")
"""Config-looking files passkit does not read (a warning names them)."""


def _explicit_file(value: str) -> Path:
    """The file ``PASSKIT_CONFIG`` names; any path that cannot be read is a ConfigError
    (a name too long, a folder, no permission...), not an OSError."""
    where = f"PASSKIT_CONFIG={cut(value)}"
    try:
        path = Path(value)
        os.lstat(path)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: cannot be read: {_why(exc)}") from None
    problem = not_a_config_file(path)
    if problem:
        raise ConfigError(f"{where}: {problem}")
    return path


_NOT_NULLABLE = frozenset(
    name
    for name, field in Config.model_fields.items()
    if not field.is_required() and field.default is not None
)
"""Fields for which None is no value: ``passes=None`` in Python means "not set"."""


def merge(layers: Iterable[tuple[str, Mapping[str, Any]]]) -> Config:
    """Merge config layers (lowest precedence first) into one validated :class:`Config`."""
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}
    disabled: dict[str, tuple[int, str]] = {}  # entry -> (level, source) that disabled it first
    passes_from = (-1, "")
    for level, (origin, data) in enumerate(layers):
        layer = _validate(data, origin)  # each layer must be valid on its own
        for field in layer.model_fields_set:
            merged[field] = getattr(layer, field)
            origins[field] = origin
        if "passes" in layer.model_fields_set:
            passes_from = (level, origin)
        for name in layer.disable:
            disabled.setdefault(name, (level, origin))

    def source_disabling(name: str) -> tuple[int, str] | None:  # whichever spelling, either side
        off = disabled_by(name, disabled)
        return None if off is None else disabled[off]

    passes = [p for p in merged.get("passes", []) if source_disabling(p.name) is None]
    for p in merged.get("passes", []):  # a lower source's disable overrides: say so
        by = source_disabling(p.name)
        if by is not None and by[0] < passes_from[0]:
            logs.log.warning(
                "passkit: pass %r, enabled by %s, does not run: %s disables it (disable wins "
                "whatever its source)",
                p.name,
                passes_from[1],
                by[1],
            )
    merged["passes"] = passes
    merged["disable"] = list(disabled)
    config = Config.model_validate(merged)
    config._origins = origins
    if passes_from[1]:
        config._passes_from = f"{ENV_PREFIX}PASSES" if passes_from[1] == ENV_ORIGIN else passes_from[1]
    return config


def load_config(
    config: Config | Mapping[str, Any] | None = None,
    *,
    cwd: Path | None = None,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Config:
    """Resolve the effective config from every source (see the module docstring)."""
    layers = sources(cwd=cwd, environ=environ)
    python: dict[str, Any] = {}
    if isinstance(config, Config):
        python.update({f: getattr(config, f) for f in config.model_fields_set})
    elif config is not None:
        python.update(config)
    python.update(overrides)
    for name in [n for n, v in python.items() if v is None and n in _NOT_NULLABLE]:
        del python[name]  # passes=None: not set (a field that has no None value)
    if python:
        layers.append(("Python config", python))
    merged = merge(layers)
    if isinstance(config, Config) and config.passes_from and "passes" not in overrides:
        merged._passes_from = config.passes_from  # a resolved config: its passes' source stays
    if isinstance(config, Config):  # and so do its other fields' sources
        merged._origins.update({f: o for f, o in config._origins.items() if f not in overrides})
    return merged


# ---------------------------------------------------------------------------------------
# the compiler the config names


COMPILERS = ("inductor", "aot_eager")
"""The compilers :class:`passkit.Backend` knows by name (any AOTAutograd compiler callable works too)."""


def resolve_compiler(spec: str, where: str = "config key compiler") -> str | Callable[..., Any]:
    """The compiler the config's ``compiler`` names: ``"inductor"`` / ``"aot_eager"`` as is,
    ``"package.module:name"`` imported (a callable, else a :class:`ConfigError` naming
    ``where`` it was set: :meth:`passkit.Config.source_of`, e.g. ``PASSKIT_COMPILER
    (compiler)``). A compile and ``passkit check`` both call it."""
    if spec in COMPILERS:
        return spec
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"{where}: {cut_repr(spec)} is neither one of {list(COMPILERS)} nor "
            f"'package.module:name' (an AOTAutograd compiler callable){suggest(spec, COMPILERS)}"
        )
    import importlib

    try:
        found: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            found = getattr(found, part)
    except BaseException as exc:  # a missing module or name, sys.exit() at import: the config's
        if isinstance(exc, KeyboardInterrupt):  # mistake, said as such
            raise
        raise ConfigError(f"{where}: cannot import {cut_repr(spec)} ({type(exc).__name__}: {exc})") from None
    if not callable(found):
        raise ConfigError(
            f"{where}: {cut_repr(spec)} is a {type(found).__name__}, not a compiler callable "
            "(gm, example_inputs) -> callable"
        )
    return cast(Callable[..., Any], found)
