"""Every ``passkit ...`` command line the documentation shows runs, as a user would type it:
each in a fresh process, in an empty folder, with a time limit and a bound on the processes it
may start (``passkit tune-model ... --cpu``, as the README gave it, started ranks until the
machine ran out of memory). A documented line that can no longer run here fails this test;
a new one must be run here or excluded below, with the reason.

Which lines are commands (the rule):

* the pages: README.md, docs/*.md, passkit_fusion/README.md;
* a line of a fenced block, or an inline code span (which may wrap across lines), that reads
  ``passkit SUBCOMMAND ...`` (a ``$ `` prompt allowed) where SUBCOMMAND is one of the CLI's
  commands (``passkit report (graph 1, ...)`` is output, not a command); a ``# comment`` and
  a synopsis' description (after two or more spaces) are cut off;
* a synopsis is no command line: one with a placeholder (an upper-case word such as ``NAME``
  or ``MOD:FN``, ``[...]`` optional parts, ``...``) or a progress line;
* every other line runs here unless :data:`EXCLUDED` says why it cannot run on a CPU-only
  machine in an empty folder (a GPU, a file or module of the user's own); it must exit with
  :data:`EXIT_CODES`' code (0 unless the page shows it as a mistake), with no traceback.

Lines that take over ~40 s on 2 cores are ``slow``; the ``tune-model --cpu`` line also runs in
the default suite, with arguments appended that make it quick (:data:`QUICK`), since it is the
one that took the machine down.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "passkit_fusion/README.md"]
PASSKIT = str(Path(sys.executable).with_name("passkit"))

MAX_PROCESSES = 24
"""The most processes a documented command may have alive at once: the command, 2 ranks,
multiprocessing's resource tracker, Inductor's compile workers (one per core, per rank)."""
TIMEOUT_S = 300
SLOW_TIMEOUT_S = 900

EXCLUDED = {
    "passkit tune": "GPU only (NCCL ranks on this machine's GPUs)",
    "passkit tune-model": "names the command; needs the user's MOD:FN",
    "passkit explain-hf": "names the command; needs a CONFIG",
    "passkit explain-hf config.json --tp 2": "the user's own config.json",
    "passkit explain-hf path/to/config.json --tp 2": "the user's own config.json",
    "passkit show": "names the command; needs a pass NAME",
    "passkit explain": "names the command; needs the user's MOD:FN",
    "passkit bisect": "names the command; needs the user's MOD:FN",
    "passkit bisect mymodel:make --passes allreduce_rmsnorm,cleanup": "the user's own module mymodel",
    "passkit check passkit.toml": "the user's own passkit.toml",
}
"""Documented lines that cannot run on a CPU-only machine in an empty folder, and why."""

EXIT_CODES = {
    "passkit show cleanpu": 2,  # the pages' example of a misspelt name: exit 2, the close name
    "passkit demo --only nope": 2,
    "passkit explain-hf Lama": 2,
    "passkit check": 1,  # an empty folder enables no pass: what a server refuses (docs/vllm.md)
}
"""Documented mistakes and the exit code the pages promise for them (others: 0)."""

SLOW = {
    "passkit demo",
    "passkit demo --only allreduce_rmsnorm",
    "passkit demo --only tp_passes",
    "passkit explain-hf Glm4Moe",
    "passkit explain-hf Qwen3MoeConfig --tp 2",
    "passkit tune-model passkit_fusion.model:tuning_target --cpu --tokens 16 64 --budget 120",
}
"""Documented lines that take longer than the default suite allows (minutes on 2 cores)."""

QUICK = {
    "passkit tune-model passkit_fusion.model:tuning_target --cpu --tokens 16 64 --budget 120": [
        "--tokens", "8", "--mode", "eager", "--budget", "1",
    ],
}  # fmt: skip
"""Arguments appended to a slow line for its default-suite run (the later flag wins)."""

MOST_RANKS = {"passkit tune-model passkit_fusion.model:tuning_target --cpu --tokens 16 64 --budget 120": 2}
"""Lines that start ranks, and how many they may start."""


def _subcommands() -> set[str]:
    import argparse

    from passkit.cli import build_parser

    parser, _ = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices)


_LINE = re.compile(r"^(?:\$\s+)?(passkit\s+([a-z][a-z-]*)(?![\w:-]).*)$")
"""A command line; ``passkit bisect: rewrite 3: ...`` (a subcommand and a colon) is a log line."""
_PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]+\b|\[|\.\.\.")


def _command(text: str, commands: set[str]) -> str | None:
    """``text`` as a command line (comment and description cut off), or None."""
    match = _LINE.match(" ".join(text.split()) if "\n" in text else text.strip())
    if not match or match.group(2) not in commands:
        return None
    line = re.split(r"\s+#|\s{2,}", match.group(1))[0].strip()
    return None if _PLACEHOLDER.search(line) else line


def documented_commands() -> dict[str, list[str]]:
    """Every command line of :data:`PAGES` -> where it is shown (``page:line``)."""
    commands = _subcommands()
    found: dict[str, list[str]] = {}
    for page in PAGES:
        text = page.read_text()
        name = page.relative_to(ROOT).as_posix()
        fenced = False
        prose: list[tuple[int, str]] = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip().startswith("```"):
                fenced = not fenced
                continue
            if fenced:
                command = _command(line, commands)
                if command:
                    found.setdefault(command, []).append(f"{name}:{number}")
            else:
                prose.append((number, line))
        # inline code spans, within a paragraph (they may wrap across lines)
        joined = "\n".join(line for _, line in prose)
        starts = [0]
        for _, line in prose:
            starts.append(starts[-1] + len(line) + 1)
        for span in re.finditer(r"`([^`\n]+(?:\n[^`\n]+)?)`", joined):
            command = _command(span.group(1), commands)
            if command:
                index = next(i for i, s in enumerate(starts) if s > span.start()) - 1
                found.setdefault(command, []).append(f"{name}:{prose[index][0]}")
    return found


def _runnable() -> list[str]:
    return sorted(c for c in documented_commands() if c not in EXCLUDED)


def test_the_rule_finds_the_documented_commands_and_every_exclusion_is_still_documented():
    found = documented_commands()
    for line in ("passkit list", "passkit check", "passkit schema | head -3", *MOST_RANKS):
        assert line in found, sorted(found)
    stale = sorted((set(EXCLUDED) | set(EXIT_CODES) | SLOW | set(QUICK)) - set(found))
    assert not stale, f"listed here but no longer in the pages: {stale}"
    assert not any(line.startswith("passkit report") for line in found)  # output, not commands


def _run(line: str, extra: list[str], tmp_path: Path, bounded, timeout: float):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PASSKIT_")}
    env["PASSKIT_CACHE_DIR"] = str(tmp_path / "cache")
    env["PATH"] = f"{Path(PASSKIT).parent}{os.pathsep}{env.get('PATH', '')}"
    work = tmp_path / "work"
    work.mkdir()
    if "|" in line:  # a pipeline as the page shows it: the shell, its status the first command's
        return bounded(
            ["bash", "-o", "pipefail", "-c", line],
            timeout=timeout,
            max_processes=MAX_PROCESSES,
            cwd=work,
            env=env,
        )
    argv = [PASSKIT, *line.split()[1:], *extra]
    return bounded(argv, timeout=timeout, max_processes=MAX_PROCESSES, cwd=work, env=env)


def _check(line: str, run) -> None:
    assert run.killed is None, run.describe()
    assert run.returncode == EXIT_CODES.get(line, 0), run.describe()
    assert "Traceback (most recent call last)" not in run.stderr, run.describe()
    if line in MOST_RANKS:  # the command, its ranks, multiprocessing's resource tracker, and
        # Inductor's compile workers (a pool per rank): never more ranks than that allows
        assert run.most_processes <= MAX_PROCESSES, run.describe()


@pytest.mark.parametrize("line", [c for c in _runnable() if c not in SLOW])
def test_a_documented_command_runs(line, tmp_path, bounded):
    _check(line, _run(line, [], tmp_path, bounded, TIMEOUT_S))


@pytest.mark.parametrize("line", sorted(QUICK))
def test_the_documented_tune_model_line_starts_two_ranks_and_ends(line, tmp_path, bounded):
    run = _run(line, QUICK[line], tmp_path, bounded, TIMEOUT_S)
    _check(line, run)
    assert "decision: tokens >= 1" in run.stdout, run.describe()
    # the command, its ranks, multiprocessing's resource tracker: never more
    assert run.most_processes <= 1 + MOST_RANKS[line] + 1, run.describe()
    files = sorted((tmp_path / "cache" / "fusion-decisions").iterdir())
    assert [f.name.split("_")[1] for f in files] == ["w2"] * len(files) and files, files


@pytest.mark.slow
@pytest.mark.parametrize("line", sorted(c for c in _runnable() if c in SLOW))
def test_a_slow_documented_command_runs(line, tmp_path, bounded):
    _check(line, _run(line, [], tmp_path, bounded, SLOW_TIMEOUT_S))
