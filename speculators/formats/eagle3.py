"""The eagle3 format (the original EAGLE-3 layout, SGLang): architectures LlamaForCausalLMEagle3, the draft
layer's Llama config with draft_vocab_size, target_hidden_size and eagle_config
{eagle_aux_hidden_state_layer_ids, use_aux_hidden_state}; weights as the speculators format with `midlayer.*`
for `layers.0.*`. It does not name the target (serve it with target=...), has no norm_before_residual=true,
and SGLang and vLLM share the target's embeddings when it has none."""

from transformers import LlamaConfig

from common.config import UserError
from speculators import draft_vocab
from speculators.formats import Format, Verifier, register_format
from speculators.layers import rope_theta

# Keys of an original EAGLE-3 config.json that are not fields of the draft layer's LlamaConfig.
FORMAT_KEYS = ("architectures", "model_type", "draft_vocab_size", "target_hidden_size", "eagle_config",
               "norm_before_residual", "num_speculative_tokens", "torch_dtype", "dtype")


def write(drafter, verifier: Verifier) -> tuple[dict, dict]:
    """The original EAGLE-3 layout SGLang (and vLLM) load: the decoder layer is `midlayer`."""
    if drafter.cfg.norm_before_residual:
        raise UserError("the original EAGLE-3 format has no norm_before_residual=true (SGLang would silently "
                        "compute the other residual); export this drafter in the speculators format")
    if drafter.eagle31_flags:
        raise UserError(f"the original EAGLE-3 format has no {', '.join(drafter.eagle31_flags)} (EAGLE-3.1); export "
                        f"this drafter in the speculators format")
    draft_vocab.check(drafter.d2t, drafter.t2d, len(drafter.t2d), drafter.cfg.draft_vocab_size)
    config = drafter.layer_cfg.to_dict() | {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "vocab_size": len(drafter.t2d),
        "rope_theta": rope_theta(drafter.layer_cfg),
        "draft_vocab_size": drafter.cfg.draft_vocab_size,
        "target_hidden_size": drafter.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": drafter.layer_ids, "use_aux_hidden_state": True},
        "norm_before_residual": False,
        "num_speculative_tokens": drafter.depth,
        "tie_word_embeddings": False,
    }
    weights = {name.replace("layers.0.", "midlayer.", 1): t for name, t in drafter.state_dict().items()}
    return config, weights


def read(config: dict, weights: dict):
    from speculators.eagle3 import Eagle3Config, Eagle3Drafter

    layer_cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in FORMAT_KEYS})
    draft_vocab.check(weights.get("d2t"), weights.get("t2d"), layer_cfg.vocab_size, config["draft_vocab_size"])
    cfg = Eagle3Config(depth=config.get("num_speculative_tokens", 5),
                       draft_vocab_size=config["draft_vocab_size"], intermediate_size=layer_cfg.intermediate_size,
                       norm_before_residual=config.get("norm_before_residual", False))
    drafter = Eagle3Drafter(cfg, layer_cfg, config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
                            config["target_hidden_size"])
    return drafter, {name.replace("midlayer.", "layers.0.", 1): t for name, t in weights.items()}


def detect(config: dict) -> bool:
    """LlamaForCausalLMEagle3 without ModelOpt's key (that is the trtllm format)."""
    return (config.get("architectures") == ["LlamaForCausalLMEagle3"]
            and "next_layer_regular" not in (config.get("eagle_config") or {}))


register_format(Format("eagle3", write, read, lambda config: None, detect, left_to_target=("embed_tokens.weight",)))
