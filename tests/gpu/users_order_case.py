"""One rank of a program written the way users write it, for ``test_users_order_gpu.py``.

A fresh process: initialise the process group, shard a small Llama with torch's DTensor
plan, compile it through passkit with a pass set and a mode, make the first call at a
given token count (the first passkit compile of the process, in that mode), then the other
counts, check every output against the eager model, print a ``CASE-RESULT`` line, call
``dist.destroy_process_group()`` and leave through the interpreter's normal exit (no
``os._exit``). The launcher times each rank from its ``DESTROY-START`` line to its exit.

On GPUs: NCCL, bf16, flashinfer and symmetric memory; hidden 4096, the size the shipped
tuning tables hold (where no table entry matches, the fused all-reduce leaves a site alone at
world sizes above 2, and says so in its notes). With ``--cpu``: gloo, fp32, the
fused op's reference implementation and async TP's test mode (Inductor records no CUDA
graphs on the CPU: the plumbing and the teardown order run, the pools do not).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python tests/gpu/users_order_case.py --passes serving --mode reduce-overhead --first 1
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time

import torch
import torch.distributed as dist

PASS_SETS = {
    "allreduce_rmsnorm": ["allreduce_rmsnorm"],
    "sequence_parallel": ["sequence_parallel"],
    "async_tp": ["sequence_parallel", "async_tp"],
    "serving": ["sequence_parallel", "async_tp", "allreduce_rmsnorm"],
}
"""Pass sets by name (``cleanup`` follows each). ``async_tp`` rewrites the all-gathers and
reduce-scatters sequence parallelism makes, so it is tested with it."""
MODES = {"none": None, "reduce-overhead": "reduce-overhead", "max-autotune": "max-autotune"}
TOKENS = (1, 16, 4096)
"""The token counts each case calls: one of them first, then the others. 1 is Dynamo's own
specialization; 4096 is where sequence parallelism and async TP start by default."""


def pass_entries(name: str, cpu: bool) -> list:
    impl = {
        "allreduce_rmsnorm": "reference" if cpu else "auto",
        "async_tp": "test_mode" if cpu else "auto",
    }
    entries: list = [{"name": p, "implementation": impl[p]} if p in impl else p for p in PASS_SETS[name]]
    return [*entries, "cleanup"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--passes", choices=list(PASS_SETS), required=True)
    parser.add_argument("--mode", choices=list(MODES), required=True)
    parser.add_argument("--first", type=int, required=True, help="token count of the first call")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--hang-dump-s", type=float, default=240.0, help="print every stack after this")
    parser.add_argument(
        "--unguarded",
        action="store_true",
        help="call torch's own destroy_process_group, bypassing passkit's teardown (shows the hang it prevents)",
    )
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.hang_dump_s, exit=False)

    from passkit_fusion.model import LlamaConfig, TinyLlama, shard_dtensor
    from torch.distributed.device_mesh import init_device_mesh

    import passkit
    import passkit.teardown

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu") if args.cpu else torch.device("cuda", rank)
    if not args.cpu:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if args.cpu else "nccl", device_id=None if args.cpu else device)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    cfg = (
        LlamaConfig(vocab=256, hidden=64, layers=1, heads=4, kv_heads=world, intermediate=128)
        if args.cpu
        else LlamaConfig(vocab=4096, hidden=4096, layers=2, heads=32, kv_heads=8, intermediate=8192)
    )
    model = shard_dtensor(
        TinyLlama(cfg).to(device=device, dtype=dtype).eval(), init_device_mesh(device.type, (world,))
    )
    backend = passkit.backend(passes=pass_entries(args.passes, args.cpu))
    compiled = torch.compile(model, backend=backend, mode=MODES[args.mode])
    order = [args.first, *(t for t in args.tokens if t != args.first)]

    def ids(tokens: int) -> torch.Tensor:
        x = torch.randint(0, cfg.vocab, (1, tokens), generator=torch.Generator().manual_seed(tokens)).to(
            device
        )
        if tokens > 1:
            torch._dynamo.mark_dynamic(x, 1)
        return x

    outs: dict[int, torch.Tensor] = {}
    calls_s: dict[int, float] = {}
    with torch.no_grad():
        for t in order:  # the first call is the process's first passkit compile
            start = time.perf_counter()
            for _ in range(3):  # with CUDA graphs: warm-up, record, replay
                out = compiled(ids(t))
            outs[t] = out.float().clone()
            calls_s[t] = time.perf_counter() - start
        refs = {t: model(ids(t)).float() for t in order}  # eager, after the compiled calls
    diffs = {t: float((outs[t] - refs[t]).abs().max() / refs[t].abs().max()) for t in order}
    reports = [
        {
            "range": str(r.token_range)
            if r.token_range is not None
            else ("cache hit" if r.cache_hit else "all sizes"),
            "passes": {p: [r[p].status, r[p].matches, r[p].reason] for p in r.names()},
        }
        for r in backend.reports
    ]
    result = {
        "rank": rank,
        "world": world,
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "order": order,
        "rel_diff": diffs,
        "calls_s": calls_s,
        "reports": reports,
        "cuda_graphs": passkit.teardown.recorded_cuda_graphs(),
    }
    print("CASE-RESULT " + json.dumps(result), flush=True)
    print("DESTROY-START", flush=True)
    destroy = dist.destroy_process_group
    if args.unguarded:
        destroy = getattr(destroy, "__passkit_original__", destroy)
    start = time.perf_counter()
    destroy()
    print("DESTROYED " + json.dumps({"rank": rank, "destroy_s": time.perf_counter() - start}), flush=True)
    faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
