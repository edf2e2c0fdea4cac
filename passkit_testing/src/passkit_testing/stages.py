"""The graph each stage of ``torch.compile`` hands to passes, for a given function.

A pass matches what its stage sees, and that is not what the model's Python wrote: by the
post-grad stages AOTAutograd and Inductor's decompositions have run (``F.gelu`` may arrive
as ``aten.gelu`` or as the ``erf``, ``mul`` and ``add`` it decomposes into), and Inductor's
own post-grad passes run between ``post_grad_pre`` and ``post_grad_post``.
:func:`stage_graphs` compiles ``fn`` once with an observer pass at each stage, which copies
the graph it receives and changes nothing::

    graphs = stage_graphs(model, x)            # {"pre_grad": gm, "post_grad_pre": gm, ...}
    print_stage_graphs(model, x)               # the same, printed: what to match at each stage
    count_ops(graphs["post_grad_post"], torch.ops.aten.gelu)

The call runs under ``torch.no_grad()`` like :func:`~passkit_testing.run_passes`: the
inference graph (the ``joint`` stage, which only training graphs reach, is not shown).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx

import passkit
from passkit.context import Mode
from passkit.graph_utils import graph_code

from .harness import copy_graph_module, run_passes

__all__ = ["STAGES", "print_stage_graphs", "stage_graphs"]

STAGES = (passkit.Stage.PRE_GRAD, passkit.Stage.PRE, passkit.Stage.POST)
"""The stages an inference graph goes through, in the order they run."""


def stage_graphs(
    fn: Callable[..., Any], *inputs: Any, mode: Mode = "inductor", dynamic: bool | None = None
) -> dict[str, torch.fx.GraphModule]:
    """Copies of the graph each stage receives when ``fn(*inputs)`` compiles, by stage value
    (``"pre_grad"``, ``"post_grad_pre"``, ``"post_grad_post"``), in the order they ran.
    ``mode="inductor"`` (the default) is what a real compile sees; ``"eager"`` is what
    :func:`~passkit_testing.run_passes`' default mode sees."""
    seen: dict[str, torch.fx.GraphModule] = {}
    observers = [_observer(stage, seen)() for stage in STAGES]
    run_passes(fn, *inputs, passes=observers, mode=mode, verify=False, dynamic=dynamic)
    return seen


def print_stage_graphs(
    fn: Callable[..., Any], *inputs: Any, mode: Mode = "inductor", dynamic: bool | None = None
) -> None:
    """Print the readable code of each stage's graph (see :func:`stage_graphs`)."""
    for stage, gm in stage_graphs(fn, *inputs, mode=mode, dynamic=dynamic).items():
        print(f"# --- stage {stage} ---")
        print(graph_code(gm))


def _observer(stage: passkit.Stage, seen: dict[str, torch.fx.GraphModule]) -> type[passkit.Pass]:
    class StageObserver(passkit.GraphPass):
        """Copies the graph it receives (passkit-testing's ``stage_graphs``); changes nothing."""

        name = f"passkit_testing_sees_{stage.value}"

        def run(self, gm: torch.fx.GraphModule, ctx: passkit.CompileContext) -> passkit.PassResult:
            seen[stage.value] = copy_graph_module(gm)
            return passkit.PassResult.unchanged()

    StageObserver.stage = stage
    return StageObserver
