"""A fresh process for test_teardown_order.py: records the order in which passkit's teardown
and torch's destroy_process_group run. ``argv[1]``: ``destroy`` (the program calls
``dist.destroy_process_group()``) or ``exit`` (it never does: the interpreter's exit)."""

import atexit
import os
import sys

import torch._inductor.cudagraph_trees as trees
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

events: list[str] = []
if sys.argv[1] == "exit":  # registered before passkit's handler: runs after it
    atexit.register(lambda: print("EVENTS", events, flush=True))
torch_destroy = c10d.destroy_process_group


def spy_destroy(*args, **kwargs):
    events.append("process group")
    return torch_destroy(*args, **kwargs)


c10d.destroy_process_group = dist.destroy_process_group = spy_destroy

import passkit.teardown as teardown  # noqa: E402

# Inductor's CUDA-graph trees, as on a GPU that recorded two graphs (the CPU records none)
teardown.recorded_cuda_graphs = lambda: 2
teardown._gpu_idle = lambda timeout_s: events.append("GPU idle") or True
trees.reset_cudagraph_trees = lambda: events.append("CUDA graphs")
teardown.on_teardown(lambda: events.append("workspaces"), "the workspaces")
teardown.on_teardown(lambda: events.append("symmetric memory"), "the symmetric memory")

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
if sys.argv[1] == "destroy":
    dist.destroy_process_group()
    print("EVENTS", events, flush=True)
    dist.init_process_group("gloo", rank=0, world_size=1)  # a second world: nothing left to free
    dist.destroy_process_group()
    print("AGAIN", events, flush=True)
