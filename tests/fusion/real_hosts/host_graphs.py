"""Graphs the real hosts hand to passkit, saved as fixtures and rebuilt for replay (issue 48).

:func:`save` (run inside a host's environment, by ``record_<host>.py``) writes the post-grad
graph passkit received as JSON: its Python code (``GraphModule.code``, readable and
diffable), each placeholder's dtype and shape (symbolic sizes by their symbol's name), the
strings and integers in the graph that name the tensor-parallel group (the host's name,
torch's group name, vLLM CPU's shared-memory handle), and what passkit did with it inside
the host. :func:`load` (the default suite, without any host installed) rebuilds the
``GraphModule`` from the code (FX tracing it: the same ops, host ops included, which
``tests/fusion/host_ops.py`` registers with the hosts' schemas), names the group as the
replaying world does, and propagates fake tensors so the passes can read it, every symbolic
size replaced by a token count.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

FOLDER = Path(__file__).parent / "graphs"
"""Where the fixtures are (one JSON file per graph)."""
GROUP = "<tp-group>"
"""What the fixture's code says where the recorded graph named the TP group by a string."""
HANDLE = 987654
"""The integer standing for vLLM CPU's shared-memory handle of the TP group in a fixture's
code (``torch.ops._C.shm_allreduce(handle, x)``)."""


def _dim(size: Any) -> int | str:
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return int(expr) if expr.is_number else str(expr)
    return int(size)


def describe_input(node: fx.Node) -> dict[str, Any]:
    """A placeholder as JSON: ``{"dtype", "shape"}`` for a tensor, ``{"int": value}`` for an
    integer (a symbolic one by its symbol's name)."""
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype).removeprefix("torch."), "shape": [_dim(s) for s in value.shape]}
    if isinstance(value, (int, torch.SymInt)):
        return {"int": _dim(value)}
    raise ValueError(f"placeholder {node.name}: no tensor or integer value ({type(value).__name__})")


def save(
    gm: fx.GraphModule,
    path: Path,
    *,
    host: str,
    scenario: str,
    group_names: tuple[str, ...] = (),
    handles: tuple[int, ...] = (),
    in_host: dict[str, Any] | None = None,
    expected: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Write ``gm`` (the graph passkit received) to ``path``; ``group_names`` and
    ``handles``: the TP group's names and shm handle in the graph, replaced by
    :data:`GROUP` and :data:`HANDLE`; ``in_host``: what passkit reported inside the host;
    ``expected``: the counts the replay must find (matches per pass)."""
    code = gm.code
    for name in group_names:
        code = code.replace(repr(name), repr(GROUP))
    for handle in handles:
        code = code.replace(f"({handle}, ", f"({HANDLE}, ").replace(
            f"handle = {handle}", f"handle = {HANDLE}"
        )
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    record = {
        "host": host,
        "scenario": scenario,
        "torch": torch.__version__,
        "code": code,
        "inputs": [describe_input(n) for n in placeholders],
        "in_host": in_host or {},
        "expected": expected or {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def fixtures() -> list[Path]:
    return sorted(FOLDER.glob("*.json"))


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _globals() -> dict[str, Any]:
    return {
        "torch": torch,
        "operator": operator,
        "inf": float("inf"),
        "nan": float("nan"),
        "device": torch.device,
    }


def load(record: dict[str, Any], group: str, tokens: int = 8, handle: int | None = None) -> fx.GraphModule:
    """The recorded graph as a ``GraphModule`` naming ``group`` (a torch group name or a
    host's group name) for the TP group and ``handle`` for vLLM CPU's shm handle, without
    fake values (:func:`propagate`)."""
    from torch.fx.graph_module import _forward_from_src

    code = record["code"].replace(repr(GROUP), repr(group))
    if handle is not None:
        code = code.replace(str(HANDLE), str(handle))
    forward = _forward_from_src(code, _globals())
    module = type("Recorded", (torch.nn.Module,), {"forward": forward})()
    return fx.symbolic_trace(module)


def sizes(record: dict[str, Any], tokens: int) -> Callable[[int | str], int]:
    return lambda d: d if isinstance(d, int) else tokens


def make_inputs(record: dict[str, Any], tokens: int = 8, seed: int = 0) -> list[Any]:
    """Real inputs of the recorded shapes (every symbolic size ``tokens``): small random
    values (a weight's, around 1)."""
    size = sizes(record, tokens)
    g = torch.Generator().manual_seed(seed)
    out: list[Any] = []
    for spec in record["inputs"]:
        if "int" in spec:
            out.append(size(spec["int"]))
            continue
        dtype = getattr(torch, spec["dtype"])
        shape = [size(d) for d in spec["shape"]]
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=g)
            t = 1 + 0.1 * t if len(shape) == 1 else 0.5 * t
            out.append(t.to(dtype))
        else:
            out.append(torch.randint(0, 8, shape, generator=g).to(dtype))
    return out


def propagate(gm: fx.GraphModule, inputs: list[Any]) -> None:
    """Fake values on every node from ``inputs`` (what the passes read)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
    FakeTensorProp(gm, mode).propagate(*fake)
