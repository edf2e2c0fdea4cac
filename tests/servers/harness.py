"""What the server tests share: a tiny local Llama, a server process with bounded waits, one
OpenAI-compatible completion over HTTP on 127.0.0.1, passkit's reports read from its log.

Every step that can fail raises :class:`StepFailed` naming the step (``make model``, ``start``,
``request``...) and the cause, with the end of the server's log: a server that cannot run on
a machine says where it stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

WORDS = 480
"""The tiny model's vocabulary: ``w0`` .. ``w479`` and four special tokens (484 ids)."""
PROMPT = "w17 w3 w250 w99 w4 w8 w300 w42"
MAX_TOKENS = 8
LOGPROB_TOLERANCE = 1e-3
"""How far apart the first token's log-probability may be with and without passkit, where
the two servers' tokens differ (float32: the fused op sums in another order)."""


class StepFailed(AssertionError):
    """A server test stopped at ``step``: the message names it, the cause, and the log's end."""

    def __init__(self, step: str, cause: str, log: Path | None = None) -> None:
        tail = ""
        if log is not None and log.exists():
            tail = "\n--- end of the server's log ---\n" + "\n".join(
                log.read_text(errors="replace").splitlines()[-60:]
            )
        super().__init__(f"step '{step}' failed: {cause}{tail}")
        self.step = step


# -- the model --------------------------------------------------------------------------------


def make_tiny_llama(folder: Path, *, layers: int = 2, seed: int = 0) -> Path:
    """A Llama with random weights (float32, hidden 128, 4 heads of 32, 2 KV heads) and a
    word-level tokenizer over :data:`WORDS` words, saved with transformers: nothing from a hub."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {t: i for i, t in enumerate([*specials, *(f"w{i}" for i in range(WORDS))])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # larger than the default init: logits far apart, no ties
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.fill_(1.0)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


# -- the server process -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A server process (its own process group) logging to ``log``."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    log: Path
    started_s: float = 0.0
    answers: list[dict[str, object]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def _get(url: str, timeout: float) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return int(response.status)


@contextlib.contextmanager
def running(
    name: str,
    command: list[str],
    env: dict[str, str],
    log: Path,
    port: int,
    *,
    ready_path: str,
    start_timeout: float,
) -> Iterator[Server]:
    """Start ``command`` in a new process group; wait (at most ``start_timeout`` s) until
    ``GET ready_path`` answers 200; always end the whole group on the way out."""
    log.parent.mkdir(parents=True, exist_ok=True)
    begin = time.monotonic()
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    server = Server(name, process, port, log)
    try:
        deadline = begin + start_timeout
        while True:
            code = process.poll()
            if code is not None:
                raise StepFailed(
                    f"start {name}", f"the server exited with status {code} before it answered", log
                )
            try:
                if _get(server.url + ready_path, timeout=5) == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise StepFailed(
                    f"start {name}",
                    f"no answer on {server.url}{ready_path} within {start_timeout:.0f} s",
                    log,
                )
            time.sleep(2)
        server.started_s = time.monotonic() - begin
        yield server
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """SIGTERM to the process group, then SIGKILL after ``grace`` seconds."""
    if process.poll() is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # children it left behind
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def complete(
    server: Server, model: str, *, timeout: float, extra: dict[str, object] | None = None
) -> dict[str, object]:
    """One greedy ``/v1/completions`` request (:data:`PROMPT`, :data:`MAX_TOKENS` tokens,
    log-probabilities of the top token); the answer's JSON."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 1,
        **(extra or {}),
    }
    request = urllib.request.Request(
        server.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    begin = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise StepFailed(
            f"request {server.name}", f"HTTP {exc.code}: {exc.read()[:2000]!r}", server.log
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        raise StepFailed(f"request {server.name}", f"{type(exc).__name__}: {exc}", server.log) from None
    answer["_seconds"] = time.monotonic() - begin
    server.answers.append(answer)
    return answer


# -- passkit's reports in the server's log ----------------------------------------------------

REPORT_HEADER = re.compile(r"passkit report \(graph (\d+)")
PASS_ROW = re.compile(
    r"^(?P<name>[a-z_]+)\s+(?P<stage>post_grad_post|post_grad_pre|pre_grad|joint)\s+(?P<status>\w+)\s+(?P<matches>\d+)\s"
)


@dataclass
class LoggedReport:
    """One passkit report as ``TORCH_LOGS=passkit`` printed it, with the process that did."""

    process: str
    lines: list[str]

    def row(self, name: str) -> dict[str, str] | None:
        for line in self.lines:
            found = PASS_ROW.match(line)
            if found and found["name"] == name:
                return {**found.groupdict(), "line": line}
        return None


def reports_by_process(log_text: str, prefix: re.Pattern[str]) -> dict[str, list[LoggedReport]]:
    """The reports in ``log_text``, by the process named by ``prefix`` (its group 1) at the
    start of each line (the servers prefix their workers' output so); a report's rows are
    the lines of that process after its header, up to its ``total`` line."""
    open_reports: dict[str, LoggedReport] = {}
    out: dict[str, list[LoggedReport]] = {}
    for raw in log_text.splitlines():
        found = prefix.match(raw)
        process = found.group(1) if found else "main"
        line = raw[found.end() :] if found else raw
        line = (
            re.sub(r"^.*?(?=passkit report \(graph)", "", line) if "passkit report (graph" in line else line
        )
        if REPORT_HEADER.match(line):
            open_reports[process] = LoggedReport(process, [line])
            out.setdefault(process, []).append(open_reports[process])
            continue
        current = open_reports.get(process)
        if current is None:
            continue
        current.lines.append(line.strip())
        if line.strip().startswith("total "):
            del open_reports[process]
    return out


def token_ids(answer: dict[str, object]) -> list[object]:
    """The generated token ids of a completion (vLLM's ``return_token_ids``), else its
    tokens as its log-probabilities name them (the word-level tokenizer: one word, one id)."""
    choice = answer["choices"][0]  # type: ignore[index]
    ids = choice.get("token_ids")  # type: ignore[union-attr]
    return list(ids) if ids else list(choice["logprobs"]["tokens"])  # type: ignore[index]


def first_logprob(answer: dict[str, object]) -> float:
    choice = answer["choices"][0]  # type: ignore[index]
    return float(choice["logprobs"]["token_logprobs"][0])  # type: ignore[index]
