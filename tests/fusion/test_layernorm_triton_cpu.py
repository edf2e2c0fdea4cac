"""The Triton residual add + LayerNorm kernel of ``allreduce_add_layernorm`` on CPU tensors,
in Triton's interpreter (``TRITON_INTERPRET=1``, a subprocess: the variable is read when the
kernel is defined). Skipped where Triton is not installed (the CPU package does not need it).

The interpreter rounds float32 -> bfloat16 by truncation where the GPU rounds to nearest
even, so bfloat16 is checked within one bfloat16 step here; float16 and float32 exactly for
the residual sum. The GPU test (``tests/gpu/test_allreduce_layernorm_gpu.py``) checks bf16 on
the device."""

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
    import torch, torch.nn.functional as F
    from passkit_fusion.allreduce_layernorm.triton_kernel import add_layernorm
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for shape in ((5, 64), (2, 3, 96), (3, 4096)):
            hidden = shape[-1]
            x, r = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
            w, b = (1 + 0.1 * torch.randn(hidden)).to(dtype), (0.1 * torch.randn(hidden)).to(dtype)
            for residual, weight, bias in ((r, w, b), (r, w, None), (None, w, b), (None, w, None), (r, None, None)):
                norm, total = add_layernorm(x, residual, weight, bias, 1e-5)
                want_total = x + residual if residual is not None else x
                want = F.layer_norm(want_total, (hidden,), weight, bias, 1e-5)
                step = 2.0 ** -7 if dtype == torch.bfloat16 else 0.0
                assert norm.shape == x.shape and norm.dtype == dtype and total.shape == x.shape
                res_err = (total.float() - want_total.float()).abs().max().item()
                assert res_err <= step * want_total.float().abs().max().item(), (dtype, shape, res_err)
                tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}[dtype]
                torch.testing.assert_close(norm.float(), F.layer_norm(total, (hidden,), weight, bias, 1e-5).float(), rtol=tol, atol=tol)
                torch.testing.assert_close(norm.float(), want.float(), rtol=4 * tol, atol=4 * tol)
                if residual is None:
                    assert total is x
    print("ok")
    """
)


def test_triton_add_layernorm_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
