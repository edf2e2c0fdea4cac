"""How long a process that used passkit-fusion takes to exit, for each teardown order.

Each scenario starts ``--world`` fresh processes (one GPU each, NCCL) that run the fused
all-reduce + RMSNorm op eagerly and inside a captured CUDA graph, print a last line, then
end in one of these orders:

    explicit       destroy_workspaces(), destroy_process_group(), exit
    atexit         exit with the workspaces and the process group alive (atexit tears down)
    pg_first       destroy_process_group(), exit (workspaces destroyed at exit, after it)
    graph_alive    like pg_first, with the CUDA graph still referenced at exit
    rank_failed    rank 1 exits abruptly (os._exit(3)) after its last call; the others
                   destroy workspaces and the process group, then exit
    peer_died      rank 1 exits before the last call; the others make it, so their fused
                   kernel waits for a peer that is gone (on the CPU: synchronize() blocks
                   forever), then tear down as in ``explicit``
    peer_died_exit like peer_died, but the survivors end without destroy_process_group()
                   (which synchronizes the device, so it blocks behind that kernel): their
                   interpreter exits after passkit's bounded teardown
    nccl_only      no passkit at all: a CUDA graph over a plain NCCL all_reduce, then
                   destroy_process_group() (tells passkit's part from NCCL's own)
    nccl_graph_alive  (not run by default: it hangs by design) nccl_only with the graph
                   still alive at destroy_process_group(): NCCL >= 2.26 waits for every
                   CUDA graph holding one of its kernels to be destroyed before it frees a
                   communicator, so this never returns. passkit-fusion's unfused path
                   captures NCCL's all-reduce: destroy such graphs first.

The parent times each rank from its last line to its exit and kills what is still alive
after ``--limit`` seconds (reported as HUNG, with the stacks faulthandler printed).
passkit-fusion's teardown waits at most ``teardown_timeout_s`` (3 s here) for the GPU.

Run on a GPU machine:  python benchmarks/teardown.py --world 4 [--only explicit,atexit]
On a CPU (``--cpu``): gloo, flashinfer replaced by the test suite's fake
(``tests/fusion/fake_flashinfer.py``) and a pretend GPU; the suite runs it this way.
Results: a table on stdout, and teardown_w{N}.{md,json} under $OUT (when set).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SCENARIOS = (
    "explicit",
    "atexit",
    "pg_first",
    "graph_alive",
    "rank_failed",
    "peer_died",
    "peer_died_exit",
    "nccl_only",
)
HERE = Path(__file__).resolve().parent
TEARDOWN_TIMEOUT_S = 3.0
LAST = "LAST-LINE"


# ---------------------------------------------------------------------- worker side --


def worker(scenario: str, rank: int, world: int, port: int, limit: float, cpu: bool) -> None:
    import torch
    import torch.distributed as dist

    faulthandler.dump_traceback_later(limit - 5, exit=False)  # a hang prints its stacks
    if cpu:
        _pretend_gpu(block_synchronize=scenario.startswith("peer_died") and rank != 1)
    else:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "gloo" if cpu else "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        device_id=None if cpu else torch.device("cuda", rank),
        timeout=datetime.timedelta(seconds=60),
    )
    group = dist.group.WORLD.group_name
    hidden, tokens = 4096, 16
    device = "cpu" if cpu else "cuda"
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    res = torch.randn_like(x)
    weight = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    graph = _Graph(cpu)
    if scenario in ("nccl_only", "nccl_graph_alive"):
        y = x.clone()
        dist.all_reduce(y)
        graph.capture(lambda: dist.all_reduce(y))
    else:
        from passkit_fusion.allreduce_rmsnorm import runtime

        runtime.configure(teardown_timeout_s=TEARDOWN_TIMEOUT_S)
        runtime.prepare(group, hidden, torch.bfloat16, max_tokens=256)
        runtime.fused_allreduce_rmsnorm_cuda(x, res, weight, 1e-6, 0.0, group)
        graph.capture(lambda: runtime.fused_allreduce_rmsnorm_cuda(x, res, weight, 1e-6, 0.0, group))
        print(f"rank {rank}: path {runtime.last_decision()}", flush=True)
    for _ in range(3):
        graph.replay()
    graph.synchronize()
    if scenario.startswith("peer_died"):
        if rank == 1:
            os._exit(3)
        time.sleep(1.0)  # rank 1 is gone
        if not cpu:  # on the CPU the blocked synchronize() stands for this kernel
            graph.replay()  # the fused kernel now waits for rank 1 forever
    print(f"{LAST} {time.time():.6f}", flush=True)

    if scenario == "rank_failed" and rank == 1:
        os._exit(3)
    if scenario in ("explicit", "rank_failed", "peer_died", "peer_died_exit"):
        from passkit_fusion.allreduce_rmsnorm import runtime

        del graph
        runtime.destroy_workspaces()
        if scenario.startswith("peer_died"):
            print(f"rank {rank}: workspaces destroyed (or skipped) in bounded time", flush=True)
        if scenario != "peer_died_exit":
            dist.destroy_process_group()
    elif scenario in ("pg_first", "nccl_only"):
        del graph
        dist.destroy_process_group()
    elif scenario == "nccl_graph_alive":
        dist.destroy_process_group()  # the graph (holding an NCCL kernel) is still alive
    elif scenario == "graph_alive":
        dist.destroy_process_group()
        globals()["_keep_graph"] = graph
    # "atexit": nothing; the interpreter's exit does it


class _Graph:
    """A CUDA graph, or on the CPU a recorded function (replaying re-runs it)."""

    def __init__(self, cpu: bool):
        import torch

        self.cpu = cpu
        self.graph = None if cpu else torch.cuda.CUDAGraph()
        self.fn = None

    def capture(self, fn):
        import torch

        if self.cpu:
            self.fn = fn
            return
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph):
            fn()

    def replay(self) -> None:
        if self.cpu:
            self.fn()
        else:
            self.graph.replay()

    def synchronize(self) -> None:
        import torch

        if not self.cpu:
            torch.cuda.synchronize()


def _pretend_gpu(block_synchronize: bool) -> None:
    """CPU mode: the test suite's fake flashinfer and pretend GPU; ``block_synchronize``
    makes ``torch.cuda.synchronize`` never return, like a kernel waiting for a dead peer."""
    import threading

    import torch

    sys.path.insert(0, str(HERE.parent / "tests" / "fusion"))
    import fake_flashinfer

    fake_flashinfer.install("0.7.2")
    fake_flashinfer.pretend_gpu()
    if block_synchronize:
        stuck = threading.Event()
        torch.cuda.synchronize = lambda device=None: stuck.wait()


# ---------------------------------------------------------------------- parent side --


def run_scenario(scenario: str, world: int, limit: float, cpu: bool = False) -> dict:
    here = str(Path(__file__).parent)  # worlds.py's folder, also where a test loads this file
    if here not in sys.path:
        sys.path.append(here)
    from worlds import free_port

    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                scenario,
                str(r),
                str(world),
                str(port),
                str(limit),
                str(int(cpu)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + limit
    outputs, exits = [], []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            exits.append((proc.returncode, time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            exits.append((None, time.time()))
        outputs.append(out)
    ranks = []
    for rank, (out, (code, ended)) in enumerate(zip(outputs, exits)):
        last = [float(line.split()[1]) for line in out.splitlines() if line.startswith(LAST)]
        ranks.append(
            {
                "rank": rank,
                "exit_code": code,
                "hung": code is None,
                "last_line_to_exit_s": round(ended - last[0], 3) if last and code is not None else None,
                "reached_last_line": bool(last),
                "output_tail": out[-3000:],
            }
        )
    return {"scenario": scenario, "world": world, "cpu": cpu, "ranks": ranks}


def summarize(results: list[dict]) -> str:
    lines = [
        "| scenario | world | exit codes | last line -> exit (s), max over ranks | verdict |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        codes = [x["exit_code"] for x in r["ranks"]]
        waits = [x["last_line_to_exit_s"] for x in r["ranks"] if x["last_line_to_exit_s"] is not None]
        hung = [x["rank"] for x in r["ranks"] if x["hung"]]
        verdict = f"HUNG (ranks {hung})" if hung else "exited"
        lines.append(
            f"| {r['scenario']} | {r['world']} | {codes} | {max(waits) if waits else '-'} | {verdict} |"
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        scenario, rank, world, port, limit, cpu = sys.argv[2:8]
        worker(scenario, int(rank), int(world), int(port), float(limit), cpu == "1")
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--only", default=",".join(SCENARIOS))
    parser.add_argument("--limit", type=float, default=60.0, help="seconds before a scenario is killed")
    parser.add_argument("--cpu", action="store_true", help="gloo + fake flashinfer (no GPU)")
    args = parser.parse_args()
    results = []
    for scenario in args.only.split(","):
        start = time.monotonic()
        result = run_scenario(scenario, args.world, args.limit, args.cpu)
        results.append(result)
        print(
            f"[{time.monotonic() - start:6.1f}s] {scenario}: {summarize([result]).splitlines()[-1]}",
            flush=True,
        )
        for rank in result["ranks"]:
            if rank["hung"] or rank["exit_code"] not in (0, 3):
                print(f"--- rank {rank['rank']} output tail:\n{rank['output_tail']}", flush=True)
    table = summarize(results)
    print(table)
    out = os.environ.get("OUT")
    if out:
        Path(out, f"teardown_w{args.world}.md").write_text(table + "\n")
        Path(out, f"teardown_w{args.world}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
