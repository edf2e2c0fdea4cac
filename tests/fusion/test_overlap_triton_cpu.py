"""The Triton kernel of ``matmul_all_reduce_rmsnorm`` (the ranks' partials summed in rank
order + residual add + RMSNorm) on CPU tensors, in Triton's interpreter
(``TRITON_INTERPRET=1``, a subprocess: the variable is read when the kernel is defined).
Skipped where Triton is not installed (the CPU package does not need it).

The interpreter rounds float32 -> bfloat16 by truncation where the GPU rounds to nearest
even, so bfloat16 is checked within one bfloat16 step here; float32 tightly. The GPU test
(``tests/gpu/test_allreduce_overlap_gpu.py``) checks the op on the device against NCCL +
the reference norm."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

SCRIPT = textwrap.dedent(
    """
    import torch
    from passkit_fusion.reference import rms_norm
    from passkit_fusion.allreduce_overlap.triton_kernel import partials_add_rmsnorm
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for world in (1, 2, 4, 6):
            for shape in ((5, 64), (1, 3, 96), (3, 4096)):
                hidden, rows = shape[-1], 1
                for d in shape[:-1]:
                    rows *= d
                parts = [torch.randn(rows, hidden).to(dtype) for _ in range(world)]
                residual = torch.randn(shape).to(dtype)
                weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
                for weight_bias in (0.0, 1.0):
                    norm, total = partials_add_rmsnorm(parts, residual, weight, 1e-6, weight_bias)
                    assert norm.shape == total.shape == residual.shape and norm.dtype == total.dtype == dtype
                    want = parts[0].float()
                    for p in parts[1:]:
                        want = want + p.float()
                    want = (want.to(dtype).view(shape).float() + residual.float()).to(dtype)
                    step = 2.0 ** -6 if dtype == torch.bfloat16 else 1e-6
                    err = (total.float() - want.float()).abs().max().item()
                    assert err <= step * want.float().abs().max().item(), (dtype, world, shape, err)
                    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
                    torch.testing.assert_close(
                        norm.float(), rms_norm(total, weight, 1e-6, weight_bias).float(), rtol=tol, atol=tol
                    )
    # rows of larger tensors, written in place (the op's per-chunk calls)
    parts = [torch.randn(10, 64) for _ in range(2)]
    residual, weight = torch.randn(10, 64), torch.randn(64)
    whole = partials_add_rmsnorm(parts, residual, weight, 1e-6, 0.0)
    norm, total = torch.zeros(10, 64), torch.zeros(10, 64)
    for lo, hi in ((0, 3), (3, 10)):
        got = partials_add_rmsnorm([p[lo:hi] for p in parts], residual[lo:hi], weight, 1e-6, 0.0, out=(norm[lo:hi], total[lo:hi]))
        assert got[0].data_ptr() == norm[lo:hi].data_ptr()
    torch.testing.assert_close(norm, whole[0]); torch.testing.assert_close(total, whole[1])
    print("ok")
    """
)


def test_partials_residual_and_rmsnorm_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
