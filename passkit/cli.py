"""The ``passkit`` command line.

    passkit list [--json]        installed passes and plugin load failures
    passkit show NAME            a pass's documentation and options schema
    passkit schema               JSON schema of the config, with installed passes' options
    passkit check [FILE|DIR]     validate a config (and the PASSKIT_* environment) against the installed passes
    passkit explain MOD:FN       compile MOD:FN's model with the configured passes, print the report
    passkit bisect MOD:FN        the first rewrite after which MOD:FN's compiled output is wrong
    passkit bisect --run CMD     the same over a shell command, its exit status 0 meaning good
    passkit demo                 the demo (core, then plugins' demos)

Plugins add commands through the ``passkit_cli_commands`` hook (``passkit-fusion`` adds
``tune``). User mistakes print one clear line on stderr and exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, cast

from ._plugins.cli_hooks import call_hook
from ._plugins.hook_returns import HookReturnError
from ._plugins.options_docs import documented
from .environment import environment_checks
from .errors import PasskitError, PluginHookError, cut, cut_repr, describe

Handler = Callable[[argparse.Namespace], int]


def _plugins() -> Any:
    from ._plugins.registry import plugins_for
    from .config import load_config

    return plugins_for(load_config())


# -- list / show / schema ------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    from ._plugins.registry import owner

    plugins = _plugins()
    rows = []
    clashing = [
        (f"{owner(info.plugin)}:{name}", info) for name, infos in plugins.clashes.items() for info in infos
    ]
    for name, info in sorted([*plugins.passes.items(), *clashing]):
        cls = info.cls
        rows.append(
            {
                "name": name,
                "clash": ":" in name,
                "distribution": info.plugin.distribution or "(in-process)",
                "version": info.plugin.version or "",
                "plugin": info.plugin.name,
                "stage": cls.stage.value,
                "options": {k: _describe_field(f) for k, f in documented(cls.Options).model_fields.items()},
                "summary": _summary(cls),
            }
        )
    failures = [
        {
            "plugin": f.name,
            "distribution": f.distribution,
            "version": f.version,
            "stage": f.stage,
            "error": f.error,
        }
        for f in plugins.failures
    ] + [
        {
            "plugin": f.plugin,
            "distribution": f.distribution,
            "version": f.version,
            "stage": f"hook {f.hook}",
            "error": f.error,
        }
        for f in plugins.hook_failures
    ]
    mistakes = [dataclasses.asdict(m) for m in plugins.mistakes]
    checks = environment_checks(plugins)
    from ._plugins.env_variables import declared_variables
    from .config import CORE_VARIABLES

    variables = declared_variables(reserved=CORE_VARIABLES)
    if args.json:
        environment = [dataclasses.asdict(c) for c in checks]
        clashes = {n: [owner(i.plugin) for i in infos] for n, infos in sorted(plugins.clashes.items())}
        print(
            json.dumps(
                {
                    "passes": rows,
                    "failures": failures,
                    "mistakes": mistakes,
                    "clashes": clashes,
                    "environment": environment,
                    "variables": variables,
                },
                indent=2,
            )
        )
        return 0
    if not rows:
        print("no passes installed")
    width = max([len(r["name"]) for r in rows] + [4])
    origins = [f"{r['distribution']} {r['version']}".strip() for r in rows]
    origin_width = max([len(o) for o in origins] + [4])
    for r, origin in zip(rows, origins):
        print(f"{r['name']:<{width}}  {r['stage']:<15} {origin:<{origin_width}}  {r['summary']}")
        for opt, desc in r["options"].items():
            print(f"{'':<{width}}    {opt}: {desc}")
    if checks:
        print("\nenvironment (what the installed passes can read here):")
        for check in checks:
            print(f"  {check}")
    if variables:
        print("\nenvironment variables the installed distributions declare:")
        for variable, what in sorted(variables.items()):
            print(f"  {variable}: {what}")
    for name, infos in sorted(plugins.clashes.items()):
        who = ", ".join(f"{owner(i.plugin)}:{name}" for i in infos)
        print(f"NAME CLASH: pass {name!r} is registered by several distributions; enable one of {who}")
    for f in plugins.failures:
        print(f"FAILED TO LOAD: {f}", file=sys.stderr if not args.json else sys.stdout)
    for h in plugins.hook_failures:
        print(f"HOOK FAILED: {h}", file=sys.stderr)
    for m in plugins.mistakes:
        print(f"PLUGIN MISTAKE: {m}", file=sys.stderr)
    return 0


def _describe_field(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    ann = field.annotation
    ann = ann.__name__ if isinstance(ann, type) else str(ann).replace("typing.", "")
    default = "" if field.default is PydanticUndefined else f" = {field.default!r}"
    return f"{ann}{default}" + (f"  ({field.description})" if field.description else "")


def _summary(cls: type) -> str:
    """The first sentence of the class docstring, on one line."""
    paragraph = (inspect.getdoc(cls) or "").split("\n\n")[0]
    text = " ".join(paragraph.split())
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def cmd_show(args: argparse.Namespace) -> int:
    from .config import suggest

    plugins = _plugins()
    info = plugins.lookup(args.name)
    if info is None:
        raise PasskitError(
            f"no installed pass named {args.name!r}{suggest(args.name, plugins.passes)}; "
            f"installed: {', '.join(sorted(plugins.passes)) or '(none)'}"
        )
    cls = info.cls
    print(f"{cls.name}  ({info.plugin.origin})")
    print(f"stage: {cls.stage.value}   class: {cls.__module__}.{cls.__qualname__}")
    if cls.before or cls.after:
        print(f"runs before: {list(cls.before)}   runs after: {list(cls.after)}")
    if cls.graph_kinds is not None:
        why = f" ({cls.skip_graph_kinds_reason})" if cls.skip_graph_kinds_reason else ""
        print(f"graph kinds: {', '.join(cls.graph_kinds)}; skipped on the others{why}")
    print()
    print(inspect.getdoc(cls) or "(no documentation)")
    print("\noptions schema:")
    print(json.dumps(documented(cls.Options).model_json_schema(), indent=2))
    return 0


def config_schema(plugins: Any) -> dict[str, Any]:
    """The config's JSON schema, with each installed pass's options as a named variant."""
    from .config import Config

    schema = Config.model_json_schema()
    variants: list[dict[str, Any]] = []
    for name, info in sorted(plugins.passes.items()):
        opts = documented(info.cls.Options).model_json_schema()
        props = {"name": {"const": name}, **opts.get("properties", {})}
        variants.append(
            {
                "title": name,
                "type": "object",
                "properties": props,
                "required": ["name"],
                "additionalProperties": False,
            }
        )
        variants.append({"const": name})
    schema["properties"]["passes"] = {"type": "array", "items": {"anyOf": variants}}
    return schema


def cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(config_schema(_plugins()), indent=2))
    return 0


# -- check / explain -----------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    """Validate a config as a compile here would see it: FILE (or the file found in DIR, or,
    with no argument, the files a compile in this folder reads), then the ``PASSKIT_*``
    environment over it. Exit 0 when it runs passes, 1 when an environment check failed or
    no pass is enabled (a server refuses that config), 2 when it is invalid."""
    from ._compile.backend import Backend
    from ._pipeline.build import Pipeline
    from ._plugins.registry import instantiate, plugins_for
    from .config import ENV_ORIGIN, env_source, file_source, merge, sources

    if args.file is None:
        layers = sources()
        label = "the config of this folder" if layers else "no config file here and no PASSKIT_* set"
    else:
        path = config_file_in(Path(args.file))
        label = str(path)
        layers = [(str(path), file_source(path))]
        if env := env_source(os.environ):  # as at compile time: the environment wins
            layers.append((ENV_ORIGIN, env))
    cfg = merge(layers)
    plugins = plugins_for(cfg)
    # the checks a compile runs, by the code that runs them: the passes built and ordered,
    # then passkit's backend made (the `compiler` key resolved: imported when it names one)
    pipeline = Pipeline(cfg, plugins, instantiate(cfg, plugins))
    Backend(pipeline=pipeline)
    passes = pipeline.passes
    names = ", ".join(f"{p.name} ({p.stage.value})" for p in passes) or "(no pass enabled)"
    print(f"{label}: OK — {len(passes)} pass(es): {names}")
    for origin, _data in layers:
        print(f"  read: {origin}")
    if cfg.compiler != "inductor":
        print(f"  compiler: {cfg.compiler}")
    for mistake in plugins.mistakes:
        print(f"  PLUGIN MISTAKE: {mistake}")
    checks = environment_checks(plugins)
    for check in checks:
        print(f"  {check}")
    if failed := [c for c in checks if not c.ok]:
        print(
            f"{label}: {len(failed)} environment check(s) failed: the passes that depend on them will decline"
        )
        return 1
    if not passes:  # what a server started with this config refuses (docs/vllm.md)
        print(
            f"{label}: no pass is enabled: a compile runs none (passkit.backend warns, a vLLM server "
            "refuses to start); set PASSKIT_PASSES=name,... or passes in passkit.toml"
        )
        return 1
    return 0


CONFIG_FILES = ("passkit.toml", "pyproject.toml")


def config_file_in(path: Path) -> Path:
    """``path`` itself when it is a file; in a folder, its ``passkit.toml``, else its
    ``pyproject.toml``; a clear error otherwise."""
    try:
        if path.is_file():
            return path
        if path.is_dir():
            for name in CONFIG_FILES:
                if (path / name).is_file():
                    return path / name
                if os.path.lexists(path / name):  # a folder, a FIFO, a dangling symlink: named
                    from .config import not_a_config_file

                    raise PasskitError(f"{path / name}: {not_a_config_file(path / name)}")
            raise PasskitError(f"{path}: a folder with no {' or '.join(CONFIG_FILES)} in it")
        if os.path.lexists(path):  # a device (/dev/null), a FIFO, a socket, a broken symlink
            from .config import not_a_config_file

            raise PasskitError(f"{path}: {not_a_config_file(path) or 'not a regular file'}")
    except OSError as exc:
        raise PasskitError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    raise PasskitError(f"{path}: no such file or folder")


def _working_directory_importable() -> None:
    """Put the working directory first on ``sys.path``, as ``python -m``, pytest and
    uvicorn do (the ``passkit`` script's own folder is there instead)."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)


def import_target(target: str, expected: str = "function") -> Any:
    """The object ``package.module:name`` names, imported as ``python -m`` would (the working
    directory first on ``sys.path``). A target that is no importable name (a path, a
    relative module, nothing before or after ``:``) or that cannot be imported is one
    :class:`PasskitError` naming it and what to write instead."""
    example = f"'package.module:{expected}'"
    if ":" not in target:
        raise PasskitError(f"target {cut_repr(target)} must look like {example}")
    mod_name, _, attr = target.partition(":")
    if not mod_name or not attr:
        missing = "module name before" if not mod_name else f"{expected} name after"
        raise PasskitError(f"target {cut_repr(target)} has no {missing} ':' (expected {example})")
    path_like = any(c in mod_name for c in "/\\") or mod_name.startswith(".") or mod_name.endswith(".py")
    if path_like or not all(part.isidentifier() for part in mod_name.split(".")):
        stem = Path(mod_name.replace("\\", "/")).name.removesuffix(".py").lstrip(".") or "module"
        why = (
            "is a path or a relative name, not a module name: run passkit from the folder "
            f"holding {stem}.py and give '{stem}:{attr}'"
            if path_like
            else "is not a module name (dotted Python identifiers, e.g. package.module)"
        )
        raise PasskitError(f"target {cut_repr(target)}: {cut_repr(mod_name)} {why}")
    _working_directory_importable()
    try:
        found: Any = importlib.import_module(mod_name)
    except ImportError as exc:
        raise PasskitError(f"cannot import {mod_name!r} for target {target!r}: {exc}") from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the user's module raised (or called sys.exit) as it was imported
        raise target_raised(target, f"importing {mod_name!r}", exc) from None
    for part in attr.split("."):
        if not hasattr(found, part):
            raise PasskitError(f"module {mod_name!r} has no attribute {attr!r}")
        found = getattr(found, part)
    return found


def target_raised(target: str, when: str, exc: BaseException) -> PasskitError:
    """A :class:`PasskitError` for a target whose own code raised: one line naming the target
    and the exception, then the traceback's frames in the user's code only (passkit's and
    the import machinery's left out)."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _users_frame(f.filename)]
    where = "".join(traceback.format_list(frames)).rstrip("\n")
    return PasskitError(
        f"target {target!r} raised {describe(exc)} ({when})" + (f"\n{where}" if where else "")
    )


_NOT_THE_USERS = (str(Path(__file__).resolve().parent), str(Path(importlib.__file__).resolve().parent))
"""passkit's folder and the import machinery's: their frames are not the user's."""


def _users_frame(filename: str) -> bool:
    if filename.startswith("<frozen importlib"):
        return False
    try:
        resolved = str(Path(filename).resolve())
    except OSError:
        return True
    if f"{os.sep}torch{os.sep}" in resolved and "-packages" in resolved:  # torch's own (nn.Module's call)
        return False
    return not any(resolved.startswith(folder + os.sep) for folder in _NOT_THE_USERS)


def load_target(target: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Resolve ``module:function``; the function returns ``(model_or_fn, example_args)``."""
    factory = import_target(target)
    if not callable(factory):
        raise PasskitError(f"{target} is a {type(factory).__name__}, not a function")
    try:
        made = factory()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit too: a target that ends the program is named
        raise target_raised(target, "when called", exc) from None
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0])):
        raise PasskitError(
            f"{target} must return (model_or_function, example_args_tuple), got {type(made).__name__}"
        )
    fn, example = made
    return fn, tuple(example) if isinstance(example, (list, tuple)) else (example,)


def cmd_explain(args: argparse.Namespace) -> int:
    import torch

    from ._compile.backend import backend
    from .config import merge, sources

    fn, example = load_target(args.target)
    layers = sources()  # the files and PASSKIT_* a compile here reads, then the flags over them
    for flag, field, value in (
        ("--passes", "passes", args.passes),
        ("--dump", "dump_dir", args.dump),
        ("--compile-ranges", "compile_ranges", args.compile_ranges),
    ):
        if value is not None:
            layers.append((flag, {field: value}))  # a mistake is named by its flag
    # upfront: one call, a report for every token range
    b = backend(merge(layers), mode=args.mode, compile_at="upfront")
    dump_dir = b.pipeline.config.dump_dir
    if dump_dir is not None:  # refused now, not warned about midway and then claimed written
        _writable_folder(dump_dir, "--dump" if args.dump is not None else "dump_dir")
    if not b.pipeline.enabled:
        print("no pass is enabled (set `passes` in passkit.toml, PASSKIT_PASSES or --passes)")
        return 0
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(fn, backend=b, dynamic=True if args.dynamic else None)(*example)
    except (KeyboardInterrupt, PasskitError):
        raise
    except BaseException as exc:
        raise _target_or_compile(args.target, fn, example, exc) from None
    for report in b.reports:  # one per specialization when the compile is split by token range
        print(report.format())
    if dump_dir is not None:
        from ._pipeline.dump import _unwritable

        if str(dump_dir) in _unwritable:  # it went away or filled up during the compile
            print(f"{dump_dir}: the dumps could not all be written (see the warning above)", file=sys.stderr)
            return 1
        served = [str(r.graph_id) for r in b.reports if r.cache_hit]
        if served:  # no pass ran for them: nothing to dump but the report
            print(f"graph {', '.join(served)}: served from Inductor's cache, only its report is dumped")
        print(f"graphs, diffs and report.json written under {dump_dir}")
    return 0


def _target_or_compile(
    target: str, fn: Callable[..., Any], example: tuple[Any, ...], exc: BaseException
) -> BaseException:
    """What a failed compile-and-call of ``target``'s model was: the model's own code raising
    (it raises without torch.compile too: one line naming it and the user's frames, as for a
    factory that raises), else ``exc`` itself (torch.compile or a pass failed)."""
    import torch

    try:
        with torch.no_grad():
            fn(*example)
    except KeyboardInterrupt:
        raise
    except BaseException as eager:
        return target_raised(
            target, "calling its model on the example; it raises without torch.compile too", eager
        )
    return exc


def _writable_folder(path: Path, name: str) -> None:
    """Create ``path`` (parents too) and check a file can be written in it; a
    :class:`PasskitError` naming ``name`` (the flag or config key) otherwise."""
    import tempfile

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        why = "a file is in its place" if isinstance(exc, FileExistsError) else (exc.strerror or str(exc))
        raise PasskitError(f"{name} {cut(str(path))}: cannot be written ({why})") from None


def cmd_bisect(args: argparse.Namespace) -> int:
    from ._bisect import search

    if args.run is not None:  # any command, its exit status the check
        from ._bisect import command

        command.validate(args)
        return command.run(args)
    if args.target is None:
        raise PasskitError("give the target MODULE:FUNCTION, or --run CMD to bisect a shell command")
    search.validate(args)
    factory = import_target(args.target)  # named as explain names it, before any probe starts
    if not callable(factory):
        raise PasskitError(f"{args.target} is a {type(factory).__name__}, not a function")
    if args.repro is not None:
        _writable_folder(Path(args.repro), "--repro")
    return search.run(args)


def nonnegative_float(text: str) -> float:
    """A number >= 0 (an argparse ``type``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{value} is not >= 0")
    return value


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import main as demo_main

    return demo_main(args)


# -- parser ------------------------------------------------------------------------------


class UsageError(PasskitError):
    """A command line argparse refuses; its message is the whole line to print."""


class Parser(argparse.ArgumentParser):
    """argparse, with a mistake as one line (``passkit CMD: error: ... (see passkit CMD
    --help)``) raised as :class:`UsageError` instead of the usage block and ``SystemExit``.
    Plugins' subcommands get this class too (``add_parser`` makes the parent's class)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see `{self.prog} --help`)")


def name_list(text: str) -> list[str]:
    """``a,b,c`` -> ``["a", "b", "c"]`` (an argparse ``type``)."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names nothing (expected NAME,NAME,...)")
    return names


def int_list(text: str) -> list[int]:
    """``16,256`` -> ``[16, 256]`` (an argparse ``type``)."""
    values = []
    for part in [p.strip() for p in text.split(",")]:
        try:
            values.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part[:40]!r} is not an integer (expected N,N,..., e.g. 16,256)"
            ) from None
    return values


def positive_int(text: str) -> int:
    """An integer >= 1 (an argparse ``type``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def build_parser(all_plugins: bool = False) -> tuple[argparse.ArgumentParser, dict[str, Handler]]:
    """The parser and each command's handler. Plugins' commands come from the light plugin
    set (``passkit.cli`` entry points, in-process plugins: no torch imported), or with
    ``all_plugins`` from every plugin (a command a pass plugin adds)."""
    parser = Parser(prog="passkit", description="torch.compile graph passes as plugins")
    from ._version import __version__

    parser.add_argument("--version", action="version", version=f"passkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    handlers: dict[str, Handler] = {}

    p = sub.add_parser("list", help="installed passes and plugin load failures")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    handlers["list"] = cmd_list

    p = sub.add_parser("show", help="a pass's documentation and options schema")
    p.add_argument("name")
    handlers["show"] = cmd_show

    sub.add_parser("schema", help="JSON schema of the config with installed passes' options")
    handlers["schema"] = cmd_schema

    p = sub.add_parser(
        "check",
        help="validate a config file (passkit.toml or pyproject.toml) with the PASSKIT_* environment over it",
    )
    p.add_argument(
        "file",
        nargs="?",
        help="the file, or a folder holding passkit.toml / pyproject.toml "
        "(default: what a compile in this folder reads)",
    )
    handlers["check"] = cmd_check

    p = sub.add_parser("explain", help="compile MODULE:FUNCTION with the configured passes")
    p.add_argument("target", help="'pkg.module:factory'; factory() returns (model, example_args)")
    p.add_argument("--passes", type=name_list, help="comma-separated pass names (overrides the config)")
    p.add_argument("--dump", metavar="DIR", help="write graphs, diffs and the report here")
    p.add_argument("--mode", choices=["inductor", "eager"], default="inductor")
    p.add_argument(
        "--dynamic",
        action="store_true",
        help="compile with dynamic shapes: token ranges apply, one report per specialization",
    )
    p.add_argument(
        "--compile-ranges", type=int_list, metavar="N,N,...", help="range boundaries (overrides the config)"
    )
    handlers["explain"] = cmd_explain

    p = sub.add_parser(
        "bisect", help="find the first rewrite after which MODULE:FUNCTION's compiled output is wrong"
    )
    p.add_argument("target", nargs="?", help="'pkg.module:factory'; factory() returns (model, example_args)")
    p.add_argument(
        "--run",
        metavar="CMD",
        help="bisect a shell command instead (exit status 0 is good), run with PASSKIT_BISECT_LIMIT "
        "set, each run under --timeout seconds",
    )
    p.add_argument("--passes", type=name_list, help="comma-separated pass names (overrides the config)")
    p.add_argument(
        "--check",
        choices=["output", "compile", "grad"],
        default="output",
        help="output: differs from the compile with every rewrite refused; compile: the compile, "
        "a pass or the call fails; grad: a gradient differs (default: output)",
    )
    p.add_argument("--atol", type=nonnegative_float, default=1e-5, help="absolute tolerance (default 1e-5)")
    p.add_argument("--rtol", type=nonnegative_float, default=1e-4, help="relative tolerance (default 1e-4)")
    p.add_argument(
        "--world-size", type=positive_int, default=1, help="ranks of a gloo world per probe (default 1)"
    )
    p.add_argument("--repro", metavar="DIR", help="write a standalone reproducer of the culprit here")
    p.add_argument("--max-compiles", type=positive_int, default=64, help="most probes to run (default 64)")
    p.add_argument(
        "--timeout", type=positive_int, default=600, help="seconds per probe or --run run (default 600)"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="torch.manual_seed before the target is built (default 0)"
    )
    handlers["bisect"] = cmd_bisect

    p = sub.add_parser("demo", help="run the demo")
    p.add_argument("--mode", choices=["inductor", "eager"], default="inductor")
    p.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help=f"run only this demo (repeatable): {', '.join(_demo_names(all_plugins))}",
    )
    handlers["demo"] = cmd_demo

    builtin = dict(handlers)

    def checkpoint() -> Callable[[], None]:  # a plugin's parsers go with its failure
        choices, actions = dict(sub.choices), list(sub._choices_actions)

        def undo() -> None:
            sub.choices.clear()
            sub.choices.update(choices)
            sub._choices_actions[:] = actions

        return undo

    def no_builtin(plugin: object, extra: Any) -> None:
        replaced = sorted(set(extra or {}) & set(builtin))
        replaced += sorted(n for n in builtin if n not in replaced and sub.choices.get(n) is not parsers[n])
        if replaced:
            raise HookReturnError(
                f"the command(s) {', '.join(map(repr, replaced))} are passkit's own: a plugin cannot "
                "replace a built-in command (name yours otherwise); the plugin's commands are not added"
            )

    parsers = {name: sub.choices[name] for name in builtin}
    try:
        for extra in call_hook(
            "passkit_cli_commands",
            cli_only=not all_plugins,
            checkpoint=checkpoint,
            check=no_builtin,
            subparsers=sub,
        ):
            for name, handler in extra.items():
                handlers[name] = _plugin_command(name, handler)
    except PluginHookError:
        raise
    except PasskitError:
        pass  # a broken config must not hide the built-in commands (check reports it)
    return parser, handlers


def _plugin_command(name: str, handler: Handler) -> Handler:
    """A plugin's command handler whose return must be an exit status: None is 0, an int is
    itself, anything else a one-line error (rc 2), not a crash."""

    def run(args: argparse.Namespace) -> int:
        status = handler(args)
        if status is None:
            return 0
        if isinstance(status, int):
            return int(status)
        raise PasskitError(
            f"the plugin command {name!r} returned {cut_repr(status, 100)}, not an exit status "
            "(handler(args) -> int): a bug in the plugin that adds it"
        )

    return run


def _demo_names(all_plugins: bool) -> list[str]:
    from ._plugins.cli_hooks import plugin_demos

    try:
        return ["core", *plugin_demos(cli_only=not all_plugins)]
    except PasskitError:  # a broken config: `passkit check` names it
        return ["core"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; a mistake prints one line on stderr and returns 2; output into a
    pipe its reader closed (``passkit schema | head``) ends quietly; Ctrl-C returns 130 with a
    line, no traceback."""
    try:
        return _run(argv)
    except BrokenPipeError:
        _discard_stdout()
        return 0
    except KeyboardInterrupt:  # Ctrl-C: what it stopped is named where it was (a plugin's import)
        print("passkit: interrupted", file=sys.stderr)
        return 130


def _run(argv: Sequence[str] | None) -> int:
    command = "passkit"
    try:
        parser, handlers = build_parser()
        if _command_word(argv) not in (None, *handlers):  # a command a pass plugin adds
            parser, handlers = build_parser(all_plugins=True)
        try:
            args, extra = parser.parse_known_args(argv)
            if extra:  # named by the subcommand that does not know them (its --help lists its own)
                _subparser(parser, getattr(args, "command", None)).error(
                    f"unrecognized arguments: {' '.join(extra)}"
                )
        except SystemExit as exc:  # --help, --version
            return int(exc.code or 0) if not isinstance(exc.code, str) else 2
        if not args.command:
            parser.print_help()
            return 2
        command = f"passkit {args.command}"
        if args.command not in handlers:  # its plugin's passkit_cli_commands raised midway
            raise PasskitError("the plugin adding this command failed (see above)")
        return int(handlers[args.command](args) or 0)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    except PasskitError as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 2


def _command_word(argv: Sequence[str] | None) -> str | None:
    """The subcommand ``argv`` names: its first word that is no option (None: none)."""
    words = sys.argv[1:] if argv is None else argv
    return next((w for w in words if not w.startswith("-")), None)


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The parser of subcommand ``command`` (``parser`` itself when there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return cast(argparse.ArgumentParser, action.choices[command])
    return parser


def _discard_stdout() -> None:
    """After the reader of stdout went away: send what is left (and the interpreter's final
    flush) to /dev/null, so that no second BrokenPipeError is printed at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is no file (tests capture it)
        pass


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
