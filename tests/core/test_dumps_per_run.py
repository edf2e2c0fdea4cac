"""Dumps go to a folder per process and run: two ranks sharing one ``PASSKIT_DUMP_DIR``
write apart, and a rerun never finds the earlier run's ``FAILED_*`` reproducers beside its
report (:func:`passkit._pipeline.dump.run_folder`).

Before, every process wrote ``<dump_dir>/graph_001`` (graph ids restart at 1 per process)
and nothing was cleaned: rank 1 overwrote rank 0's dumps, and a rerun in which nothing
failed left the first run's reproducer beside a report saying nothing failed. Each run here
is a fresh process, as a user's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROGRAM = """
import sys
import torch, passkit

class Fails(passkit.GraphPass):
    name = "dump_test_fails"

    def run(self, gm, ctx):
        raise RuntimeError("the first run fails")

class Plugin:
    @passkit.hookimpl
    def passkit_register_passes(self):
        return [Fails]

passkit.register(Plugin(), name="dump-test")
passes = ["cleanup"] + (["dump_test_fails"] if sys.argv[1] == "fail" else [])
backend = passkit.backend(passes=passes, compiler="aot_eager")
torch.compile(lambda x: torch.relu(x) * 2, backend=backend)(torch.randn(4))
print("DONE")
"""


def _run(dumps, mode, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PASSKIT_") and k != "RANK"}
    env.update(PASSKIT_DUMP_DIR=str(dumps), **extra)
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0 and "DONE" in out.stdout, out.stderr[-3000:]


def _runs(dumps):
    return sorted(p for p in dumps.iterdir() if p.is_dir())


def test_two_ranks_sharing_one_dump_dir_write_apart_and_no_reproducer_goes_stale(tmp_path):
    """Rank 0's run fails a pass, rank 1's (or a rerun's) does not: each has its own folder,
    and a reproducer is beside a report exactly when that report records the failure."""
    dumps = tmp_path / "dumps"
    _run(dumps, "fail", RANK="0")
    _run(dumps, "ok", RANK="1")
    runs = _runs(dumps)
    assert len(runs) == 2, runs
    by_rank = {
        ("rank0" if "-rank0-" in p.name else "rank1" if "-rank1-" in p.name else p.name): p for p in runs
    }
    assert set(by_rank) == {"rank0", "rank1"}, runs
    for rank, statuses in (("rank0", ["ran", "failed"]), ("rank1", ["ran"])):
        graph = by_rank[rank] / "graph_001"
        report = json.loads((graph / "report.json").read_text())
        assert [r["status"] for r in report["passes"]] == statuses
        reproducers = sorted(p.name for p in graph.glob("FAILED_*"))
        assert bool(reproducers) == ("failed" in statuses), (rank, reproducers)
