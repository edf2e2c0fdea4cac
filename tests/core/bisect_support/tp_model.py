"""A tensor-parallel target for ``passkit bisect --world-size 2`` (a gloo world): 8
all-reduce -> add residual -> RMSNorm sites, each with its own epsilon, fused by
passkit-fusion's ``allreduce_rmsnorm`` (reference implementation). The site of epsilon
``PLANTED_EPS`` is planted wrong in the reference path: the fused op's reference
computation is off there (the 6th site), so bisect must name that all-reduce.
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from passkit_fusion import reference

EPS = [1.1e-6, 2.2e-6, 3.3e-6, 4.4e-6, 5.5e-6, 6.6e-6, 7.7e-6, 8.8e-6]
PLANTED_EPS = EPS[5]

_right = reference.allreduce_rmsnorm


def _planted(x, residual, weight, eps, weight_bias, group_name):
    norm, total = _right(x, residual, weight, eps, weight_bias, group_name)
    return (norm * 1.5 if eps == PLANTED_EPS else norm), total


reference.allreduce_rmsnorm = _planted


class Block(torch.nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(hidden, hidden) * 0.3) for _ in EPS)
        self.g = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(hidden)) for _ in EPS)

    def forward(self, x):
        group = dist.group.WORLD
        residual = x
        for w, g, eps in zip(self.w, self.g, EPS):
            total = funcol.all_reduce(x @ w, "sum", group) + residual
            residual = total
            h = total.float()
            x = g * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(total.dtype)
        return x


def make():
    return Block(), (torch.randn(4, 16),)
