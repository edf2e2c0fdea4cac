"""Record the graphs real SGLang hands passkit, as fixtures the default suite replays (issue 48).

Run in SGLang's environment (``nox -s hosts`` makes it: ``.nox/hosts-host-sglang``), from
the repository root::

    .nox/hosts-host-sglang/bin/python tests/fusion/real_hosts/record_sglang.py

It runs ``tests/hosts/test_sglang.py``'s world (SGLang's own distributed init on 2 gloo
ranks, its ``ColumnParallelLinear`` / ``RowParallelLinear`` / ``RMSNorm`` block, its plugin
loader, piecewise backend and ``--enable-torch-compile`` path) with the ``record_graph`` pass
first in passkit's pipeline, and keeps rank 0's first graph of each scenario as
``tests/fusion/real_hosts/graphs/sglang-<scenario>.json``:

* ``cpu``: SGLang's CPU path as it is (torch's functional all-reduce);
* ``device``: the branch SGLang takes on a GPU (``sglang.outplace_all_reduce``);
* ``torch-compile``: ``--enable-torch-compile`` (``torch.compile`` per batch size).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path[:0] = [str(HERE), str(ROOT / "tests" / "hosts")]

import host_graphs  # noqa: E402
import recorder  # noqa: E402

CALLS = ["cpu", "device", "narrowed", "torch-compile", "broken"]
"""What ``test_sglang._world`` compiles, call by call of ``_compile_and_run`` (the
``--enable-torch-compile`` path runs after the fourth call, before the fifth)."""
KEEP = ("cpu", "device", "torch-compile")


def _groups() -> tuple[list[str], list[int]]:
    from sglang.srt.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    return [tp.unique_name, tp.device_group.group_name], []


def _rank(rank: int, world_size: int, config_dir: str) -> dict:
    from importlib.metadata import version

    import test_sglang

    import passkit

    passkit.register(recorder.PLUGIN, name="record-graph")
    if rank == 0:
        recorder.SETTINGS.update(
            folder=os.environ["RECORD_GRAPHS_FOLDER"],
            host=f"sglang {version('sglang')}",
            scenario="setup",
            groups=_groups,
        )
    compile_and_run = test_sglang._compile_and_run
    calls = iter(CALLS)

    def labelled(*args, **kwargs):
        if rank == 0:
            recorder.SETTINGS["scenario"] = next(calls)
        return compile_and_run(*args, **kwargs)

    test_sglang._compile_and_run = labelled
    return test_sglang._world(rank, world_size, config_dir)


def main() -> int:
    from passkit_testing.worlds import gloo_world

    folder = Path(tempfile.mkdtemp(prefix="sglang-record-"))
    config_dir = folder / "config"
    config_dir.mkdir()
    passes = [
        '"record_graph"',
        '"sglang_probe"',
        '{name = "allreduce_rmsnorm", implementation = "reference"}',
    ]
    (config_dir / "passkit.toml").write_text(f"passes = [{', '.join(passes)}]\n")
    env = {
        "SGLANG_CACHE_DIR": str(folder / "cache"),
        "PASSKIT_CACHE_DIR": str(folder / "cache" / "passkit"),
        "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",
        "RECORD_GRAPHS_FOLDER": str(folder / "graphs"),
    }
    results = gloo_world(_rank, 2, args=(str(config_dir),), timeout=1500, env=env)
    recorded = [host_graphs.read(p) for p in sorted((folder / "graphs").glob("graph*.json"), key=_index)]
    by_label: dict[str, list[dict]] = {}
    for record in recorded:
        by_label.setdefault(record["scenario"], []).append(record)
    for scenario in KEEP:
        graphs = by_label.get(scenario, [])
        if graphs:  # --enable-torch-compile's are the last under its label (the 4th call's first)
            _write(graphs[-1] if scenario == "torch-compile" else graphs[0], scenario, results)
    shutil.rmtree(folder, ignore_errors=True)
    return 0


def _index(path: Path) -> int:
    return int(path.stem.removeprefix("graph"))


def _write(record: dict, scenario: str, results: list) -> None:
    key = "torch_compile" if scenario == "torch-compile" else scenario
    reports = results[0].get(key, {}).get("reports", [])
    fused = [p for r in reports for p in r["passes"] if p["name"] == "allreduce_rmsnorm"]
    record["in_host"]["allreduce_rmsnorm"] = [
        {k: p.get(k) for k in ("status", "matches", "reason")} for p in fused[:1]
    ]
    record["in_host"]["max_abs_diff_vs_eager"] = results[0].get(key, {}).get("error")
    record["expected"] = {"allreduce_rmsnorm": 2}
    path = HERE / "graphs" / f"sglang-{scenario}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(path.relative_to(ROOT), "in SGLang:", record["in_host"]["allreduce_rmsnorm"])


if __name__ == "__main__":
    sys.exit(main())
