"""A small Llama-style decoder (random weights) for the demo and the tests, shardable for
tensor parallelism in two ways:

* :func:`shard_functional` slices the weights of each rank by hand and makes the model call
  ``torch.distributed._functional_collectives.all_reduce`` after the row-parallel layers
  (the vocabulary-parallel embedding, the attention output and the MLP down projections):
  plain functional collectives, as serving engines write them.
* :func:`shard_dtensor` applies torch's tensor-parallel API (``parallelize_module`` with
  ``ColwiseParallel`` / ``RowwiseParallel``) on a device mesh: DTensor emits the same
  all-reduces.

Either way every decoder layer has the sites ``allreduce_rmsnorm`` fuses: the all-reduce of
the attention output, the residual add and the post-attention norm; the all-reduce of the MLP
output, the residual add and the next layer's input norm (the final norm after the last
layer); and, first of all, the embedding's all-reduce feeding the first input norm with no
residual add before it (its result becomes the first residual).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes of :class:`TinyLlama`. Defaults are tiny so that a CPU compile is quick."""

    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def sites(self) -> int:
        """All-reduce + RMSNorm sites when sharded: the embedding, then 2 per layer."""
        return 1 + 2 * self.layers


class RMSNorm(nn.Module):
    """RMSNorm as Llama's reference code writes it: in fp32, downcast, then the weight."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings (no KV cache).

    Head counts are inferred from the projections' output sizes, so the same code runs on
    full weights and on a tensor-parallel shard of the heads.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RowParallelReduce:
    """Sums a row-parallel layer's partial result over the tensor-parallel group with a
    functional all-reduce; the identity while ``group`` is ``None`` (unsharded, or sharded
    with DTensor, which inserts its own all-reduces)."""

    def __init__(self) -> None:
        self.group: Any = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return x
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(x, "sum", self.group)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, reduce: RowParallelReduce):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.mlp = MLP(cfg)
        self.reduce = reduce

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.reduce(self.self_attn(self.input_layernorm(x), cos, sin))
        return h + self.reduce(self.mlp(self.post_attention_layernorm(h)))


class TinyLlama(nn.Module):
    """Embedding, ``cfg.layers`` pre-norm decoder layers, final norm; returns hidden states.

    Args:
        cfg: the sizes.
        seed: the weights are ``torch.randn`` draws from this seed (norm weights around 1),
            so every rank builds the same full model before taking its shard.
    """

    inv_freq: torch.Tensor

    def __init__(self, cfg: LlamaConfig = LlamaConfig(), seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.reduce = RowParallelReduce()
        """The row-parallel all-reduce; :func:`shard_functional` sets its group."""
        self.vocab_range = (0, cfg.vocab)
        """Token ids this rank's embedding shard holds."""
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.reduce) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._init_weights(seed)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        gen: torch.Generator | None = None
        for name, p in self.named_parameters():
            gen = gen or torch.Generator(device=p.device).manual_seed(seed)
            noise = torch.randn(p.shape, generator=gen, device=p.device)
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        start, end = self.vocab_range
        if (start, end) == (0, self.cfg.vocab):
            return self.embed_tokens(ids)
        outside = (ids < start) | (ids >= end)
        local = self.embed_tokens((ids - start).masked_fill(outside, 0))
        return self.reduce(local.masked_fill(outside.unsqueeze(-1), 0.0))

    def rotary(self, seq: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(seq, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        cos, sin = self.rotary(ids.shape[1], x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


# ---------------------------------------------------------------------------------------
# tensor parallelism

_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")


def _check_divisible(cfg: LlamaConfig, world_size: int) -> None:
    for what, n in (("kv_heads", cfg.kv_heads), ("intermediate", cfg.intermediate), ("vocab", cfg.vocab)):
        if n % world_size:
            raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {world_size}")


@torch.no_grad()
def shard_functional(model: TinyLlama, group: Any, rank: int, world_size: int) -> TinyLlama:
    """Keep this rank's shard of every parallel weight (in place) and all-reduce with
    functional collectives on ``group``. Column-parallel layers keep a slice of their output
    rows, row-parallel ones a slice of their input columns; the embedding keeps a slice of
    the vocabulary."""
    _check_divisible(model.cfg, world_size)
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _COLUMN_PARALLEL:
            module.weight = nn.Parameter(module.weight.chunk(world_size, dim=0)[rank].clone())
        elif leaf in _ROW_PARALLEL:
            module.weight = nn.Parameter(module.weight.chunk(world_size, dim=1)[rank].clone())
    per_rank = model.cfg.vocab // world_size
    model.vocab_range = (rank * per_rank, (rank + 1) * per_rank)
    emb = model.embed_tokens
    emb.weight = nn.Parameter(emb.weight[rank * per_rank : (rank + 1) * per_rank].clone())
    model.reduce.group = group
    return model


def shard_dtensor(model: TinyLlama, mesh: Any) -> TinyLlama:
    """Parallelise ``model`` (unsharded) on a 1-D device mesh with torch's tensor-parallel
    API; DTensor inserts the all-reduces (the model's own ``reduce`` stays a no-op)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    _check_divisible(model.cfg, mesh.size())
    plan: dict[str, Any] = {"embed_tokens": RowwiseParallel(input_layouts=Replicate())}
    for i in range(model.cfg.layers):
        plan.update({f"layers.{i}.self_attn.{p}": ColwiseParallel() for p in _COLUMN_PARALLEL[:3]})
        plan.update({f"layers.{i}.mlp.{p}": ColwiseParallel() for p in _COLUMN_PARALLEL[3:]})
        plan.update(
            {
                f"layers.{i}.{m}.{p}": RowwiseParallel()
                for m, p in (("self_attn", "o_proj"), ("mlp", "down_proj"))
            }
        )
    parallelize_module(model, mesh, plan)
    return model


def tuning_target(rank: int, world_size: int, device: str = "cpu") -> Any:
    """A :class:`~passkit_fusion.tuning.measure.Target` for ``passkit tune-model``: a
    one-layer :class:`TinyLlama` sharded over the world (gloo's default group), with the
    three fusion passes (reference op and test-mode async TP off CUDA)::

        passkit tune-model passkit_fusion.model:tuning_target --cpu --world-size 2
    """
    import torch.distributed as dist

    from .tuning.measure import Target

    cfg = LlamaConfig(layers=1, kv_heads=max(2, world_size))
    model = shard_functional(TinyLlama(cfg).eval().to(device), dist.group.WORLD, rank, world_size)
    cuda = device == "cuda"

    def inputs(tokens: int) -> tuple[torch.Tensor]:
        gen = torch.Generator().manual_seed(tokens)
        return (torch.randint(0, cfg.vocab, (1, tokens), generator=gen).to(device),)

    passes = [
        {"name": "sequence_parallel"},
        {"name": "async_tp", "implementation": "auto" if cuda else "test_mode"},
        {"name": "allreduce_rmsnorm", "implementation": "auto" if cuda else "reference"},
        "cleanup",
    ]
    return Target(model, inputs, passes, lambda args: torch._dynamo.mark_dynamic(args[0], 1))
