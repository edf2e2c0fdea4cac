"""passkit inside the real SGLang (0.5.23): the plugin door, its piecewise backend and its
``--enable-torch-compile`` path, in a 2-rank gloo world built by SGLang's own distributed init.

Skipped where SGLang is not installed (the default suite); ``nox -s hosts`` runs it in a venv
with ``sglang==0.5.23``. One world runs every scenario (SGLang's import and group set-up
take most of a minute per rank on two cores); the tests below read its results.

What runs on this CPU machine, and what does not:

* Real: SGLang's ``init_distributed_environment`` / ``initialize_model_parallel`` on gloo
  (PyNccl and custom all-reduce off, as a CPU machine needs), its ``ColumnParallelLinear``,
  ``RowParallelLinear`` and ``RMSNorm`` (``forward_native`` under compile, as SGLang's
  piecewise backend sets it), its plugin loader (``load_plugins`` finds passkit's
  ``sglang.srt.plugins`` entry point), ``install_torch_compiled`` -> ``SGLangBackend`` ->
  ``split_graph`` -> ``PiecewiseCompileInterpreter`` -> ``CompilerManager`` ->
  ``InductorAdaptor`` (Inductor with SGLang's ``PostGradPassManager``) ->
  ``CUDAPiecewiseBackend`` (general-shape runnable), and ``torch_compile_decoration.
  patch_model`` (``torch.compile`` mode ``max-autotune-no-cudagraphs``).
* Stand-ins: ``weak_ref_tensor`` (its module raises at import without a GPU; used only by
  CUDA-graph capture, which does not run here), and for the "device" scenario a gloo-backed
  stand-in for SGLang's PyNccl communicator plus :func:`_device_path`: SGLang's
  ``GroupCoordinator.all_reduce`` sends CPU tensors down its ``input_.is_cpu`` branch
  (``torch.distributed.all_reduce``, traced as torch's functional all-reduce) before any
  setting is read, so no switch makes a CPU run emit ``sglang.outplace_all_reduce``;
  :func:`_device_path` runs the branch SGLang takes under ``torch.compile`` on a GPU, and
  registers SGLang's own Python implementation of ``sglang::outplace_all_reduce`` for CPU
  tensors (SGLang registers it for the platform's device only, CUDA in this wheel).
* Per-shape compiles: SGLang 0.5.23's ``CUDAPiecewiseBackend`` has an empty
  ``compile_sizes`` (every piece compiles once, for the general shape); :func:`_compile_sizes`
  fills it, and SGLang's own code then compiles those sizes apart (``runtime_shape=n``).
* Not run: CUDA-graph capture and replay, SGLang's GPU kernels, flashinfer (passkit's
  ``allreduce_rmsnorm`` runs its reference implementation).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import types
from typing import Any

import pydantic
import pytest
import torch

import passkit

pytest.importorskip("sglang")

from passkit_testing.worlds import gloo_world

WORLD = 2
HIDDEN, INTERMEDIATE = 64, 128
CAPTURE_SIZES = [4, 8, 16]
HAVE_DIALECTS = importlib.util.find_spec("passkit_fusion.dialects") is not None

HOST_ALL_REDUCES = (
    "sglang.outplace_all_reduce",
    "sglang.inplace_all_reduce",
    "sglang.flashinfer_allreduce",
    "_c10d_functional.all_reduce",
)


# ---------------------------------------------------------------------------------------
# rank side


def _cpu_stand_ins() -> None:
    """SGLang modules that refuse to import on a machine with no GPU, stood in for."""
    name = "sglang.srt.model_executor.runner_backend_utils.weak_ref_tensor"
    module = types.ModuleType(name)
    module.weak_ref_tensor = lambda t: t  # type: ignore[attr-defined]
    module.weak_ref_tensors = lambda t: t  # type: ignore[attr-defined]
    sys.modules[name] = module


def _model_dir() -> str:
    """A local model folder with only a ``config.json`` (what SGLang's server args read;
    no weights are loaded, nothing is fetched)."""
    folder = tempfile.mkdtemp(prefix="passkit-sglang-model-")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 128,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "float32",
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def _sglang_groups(rank: int, world_size: int) -> Any:
    """SGLang's world and TP groups, from its own init (the default group is the world's)."""
    from sglang.srt import runtime_context
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.server_args import ServerArgs

    runtime_context.publish(
        ServerArgs(model_path=_model_dir(), tp_size=world_size, device="cpu"), role="scheduler"
    )
    ps.init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank, backend="gloo")
    original = ps.init_model_parallel_group

    def without_pynccl(*args: Any, **kwargs: Any) -> Any:
        kwargs["use_pynccl"] = False  # PyNccl needs CUDA
        return original(*args, **kwargs)

    ps.init_model_parallel_group = without_pynccl
    ps.set_custom_all_reduce(False)
    try:
        ps.initialize_model_parallel()
    finally:
        ps.init_model_parallel_group = original
    return ps.get_tp_group()


class _GlooCommunicator:
    """Stands in for SGLang's ``PyNcclCommunicator`` (what GPU groups have): the same
    methods, over the group's gloo process group."""

    disabled = False

    def __init__(self, group: Any):
        self.group = group.device_group

    def change_state(self, enable: bool | None = None, **_: Any) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def all_reduce(self, tensor: torch.Tensor, *_: Any, **__: Any) -> None:
        torch.distributed.all_reduce(tensor, group=self.group)

    def outplace_all_reduce(self, tensor: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        out = tensor.clone()
        torch.distributed.all_reduce(out, group=self.group)
        return out


def _device_path(group: Any) -> None:
    """Make ``group.all_reduce`` take, under ``torch.compile``, the branch SGLang 0.5.23
    takes for GPU tensors (``GroupCoordinator.all_reduce``, the ``is_compiling()`` branch):
    with a communicator, ``sglang.outplace_all_reduce(x, group_name, "auto")``. Eager calls
    keep SGLang's own code."""
    from sglang.srt.distributed.parallel_state import outplace_all_reduce
    from sglang.srt.utils.common import sglang_lib

    # SGLang registers its collectives' kernels for the platform's device (CUDA here, as the
    # wheel is a CUDA build); register the same Python function for CPU tensors
    sglang_lib.impl("outplace_all_reduce", inspect.unwrap(outplace_all_reduce), "CPU")
    original = group.all_reduce
    group.pynccl_comm = _GlooCommunicator(group)

    def all_reduce(input_: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return original(input_)
        return outplace_all_reduce(input_, group_name=group.unique_name, outplace_all_reduce_method="auto")

    group.all_reduce = all_reduce


def _block() -> torch.nn.Module:
    """A TP block of SGLang's layers: two MLPs (column-, row-parallel), each all-reduce
    followed by residual add + RMSNorm, then ``x + residual * x * 0.5`` (a site of the
    example plugin's ``fuse_addcmul``), then a third MLP and the model's final norm, whose
    residual output is unused (``h, _ = self.norm(y, residual)``, as in SGLang's Llama)."""
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.linear import ColumnParallelLinear, RowParallelLinear

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            kw = {"bias": False, "params_dtype": torch.float32}
            self.up1 = ColumnParallelLinear(HIDDEN, INTERMEDIATE, **kw)
            self.down1 = RowParallelLinear(INTERMEDIATE, HIDDEN, **kw)
            self.norm1 = RMSNorm(HIDDEN, eps=1e-6)
            self.up2 = ColumnParallelLinear(HIDDEN, INTERMEDIATE, **kw)
            self.down2 = RowParallelLinear(INTERMEDIATE, HIDDEN, **kw)
            self.norm2 = RMSNorm(HIDDEN, eps=1e-5)
            self.up3 = ColumnParallelLinear(HIDDEN, INTERMEDIATE, **kw)
            self.down3 = RowParallelLinear(INTERMEDIATE, HIDDEN, **kw)
            self.norm = RMSNorm(HIDDEN, eps=1e-6)

        def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y, _ = self.up1(x)
            y, _ = self.down1(torch.relu(y))
            x, residual = self.norm1(y, residual)
            y, _ = self.up2(x)
            y, _ = self.down2(torch.relu(y))
            x, residual = self.norm2(y, residual)
            mixed = x + residual * x * 0.5
            y, _ = self.up3(mixed)
            y, _ = self.down3(torch.relu(y))
            h, _ = self.norm(y, residual)  # the model's final norm: its residual output unused
            return h, mixed

    torch.manual_seed(0)  # the same weights on every rank and in every scenario
    block = Block()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.1)  # norm weights near 1
    from sglang.kernels.fused_op import BaseFusedOp

    for m in block.modules():
        if isinstance(m, BaseFusedOp):  # as SGLang's piecewise backend does before compiling
            m.enter_torch_compile(num_tokens=CAPTURE_SIZES[-1])
    return block


class _ProbeOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)
    max_tokens: int | None = None


class SGLangProbe(passkit.GraphPass):
    """Counts the host's all-reduce sites in the graphs passkit sees (changes nothing)."""

    name = "sglang_probe"
    Options = _ProbeOptions

    def token_constraint(self, ctx: passkit.CompileContext) -> passkit.TokenConstraint | None:
        if self.options.max_tokens is None:
            return None
        return passkit.TokenConstraint(max_tokens=self.options.max_tokens)

    def run(self, gm: torch.fx.GraphModule, ctx: passkit.CompileContext) -> passkit.PassResult:
        counts = dict.fromkeys(HOST_ALL_REDUCES, 0)
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            target = node.target
            if "auto_functionalized" in str(target) and node.args:
                target = node.args[0]
            name = str(target).removesuffix(".default")
            if name in counts:
                counts[name] += 1
        notes = [f"{k}={v}" for k, v in counts.items() if v]
        return passkit.PassResult(modified=False, matches=sum(counts.values()), notes=notes)


class HalfCast(passkit.GraphPass):
    """Casts each relu's output to float16 (issue 27): the schema binds, Inductor rejects it
    ("both a fallback and a decomp for same op"), inside SGLang's compile."""

    name = "half_cast"

    def run(self, gm: torch.fx.GraphModule, ctx: passkit.CompileContext) -> passkit.PassResult:
        n = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.relu.default)):
            with gm.graph.inserting_after(node):
                cast = gm.graph.call_function(
                    torch.ops.aten._to_copy.default, (node,), {"dtype": torch.float16}
                )
            node.replace_all_uses_with(cast, delete_user_cb=lambda user, c=cast: user is not c)
            n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


class _ProbePlugin:
    @passkit.hookimpl
    def passkit_register_passes(self) -> list[type[passkit.Pass]]:
        return [SGLangProbe, HalfCast]


def _compile_sizes(backend: Any, sizes: list[int]) -> None:
    """Give each piece of ``backend`` the per-shape compiles of ``sizes``: what SGLang's
    ``CUDAPiecewiseBackend`` does for its ``compile_sizes`` (a set SGLang 0.5.23 leaves
    empty, so that its own runs compile the general shape only)."""
    for piece in vars(backend.split_gm).values():
        if hasattr(piece, "concrete_size_entries"):
            piece.compile_sizes |= set(sizes)
            piece.to_be_compiled_sizes |= set(sizes)
            for n in sizes:
                piece.concrete_size_entries[n].need_to_compile = True


def _compile_and_run(
    block: torch.nn.Module,
    inputs: list[tuple[torch.Tensor, torch.Tensor]],
    per_shape: list[tuple[torch.Tensor, torch.Tensor]] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    """Compile ``block`` as SGLang's piecewise CUDA-graph runner does and run ``inputs``
    (the general-shape compile); then compile the sizes of ``per_shape`` apart and run them."""
    from sglang.srt.compilation.backend import SGLangBackend
    from sglang.srt.compilation.compilation_config import CompilationConfig
    from sglang.srt.compilation.compile import install_torch_compiled
    from sglang.srt.compilation.compile_phase import enable_torch_compile_warmup
    from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph import (
        enable_tc_piecewise_cuda_graph,
    )

    config = CompilationConfig(CAPTURE_SIZES, compiler="inductor")
    backends: list[Any] = []

    def backend_factory(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        backend = SGLangBackend(config, graph_pool=object())
        backends.append(backend)
        return backend(gm, example_inputs)

    install_torch_compiled(block, compile_config=config, graph_pool=object(), backend_factory=backend_factory)
    start = time.perf_counter()
    with torch.no_grad(), enable_tc_piecewise_cuda_graph(), enable_torch_compile_warmup():
        outputs = [block(x.clone(), r.clone()) for x, r in inputs]
        (backend,) = backends
        _compile_sizes(backend, [x.shape[0] for x, _ in per_shape])
        shape_outputs = [block(x.clone(), r.clone()) for x, r in per_shape]
    keys = {
        str(index): handle[0]
        for (shape, index, _), handle in backend.compiler_manager.cache.items()
        if shape is None
    }
    manager = backend.post_grad_pass_manager
    return {
        "outputs": outputs,
        "shape_outputs": shape_outputs,
        "seconds": time.perf_counter() - start,
        "cache_keys": keys,
        "manager_passes": [type(p).__name__ for p in manager.passes],
        "manager_uuid": manager.uuid(),
    }


def _reports(adapter: Any, since: int) -> list[dict[str, Any]]:
    return [r.to_dict() for r in adapter.reports[since:]]


def _max_error(got: Any, want: Any) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(got, want))


def _world(rank: int, world_size: int, config_dir: str) -> dict[str, Any]:
    _cpu_stand_ins()
    start = time.perf_counter()
    tp = _sglang_groups(rank, world_size)
    out: dict[str, Any] = {"setup_s": time.perf_counter() - start}

    # -- the plugin door: SGLang's loader finds passkit's entry point; the config is a
    # passkit.toml in the working directory (plus PASSKIT_DUMP_DIR from the environment)
    os.chdir(config_dir)
    dumps = tempfile.mkdtemp(prefix=f"passkit-sglang-dumps-{rank}-")
    os.environ["PASSKIT_DUMP_DIR"] = dumps
    logged: list[str] = []  # TORCH_LOGS=passkit (the world's env) sets the logger's level
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("passkit").addHandler(handler)
    passkit.register(_ProbePlugin(), name="sglang-probe")
    from sglang.srt.compilation.backend import SGLangBackend
    from sglang.srt.plugins import load_plugins

    import passkit.hosts.sglang as host

    load_plugins()
    adapter = host.active()
    out["door"] = {
        "active": adapter is not None,
        "passes": adapter.pipeline.names() if adapter else [],
        "hooked": hasattr(SGLangBackend.configure_post_pass, "__wrapped__"),
        "error": str(host._error) if host._error else None,
    }
    if adapter is None:
        return out

    torch.manual_seed(1 + rank)  # inputs differ per rank (a real all-reduce), weights do not
    inputs = [(torch.randn(n, HIDDEN), torch.randn(n, HIDDEN)) for n in (8, 16, 4)]
    eager = _block()
    with torch.no_grad():
        want = [eager(x.clone(), r.clone()) for x, r in inputs]

    # -- SGLang's CPU path as is: its all-reduce traces as torch's functional all_reduce
    since = len(adapter.reports)
    run = _compile_and_run(_block(), inputs)
    out["cpu"] = {
        "error": max(_max_error(g, w) for g, w in zip(run["outputs"], want)),
        "reports": _reports(adapter, since),
        "manager_passes": run["manager_passes"],
        "seconds": run["seconds"],
    }

    # -- the device path: sglang.outplace_all_reduce in the graphs, as on GPUs
    _device_path(tp)
    since = len(adapter.reports)
    run = _compile_and_run(_block(), inputs, per_shape=[inputs[0]])
    out["device"] = {
        "error": max(_max_error(g, w) for g, w in zip(run["outputs"], want)),
        "shape_error": _max_error(run["shape_outputs"][0], want[0]),
        "reports": _reports(adapter, since),
        "cache_keys": run["cache_keys"],
        "manager_uuid": run["manager_uuid"],
        "seconds": run["seconds"],
        "logged_reports": sum("passkit report" in m for m in logged),
        "dumped": sorted(str(p.relative_to(dumps)) for p in pathlib.Path(dumps).rglob("*") if p.is_file()),
    }

    # -- the cache key follows passkit's config (explicit API: install() swaps the pipeline)
    narrowed = host.install(passes=[{"name": "sglang_probe", "max_tokens": CAPTURE_SIZES[0]}])
    run = _compile_and_run(_block(), inputs, per_shape=[inputs[2], inputs[0]])
    out["narrowed"] = {
        "error": max(_max_error(g, w) for g, w in zip(run["outputs"], want)),
        "shape_error": max(_max_error(g, w) for g, w in zip(run["shape_outputs"], [want[2], want[0]])),
        "reports": _reports(narrowed, 0),
        "cache_keys": run["cache_keys"],
    }
    again = host.install(adapter.pipeline.config)
    run = _compile_and_run(_block(), inputs)
    out["again"] = {"cache_keys": run["cache_keys"], "reports": _reports(again, 0)}

    # -- --enable-torch-compile: torch.compile(max-autotune-no-cudagraphs) per batch size
    from sglang.srt.compilation import torch_compile_decoration

    tc = host.install(adapter.pipeline.config)
    errors, wrapped = [], []
    start = time.perf_counter()
    for index in (1, 0):
        block = _block()
        x, r = inputs[index]
        with (
            torch.no_grad(),
            torch_compile_decoration.patch_model(block, True, num_tokens=x.shape[0], tp_group=tp) as forward,
        ):
            errors.append(_max_error(forward(x.clone(), r.clone()), want[index]))
            wrapped.append(getattr(forward, "passkit_pipeline", None) is not None)
    out["torch_compile"] = {
        "error": max(errors),
        "wrapped": all(wrapped),
        "reports": _reports(tc, 0),
        "seconds": time.perf_counter() - start,
    }

    # -- a pass whose graph Inductor rejects, inside SGLang's piecewise compile
    broken = host.install(passes=["sglang_probe", "half_cast"])
    run = _compile_and_run(_block(), inputs)
    out["broken"] = {
        "error": max(_max_error(g, w) for g, w in zip(run["outputs"], want)),
        "reports": _reports(broken, 0),
    }
    host.uninstall()
    return out


# ---------------------------------------------------------------------------------------
# the world, once per module


def _config() -> str:
    """passkit.toml of the world: the test's probe, the example plugin's pass and (with the
    dialects) passkit-fusion's allreduce_rmsnorm with its reference implementation."""
    passes = ['"sglang_probe"', '"fuse_addcmul"']
    if HAVE_DIALECTS:
        passes.append('{name = "allreduce_rmsnorm", implementation = "reference"}')
    return f"passes = [{', '.join(passes)}]\n"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    cache = tmp_path_factory.mktemp("sglang-cache")
    config_dir = tmp_path_factory.mktemp("sglang-config")
    (config_dir / "passkit.toml").write_text(_config())
    start = time.perf_counter()
    results = gloo_world(
        _world,
        WORLD,
        args=(str(config_dir),),
        timeout=1200,
        env={
            "SGLANG_CACHE_DIR": str(cache),
            "PASSKIT_CACHE_DIR": str(cache / "passkit"),
            "TORCH_LOGS": "passkit",
        },
    )
    if os.environ.get("SGLANG_TEST_WORLD_JSON"):  # for a look at what the ranks saw
        with open(os.environ["SGLANG_TEST_WORLD_JSON"], "w") as f:
            json.dump(results, f, indent=1, default=str)
    print(
        f"\nSGLang world: {time.perf_counter() - start:.1f} s; setup per rank {results[0]['setup_s']:.1f} s"
    )
    return results


def _records(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in report["passes"]}


def test_the_plugin_door_enables_the_configured_passes(world):
    for rank in world:
        door = rank["door"]
        assert door["active"] and door["hooked"], door
        assert door["passes"][:2] == ["sglang_probe", "fuse_addcmul"]
        assert rank["cpu"]["manager_passes"] == ["SGLangPass"]


GENERAL = f"tokens {CAPTURE_SIZES[0]}..{CAPTURE_SIZES[-1]}"


def test_a_report_per_piecewise_compile_with_sglangs_range(world):
    for rank in world:
        assert [r["token_range"] for r in rank["cpu"]["reports"]] == [GENERAL]
        # the device run also compiles 8 tokens apart, as for a size in SGLang's compile_sizes
        general, shape = rank["device"]["reports"]
        assert general["token_range"] == GENERAL
        assert "SGLang general-shape compile" in general["notes"][0]
        assert shape["token_range"] == "tokens 8, multiples of 8"
        assert shape["notes"][0] == "SGLang compile for runtime shape 8"
        for report in (*rank["cpu"]["reports"], general, shape):
            assert _records(report)["sglang_probe"]["status"] == "ran"


def test_logs_and_dumps_work_inside_sglang(world):
    for rank in world:
        device = rank["device"]
        assert device["logged_reports"] >= 2  # the cpu and device compiles' reports, logged
        assert any(name.endswith("allreduce_rmsnorm.after.py") for name in device["dumped"]), device["dumped"]
        assert any(name.endswith("report.json") for name in device["dumped"]), device["dumped"]


def test_numerics_equal_eager(world):
    for rank in world:
        for scenario in ("cpu", "device", "narrowed", "torch_compile", "broken"):
            assert rank[scenario]["error"] < 1e-4, (scenario, rank[scenario]["error"])
        for scenario in ("device", "narrowed"):  # the per-shape compiles
            assert rank[scenario]["shape_error"] < 1e-4, (scenario, rank[scenario]["shape_error"])


def test_host_all_reduce_sites_reach_passkit(world):
    for rank in world:
        for report in rank["cpu"]["reports"]:  # SGLang on CPU: torch's functional all-reduce
            assert _records(report)["sglang_probe"]["notes"] == ["_c10d_functional.all_reduce=3"]
        for report in rank["device"]["reports"]:  # SGLang's GPU branch: its own op
            assert _records(report)["sglang_probe"]["notes"] == ["sglang.outplace_all_reduce=3"]


def test_a_third_party_pass_runs_inside(world):
    for rank in world:
        for scenario in ("cpu", "device"):
            for report in rank[scenario]["reports"]:
                assert _records(report)["fuse_addcmul"]["matches"] == 1, scenario


def test_the_cache_key_changes_with_passkits_config(world):
    for rank in world:
        device, narrowed, again = rank["device"], rank["narrowed"], rank["again"]
        assert device["cache_keys"] and set(device["cache_keys"]) == set(narrowed["cache_keys"])
        for index, key in device["cache_keys"].items():
            assert narrowed["cache_keys"][index] != key
            assert again["cache_keys"][index] == key  # the same config: the same key (a hit)
        # the hit ran no pass: its report says so and restores what the passes did
        (hit,) = again["reports"]
        assert hit["cache_hit"] and hit["restored"]
        assert _records(hit)["fuse_addcmul"]["matches"] == 1


def test_passes_outside_sglangs_range_skip_with_the_reason(world):
    """The probe narrowed to 1..4 tokens: SGLang's general compile (4..16) and its compile
    for 8 tokens skip it (SGLang is told no pass applies, passkit still reports), the
    compile for 4 tokens runs it."""
    for rank in world:
        general, four, eight = rank["narrowed"]["reports"]
        assert (four["token_range"], eight["token_range"]) == (
            "tokens 4, multiples of 4",
            "tokens 8, multiples of 8",
        )
        assert _records(four)["sglang_probe"]["status"] == "ran"
        for report in (general, eight):
            record = _records(report)["sglang_probe"]
            assert record["status"] == "skipped"
            assert f"applies to tokens 1..4; this compile serves {report['token_range']}" == record["reason"]


def test_enable_torch_compile_path_runs_passkit_per_batch_size(world):
    for rank in world:
        tc = rank["torch_compile"]
        assert tc["wrapped"]
        reports = tc["reports"]
        assert [r["token_range"] for r in reports] == [
            "tokens 16, multiples of 16",
            "tokens 8, multiples of 8",
        ]
        assert reports[0]["notes"] == ["SGLang compile for runtime shape 16"]
        for report in reports:  # 8 tokens may be served by the cache the per-shape compile filled
            assert report["cache_hit"] or _records(report)["fuse_addcmul"]["matches"] == 1


@pytest.mark.skipif(not HAVE_DIALECTS, reason="passkit_fusion.dialects not installed")
def test_allreduce_rmsnorm_matches_every_sglang_all_reduce_site(world):
    for rank in world:
        for scenario in ("cpu", "device", "torch_compile"):
            for report in rank[scenario]["reports"]:
                if report["cache_hit"]:
                    continue
                sites = _records(report)["sglang_probe"]["matches"]
                fused = _records(report)["allreduce_rmsnorm"]["matches"]
                assert sites == 3 and fused == sites, (scenario, report["token_range"], sites, fused)
                # issue 27: layer names are module paths on every path (not Dynamo's sources,
                # e.g. L['fn'].__closure__[1].cell_contents.__self__.norm1 under torch.compile)
                notes = _records(report)["allreduce_rmsnorm"]["notes"]
                assert "per layer: norm1=1, norm2=1, norm=1" in notes, (scenario, notes)
        device = [n for r in rank["device"]["reports"] for n in _records(r)["allreduce_rmsnorm"]["notes"]]
        assert any("3 in the sglang dialect" in n for n in device), device


def _bisect_world(rank: int, world_size: int, config_dir: str) -> dict[str, Any]:
    """SGLang's piecewise compile (the device path: ``sglang.outplace_all_reduce`` in the
    graphs) of the block, its general shape and then two sizes apart, under the
    ``PASSKIT_BISECT_LIMIT`` of the world's environment; the passkit log lines it made."""
    _cpu_stand_ins()
    tp = _sglang_groups(rank, world_size)
    os.chdir(config_dir)
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("passkit").addHandler(handler)
    passkit.register(_ProbePlugin(), name="sglang-probe")
    from sglang.srt.plugins import load_plugins

    import passkit.hosts.sglang as host

    load_plugins()
    _device_path(tp)
    torch.manual_seed(1 + rank)
    inputs = [(torch.randn(n, HIDDEN), torch.randn(n, HIDDEN)) for n in (8, 16, 4)]
    with torch.no_grad():
        want = [_block()(x.clone(), r.clone()) for x, r in inputs]
    run = _compile_and_run(_block(), inputs[:2], per_shape=[inputs[2], inputs[0]])
    got = [*run["outputs"], *run["shape_outputs"]]
    return {
        "error": max(_max_error(g, w) for g, w in zip(got, [*want[:2], want[2], want[0]])),
        "reports": _reports(host.active(), 0),
        "logged": [m for m in logged if m.startswith("passkit bisect: ")],
    }


@pytest.mark.skipif(not HAVE_DIALECTS, reason="passkit_fusion.dialects not installed")
def test_a_bisect_limit_from_the_environment_counts_alike_on_every_rank_inside_sglang(tmp_path):
    """``PASSKIT_BISECT_LIMIT=k`` restarts an SGLang server's ranks with only the first k
    rewrites of the process allowed, counted in SGLang's compile order (the general shape,
    then each size): the first k all-reduce sites are fused, every later one is refused and
    left as it was (the outputs still equal eager's), and the ranks log the same rewrites."""
    limit = 4
    (tmp_path / "passkit.toml").write_text(
        'passes = ["sglang_probe", {name = "allreduce_rmsnorm", implementation = "reference"}]\n'
    )
    env = {
        "SGLANG_CACHE_DIR": str(tmp_path / "cache"),
        "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",
        "TORCH_LOGS": "passkit",
        "PASSKIT_BISECT_LIMIT": str(limit),
    }
    ranks = gloo_world(_bisect_world, WORLD, args=(str(tmp_path),), timeout=900, env=env)
    for rank in ranks:
        assert rank["error"] < 1e-4, rank["error"]
        fused = [_records(r)["allreduce_rmsnorm"]["matches"] for r in rank["reports"]]
        sites = [_records(r)["sglang_probe"]["matches"] for r in rank["reports"]]
        assert sites == [3, 3, 3] and fused == [3, 1, 0], (sites, fused)  # general, size 4, size 8
        allowed = [m for m in rank["logged"] if " REFUSED" not in m and "limit 4 reached" not in m]
        assert [m.split(":")[1] for m in allowed] == [f" rewrite {i}" for i in range(1, limit + 1)], allowed
        assert "(the last allowed: limit 4)" in allowed[-1]
        assert any("limit 4 reached: rewrite 5 REFUSED: pass=allreduce_rmsnorm" in m for m in rank["logged"])
    assert ranks[0]["logged"] == ranks[1]["logged"]  # the same count on every rank


@pytest.mark.skipif(not HAVE_DIALECTS, reason="passkit_fusion.dialects not installed")
def test_sglang_dialect_schemas_match_the_real_ops():
    """passkit-fusion's sglang dialect (and the default suite's stand-in ops) declare
    these schemas: a drift of SGLang's collectives fails here."""
    import importlib

    from passkit_fusion.dialects import check_schemas
    from passkit_fusion.dialects.sglang import SGLangDialect

    importlib.import_module("sglang.srt.distributed.parallel_state")  # registers sglang::*
    assert check_schemas(SGLangDialect) == []


def test_config_files_and_the_cli_work_the_same_in_sglangs_environment(clean_env):
    clean_env.joinpath("passkit.toml").write_text(
        'passes = ["cleanup", {name = "fuse_addcmul", min_numel = 8}]\n'
    )
    cli = [sys.executable, "-m", "passkit.cli"]
    subprocess.run([*cli, "check", "passkit.toml"], check=True, cwd=clean_env, capture_output=True)
    listed = subprocess.run(
        [*cli, "list", "--json"], check=True, cwd=clean_env, capture_output=True, text=True
    )
    found = json.loads(listed.stdout)
    assert {"cleanup", "fuse_addcmul", "allreduce_rmsnorm"} <= {p["name"] for p in found["passes"]}
    assert not found["failures"], found["failures"]


def test_an_inductor_failure_inside_sglangs_compile_leaves_the_pass_out(world):
    """Issue 27: Inductor fails on the graph ``half_cast`` changed inside SGLang's
    ``CompilerManager.compile``: the piece compiles again without it (output equal to eager,
    above), the report names it with Inductor's message."""
    for rank in world:
        reports = rank["broken"]["reports"]
        assert reports
        for report in reports:
            records = _records(report)
            assert records["sglang_probe"]["status"] == "ran"
            failed = records["half_cast"]
            if report["cache_hit"]:  # the other rank compiled it first (one cache folder)
                continue
            assert failed["status"] == "failed", failed
            # passkit's output check answers first (issue 44), else Inductor rejects the graph
            checked = failed["reason"].startswith("VerificationError") and (
                "now gets tensors of dtypes float16, float32" in failed["reason"]
            )
            inductor = failed["reason"].startswith(
                "Inductor failed on the graph this pass changed: AssertionError"
            ) and ("both a fallback and a decomp" in failed["reason"])
            assert checked or inductor, failed["reason"]


def _no_piecewise_probe(passes: str) -> dict[str, Any]:
    """Run tests/hosts/sglang_no_piecewise_probe.py (no CPU stand-ins: SGLang's piecewise
    backend fails to import, as on a CPU-only install) with ``PASSKIT_PASSES=passes``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PASSKIT_")}
    env["PASSKIT_PASSES"] = passes
    env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="passkit-sglang-inductor-")  # a cold cache
    root = pathlib.Path(__file__).parents[2]
    out = subprocess.run(
        [sys.executable, str(root / "tests" / "hosts" / "sglang_no_piecewise_probe.py"), str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tempfile.mkdtemp(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["stderr"] = out.stderr
    return result


def test_without_the_piecewise_backend_enable_torch_compile_still_gets_passkit():
    """Issue 27: the piecewise backend fails to import (``weak_ref_tensor`` on a CPU): passkit
    hooks ``--enable-torch-compile`` alone (no hook on the piecewise backend, so SGLang logs no
    traceback), compiles there, and leaves out a pass whose graph Inductor rejects."""
    result = _no_piecewise_probe("mul_to_scale,to_half_after_relu")
    assert result["active"] and result["paths"] == ["--enable-torch-compile"]
    assert "sglang.srt.compilation.torch_compile_decoration.patch_model" in result["hooked"]
    assert not any("compilation.backend" in target for target in result["hooked"])
    assert result["tracebacks"] == [] and "Traceback" not in result["stderr"]
    assert result["wrapped"] and result["error_vs_expected"] < 1e-5
    (report,) = result["reports"]
    assert report["mul_to_scale"][0] == "ran"
    assert report["to_half_after_relu"][0] == "failed"
    assert "both a fallback and a decomp" in report["to_half_after_relu"][1]
    assert any("piecewise backend is not available" in m and "weak_ref_tensor" in m for m in result["logged"])


def test_a_config_error_in_sglang_is_passkits_first_and_leaves_no_traceback():
    result = _no_piecewise_probe("cleanup:max_nodes=lots")
    assert not result["active"] and result["paths"] == ["--enable-torch-compile"]
    assert result["error"].startswith("PASSKIT_PASSES: invalid configuration")
    assert result["raised"].startswith("passkit.errors.ConfigError: PASSKIT_PASSES: invalid configuration")
    assert result["tracebacks"] == [] and "Traceback" not in result["stderr"]
    # the probe's root logger keeps the records (SGLang's own logging config prints them)
    assert any("not enabled in SGLang: PASSKIT_PASSES: invalid configuration" in m for m in result["logged"])


# ---------------------------------------------------------------------------------------
# a CPU with AMX tiles, simulated


def _amx_world(rank: int, world_size: int, config_dir: str, with_passkit: bool) -> dict[str, Any]:
    """SGLang's CPU path on a CPU that reports AMX tiles (``torch.cpu._is_amx_tile_supported``
    made to say so before SGLang reads it): SGLang's all-reduce asks ``cpu_has_amx_support()``,
    which imports sgl_kernel (absent here). ``with_passkit``: passkit's plugin loads first."""
    torch.cpu._is_amx_tile_supported = lambda: True  # type: ignore[attr-defined]
    _cpu_stand_ins()
    from sglang.srt.utils import common

    common.is_amx_tile_supported = True  # read when SGLang is imported (this module did)
    common._is_intel_amx_backend_available.cache_clear()
    _sglang_groups(rank, world_size)
    out: dict[str, Any] = {"sglang_sees_amx": bool(common.is_amx_tile_supported)}
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("passkit").addHandler(handler)
    if with_passkit:
        os.chdir(config_dir)
        passkit.register(_ProbePlugin(), name="sglang-probe")
        from sglang.srt.plugins import load_plugins

        import passkit.hosts.sglang as host

        load_plugins()
        out["active"] = host.active() is not None
    torch.manual_seed(1 + rank)
    inputs = [(torch.randn(n, HIDDEN), torch.randn(n, HIDDEN)) for n in (8,)]
    with torch.no_grad():
        want = [_block()(x.clone(), r.clone()) for x, r in inputs]
    try:
        run = _compile_and_run(_block(), inputs)
    except Exception as exc:
        out["failed"] = f"{type(exc).__name__}: {exc}"
    else:
        out["error"] = max(_max_error(g, w) for g, w in zip(run["outputs"], want))
        if with_passkit:
            out["reports"] = _reports(host.active(), 0)
    out["logged"] = logged
    return out


@pytest.mark.slow
def test_on_a_cpu_with_amx_passkit_answers_sglangs_check_before_the_trace(tmp_path):
    """Issue 27: with AMX tiles SGLang's all-reduce imports sgl_kernel while Dynamo traces and
    the trace fails (reproduced here by making torch report AMX tiles); with passkit's plugin
    loaded, passkit asks SGLang's check first, the trace takes torch's functional all-reduce,
    every site is fused and the log says why."""
    (tmp_path / "passkit.toml").write_text(_config())
    env = {"SGLANG_CACHE_DIR": str(tmp_path / "cache"), "TORCH_LOGS": "passkit"}
    without = gloo_world(_amx_world, WORLD, args=(str(tmp_path), False), timeout=900, env=env)
    for rank in without:
        assert rank["sglang_sees_amx"]
        assert "sgl_kernel" in rank.get("failed", ""), rank
    with_passkit = gloo_world(_amx_world, WORLD, args=(str(tmp_path), True), timeout=900, env=env)
    for rank in with_passkit:
        assert rank["active"] and "failed" not in rank, rank
        assert rank["error"] < 1e-4
        assert any("AMX tiles and sgl_kernel's CPU backend is not available" in m for m in rank["logged"])
        if HAVE_DIALECTS:
            for report in rank["reports"]:
                fused = _records(report)["allreduce_rmsnorm"]
                assert fused["status"] == "ran" and fused["matches"] >= 1, fused


# ---------------------------------------------------------------------------------------
# Dynamo's 1-token recompile


def _recompile_world(rank: int, world_size: int, config_dir: str) -> dict[str, Any]:
    """SGLang's piecewise compile of the block called with 8, 16, then 1 token: Dynamo
    compiles the 1-token call again with static shapes, and SGLang compiles that graph as a
    general-shape compile."""
    _cpu_stand_ins()
    _sglang_groups(rank, world_size)
    os.chdir(config_dir)
    passkit.register(_ProbePlugin(), name="sglang-probe")
    from sglang.srt.compilation.backend import SGLangBackend
    from sglang.srt.compilation.compilation_config import CompilationConfig
    from sglang.srt.compilation.compile import install_torch_compiled
    from sglang.srt.compilation.compile_phase import enable_torch_compile_warmup
    from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph import (
        enable_tc_piecewise_cuda_graph,
    )
    from sglang.srt.plugins import load_plugins

    import passkit.hosts.sglang as host

    load_plugins()
    config = CompilationConfig(CAPTURE_SIZES, compiler="inductor")
    block = _block()

    def backend_factory(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return SGLangBackend(config, graph_pool=object())(gm, example_inputs)

    install_torch_compiled(block, compile_config=config, graph_pool=object(), backend_factory=backend_factory)
    torch.manual_seed(1 + rank)
    inputs = [(torch.randn(n, HIDDEN), torch.randn(n, HIDDEN)) for n in (8, 16, 1)]
    with torch.no_grad():
        want = [_block()(x.clone(), r.clone()) for x, r in inputs]
    with torch.no_grad(), enable_tc_piecewise_cuda_graph(), enable_torch_compile_warmup():
        got = [block(x.clone(), r.clone()) for x, r in inputs]
    return {
        "error": max(_max_error(g, w) for g, w in zip(got, want)),
        "reports": _reports(host.active(), 0),
    }


@pytest.mark.slow
def test_dynamos_1_token_recompile_is_reported_as_serving_1_token(tmp_path):
    """Issue 27: the report of SGLang's compile of Dynamo's 1-token recompile says it serves 1
    token (it read ``tokens 4..16``, the capture sizes' span)."""
    (tmp_path / "passkit.toml").write_text(_config())
    env = {"SGLANG_CACHE_DIR": str(tmp_path / "cache"), "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    for rank in gloo_world(_recompile_world, WORLD, args=(str(tmp_path),), timeout=900, env=env):
        assert rank["error"] < 1e-4
        labels = [r["token_range"] for r in rank["reports"]]
        assert labels[-1] == "tokens = 1 (Dynamo's 1-token recompile)", labels
        assert set(labels[:-1]) == {GENERAL}, labels
        last = rank["reports"][-1]
        assert "Dynamo compiled with static shapes: it serves 1 token only" in last["notes"][0]
        assert _records(last)["sglang_probe"]["status"] == "ran"


# -- the server's arguments: which compile nothing passkit sees ----------------------------

DOCS_COMMAND = ["--model-path", "/nonexistent/model", "--tp", "2", "--enable-torch-compile"]
"""docs/sglang.md's command line (what follows ``python -m sglang.launch_server``)."""

_PARSE_AND_WARN = """
import json, sys, warnings
warnings.simplefilter("always")
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args
load_plugins()  # as launch_server does, before it parses: passkit's entry point runs here
args = prepare_server_args(json.loads(sys.argv[1]))
print("PARSED", args.enable_torch_compile)
"""


@pytest.mark.parametrize(
    ("argv", "warned"),
    [(DOCS_COMMAND, None), (DOCS_COMMAND[:-1], "without --enable-torch-compile")],
    ids=["docs-command", "default-args"],
)
def test_sglangs_own_parser_tells_which_arguments_compile_through_passkit(tmp_path, argv, warned):
    """SGLang 0.5.23's real ``prepare_server_args``, in a fresh process with passkit's plugin
    loaded as ``launch_server`` loads it: the docs' command selects ``--enable-torch-compile``
    (the only path through Inductor) and prints nothing; the default arguments print one
    WARNING naming the flag, with no TORCH_LOGS set."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS",) and not k.startswith("PASSKIT_")}
    env["PASSKIT_PASSES"] = "allreduce_rmsnorm"
    done = subprocess.run(
        [sys.executable, "-c", _PARSE_AND_WARN, json.dumps(argv)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"PARSED {warned is None}" in done.stdout, done.stdout
    lines = [
        x for x in done.stderr.splitlines() if "passkit: the enabled passes allreduce_rmsnorm do not run" in x
    ]
    if warned is None:
        assert lines == [], done.stderr[-3000:]
    else:
        assert lines and all(warned in x and "add --enable-torch-compile" in x for x in lines), done.stderr[
            -3000:
        ]
        assert len({x[x.index("passkit:") :] for x in lines}) == 1, lines  # one message (log + warning)
