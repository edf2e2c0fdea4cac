"""What passes and plugins know about the compile they run in."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.fx

if TYPE_CHECKING:
    from .tokens import TokenRange

Mode = Literal["inductor", "eager"]


@dataclasses.dataclass(frozen=True)
class CompileContext:
    """Facts about one compile, identical on every rank of a distributed job.

    Plugins read it in ``passkit_configure_pipeline``; passes read it in
    ``Pass.skip_reason`` and ``Pass.run``. Nothing rank-local belongs here: decisions taken
    from it must be the same on every rank, or collectives hang.
    """

    device: str = "cpu"
    """Device type of the compiled graph's tensors (``"cpu"``, ``"cuda"``, ...)."""
    dtype: torch.dtype | None = None
    """The dominant floating dtype of the graph inputs, when there is one."""
    world_size: int = 1
    """Size of the default process group, 1 when torch.distributed is not initialised."""
    mode: Mode = "inductor"
    """``"inductor"`` (post-grad custom pass) or ``"eager"`` (no code generation)."""
    token_range: TokenRange | None = None
    """The token counts this compile serves (see :mod:`passkit.tokens`); ``None`` when the
    graph is not specialized by token count (it then serves every size)."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    graph_kind: str | None = None
    """What graph the pass sees: ``"torch"`` (the pre-grad stage: Dynamo's graph),
    ``"joint"`` (forward and backward before partitioning), ``"forward"`` / ``"backward"``
    (a training graph's two halves), ``"inference"`` (no gradient needed); ``None`` where
    not known (a plugin's ``passkit_configure_pipeline`` outside a compile)."""
    stage: str | None = None
    """The stage running (``"pre_grad"``, ``"joint"``, ``"post_grad_pre"``,
    ``"post_grad_post"``)."""
    compiler: str = "inductor"
    """The compiler the graph goes to after the passes: ``"inductor"``, ``"aot_eager"`` or
    the name of a custom compiler callable."""

    def may_rewrite(self, site: str) -> bool:
        """Whether the running pass may rewrite ``site`` (a short description of it): ask
        before each rewrite and leave the site as it was when refused. Always True unless
        ``bisect_limit`` is set (see :mod:`passkit.rewrite_counter`)."""
        from .rewrite_counter import may_rewrite

        return may_rewrite(site)

    @classmethod
    def detect(
        cls,
        example_inputs: Any = (),
        mode: Mode = "inductor",
        token_range: TokenRange | None = None,
        **fields: Any,
    ) -> CompileContext:
        """Build a context from a compile's example inputs and the process group."""
        tensors = [t for t in _flatten(example_inputs) if isinstance(t, torch.Tensor)]
        device = "cpu"
        dtype = None
        for t in tensors:
            if t.device.type != "cpu":
                device = t.device.type
            if dtype is None and t.is_floating_point():
                dtype = t.dtype
        return cls(
            device=device, dtype=dtype, world_size=_world_size(), mode=mode, token_range=token_range, **fields
        )

    @classmethod
    def from_graph(
        cls,
        gm: torch.fx.GraphModule,
        mode: Mode = "inductor",
        token_range: TokenRange | None = None,
        **fields: Any,
    ) -> CompileContext:
        """Build a context from the recorded fake values of a graph's placeholders (Dynamo's
        ``example_value`` on a pre-grad graph)."""
        vals = [
            n.meta.get("val", n.meta.get("example_value")) for n in gm.graph.nodes if n.op == "placeholder"
        ]
        return cls.detect(vals, mode=mode, token_range=token_range, **fields)


_graph_kind: contextvars.ContextVar[str | None] = contextvars.ContextVar("passkit_graph_kind", default=None)


@contextlib.contextmanager
def graph_kind_scope(kind: str | None) -> Iterator[None]:
    """Within the block, post-grad graphs are of ``kind`` (``"forward"``, ``"backward"``,
    ``"inference"``): set by passkit's compilers, which know what they compile."""
    token = _graph_kind.set(kind)
    try:
        yield
    finally:
        _graph_kind.reset(token)


def graph_kind_of(gm: torch.fx.GraphModule, joint: bool = False) -> str:
    """The kind of an AOTAutograd graph: what the compile under way said
    (:func:`graph_kind_scope`), else read from its placeholders (AOTAutograd names a training
    graph's inputs ``primals_*`` and the backward's gradients ``tangents_*``). ``joint``: the
    joint stage (a graph with tangents is the joint graph, else an inference one)."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    tangents = any(n.startswith("tangents") for n in names)
    if joint:
        return "joint" if tangents else "inference"
    known = _graph_kind.get()
    if known is not None:
        return known
    if tangents:
        return "backward"
    if any(n.startswith("primals") for n in names):
        return "forward"
    return "inference"


def _flatten(obj: Any) -> list[Any]:
    if isinstance(obj, (list, tuple)):
        out: list[Any] = []
        for item in obj:
            out.extend(_flatten(item))
        return out
    return [obj]


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1
