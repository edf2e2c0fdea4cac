"""HF-style LayerNorm decoder blocks, tensor-parallel by hand (functional all-reduces), for
the ``allreduce_layernorm`` tests (graphs in a fake world, numerics on gloo)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn


def ar(x: torch.Tensor) -> torch.Tensor:
    return funcol.all_reduce(x, "sum", dist.group.WORLD)


class Block(nn.Module):
    """Pre-norm decoder block (Starcoder2, OLMo, Phi-MoE...): ``h = x + AR(attn(ln1(x)))``,
    ``out = h + AR(mlp(ln2(h)))``; the column-parallel projections hold 1/world of the
    inner dim, the row-parallel ones end in an all-reduce."""

    def __init__(self, hidden: int, inner: int, bias: bool, parallel: bool | str = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, eps=1e-5, bias=bias)
        self.ln2 = nn.LayerNorm(hidden, eps=1e-5, bias=bias)
        self.attn_in = nn.Linear(hidden, inner, bias=bias)
        self.attn_out = nn.Linear(inner, hidden, bias=False)
        self.up = nn.Linear(hidden, 2 * inner, bias=bias)
        self.down = nn.Linear(2 * inner, hidden, bias=False)
        self.parallel = parallel
        # the row-parallel projections' biases, replicated, added after their all-reduce
        self.attn_out_bias = nn.Parameter(torch.zeros(hidden))
        self.down_bias = nn.Parameter(torch.zeros(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel == "biased":  # GPT-NeoX's and Phi's: mlp + attn + x, each with its bias
            attn = ar(self.attn_out(torch.tanh(self.attn_in(self.ln1(x))))) + self.attn_out_bias
            mlp = ar(self.down(F.gelu(self.up(self.ln2(x))))) + self.down_bias
            return mlp + attn + x
        if self.parallel:  # Cohere's parallel residual: both norms read the block input
            return (
                x
                + ar(self.attn_out(torch.tanh(self.attn_in(self.ln1(x)))))
                + ar(self.down(F.gelu(self.up(self.ln2(x)))))
            )
        h = x + ar(self.attn_out(torch.tanh(self.attn_in(self.ln1(x)))))
        return h + ar(self.down(F.gelu(self.up(self.ln2(h)))))


class LayerNormDecoder(nn.Module):
    """Two pre-norm blocks and a final LayerNorm: 4 all-reduces, each followed by a residual
    add and a LayerNorm (the final norm reads the last block's output)."""

    def __init__(
        self, hidden: int = 64, inner: int = 32, bias: bool = True, parallel: bool | str = False
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(hidden, inner, bias, parallel) for _ in range(2)])
        self.norm = nn.LayerNorm(hidden, eps=1e-5, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def make_decoder(bias: bool, dtype: torch.dtype, rank: int, parallel: bool | str = False) -> LayerNormDecoder:
    """The same replicated parameters (norms, row-parallel biases) on every rank, rank-local
    projection shards. ``parallel``: Cohere's parallel block (True) or GPT-NeoX's with the
    row-parallel biases (``"biased"``)."""
    torch.manual_seed(0)
    model = LayerNormDecoder(bias=bias, parallel=parallel)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln" in name or name.startswith("norm") or name.endswith("_bias"):
                p.add_(0.1 * torch.randn(p.shape))  # non-trivial weight and bias
        gen = torch.Generator().manual_seed(100 + rank)
        for layer in model.layers:
            for lin in (layer.attn_in, layer.attn_out, layer.up, layer.down):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * lin.weight.shape[1] ** -0.5)
    return model.to(dtype).eval()
