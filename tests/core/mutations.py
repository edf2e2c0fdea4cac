"""Single-node mutations of real graphs, applied by a pass (used by test_fuzz).

:func:`capture_graphs` records the graphs Inductor hands its post-grad passes for a small
transformer block and an MLP with an RMS norm; :func:`mutation_pass` makes a pass that
mutates one node of such a graph in one of :data:`MUTATION_KINDS`; :func:`outcome` runs it
in a pipeline and says what happened, judged against the graph before the mutation run on
the same random inputs.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch
import torch.fx

import passkit
from passkit._pipeline.build import Pipeline
from passkit._pipeline.numeric_check import _differs, _run, random_inputs
from passkit._plugins.registry import PluginInfo, PluginSet, instantiate
from passkit.config import load_config
from passkit.graph_utils import snapshot

aten, prims = torch.ops.aten, torch.ops.prims

MUTATION_KINDS = (
    "delete",
    "retarget",
    "drop_arg",
    "add_arg",
    "shape",
    "dtype",
    "output",
    "value",
    "swap",
    "method",
    "input_mutation",
)
STRUCTURAL = frozenset(MUTATION_KINDS) - {"value"}
"""Kinds that change the graph's structure (one may still happen to change values only:
``relu`` retargeted to ``neg``); ``value`` changes values only (``add`` -> ``sub``).
``swap`` installs a new graph object (``gm.graph = new``) holding a copy with one structural
mutation of another kind; ``method`` routes a node's users through a tensor method inserted as
a ``call_method`` node (``narrow``, ``to``, ``transpose``, ``unsqueeze``), its recorded value
copied from the node; ``input_mutation`` writes to one of the graph's inputs after its last
use (every output unchanged, the caller's tensor changed)."""

UNARY = [aten.relu.default, aten.neg.default, aten.sigmoid.default, aten.exp.default, aten.t.default]
BINARY = [aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.mm.default, aten.bmm.default]
DTYPES = [torch.float16, torch.bfloat16, torch.float64, torch.int32]
VALUE_SWAPS = {
    aten.add.Tensor: aten.sub.Tensor,
    aten.sub.Tensor: aten.add.Tensor,
    aten.mul.Tensor: aten.div.Tensor,
    aten.div.Tensor: aten.mul.Tensor,
    aten.relu.default: aten.abs.default,
    aten.sigmoid.default: aten.tanh.default,
    aten.exp.default: aten.sigmoid.default,
}


class Block(torch.nn.Module):
    """A pre-norm transformer block (attention + GELU MLP), small."""

    def __init__(self, hidden: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.up, self.down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / (h // self.heads) ** 0.5, dim=-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class RMSMLP(torch.nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(hidden) + 0.5)
        self.up, self.down = torch.nn.Linear(hidden, 2 * hidden), torch.nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        normed = residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return self.down(torch.relu(self.up(normed)) * 3.0), residual


def _models() -> list[tuple[str, torch.nn.Module, tuple[torch.Tensor, ...]]]:
    torch.manual_seed(0)
    return [
        ("block", Block().eval(), (torch.randn(2, 8, 16),)),
        ("rms_mlp", RMSMLP().eval(), (torch.randn(6, 16), torch.randn(6, 16))),
    ]


def capture_graphs() -> list[tuple[str, torch.fx.GraphModule]]:
    """The post-grad graphs of :func:`_models` (one compile each), as passes see them, and
    the joint graph of the transformer block in training (``block_joint``: forward and
    backward, called with ``(primals, tangents)``; its outputs hold the gradients)."""
    captured: list[torch.fx.GraphModule] = []
    joints: list[torch.fx.GraphModule] = []

    class Capture(passkit.GraphPass):
        name = "capture_graph"

        def run(self, gm, ctx):
            captured.append(torch.fx.GraphModule(gm, snapshot(gm.graph)))
            return passkit.PassResult.unchanged()

    class CaptureJoint(passkit.GraphPass):
        name = "capture_joint"
        stage = passkit.Stage.JOINT

        def run(self, gm, ctx):
            if ctx.graph_kind == "joint":
                joints.append(torch.fx.GraphModule(gm, snapshot(gm.graph)))
            return passkit.PassResult.unchanged()

    class Plugin:
        @passkit.hookimpl
        def passkit_register_passes(self):
            return [Capture, CaptureJoint]

    import torch._functorch.config
    import torch._inductor.config

    out = []
    with (
        passkit._plugins.registry.isolated(),
        torch._inductor.config.patch(fx_graph_cache=False),  # a cache hit runs no pass
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        passkit.register(Plugin(), name="capture")
        for name, model, inputs in _models():
            torch._dynamo.reset()
            with torch.no_grad():
                torch.compile(model, backend=passkit.backend(passes=["capture_graph"]))(*inputs)
            out.append((name, captured[-1]))
        torch._dynamo.reset()
        _, block, (x,) = _models()[0]
        block = block.train()
        compiled = torch.compile(block, backend=passkit.backend(passes=["capture_joint"], compiler="aot_eager"))
        compiled(x.requires_grad_(True))
        out.append(("block_joint", joints[-1]))
    torch._dynamo.reset()
    return out


# -- mutations ------------------------------------------------------------------------------


def _tensor_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [
        n
        for n in graph.nodes
        if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor) and n.users
    ]


METHODS = ("narrow", "to", "transpose", "unsqueeze")


def mutate(gm: torch.fx.GraphModule, kind: str, rng: random.Random) -> bool:
    """Mutate one node of ``gm`` in a way of ``kind``; False: no node to mutate that way."""
    graph = gm.graph
    nodes = _tensor_nodes(graph)
    if not nodes:
        return False
    node = rng.choice(nodes)
    if kind == "swap":  # a new graph object, with a structural mutation of another kind
        new = torch.fx.Graph()
        new.output(new.graph_copy(graph, {}))
        gm.graph = new
        return mutate(gm, rng.choice(sorted(STRUCTURAL - {"swap"})), rng)
    if kind == "method":
        val = node.meta["val"]
        method = rng.choice(METHODS)
        if method == "narrow" and val.dim() and int(val.shape[0]) > 1:
            args: tuple[Any, ...] = (0, 0, int(val.shape[0]) - 1)
        elif method == "transpose" and val.dim() >= 2:
            args = (0, val.dim() - 1)
        elif method == "to":
            args = (rng.choice([d for d in DTYPES if d != val.dtype]),)
        else:
            method, args = "unsqueeze", (0,)
        with graph.inserting_after(node):
            call = graph.call_method(method, (node, *args))
        call.meta = dict(node.meta)  # the recorded value is the old node's: a lie
        node.replace_all_uses_with(call, delete_user_cb=lambda user: user is not call)
        return True
    if kind == "input_mutation":
        inputs = [
            n
            for n in graph.find_nodes(op="placeholder")
            if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dtype.is_floating_point
        ]
        if not inputs:
            return False
        target = rng.choice(inputs)
        out = next(n for n in reversed(graph.nodes) if n.op == "output")
        with graph.inserting_before(out):
            if rng.random() < 0.5:
                graph.call_function(aten.add_.Tensor, (target, 1.0))
            else:
                graph.call_method("mul_", (target, 2.0))
        return True
    if kind == "delete":
        inputs = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if not inputs:
            return False
        node.replace_all_uses_with(rng.choice(inputs))
        graph.erase_node(node)
    elif kind == "retarget":
        node.target = rng.choice([t for t in UNARY + BINARY if t is not node.target])
    elif kind == "drop_arg":
        if not node.args:
            return False
        node.args = node.args[:-1]
    elif kind == "add_arg":
        extra = rng.choice([node.args[0] if node.args else 1, 1, 2.0])
        node.args = (*node.args, extra)
    elif kind == "shape":
        sites = [
            (n, i)
            for n in nodes
            for i, a in enumerate(n.args)
            if isinstance(a, (list, tuple)) and a and all(isinstance(v, int) for v in a)
        ]
        if not sites:
            return False
        node, i = rng.choice(sites)
        sizes = list(node.args[i])
        j = rng.randrange(len(sizes))
        sizes[j] = rng.choice([sizes[j] + 1, sizes[j] * 2, 1, -1 if sizes[j] != -1 else 2])
        node.update_arg(i, sizes)
    elif kind == "dtype":
        dtype = rng.choice([d for d in DTYPES if d != node.meta["val"].dtype])
        with graph.inserting_after(node):
            cast = graph.call_function(prims.convert_element_type.default, (node, dtype))
        node.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
    elif kind == "output":
        out = next(n for n in reversed(graph.nodes) if n.op == "output")
        flat = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
        entries = [i for i, e in enumerate(flat) if isinstance(e, torch.fx.Node)]
        if not entries:
            return False
        i = rng.choice(entries)
        replaced = [*flat]
        replaced[i] = node
        out.args = (type(out.args[0])(replaced) if isinstance(out.args[0], (list, tuple)) else node,)
    else:  # value: keeps every shape and dtype
        swaps = [n for n in nodes if n.target in VALUE_SWAPS]
        scalars = [
            (n, i)
            for n in nodes
            for i, a in enumerate(n.args)
            if isinstance(a, float) and not isinstance(a, bool)
        ]
        if swaps and (not scalars or rng.random() < 0.7):
            node = rng.choice(swaps)
            node.target = VALUE_SWAPS[node.target]
        elif scalars:
            node, i = rng.choice(scalars)
            node.update_arg(i, node.args[i] * 1.5 + 0.25)
        else:
            return False
    return True


def mutation_pass(kind: str, rng: random.Random, stage: passkit.Stage = passkit.Stage.POST) -> type[passkit.Pass]:
    """A pass class at ``stage`` mutating one node in a way of ``kind`` (its choices from
    ``rng``); it returns a random ``modified`` (passkit measures the change)."""
    seed = rng.randrange(2**31)

    class Mutation(passkit.GraphPass):
        name = f"mutate_{kind}"
        applied = False

        def run(self, gm, ctx):
            pick = random.Random(seed)
            type(self).applied = mutate(gm, kind, pick)
            return passkit.PassResult(modified=pick.random() < 0.5, matches=int(type(self).applied))

    Mutation.stage = stage
    Mutation.__qualname__ = f"Mutation[{kind}, {seed}]"
    return Mutation


# -- judging --------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    what: str
    """``caught`` (failed, named, restored), ``harmless`` (ran, output as before),
    ``no_site``, ``value_only`` (ran, every shape and dtype as recorded, values differ), or a
    bad one: ``not_restored``, ``wrong_structure``, ``crash``, ``unnamed``, ``mutated_input``
    (ran, and the graph writes to its inputs). On a joint graph the outputs compared are the
    forward outputs and the gradients."""
    detail: str = ""
    values_only: bool = False


def outcome(captured: torch.fx.GraphModule, cls: type[passkit.Pass], verify: Any) -> Outcome:
    plugins = PluginSet()
    plugins.load_entry_points(autoload=False)
    register = passkit.hookimpl(specname="passkit_register_passes")(lambda: [cls])
    plugins.add(
        type("Mutations", (), {"passkit_register_passes": staticmethod(register)})(),
        PluginInfo("mutations", "acme-mutations", "0.1", "acme"),
    )
    cfg = load_config(passes=[cls.name], verify=verify, environ={})
    gm = torch.fx.GraphModule(captured, snapshot(captured.graph))
    inputs = random_inputs(captured.graph)
    assert inputs is not None
    expected = _run(captured, inputs)
    try:
        pipeline = Pipeline(cfg, plugins, instantiate(cfg, plugins))
        if cls.stage is passkit.Stage.JOINT:
            report = pipeline.run_stage(gm, passkit.Stage.JOINT, graph_kind="joint")
        else:
            report = pipeline.run(gm)
    except BaseException as exc:
        return Outcome("unnamed", f"{type(exc).__name__}: {exc}"[:500])
    record = report[cls.name]
    if record.status == "failed":
        if not record.reason:
            return Outcome("unnamed", "failed without a reason")
        got = _run(gm, inputs)
        bad = [why for a, b in zip(expected, got) if (why := _differs(a, b))]
        return Outcome("not_restored", bad[0]) if bad else Outcome("caught", record.reason[:200])
    if not cls.applied:
        return Outcome("no_site")
    try:
        got, shapes_ok, wrote = _run_checked(gm, inputs)
    except Exception as exc:
        return Outcome("crash", f"{type(exc).__name__}: {exc}"[:300] + f" | {record}")
    if wrote:
        return Outcome("mutated_input", f"inputs {wrote} written | {record}")
    if len(got) != len(expected):
        return Outcome("wrong_structure", f"{len(got)} outputs, {len(expected)} before")
    bad = [why for a, b in zip(expected, got) if (why := _differs(a, b))]
    if not bad:
        return Outcome("harmless")
    if not shapes_ok:
        return Outcome("wrong_structure", bad[0])
    shapes_same = all(
        isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
        for a, b in zip(expected, got)
    )
    if not shapes_same:
        return Outcome("wrong_structure", bad[0])
    return Outcome("value_only", bad[0], values_only=True)


def _run_checked(gm: torch.fx.GraphModule, inputs: list[Any]) -> tuple[list[Any], bool, list[int]]:
    """The outputs of ``gm`` on ``inputs`` (flat), whether every node's result has the shape
    and dtype its recorded value says (a structural change that slipped through would not),
    and the positions of the inputs it wrote to."""
    ok = True

    class Checked(torch.fx.Interpreter):
        def run_node(self, n):
            nonlocal ok
            out = super().run_node(n)
            val = n.meta.get("val")
            if (
                isinstance(out, torch.Tensor)
                and isinstance(val, torch.Tensor)
                and (tuple(out.shape) != tuple(int(s) for s in val.shape) or out.dtype != val.dtype)
            ):
                ok = False
            return out

    args = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    with torch.no_grad():
        out = Checked(gm).run(*args)
    flat = torch.utils._pytree.tree_leaves(out)
    wrote = [
        i
        for i, (a, x) in enumerate(zip(args, inputs))
        if isinstance(a, torch.Tensor) and not torch.equal(a, x)
    ]
    return flat, ok, wrote


def compile_case(cls: type[passkit.Pass]) -> None:
    """``cls`` in a real Inductor compile of the RMS-norm MLP (verify off): the output equals
    eager, or differs in values only (a structural mutation that only changed values), never
    in shape or dtype, and a failure is named."""
    _, model, inputs = _models()[1]
    with torch.no_grad():
        expected = model(*inputs)
    register = passkit.hookimpl(specname="passkit_register_passes")(lambda: [cls])
    with passkit._plugins.registry.isolated():
        passkit.register(type("M", (), {"passkit_register_passes": staticmethod(register)})(), name="m")
        backend = passkit.backend(passes=[cls.name])
        torch._dynamo.reset()
        with torch.no_grad():
            got = torch.compile(model, backend=backend)(*inputs)
    for a, b in zip(expected, got):
        assert a.shape == b.shape and a.dtype == b.dtype, (cls.__qualname__, backend.reports)
    record = backend.reports[-1][cls.name]
    if record.status == "failed":
        assert record.reason, record
        for a, b in zip(expected, got):
            torch.testing.assert_close(a, b)
