"""Hugging Face configs for the coverage report: reading a user's config (a ``config.json``
path, a folder holding one, or a config class name such as ``Qwen3MoeConfig``) and
shrinking it to a laptop-sized architecture with the same structure.

Only sizes change (hidden, heads, experts, layers, vocabulary, LoRA ranks of MLA...):
everything that decides the graph's shape around the all-reduces (norm kinds, residual and
embedding multipliers, shared experts, sliding windows, dense-then-MoE layer layouts) is
kept from the config. The families of ``benchmarks/coverage.py`` are listed in
:data:`FAMILIES`; any other config works the same way.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

from passkit.errors import cut_repr, suggest

__all__ = ["FAMILIES", "ConfigError", "load_config", "small_config", "tp_families"]

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # family: (config class, what the family's checkpoints set that the defaults do not)
    "Llama": ("LlamaConfig", {}),
    "Qwen2": ("Qwen2Config", {}),
    "Qwen3": ("Qwen3Config", {}),
    "Mistral": ("MistralConfig", {}),
    "Gemma 2": ("Gemma2Config", {}),
    "Gemma 3": ("Gemma3TextConfig", {}),
    "Granite": ("GraniteConfig", {"residual_multiplier": 0.22, "embedding_multiplier": 12.0}),
    "Phi-3": ("Phi3Config", {}),
    "Mixtral": ("MixtralConfig", {}),
    "Qwen3-MoE": ("Qwen3MoeConfig", {}),
    "Qwen2-MoE": ("Qwen2MoeConfig", {}),
    "Granite-MoE": ("GraniteMoeConfig", {"residual_multiplier": 0.22, "embedding_multiplier": 12.0}),
    "DeepSeek-V3": ("DeepseekV3Config", {}),
    "gpt-oss": ("GptOssConfig", {}),
}
"""The families ``benchmarks/coverage.py`` runs (Granite's multipliers are Granite 3.x's:
the defaults are 1.0)."""

_SMALL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "qk_head_dim": 16,
    "query_pre_attn_scalar": 16,
    "max_window_layers": 2,
    "num_nextn_predict_layers": 0,
    "num_expert_group": 1,
    "vocab_size_per_layer_input": 256,
    "hidden_size_per_layer_input": 16,
}
"""Laptop sizes, applied to the keys a config has (TP=2 and 4 divide every head count)."""
_POSITIVE_ONLY = ("shared_expert_intermediate_size", "shared_intermediate_size", "n_shared_experts")
"""Sizes that switch a feature on: shrunk only where the config has the feature."""
_DERIVED = (
    "quantization_config",
    "torch_dtype",
    "dtype",
)
"""Quantization dropped (the weights are random)."""
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "top_k_experts", "moe_topk", "moe_k")
"""Experts per token: at most :data:`_SMALL_EXPERTS` / 2 once the experts are shrunk."""
_SMALL_EXPERTS = 4
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")
_SLIDING_WINDOW = 64
_DEFAULT_ROPE: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
"""A layer type's RoPE where the config has none (see :func:`_rope_per_layer_type`)."""
_UNSET_DEFAULTS: dict[str, dict[str, Any]] = {
    # model_type: {key: small value}, only where the config leaves the key None
    # Lfm2MoeConfig's layer_types default to None, which its model indexes per layer (the
    # checkpoints set it: short convolutions with an attention layer every few layers).
    "lfm2_moe": {"layer_types": lambda n: ["full_attention" if i % 4 == 2 else "conv" for i in range(n)]},
    # Qwen4ExpTextConfig's QSA indexer sizes default to None, yet its "indexed_attention"
    # layers (the default layer_types) build the indexer from them: one key head (required),
    # blocks of 2 tokens, 4 tokens kept per query.
    "qwen4_exp_text": {
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 4,
        "indexer_compress_ratio": 2,
    },
}
"""Values a family's default config leaves None although its model requires them (a
checkpoint's config.json sets them): filled with small ones, said per family."""


class ConfigError(ValueError):
    """A config the coverage report cannot build (the message names the problem)."""


def load_config(source: str | Path) -> Any:
    """A ``PretrainedConfig`` from a config class name (``"Qwen3MoeConfig"``), a family of
    :data:`FAMILIES` (``"Qwen3-MoE"``), a ``config.json`` path or a folder holding one.
    Multimodal configs give their text model's config."""
    import transformers

    text = str(source)
    if text in FAMILIES:
        name, extra = FAMILIES[text]
        return getattr(transformers, name)(**extra)
    path = Path(text)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{source}: a folder with no config.json in it")
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ConfigError(f"{source}: no such config file")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        model_type = data.get("model_type")
        if not model_type:
            raise ConfigError(f"{path}: no 'model_type' key (is it a Hugging Face config.json?)")
        try:
            config = transformers.AutoConfig.for_model(**data)
        except (ValueError, KeyError):
            # (transformers' own message lists every model_type it knows: 2,000 characters)
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

            raise ConfigError(
                f"{path}: model_type {cut_repr(model_type)} is not known to transformers "
                f"{transformers.__version__}{suggest(str(model_type), CONFIG_MAPPING_NAMES)}"
            ) from None
        return config.get_text_config()
    cls = getattr(transformers, text, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig)):
        cls = _config_class(text)
    if cls is None:
        known = ", ".join(FAMILIES)
        raise ConfigError(
            f"{source!r} is neither a config file, a transformers config class (e.g. Qwen3MoeConfig), "
            f"a model_type (glm4_moe) nor a family ({known}; any transformers family name works: Glm4Moe)"
            f"{_suggest(text, transformers)}"
        )
    extra = next(
        (e for f, (name, e) in FAMILIES.items() if name == cls.__name__ and _key(f) == _key(text)), {}
    )
    return cls(**extra).get_text_config()


def _key(name: str) -> str:
    """A name compared loosely: ``Glm4-MoE``, ``glm4_moe``, ``Glm4Moe``, ``Glm4MoeConfig``."""
    return re.sub(r"[^a-z0-9]", "", name.lower()).removesuffix("config")


def _config_class(name: str) -> Any:
    """The config class of a family named loosely (:func:`_key`): a family of
    :data:`FAMILIES`, a ``model_type`` or a config class name of the installed transformers."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    key = _key(name)
    for family, (cls_name, _) in FAMILIES.items():
        if _key(family) == key:
            return getattr(transformers, cls_name)
    for model_type, cls_name in CONFIG_MAPPING_NAMES.items():
        if key in (_key(model_type), _key(cls_name)):
            try:
                from transformers.models.auto.configuration_auto import CONFIG_MAPPING

                return CONFIG_MAPPING[model_type]
            except (KeyError, ImportError, AttributeError):
                return None
    return None


def tp_families() -> dict[str, str]:
    """``model_type -> config class name`` of every causal LM the installed transformers has a
    tensor-parallel plan for (``base_model_tp_plan``): what ``benchmarks/coverage.py --all``
    runs."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out: dict[str, str] = {}
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            cls = CONFIG_MAPPING[model_type]
            if getattr(cls, "base_model_tp_plan", None):
                out[model_type] = cls.__name__
        except Exception:  # a model this transformers cannot import
            continue
    return out


def _suggest(text: str, transformers: Any) -> str:
    """``"; did you mean 'Llama' or 'LlamaConfig'?"`` for a name close to a family or a config
    class of the installed transformers, else ``""``."""
    import difflib

    if len(text) > 100:
        return ""
    classes = [n for n in dir(transformers) if n.endswith("Config") and n != "PretrainedConfig"]
    close = difflib.get_close_matches(text, [*FAMILIES, *classes], n=2, cutoff=0.75)
    close += [
        c for c in difflib.get_close_matches(text + "Config", classes, n=1, cutoff=0.75) if c not in close
    ]
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def small_config(config: Any, layers: int = 2, hidden: int | None = None) -> Any:
    """``config`` at laptop sizes, same structure (see the module docstring).

    ``hidden``: the residual stream that wide instead (``4096`` for the GPU kernels at a
    serving size): the MLPs and experts widen with it (2x and 1x ``hidden``), attention
    keeps its small heads where the config names a head dim, else gets 128-wide heads.

    Per-layer settings follow the layers kept (:func:`_keep_layers`: the first layer of each
    kind, then the first ones): lists with one entry per layer (``layer_types``,
    ``mlp_layer_types``, Llama-4's ``no_rope_layers``, Gemma-3n's per-layer
    ``intermediate_size``...) are cut to them, lists of layer indices (``moe_layers``) and
    dicts keyed by layer index (Gemma-4's ``per_layer_config``) renumbered; routing sizes
    (experts per token, expert groups) are kept within the shrunk expert count. What a
    family's default config leaves None or empty although its model needs it gets a small
    value: routing sizes of an MoE config (Dots1, DeepSeek-V2), one RoPE per layer type
    (Cohere-Compass), and per family :data:`_UNSET_DEFAULTS` (LFM2-MoE, Qwen4-Exp). A recurrent
    stack (HRM: a stack of layers run several cycles) runs one layer ``layers`` times."""
    values = {k: v for k, v in config.to_dict().items() if k not in _DERIVED}
    full = values.get("num_hidden_layers")
    for key, small in _UNSET_DEFAULTS.get(values.get("model_type", ""), {}).items():
        if values.get(key) is None:
            values[key] = small(full) if callable(small) else small
    if isinstance(full, int) and full > 0:
        _per_layer(values, full, _keep_layers(values, full, layers))
    sizes = _sizes(hidden, values)
    for key, small in sizes.items():
        if key not in values or (key in _POSITIVE_ONLY and not values[key]):
            continue
        routing = key in (*_EXPERTS, *_TOP_K, "moe_intermediate_size")
        if values[key] is None and routing and not _has_experts(values):
            continue  # no experts (Gemma-4's dense models): stays so
        # (an MoE config leaving a routing size None, Dots1's expert count and experts per
        # token, DeepSeek-V2's experts per token: its model needs one, so the small one;
        # experts per token halved below)
        current = values[key]
        if isinstance(current, list):  # one size per layer (Gemma-3n's intermediate_size)
            values[key] = [small] * len(current)
        elif not isinstance(current, bool):
            values[key] = small
    for key in _TOP_K:
        if isinstance(values.get(key), int) and values[key] > _SMALL_EXPERTS // 2:
            values[key] = _SMALL_EXPERTS // 2
    if any(isinstance(values.get(k), int) for k in _EXPERTS) and isinstance(values.get("topk_group"), int):
        values["topk_group"] = 1  # with one expert group
    for key, value in list(values.items()):  # per-layer head counts (Laguna)
        if key.endswith("heads_per_layer") and isinstance(value, list):
            values[key] = [sizes["num_attention_heads"]] * len(value)
    _fit_head_dim_splits(values)
    if isinstance(values.get("mamba_d_head"), int) and isinstance(values.get("mamba_n_heads"), int):
        inner = int(values.get("mamba_expand") or 2) * values["hidden_size"]  # Mamba heads fill it
        values["mamba_d_head"] = 16
        values["mamba_n_heads"] = inner // 16
    if isinstance(values.get("num_kv_shared_layers"), int) and values["num_kv_shared_layers"]:
        values["num_kv_shared_layers"] = values["num_kv_shared_layers"] * layers // full  # type: ignore[operator]
    for key in _POSITIVE_ONLY:
        if values.get(key):
            values[key] = 1 if key == "n_shared_experts" else 64
    if "n_shared_experts" in values and values["n_shared_experts"] is None and _has_experts(values):
        # None in an MoE config (Dots1's default): every model reading it multiplies its
        # shared expert's size by it, so one shared expert
        values["n_shared_experts"] = 1
    if isinstance(values.get("num_layers_per_stack"), int) and isinstance(values.get("L_cycles"), int):
        # a recurrent stack (HRM): the decoder runs num_layers_per_stack layers
        # H_cycles * (L_cycles + 1) times (128 layers unrolled at its defaults): one layer, one
        # high-level cycle of ``layers - 1`` low-level cycles and the high-level step
        values["num_layers_per_stack"] = 1
        values["H_cycles"] = 1
        values["L_cycles"] = max(1, layers - 1)
        values["L_bp_cycles"] = [1]
    if isinstance(values.get("num_dense_layers"), int) and values["num_dense_layers"] > 1:
        values["num_dense_layers"] = 1  # dense-then-MoE kept at small sizes (first_k_dense_replace's 1)
    _rope_per_layer_type(values)
    if "qk_rope_head_dim" in values:  # MLA (DeepSeek): head_dim is the rotary part, no GQA
        values["head_dim"] = values["qk_rope_head_dim"]
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values.get("sliding_window"):
        values["sliding_window"] = _SLIDING_WINDOW
    values["num_hidden_layers"] = layers
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # inside the small vocabulary
        token = values.get(key)
        if isinstance(token, int) and token >= values.get("vocab_size", _SMALL["vocab_size"]):
            values[key] = 0
        elif isinstance(token, list):
            values[key] = [t if t < _SMALL["vocab_size"] else 0 for t in token]
    values.pop("architectures", None)
    values.pop("auto_map", None)
    return type(config)(**values)


def _sizes(hidden: int | None, values: dict[str, Any]) -> dict[str, Any]:
    """:data:`_SMALL`, or with a ``hidden``-wide residual stream (see :func:`small_config`)."""
    if hidden is None:
        return _SMALL
    if hidden % 128:
        raise ValueError(f"hidden must be a multiple of 128 (got {hidden})")
    sizes = {
        **_SMALL,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "moe_intermediate_size": hidden,
        "shared_expert_intermediate_size": hidden,
    }
    if values.get("head_dim") is None:  # head dim = hidden / heads: 128-wide heads, 4 per KV head
        sizes["num_attention_heads"] = hidden // 128
        sizes["num_key_value_heads"] = max(2, hidden // 512)
    return sizes


def _has_experts(values: dict[str, Any]) -> bool:
    """An MoE config: an expert count or an expert size is set."""
    return any(isinstance(values.get(k), int) and values[k] > 0 for k in (*_EXPERTS, "moe_intermediate_size"))


def _rope_per_layer_type(values: dict[str, Any]) -> None:
    """An empty ``rope_parameters`` in a config with ``layer_types``
    (CohereCompassTextConfig's default, whose model reads ``rope_parameters[layer_type]`` for
    every layer type: a checkpoint sets one per type): :data:`_DEFAULT_ROPE` for each layer
    type kept. RoPE parameters the config has, plain or per layer type, are left alone (a
    layer type without an entry may be NoPE)."""
    rope, types = values.get("rope_parameters"), values.get("layer_types")
    if rope == {} and isinstance(types, list) and all(isinstance(t, str) for t in types):
        values["rope_parameters"] = {t: dict(_DEFAULT_ROPE) for t in dict.fromkeys(types)}


def _fit_head_dim_splits(values: dict[str, Any]) -> None:
    """Multimodal RoPE's ``mrope_section`` (three sections summing to half the head dim),
    rescaled to the small head dim."""
    rope = values.get("rope_parameters") or values.get("rope_scaling")
    section = rope.get("mrope_section") if isinstance(rope, dict) else None
    head_dim = values.get("head_dim")
    if not (isinstance(section, list) and section and isinstance(head_dim, int)):
        return
    half, total = head_dim // 2, sum(section)
    scaled = [max(1, s * half // total) for s in section]
    scaled[0] += half - sum(scaled)
    rope["mrope_section"] = scaled  # type: ignore[index]


def _layer_lists(values: dict[str, Any], full: int) -> dict[str, list[Any]]:
    """The settings with one entry per layer (lists of ``full`` entries that are not lists of
    layer indices)."""
    return {
        k: v
        for k, v in values.items()
        if isinstance(v, list) and len(v) == full and not _is_index_list(v, full)
    }


def _is_index_list(value: list[Any], full: int) -> bool:
    """Layer indices: strictly increasing ints below ``full`` (``moe_layers``)."""
    ints = all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    return ints and all(0 <= i < full for i in value) and all(a < b for a, b in itertools.pairwise(value))


def _keep_layers(values: dict[str, Any], full: int, layers: int) -> list[int]:
    """Which of the ``full`` layers the small model keeps: the first layer of each kind (the
    tuple of its per-layer settings and index-list memberships), then the first others,
    in order; ``layers`` of them (all of them when ``layers >= full``)."""
    if layers >= full:
        return list(range(full)) + [full - 1] * (layers - full)
    per_layer = _layer_lists(values, full)
    index_lists = [set(v) for k, v in values.items() if isinstance(v, list) and v and _is_index_list(v, full)]
    kinds: dict[Any, int] = {}
    for i in range(full):
        kind = (tuple(repr(v[i]) for v in per_layer.values()), tuple(i in s for s in index_lists))
        kinds.setdefault(kind, i)
    keep = sorted(kinds.values())[:layers]
    for i in range(full):
        if len(keep) >= layers:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def _per_layer(values: dict[str, Any], full: int, keep: list[int]) -> None:
    """Cut the per-layer settings of ``values`` to the layers ``keep`` (see :func:`small_config`)."""
    for key, value in list(values.items()):
        if isinstance(value, list) and value and _is_index_list(value, full) and len(value) < full:
            present = set(value)
            values[key] = [j for j, i in enumerate(keep) if i in present]
        elif isinstance(value, list) and len(value) == full:
            if _is_index_list(value, full) and value == list(range(full)):
                values[key] = list(range(len(keep)))  # every layer (Llama-4's moe_layers)
            else:
                values[key] = [value[i] for i in keep]
        elif isinstance(value, dict) and value and all(isinstance(k, str) and k.isdigit() for k in value):
            width = len(next(iter(value)))
            if all(int(k) < full for k in value):
                values[key] = {
                    str(j).zfill(width): value[k]
                    for j, i in enumerate(keep)
                    if (k := str(i).zfill(width)) in value
                }
