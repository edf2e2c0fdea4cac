"""Base classes a pass derives from.

A pass is a class with a ``name``, a ``stage``, optional ``before``/``after`` ordering hints,
an ``Options`` pydantic model and a ``run`` method that rewrites a ``torch.fx.GraphModule``
in place and returns a :class:`PassResult`::

    class DropDetach(passkit.GraphPass):
        name = "drop_detach"

        def run(self, gm, ctx):
            n = 0
            for node in list(gm.graph.find_nodes(op="call_function", target=aten.detach.default)):
                node.replace_all_uses_with(node.args[0]); gm.graph.erase_node(node); n += 1
            return passkit.PassResult(modified=n > 0, matches=n)
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import inspect
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import pydantic

from . import logs
from .errors import ConfigError, PassCodeError, cut, cut_repr, describe, suggest
from .tokens import TokenConstraint

if TYPE_CHECKING:
    import torch.fx

    from .context import CompileContext


class Stage(str, enum.Enum):
    """Where in torch.compile a pass runs, in run order: :attr:`PRE_GRAD` (the torch-level
    graph Dynamo captured), :attr:`JOINT` (forward and backward together, before AOTAutograd
    partitions them), :attr:`PRE` and :attr:`POST` (Inductor's post-grad pipeline, on each
    forward, backward or inference graph).

    :attr:`PRE_GRAD` and :attr:`JOINT` run under passkit's own backend (``passkit.backend``,
    ``backend="passkit"``), whatever its compiler; hosts that install passkit into their own
    Inductor config (vLLM, SGLang, :func:`passkit.install`) run the two post-grad stages only,
    and report a pass at another stage skipped, with why.
    """

    PRE_GRAD = "pre_grad"
    """On Dynamo's torch-level graph (``torch.*`` functions, ``Tensor`` methods, the model's
    parameters as inputs), before AOTAutograd: run by passkit's backend on the graph Dynamo
    hands it, for any compiler. The graph is not functionalized nor normalized."""
    JOINT = "joint"
    """On the joint forward+backward ATen graph before it is partitioned (Inductor's
    ``joint_custom_pre_pass``, or a wrapped ``partition_fn`` for other compilers); on an
    inference graph (nothing to partition) it runs on that graph, before the post-grad
    stages."""
    PRE = "post_grad_pre"
    """Before Inductor's own post-grad pattern passes (graph as AOTAutograd produced it)."""
    POST = "post_grad_post"
    """After Inductor's own post-grad passes, just before lowering."""


STAGE_ORDER: tuple[Stage, ...] = (Stage.PRE_GRAD, Stage.JOINT, Stage.PRE, Stage.POST)
"""Stages in the order a compile runs them."""
POST_GRAD_STAGES: tuple[Stage, ...] = (Stage.PRE, Stage.POST)
"""The stages every host runs (on each forward, backward or inference graph)."""

GraphKind = str
"""What graph a pass sees: ``"torch"`` (pre-grad), ``"joint"``, ``"forward"``,
``"backward"`` or ``"inference"``."""
GRAPH_KINDS: tuple[str, ...] = ("torch", "joint", "forward", "backward", "inference")


def stage_phase(stage: Stage) -> str:
    """The graph a stage runs on: ``"pre_grad"``, ``"joint"`` or ``"post_grad"`` (the two
    post-grad stages share one graph, and one report)."""
    if stage is Stage.PRE_GRAD:
        return "pre_grad"
    if stage is Stage.JOINT:
        return "joint"
    return "post_grad"


class NoOptions(pydantic.BaseModel):
    """Options model of a pass that takes none."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


@dataclasses.dataclass(frozen=True)
class Requirements:
    """What a pass needs to be useful. Unmet requirements skip the pass with a reason."""

    cuda: bool = False
    """The graph must run on CUDA."""
    min_world_size: int = 1
    """Smallest default-process-group size at which the pass does anything."""
    packages: tuple[str, ...] = ()
    """Importable modules the pass needs (checked lazily, without importing them)."""

    def unmet(self, ctx: CompileContext) -> str | None:
        """Return why these requirements are not met in ``ctx``, or ``None``."""
        import importlib.util

        if self.cuda and ctx.device != "cuda":
            return f"needs CUDA tensors (graph is on {ctx.device})"
        if ctx.world_size < self.min_world_size:
            return f"needs world size >= {self.min_world_size} (got {ctx.world_size})"
        for pkg in self.packages:
            if importlib.util.find_spec(pkg) is None:
                return f"needs the package {pkg!r}, which is not installed"
        return None


@dataclasses.dataclass
class PassResult:
    """What one run of a pass did: ``run(gm, ctx)`` returns it, and the report shows it."""

    modified: bool = False
    """Whether the pass changed the graph (passkit then recompiles the module)."""
    matches: int = 0
    """How many sites the pass rewrote: the report's ``matches`` column."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """Remarks for the report's ``note`` column (``PassResult(notes=["2 sites without a
    residual"])``), joined with ``; ``."""
    declined: str | None = None
    """Why the pass could not read this graph at all, when it could not: an op whose schema
    or host version it does not know. The record's status becomes ``declined`` with this
    reason and a :class:`~passkit.errors.PassDeclinedWarning` is emitted (once per process
    and reason). Use it for what the user must act on (upgrade the pass package, pin
    torch), never for a graph that simply has nothing to rewrite."""

    @classmethod
    def unchanged(cls, note: str | None = None) -> PassResult:
        return cls(modified=False, matches=0, notes=[note] if note else [])

    @classmethod
    def declining(cls, reason: str, notes: list[str] | None = None) -> PassResult:
        """The graph was left as it was because the pass cannot read it (see :attr:`declined`)."""
        return cls(modified=False, matches=0, notes=list(notes or []), declined=reason)


class Pass:
    """A graph pass. Subclass it (usually through :class:`GraphPass` or :class:`PatternPass`).

    Class attributes:
        name: unique name users enable in config.
        stage: :class:`Stage` the pass runs in.
        before / after: names of passes this one must run before / after when both are
            enabled. Violations of the configured order are errors.
        Options: a pydantic model of the pass's options (``extra="forbid"`` recommended).
        requires: :class:`Requirements`; unmet ones skip the pass with a reason.
        idempotent: running the pass twice changes nothing the second time.
        analysis_only: the pass reads the graph and rewrites nothing (it reports what it
            found in ``matches`` and ``notes``): passkit-testing's conformance checks that it
            leaves the sample graph as it was, instead of checking that a second run finds
            nothing left to do.
        source_files: extra files whose content is part of the pass's cache identity
            (the module defining the class is always included).
        tokens: a :class:`~passkit.TokenConstraint`: the token counts the pass applies to
            (``None``: all). Override :meth:`token_constraint` to derive it from options or
            the compile context. The backend compiles one specialization per token range
            with a distinct set of applicable passes and picks one per call.
        depends_on: passes whose rewrite this one acts on (``async_tp`` acts on the
            all-gathers and reduce-scatters ``sequence_parallel`` makes). When one of them is
            enabled, this pass runs only in token ranges where one of them can run, after
            it, and only on graphs it changed; with none enabled, it runs on its own. Implies
            ``after``.
        shares_sites_with: passes that rewrite the same sites as this one (either side
            may declare it): where both apply, the one first in pipeline order takes every
            site and the other has nothing left, so it is left out of that token range and
            neighbouring ranges that differ only by it compile once.
        graph_kinds: the kinds of graph the pass runs on (``"torch"``, ``"joint"``,
            ``"forward"``, ``"backward"``, ``"inference"``; ``None``: every graph its stage
            sees). On another kind it is skipped, the report saying why
            (``skip_graph_kinds_reason`` added to it).
        environment_modules: modules whose presence decides whether the pass skips or what it
            writes (a kernel library: ``("flashinfer",)``). Whether each is importable, from
            where and at what version is part of the pass's cache identity
            (:meth:`environment`), so a compile cached while one was missing (the pass skipped)
            is not served once it is installed. Override :meth:`environment` for anything else
            a decision reads from the process (an environment variable, a driver version).
        required: the pass must run whenever it is enabled (a pass others depend on to leave
            a graph they can compile): ``bisect_limit`` never refuses its rewrites nor counts
            them, so ``passkit bisect`` searches only the other passes' rewrites.
    """

    name: ClassVar[str] = ""
    stage: ClassVar[Stage] = Stage.POST
    before: ClassVar[Sequence[str]] = ()
    after: ClassVar[Sequence[str]] = ()
    Options: ClassVar[type[pydantic.BaseModel]] = NoOptions
    requires: ClassVar[Requirements] = Requirements()
    idempotent: ClassVar[bool] = True
    analysis_only: ClassVar[bool] = False
    source_files: ClassVar[Sequence[str]] = ()
    tokens: ClassVar[TokenConstraint | None] = None
    depends_on: ClassVar[Sequence[str]] = ()
    shares_sites_with: ClassVar[Sequence[str]] = ()
    graph_kinds: ClassVar[Sequence[str] | None] = None
    skip_graph_kinds_reason: ClassVar[str] = ""
    environment_modules: ClassVar[Sequence[str]] = ()
    required: ClassVar[bool] = False

    def __init__(self, options: pydantic.BaseModel | dict[str, Any] | None = None, **kwargs: Any):
        if options is not None and kwargs:
            raise TypeError("pass either an options object or keyword options, not both")
        if isinstance(options, pydantic.BaseModel):
            if not isinstance(options, self.Options):
                raise TypeError(
                    f"{self.name}: options must be {self.Options.__name__}, got {type(options).__name__}"
                )
            self.options = options
        else:
            self.options = validate_options(type(self), dict(options or kwargs))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not isinstance(cls.stage, Stage):
            valid = {s.value for s in Stage}
            if not isinstance(cls.stage, str) or cls.stage not in valid:
                raise TypeError(
                    f"pass class {cls.__module__}.{cls.__qualname__} (pass "
                    f"{cls.__dict__.get('name', cls.name)!r}): stage = {cut_repr(cls.stage)} is not "
                    f"a stage; valid: " + ", ".join(f"{s.value!r} (passkit.Stage.{s.name})" for s in Stage)
                )
            cls.stage = Stage(cls.stage)
        kinds = cls.__dict__.get("graph_kinds")
        if kinds is not None:
            bad = [k for k in kinds if k not in GRAPH_KINDS] if not isinstance(kinds, str) else [kinds]
            if bad:
                raise TypeError(
                    f"pass class {cls.__module__}.{cls.__qualname__} (pass "
                    f"{cls.__dict__.get('name', cls.name)!r}): graph_kinds = {cut_repr(kinds)} holds "
                    f"{cut_repr(bad)}; valid kinds: " + ", ".join(repr(k) for k in GRAPH_KINDS)
                )

    def graph_kind_skip(self, ctx: CompileContext) -> str | None:
        """Why this pass does not run on the graph of ``ctx`` (its kind is not in
        :attr:`graph_kinds`), or None."""
        kinds = self.graph_kinds
        if kinds is None or ctx.graph_kind is None or ctx.graph_kind in kinds:
            return None
        why = f"runs on {'/'.join(kinds)} graphs only; this is a {ctx.graph_kind} graph"
        return f"{why}: {self.skip_graph_kinds_reason}" if self.skip_graph_kinds_reason else why

    # -- to override -----------------------------------------------------------------
    def run(self, gm: torch.fx.GraphModule, ctx: CompileContext) -> PassResult:
        """Rewrite ``gm.graph`` in place and say what changed."""
        raise NotImplementedError(f"pass {self.name!r} does not implement run()")

    def skip_reason(self, ctx: CompileContext) -> str | None:
        """Why this pass should not run in ``ctx`` (``None`` to run). Default: ``requires``."""
        return self.requires.unmet(ctx)

    def token_constraint(self, ctx: CompileContext) -> TokenConstraint | None:
        """The token counts this pass applies to in ``ctx`` (``ctx.token_range`` is not set
        yet: this decides the ranges). Default: the class attribute :attr:`tokens`. Must be
        the same on every rank."""
        return self.tokens

    def decision_source(self, ctx: CompileContext) -> str | None:
        """Where this pass's token-range decision in ``ctx`` came from, for its report record
        (:attr:`PassRecord.decision <passkit.PassRecord.decision>`), ran or skipped: a short
        word the pass defines (a tuned pass: ``"table"``, ``"measured"``, ``"stored"``), the
        same on every rank. Default: None (the pass does not say)."""
        return None

    # -- called by passkit (a pass's own code, isolated) -------------------------------
    code_failure: PassCodeError | None = None
    """Set when one of this pass's own methods called to plan a compile (:meth:`skip_reason`,
    :meth:`token_constraint`) raised or returned garbage: the pass then runs nowhere for the
    rest of the process, and every compile records it ``failed`` with this error."""

    def checked_skip_reason(self, ctx: CompileContext) -> str | None:
        """:meth:`skip_reason`, isolated: when it raises or returns something else than a
        string or None, :attr:`code_failure` is set and its message returned (the pass does
        not run)."""
        if self.code_failure is not None:
            return str(self.code_failure)
        try:
            reason = self.skip_reason(ctx)
        except Exception as exc:
            return str(self._code_failed(f"skip_reason() raised {describe(exc)}", exc))
        if reason is not None and not isinstance(reason, str):
            return str(self._code_failed(f"skip_reason() must return a str or None, got {cut_repr(reason)}"))
        return reason or None

    def checked_decision_source(self, ctx: CompileContext) -> str | None:
        """:meth:`decision_source`, isolated as :meth:`checked_skip_reason` is: when it raises
        or returns something else than a string or None, :attr:`code_failure` is set (the
        pass does not run) and None is returned."""
        if self.code_failure is not None:
            return None
        try:
            source = self.decision_source(ctx)
        except Exception as exc:
            self._code_failed(f"decision_source() raised {describe(exc)}", exc)
            return None
        if source is not None and not isinstance(source, str):
            self._code_failed(f"decision_source() must return a str or None, got {cut_repr(source)}")
            return None
        return source or None

    def checked_token_constraint(self, ctx: CompileContext) -> TokenConstraint | None:
        """:meth:`token_constraint`, validated and isolated: when it raises or returns no
        valid constraint, :attr:`code_failure` is set (the pass does not run) and None is
        returned."""
        if self.code_failure is not None:
            return None
        try:
            constraint = self.token_constraint(ctx)
        except Exception as exc:
            self._code_failed(f"token_constraint() raised {describe(exc)}", exc)
            return None
        if constraint is None:
            return None
        if not isinstance(constraint, TokenConstraint):
            self._code_failed(
                f"token_constraint() must return a passkit.TokenConstraint or None, got "
                f"{type(constraint).__name__}"
            )
            return None
        try:
            constraint.check(f"pass {self.name!r}")
        except ConfigError as exc:
            self._code_failed(f"token_constraint() returned an invalid constraint: {exc}")
            return None
        return None if constraint.unconstrained else constraint

    def _code_failed(self, what: str, exc: Exception | None = None) -> PassCodeError:
        failure = PassCodeError(
            f"pass {self.name!r} ({type(self).__module__}.{type(self).__qualname__}): {what}; "
            "the pass does not run in this pipeline",
            pass_name=self.name,
            method=what.partition("(")[0],
        )
        failure.__cause__ = exc
        self.code_failure = failure
        logs.log.warning("passkit: %s", failure)
        return failure

    # -- identity --------------------------------------------------------------------
    def options_json(self) -> str:
        return json.dumps(self.options.model_dump(mode="json"), sort_keys=True)

    def environment(self) -> dict[str, Any]:
        """What this pass's decisions read from the process, for its cache identity (JSON
        values). Default: per module of :attr:`environment_modules`, whether it is importable,
        its version and where it is (:func:`module_state`; nothing is imported)."""
        return {name: module_state(name) for name in self.environment_modules}

    def identity(self) -> dict[str, Any]:
        """Everything that determines what this pass does, for cache keys and plans."""
        return {
            "name": self.name,
            "class": f"{type(self).__module__}.{type(self).__qualname__}",
            "stage": self.stage.value,
            "options": self.options_json(),
            "source": source_hash(type(self)),
            "tokens": str(self.tokens) if self.tokens else None,
            "depends_on": list(self.depends_on),
            "shares_sites_with": list(self.shares_sites_with),
            **({"graph_kinds": list(self.graph_kinds)} if self.graph_kinds is not None else {}),
            **({"environment": environment} if (environment := self._checked_environment()) else {}),
        }

    def _checked_environment(self) -> dict[str, Any] | None:
        """:meth:`environment`, isolated: one that raises is the pass's code failure (it then
        runs nowhere, as when :meth:`skip_reason` raises)."""
        try:
            environment = self.environment()
            json.dumps(environment, sort_keys=True)
        except Exception as exc:
            failure = self._code_failed(f"environment() raised or returned no JSON: {describe(exc)}", exc)
            return {"failed": str(failure)}
        return environment or None

    def __repr__(self) -> str:
        return f"<pass {self.name} {self.options_json()}>"


class GraphPass(Pass):
    """A pass written by hand against the FX graph: implement :meth:`run`."""


def module_state(name: str) -> dict[str, Any]:
    """Whether module ``name`` is importable here, where from and its distribution's version
    (found without importing it; a module that cannot be looked up counts as absent)."""
    import importlib.metadata
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return {"found": False}
    try:
        version: str | None = importlib.metadata.version(name.partition(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        version = None
    return {"found": True, "version": version, "origin": str(spec.origin)}


def validate_options(cls: type[Pass], raw: dict[str, Any], origin: str | None = None) -> pydantic.BaseModel:
    """Validate raw options for ``cls``; errors name ``passes.<name>.<field>``. An options
    model whose own code raises something else than a validation error (a validator raising
    ``RuntimeError``) is a :class:`ConfigError` too, naming the pass and ``origin`` (the
    plugin and distribution it came from)."""
    try:
        return cls.Options.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise ConfigError(format_validation_error(exc, f"passes.{cls.name}", cls.Options)) from None
    except Exception as exc:
        raise ConfigError(
            f"passes.{cls.name}: the options model {cls.Options.__qualname__} of pass {cls.name!r}"
            f"{f' ({origin})' if origin else ''} raised {describe(exc)} (a bug in the pass, not in "
            "your config; `passkit show` describes its options)"
        ) from exc


def format_validation_error(
    exc: pydantic.ValidationError,
    prefix: str,
    model: type[pydantic.BaseModel] | None = None,
    *,
    what: str = "option",
    rename: dict[str, str] | None = None,
) -> str:
    """One line per error, each starting with the field's path (``prefix`` and the error's
    location; an error of the model as a whole is named by ``prefix``, else ``config``).
    ``what`` names a key (``option``, ``config key``) in "unknown ..." errors, which list the
    known ones and suggest a close one; ``rename`` shows a top-level field under another name
    (``{"on_error": "PASSKIT_ON_ERROR (on_error)"}``)."""
    lines = []
    errors = exc.errors()
    for err in errors[:_MAX_ERRORS]:
        where = list(err["loc"])
        if rename and where and str(where[0]) in rename:
            where[0] = rename[str(where[0])]
        loc = cut(".".join(str(p) for p in (prefix, *where) if p != "")) or "config"
        expected = ""
        if (
            model is not None
            and err["loc"]
            and err["loc"][0] in model.model_fields
            and err["type"] != "value_error"
        ):
            ann = model.model_fields[str(err["loc"][0])].annotation
            expected = f" (expected {_type_name(ann)})"
        if err["type"] == "extra_forbidden" and model is not None:
            known = ", ".join(model.model_fields) or "none"
            key = str(err["loc"][-1]) if err["loc"] else ""
            lines.append(f"{loc}: unknown {what} (known {what}s: {known}){suggest(key, model.model_fields)}")
            continue
        message = err["msg"].removeprefix("Value error, ")
        got = ""
        if "input" in err and err["type"] != "missing" and err["loc"]:  # a whole model: not repeated
            got = f", got {cut_repr(err['input'])}"
        lines.append(f"{loc}: {cut(message)}{expected}{got}")
    if len(errors) > _MAX_ERRORS:
        lines.append(f"... and {len(errors) - _MAX_ERRORS} more error(s)")
    return "invalid configuration:\n  " + "\n  ".join(lines)


_MAX_ERRORS = 5


def _type_name(ann: Any) -> str:
    if isinstance(ann, type):
        return ann.__name__
    return str(ann).replace("typing.", "")


_source_hashes: dict[type, str] = {}


def source_hash(cls: type) -> str:
    """Hash of the files defining ``cls`` (its module plus ``cls.source_files``) and of its
    code (:func:`passkit.code_identity.code_hash`: its bytecode and its helpers', which is
    what changes with the code where no file can be read, a script read from stdin, or where
    only a helper module changed), computed once per class and process (never per compile)."""
    found = _source_hashes.get(cls)
    if found is None:
        from .code_identity import code_hash

        found = _source_hashes[cls] = hashlib.sha256(
            f"{_hash_files(cls)}:{code_hash(cls)}".encode()
        ).hexdigest()[:16]
    return found


def _hash_files(cls: type) -> str:
    files: list[str] = []
    try:
        files.append(inspect.getfile(cls))
    except (TypeError, OSError):
        pass
    files.extend(getattr(cls, "source_files", ()) or ())
    h = hashlib.sha256()
    for path in files:
        try:
            with open(path, "rb") as f:
                h.update(f.read())
        except OSError:
            h.update(f"<unreadable {path}>".encode())
    return h.hexdigest()[:16]
