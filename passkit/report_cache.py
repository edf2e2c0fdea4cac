"""passkit's own small cache of reports, so that an Inductor cache hit still says what the
passes did when they built the cached code.

One JSON file per compiled graph under ``$PASSKIT_CACHE_DIR`` (default
``$XDG_CACHE_HOME/passkit/reports`` or ``~/.cache/passkit/reports``), keyed by the
pipeline's cache identity (passes, versions, options, token range) and a hash of the graph
Dynamo handed over (its code and its inputs' shapes and dtypes). Failing to read or write
it only loses the restored report, never a compile.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx

from . import logs
from .report import Report


def cache_dir() -> Path:
    explicit = os.environ.get("PASSKIT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "passkit" / "reports"


def key(pipeline_uuid: str, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """Identity of one compile: the pipeline and the graph with its inputs' metadata."""
    inputs = [
        f"{tuple(x.shape)}:{x.dtype}:{x.device.type}" if isinstance(x, torch.Tensor) else type(x).__name__
        for x in example_inputs
    ]
    blob = json.dumps([pipeline_uuid, gm.code, inputs], default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


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
    path = cache_dir() / f"{cache_key}.json"
    try:
        data = json.loads(path.read_text())
        return [Report.from_dict(d) for d in data]
    except (OSError, ValueError, TypeError) as exc:
        logs.log.debug("passkit: no usable report cache entry %s: %s", path, exc)
        return None
