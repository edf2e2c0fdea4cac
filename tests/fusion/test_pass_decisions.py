"""Decisions the pass takes from the tuned table, and the ``passkit tune`` command's wiring."""

from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from passkit_fusion.allreduce_rmsnorm import AllReduceRMSNorm
from passkit_fusion.patterns.sites import find_sites
from passkit_fusion.tuning import tables
from torch.fx.experimental.proxy_tensor import make_fx

from passkit_testing import fake_world


def site_graph(world, x, r, w):
    def f(x, r, w):
        h = (funcol.all_reduce(x, "sum", world.group) + r).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * h.to(x.dtype)

    return make_fx(f, tracing_mode="fake")(x, r, w)


def table(world_size: int, fused: bool) -> tables.Table:
    key = tables.TableKey("Fancy GPU", world_size, 64, "bfloat16")
    decision = tables.Decision(True, True) if fused else tables.UNFUSED
    return tables.Table({key: tables.Entry((tables.Rule(1024, decision),))})


@pytest.mark.parametrize(
    "world_size, fused, expect_skip",
    [(2, True, False), (2, False, True), (4, True, False), (8, None, True)],
)
def test_site_left_alone_where_no_table_fuses(monkeypatch, world_size, fused, expect_skip):
    """With no fused rule for the GPU/world/hidden/dtype, every call would take the op's
    slower unfused fallback: the pass must leave the site to Inductor."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fancy GPU")
    shipped = table(world_size, fused) if fused is not None else tables.Table()
    monkeypatch.setattr(tables, "default_table", lambda: shipped)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with fake_world(world_size) as world:
        gm = site_graph(world, x, x.clone(), torch.ones(64, dtype=torch.bfloat16))
        (site,), rejected = find_sites(gm.graph)
        assert rejected == []
        why = AllReduceRMSNorm(implementation="flashinfer")._never_pays(site, "flashinfer")
        assert AllReduceRMSNorm(implementation="reference")._never_pays(site, "reference") is None
    if expect_skip:
        assert why == (
            f"no tuned table fuses Fancy GPU x{world_size}, hidden 64, bfloat16 "
            "(run `passkit tune` to measure one)"
        )
    else:
        assert why is None


def test_user_tables_replace_shipped_ones(tmp_path):
    user = table(2, False)
    tables.save_table(user, tmp_path / "fancy_w2.json")
    real = tables.USER_TABLES_DIR  # default_table() reads the folder from the tables module
    tables.USER_TABLES_DIR = tmp_path
    tables.default_table.cache_clear()
    try:
        merged = tables.default_table()
        assert merged.rules_for("Fancy GPU", 2, 64, "bfloat16") == user.rules_for(
            "Fancy GPU", 2, 64, "bfloat16"
        )
        assert merged.rules_for("NVIDIA H200", 2, 4096, "bfloat16")  # shipped entries remain
    finally:
        tables.USER_TABLES_DIR = real
        tables.default_table.cache_clear()


def test_tune_command_is_registered_and_refuses_without_gpus(capsys):
    from passkit.cli import main

    assert main(["tune", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "passkit tune: error: needs 2 or more local CUDA GPUs; this machine has 0" in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # issue 46: "needs 2 to 0 local CUDA GPUs (this machine has 0); asked for 0"
        (["tune"], "needs 2 or more local CUDA GPUs; this machine has 0\n"),
        (["tune", "--world-size", "1"], "--world-size 1: needs 2 or more ranks\n"),
        (
            ["tune-model", "passkit_fusion.model:tuning_target"],
            "needs 2 or more local CUDA GPUs; this machine has 0 (--cpu runs gloo ranks instead)\n",
        ),
        (
            ["tune-model", "passkit_fusion.model:tuning_target", "--cpu", "--world-size", "1"],
            "needs 2 or more",
        ),
    ],
)
def test_tune_commands_say_what_is_wrong_with_the_world_size(capsys, monkeypatch, argv, expected):
    from passkit.cli import main

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "to 0" not in err and "asked for" not in err, err


# ---------------------------------------------------- tune-model: how many ranks, which arguments

TARGET = "passkit_fusion.model:tuning_target"


@pytest.fixture
def spawned(monkeypatch):
    """``torch.multiprocessing.spawn`` recorded, not run: the ranks each call would start."""
    import torch.multiprocessing

    calls: list[int] = []
    monkeypatch.setattr(torch.multiprocessing, "spawn", lambda fn, args, nprocs, join: calls.append(nprocs))
    return calls


def test_tune_model_on_the_cpu_starts_two_ranks_by_default(spawned, capsys):
    """It started 65,536 (``_world_size(0, 1 << 16)``) until the machine ran out of memory;
    the help and the README say 2."""
    from passkit.cli import main

    assert main(["tune-model", TARGET, "--cpu"]) == 0
    assert spawned == [2]


def test_tune_model_on_the_cpu_starts_at_most_one_rank_per_core(spawned, capsys, monkeypatch):
    import os

    from passkit.cli import main

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert main(["tune-model", TARGET, "--cpu", "--world-size", "3"]) == 0
    assert main(["tune-model", TARGET, "--cpu", "--world-size", "4"]) == 2
    assert main(["tune-model", TARGET, "--cpu", "--world-size", "65536"]) == 2
    assert spawned == [3]
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "passkit tune-model: error: --world-size 4 --cpu: at most 3 gloo ranks here (one per CPU core "
        "this process may use); give --world-size 3 or less",
        "passkit tune-model: error: --world-size 65536 --cpu: at most 3 gloo ranks here (one per CPU core "
        "this process may use); give --world-size 3 or less",
    ]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--tokens", "0"], "--tokens 0: every value must be 1 or more (got 0)"),
        (["--tokens", "16", "-4"], "--tokens 16 -4: every value must be 1 or more (got -4)"),
        (["--budget", "0"], "--budget 0.0: must be a finite number more than 0"),
        (["--budget", "-5"], "--budget -5.0: must be a finite number more than 0"),
        (["--budget", "inf"], "--budget inf: must be a finite number"),
        (["--budget", "nan"], "--budget nan: must be a finite number"),
        (["--margin", "-0.1"], "--margin -0.1: must be a finite number at least 0 and at most 1"),
        (["--margin", "inf"], "--margin inf: must be a finite number"),
        (["--world-size", "-2"], "--world-size -2: needs 2 or more ranks"),
        (["--candidates", "allreduce_rmsnorm+"], "--candidates 'allreduce_rmsnorm+': an empty pass name"),
    ],
)
def test_tune_model_refuses_a_bad_argument_before_any_rank_starts(spawned, capsys, extra, expected):
    from passkit.cli import main

    assert main(["tune-model", TARGET, "--cpu", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"passkit tune-model: error: {expected}") and err.count("\n") == 1, err
    assert spawned == []


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--tokens", "0"], "--tokens 0: every value must be 1 or more"),
        (["--hidden", "0"], "--hidden 0: every value must be 1 or more"),
        (["--margin", "nan"], "--margin nan: must be a finite number"),
    ],
)
def test_tune_refuses_a_bad_argument_before_any_rank_starts(spawned, capsys, extra, expected):
    from passkit.cli import main

    assert main(["tune", "--world-size", "2", *extra]) == 2
    assert f"passkit tune: error: {expected}" in capsys.readouterr().err
    assert spawned == []


def test_a_tune_model_factory_returning_none_is_a_one_line_error(tmp_path):
    """A 35-line traceback ending in ``AttributeError: 'NoneType' object has no attribute
    'model'``: now the CLI's one line and exit 2 (2 real gloo ranks, a time limit)."""
    import os
    import subprocess
    import sys

    (tmp_path / "none_target.py").write_text("def target(rank, world_size, device):\n    return None\n")
    out = subprocess.run(
        [sys.executable, "-m", "passkit.cli", "tune-model", "none_target:target", "--cpu"],
        cwd=tmp_path,
        env={**os.environ, "PASSKIT_CACHE_DIR": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1].startswith("passkit tune-model: error: rank "), out.stderr[
        -3000:
    ]
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .endswith(
            ": none_target:target(rank, world_size, device) returned NoneType, not a "
            "passkit_fusion.tuning.measure.Target (model, inputs, passes)"
        )
    ), out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
