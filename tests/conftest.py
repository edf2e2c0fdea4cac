"""Shared fixtures for the repository's own tests."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
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


class Site:
    """A folder of installed distributions (each a module and a ``.dist-info`` with its entry
    points), on ``sys.path`` for this process and on ``PYTHONPATH`` for the processes a test
    starts (:meth:`env`): fake plugins installed as real distributions."""

    def __init__(self, folder, monkeypatch) -> None:
        self.folder = folder
        self._monkeypatch = monkeypatch
        folder.mkdir(parents=True, exist_ok=True)
        monkeypatch.syspath_prepend(str(folder))

    def install(
        self,
        distribution: str,
        modules: dict[str, str],
        entry_points: dict[str, dict[str, str]],
        version: str = "0.1",
    ) -> None:
        """Install ``distribution`` (its metadata name, spelled as given) with ``modules``
        (``{"acme_plugin": source}``) and ``entry_points`` (``{group: {name: value}}``)."""
        import importlib

        import passkit._plugins.registry

        for name, source in modules.items():
            (self.folder / f"{name}.py").write_text(source)
            self._monkeypatch.delitem(sys.modules, name, raising=False)  # another test's, same name
        info = self.folder / f"{distribution.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
        groups = "".join(
            f"[{group}]\n" + "".join(f"{n} = {v}\n" for n, v in eps.items()) for group, eps in entry_points.items()
        )
        (info / "entry_points.txt").write_text(groups)
        importlib.invalidate_caches()
        passkit._plugins.registry.reset()

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a process that sees this folder's distributions (no PASSKIT_*
        variable but ``extra``)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PASSKIT_")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.folder), env.get("PYTHONPATH")) if p)
        env.update(extra)
        return env


@pytest.fixture
def plugin_site(tmp_path, monkeypatch):
    """A :class:`Site` in the test's temporary folder."""
    return Site(tmp_path / "site", monkeypatch)
