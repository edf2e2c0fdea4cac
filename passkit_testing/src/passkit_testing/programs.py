"""Run a whole program on every rank of a world, as ``torchrun`` would, and watch it end.

:mod:`passkit_testing.worlds` runs a function inside ranks it sets up and tears down itself.
Some failures show only in a program as users write it: the first compile of a fresh
process in a given mode, and the program's own end (``destroy_process_group()``, then the
interpreter's exit, with no ``os._exit``). :func:`run_world_program` starts ``world_size``
fresh interpreters of one script (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
and ``MASTER_PORT`` set, a free loopback port), timestamps every line each one prints, and
kills what is still running after ``timeout`` (reported as hung, never waited for)::

    run = run_world_program(["my_case.py", "--mode", "reduce-overhead"], world_size=2, timeout=300)
    assert run.ok, run.describe()
    assert max(run.seconds_after("DESTROY-START")) < 10   # from that line to the exit
    results = run.json_lines("CASE-RESULT")               # one parsed JSON per rank
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ProgramRun", "RankProgram", "run_world_program"]


@dataclasses.dataclass
class RankProgram:
    """What one rank's process did."""

    rank: int
    exit_code: int | None
    """``None`` when it was killed at the timeout."""
    lines: list[tuple[float, str]]
    """Each line printed (stdout and stderr), with the seconds since the world started."""
    exited_at: float | None
    """Seconds since the world started at which the process ended (``None``: killed)."""

    @property
    def hung(self) -> bool:
        return self.exit_code is None

    def output(self, last: int | None = None) -> str:
        lines = self.lines if last is None else self.lines[-last:]
        return "\n".join(text for _, text in lines)

    def line_time(self, prefix: str) -> float | None:
        """When this rank printed its first line starting with ``prefix``."""
        return next((t for t, text in self.lines if text.startswith(prefix)), None)


@dataclasses.dataclass
class ProgramRun:
    ranks: list[RankProgram]

    @property
    def ok(self) -> bool:
        """Every rank exited with status 0."""
        return all(r.exit_code == 0 for r in self.ranks)

    def json_lines(self, prefix: str) -> list[Any]:
        """Each rank's first line starting with ``prefix``, the rest parsed as JSON (rank order);
        raises ``AssertionError`` with the rank's output when one has none."""
        found = []
        for r in self.ranks:
            line = next((text for _, text in r.lines if text.startswith(prefix)), None)
            assert line is not None, f"rank {r.rank} printed no {prefix!r} line:\n{r.output(60)}"
            found.append(json.loads(line[len(prefix) :]))
        return found

    def seconds_after(self, prefix: str) -> list[float | None]:
        """Per rank, seconds from its first ``prefix`` line to its exit (``None``: no such
        line, or it never exited)."""
        out: list[float | None] = []
        for r in self.ranks:
            start = r.line_time(prefix)
            out.append(None if start is None or r.exited_at is None else r.exited_at - start)
        return out

    def describe(self, last: int = 40) -> str:
        """Each rank's status and its last ``last`` lines: what an assertion should show."""
        parts = []
        for r in self.ranks:
            status = "HUNG (killed)" if r.hung else f"exit {r.exit_code}"
            parts.append(f"--- rank {r.rank}: {status}\n{r.output(last)}")
        return "\n".join(parts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world_program(
    argv: Sequence[str],
    world_size: int,
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    python: str = sys.executable,
    exit_within: tuple[str, float] | None = None,
    port_retries: int = 3,
) -> ProgramRun:
    """Run ``python argv...`` as ``world_size`` ranks and wait for all of them, at most
    ``timeout`` seconds from the start; ranks still running then are killed (``hung``).
    ``exit_within=(prefix, seconds)``: a rank still running ``seconds`` after it printed a line
    starting with ``prefix`` is killed then (a hung teardown fails fast). The loopback port is
    chosen free, but another program may take it before rank 0 listens: a world whose store
    failed with ``EADDRINUSE`` runs again on another port, up to ``port_retries`` times."""
    for _ in range(port_retries):
        run = _run_once(argv, world_size, timeout=timeout, env=env, python=python, exit_within=exit_within)
        if not any("EADDRINUSE" in r.output(20) for r in run.ranks):
            break
    return run


def _run_once(
    argv: Sequence[str],
    world_size: int,
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    python: str = sys.executable,
    exit_within: tuple[str, float] | None,
) -> ProgramRun:
    port = str(_free_port())
    start = time.monotonic()
    procs: list[subprocess.Popen[str]] = []
    lines: list[list[tuple[float, str]]] = [[] for _ in range(world_size)]
    exited: list[float | None] = [None] * world_size
    readers = []
    for rank in range(world_size):
        child_env = {
            **os.environ,
            **(env or {}),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "PYTHONUNBUFFERED": "1",
        }
        proc = subprocess.Popen(
            [python, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            env=child_env,
        )
        procs.append(proc)

        def read(proc: subprocess.Popen[str] = proc, rank: int = rank) -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines[rank].append((time.monotonic() - start, line.rstrip("\n")))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        readers.append(reader)
    killed: set[int] = set()

    def kill(rank: int) -> None:
        if procs[rank].poll() is None:
            procs[rank].kill()
            killed.add(rank)

    # the processes' own exits count (a child such as a compile worker may keep the pipe open)
    while any(exited[r] is None and r not in killed for r in range(world_size)):
        now = time.monotonic() - start
        for rank, proc in enumerate(procs):
            if exited[rank] is not None or rank in killed:
                continue
            if proc.poll() is not None:
                exited[rank] = now
                continue
            since = None
            if exit_within is not None:
                since = next((t for t, text in lines[rank] if text.startswith(exit_within[0])), None)
            if now > timeout or (
                exit_within is not None and since is not None and now - since > exit_within[1]
            ):
                kill(rank)
        time.sleep(0.05)
    for reader in readers:
        reader.join(5)
    codes: list[int | None] = [None if r in killed else procs[r].returncode for r in range(world_size)]
    for rank in killed:
        exited[rank] = None
    return ProgramRun([RankProgram(r, codes[r], lines[r], exited[r]) for r in range(world_size)])
