"""``passkit bisect --run CMD``: the bisect over any shell command (a server's smoke test, a
user's script), exit status 0 meaning good.

Each run is ``CMD`` in a shell with ``PASSKIT_BISECT_LIMIT=N`` set, in a session of its own,
under ``--timeout`` seconds (its whole process group killed past it, and at its end whatever it
left running). The command's processes count their own rewrites; the number of rewrites is read
from the two warnings every process prints whatever its logging setup (``... (the last allowed:
limit N)`` and ``limit N reached: rewrite N+1 REFUSED``), so nothing but the exit status and
that output is needed of it: the limits 0, 1, 2, 4, ... until one is bad or makes every
rewrite, then a binary search between the last good limit and the first bad one.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import COUNT_ALL
from .search import ProbeError

_LAST = re.compile(r"passkit bisect: rewrite (\d+): (pass=.*) \(the last allowed: limit (\d+)\)")
_REFUSED = re.compile(r"passkit bisect: limit (\d+) reached: rewrite (\d+) REFUSED")


@dataclass
class Run:
    """One run of the command at one limit."""

    limit: int
    code: int
    output: str

    @property
    def good(self) -> bool:
        return self.code == 0

    def more(self) -> bool:
        """Whether some process of the run refused a rewrite (there are more than ``limit``)."""
        return any(int(m.group(1)) == self.limit for m in _REFUSED.finditer(self.output))

    def last_allowed(self) -> str | None:
        """``pass=..., stage=..., graph=..., site=...`` of the run's last allowed rewrite."""
        for m in _LAST.finditer(self.output):
            if int(m.group(3)) == self.limit:
                return m.group(2)
        return None

    def tail(self) -> str:
        lines = [x for x in self.output.strip().splitlines() if x.strip()]
        return " | ".join(lines[-3:])[:300] or "no output"


class Runner:
    """Runs the command at a limit, bounded in time and in number of runs."""

    def __init__(self, args: argparse.Namespace, work: Path):
        self.args = args
        self.work = work
        self.runs = 0

    def __call__(self, limit: int) -> Run:
        if self.runs >= self.args.max_compiles:
            raise ProbeError(f"--max-compiles {self.args.max_compiles} reached before the culprit was found")
        self.runs += 1
        log = self.work / f"run_{self.runs:02d}.txt"
        env = {**os.environ, "PASSKIT_BISECT_LIMIT": str(limit)}
        with open(log, "w") as out:
            proc = subprocess.Popen(
                self.args.run,
                shell=True,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                code = proc.wait(timeout=self.args.timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                _end_group(proc)
        if code is None:
            raise ProbeError(
                f"--run: the command ran past --timeout {self.args.timeout} s at "
                f"PASSKIT_BISECT_LIMIT={_show(limit)} (its process group was killed)"
            )
        return Run(limit, code, log.read_text(errors="replace"))


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """End the command's process group: what it left running, or all of it past the timeout."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.05)
        else:
            continue
        break
    if proc.poll() is None:
        proc.wait()


def run(args: argparse.Namespace) -> int:
    """Find and print the culprit of ``args.run``; 0 when found, 1 when there is none."""
    with tempfile.TemporaryDirectory(prefix="passkit-bisect-run-") as work:
        return _search(Runner(args, Path(work)))


def _search(run: Runner) -> int:
    args = run.args
    print(f"passkit bisect --run {args.run!r}: exit status 0 is good ({args.timeout} s each)")
    none = run(0)
    if not none.good:
        print(
            f"no culprit: the command fails (exit {none.code}) with every rewrite refused "
            f"(PASSKIT_BISECT_LIMIT=0): the cause is not a pass; its last lines: {none.tail()}"
        )
        print(f"{run.runs} runs")
        return 1
    if not none.more():
        print(
            "no culprit: the command made no rewrite (no process printed `passkit bisect: limit 0 "
            "reached`): are passkit's passes enabled in it, and does it compile through passkit?"
        )
        print(f"{run.runs} runs")
        return 1
    print("  limit 0: ok (every rewrite refused)")
    lo, hi, limit, bad = 0, None, 1, None
    while hi is None:
        found = run(limit)
        print(f"  limit {limit}: {'ok' if found.good else f'bad (exit {found.code})'}")
        if not found.good:
            hi, bad = limit, found
        elif not found.more():  # every rewrite made, and good
            print(
                f"no culprit: the command passes with all its rewrites (at most {limit}): the cause is not a pass"
            )
            print(f"{run.runs} runs")
            return 1
        else:
            lo, limit = limit, min(limit * 2, COUNT_ALL)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = run(mid)
        print(f"  limit {mid}: {'ok' if found.good else f'bad (exit {found.code})'}")
        if found.good:
            lo = mid
        else:
            hi, bad = mid, found
    assert bad is not None
    what = bad.last_allowed()
    if what is None:  # the bad run made fewer rewrites than its limit: the last one it made
        print(
            f"culprit: the rewrite after limit {lo} (the command printed no `(the last allowed: limit {hi})`)"
        )
    else:
        print(f"culprit: rewrite {hi}: {what}")
    print(f"  with it: exit {bad.code}; its last lines: {bad.tail()}")
    print(f"{run.runs} runs")
    print(
        f"by hand: PASSKIT_BISECT_LIMIT={hi} {args.run} fails, PASSKIT_BISECT_LIMIT={hi - 1} {args.run} passes"
    )
    return 0


def _show(limit: int) -> str:
    return "all" if limit >= COUNT_ALL else str(limit)


def validate(args: argparse.Namespace) -> None:
    """Options that cannot go with ``--run`` (one line each, exit 2)."""
    from ..errors import PasskitError

    if args.target is not None:
        raise PasskitError(
            f"--run and a target ({args.target}) both given: bisect either MODULE:FUNCTION or a command"
        )
    if not args.run.strip():
        raise PasskitError(
            f"--run {args.run!r}: empty (give the command to run, e.g. --run 'python smoke.py')"
        )
    given = {
        "--repro": args.repro is not None,
        "--world-size": args.world_size != 1,
        "--passes": args.passes is not None,
        "--check": args.check != "output",
    }
    for flag, set_ in given.items():
        if set_:
            raise PasskitError(
                f"{flag} does not apply with --run (the command decides, by its exit status, and "
                "its own configuration)"
            )
