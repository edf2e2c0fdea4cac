"""``python -m passkit_fusion.dialects [vllm|sglang ...]``: check the dialects' schemas
against the hosts installed in this environment.

For each host named (default: every shipped host dialect whose package is installed), import
the host modules that register its ops, then print :func:`check_schemas` for its dialect
and torch's. Exit status 1 when any expected op is absent or differs (``nox -s hosts`` runs
it in the hosts' environments), 2 when a named host is not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

from . import builtin, check_schemas

HOST_MODULES = {
    "vllm": ("vllm.distributed.parallel_state", "vllm.ir.ops"),
    "sglang": ("sglang.srt.distributed.parallel_state",),
}
"""The modules whose import registers each host's ops (collectives, IR norms)."""


def main(argv: list[str] | None = None) -> int:
    hosts = list(argv if argv is not None else sys.argv[1:])
    if not hosts:
        hosts = [h for h in HOST_MODULES if importlib.util.find_spec(h) is not None]
    dialects = {d.name: d for d in builtin()}
    status = 0
    for host in hosts:
        if host not in HOST_MODULES or importlib.util.find_spec(host) is None:
            print(f"{host}: not installed (known hosts: {', '.join(HOST_MODULES)})")
            status = max(status, 2)
            continue
        for module in HOST_MODULES[host]:
            importlib.import_module(module)
        version = getattr(importlib.import_module(host), "__version__", "?")
        for name in (host, "torch"):
            problems = check_schemas(dialects[name])
            verdict = "ok" if not problems else f"{len(problems)} problem(s)"
            print(f"{host} {version}: {name} dialect ({dialects[name].host}): {verdict}")
            for problem in problems:
                print(f"  {problem}")
            status = max(status, 1 if problems else 0)
    return status


if __name__ == "__main__":
    sys.exit(main())
