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

import json
from pathlib import Path
from typing import Any

__all__ = ["FAMILIES", "ConfigError", "load_config", "small_config"]

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
}
"""Laptop sizes, applied to the keys a config has (TP=2 and 4 divide every head count)."""
_POSITIVE_ONLY = ("shared_expert_intermediate_size", "shared_intermediate_size", "n_shared_experts")
"""Sizes that switch a feature on: shrunk only where the config has the feature."""
_DERIVED = (
    "layer_types",
    "mlp_layer_types",
    "sliding_window_pattern",
    "quantization_config",
    "torch_dtype",
    "dtype",
)
"""Per-layer lists rebuilt from the new layer count by the config class; quantization
dropped (the weights are random)."""
_SLIDING_WINDOW = 64


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
        except (ValueError, KeyError) as exc:
            raise ConfigError(
                f"{path}: model_type {model_type!r} is not known to transformers "
                f"{transformers.__version__} ({exc})"
            ) from None
        return config.get_text_config()
    cls = getattr(transformers, text, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig)):
        known = ", ".join(FAMILIES)
        raise ConfigError(
            f"{source!r} is neither a config file, a transformers config class (e.g. Qwen3MoeConfig) "
            f"nor a family ({known}){_suggest(text, transformers)}"
        )
    return cls().get_text_config()


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


def small_config(config: Any, layers: int = 2) -> Any:
    """``config`` at laptop sizes, same structure (see the module docstring)."""
    values = {k: v for k, v in config.to_dict().items() if k not in _DERIVED}
    for key, small in _SMALL.items():
        if key in values and not (key in _POSITIVE_ONLY and not values[key]):
            values[key] = small
    for key in _POSITIVE_ONLY:
        if values.get(key):
            values[key] = 1 if key == "n_shared_experts" else 64
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
