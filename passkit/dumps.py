"""Reading a dump folder (``dump_dir``): the graph around each pass, in the tree passkit
writes.

The tree: one folder per process and run, one per compiled graph, one per stage in it, and
one file per snapshot of the graph::

    <dump_dir>/run-20261207-170312-rank1-pid4242/graph_003/
        pre_grad/
            01_silu_from_sigmoid.before.py    the graph the stage received
            01_silu_from_sigmoid.after.py     after the pass
            01_silu_from_sigmoid.diff
        post_grad_post/
            02_noop_elimination.before.py
            02_noop_elimination.after.py      02_noop_elimination.diff
            03_cleanup.after.py               03_cleanup.diff   (its graph before: 02's after)
        FAILED_04_my_pass.repro.py            a pass that raised (written whatever the filters)
        FAILED_04_my_pass.repro/
        report.json

Numbers are the passes' places in the compile's report. A pass's ``.before.py`` is written
only where no earlier snapshot of its stage holds that graph (the stage's first dumped pass,
or the first after passes the dump filters left out): each graph is on disk once.
:func:`pass_graphs` finds a pass's graphs either way.
"""

from __future__ import annotations

from pathlib import Path

BEFORE, AFTER, DIFF = ".before.py", ".after.py", ".diff"
"""The suffixes of a pass's snapshot files."""


def stem(index: int, pass_name: str) -> str:
    """A pass's file stem in its stage folder: its place in the report and its name."""
    return f"{index:02d}_{pass_name}"


def snapshots(*stage_folders: str | Path) -> list[Path]:
    """The snapshot files of stage folders (of one graph) in the order the graph went
    through them: by the pass's place in the report, its ``.before.py`` (where written) before
    its ``.after.py``. A folder that does not exist holds none."""
    files = [
        p
        for folder in map(Path, stage_folders)
        if folder.is_dir()
        for p in folder.iterdir()
        if p.name.endswith((BEFORE, AFTER))
    ]
    return sorted(files, key=lambda p: (int(p.name.split("_", 1)[0]), p.name.endswith(AFTER)))


def pass_graphs(graph_folder: str | Path, pass_name: str) -> tuple[str, str]:
    """``(before, after)``: the code of graph ``graph_folder``'s graph around pass
    ``pass_name`` (its before is the previous snapshot of its stage where no ``.before.py`` of
    its own was written). Raises ``FileNotFoundError`` naming the folder when the pass's graphs
    were not dumped there (the dump filters left them out, or the pass did not run)."""
    for stage in sorted(p for p in Path(graph_folder).iterdir() if p.is_dir()):
        files = snapshots(stage)
        for i, path in enumerate(files):
            if path.name.endswith(AFTER) and path.name[: -len(AFTER)].split("_", 1)[1] == pass_name:
                if i == 0:
                    break  # no snapshot before it: not a tree passkit wrote
                return files[i - 1].read_text(), path.read_text()
    raise FileNotFoundError(f"{graph_folder} holds no snapshot of pass {pass_name!r}'s graph")
