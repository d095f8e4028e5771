"""Drafter exports in the formats serving engines load unchanged.

An export is a folder with config.json and model.safetensors. Each format has a writer,
`(drafter, verifier) -> (config, weights)`, and a reader, `(config, weights) -> drafter`;
`save` and `load` do what every format shares: validation, atomic writes (a sibling
temporary folder renamed into place, so an interrupted export leaves the previous one
intact), no silent overwrite, and refusing corrupt or truncated files.

- speculators (vLLM): EAGLE-3, P-EAGLE and DFlash (each family adds its own keys to the shared
  ones: `speculators_extra_config`); weights keep the drafter's own names (fc,
  layers.N.*, norm, lm_head, embed_tokens) plus the draft-vocab maps d2t (int64 [N]) and
  t2d (bool [V]). An export without valid maps is refused: it would load in vLLM and accept
  almost nothing.
- eagle (SafeAILab/EAGLE, EAGLE-1): config.json is the Llama config of the one-layer draft,
  as EAGLE's own exports (architectures LlamaForCausalLM; `bias` for fc), plus the base
  model and the chain length. Weights: fc.{weight,bias}, layers.0.* (no input_layernorm),
  embed_tokens.weight, and lm_head.weight: the target's, stored so that an export loads and
  serves without the target's files (EAGLE itself loads non-strictly and uses the base
  model's lm_head).
- eagle3 (the original EAGLE-3 layout, SGLang): architectures LlamaForCausalLMEagle3, the
  draft layer's Llama config with draft_vocab_size, target_hidden_size and eagle_config
  {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state}; weights as the speculators
  format with `midlayer.*` for `layers.0.*`. It does not name the target (serve it with
  target=...) and has no norm_before_residual=true.
- medusa (FasterDecoding/Medusa): config.json with medusa_num_heads, medusa_num_layers and
  base_model_name_or_path (plus hidden_size and vocab_size, which vLLM's Medusa config reads,
  and medusa_choices, the candidate tree served); head k's weights are
  `{k}.{layer}.linear.{weight,bias}` (ResBlocks) and `{k}.{num_layers}.weight` (its lm_head).

- dflash (the original DFlash layout: z-lab/dflash's DFlashDraftModel, SGLang's DFLASH, llama.cpp's converter
  `convert_hf_to_gguf.py DRAFT --target-model-dir TARGET`, conversion/qwen.py DFlashModel): architectures
  DFlashDraftModel, the draft layers' Qwen3 config (vocab_size the target's), block_size, num_target_layers and
  dflash_config {mask_token_id, target_layer_ids}. A target layer id there is the decoder layer whose output is
  read, HF hidden_states[i + 1] (the authors' extract_context_feature; the converter writes i + 1 as the layer
  llama.cpp takes the input of): ours minus one. Weights fc.weight, hidden_norm.weight, layers.N.*, norm.weight;
  the learned mask embedding in mask_embedding.pt {mask_token_id, embedding}, which the converter writes into
  row mask_token_id of the target's embeddings. No embed_tokens, lm_head, d2t or t2d: these engines embed and
  project with the target's own, over its whole vocabulary. Our lm_head rows are frozen copies of the target's,
  so the export drafts what ours does wherever the full-vocabulary argmax lies in the draft vocabulary; loaded
  back, it is such a full-vocabulary drafter, filled from the target (`share_target_embedding`). It does not
  name its target (serve it with target=...).

- gguf (llama.cpp, `-md draft.gguf --spec-type draft-eagle3`): EAGLE-3 only, one file OUT ending in
  .gguf (speculators/export_gguf.py); written, not read back. The tokenizer comes from the target the
  source records or --target (best: the .gguf llama.cpp will serve as the target).

- trtllm (TensorRT-LLM's PyTorch backend, `trtllm-serve TARGET --config OUT/trtllm_serving.yaml`): EAGLE-3 only,
  the layout NVIDIA ModelOpt's exporter writes (speculators/export_trtllm.py): its config template with an
  eagle_config dict, weights layers.0.*, fc, norm, lm_head and d2t (no embeddings, no t2d), and beside them the
  serving YAML with the capture layers in TensorRT-LLM's numbering (ours minus one). TensorRT-LLM's DFlash
  takes the mask token's embedding from the target, and ours is learned: DFlash and DSpark are not written.

Any export converts to another format that can hold the drafter:
    python -m speculators.export SRC OUT --format eagle3

An EAGLE-3 export in the speculators or eagle3 format may leave out embed_tokens (--shared-embedding): it
is the target's own, frozen, and vLLM and SGLang share the target's when a drafter has none; this
project's loaders take it from the target (`share_target_embedding`). With --dtype bfloat16 an export is
stored at half the size. Both make a drafter small enough to ship (models/smollm2-eagle3: 20 MB
instead of 152 MB). A conversion keeps both: the source's dtype (unless --dtype) and embeddings left out
stay out. config.json records the stored dtype (torch_dtype, and `dtype` where a Llama config has it).
A write the disk refuses (full, read-only) ends in one line naming the path and leaves nothing behind.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig

from common.config import UserError
from common.files import check_writable, disk_error, remove, sync_file, write_atomically
from speculators import draft_vocab, export_gguf, export_trtllm, gguf_file
from speculators.layers import decoding_linears, rope_theta

SPECULATORS_VERSION = "0.3.0"
# vLLM's class names of the speculators families it serves; a family of your own records its class's name.
SPECULATORS_ARCHITECTURES = {"eagle3": "Eagle3DraftModel", "peagle": "PEagleSpeculator", "dflash": "DFlashSpeculator"}


@dataclass
class Verifier:
    """The target an export is served with, as the formats record it."""

    name_or_path: str
    architectures: list[str]

    @classmethod
    def named(cls, name_or_path: str) -> "Verifier":
        """From the target's config.json when it can be read offline; its architectures are informational.
        A GGUF file has no config.json to look for (nor a hub repository to ask)."""
        if name_or_path.endswith(".gguf"):
            return cls(name_or_path, [])
        try:
            architectures = AutoConfig.from_pretrained(name_or_path).architectures or []
        except (OSError, ValueError):
            architectures = []
        return cls(name_or_path, list(architectures))

    @classmethod
    def of(cls, target) -> "Verifier":
        return cls(target.name_or_path,
                   list(getattr(target.config, "architectures", None) or [type(target.model).__name__]))


def speculators_config(drafter, verifier: Verifier) -> dict:
    layer = drafter.layer_cfg.to_dict()
    layer.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=len(drafter.layers),
                 vocab_size=len(drafter.t2d))
    kind = drafter.family  # a family's speculators_model_type is its name
    return {
        "architectures": [SPECULATORS_ARCHITECTURES.get(kind, type(drafter).__name__)],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafter.k,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier.name_or_path, "architectures": verifier.architectures},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": drafter.cfg.draft_vocab_size,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "trained_depth": drafter.depth,  # this project's key: speculative_tokens is the K to serve
    } | drafter.speculators_extra_config()


def write_speculators(drafter, verifier: Verifier) -> tuple[dict, dict]:
    draft_vocab.check(drafter.d2t, drafter.t2d, len(drafter.t2d), drafter.cfg.draft_vocab_size)
    return speculators_config(drafter, verifier), drafter.state_dict()


def read_speculators(config: dict, weights: dict):
    kind = config.get("speculators_model_type")
    if not isinstance(kind, str) or "speculators" not in family_class(kind, "speculators").export_formats:
        raise UserError(f"speculators_model_type {kind!r} is not supported here; "
                        f"supported: {', '.join(families_of('speculators'))}")
    layer_cfg = LlamaConfig(**{k: v for k, v in config["transformer_layer_config"].items()
                               if k not in ("architectures", "model_type", "dtype")})
    draft_vocab.check(weights.get("d2t"), weights.get("t2d"), layer_cfg.vocab_size, config["draft_vocab_size"])
    drafter = family_class(kind, "speculators").from_speculators_config(config, layer_cfg)
    drafter.best_k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    return drafter, weights


# Keys of an EAGLE config.json that are not fields of the draft layer's LlamaConfig.
EAGLE_FORMAT_KEYS = ("architectures", "model_type", "bias", "torch_dtype", "dtype", "base_model_name_or_path",
                     "num_speculative_tokens")


def write_eagle(drafter, verifier: Verifier) -> tuple[dict, dict]:
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


def read_eagle(config: dict, weights: dict):
    from speculators.eagle import EagleConfig, EagleDrafter

    layer_cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in EAGLE_FORMAT_KEYS})
    return EagleDrafter(EagleConfig(depth=config["num_speculative_tokens"]), layer_cfg), weights


# Keys of an original EAGLE-3 config.json that are not fields of the draft layer's LlamaConfig.
EAGLE3_FORMAT_KEYS = ("architectures", "model_type", "draft_vocab_size", "target_hidden_size", "eagle_config",
                      "norm_before_residual", "num_speculative_tokens", "torch_dtype", "dtype")


def write_eagle3(drafter, verifier: Verifier) -> tuple[dict, dict]:
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


def read_eagle3(config: dict, weights: dict):
    from speculators.eagle3 import Eagle3Config, Eagle3Drafter

    layer_cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in EAGLE3_FORMAT_KEYS})
    draft_vocab.check(weights.get("d2t"), weights.get("t2d"), layer_cfg.vocab_size, config["draft_vocab_size"])
    cfg = Eagle3Config(depth=config.get("num_speculative_tokens", 5),
                       draft_vocab_size=config["draft_vocab_size"], intermediate_size=layer_cfg.intermediate_size,
                       norm_before_residual=config.get("norm_before_residual", False))
    drafter = Eagle3Drafter(cfg, layer_cfg, config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
                            config["target_hidden_size"])
    return drafter, {name.replace("midlayer.", "layers.0.", 1): t for name, t in weights.items()}


# Keys of an original DFlash config.json that are not fields of the draft layers' config.
DFLASH_FORMAT_KEYS = ("architectures", "model_type", "block_size", "dflash_config", "num_target_layers", "torch_dtype",
                      "dtype")
MASK_FILE = "mask_embedding.pt"  # the original DFlash layout's learned mask embedding


def write_dflash(drafter, verifier: Verifier) -> tuple[dict, dict]:
    """The layout the DFlash authors, SGLang and llama.cpp's converter read (module docstring: dflash)."""
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


def read_dflash(config: dict, weights: dict):
    """A drafter over the target's whole vocabulary; embed_tokens and lm_head are the target's (load leaves
    them, and the mask embedding when there is no mask_embedding.pt, to share_target_embedding)."""
    from speculators.dflash import DFlashConfig, DFlashDrafter

    dflash = config.get("dflash_config", {})
    if dflash.get("mask_token_id") is None or not dflash.get("target_layer_ids"):
        raise UserError("an original DFlash config.json needs dflash_config.mask_token_id and "
                        "dflash_config.target_layer_ids")
    layer_cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in DFLASH_FORMAT_KEYS})
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


def write_medusa(drafter, verifier: Verifier) -> tuple[dict, dict]:
    config = {
        "medusa_num_heads": drafter.cfg.depth,
        "medusa_num_layers": drafter.cfg.num_layers,
        "base_model_name_or_path": verifier.name_or_path,
        "hidden_size": drafter.target_hidden_size,
        "vocab_size": len(drafter.t2d),
        "medusa_choices": drafter.cfg.tree_choices,
    }
    return config, {name.removeprefix("heads."): t for name, t in drafter.state_dict().items()}


def read_medusa(config: dict, weights: dict):
    """Shaped by head 0's vocabulary projection [V, H], so Medusa's own exports (which record
    neither size) read too; without medusa_choices the drafter gets the default tree."""
    from speculators.medusa import MedusaConfig, MedusaDrafter

    layers = config["medusa_num_layers"]
    projection = weights.get(f"0.{layers}.weight")
    if projection is None:
        raise UserError(f"a Medusa export with medusa_num_layers={layers} needs the weight '0.{layers}.weight' "
                        f"(head 0's vocabulary projection)")
    tree = {"tree_choices": config["medusa_choices"]} if "medusa_choices" in config else {}
    cfg = MedusaConfig(depth=config["medusa_num_heads"], num_layers=layers, **tree)
    vocab_size, hidden_size = projection.shape
    return MedusaDrafter(cfg, hidden_size, vocab_size), {f"heads.{name}": t for name, t in weights.items()}


class Format(NamedTuple):
    write: Callable  # (drafter, Verifier) -> (config, weights in the format's names)
    read: Callable  # (config, weights) -> (an empty drafter shaped by config, weights in the drafter's names)
    verifier: Callable  # config -> the target's name_or_path it records, or None
    weights_file: str = "model.safetensors"
    save: Callable | None = None  # (drafter, out, Verifier, overwrite) -> path: a format that is not a folder
    extra_file: str | None = None  # a torch.save file beside the weights, under its name in the weights dict
    left_to_target: tuple[str, ...] = ()  # weights an export may leave out: the target's (share_target_embedding)
    families: tuple[str, ...] = ()  # families it holds besides those whose class names it in export_formats
    beside: Callable | None = None  # (drafter, out) -> {file name: text} written beside config.json


# A drafter class names the formats that hold it in `export_formats`.
FORMATS = {
    "speculators": Format(write_speculators, read_speculators,
                          lambda config: config["speculators_config"]["verifier"]["name_or_path"],
                          left_to_target=("embed_tokens.weight",)),
    "eagle": Format(write_eagle, read_eagle, lambda config: config["base_model_name_or_path"]),
    # It does not name its target; SGLang and vLLM share the target's embeddings when it has none.
    "eagle3": Format(write_eagle3, read_eagle3, lambda config: None, left_to_target=("embed_tokens.weight",)),
    "dflash": Format(write_dflash, read_dflash, lambda config: None, extra_file=MASK_FILE,
                     left_to_target=("embed_tokens.weight", "lm_head.weight", "mask_embedding")),
    # Medusa's loaders (FasterDecoding/Medusa, TGI, TensorRT-LLM) look for this file name.
    "medusa": Format(write_medusa, read_medusa, lambda config: config["base_model_name_or_path"],
                     "medusa_lm_head.safetensors"),
    # llama.cpp (-md draft.gguf --spec-type draft-eagle3): one .gguf file, written only (speculators/export_gguf.py).
    "gguf": Format(None, None, None,
                   save=lambda drafter, out, verifier, overwrite: export_gguf.save(drafter, out, verifier.name_or_path,
                                                                                   overwrite)),
    # TensorRT-LLM (PyTorch backend): ModelOpt's EAGLE-3 layout and a serving YAML (speculators/export_trtllm.py).
    "trtllm": Format(export_trtllm.write, export_trtllm.read, lambda config: None,
                     left_to_target=("embed_tokens.weight",), families=("eagle3",), beside=export_trtllm.serving_files),
}


def families_of(fmt: str) -> list[str]:
    """The drafter families a format holds, as their classes say (export_formats)."""
    from speculators.families import FAMILIES

    return [name for name, cls in FAMILIES.items() if fmt in cls.export_formats or name in FORMATS[fmt].families]


def family_class(name: str, fmt: str) -> type:
    """The class of family `name`, read from an export in format `fmt` (an unknown name: one line)."""
    from speculators.families import family

    try:
        return family(name)
    except UserError:
        raise UserError(f"a {fmt} export of a drafter family {name!r} this installation does not have; "
                        f"known: {', '.join(families_of(fmt))}") from None


def format_of(config: dict) -> str | None:
    """Which format wrote this config.json."""
    if "speculators_model_type" in config:
        return "speculators"
    if "medusa_num_heads" in config:
        return "medusa"
    if config.get("architectures") == ["LlamaForCausalLMEagle3"]:
        return "trtllm" if "next_layer_regular" in (config.get("eagle_config") or {}) else "eagle3"  # ModelOpt's key
    if config.get("architectures") == ["DFlashDraftModel"]:
        return "dflash"
    # EAGLE-1: the plain one-layer Llama config EAGLE writes, naming its base model as ours do.
    if (config.get("architectures") == ["LlamaForCausalLM"] and config.get("num_hidden_layers") == 1
            and "base_model_name_or_path" in config):
        return "eagle"
    return None


def save(drafter, out_dir: Path, verifier: Verifier, overwrite: bool = False, training: dict | None = None,
         fmt: str | None = None, dtype: str | None = None, shared_embedding: bool = False) -> Path:
    """Write the export into a sibling temporary folder, then move it in place whole. `training`
    (steps, tokens seen, ...) goes to training.json beside the weights: serving engines ignore it.
    `fmt` defaults to the drafter's own format (`export_format`); `dtype` (e.g. bfloat16) stores the
    floating-point weights in it (None: as they are); `shared_embedding` leaves out an EAGLE-3 drafter's
    embed_tokens, as does a drafter loaded from an export that left it to the target."""
    fmt = fmt or drafter.export_format
    if fmt not in FORMATS:
        raise UserError(f"unknown export format {fmt!r}; allowed: {', '.join(FORMATS)}")
    if fmt not in drafter.export_formats and drafter.family not in FORMATS[fmt].families:
        raise UserError(f"the {fmt} format holds {', '.join(families_of(fmt))} drafters, not {drafter.family}")
    if FORMATS[fmt].save is not None:
        return FORMATS[fmt].save(drafter, out_dir, verifier, overwrite)
    config, weights = FORMATS[fmt].write(drafter, verifier)  # validates before anything is written
    extra = weights.pop(FORMATS[fmt].extra_file, None)
    weights = without_shared_embedding(drafter, fmt, weights, shared_embedding)
    weights = stored_in(dtype, weights)
    record_dtype(config, floating_dtype(weights))
    out_dir = Path(out_dir)
    texts = FORMATS[fmt].beside(drafter, out_dir) if FORMATS[fmt].beside else {}
    check_writable(out_dir, overwrite)
    partial = out_dir.with_name(out_dir.name + ".partial")
    try:
        write_folder(partial, FORMATS[fmt], config, weights, extra, training, texts)
        move_into_place(partial, out_dir)
    except (OSError, SafetensorError) as error:  # a full disk, a read-only folder
        raise disk_error(out_dir, error) from None
    finally:
        remove(partial)  # nothing half-written left beside the export
    return out_dir


def write_folder(folder: Path, fmt: Format, config: dict, weights: dict, extra, training: dict | None,
                 texts: dict[str, str]) -> None:
    remove(folder)
    folder.mkdir(parents=True)
    weights_file = folder / fmt.weights_file
    save_file({name: t.detach().cpu().contiguous() for name, t in weights.items()}, weights_file)
    weights_file.chmod(0o644)  # safetensors writes 0600; serving often runs as another user
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if extra is not None:
        torch.save(extra, folder / fmt.extra_file)
    if training is not None:
        (folder / "training.json").write_text(json.dumps(training, indent=2))
    for name, text in texts.items():
        (folder / name).write_text(text)
    sync(folder)


def sync(folder: Path) -> None:
    """Every file of the folder on disk before it is renamed into place (a full disk fails here, not later)."""
    for file in folder.iterdir():
        sync_file(file)




def without_shared_embedding(drafter, fmt: str, weights: dict, shared_embedding: bool) -> dict:
    """The weights without embed_tokens where it is the target's: asked (shared_embedding), or never loaded
    (an export that left it to the target: what the drafter holds there is not the target's)."""
    if shared_embedding and (drafter.cfg.family != "eagle3" or fmt not in ("speculators", "eagle3", "trtllm")):
        raise UserError(f"shared_embedding: only EAGLE-3 drafters in the speculators, eagle3 and trtllm formats leave "
                        f"out their embeddings (a {drafter.cfg.family} drafter in the {fmt} format keeps its own)")
    left = "embed_tokens.weight" in getattr(drafter, "left_to_target", ())
    if left and "embed_tokens.weight" not in FORMATS[fmt].left_to_target and "embed_tokens.weight" in weights:
        raise UserError(f"the {fmt} format stores the drafter's embeddings, and this drafter's export left them to "
                        f"the target; export it in a format that shares the target's")
    if shared_embedding or left:
        return {name: t for name, t in weights.items() if name != "embed_tokens.weight"}
    return weights


def stored_in(dtype: str | None, weights: dict) -> dict:
    """The weights with floating-point tensors in `dtype` (None: as they are)."""
    if dtype is None:
        return weights
    stored = getattr(torch, dtype, None)
    if not isinstance(stored, torch.dtype) or not stored.is_floating_point:
        raise UserError(f"dtype={dtype!r} is not a floating-point torch dtype (e.g. bfloat16, float16, float32)")
    return {name: t.to(stored) if t.is_floating_point() else t for name, t in weights.items()}


def floating_dtype(weights: dict) -> str:
    """The dtype the floating-point weights are stored in (the widest, should they differ)."""
    dtypes = {t.dtype for t in weights.values() if t.is_floating_point()} or {torch.float32}
    return str(max(dtypes, key=lambda d: torch.finfo(d).bits)).removeprefix("torch.")


def record_dtype(config: dict, dtype: str) -> None:
    """The stored dtype in config.json as torch_dtype, and as transformers 5's `dtype` wherever a Llama
    config has that key (a format's own config, or the layer config the speculators format nests)."""
    config["torch_dtype"] = dtype
    for holder in (config, config.get("transformer_layer_config")):
        if isinstance(holder, dict) and "dtype" in holder:
            holder["dtype"] = dtype


def move_into_place(partial: Path, out_dir: Path) -> None:
    """The previous export (a folder, or whatever file was there) is moved aside, not deleted, until the new
    one is in place, and put back if the swap is interrupted."""
    previous = out_dir.with_name(out_dir.name + ".previous")
    remove(previous)
    try:
        if out_dir.exists() or out_dir.is_symlink():
            out_dir.rename(previous)
        partial.rename(out_dir)
    except BaseException:  # Ctrl-C included
        if (previous.exists() or previous.is_symlink()) and not out_dir.exists():
            previous.rename(out_dir)
        raise
    remove(previous)












CALIBRATION_FILE = "sts.json"  # per-position temperatures of the drafter's acceptance estimates (inference/calibration.py)


def load(path: Path) -> tuple[torch.nn.Module, str | None]:
    """(drafter, the verifier's name_or_path its config records) from an export of any supported format."""
    path = Path(path)
    config = read_config(path)
    fmt = format_of(config)
    if fmt is None:
        raise UserError(f"{path}: config.json is not in a drafter format this project reads "
                        f"(supported: {', '.join(FORMATS)})")
    weights = read_weights(path / FORMATS[fmt].weights_file)
    stored_dtype = floating_dtype(weights)
    extra = FORMATS[fmt].extra_file
    if extra is not None and (path / extra).is_file():
        weights[extra] = torch.load(path / extra, map_location="cpu", weights_only=True)
    try:
        drafter, weights = FORMATS[fmt].read(config, weights)
    except KeyError as e:  # a hand-edited or foreign config.json
        raise UserError(f"{path}/config.json has no {e.args[0]!r}, which a {fmt} export needs") from None
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    drafter.left_to_target = tuple(name for name in missing if name in FORMATS[fmt].left_to_target)
    drafter.stored_dtype = stored_dtype  # what a conversion keeps unless told otherwise
    if (path / CALIBRATION_FILE).is_file():
        drafter.calibration_file = path / CALIBRATION_FILE
    missing = [name for name in missing if name not in drafter.left_to_target]  # share_target_embedding fills those
    if missing or unexpected:
        raise UserError(f"{path}: weights do not match the config (missing {missing}, unexpected {unexpected})")
    return decoding_linears(drafter), FORMATS[fmt].verifier(config)


def share_target_embedding(drafter, target) -> None:
    """Give a drafter exported without its embeddings (shared_embedding, the original DFlash layout) the
    target's, as vLLM does; and the target's lm_head and mask-token row where the export left those out."""
    with torch.no_grad():
        if "embed_tokens.weight" in drafter.left_to_target:
            drafter.embed_tokens.weight.copy_(target.embedding_weight().float())
        if "lm_head.weight" in drafter.left_to_target:
            drafter.lm_head.weight.copy_(target.lm_head_weight().float())
    if "mask_embedding" in drafter.left_to_target:
        drafter.reset_mask_embedding()
    drafter.left_to_target = ()


def set_best_k(path: Path, k: int) -> None:
    """Record in a speculators-format export the K measured fastest: its speculative_tokens, which vLLM, SGLang
    and this project's engine serve when the user sets no K. Other formats have no such field."""
    config = read_config(Path(path))
    if format_of(config) != "speculators":
        return
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = k
    write_atomically(Path(path) / "config.json", json.dumps(config, indent=2))


def training_record(path: Path) -> dict | None:
    """training.json of an export written by this project (None for exports from elsewhere)."""
    record = Path(path) / "training.json"
    return json.loads(record.read_text()) if record.is_file() else None


def read_config(path: Path) -> dict:
    """config.json of an export, refusing a missing, truncated or corrupt file by name."""
    if not (path / "config.json").is_file():
        raise UserError(f"{path} is not a drafter export (no config.json)")
    try:
        config = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}/config.json is corrupt or truncated ({e})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}/config.json is corrupt: it holds a JSON {type(config).__name__}, not an object")
    return config


def read_weights(file: Path) -> dict:
    if not file.is_file():
        raise UserError(f"{file.parent} is not a complete drafter export (no {file.name})")
    try:
        return load_file(file)
    except (SafetensorError, OSError) as e:
        raise UserError(f"{file} is corrupt or truncated ({e})") from None


def convert(source: Path, out: Path, fmt: str, target: str | None = None, overwrite: bool = False,
            dtype: str | None = None, shared_embedding: bool = False) -> Path:
    """The export `source` rewritten in format `fmt`: in the source's dtype unless `dtype`, without the
    embeddings it left to the target."""
    check_writable(Path(out), overwrite, hint="--overwrite")  # before the source loads
    drafter, verifier = load(source)
    if not (target or verifier):
        raise UserError(f"{source} does not name its target; pass --target")
    return save(drafter, out, Verifier.named(target or verifier), overwrite, training_record(source), fmt,
                dtype or drafter.stored_dtype, shared_embedding)


def main(argv: list[str] | None = None) -> None:
    from common.config import OneLineArgumentParser, exit_on_user_error

    parser = OneLineArgumentParser(prog="python -m speculators.export",
                                   description="Convert a drafter export to another serving format.")
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--format", required=True, choices=sorted(FORMATS))
    parser.add_argument("--target", help="the target's name_or_path, if the source format does not record it")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--dtype", help="store floating-point weights in this dtype, e.g. bfloat16 (default: the source's)")
    parser.add_argument("--shared-embedding", action="store_true",
                        help="leave out an EAGLE-3 drafter's embeddings (the target's own; engines share them)")
    args = parser.parse_args(argv)

    exit_on_user_error(lambda: print(convert(args.source, args.out, args.format, args.target, args.overwrite,
                                             args.dtype, args.shared_embedding)))()


if __name__ == "__main__":
    main()
