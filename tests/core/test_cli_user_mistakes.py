"""One line for each user mistake, exit 2, in a fresh process as a user runs ``passkit``:
a target that calls ``sys.exit``, a model whose forward raises, ``check`` on a path that is
not a regular file, a ``tune-model`` factory of the wrong signature.

Before: ``explain`` on a target calling ``sys.exit(0)`` printed nothing and exited 0; a
forward that raised gave Dynamo's traceback; ``check /dev/null`` or a FIFO said "no such
file"; a wrong factory gave a traceback per rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGETS = "tests.core.explain_target_mistakes"


def passkit(*args, env=None):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PASSKIT_")}
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; from passkit.cli import main; sys.exit(main({list(args)!r}))"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**environ, **(env or {})},
    )
    return out.returncode, out.stdout, out.stderr


def test_explain_on_a_target_that_calls_sys_exit_names_it():
    code, out, err = passkit("explain", f"{TARGETS}:exits", env={"PASSKIT_PASSES": "cleanup"})
    assert code == 2, (out, err)
    assert err.splitlines()[0] == (
        f"passkit explain: error: target '{TARGETS}:exits' raised SystemExit: 0 (when called)"
    )
    assert "Traceback" not in err


def test_explain_on_a_model_whose_forward_raises_is_one_line_and_the_users_frames():
    code, out, err = passkit("explain", f"{TARGETS}:forward_raises", env={"PASSKIT_PASSES": "cleanup"})
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert lines[0] == (
        f"passkit explain: error: target '{TARGETS}:forward_raises' raised ValueError: expected 8 "
        "features, got 4 (calling its model on the example; it raises without torch.compile too)"
    )
    assert "Traceback" not in err and len(lines) <= 6, err
    frames = [line for line in lines if line.lstrip().startswith("File ")]
    assert frames and all("explain_target_mistakes.py" in f for f in frames), frames


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_check_on_a_path_that_is_not_a_regular_file_says_so(kind, tmp_path):
    if kind == "device":
        path = "/dev/null"
        said = "/dev/null: not a regular file"
    else:
        path = str(tmp_path / "config.fifo")
        os.mkfifo(path)
        said = f"{path}: a named pipe (FIFO), not a file"
    code, out, err = passkit("check", path)
    assert code == 2, (out, err)
    assert err.strip() == f"passkit check: error: {said}"


def test_tune_model_with_a_factory_of_the_wrong_signature_is_one_line_before_any_rank():
    code, out, err = passkit("tune-model", f"{TARGETS}:wrong_signature", "--cpu", "--world-size", "2")
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(
        f"passkit tune-model: error: {TARGETS}:wrong_signature(rank) cannot be called as each rank "
        "calls it, wrong_signature(rank, world_size, device): "
    ), lines[0]
    assert "never called" not in err and "rank 0" not in err
