"""The conformance check every pass should pass.

:func:`check_pass` checks the properties passkit relies on and raises
:class:`ConformanceError` listing every one that fails::

    check_pass("fuse_addcmul", options_variants=[{}, {"min_numel": 64}], sample=(fn, (a, b, c)))

:func:`conformance_tests` makes the same checks a parametrized pytest test, one test per
property::

    test_fuse_addcmul_conformance = conformance_tests("fuse_addcmul", sample=(fn, (a, b, c)))

The properties (and the test ids):

``uuid-stable``
    Two instances with equal options give the same pipeline uuid (Inductor's cache key).
``uuid-cross-process``
    A fresh Python process computes the same uuid (no ``id()``, no hash randomisation).
``uuid-distinct``
    Different options give different uuids (needs two different ``options_variants``).
``options-json``
    The options survive a round trip through JSON, as they do through config files.
``options-reject-unknown``
    The options model rejects unknown keys, so a typo in a config is an error.
``neutral-graph``
    On a graph without the pass's pattern, the pass runs, reports 0 matches and leaves the
    graph as it was.
``idempotent``
    Running the pass again on its own output changes nothing (when ``Pass.idempotent``); for
    a pass declaring ``analysis_only = True`` (it reads the graph, rewrites nothing): it
    leaves the sample graph as it was.
``lint``
    The graph after the pass lints and its metadata agrees with fake-tensor propagation.
``plugin-valid``
    The plugin that registers the pass loads and its hookimpls validate.
``imports-without-cuda``
    The pass's module (and its plugin's) imports with no GPU visible, without initialising
    CUDA.

``sample`` is a ``(fn, inputs)`` pair whose graph contains the pass's pattern; without one,
``idempotent`` is skipped and ``lint`` uses the neutral graph. ``neutral`` replaces the
built-in graph without any pattern (``cos(x) @ y - 1``) when that one happens to contain
the pass's pattern. Graph checks run in the eager mode, once per options variant.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

import passkit
from passkit.graph_utils import graph_code, unified_diff
from passkit.plugins import ENTRY_POINT_GROUP, PassInfo, PluginSet, get_plugins, unknown_pass_message

from .harness import HarnessResult, copy_graph_module, run_passes

__all__ = [
    "PROPERTIES",
    "ConformanceError",
    "PassChecker",
    "PropertyResult",
    "Sample",
    "check_pass",
    "conformance_tests",
]

Sample = tuple[Callable[..., Any], Sequence[Any]]
"""A function and the inputs to call it with."""

PROPERTIES: tuple[str, ...] = (
    "uuid-stable",
    "uuid-cross-process",
    "uuid-distinct",
    "options-json",
    "options-reject-unknown",
    "neutral-graph",
    "idempotent",
    "lint",
    "plugin-valid",
    "imports-without-cuda",
)
"""Every property checked, in order (see the module docstring)."""

_SUBPROCESS_TIMEOUT_S = 120.0


def _neutral_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.cos(x) @ y - 1.0


_NEUTRAL: Sample = (_neutral_fn, (torch.ones(4, 4), torch.ones(4, 4)))


@dataclasses.dataclass(frozen=True)
class PropertyResult:
    """The outcome of checking one property."""

    name: str
    status: Literal["passed", "failed", "skipped"]
    detail: str = ""
    """Why it failed or was skipped."""

    def __str__(self) -> str:
        return f"{self.name}: {self.status}" + (f": {self.detail}" if self.detail else "")


class ConformanceError(AssertionError):
    """Some properties failed; :attr:`results` holds every property's outcome."""

    def __init__(self, pass_name: str, results: Sequence[PropertyResult]):
        self.results = list(results)
        failed = [r for r in self.results if r.status == "failed"]
        lines = [
            f"pass {pass_name!r} fails {len(failed)} conformance propert{'y' if len(failed) == 1 else 'ies'}:"
        ]
        lines += [f"- {r.name}: {_indent(r.detail)}" for r in failed]
        skipped = [r for r in self.results if r.status == "skipped"]
        if skipped:
            lines.append("skipped: " + "; ".join(f"{r.name} ({r.detail})" for r in skipped))
        super().__init__("\n".join(lines))


class _Skip(Exception):
    """The property does not apply (the message says why)."""


def check_pass(
    pass_: str | type[passkit.Pass],
    *,
    options_variants: Sequence[Mapping[str, Any]] | None = None,
    sample: Sample | None = None,
    neutral: Sample | None = None,
) -> list[PropertyResult]:
    """Check every property of :data:`PROPERTIES`; return their results.

    Args:
        pass_: a registered pass name or a ``Pass`` class.
        options_variants: options to check the pass with (default: its default options
            only). Give two or more different ones to check ``uuid-distinct``.
        sample: ``(fn, inputs)`` whose graph contains the pass's pattern.
        neutral: ``(fn, inputs)`` whose graph does not (default: ``cos(x) @ y - 1``).

    Raises:
        ConformanceError: listing every failed property (an ``AssertionError``).
    """
    checker = PassChecker(pass_, options_variants=options_variants, sample=sample, neutral=neutral)
    results = [checker.check(name) for name in PROPERTIES]
    if any(r.status == "failed" for r in results):
        raise ConformanceError(checker.cls.name, results)
    return results


def conformance_tests(
    pass_: str | type[passkit.Pass],
    *,
    options_variants: Sequence[Mapping[str, Any]] | None = None,
    sample: Sample | None = None,
    neutral: Sample | None = None,
) -> Callable[[str], None]:
    """A pytest test function checking :func:`check_pass`'s properties, one test each.

    Assign it to a ``test_*`` name in a test module::

        test_my_pass_conformance = conformance_tests("my_pass", sample=(fn, (x,)))

    The pass is resolved, and the shared work (one subprocess, the sample compiles) done,
    when the first of these tests runs, not at collection.
    """
    import pytest

    @functools.cache
    def checker() -> PassChecker:
        return PassChecker(pass_, options_variants=options_variants, sample=sample, neutral=neutral)

    @pytest.mark.parametrize("conformance_property", PROPERTIES)
    def test_conformance(conformance_property: str) -> None:
        result = checker().check(conformance_property)
        if result.status == "skipped":
            pytest.skip(result.detail)
        if result.status == "failed":
            pytest.fail(f"{checker().cls.name}: {result.detail}", pytrace=False)

    return test_conformance


# ---------------------------------------------------------------------------------------
# the checks


class PassChecker:
    """Checks the properties of one pass class, one at a time (:meth:`check`); arguments as
    for :func:`check_pass`. Work shared by several properties (the fresh process, compiling
    the sample) is done once, when the first of them needs it."""

    def __init__(
        self,
        pass_: str | type[passkit.Pass],
        *,
        options_variants: Sequence[Mapping[str, Any]] | None = None,
        sample: Sample | None = None,
        neutral: Sample | None = None,
    ):
        self.cls = _pass_class(pass_)
        variants = [dict(v) for v in options_variants] if options_variants is not None else [{}]
        if not variants:
            raise ValueError("options_variants must not be empty")
        self.instances = [self.cls(v) for v in variants]
        self.sample = sample
        self.neutral = neutral or _NEUTRAL
        self._runs: dict[tuple[str, passkit.Pass], HarnessResult] = {}

    def check(self, name: str) -> PropertyResult:
        """Check one property of :data:`PROPERTIES`."""
        if name not in PROPERTIES:
            raise ValueError(f"unknown property {name!r}; properties: {', '.join(PROPERTIES)}")
        method = getattr(self, "check_" + name.replace("-", "_"))
        try:
            method()
        except _Skip as skip:
            return PropertyResult(name, "skipped", str(skip))
        except AssertionError as exc:
            return PropertyResult(name, "failed", str(exc))
        except Exception as exc:
            return PropertyResult(name, "failed", f"{type(exc).__name__}: {exc}")
        return PropertyResult(name, "passed")

    # -- identity ----------------------------------------------------------------------
    def check_uuid_stable(self) -> None:
        for p in self.instances:
            twin = self.cls(p.options.model_copy(deep=True))
            if self._uuid(twin) != self._uuid(p):
                raise AssertionError(
                    f"two instances with options {p.options_json()} have different pipeline uuids; "
                    f"identities:\n{p.identity()}\n{twin.identity()}"
                )

    def check_uuid_cross_process(self) -> None:
        fresh = self._subprocess_facts["uuids"]
        for p, theirs in zip(self.instances, fresh):
            if theirs != self._uuid(p):
                raise AssertionError(
                    f"with options {p.options_json()}, a fresh process computes uuid {theirs[:12]}, "
                    f"this one {self._uuid(p)[:12]}: the pass's identity depends on process state "
                    "(object ids, hash randomisation, the environment)"
                )

    def check_uuid_distinct(self) -> None:
        if not self.cls.Options.model_fields:
            raise _Skip("the pass has no options")
        by_options = {p.options_json(): p for p in self.instances}
        if len(by_options) < 2:
            raise _Skip("give two or more different options_variants")
        seen: dict[str, str] = {}
        for options, p in by_options.items():
            uuid = self._uuid(p)
            if uuid in seen:
                raise AssertionError(f"options {seen[uuid]} and {options} give the same uuid {uuid[:12]}")
            seen[uuid] = options

    # -- options -----------------------------------------------------------------------
    def check_options_json(self) -> None:
        for p in self.instances:
            text = p.options_json()
            again = self.cls(json.loads(text))
            if again.options != p.options or again.options_json() != text:
                raise AssertionError(
                    f"options {p.options!r} do not survive JSON: {text} validates back to {again.options!r}"
                )

    def check_options_reject_unknown(self) -> None:
        unknown = "passkit_conformance_unknown_option"
        try:
            self.cls({unknown: 1})
        except passkit.ConfigError:
            return
        raise AssertionError(
            f"{self.cls.Options.__name__} accepts the unknown option {unknown!r}: a typo in a config "
            "would be silently ignored; set model_config = pydantic.ConfigDict(extra='forbid')"
        )

    # -- graphs ------------------------------------------------------------------------
    def check_neutral_graph(self) -> None:
        for p in self.instances:
            result = self._run("neutral", p)
            record = result.report[p.name]
            graphs = result.graphs[p.name]
            if record.matches or record.modified or graphs.after_code != graphs.before_code:
                raise AssertionError(
                    f"with options {p.options_json()}, on a graph without its pattern the pass reported "
                    f"{record.matches} match(es), modified={record.modified}; graph diff:\n{graphs.diff()}"
                )

    def check_idempotent(self) -> None:
        if not self.cls.idempotent:
            raise _Skip("the pass declares idempotent = False")
        if self.sample is None:
            raise _Skip("no sample given (a graph containing the pass's pattern)")
        if self.cls.analysis_only:
            self._check_analysis_leaves_the_graph()
            return
        matched = 0
        for p in self.instances:
            first = self._run("sample", p)
            if first.report[p.name].matches == 0:
                continue  # these options leave the sample alone
            matched += 1
            gm = copy_graph_module(first.graph_after)
            before = graph_code(gm)
            pipeline = passkit.Pipeline(passkit.Config(on_error="raise", verify=True), self._plugins, [p])
            again = pipeline.run(gm, mode="eager")[p.name]
            diff = unified_diff(before, graph_code(gm), "graph")
            if again.matches or diff:
                changed = f"; graph diff:\n{diff}" if diff else " (the graph is unchanged)"
                raise AssertionError(
                    f"with options {p.options_json()}, running the pass again on its own output "
                    f"reported {again.matches} match(es){changed}"
                )
        if not matched:
            sample_graph = self._run("sample", self.instances[0]).graph_before
            raise AssertionError(
                "the pass found nothing to do on the sample (0 matches with every options variant); "
                "give a sample containing its pattern (a pass that only reads the graph declares "
                f"analysis_only = True):\n{graph_code(sample_graph)}"
            )

    def _check_analysis_leaves_the_graph(self) -> None:
        for p in self.instances:
            result = self._run("sample", p)
            graphs = result.graphs[p.name]
            if result.report[p.name].modified or graphs.after_code != graphs.before_code:
                raise AssertionError(
                    f"with options {p.options_json()}, the pass declares analysis_only = True but "
                    f"changed the sample graph; graph diff:\n{graphs.diff()}"
                )

    def check_lint(self) -> None:
        # the harness verifies the graph after the pass (lint, fake-tensor re-propagation)
        for p in self.instances:
            self._run("sample" if self.sample is not None else "neutral", p)

    # -- packaging ---------------------------------------------------------------------
    def check_plugin_valid(self) -> None:
        dist = _distribution_of(self.cls)
        failures = [str(f) for f in self._plugins.failures if dist is not None and f.distribution == dist]
        if failures:
            raise AssertionError("the plugins of its distribution fail to load:\n" + "\n".join(failures))
        if self._registration() is not None:
            return
        where = f"{self.cls.__module__}.{self.cls.__qualname__}"
        if dist is None or not _has_entry_point(dist):
            raise _Skip(f"{where} is not provided by an installed plugin")
        raise AssertionError(
            f"distribution {dist} has {ENTRY_POINT_GROUP} entry points, but none registers {where}"
        )

    def check_imports_without_cuda(self) -> None:
        facts = self._subprocess_facts
        if facts["cuda_initialized"]:
            raise AssertionError(f"importing {', '.join(facts['modules'])} initialises CUDA")

    # -- shared work -------------------------------------------------------------------
    @functools.cached_property
    def _plugins(self) -> PluginSet:
        """The plugins installed through entry points, loaded afresh: what another process
        sees, without this process's ``passkit.register`` calls."""
        return _entry_point_plugins()

    def _registration(self) -> PassInfo | None:
        info = self._plugins.passes.get(self.cls.name)
        return info if info is not None and info.cls is self.cls else None

    def _uuid(self, p: passkit.Pass) -> str:
        return passkit.Pipeline(passkit.Config(), self._plugins, [p]).uuid()

    def _run(self, graph: Literal["sample", "neutral"], p: passkit.Pass) -> HarnessResult:
        """``p`` run on the sample or neutral graph (eager mode, verified); cached."""
        if (graph, p) not in self._runs:
            fn, inputs = self.sample if graph == "sample" and self.sample is not None else self.neutral
            self._runs[graph, p] = run_passes(fn, *inputs, passes=[p], on_error="raise", verify=True)
        record = self._runs[graph, p].report[p.name]
        if record.status != "ran":
            raise _Skip(f"the pass did not run on the {graph} graph: {record.reason}")
        return self._runs[graph, p]

    @functools.cached_property
    def _subprocess_facts(self) -> dict[str, Any]:
        """Uuids computed, and CUDA state after importing the pass's modules, in a fresh
        process with no GPU visible."""
        module, qualname = self.cls.__module__, self.cls.__qualname__
        if module == "__main__" or "<locals>" in qualname:
            raise _Skip(f"{module}.{qualname} cannot be imported by another process")
        modules = [module]
        info = self._registration()
        if info is not None:
            modules.append(info.plugin.module.partition(":")[0])
        request = {
            "modules": modules,
            "qualname": qualname,
            "variants": [json.loads(p.options_json()) for p in self.instances],
        }
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS_SCRIPT, json.dumps(request)],
            capture_output=True,
            text=True,
            env=env,
            timeout=_SUBPROCESS_TIMEOUT_S,
        )
        if proc.returncode != 0:
            raise AssertionError(
                f"a fresh process failed to import and instantiate the pass:\n{proc.stderr[-3000:]}"
            )
        facts: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        facts["modules"] = modules
        return facts


def _pass_class(pass_: str | type[passkit.Pass]) -> type[passkit.Pass]:
    if isinstance(pass_, str):
        plugins = get_plugins()
        info = plugins.passes.get(pass_)
        if info is None:
            raise passkit.ConfigError(unknown_pass_message(pass_, plugins))
        return info.cls
    if isinstance(pass_, type) and issubclass(pass_, passkit.Pass):
        return pass_
    raise TypeError(f"check a pass by registered name or Pass class, got {pass_!r}")


def _entry_point_plugins() -> PluginSet:
    plugins = PluginSet()
    plugins.load_entry_points()
    return plugins


def _distribution_of(cls: type) -> str | None:
    """The installed distribution providing ``cls``'s top-level package, if any."""
    top = cls.__module__.partition(".")[0]
    names = importlib.metadata.packages_distributions().get(top)
    return names[0] if names else None


def _has_entry_point(distribution: str) -> bool:
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return any(ep.dist is not None and ep.dist.name == distribution for ep in eps)


_SUBPROCESS_SCRIPT = """
import importlib, json, sys
request = json.loads(sys.argv[1])
modules = [importlib.import_module(name) for name in request["modules"]]
import torch
cuda_initialized = torch.cuda.is_initialized()
import passkit
from passkit.plugins import PluginSet
cls = modules[0]
for part in request["qualname"].split("."):
    cls = getattr(cls, part)
plugins = PluginSet()
plugins.load_entry_points()
uuids = [passkit.Pipeline(passkit.Config(), plugins, [cls(v)]).uuid() for v in request["variants"]]
print(json.dumps({"cuda_initialized": cuda_initialized, "uuids": uuids}))
"""
"""Run in a fresh interpreter: import the pass's modules, then compute the uuids exactly as
:meth:`PassChecker._uuid` does (a pipeline of the pass alone, entry-point plugins only)."""


def _indent(text: str) -> str:
    return text.replace("\n", "\n  ")
