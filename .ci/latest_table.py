"""``nox -s latest``'s bookkeeping (standard library only): the newest release a registry
serves (``pip index versions``), the rows each stack's session records, and the one table
printed from every stack's rows."""

from __future__ import annotations

import json
import re
from pathlib import Path

_LATEST = re.compile(r"^\S+ \(([^)]+)\)", re.MULTILINE)
_AVAILABLE = re.compile(r"^Available versions: (.*)$", re.MULTILINE)


def newest(index_output: str) -> str | None:
    """The newest version in ``pip index versions NAME``'s output (its first line,
    ``NAME (X.Y.Z)``), or None when it names none."""
    match = _LATEST.search(index_output)
    return match.group(1) if match else None


def newest_cpu_build(index_output: str, version: str) -> str | None:
    """``version``'s CPU build (``X.Y.Z+cpu``) where the indexes serve one, else None."""
    available = _AVAILABLE.search(index_output)
    builds = [v.strip() for v in available.group(1).split(",")] if available else []
    return f"{version}+cpu" if f"{version}+cpu" in builds else None


def write_rows(folder: Path, stack: str, rows: list[dict[str, str]]) -> None:
    """Record ``stack``'s rows (``package``, ``tested``, ``newest``, ``result``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stack}.json").write_text(json.dumps(rows, indent=1))


def read_rows(folder: Path, stacks: list[str]) -> list[dict[str, str]]:
    """Every recorded stack's rows, in ``stacks``' order; a stack not run yet gives one row
    saying so."""
    rows: list[dict[str, str]] = []
    for stack in stacks:
        path = folder / f"{stack}.json"
        if path.exists():
            rows.extend(json.loads(path.read_text()))
        else:
            rows.append(
                {
                    "package": stack,
                    "tested": "-",
                    "newest": "-",
                    "result": f"not run (nox -s \"latest(stack='{stack}')\")",
                }
            )
    return rows


def table(rows: list[dict[str, str]]) -> str:
    """The Markdown table: package, version tested, version newest, result."""
    lines = ["| package | version tested | version newest | result |", "|---|---|---|---|"]
    lines += [f"| {r['package']} | {r['tested']} | {r['newest']} | {r['result']} |" for r in rows]
    return "\n".join(lines)


_NOT_SERVED = re.compile(r"No matching distribution found for (\S+?)(?: \(from ([^)]+)\))?$", re.MULTILINE)


def unserved_pin(pip_output: str) -> str | None:
    """The requirement pip could not find on the registry (``No matching distribution found
    for flashinfer-python==0.7.3 (from vllm)``), or None when the install failed otherwise."""
    match = _NOT_SERVED.search(pip_output)
    return match.group(1) if match else None


def pinned_name(requirement: str) -> str:
    """The distribution a requirement names (``flashinfer-python==0.7.3`` -> ``flashinfer-python``)."""
    return re.split(r"[\s;\[<>=!~]", requirement.strip(), maxsplit=1)[0]


def _canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them (``Flashinfer_Python`` -> ``flashinfer-python``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def replace_pin(requires: list[str], pin: str, served: str) -> list[str]:
    """``requires`` (a distribution's ``Requires-Dist``) with the requirement on ``pin``'s
    distribution replaced by ``served`` (the release the registry has), markers kept."""
    name = _canonical(pinned_name(pin))
    out = []
    for req in requires:
        if _canonical(pinned_name(req)) == name:
            marker = req.partition(";")[2].strip()
            out.append(f"{served}; {marker}" if marker else served)
        else:
            out.append(req)
    return out


def other_complaints(pip_check_output: str, moved: str | None) -> list[str]:
    """``pip check``'s lines but those about the pin ``moved`` (``flashinfer-python==0.7.3``:
    ``vllm 0.34.0 has requirement flashinfer-python==0.7.3, but you have ... 0.7.4.``)."""
    lines = [
        line
        for line in pip_check_output.splitlines()
        if line.strip() and line != "No broken requirements found."
    ]
    if moved is None:
        return lines
    return [line for line in lines if f"requirement {moved}," not in line]
