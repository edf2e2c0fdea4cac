"""One rank of a 2-rank gloo program (``passkit_testing.run_world_program``): a TP=2
TinyLlama compiled through passkit's backend with a fusion pass (reference op) and a
compiler, its result printed, then the interpreter's exit (``--destroy``: after
``dist.destroy_process_group()``; ``--trace-exit``: the threads' Python stacks every 3 s while
it exits). Run it with ``passkit_testing.run_world_program(["tests/fusion/exit_probe.py",
...], 2, timeout=300)``: every rank must exit with rc 0 (issue 45's exit abort, not reproduced
here: see the issue's report)."""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from passkit_fusion.model import LlamaConfig, TinyLlama, shard_functional

import passkit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pass", dest="pass_name", default="allreduce_rmsnorm")
    parser.add_argument("--compiler", default="aot_eager")
    parser.add_argument("--destroy", action="store_true")
    parser.add_argument("--trace-exit", action="store_true", help="dump the threads' stacks every 3 s while exiting")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = shard_functional(TinyLlama(LlamaConfig(layers=1)), dist.group.WORLD, rank, world).eval()
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    passes = [{"name": args.pass_name, "implementation": "reference"}] if args.pass_name != "none" else []
    backend = passkit.backend(passes=passes, compiler=args.compiler)
    with torch.no_grad():
        expected = model(ids)
        out = torch.compile(model, backend=backend)(ids)
    record = backend.last_report[args.pass_name] if passes and backend.last_report else None
    print(
        "RESULT "
        + json.dumps(
            {
                "rank": rank,
                "close": bool(torch.allclose(out.float(), expected.float(), rtol=1e-3, atol=1e-3)),
                "status": record.status if record else None,
                "matches": record.matches if record else None,
            }
        ),
        flush=True,
    )
    if args.destroy:
        dist.destroy_process_group()
        print("DESTROYED", flush=True)
    if args.trace_exit:
        import faulthandler
        import sys

        faulthandler.dump_traceback_later(3.0, repeat=True, file=sys.stdout)


if __name__ == "__main__":
    main()
