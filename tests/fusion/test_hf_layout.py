"""The layout the coverage run shards a Hugging Face model with
(``passkit_fusion.coverage.layout``): expert parallelism over the TP group exactly where the
model's expert-parallel plan names modules its TP plan leaves out (transformers 5.25's MoE
families, GPT-OSS), ``tp_plan="auto"`` alone where the TP plan shards the experts
(transformers 5.24's) or the model has no experts. Configs only, no world."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from passkit_fusion.coverage.layout import distributed_layout, unsharded_experts  # noqa: E402

EXPERTS_BY_TP = {  # transformers 5.24's Mixtral plan: the experts sharded by TP
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "layers.*.mlp.experts.down_proj": "rowwise",
    "layers.*.mlp.experts": "moe_tp_experts",
}
EP_PLAN = {
    "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
    "layers.*.mlp.experts.down_proj": "grouped_gemm",
    "layers.*.mlp.experts": "ep_dispatch_experts",
}


def _config(tp_plan: dict, ep_plan: dict | None, experts: int = 4):
    config = transformers.MixtralConfig(num_local_experts=experts)
    config.base_model_tp_plan = tp_plan
    config.base_model_ep_plan = ep_plan
    return config


def test_experts_the_tp_plan_shards_keep_tp_plan_auto_alone():
    config = _config(EXPERTS_BY_TP, EP_PLAN)
    assert unsharded_experts(config) == []
    layout = distributed_layout(config, 2)
    assert layout.kwargs == {"tp_plan": "auto", "tp_size": 2} and layout.note is None


def test_experts_the_tp_plan_leaves_out_are_sharded_by_expert_parallelism():
    """transformers 5.25's Mixtral: its TP plan shards attention only."""
    config = _config({"layers.*.self_attn.o_proj": "rowwise"}, EP_PLAN)
    assert unsharded_experts(config) == list(EP_PLAN)
    layout = distributed_layout(config, 2, dp=2)
    assert layout.kwargs == {"tp_plan": "auto", "tp_size": 2, "dp_replicate_size": 2, "ep_size": 2}
    assert layout.note is not None and "experts sharded with ep_size=2" in layout.note
    assert "leaves layers.*.mlp.experts out" in layout.note  # the module, not each of its weights


def test_experts_that_do_not_divide_over_the_ranks_stay_replicated_and_say_so():
    config = _config({"layers.*.self_attn.o_proj": "rowwise"}, EP_PLAN, experts=3)
    layout = distributed_layout(config, 2)
    assert "ep_size" not in layout.kwargs
    assert layout.note is not None and "3 experts do not divide over 2 ranks" in layout.note


def test_a_dense_model_keeps_tp_plan_auto_alone():
    config = transformers.LlamaConfig()
    assert unsharded_experts(config) == []
    assert distributed_layout(config, 2).kwargs == {"tp_plan": "auto", "tp_size": 2}
