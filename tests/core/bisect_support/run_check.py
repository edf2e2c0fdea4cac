"""A user's check script for ``passkit bisect --run``: compile the bisect model with passkit
(the passes from PASSKIT_PASSES), exit 0 when the output equals eager's, 1 otherwise."""

import sys

import bisect_model
import torch

import passkit

torch.manual_seed(0)
fn, example = bisect_model.make()
with torch.no_grad():
    out = torch.compile(fn, backend=passkit.backend(compiler="aot_eager"))(*example)
    expected = fn(*example)
sys.exit(0 if torch.allclose(out[0], expected[0], atol=1e-5, rtol=1e-4) else 1)
