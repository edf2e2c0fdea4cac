"""Shared fixtures for the repository's own tests."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile

import pytest

# the suite's caches go to one throw-away folder, not ~/.cache and /tmp/torchinductor_<user>:
# passkit's report cache and Inductor's together. The ranks and programs the tests start
# inherit both; kept apart (a fresh report cache over a warm Inductor cache), a second run of
# the GPU suite got graphs from Inductor's cache whose reports were in no report cache.
_CACHES = tempfile.mkdtemp(prefix="passkit-test-caches-")
os.environ.setdefault("PASSKIT_CACHE_DIR", os.path.join(_CACHES, "reports"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHES, "inductor"))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch (no Inductor/AOTAutograd cache hits, which would skip
    the passes) and leaves no plugin registered in-process."""
    import torch._functorch.config
    import torch._inductor.config

    import passkit._plugins.registry

    torch._dynamo.reset()
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
        passkit._plugins.registry.isolated(),
    ):
        yield
    torch._dynamo.reset()


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No PASSKIT_* variables and an empty working directory (no config files)."""
    import os

    for name in list(os.environ):
        if name.startswith("PASSKIT_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    """passkit warns of a config mistake once per process: once per test here."""
    import passkit._pipeline.dump
    import passkit.errors

    monkeypatch.setattr(passkit.errors, "_warned", set())
    monkeypatch.setattr(passkit._pipeline.dump, "_unwritable", set())


# ---------------------------------------------------------------------------------------
# commands run with a time limit and a bound on the processes they start


@dataclasses.dataclass
class BoundedRun:
    """What :func:`run_bounded` saw: ``returncode`` None when it was killed (``killed``
    says why), ``most_processes`` the most processes alive at once in its session."""

    argv: list[str] | str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    most_processes: int
    killed: str | None

    def describe(self) -> str:
        return (
            f"{self.argv!r}: rc={self.returncode} killed={self.killed} after {self.seconds:.1f} s, "
            f"at most {self.most_processes} processes\n--- stdout\n{self.stdout[-2000:]}\n"
            f"--- stderr\n{self.stderr[-4000:]}"
        )


def _session_members(sid: int) -> list[int]:
    """The processes of session ``sid`` (Linux /proc; field 6 of /proc/PID/stat)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[3]) == sid and fields[0] != b"Z":
            members.append(int(entry))
    return members


def run_bounded(
    argv: list[str] | str,
    *,
    timeout: float,
    max_processes: int,
    cwd: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    shell: bool = False,
) -> BoundedRun:
    """Run ``argv`` in a session of its own; kill the whole session (SIGKILL) when it runs
    past ``timeout`` seconds or has more than ``max_processes`` processes alive at once, and
    at the end whatever it left behind. RLIMIT_NPROC cannot bound it: it counts every
    process and thread of the user (and root ignores it), so the session is watched."""
    import signal
    import subprocess
    import threading
    import time

    start = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, shell=shell, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True,
    )  # fmt: skip
    out: dict[str, str] = {}
    readers = [
        threading.Thread(target=lambda n=n, s=s: out.__setitem__(n, s.read()), daemon=True)
        for n, s in (("stdout", proc.stdout), ("stderr", proc.stderr))
    ]
    for reader in readers:
        reader.start()
    most, killed = 1, None
    try:
        while proc.poll() is None:
            alive = len(_session_members(proc.pid))
            most = max(most, alive)
            if alive > max_processes:
                killed = f"{alive} processes alive at once (bound {max_processes})"
            elif time.monotonic() - start > timeout:
                killed = f"still running after {timeout:g} s"
            if killed:
                break
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the session's group: the command and its children
        for pid in _session_members(proc.pid):  # any that moved to a group of their own
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
        for reader in readers:
            reader.join(timeout=30)
    return BoundedRun(
        argv, None if killed else proc.returncode, out.get("stdout", ""), out.get("stderr", ""),
        time.monotonic() - start, most, killed,
    )  # fmt: skip


@pytest.fixture
def bounded():
    """:func:`run_bounded`, for tests that start commands (a time limit, a process bound)."""
    return run_bounded
