"""The trtllm format (`trtllm-serve TARGET --config OUT/trtllm_serving.yaml`): EAGLE-3 drafters in the layout
TensorRT-LLM's PyTorch backend serves, as NVIDIA ModelOpt exports it (modelopt/torch/export/plugins/
hf_spec_export.py, EagleExporter, with the llama_eagle_template_config of hf_spec_configs.py):

- config.json: that template's keys in its order, filled from the draft layer's Llama config (vocab_size
  the target's, draft_vocab_size ours), rope_scaling the layer's rope parameters, and an eagle_config dict
  with ModelOpt's EAGLE-3 settings. TensorRT-LLM loads a draft config with draft_vocab_size as EAGLE-3
  (LlamaForCausalLMEagle3 -> EAGLE3LlamaForCausalLM).
- model.safetensors: layers.0.* (ModelOpt's names; TensorRT-LLM also reads midlayer.*), fc.weight,
  norm.weight, lm_head.weight, and d2t (int64 offsets, as ours) when the draft vocabulary is reduced.
  No embeddings (TensorRT-LLM takes the target's; ours are a frozen copy) and no t2d (ModelOpt writes
  none; it is rebuilt from d2t when read back).
- trtllm_serving.yaml beside them: the speculative_config for `trtllm-serve --config`. TensorRT-LLM takes
  the capture layers from there, numbered "output of layer i" (HF hidden_states[i + 1]): ours minus one,
  as ModelOpt's eagle_aux_hidden_state_layer_ids are (its default {1, L//2-1, L-4} is our [2, L//2, L-3]).

ModelOpt's layout has no place for the EAGLE-3.1 options, norm_before_residual, or a drafter narrower than
its target (fc is len(layers) * hidden_size wide): those are refused, as are other families.

DFlash and DSpark drafters are written as ModelOpt's DFlashExporter / DSparkExporter write them
(hf_spec_export.py; the z-lab layout TensorRT-LLM's DFlash / DSpark read, decoding_type DFlash / DSpark):

- config.json: DFlashExporter._export_config's keys in its order, model_type qwen3, vocab_size the target's,
  num_target_layers the target's layer count, dflash_config {mask_token_id, target_layer_ids (ours minus one,
  "output of layer i"), causal: false}, and for DSpark projector_type dspark, shift_label true (the anchor's
  slot drafts, as ours), markov_rank, markov_head_type, use_confidence_head true.
- model.safetensors: ModelOpt's dflash_module names without the prefix: fc, hidden_norm, layers.N.*, norm, and
  for DSpark the flat heads markov_w1 [V, r], markov_w2 [V, r], gate_proj / joint_proj, confidence_proj
  (ours nest them under markov_head. / confidence_head.proj). No embed_tokens, lm_head, d2t or t2d: TensorRT-LLM
  embeds and projects with the target's own over its whole vocabulary. Our lm_head rows are frozen copies of the
  target's, and markov_w2 gets zero rows outside the draft vocabulary, so the export drafts what ours does
  wherever the full-vocabulary argmax lies in the draft vocabulary.
- The mask token is embedded with the target's row mask_token_id: a drafter whose learned mask embedding has
  moved off that row is refused (TensorRT-LLM would draft from another input), as is a confidence head without
  W1[previous token] (ModelOpt's confidence_proj reads [hidden, W1[x]]) and a target layer id 0 (the
  embeddings, which "output of layer i" cannot name).
- trtllm_serving.yaml: decoding_type DFlash / DSpark, max_draft_len, speculative_model, mask_token_id and
  target_layer_ids (the values config.json holds); for DSpark with sts.json / sps.json beside the source export,
  copies of them here and enable_confidence_scheduling with confidence_sts_path / confidence_sps_table_path.
"""

import json
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, LlamaConfig

from common.config import UserError
from speculators import draft_vocab
from speculators.formats import Format, register_format
from speculators.formats.dflash import target_layer_count
from speculators.layers import rope_theta

SERVING_FILE = "trtllm_serving.yaml"
# ModelOpt's EAGLE-3 settings for a drafter like ours: aux features through fc, input_layernorm on the
# first layer, a final norm, no MTP norm, one regular draft layer, no parallel drafting.
MODELOPT_EAGLE3_SETTINGS = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                            "use_last_layernorm": True, "use_mtp_layernorm": False, "next_layer_regular": True,
                            "parallel_draft_step": 1, "parallel_draft_heads_num_layers": 1}
# Keys of this config.json that are not fields of the draft layer's LlamaConfig.
FORMAT_KEYS = ("architectures", "model_type", "draft_vocab_size", "eagle_config", "rope_scaling", "rope_theta",
               "torch_dtype", "dtype", "transformers_version")


BLOCK_FAMILIES = {"dflash": "DFlash", "dspark": "DSpark"}  # our family -> TensorRT-LLM's decoding_type
STS_FILE, SPS_FILE = "sts.json", "sps.json"  # DSpark's confidence calibration and step costs, beside an export


def write(drafter, verifier) -> tuple[dict, dict]:
    if drafter.family in BLOCK_FAMILIES:
        check_block_holds(drafter)
        return block_config_of(drafter, target_values(drafter, verifier.name_or_path)), block_weights_of(drafter)
    check_holds(drafter)
    draft_vocab.check(drafter.d2t, drafter.t2d, len(drafter.t2d), drafter.cfg.draft_vocab_size)
    return config_of(drafter), weights_of(drafter)


def check_holds(drafter) -> None:
    """Refuse what ModelOpt's layout cannot say: TensorRT-LLM would load it and compute something else."""
    if drafter.cfg.norm_before_residual:
        raise UserError("the trtllm format has no norm_before_residual=true; export this drafter in the speculators format")
    if drafter.eagle31_flags:
        raise UserError(f"the trtllm format has no {', '.join(drafter.eagle31_flags)} (EAGLE-3.1); export this "
                        f"drafter in the speculators format")
    if drafter.target_hidden_size != drafter.layer_cfg.hidden_size:
        raise UserError(f"the trtllm format needs the drafter as wide as its target (hidden {drafter.layer_cfg.hidden_size}"
                        f" vs the target's {drafter.target_hidden_size}); export it in the speculators format")


def config_of(drafter) -> dict:
    """ModelOpt's llama_eagle_template_config, key for key, filled for this drafter."""
    layer = drafter.layer_cfg
    theta = rope_theta(layer)
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": layer.bos_token_id,
        "eos_token_id": layer.eos_token_id,
        "hidden_act": layer.hidden_act,
        "hidden_size": layer.hidden_size,
        "initializer_range": layer.initializer_range,
        "intermediate_size": layer.intermediate_size,
        "max_position_embeddings": layer.max_position_embeddings,
        "model_type": "llama",
        "num_attention_heads": layer.num_attention_heads,
        "num_key_value_heads": layer.num_key_value_heads,
        "num_hidden_layers": 1,
        "pad_token_id": layer.pad_token_id,
        "rms_norm_eps": layer.rms_norm_eps,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",  # save() records the stored dtype
        "transformers_version": transformers.__version__,  # the writer's, as save_pretrained records it
        "use_cache": True,
        "vocab_size": len(drafter.t2d),
        "draft_vocab_size": drafter.cfg.draft_vocab_size,
        "rope_scaling": rope_scaling(layer, theta),
        "attention_bias": layer.attention_bias,
        "attention_dropout": layer.attention_dropout,
        "head_dim": layer.head_dim,
        "mlp_bias": layer.mlp_bias,
        "pretraining_tp": getattr(layer, "pretraining_tp", 1),
        "rope_theta": theta,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": capture_layers(drafter.layer_ids),
                         **MODELOPT_EAGLE3_SETTINGS},
    }


def rope_scaling(layer: LlamaConfig, theta: float) -> dict:
    """The layer's rope parameters, rope_theta included (transformers 5 reads it there, 4 at the top)."""
    params = dict(getattr(layer, "rope_parameters", None) or getattr(layer, "rope_scaling", None) or {})
    return {"rope_type": params.pop("rope_type", "default"), **params, "rope_theta": theta}


def capture_layers(layer_ids: list[int]) -> list[int]:
    """Our layer id k (HF hidden_states[k], the input of layer k) as "output of layer k - 1"."""
    return [k - 1 for k in layer_ids]


def weights_of(drafter) -> dict:
    weights = {name: t for name, t in drafter.state_dict().items() if name not in ("embed_tokens.weight", "t2d")}
    if drafter.cfg.draft_vocab_size == len(drafter.t2d):
        weights.pop("d2t")  # ModelOpt has a d2t only for a reduced draft vocabulary
    return weights


def check_block_holds(drafter) -> None:
    """Refuse the DFlash / DSpark drafters TensorRT-LLM would load and compute something else with."""
    if 0 in drafter.layer_ids:
        raise UserError("the trtllm format names target layers by their output; layer id 0 (the embeddings) has "
                        "none: export this drafter in the speculators format")
    if drafter.target_hidden_size != drafter.layer_cfg.hidden_size:
        raise UserError(f"the trtllm format needs the drafter as wide as its target (hidden {drafter.layer_cfg.hidden_size}"
                        f" vs the target's {drafter.target_hidden_size}); export it in the speculators format")
    mask_id = drafter.cfg.mask_token_id
    if not torch.equal(drafter.mask_embedding.detach(), drafter.embed_tokens.weight[mask_id].detach()):
        raise UserError(f"the trtllm format embeds the mask token with the target's row {mask_id}, and this drafter "
                        f"learned its own: export it in the speculators or dflash format")
    if drafter.family == "dspark" and not drafter.cfg.confidence_with_markov:
        raise UserError("the trtllm format's DSpark confidence head reads [hidden, W1[previous token]]; this one "
                        "reads the hidden state only (confidence_with_markov=false): export it in the speculators format")


def target_values(drafter, name_or_path: str) -> dict:
    """What DFlashExporter takes from the target's config: its layer count, initializer_range and context
    (a .gguf target: its block count, the others as the draft layers copied them)."""
    layer = drafter.layer_cfg
    values = {"max_position_embeddings": layer.max_position_embeddings, "initializer_range": layer.initializer_range}
    if name_or_path.endswith(".gguf"):
        return values | {"num_target_layers": target_layer_count(name_or_path)}
    try:
        text = AutoConfig.from_pretrained(name_or_path).get_text_config()
    except (OSError, ValueError):
        return values | {"num_target_layers": target_layer_count(name_or_path)}  # its one-line refusal
    return {"max_position_embeddings": getattr(text, "max_position_embeddings", 32768),
            "initializer_range": getattr(text, "initializer_range", 0.02), "num_target_layers": text.num_hidden_layers}


def block_config_of(drafter, target: dict) -> dict:
    """DFlashExporter._export_config (DSparkExporter's for DSpark), key for key, filled for this drafter and
    `target` (target_values)."""
    layer = drafter.layer_cfg
    dflash = {"mask_token_id": drafter.cfg.mask_token_id, "target_layer_ids": capture_layers(drafter.layer_ids)}
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": drafter.cfg.block_size,
        "dflash_config": dflash,
        "hidden_size": layer.hidden_size,
        "num_hidden_layers": len(drafter.layers),
        "num_attention_heads": layer.num_attention_heads,
        "num_key_value_heads": layer.num_key_value_heads,
        "head_dim": layer.head_dim,
        "intermediate_size": layer.intermediate_size,
        "hidden_act": layer.hidden_act,
        "rms_norm_eps": layer.rms_norm_eps,
        "vocab_size": len(drafter.t2d),
        "max_position_embeddings": target["max_position_embeddings"],
        "initializer_range": target["initializer_range"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": rope_theta(layer),
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",  # save() records the stored dtype
        "num_target_layers": target["num_target_layers"],
        "layer_types": ["full_attention"] * len(drafter.layers),
    }
    dflash["causal"] = False  # ours sees its whole block both ways
    if drafter.family == "dspark":
        dflash.update(projector_type="dspark", shift_label=True, markov_rank=drafter.cfg.markov_rank,
                      markov_head_type=drafter.cfg.markov_head_type, use_confidence_head=True)
    return config


def block_weights_of(drafter) -> dict:
    """ModelOpt's DFlash / DSpark module names; the Markov head's W2 over the target's vocabulary."""
    renamed = {"confidence_head.proj.weight": "confidence_proj.weight", "confidence_head.proj.bias": "confidence_proj.bias"}
    weights = {}
    for name, t in drafter.state_dict().items():
        if name in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d"):
            continue
        weights[renamed.get(name, name.removeprefix("markov_head."))] = t
    if "markov_w2.weight" in weights:
        w2 = weights["markov_w2.weight"]  # [N, r]: the draft vocabulary's rows
        full = w2.new_zeros(len(drafter.t2d), w2.shape[1])
        full[drafter.draft_to_target.to(w2.device)] = w2
        weights["markov_w2.weight"] = full
    return weights


def serving_files(drafter, out_dir: Path) -> dict[str, str]:
    """trtllm_serving.yaml: what `trtllm-serve TARGET --backend pytorch --config` reads to serve this draft."""
    path = json.dumps(str(Path(out_dir).resolve()))  # a JSON string is a YAML double-quoted scalar
    if drafter.family in BLOCK_FAMILIES:
        return block_serving_files(drafter, Path(out_dir), path)
    return {SERVING_FILE: (
        f"# trtllm-serve <target> --backend pytorch --config {SERVING_FILE}\n"
        f"speculative_config:\n"
        f"  decoding_type: Eagle3\n"
        f"  max_draft_len: {drafter.k}\n"
        f"  speculative_model: {path}\n"
        f"  eagle3_layers_to_capture: {json.dumps(capture_layers(drafter.layer_ids))}\n")}


def block_serving_files(drafter, out_dir: Path, path: str) -> dict[str, str]:
    """DFlash / DSpark: TensorRT-LLM's DFlashDecodingConfig / DSparkDecodingConfig; for DSpark, the confidence
    calibration (sts.json) and step costs (sps.json) of the source export, copied here and named."""
    lines = [f"# trtllm-serve <target> --backend pytorch --config {SERVING_FILE}", "speculative_config:",
             f"  decoding_type: {BLOCK_FAMILIES[drafter.family]}", f"  max_draft_len: {drafter.k}",
             f"  speculative_model: {path}", f"  mask_token_id: {drafter.cfg.mask_token_id}",
             f"  target_layer_ids: {json.dumps(capture_layers(drafter.layer_ids))}"]
    files = {}
    source = getattr(drafter, "calibration_file", None)
    if drafter.family == "dspark" and source is not None:
        for name, key in ((STS_FILE, "confidence_sts_path"), (SPS_FILE, "confidence_sps_table_path")):
            if (Path(source).parent / name).is_file():
                files[name] = (Path(source).parent / name).read_text()
                lines.append(f"  {key}: {json.dumps(str((out_dir / name).resolve()))}")
        if files:
            lines.insert(7, "  enable_confidence_scheduling: true")
    return {SERVING_FILE: "\n".join(lines) + "\n", **files}


def read(config: dict, weights: dict):
    """An EAGLE-3 drafter from this layout (or ModelOpt's): t2d rebuilt from d2t, the full vocabulary
    when there is no d2t; embed_tokens left to the target."""
    from speculators.eagle3 import Eagle3Config, Eagle3Drafter

    eagle = config.get("eagle_config") or {}
    if not eagle.get("use_aux_hidden_state") or not eagle.get("eagle_aux_hidden_state_layer_ids"):
        raise UserError("a TensorRT-LLM EAGLE-3 config.json needs eagle_config.use_aux_hidden_state and "
                        "eagle_config.eagle_aux_hidden_state_layer_ids")
    layer_cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in FORMAT_KEYS},
                            rope_parameters=config.get("rope_scaling") or {"rope_type": "default",
                                                                           "rope_theta": config["rope_theta"]})
    V, N = layer_cfg.vocab_size, config["draft_vocab_size"]
    d2t = weights.get("d2t", torch.zeros(N, dtype=torch.long))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_vocab.target_ids(d2t).clamp(0, V - 1)] = True  # check() below refuses ids outside the vocabulary
    draft_vocab.check(d2t, t2d, V, N)
    layer_ids = [i + 1 for i in eagle["eagle_aux_hidden_state_layer_ids"]]
    cfg = Eagle3Config(draft_vocab_size=N, intermediate_size=layer_cfg.intermediate_size)
    drafter = Eagle3Drafter(cfg, layer_cfg, layer_ids, layer_cfg.hidden_size)
    return drafter, dict(weights, d2t=d2t, t2d=t2d)


def detect(config: dict) -> bool:
    """LlamaForCausalLMEagle3 with ModelOpt's key."""
    return (config.get("architectures") == ["LlamaForCausalLMEagle3"]
            and "next_layer_regular" in (config.get("eagle_config") or {}))


register_format(Format("trtllm", write, read, lambda config: None, detect, left_to_target=("embed_tokens.weight",),
                       families=("eagle3", *BLOCK_FAMILIES), beside=serving_files))
