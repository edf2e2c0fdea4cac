"""What passkit's teardown order buys: one users'-order program, ended two ways.

Runs ``tests/gpu/users_order_case.py`` (a fresh program per run: a small Llama sharded with
DTensor, compiled through passkit, first call in the given mode, every output checked
against eager) as every rank of a world, twice, and prints side by side how long each rank
took from just before ``dist.destroy_process_group()`` to its exit:

* ``passkit``: the program calls ``dist.destroy_process_group()``, which passkit's guard
  precedes with its teardown (CUDA graphs, then the passes' resources; :mod:`passkit.teardown`);
* ``torch alone``: the program calls torch's own ``destroy_process_group`` (passkit's guard
  bypassed), as it would without passkit's teardown.

With ``mode="reduce-overhead"`` and a first call in the sequence-parallel range (4096 tokens:
its reduce-scatters and all-gathers are NCCL kernels inside the recorded CUDA graphs), torch
alone waits for NCCL, which waits for the graphs to be destroyed: the rank is killed after
``--hang-s`` seconds and reported as hung.

    python benchmarks/users_order_control.py --world 2 [--passes serving --mode reduce-overhead --first 4096]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASE = ROOT / "tests" / "gpu" / "users_order_case.py"


def main() -> None:
    from passkit_testing import run_world_program

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--passes", default="serving")
    parser.add_argument("--mode", default="reduce-overhead")
    parser.add_argument("--first", type=int, default=4096)
    parser.add_argument(
        "--hang-s", type=float, default=45.0, help="a rank still alive this long after DESTROY-START is hung"
    )
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--compile-timeout", type=float, default=400.0)
    args = parser.parse_args()
    rows = {}
    for label, extra in (("passkit", []), ("torch alone", ["--unguarded"])):
        argv = [str(CASE), "--passes", args.passes, "--mode", args.mode, "--first", str(args.first), *extra]
        if args.cpu:
            argv.append("--cpu")
        run = run_world_program(
            argv,
            args.world,
            timeout=args.compile_timeout + args.hang_s,
            exit_within=("DESTROY-START", args.hang_s),
        )
        exits = run.seconds_after("DESTROY-START")
        reached = [r.line_time("DESTROY-START") is not None for r in run.ranks]
        graphs = [
            json.loads(line[len("CASE-RESULT ") :])["cuda_graphs"]
            for r in run.ranks
            for _, line in r.lines
            if line.startswith("CASE-RESULT ")
        ]
        rows[label] = {
            "exit_s": exits,
            "reached_destroy": reached,
            "exit_codes": [r.exit_code for r in run.ranks],
            "cuda_graphs": graphs,
        }
        print(f"{label}: {rows[label]}", file=sys.stderr, flush=True)
        if not all(reached):
            print(run.describe(30), file=sys.stderr)
    print(f"\n{args.passes}, mode {args.mode}, first call {args.first} tokens, world {args.world}:")
    print(
        "| ending | CUDA graphs per rank | seconds from destroy_process_group() to exit, per rank (None: hung, killed) |"
    )
    print("|---|---|---|")
    for label, row in rows.items():
        print(f"| {label} | {row['cuda_graphs']} | {row['exit_s']} |")
    print("CONTROL " + json.dumps(rows))


if __name__ == "__main__":
    main()
