"""The dflash format (the original DFlash layout: z-lab/dflash's DFlashDraftModel, SGLang's DFLASH, llama.cpp's
converter `convert_hf_to_gguf.py DRAFT --target-model-dir TARGET`, conversion/qwen.py DFlashModel):
architectures DFlashDraftModel, the draft layers' Qwen3 config (vocab_size the target's), block_size,
num_target_layers and dflash_config {mask_token_id, target_layer_ids}. A target layer id there is the decoder
layer whose output is read, HF hidden_states[i + 1] (the authors' extract_context_feature; the converter writes
i + 1 as the layer llama.cpp takes the input of): ours minus one. Weights fc.weight, hidden_norm.weight,
layers.N.*, norm.weight; the learned mask embedding in mask_embedding.pt {mask_token_id, embedding}, which the
converter writes into row mask_token_id of the target's embeddings. No embed_tokens, lm_head, d2t or t2d:
these engines embed and project with the target's own, over its whole vocabulary. Our lm_head rows are frozen
copies of the target's, so the export drafts what ours does wherever the full-vocabulary argmax lies in the
draft vocabulary; loaded back, it is such a full-vocabulary drafter, filled from the target
(`share_target_embedding`). It does not name its target (serve it with target=...)."""

import torch
from transformers import AutoConfig, LlamaConfig

from common.config import UserError
from speculators import gguf_file
from speculators.formats import Format, Verifier, register_format
from speculators.layers import rope_theta

# Keys of an original DFlash config.json that are not fields of the draft layers' config.
FORMAT_KEYS = ("architectures", "model_type", "block_size", "dflash_config", "num_target_layers", "torch_dtype",
               "dtype")
MASK_FILE = "mask_embedding.pt"  # the original DFlash layout's learned mask embedding


def write(drafter, verifier: Verifier) -> tuple[dict, dict]:
    config = drafter.layer_cfg.to_dict() | {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "num_hidden_layers": len(drafter.layers),
        "vocab_size": len(drafter.t2d),
        "rope_theta": rope_theta(drafter.layer_cfg),
        "block_size": drafter.cfg.block_size,
        "num_target_layers": target_layer_count(verifier.name_or_path),
        "dflash_config": {"mask_token_id": drafter.cfg.mask_token_id,
                          "target_layer_ids": [k - 1 for k in drafter.layer_ids]},
        "tie_word_embeddings": False,
    }
    weights = {name: t for name, t in drafter.state_dict().items()
               if name not in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d")}
    weights[MASK_FILE] = {"mask_token_id": drafter.cfg.mask_token_id,
                          "embedding": drafter.mask_embedding.detach().float().cpu().clone()}
    return config, weights


def read(config: dict, weights: dict):
    """A drafter over the target's whole vocabulary; embed_tokens and lm_head are the target's (load leaves
    them, and the mask embedding when there is no mask_embedding.pt, to share_target_embedding)."""
    from speculators.dflash import DFlashConfig, DFlashDrafter

    dflash = config.get("dflash_config", {})
    if dflash.get("mask_token_id") is None or not dflash.get("target_layer_ids"):
        raise UserError("an original DFlash config.json needs dflash_config.mask_token_id and "
                        "dflash_config.target_layer_ids")
    layer_cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in FORMAT_KEYS})
    V, mask_id = layer_cfg.vocab_size, dflash["mask_token_id"]
    cfg = DFlashConfig(block_size=config["block_size"], num_layers=layer_cfg.num_hidden_layers, draft_vocab_size=V,
                       mask_token_id=mask_id)
    drafter = DFlashDrafter(cfg, layer_cfg, [i + 1 for i in dflash["target_layer_ids"]], layer_cfg.hidden_size)
    weights = dict(weights, d2t=torch.zeros(V, dtype=torch.long), t2d=torch.ones(V, dtype=torch.bool))
    mask = weights.pop(MASK_FILE, None)
    if mask is not None:
        if mask.get("mask_token_id") != mask_id:
            raise UserError(f"{MASK_FILE} is for mask_token_id {mask.get('mask_token_id')}, config.json says {mask_id}")
        weights["mask_embedding"] = mask["embedding"]
    return drafter, weights


def target_layer_count(name_or_path: str) -> int:
    """The target's decoder layers, from its GGUF header or its config.json."""
    if name_or_path.endswith(".gguf"):
        reader = gguf_file.read(gguf_file.locate(name_or_path))
        return gguf_file.field(reader, f"{gguf_file.field(reader, 'general.architecture')}.block_count")
    try:
        return AutoConfig.from_pretrained(name_or_path).get_text_config().num_hidden_layers
    except (OSError, ValueError):
        raise UserError(f"the original DFlash format records the target's layer count, and the config of "
                        f"{name_or_path} cannot be read here; name the target by its local folder or .gguf file") from None


register_format(Format("dflash", write, read, lambda config: None,
                       lambda config: config.get("architectures") == ["DFlashDraftModel"], extra_file=MASK_FILE,
                       left_to_target=("embed_tokens.weight", "lm_head.weight", "mask_embedding")))
