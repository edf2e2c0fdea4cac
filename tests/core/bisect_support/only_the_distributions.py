"""Fail unless this environment holds only passkit, passkit-fusion, passkit-testing, torch,
numpy and what they require (``nox -s repro``'s check that no model code or test dependency
is installed beside them). Prints what is installed."""

from __future__ import annotations

import re
import sys
from importlib import metadata

from packaging.requirements import Requirement  # packaging: pytest's, so passkit-testing's

ROOTS = ["passkit", "passkit-fusion", "passkit-testing", "torch", "numpy"]
TOOLS = {"pip", "setuptools", "wheel"}  # what a fresh venv starts with


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _required(roots: list[str]) -> set[str]:
    """The closure of the roots' requirements (the ones without an extra that applies here)."""
    seen: set[str] = set()
    todo = [_key(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_key(req.name))
    return seen


def main() -> int:
    installed = {_key(d.metadata["Name"]): d.version for d in metadata.distributions()}
    missing = [r for r in ROOTS if _key(r) not in installed]
    extra = sorted(set(installed) - _required(ROOTS) - TOOLS)
    print("installed:", ", ".join(f"{n}=={v}" for n, v in sorted(installed.items())))
    if missing or extra:
        print(f"missing: {missing or 'none'}; installed beyond what the roots require: {extra or 'none'}")
        return 1
    print(f"only {', '.join(ROOTS)} and what they require")
    return 0


if __name__ == "__main__":
    sys.exit(main())
