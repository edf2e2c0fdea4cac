"""Graph dumps, diffs, reproducers and JSON reports in the dump directory.

Layout (read back with :mod:`passkit.dumps`, whose docstring draws the tree): one folder per
process and run (:func:`run_folder`: when it started, its rank in a distributed job, its
process id), in it one folder per compiled graph, in that one folder per stage holding one
file per snapshot of the graph (a pass's graph after it, and before it where no earlier
snapshot of the stage holds that graph) and each pass's diff; a failed pass's reproducers and
``report.json`` sit in the graph's folder.

Graph ids restart at 1 in every process: the run folder keeps two ranks sharing one
``PASSKIT_DUMP_DIR`` from writing into each other's ``graph_001``, and a rerun from finding
the earlier run's ``FAILED_*`` reproducers beside its own report. Earlier runs' folders are
left as they are (delete them when done).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..dumps import AFTER, BEFORE, DIFF, stem
from ..errors import warn_config
from ..graph_utils import unified_diff

if TYPE_CHECKING:
    from ..pass_base import Pass
    from ..report import Report


_unwritable: set[str] = set()
"""Dump folders found unwritable in this process (warned about once, then left alone)."""

_run_folders: dict[tuple[str, int], Path] = {}
"""Per dump directory (and process: a forked child gets its own), this run's folder in it."""


def run_folder(root: str | Path) -> Path:
    """This process's folder in dump directory ``root``, named when it is first asked for:
    ``run-<UTC time>[-rank<R>]-pid<PID>`` (the rank of an initialized process group, else of
    ``RANK``)."""
    key = (str(root), os.getpid())
    found = _run_folders.get(key)
    if found is None:
        rank = _rank()
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        part = f"-rank{rank}" if rank is not None else ""
        found = _run_folders[key] = Path(root) / f"run-{stamp}{part}-pid{os.getpid()}"
    return found


def graph_folder(root: str | Path, graph_id: int) -> Path:
    """The folder of graph ``graph_id``'s dumps in this run's folder of ``root``."""
    return run_folder(root) / f"graph_{graph_id:03d}"


def _rank() -> int | None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:
        pass
    value = os.environ.get("RANK", "")
    return int(value) if value.isdigit() else None


class Dumper:
    """Writes one graph's dumps; every write fails soft: a dump folder that cannot be
    written (a file in its place, read-only, no space) is warned about once per process
    (:class:`~passkit.errors.ConfigWarning`) and the compile goes on without dumps."""

    def __init__(self, root: Path, graph_id: int):
        self.root = str(root)
        self.folder = graph_folder(root, graph_id)
        self._write(lambda: self.folder.mkdir(parents=True, exist_ok=True))
        self._last: dict[str, str] = {}
        """Per stage, the code of the last snapshot written (a pass whose graph before it is
        that snapshot gets no ``.before.py`` of its own)."""

    @property
    def working(self) -> bool:
        return self.root not in _unwritable

    def _write(self, write: Callable[[], object]) -> bool:
        if not self.working:
            return False
        try:
            write()
            return True
        except OSError as exc:
            _unwritable.add(self.root)
            warn_config(
                f"dump_dir {self.root} cannot be written ({type(exc).__name__}: "
                f"{exc.strerror or exc}): no dumps are written there in this process; the "
                "compile goes on"
            )
            return False

    def pass_graphs(self, index: int, name: str, stage: str, before: str, after: str) -> None:
        """The snapshots around pass ``name`` (``index``: its place in the report) in the
        folder of ``stage``, and their diff."""
        folder, base = self.folder / stage, stem(index, name)

        def write() -> None:
            folder.mkdir(exist_ok=True)
            if self._last.get(stage) != before:
                (folder / f"{base}{BEFORE}").write_text(before)
            (folder / f"{base}{AFTER}").write_text(after)
            (folder / f"{base}{DIFF}").write_text(unified_diff(before, after, name) or "# no change\n")
            self._last[stage] = after

        self._write(write)

    def reproducer(self, index: int, pass_: Pass, before: str, error: BaseException) -> Path | None:
        path = self.folder / f"FAILED_{stem(index, pass_.name)}.repro.py"
        tb = "".join(traceback.format_exception(error))
        text = (
            f'"""passkit reproducer: pass {pass_.name!r} failed on the graph below.\n\n'
            f"Re-run: build the graph with the code below (its inputs are the graph's\n"
            f"placeholders), then call PASS.run(gm, passkit.CompileContext()).\n\n"
            f'{tb}"""\n\n'
            f"PASS_NAME = {pass_.name!r}\n"
            f"PASS_CLASS = {type(pass_).__module__ + '.' + type(pass_).__qualname__!r}\n"
            f"OPTIONS = {json.loads(pass_.options_json())!r}\n\n"
            f"# ---- graph before the pass ----\n{before}"
        )
        return path if self._write(lambda: path.write_text(text)) else None

    def replay(self, index: int, pass_: Pass, gm: Any, ctx: Any, error: BaseException) -> Path | None:
        """The crash reproducer of a pass that raised on ``gm`` (the graph it saw): a folder
        with the graph, the pass and a pytest file replaying it (``passkit bisect --repro``'s)."""
        from .._bisect.repro import write

        folder = self.folder / f"FAILED_{stem(index, pass_.name)}.repro"
        found = {"gm": gm, "pass": pass_, "context": ctx, "rewrites": None, "error": error}
        spec = {
            "check": "output",
            "atol": 1e-5,
            "rtol": 1e-4,
            "seed": 0,
            "target": f"graph {self.folder.name}",
        }
        try:
            return folder if self._write(lambda: write(folder, found, spec)) else None
        except Exception as exc:  # a graph that cannot be written as code: the .repro.py stays
            from .. import logs

            logs.log.warning("passkit: could not write the replayable reproducer %s: %s", folder, exc)
            return None

    def report(self, report: Report) -> None:
        self._write(lambda: (self.folder / "report.json").write_text(report.to_json()))
