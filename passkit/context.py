"""What passes and plugins know about the compile they run in."""

from __future__ import annotations

import dataclasses
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

    @classmethod
    def detect(
        cls, example_inputs: Any = (), mode: Mode = "inductor", token_range: TokenRange | None = None
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
        return cls(device=device, dtype=dtype, world_size=_world_size(), mode=mode, token_range=token_range)

    @classmethod
    def from_graph(
        cls, gm: torch.fx.GraphModule, mode: Mode = "inductor", token_range: TokenRange | None = None
    ) -> CompileContext:
        """Build a context from the recorded fake values of a graph's placeholders."""
        vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        return cls.detect(vals, mode=mode, token_range=token_range)


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
