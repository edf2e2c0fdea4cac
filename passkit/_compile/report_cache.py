"""passkit's own small cache of reports, so that an Inductor cache hit still says what the
passes did when they built the cached code.

One JSON file per compiled graph under ``$PASSKIT_CACHE_DIR`` (default
``$XDG_CACHE_HOME/passkit/reports`` or ``~/.cache/passkit/reports``), keyed by what
decides the code Inductor caches: the pipeline's cache identity (passes, versions, options,
token range), a hash of the graph Dynamo handed over (its code and its inputs' shapes and
dtypes) and :func:`environment`, the parts of Inductor's own FX-graph-cache key that are not
the graph (torch's source hash, version included; the system: devices, CUDA and Triton
versions; Inductor's and AOTAutograd's config). Two environments that share a cache folder
(two torch versions, say) therefore never read each other's reports: a restored report
describes the code that runs. Failing to read or write it only loses the restored report,
never a compile.

Each file is an envelope: the passkit version that wrote it, the pass set it was made with
(the pipeline's pass names), its key and a SHA-256 checksum of all of it and the reports.
Anything else (another passkit's entry, a pass set that is not this pipeline's, a record of a
pass not in that set, an edited entry, bytes that are not UTF-8 JSON) is a miss with a
:class:`~passkit.ConfigWarning`, never a restored report that is not what the passes did,
and never a failed compile.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import pydantic
import torch
import torch.fx

from .. import logs
from ..errors import cut, warn_config
from ..report import Report


class _Record(pydantic.BaseModel):
    """One pass record as the cache stores it (validated before use: a file of another
    shape, hand-edited or written by another passkit, is a miss, never a failed compile)."""

    model_config = pydantic.ConfigDict(extra="ignore", strict=True)

    name: str
    stage: str
    status: Literal["ran", "skipped", "vetoed", "failed", "declined"] = "skipped"
    matches: int = pydantic.Field(default=0, ge=0)
    modified: bool = False
    ms: float = 0.0
    verify_ms: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    reason: str | None = None
    graph_kind: Literal["torch", "joint", "forward", "backward", "inference"] | None = None
    notes: list[str] = pydantic.Field(default_factory=list)
    reproducer: str | None = None
    decision: str | None = None


class _HookFailure(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="ignore", strict=True)

    hook: str
    plugin: str
    distribution: str | None = None
    version: str | None = None
    error: str
    during: str | None = None
    detail: str = ""


class _Entry(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="ignore", strict=True)

    graph_id: int = 0
    pipeline_uuid: str = ""
    mode: Literal["inductor", "eager"] = "inductor"
    graph_kind: Literal["torch", "joint", "forward", "backward", "inference", "training"] | None = None
    cache_hit: bool = False
    token_range: str | None = None
    restored: bool = False
    notes: list[str] = pydantic.Field(default_factory=list)
    hook_failures: list[_HookFailure] = pydantic.Field(default_factory=list)
    compile_s: float | None = None
    passes: list[_Record] = pydantic.Field(default_factory=list)


class _Envelope(pydantic.BaseModel):
    """A cache file: who wrote it, for which passes and key, its checksum, the reports."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)

    passkit: str
    passes: list[str]
    key: str
    checksum: str
    reports: list[dict[str, Any]]


_ENTRIES = pydantic.TypeAdapter(list[_Entry])


def _checksum(version: str, passes: Sequence[str], cache_key: str, reports: Any) -> str:
    blob = json.dumps([version, list(passes), cache_key, reports], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _passkit_version() -> str:
    from .._version import __version__

    return __version__


def cache_dir() -> Path:
    explicit = os.environ.get("PASSKIT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "passkit" / "reports"


def key(
    pipeline_uuid: str,
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    inductor_patches: Mapping[str, Any] | None = None,
    code: str | None = None,
) -> str:
    """Identity of one compile: the pipeline, the graph with its inputs' metadata, and the
    :func:`environment` (``inductor_patches``: the config patches of this compile; ``code``:
    the graph's code when ``gm.code`` is not stable, e.g. a host that changes the graph as it
    compiles it)."""
    inputs = [
        f"{tuple(x.shape)}:{x.dtype}:{x.device.type}{':grad' if x.requires_grad else ''}"
        if isinstance(x, torch.Tensor)
        else type(x).__name__
        for x in example_inputs
    ]
    if torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs
    ):
        inputs.append("training")  # a training compile caches other graphs than an inference one
    blob = json.dumps(
        [pipeline_uuid, gm.code if code is None else code, inputs, environment(inductor_patches)], default=str
    ).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def environment(inductor_patches: Mapping[str, Any] | None = None) -> str:
    """A hash of what Inductor's FX-graph-cache key holds beyond the graph and the custom
    passes: ``torch_key()`` (torch's sources and version), the system (devices, CUDA, Triton)
    and Inductor's and AOTAutograd's portable config with this compile's patches applied."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor import codecache

    inductor = inductor_config.save_config_portable()
    for name, value in (inductor_patches or {}).items():
        if name in inductor:
            inductor[name] = value
    parts = [
        codecache.torch_key().hex(),  # module attribute: cached per process by torch
        codecache.CacheBase.get_system(),
        inductor,
        functorch_config.save_config_portable(),
    ]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=_stable).encode()).hexdigest()


def _stable(value: Any) -> str:
    """A config value JSON cannot hold (a pass or function a framework set): its type only,
    never its ``repr`` (which may hold a memory address, different in every process)."""
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def in_use(inductor_patches: Mapping[str, Any] | None = None) -> bool:
    """Whether Inductor can serve a compile from a cache (its FX graph cache or
    AOTAutograd's, local or remote): without one there is nothing to restore reports for,
    and no need to hash torch's sources."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    patches = inductor_patches or {}
    names = ("fx_graph_cache", "fx_graph_remote_cache")
    inductor = any(patches.get(n, getattr(inductor_config, n)) for n in names)
    autograd = bool(
        functorch_config.enable_autograd_cache
        or getattr(functorch_config, "enable_remote_autograd_cache", False)
    )
    return inductor or autograd


def save(cache_key: str, reports: Sequence[Report], passes: Sequence[str] | None = None) -> None:
    """Store ``reports`` under ``cache_key``; ``passes``: the pipeline's pass names (else the
    passes the reports name). Written whole or not at all: a failed write (a full disk)
    leaves no partial file behind."""
    if not reports:
        return
    path = cache_dir() / f"{cache_key}.json"
    data = [r.to_dict() for r in reports]
    names = list(passes) if passes is not None else sorted({p["name"] for r in data for p in r["passes"]})
    version = _passkit_version()
    envelope = {
        "passkit": version,
        "passes": names,
        "key": cache_key,
        "checksum": _checksum(version, names, cache_key, data),
        "reports": data,
    }
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(envelope))
        tmp.replace(path)
    except OSError as exc:
        logs.log.debug("passkit: could not write the report cache %s: %s", path, exc)
        with contextlib.suppress(OSError):
            tmp.unlink()


def load(cache_key: str, passes: Sequence[str] | None = None) -> list[Report] | None:
    """The reports stored under ``cache_key``, or None: no entry (a miss), or one that cannot
    be read, is not of the shape passkit writes, was written by another passkit version, for
    another pass set than ``passes`` (the pipeline's pass names), or does not match its
    checksum (a miss with a warning)."""
    path = cache_dir() / f"{cache_key}.json"
    try:
        raw = path.read_bytes()
    except OSError as exc:
        logs.log.debug("passkit: no report cache entry %s: %s", path, exc)
        return None
    try:
        return _decode(raw, cache_key, passes)
    except _Miss as exc:
        why: Any = exc
    except (pydantic.ValidationError, ValueError, TypeError, RecursionError) as exc:
        # (UnicodeDecodeError and json's errors are ValueErrors)
        why = f"not a passkit report: {_why(exc)}"
    warn_config(
        f"report cache entry {path} is {cut(str(why), 300)}: ignored (the compile goes on; its "
        "report is not restored)"
    )
    return None


class _Miss(Exception):
    """An entry passkit wrote, but not for this compile (the message says why)."""


def _why(exc: Exception) -> str:
    if isinstance(exc, pydantic.ValidationError) and exc.errors():
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "the file"
        return cut(f"{where}: {first['msg']}", 200)
    return cut(f"{type(exc).__name__}: {exc}", 200)


def _decode(raw: bytes, cache_key: str, passes: Sequence[str] | None) -> list[Report]:
    envelope = _Envelope.model_validate_json(raw.decode("utf-8"))
    version = _passkit_version()
    if envelope.passkit != version:
        raise _Miss(f"from passkit {cut(envelope.passkit, 40)} (this is passkit {version})")
    if envelope.key != cache_key:
        raise _Miss(f"the entry of another key ({cut(envelope.key, 40)})")
    if envelope.checksum != _checksum(envelope.passkit, envelope.passes, envelope.key, envelope.reports):
        raise _Miss("edited or damaged (its checksum does not match what passkit wrote)")
    if passes is not None and list(passes) != envelope.passes:
        raise _Miss(
            f"for passes {cut(repr(envelope.passes), 120)} (this compile runs {cut(repr(list(passes)), 120)})"
        )
    entries = _ENTRIES.validate_python(envelope.reports)
    known = set(envelope.passes)
    strays = sorted({p.name for e in entries for p in e.passes} - known)
    if strays:
        raise _Miss(f"holding records of pass(es) {cut(repr(strays), 120)} outside its pass set")
    return [Report.from_dict(e.model_dump()) for e in entries]
