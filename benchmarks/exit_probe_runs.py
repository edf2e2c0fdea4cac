"""The exit of a 2-rank gloo program that compiled a TP=2 TinyLlama with ``allreduce_rmsnorm``
(reference op, ``aot_eager``): ``tests/fusion/exit_probe.py`` run ``--runs`` times, every
other run ending with ``dist.destroy_process_group()``, one line of JSON per run (each rank's
exit code, the seconds the world took, the last lines of a rank that did not exit with 0).
It looks for "terminate called without an active exception" (rc -6), once seen in 4 of 16 runs.

    python benchmarks/exit_probe_runs.py --runs 40 > benchmarks/results/exit_probe_runs.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    from passkit_testing import run_world_program

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--pass", dest="pass_name", default="allreduce_rmsnorm")
    args = ap.parse_args()
    failed = 0
    for i in range(args.runs):
        extra = ["--destroy"] if i % 2 == 0 else []
        start = time.perf_counter()
        run = run_world_program(
            [str(ROOT / "tests/fusion/exit_probe.py"), "--pass", args.pass_name, *extra],
            2,
            timeout=300,
            env={"OMP_NUM_THREADS": "1"},
        )
        codes = [r.exit_code for r in run.ranks]
        bad = [r.output(5) for r in run.ranks if r.exit_code != 0]
        failed += bool(bad)
        row = {
            "run": i,
            "destroy": bool(extra),
            "exit_codes": codes,
            "s": round(time.perf_counter() - start, 1),
        }
        print(json.dumps({**row, "not_zero": bad}), flush=True)
    print(f"{args.runs - failed} of {args.runs} runs: every rank exited with 0", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
