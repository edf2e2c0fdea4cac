"""Which package indexes named in the environment cannot be reached from this machine.

``PIP_EXTRA_INDEX_URL`` (the README's CPU-torch index) or ``PIP_INDEX_URL`` naming a host
this machine cannot reach makes pip retry it five times for every package it installs,
minutes in all, with nox hiding pip's output. :func:`reachable_indexes` tries each named
host once, all at once, for a bounded time (a TCP connection, no request), and says which
URLs to keep and which to drop with why; ``noxfile.py`` drops the unreachable ones from its
sessions and says so in one line. Standard library only: nox's environment and the tests
both import it.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

VARIABLES = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")
"""The variables whose URLs are tried (pip reads both as whitespace-separated lists)."""
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
TIMEOUT_S = 2.5
"""How long a host has to accept a connection (all hosts are tried at once)."""


@dataclass(frozen=True)
class Unreachable:
    variable: str
    url: str
    why: str


def reachable_indexes(
    environ: Mapping[str, str], timeout: float = TIMEOUT_S
) -> tuple[dict[str, list[str]], list[Unreachable]]:
    """``({variable: urls to keep}, [what to drop])`` for :data:`VARIABLES` in ``environ``.

    Only ``http``/``https`` URLs are tried; other schemes (``file://``) are kept. Behind a
    proxy (a ``*_PROXY`` variable set) nothing is tried and everything is kept: a direct
    connection says nothing about what pip reaches through the proxy."""
    named = {v: environ[v].split() for v in VARIABLES if environ.get(v, "").strip()}
    if not named or any(environ.get(p) for p in PROXY_VARIABLES):
        return named, []
    hosts = {_host_port(url) for urls in named.values() for url in urls} - {None}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
        futures = {host: pool.submit(_why_unreachable, host, timeout) for host in hosts}
        why = {host: f.result() for host, f in futures.items()}
    keep: dict[str, list[str]] = {}
    dropped: list[Unreachable] = []
    for variable, urls in named.items():
        keep[variable] = []
        for url in urls:
            problem = why.get(_host_port(url))
            if problem is None:
                keep[variable].append(url)
            else:
                dropped.append(Unreachable(variable, url, problem))
    return keep, dropped


def _host_port(url: str) -> tuple[str, int] | None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    try:
        port = parts.port
    except ValueError:  # a malformed port: pip will say so itself
        return None
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


def _why_unreachable(host_port: tuple[str, int], timeout: float) -> str | None:
    """None when ``host:port`` accepts a TCP connection within ``timeout`` seconds."""
    try:
        with socket.create_connection(host_port, timeout=timeout):
            return None
    except socket.gaierror as exc:
        return f"its name does not resolve ({exc.strerror or exc})"
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)


def describe(unreachable: list[Unreachable]) -> str:
    """One line for a session's log: what is left out (an extra index) or retried no more
    (the main index, which pip cannot do without)."""
    parts = "; ".join(f"{u.variable} {u.url}: {u.why}" for u in unreachable)
    main = any(u.variable == "PIP_INDEX_URL" for u in unreachable)
    what = "extra index left out of" if not main else "pip told not to retry it (PIP_RETRIES=0) in"
    return (
        f"package index unreachable from here, {what} this session's installs ({parts}); "
        "pip would retry it for every package"
    )


if __name__ == "__main__":  # python .ci/pip_indexes.py: what a session would drop here
    _keep, _dropped = reachable_indexes(os.environ)
    print(describe(_dropped) if _dropped else "every package index named in the environment answers")
