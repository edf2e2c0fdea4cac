"""passkit inside serving stacks ("hosts") that run their own compile pipeline.

One module per host (``passkit.hosts.vllm``, ``passkit.hosts.sglang``), loaded on first
attribute access: importing passkit, or this package, never imports a host, and nothing here
runs unless a user calls a host's adapter (or a host loads passkit's entry point).
:data:`HOSTS` says which versions of each host passkit was tested with; :func:`check_version`
is how an adapter treats any other version.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import re
import warnings
from types import ModuleType
from typing import Literal

from ..errors import PasskitError

OnUnknown = Literal["warn", "raise"]


class HostError(PasskitError):
    """A host is missing, of a version passkit does not support, or lacks an API it needs."""


class HostVersionWarning(UserWarning):
    """A host version passkit was not tested with: the adapter runs, best effort."""


@dataclasses.dataclass(frozen=True)
class Host:
    """One serving stack: its distribution, the release series passkit supports (``"0.33"``
    matches 0.33.0, 0.33.1...) and the passkit module that adapts it."""

    distribution: str
    supported: tuple[str, ...]
    module: str


HOSTS: dict[str, Host] = {
    "vllm": Host("vllm", ("0.33",), "passkit.hosts.vllm"),
    "sglang": Host("sglang", ("0.5",), "passkit.hosts.sglang"),
}
"""The hosts passkit has adapters for, by name."""


def installed_version(host: str) -> str | None:
    """The installed version of ``host``'s distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version(HOSTS[host].distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def series_of(version: str) -> str | None:
    """``"0.33.1.dev3+gabc"`` -> ``"0.33"`` (None for a version with no ``X.Y`` prefix)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return f"{int(found[1])}.{int(found[2])}" if found else None


def check_version(host: str, found: str | None = None, on_unknown: OnUnknown = "warn") -> str:
    """Return ``host``'s installed version (or ``found``) when passkit supports it.

    Not installed: :class:`HostError`. A version outside :data:`HOSTS`' supported series:
    a :class:`HostVersionWarning` naming the found and supported versions (the adapter then
    runs, best effort), or a :class:`HostError` with ``on_unknown="raise"``.
    """
    spec = HOSTS[host]
    version = found if found is not None else installed_version(host)
    if version is None:
        raise HostError(f"passkit.hosts.{host}: {spec.distribution} is not installed")
    if series_of(version) in spec.supported:
        return version
    supported = ", ".join(f"{s}.x" for s in spec.supported)
    message = (
        f"passkit.hosts.{host}: found {spec.distribution} {version}; passkit supports "
        f"{spec.distribution} {supported}"
    )
    if on_unknown == "raise":
        raise HostError(message + ".")
    warnings.warn(
        message + ". Running anyway (best effort): check the report of each compile.",
        HostVersionWarning,
        stacklevel=3,
    )
    return version


def __getattr__(name: str) -> ModuleType:
    if name in HOSTS:
        return importlib.import_module(HOSTS[name].module)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "HOSTS",
    "Host",
    "HostError",
    "HostVersionWarning",
    "check_version",
    "installed_version",
    "series_of",
]
