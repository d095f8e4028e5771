"""The eagle format (SafeAILab/EAGLE, EAGLE-1): config.json is the Llama config of the one-layer draft, as
EAGLE's own exports (architectures LlamaForCausalLM; `bias` for fc), plus the base model and the chain length.
Weights: fc.{weight,bias}, layers.0.* (no input_layernorm), embed_tokens.weight, and lm_head.weight: the
target's, stored so that an export loads and serves without the target's files (EAGLE itself loads
non-strictly and uses the base model's lm_head)."""

from transformers import LlamaConfig

from speculators.formats import Format, Verifier, register_format
from speculators.layers import rope_theta

# Keys of an EAGLE config.json that are not fields of the draft layer's LlamaConfig.
FORMAT_KEYS = ("architectures", "model_type", "bias", "torch_dtype", "dtype", "base_model_name_or_path",
               "num_speculative_tokens")


def write(drafter, verifier: Verifier) -> tuple[dict, dict]:
    config = drafter.layer_cfg.to_dict() | {
        "architectures": ["LlamaForCausalLM"],  # as EAGLE's exports; engines pick their EAGLE model by flag
        "model_type": "llama",
        "num_hidden_layers": len(drafter.layers),
        "vocab_size": len(drafter.t2d),
        "rope_theta": rope_theta(drafter.layer_cfg),  # EAGLE's config class reads it here, not in rope_parameters
        "bias": True,  # fc has a bias (EAGLE's loader reads this key)
        "tie_word_embeddings": False,
        "base_model_name_or_path": verifier.name_or_path,
        "num_speculative_tokens": drafter.depth,
    }
    return config, drafter.state_dict()


def read(config: dict, weights: dict):
    from speculators.eagle import EagleConfig, EagleDrafter

    layer_cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in FORMAT_KEYS})
    return EagleDrafter(EagleConfig(depth=config["num_speculative_tokens"]), layer_cfg), weights


def detect(config: dict) -> bool:
    """The plain one-layer Llama config EAGLE writes, naming its base model as ours do."""
    return (config.get("architectures") == ["LlamaForCausalLM"] and config.get("num_hidden_layers") == 1
            and "base_model_name_or_path" in config)


register_format(Format("eagle", write, read, lambda config: config["base_model_name_or_path"], detect))
