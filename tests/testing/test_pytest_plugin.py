"""Tests of passkit_testing.pytest_plugin, loaded through its pytest11 entry point (the inner
sessions run by ``pytester`` get it only because passkit-testing is installed)."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys

import pytest
import torch

pytest_plugins = ["pytester"]


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", *args)


def test_registered_through_the_pytest11_entry_point():
    (ep,) = [ep for ep in importlib.metadata.entry_points(group="pytest11") if ep.name == "passkit"]
    assert ep.value == "passkit_testing.pytest_plugin"
    assert ep.dist is not None and ep.dist.name == "passkit-testing"


def test_loading_the_plugin_does_not_import_torch():
    code = "import sys, passkit_testing.pytest_plugin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_package_exports_each_submodules_public_names():
    import passkit_testing

    for module, names in passkit_testing._EXPORTS.items():
        submodule = importlib.import_module(f"passkit_testing.{module}")
        assert sorted(submodule.__all__) == sorted(names), module
        for name in names:
            assert getattr(passkit_testing, name) is getattr(submodule, name)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        passkit_testing.nope  # noqa: B018


def test_fixtures(pytester):
    pytester.makepyfile(
        """
        import pytest
        import torch.distributed as dist

        import passkit
        import passkit_testing


        def test_harness(passkit_harness):
            assert passkit_harness is passkit_testing.run_passes


        def test_fake_world_defaults_to_two_ranks(fake_world):
            assert (fake_world.world_size, fake_world.rank) == (2, 0)
            assert dist.get_world_size() == 2


        @pytest.mark.parametrize(
            ("fake_world", "expected"),
            [(4, (4, 0)), ({"world_size": 3, "rank": 2}, (3, 2))],
            indirect=["fake_world"],
        )
        def test_fake_world_indirect(fake_world, expected):
            assert (dist.get_world_size(), dist.get_rank()) == expected


        def test_fake_world_is_torn_down():
            assert not dist.is_initialized()


        def test_gloo_world(gloo_world):
            assert gloo_world is passkit_testing.gloo_world


        class Plugin:
            def __init__(self, name):
                class P(passkit.GraphPass):
                    pass

                P.name = name
                self.cls = P

            @passkit.hookimpl
            def passkit_register_passes(self):
                return [self.cls]


        OUTER, INNER = Plugin("outer_pass"), Plugin("inner_pass")
        passkit.register(OUTER)


        def test_isolated_plugins_hide_and_undo(passkit_isolated_plugins):
            assert "outer_pass" not in passkit.get_plugins().passes
            passkit.register(INNER)
            assert "inner_pass" in passkit.get_plugins().passes


        def test_isolated_plugins_restore():
            names = passkit.get_plugins().passes
            assert "outer_pass" in names and "inner_pass" not in names
            passkit.unregister(OUTER)
        """
    )
    run(pytester).assert_outcomes(passed=8)


def test_markers_are_registered(pytester):
    result = run(pytester, "--markers")
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.gpu: needs a CUDA GPU; skipped when none is visible",
            "@pytest.mark.requires_gpus(n): needs at least n CUDA GPUs; skipped when fewer are visible",
            "@pytest.mark.slow: takes over ~15 s*",
        ]
    )


def test_gpu_markers_skip_without_enough_gpus(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpu
        def test_gpu():
            pass

        @pytest.mark.requires_gpus(2)
        def test_two_gpus():
            pass

        @pytest.mark.slow
        def test_slow():
            pass
        """
    )
    result = run(pytester, "--strict-markers", "-rs")
    found = torch.cuda.device_count()
    skipped = (found < 1) + (found < 2)
    result.assert_outcomes(passed=3 - skipped, skipped=skipped)
    if found < 2:
        result.stdout.fnmatch_lines([f"SKIPPED * needs 2 CUDA GPUs, found {found}"])


@pytest.mark.parametrize("args", ["", "'2'", "0", "n=2"])
def test_requires_gpus_misuse_is_a_usage_error(pytester, args):
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.requires_gpus({args})
        def test_it():
            pass
        """
    )
    result = run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*requires_gpus takes one positive int, the number of GPUs*"])


def test_a_failing_pass_test_shows_passkits_log_not_empty_torch_trace_lines(pytester):
    """pytest attaches its capture to torch's non-propagating ``torch.__trace`` logger, which
    turns structured tracing on and prints dozens of empty ``DEBUG torch.__trace`` lines
    under a failing test: the plugin takes it off that logger, and passkit's log stays."""
    pytester.makepyfile(
        """
        import logging
        import torch

        def test_fails(passkit_harness):
            logging.getLogger("passkit").warning("passkit: a note from passkit")
            trace = logging.getLogger("torch.__trace")
            result = passkit_harness(lambda x: torch.neg(torch.neg(x)) * 2, torch.randn(8), passes=["cleanup"])
            assert not trace.handlers  # torch's structured tracing stays off
            result.assert_matches("cleanup", 99)
        """
    )
    result = run(pytester, "--log-level=DEBUG")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "reported 0 match(es), expected 99" in out
    assert "Captured log call" in out and "passkit: a note from passkit" in out
    captured = out[out.index("Captured log call") :]
    assert "torch.__trace" not in captured
