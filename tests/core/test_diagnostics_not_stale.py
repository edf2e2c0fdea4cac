"""Diagnostics turned on after an earlier compile do what they say: ``verify = "numeric"``
and ``passkit explain --dump`` are part of the cache identity with the process, so a warm
Inductor cache filled without them never serves their compile.

Each test runs ``passkit explain`` twice in fresh processes sharing one Inductor cache and
one passkit report cache: first plain (filling them), then with the diagnostic on.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parent / "bisect_support"
TARGET = "bisect_model:make"


@pytest.fixture
def shared(tmp_path):
    """The planted plugin installed in a site folder; an environment with it on the path and
    the caches in ``tmp_path`` (no PASSKIT_* of the caller's)."""
    site = tmp_path / "site"
    info = site / "planted_passes-0.1.dist-info"
    info.mkdir(parents=True)
    (site / "planted_passes.py").write_text((SUPPORT / "planted_passes.py").read_text())
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: planted-passes\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[passkit.passes]\nplanted = planted_passes\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PASSKIT_", "TORCHINDUCTOR_"))}
    env.update(
        PYTHONPATH=str(site),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
        PASSKIT_CACHE_DIR=str(tmp_path / "reports"),
    )
    return env


def _explain(bounded, env, *args, **extra):
    done = bounded(
        [sys.executable, "-m", "passkit.cli", "explain", TARGET, "--passes", "planted_graph", *args],
        cwd=SUPPORT,
        env={**env, **extra},
        timeout=400,
        max_processes=8,  # Inductor's compile workers aside: one process and its helpers
    )
    assert done.killed is None, done.killed
    return done


@pytest.mark.slow
def test_numeric_verify_turned_on_after_a_compile_verifies(shared, bounded):
    first = _explain(bounded, shared)
    assert first.returncode == 0 and "planted_graph" in first.stdout, first.stdout + first.stderr
    second = _explain(bounded, shared, PASSKIT_VERIFY="numeric")
    assert "served from Inductor's cache" not in second.stdout, second.stdout
    row = next(line for line in second.stdout.splitlines() if line.startswith("planted_graph"))
    assert " failed " in row, second.stdout + second.stderr  # the planted wrong site, caught
    third = _explain(bounded, shared, PASSKIT_VERIFY="numeric")  # and again: never stale
    assert " failed " in next(x for x in third.stdout.splitlines() if x.startswith("planted_graph"))


@pytest.mark.slow
def test_explain_dump_after_a_compile_writes_the_graphs(shared, bounded, tmp_path):
    first = _explain(bounded, shared)
    assert first.returncode == 0, first.stdout + first.stderr
    for run in ("one", "two"):  # each a fresh process, the caches warm
        dumps = tmp_path / f"dumps_{run}"
        done = _explain(bounded, shared, "--dump", str(dumps))
        assert done.returncode == 0 and "served from Inductor's cache" not in done.stdout, done.stdout
        written = {p.name for p in dumps.rglob("*") if p.is_file()}
        assert "report.json" in written and any(
            n.endswith(".py") and "planted_graph" in n for n in written
        ), written


def test_verify_and_dump_dir_are_part_of_the_cache_identity(clean_env, tmp_path):
    import passkit

    plain = passkit.build_pipeline(passes=["cleanup"]).uuid()
    verified = passkit.build_pipeline(passes=["cleanup"], verify="numeric").uuid()
    structural = passkit.build_pipeline(passes=["cleanup"], verify=True).uuid()
    dumped = passkit.build_pipeline(passes=["cleanup"], dump_dir=tmp_path / "d").uuid()
    assert len({plain, verified, structural, dumped}) == 4
    assert plain == passkit.build_pipeline(passes=["cleanup"]).uuid()


def test_a_cache_hit_says_which_asked_checks_did_not_run(clean_env, tmp_path):
    import passkit

    pipeline = passkit.build_pipeline(passes=["cleanup"], verify="numeric", dump_dir=tmp_path / "d")
    text = pipeline.record_cache_hit().format()
    assert f"note: not run for this graph: verify=numeric, dump_dir={tmp_path / 'd'} (served from" in text, (
        text
    )
    assert "note: not run" not in passkit.build_pipeline(passes=["cleanup"]).record_cache_hit().format()
