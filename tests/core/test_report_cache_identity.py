"""Issue 45 (5) and issue 48 (5): passkit's report cache restores only what this passkit wrote
for this pipeline, and a pass's cache identity holds what its decisions read.

On c84528f an edited entry was restored (``matches=99``), so was a record of a pass that is not
enabled and an entry of an unknown graph kind; an entry that is not UTF-8 aborted every warm
compile; a full disk left a 0-byte ``.tmp``; and a compile cached while a pass's kernel library
was missing kept reporting (and running) the skip once it was installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import passkit
from passkit._compile import report_cache
from passkit.errors import ConfigWarning
from passkit.report import PassRecord, Report

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch, clean_env):
    monkeypatch.setenv("PASSKIT_CACHE_DIR", str(tmp_path / "reports"))
    return tmp_path / "reports"


def _report(name="cleanup", kind="forward", matches=2):
    record = PassRecord(name=name, stage="post_grad_post", status="ran", matches=matches, modified=True)
    return Report(graph_id=1, graph_kind=kind, records=[record])


def test_an_entry_round_trips(cache):
    report_cache.save("k", [_report()], ["cleanup"])
    (restored,) = report_cache.load("k", ["cleanup"])
    assert restored.graph_kind == "forward" and restored["cleanup"].matches == 2


def test_an_edited_entry_is_a_miss_with_a_warning(cache):
    report_cache.save("k", [_report()], ["cleanup"])
    path = cache / "k.json"
    path.write_text(path.read_text().replace('"matches": 2', '"matches": 99'))
    with pytest.warns(ConfigWarning, match="edited or damaged"):
        assert report_cache.load("k", ["cleanup"]) is None


def test_an_entry_of_another_pass_set_is_a_miss(cache):
    report_cache.save("k", [_report("allreduce_rmsnorm")], ["allreduce_rmsnorm"])
    with pytest.warns(ConfigWarning, match=r"for passes \['allreduce_rmsnorm'\]"):
        assert report_cache.load("k", ["cleanup"]) is None


def _forge(cache, key, *, version=None, passes=("cleanup",), reports=None):
    """An entry with a valid checksum (as a tool rewriting it whole would make)."""
    version = version or report_cache._passkit_version()
    reports = reports if reports is not None else [_report().to_dict()]
    cache.mkdir(parents=True, exist_ok=True)
    envelope = {
        "passkit": version,
        "passes": list(passes),
        "key": key,
        "checksum": report_cache._checksum(version, list(passes), key, reports),
        "reports": reports,
    }
    (cache / f"{key}.json").write_text(json.dumps(envelope))


def test_a_record_outside_the_pass_set_is_a_miss(cache):
    _forge(cache, "k", reports=[_report("allreduce_rmsnorm").to_dict()])
    with pytest.warns(ConfigWarning, match="allreduce_rmsnorm.*outside its pass set"):
        assert report_cache.load("k", ["cleanup"]) is None


def test_an_unknown_graph_kind_is_a_miss(cache):
    bad = _report().to_dict()
    bad["graph_kind"] = "sideways"
    _forge(cache, "k", reports=[bad])
    with pytest.warns(ConfigWarning, match="not a passkit report"):
        assert report_cache.load("k", ["cleanup"]) is None


def test_an_entry_of_another_passkit_version_is_a_miss(cache):
    _forge(cache, "k", version="0.0.1")
    with pytest.warns(ConfigWarning, match="from passkit 0.0.1"):
        assert report_cache.load("k", ["cleanup"]) is None


def test_an_entry_under_another_key_is_a_miss(cache):
    _forge(cache, "other")
    (cache / "other.json").rename(cache / "k.json")
    with pytest.warns(ConfigWarning, match="another key"):
        assert report_cache.load("k", ["cleanup"]) is None


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage", b'{"passkit": "\xe9"}', b"[1,2]"])
def test_bytes_that_are_not_an_entry_are_a_miss(cache, content):
    cache.mkdir(parents=True)
    (cache / "k.json").write_bytes(content)
    with pytest.warns(ConfigWarning, match="not a passkit report"):
        assert report_cache.load("k", ["cleanup"]) is None


def test_a_full_disk_leaves_no_partial_file(cache, monkeypatch):
    real = Path.write_text

    def full(self, data, *args, **kwargs):
        real(self, "", *args, **kwargs)  # created, then the disk is full
        raise OSError(28, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", full)
    report_cache.save("k", [_report()], ["cleanup"])
    assert list(cache.iterdir()) == []


def _child_env(tmp_path, **extra):
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PASSKIT_", "TORCHINDUCTOR_", "TORCH_LOGS"))
    }
    env.update(
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
        TORCHINDUCTOR_FX_GRAPH_CACHE="1",
        PASSKIT_CACHE_DIR=str(tmp_path / "reports"),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env


def _probe(env):
    out = subprocess.run(
        [sys.executable, "-m", "tests.core.kernel_skip_probe"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_warm_start_does_not_keep_a_stale_skip(tmp_path):
    """First run: the pass's kernel module is not importable (skipped). Second run, the same
    Inductor and report caches, the module importable: the pass runs and rewrites, and its
    report says so. Third run: served from the cache, the restored report is the second's."""
    kernel = tmp_path / "kernels"
    kernel.mkdir()
    (kernel / "passkit_probe_kernel.py").write_text("VERSION = 1\n")
    without = _probe(_child_env(tmp_path))
    assert (without["status"], without["reason"]) == ("skipped", "passkit_probe_kernel is not installed")
    with_kernel = _child_env(tmp_path, PYTHONPATH=f"{ROOT}{os.pathsep}{kernel}")
    now = _probe(with_kernel)
    assert (now["hit"], now["status"], now["matches"]) == (0, "ran", 1), now
    assert now["out"] != without["out"]  # the rewrite ran: x * 2.0, not x * 3.0
    again = _probe(with_kernel)
    assert again["hit"] > 0 and again["restored"], again
    assert (again["status"], again["matches"], again["out"]) == ("ran", 1, now["out"])


def test_a_cache_hit_without_its_report_says_so(tmp_path):
    """Inductor's cache kept, passkit's report cache not (cleared, or kept elsewhere): the
    graph is served from Inductor's cache and no pass ran, so nothing is known of what the
    passes did. The report says that (a note, and a warning on the log), never an empty
    report that reads like a compile without passes."""
    kernel = tmp_path / "kernels"
    kernel.mkdir()
    (kernel / "passkit_probe_kernel.py").write_text("VERSION = 1\n")
    env = _child_env(tmp_path, PYTHONPATH=f"{ROOT}{os.pathsep}{kernel}")
    first = _probe(env)
    assert (first["hit"], first["status"]) == (0, "ran"), first
    second = _probe({**env, "PASSKIT_CACHE_DIR": str(tmp_path / "elsewhere")})
    assert second["hit"] > 0 and not second["restored"], second
    assert second["status"] is None  # no record: nothing is known, nothing is made up
    assert any("report cache had no report of it" in note for note in second["notes"]), second
    assert second["out"] == first["out"]


def test_environment_modules_enter_the_pass_identity(tmp_path, monkeypatch):
    class Needs(passkit.GraphPass):
        name = "needs_mod"
        environment_modules = ("passkit_probe_kernel_x",)

    before = Needs().identity()
    assert before["environment"] == {"passkit_probe_kernel_x": {"found": False}}
    (tmp_path / "passkit_probe_kernel_x.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    after = Needs().identity()["environment"]["passkit_probe_kernel_x"]
    assert after["found"] is True and after["origin"].endswith("passkit_probe_kernel_x.py")


def test_the_fusion_passes_declare_their_kernel_libraries():
    from passkit_fusion.allreduce_layernorm.pass_ import AllReduceLayerNorm
    from passkit_fusion.allreduce_rmsnorm.pass_ import AllReduceRMSNorm

    assert "flashinfer" in AllReduceRMSNorm().identity()["environment"]
    assert "triton" in AllReduceLayerNorm().identity()["environment"]
