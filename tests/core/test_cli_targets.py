"""``passkit explain MOD:FN`` whose own code raises: one line naming the target and the
exception, then the user's frames only (none of passkit's), exit 2 like every mistake."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "target, first_line, user_frame",
    [
        (
            "tests.core.explain_target:boom",
            "passkit explain: error: target 'tests.core.explain_target:boom' raised "
            "ValueError: size 12 is not a multiple of 8 (when called)",
            "in _check_sizes",
        ),
        (
            "tests.core.explain_target_raises_at_import:make",
            "passkit explain: error: target 'tests.core.explain_target_raises_at_import:make' raised "
            "RuntimeError: hidden size 12 is not a multiple of 8 (importing "
            "'tests.core.explain_target_raises_at_import')",
            "explain_target_raises_at_import.py",
        ),
    ],
)
def test_a_target_that_raises_is_one_line_and_the_users_frames(target, first_line, user_frame):
    # the console script's entry point in a fresh process, as a user runs it
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; from passkit.cli import main; sys.exit(main({['explain', target]!r}))",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[0] == first_line
    assert "Traceback" not in out.stderr
    frames = [line for line in lines if line.lstrip().startswith("File ")]
    assert frames and any(user_frame in line for line in lines)
    assert all("/passkit/" not in f and "importlib" not in f for f in frames), frames
