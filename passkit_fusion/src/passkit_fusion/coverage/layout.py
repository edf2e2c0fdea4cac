"""How a Hugging Face model is sharded over one tensor-parallel group: the
``DistributedConfig`` arguments the coverage run loads it with.

transformers up to 5.24 shards an MoE block's experts in ``base_model_tp_plan``
(``packed_colwise`` / ``rowwise`` / ``moe_tp_experts``): each rank computes a slice of every
expert and one all-reduce after the block sums them, before the residual add and the next
norm. From 5.25 on the experts are left out of the TP plan (its docs: "experts are not
tensor-parallel"); they are sharded only by the expert-parallel plan
(``base_model_ep_plan``, applied with ``ep_size > 1``). With ``tp_plan="auto"`` alone every
rank then computes every expert, whole: no all-reduce after the experts, nothing to fuse,
and the experts' weights held ``tp`` times. The serving layout on 5.25 is expert parallelism
over the TP group, ``ep_size == tp_size``, whose inference path (``AllReduceEP``) runs each
rank's experts on the batch the ranks share and sums the outputs with one all-reduce: the
site 5.24's TP plan made, in the same place. :func:`distributed_layout` asks for it exactly
when the model's EP plan names modules its TP plan leaves out, so a transformers whose TP
plan still shards the experts (5.24) loads as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Layout", "distributed_layout", "unsharded_experts"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """``DistributedConfig`` keyword arguments and, where they differ from ``tp_plan="auto"``
    alone, a note saying how and why (None otherwise)."""

    kwargs: dict[str, Any]
    note: str | None = None


def unsharded_experts(config: Any) -> list[str]:
    """The modules of ``config``'s expert-parallel plan (``base_model_ep_plan``) that its
    tensor-parallel plan shards neither themselves nor through a parent's rule: what
    ``tp_plan="auto"`` leaves replicated on every rank (empty: none, or no EP plan)."""
    ep_plan = getattr(config, "base_model_ep_plan", None) or {}
    tp_plan = getattr(config, "base_model_tp_plan", None) or {}
    return [key for key in ep_plan if not any(_related(key, rule) for rule in tp_plan)]


def _related(a: str, b: str) -> bool:
    """Whether plan keys ``a`` and ``b`` name the same module, or one a submodule of the other."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def distributed_layout(config: Any, tp: int, dp: int = 1) -> Layout:
    """The ``DistributedConfig`` arguments for ``tp`` ranks (and ``dp`` data-parallel replicas)
    sharding ``config``: ``tp_plan="auto"``, plus ``ep_size=tp`` where :func:`unsharded_experts`
    finds experts the TP plan would replicate and the installed transformers can shard them by
    expert parallelism over the TP group (its ``DistributedConfig`` has ``ep_size``, the expert
    count divides by ``tp``)."""
    import transformers

    kwargs: dict[str, Any] = {"tp_plan": "auto", "tp_size": tp}
    if dp > 1:
        kwargs["dp_replicate_size"] = dp
    left = unsharded_experts(config)
    if not left or tp < 2:
        return Layout(kwargs)
    left = [k for k in left if not any(k.startswith(other + ".") for other in left)]  # not their params
    fields = {f.name for f in dataclasses.fields(transformers.DistributedConfig)}
    experts = _expert_count(config)
    version = transformers.__version__
    if "ep_size" not in fields or (experts is not None and experts % tp):
        why = (
            "its DistributedConfig has no ep_size"
            if "ep_size" not in fields
            else f"{experts} experts do not divide over {tp} ranks"
        )
        return Layout(
            kwargs,
            f"experts replicated on every rank: transformers {version}'s TP plan leaves "
            f"{', '.join(left)} out and {why} (no all-reduce after the experts)",
        )
    kwargs["ep_size"] = tp
    return Layout(
        kwargs,
        f"experts sharded with ep_size={tp} (expert parallelism over the TP group): transformers "
        f"{version}'s TP plan leaves {', '.join(left)} out, which tp_plan='auto' alone replicates",
    )


def _expert_count(config: Any) -> int | None:
    for name in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
