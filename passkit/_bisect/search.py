"""The driver of ``passkit bisect``: a binary search over ``bisect_limit``, each probe in
fresh processes (one per rank), bounded in number and time.

Probes: limit 0 (every rewrite refused: the compile with the passes off, whose values are the
reference), then every rewrite allowed (counting them: N), then the search over 1..N-1 for
the first limit at which the check fails: at most ceil(log2 N) more compiles.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import PasskitError, cut
from . import COUNT_ALL

CHECKS = ("output", "compile", "grad")


class ProbeError(PasskitError):
    """A probe process failed on its own (the target, a timeout): not a finding."""


class Search:
    """The probes of one bisect, in one scratch folder."""

    def __init__(self, args: argparse.Namespace, work: Path):
        self.args = args
        self.work = work
        self.compiles = 0

    def spec(
        self,
        tag: str,
        limit: int,
        *,
        reference: bool = False,
        repro: str | None = None,
        determinism: bool = False,
    ) -> Path:
        a = self.args
        spec = {
            "target": a.target,
            "passes": a.passes,
            "limit": limit,
            "check": a.check,
            "atol": a.atol,
            "rtol": a.rtol,
            "seed": a.seed,
            "workdir": str(self.work),
            "world_size": a.world_size,
            "reference": reference,
            "repro": repro,
            "determinism": determinism,
            "tag": tag,
        }
        path = self.work / f"spec_{tag}.json"
        path.write_text(json.dumps(spec))
        return path

    def probe(
        self, limit: int, *, reference: bool = False, repro: str | None = None, determinism: bool = False
    ) -> dict[str, Any]:
        """Compile at ``limit`` in fresh processes; the ranks' results merged. ``determinism``:
        the probe also runs the target eagerly and compares with the reference probe's eager
        values (another process: a target drawing unseeded values differs)."""
        if self.compiles >= self.args.max_compiles:
            raise ProbeError(f"--max-compiles {self.args.max_compiles} reached before the culprit was found")
        self.compiles += 1
        tag = f"{self.compiles:02d}"
        spec = self.spec(tag, limit, reference=reference, repro=repro, determinism=determinism)
        ranks = _run_ranks(spec, self.args.world_size, self.args.timeout, self.work / f"log_{tag}")
        results = []
        for rank in range(self.args.world_size):
            path = self.work / f"result_{tag}_rank{rank}.json"
            if not path.exists():
                log = ranks.get(rank, "")
                raise ProbeError(f"the probe at limit {_show(limit)} (rank {rank}) wrote no result: {log}")
            results.append(json.loads(path.read_text()))
        for r in results:
            if r["error"]:
                raise ProbeError(
                    f"the probe at limit {_show(limit)} failed on rank {r['rank']}: {r['error']}"
                )
        merged = dict(results[0])
        bad = [r for r in results if r["bad"]]
        merged["bad"] = bool(bad)
        merged["detail"] = (
            f"rank {bad[0]['rank']}: {bad[0]['detail']}"
            if len(results) > 1 and bad
            else (bad[0]["detail"] if bad else "")
        )
        for key in ("eager_diff", "nondeterministic"):
            merged[key] = next((r.get(key) for r in results if r.get(key)), "")
        merged["has_parameters"] = any(r.get("has_parameters") for r in results)
        for key in ("repro_command", "repro_refused"):  # rank 0 writes the reproducer
            merged[key] = results[0].get(key)
        return merged


def run(args: argparse.Namespace) -> int:
    """Find and print the culprit; 0 when found, 1 when there is none (the options checked:
    :func:`validate`)."""
    work = Path(tempfile.mkdtemp(prefix="passkit-bisect-"))
    try:
        return _search(Search(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _search(s: Search) -> int:
    args = s.args
    print(
        f"passkit bisect: {args.target}, --check {args.check}, probes in fresh processes "
        f"(world size {args.world_size}, {args.timeout} s each)"
    )
    none = s.probe(0, reference=True)
    if none["bad"]:  # compile check: failing with every rewrite refused
        print(f"no culprit: {none['detail']} with every rewrite refused (limit 0): the cause is not a pass")
        print(f"{s.compiles} compiles")
        return 1
    full = s.probe(COUNT_ALL, determinism=True)
    if full["nondeterministic"]:
        print(
            f"no culprit: the target is not deterministic: built and run eagerly in two processes "
            f"after torch.manual_seed({args.seed}), {full['nondeterministic']} (seed what it draws: "
            "weights, inputs, random, numpy)"
        )
        print(f"{s.compiles} compiles")
        return 1
    rewrites = [r for r in full["rewrites"] if r["allowed"]]
    n = len(rewrites)
    print(
        f"  limit 0: passes' rewrites all refused: ok (the reference); all {n} rewrite(s): "
        + (f"bad ({full['detail']})" if full["bad"] else "ok")
    )
    if n == 0:
        print(
            "no culprit: the passes made no rewrite (0 counted): "
            + (f"the check fails with none ({full['detail']}): " if full["bad"] else "")
            + "the cause is not a pass (are the passes enabled, and do they match this target?)"
        )
        print(f"{s.compiles} compiles")
        return 1
    if not full["bad"]:
        print(f"no culprit: {_why_none(args, none, n)}")
        print(f"{s.compiles} compiles")
        return 1
    lo, hi, detail = 0, n, full["detail"]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if s.compiles >= args.max_compiles:
            print(
                f"no culprit named: --max-compiles {args.max_compiles} reached; it is one of rewrites {lo + 1}..{hi}"
            )
            print(f"{s.compiles} compiles")
            return 1
        found = s.probe(mid)
        print(f"  limit {mid}: {'bad (' + found['detail'] + ')' if found['bad'] else 'ok'}")
        if found["bad"]:
            hi, detail = mid, found["detail"]
        else:
            lo = mid
    culprit = rewrites[hi - 1]
    where = f", source={culprit['location']}" if culprit.get("location") else ""
    print(
        f"culprit: rewrite {hi} of {n}: pass={culprit['pass_name']}, stage={culprit['stage']}, "
        f"graph={culprit['graph']}, site={culprit['site']}{where}"
    )
    print(f"  with it: {detail}")
    code = 0
    if args.repro:
        s.args.max_compiles += 1  # the reproducer's compile is on top of the search's
        written = s.probe(hi, repro=str(Path(args.repro).resolve()))
        if written.get("repro_refused"):
            print(f"no reproducer written: {written['repro_refused']}")
            code = 1
        else:
            print(f"reproducer written to {args.repro} (run: {written.get('repro_command') or 'pytest'})")
    print(f"{s.compiles} compiles")
    print(
        f"by hand (a server, a script): PASSKIT_BISECT_LIMIT={hi} makes the culprit rewrite, "
        f"PASSKIT_BISECT_LIMIT={hi - 1} stops just before it"
    )
    return code


def _why_none(args: argparse.Namespace, none: dict[str, Any], n: int) -> str:
    """Why a check that passes with every rewrite names no culprit, and where to look."""
    if none["eager_diff"]:
        return (
            f"the check passes with all {n} rewrite(s), but the compile with no rewrite already "
            f"differs from eager: {none['eager_diff']}: the cause is not a pass (look at the compiler "
            "or the model)"
        )
    why = f"the {'gradients' if args.check == 'grad' else 'outputs'} are right with and without the {n} rewrite(s)"
    if args.check != "grad" and none["has_parameters"]:
        return f"{why}; the target has parameters: a pass wrong only in gradients shows with --check grad"
    return f"{why}: nothing to bisect with --check {args.check}"


def validate(args: argparse.Namespace) -> None:
    """Every option that cannot work, as one :class:`PasskitError` (exit 2), before any probe
    (the target and a writable ``--repro`` folder are the command line's to check:
    :func:`passkit.cli.cmd_bisect`)."""
    if args.check not in CHECKS:  # argparse's choices say it first; kept for callers in Python
        raise PasskitError(f"--check {args.check!r}: expected one of {', '.join(CHECKS)}")
    for flag, value in (("--atol", args.atol), ("--rtol", args.rtol)):
        if not value >= 0:
            raise PasskitError(f"{flag} {value}: expected a number >= 0")
    cores = os.cpu_count() or 1
    if args.world_size > max(cores, 2):
        raise PasskitError(f"--world-size {args.world_size}: more ranks than this machine's {cores} cores")
    if args.max_compiles < 2:
        raise PasskitError(
            f"--max-compiles {args.max_compiles}: a bisect needs at least 2 (limit 0 and all rewrites)"
        )
    if args.repro is not None:
        repro = Path(args.repro)
        try:
            full = repro.is_dir() and any(repro.iterdir())
        except OSError as exc:
            raise PasskitError(f"--repro {cut(args.repro)}: cannot be read ({exc.strerror or exc})") from None
        if full:
            raise PasskitError(
                f"--repro {cut(args.repro)}: not empty (a reproducer goes in a new or empty folder)"
            )
    if args.passes is not None:  # names and options checked here, as a compile (and explain) would
        from .._pipeline.build import build_pipeline
        from ..config import merge, sources

        build_pipeline(merge([*sources(), ("--passes", {"passes": args.passes})]))


def _run_ranks(spec: Path, world_size: int, timeout: float, log_stem: Path) -> dict[int, str]:
    """Start one probe process per rank (a gloo world when more than one), wait for all
    within ``timeout`` seconds, end every one left (its process group too); the tails of
    the logs of ranks that failed, by rank."""
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env["PYTHONPATH"]) if p)
    if world_size > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), GLOO_SOCKET_IFNAME="lo")
    procs = []
    logs = []
    try:
        for rank in range(world_size):
            log = open(f"{log_stem}_rank{rank}.txt", "w")  # noqa: SIM115 (closed below, with the others)
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "passkit._bisect.probe", str(spec)],
                    env={**env, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                raise ProbeError(f"a probe ran past --timeout {timeout:g} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                _end(p)
        for log in logs:
            log.close()
    tails = {}
    for rank, p in enumerate(procs):
        if p.returncode:
            text = Path(f"{log_stem}_rank{rank}.txt").read_text(errors="replace").strip().splitlines()
            tails[rank] = f"exit {p.returncode}: {' | '.join(text[-3:])[:400]}"
    return tails


def _end(p: subprocess.Popen[Any]) -> None:
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _show(limit: int) -> str:
    return "all" if limit >= COUNT_ALL else str(limit)
