"""One bisect probe: compile the target at one ``bisect_limit`` and say what came out.

Run as ``python -m passkit._bisect.probe SPEC.json`` (one process per rank, started by
:mod:`passkit._bisect.search`). It writes ``result_<tag>_rank<r>.json``: the counted
rewrites, whether the probe is *bad* for the check, and why; the reference probe (limit 0)
saves the values later probes compare with.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    rank, world_size = int(os.environ.get("RANK", "0")), int(spec["world_size"])
    work = Path(spec["workdir"])
    result: dict[str, Any] = {"rank": rank, "bad": False, "detail": "", "error": None, "rewrites": []}
    try:
        if world_size > 1:
            import torch.distributed as dist

            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result.update(_probe(spec, rank, work))
    except BaseException as exc:  # the probe's own failure: the target, the config
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    from ..rewrite_counter import counted_rewrites

    result["rewrites"] = [r.to_json() for r in counted_rewrites()]
    (work / f"result_{spec['tag']}_rank{rank}.json").write_text(json.dumps(result))
    return 0


def _probe(spec: dict[str, Any], rank: int, work: Path) -> dict[str, Any]:
    import torch

    from .._compile.backend import backend
    from ..cli import load_target
    from ..config import merge, sources

    torch.manual_seed(spec["seed"])
    fn, example = load_target(spec["target"])
    layers = sources()
    if spec["passes"] is not None:
        layers.append(("--passes", {"passes": spec["passes"]}))
    layers.append(("passkit bisect", {"bisect_limit": spec["limit"]}))
    capture = None
    if spec.get("repro"):  # a plugin: before the backend loads the plugin set
        from .repro import Capture

        capture = Capture(spec["limit"])
        capture.install()
    b = backend(merge(layers), compile_at="upfront")
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=b)
    out: dict[str, Any] = {"bad": False, "detail": ""}
    try:
        values = _values(compiled, example, spec)
    except Exception as exc:
        out["bad"], out["detail"] = (
            True,
            f"the compile or the call raised {type(exc).__name__}: {str(exc)[:300]}",
        )
        values = None
    failed = [r for report in b.reports for r in report.records if r.status == "failed"]
    if spec["check"] == "compile" and failed and not out["bad"]:
        out["bad"] = True
        out["detail"] = f"pass {failed[0].name} failed: {(failed[0].reason or '')[:300]}"
    if capture is not None and rank == 0:  # one reproducer, from the first rank
        from .repro import ReproRefused

        try:
            out["repro_command"] = capture.write(Path(spec["repro"]), spec)
        except ReproRefused as exc:
            out["repro_refused"] = str(exc)
    if values is None:
        return out
    ref_path = work / f"reference_rank{rank}.pt"
    eager_path = work / f"eager_rank{rank}.pt"
    if spec["reference"]:
        torch.save(values, ref_path)
        eager = _values(fn, example, spec)
        torch.save(eager, eager_path)
        out["eager_diff"] = _difference(values, eager, spec)
        out["has_parameters"] = isinstance(fn, torch.nn.Module) and any(True for _ in fn.parameters())
    else:
        if spec.get("determinism"):  # the target as built in a second process: the same?
            out["nondeterministic"] = _difference(_values(fn, example, spec), torch.load(eager_path), spec)
        if spec["check"] in ("output", "grad"):
            diff = _difference(values, torch.load(ref_path), spec)
            if diff:
                out["bad"], out["detail"] = True, diff
    return out


def _values(fn: Any, example: tuple[Any, ...], spec: dict[str, Any]) -> list[Any]:
    """What the check compares: the outputs (``output``, ``compile``) or the gradients of
    the parameters and floating inputs (``grad``, with seeded cotangents)."""
    import torch
    import torch.utils._pytree as pytree

    inputs = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in example]
    if spec["check"] != "grad":
        with torch.no_grad():
            leaves = pytree.tree_leaves(fn(*inputs))
        return [[f"output {i}", _plain(v)] for i, v in enumerate(leaves)]
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x.requires_grad_(True)
    module = getattr(fn, "_orig_mod", fn)  # the compiled module's parameters under the model's names
    params = list(module.named_parameters()) if isinstance(module, torch.nn.Module) else []
    for _, p in params:
        p.grad = None
    leaves = [v for v in pytree.tree_leaves(fn(*inputs)) if isinstance(v, torch.Tensor) and v.requires_grad]
    if not leaves:
        raise RuntimeError("--check grad: the target's outputs need no gradient (is it a training target?)")
    gen = torch.Generator().manual_seed(spec["seed"])
    loss = sum((v * torch.randn(v.shape, generator=gen).to(v)).sum() for v in leaves)
    loss.backward()  # type: ignore[union-attr]
    named = [(f"the gradient of parameter {n!r}", p.grad) for n, p in params]
    named += [
        (f"the gradient of input {i}", x.grad) for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)
    ]
    return [[name, _plain(g)] for name, g in named]


def _plain(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        if hasattr(value, "full_tensor"):  # a DTensor
            value = value.full_tensor()
        return value.detach().cpu().clone()
    return value


def _difference(actual: list[Any], expected: list[Any], spec: dict[str, Any]) -> str:
    """Why ``actual`` is not ``expected`` (``[name, value]`` pairs: ``output 0``, ``the
    gradient of parameter 'w'``) within the tolerances, naming the value; or ``""``."""
    import torch

    if len(actual) != len(expected):
        return f"{len(actual)} values, expected {len(expected)}"
    for (name, a), (_, e) in zip(actual, expected):
        if isinstance(a, torch.Tensor) != isinstance(e, torch.Tensor):
            return f"{name}: {type(a).__name__}, expected {type(e).__name__}"
        if not isinstance(a, torch.Tensor):
            if a != e:
                return f"{name}: {a!r}, expected {e!r}"
            continue
        if a.shape != e.shape:
            return f"{name}: shape {tuple(a.shape)}, expected {tuple(e.shape)}"
        a64, e64 = a.double(), e.double()
        if not torch.allclose(a64, e64, rtol=spec["rtol"], atol=spec["atol"], equal_nan=True):
            worst = (a64 - e64).abs().nan_to_num(float("inf")).max().item()
            return f"{name} differs by up to {worst:.3g} (atol {spec['atol']:g}, rtol {spec['rtol']:g})"
    return ""


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
