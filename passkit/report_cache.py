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
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import pydantic
import torch
import torch.fx

from . import logs
from .errors import cut, warn_config
from .report import Report


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
    notes: list[str] = pydantic.Field(default_factory=list)
    reproducer: str | None = None


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
    mode: str = "inductor"
    graph_kind: str | None = None
    cache_hit: bool = False
    token_range: str | None = None
    restored: bool = False
    notes: list[str] = pydantic.Field(default_factory=list)
    hook_failures: list[_HookFailure] = pydantic.Field(default_factory=list)
    compile_s: float | None = None
    passes: list[_Record] = pydantic.Field(default_factory=list)


_ENTRIES = pydantic.TypeAdapter(list[_Entry])


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


def save(cache_key: str, reports: Sequence[Report]) -> None:
    if not reports:
        return
    path = cache_dir() / f"{cache_key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps([r.to_dict() for r in reports]))
        tmp.replace(path)
    except OSError as exc:
        logs.log.debug("passkit: could not write the report cache %s: %s", path, exc)


def load(cache_key: str) -> list[Report] | None:
    """The reports stored under ``cache_key``, or None: no entry (a miss), or one that cannot
    be read or is not of the shape passkit writes (a miss with a warning)."""
    path = cache_dir() / f"{cache_key}.json"
    try:
        text = path.read_text()
    except OSError as exc:
        logs.log.debug("passkit: no report cache entry %s: %s", path, exc)
        return None
    try:
        entries = _ENTRIES.validate_json(text)
        return [Report.from_dict(e.model_dump()) for e in entries]
    except (pydantic.ValidationError, ValueError, TypeError, RecursionError) as exc:
        why: Any = exc
        if isinstance(exc, pydantic.ValidationError) and exc.errors():
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "the file"
            why = f"{where}: {first['msg']}"
        warn_config(
            f"report cache entry {path} is not a passkit report ({cut(str(why), 200)}): ignored "
            "(the compile goes on; its report is not restored)"
        )
        return None
