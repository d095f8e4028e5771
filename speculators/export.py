"""Drafter exports in the formats serving engines load unchanged (DESIGN.md section 4).

An export is a folder with config.json and model.safetensors. Each format has a writer,
`(drafter, verifier) -> (config, weights)`, and a reader, `(config, weights) -> drafter`;
`save` and `load` do what every format shares: validation, atomic writes (a sibling
temporary folder renamed into place, so an interrupted export leaves the previous one
intact), no silent overwrite, and refusing corrupt or truncated files.

- speculators (vLLM): EAGLE-3 and P-EAGLE; weights keep the drafter's own names (fc,
  layers.N.*, norm, lm_head, embed_tokens) plus the draft-vocab maps d2t (int64 [N]) and
  t2d (bool [V]). An export without valid maps is refused: it would load in vLLM and accept
  almost nothing.
- eagle (SafeAILab/EAGLE, EAGLE-1): config.json is the Llama config of the one-layer draft,
  as EAGLE's own exports (architectures LlamaForCausalLM; `bias` for fc), plus the base
  model and the chain length. Weights: fc.{weight,bias}, layers.0.* (no input_layernorm),
  embed_tokens.weight, and lm_head.weight: the target's, stored so that an export loads and
  serves without the target's files (EAGLE itself loads non-strictly and uses the base
  model's lm_head).
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from speculators import draft_vocab
from speculators.config import UserError
from speculators.layers import rope_theta

SPECULATORS_VERSION = "0.3.0"
SPECULATORS_ARCHITECTURES = {"eagle3": "Eagle3DraftModel", "peagle": "PEagleSpeculator"}


@dataclass
class Verifier:
    """The target an export is served with, as the formats record it."""

    name_or_path: str
    architectures: list[str]

    @classmethod
    def of(cls, target) -> "Verifier":
        return cls(target.name_or_path,
                   list(getattr(target.config, "architectures", None) or [type(target.model).__name__]))


def speculators_config(drafter, verifier: Verifier) -> dict:
    layer = drafter.layer_cfg.to_dict()
    layer.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=len(drafter.layers),
                 vocab_size=len(drafter.t2d))
    kind = drafter.speculators_model_type
    return {
        "architectures": [SPECULATORS_ARCHITECTURES[kind]],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafter.num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier.name_or_path, "architectures": verifier.architectures},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": drafter.cfg.draft_vocab_size,
        "target_hidden_size": drafter.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": drafter.layer_ids,
        "norm_before_residual": drafter.cfg.norm_before_residual,  # vLLM assumes true when absent
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    } | drafter.speculators_extra_config()


def write_speculators(drafter, verifier: Verifier) -> tuple[dict, dict]:
    draft_vocab.check(drafter.d2t, drafter.t2d, len(drafter.t2d), drafter.cfg.draft_vocab_size)
    return speculators_config(drafter, verifier), drafter.state_dict()


def read_speculators(config: dict, weights: dict):
    from speculators.families import FAMILIES

    kind = config.get("speculators_model_type")
    if kind not in SPECULATORS_ARCHITECTURES:
        raise UserError(f"speculators_model_type {kind!r} is not supported here; "
                        f"supported: {', '.join(SPECULATORS_ARCHITECTURES)}")
    layer_cfg = LlamaConfig(**{k: v for k, v in config["transformer_layer_config"].items()
                               if k not in ("architectures", "model_type")})
    draft_vocab.check(weights.get("d2t"), weights.get("t2d"), layer_cfg.vocab_size, config["draft_vocab_size"])
    return FAMILIES[kind].from_speculators_config(config, layer_cfg)


# Keys of an EAGLE config.json that are not fields of the draft layer's LlamaConfig.
EAGLE_FORMAT_KEYS = ("architectures", "model_type", "bias", "torch_dtype", "base_model_name_or_path",
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
        "torch_dtype": "float32",
        "base_model_name_or_path": verifier.name_or_path,
        "num_speculative_tokens": drafter.num_speculative_tokens,
    }
    return config, drafter.state_dict()


def read_eagle(config: dict, weights: dict):
    from speculators.eagle import EagleConfig, EagleDrafter

    layer_cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in EAGLE_FORMAT_KEYS})
    return EagleDrafter(EagleConfig(num_speculative_tokens=config["num_speculative_tokens"]), layer_cfg)


class Format(NamedTuple):
    write: Callable  # (drafter, Verifier) -> (config, weights)
    read: Callable  # (config, weights) -> an empty drafter shaped by config
    verifier: Callable  # config -> the target's name_or_path it records


# A drafter class names its format in `export_format`.
FORMATS = {
    "speculators": Format(write_speculators, read_speculators,
                          lambda config: config["speculators_config"]["verifier"]["name_or_path"]),
    "eagle": Format(write_eagle, read_eagle, lambda config: config["base_model_name_or_path"]),
}


def format_of(config: dict) -> str | None:
    """Which format wrote this config.json."""
    if "speculators_model_type" in config:
        return "speculators"
    # EAGLE-1: the plain one-layer Llama config EAGLE writes, naming its base model as ours do.
    if (config.get("architectures") == ["LlamaForCausalLM"] and config.get("num_hidden_layers") == 1
            and "base_model_name_or_path" in config):
        return "eagle"
    return None


def save(drafter, out_dir: Path, verifier: Verifier, overwrite: bool = False, training: dict | None = None) -> Path:
    """Write the export into a sibling temporary folder, then move it in place whole. `training`
    (steps, tokens seen, ...) goes to training.json beside the weights: serving engines ignore it."""
    config, weights = FORMATS[drafter.export_format].write(drafter, verifier)  # validates before anything is written
    out_dir = Path(out_dir)
    check_writable(out_dir, overwrite)
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file({name: t.detach().cpu().contiguous() for name, t in weights.items()}, partial / "model.safetensors")
    (partial / "model.safetensors").chmod(0o644)  # safetensors writes 0600; serving often runs as another user
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    if training is not None:
        (partial / "training.json").write_text(json.dumps(training, indent=2))
    move_into_place(partial, out_dir)
    return out_dir


def move_into_place(partial: Path, out_dir: Path) -> None:
    """The previous export is moved aside, not deleted, until the new one is in place, and put
    back if the swap is interrupted."""
    previous = out_dir.with_name(out_dir.name + ".previous")
    shutil.rmtree(previous, ignore_errors=True)
    try:
        if out_dir.exists():
            out_dir.rename(previous)
        partial.rename(out_dir)
    except BaseException:  # Ctrl-C included
        if previous.exists() and not out_dir.exists():
            previous.rename(out_dir)
        raise
    shutil.rmtree(previous, ignore_errors=True)


def check_writable(out_dir: Path, overwrite: bool) -> None:
    """An existing export is replaced only when asked: it may be the only copy of days of training."""
    if out_dir.exists() and not overwrite:
        raise UserError(f"{out_dir} already exists; pass overwrite=true to replace it")


def load(path: Path) -> tuple[torch.nn.Module, str]:
    """(drafter, the verifier's name_or_path its config records) from an export of any supported format."""
    config, weights = read_files(Path(path))
    fmt = format_of(config)
    if fmt is None:
        raise UserError(f"{path}: config.json is not in a drafter format this project reads "
                        f"(supported: {', '.join(FORMATS)})")
    drafter = FORMATS[fmt].read(config, weights)
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise UserError(f"{path}: weights do not match the config (missing {missing}, unexpected {unexpected})")
    return drafter, FORMATS[fmt].verifier(config)


def training_record(path: Path) -> dict | None:
    """training.json of an export written by this project (None for exports from elsewhere)."""
    record = Path(path) / "training.json"
    return json.loads(record.read_text()) if record.is_file() else None


def read_files(path: Path) -> tuple[dict, dict]:
    """config.json and model.safetensors, refusing missing, truncated or corrupt files by name."""
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise UserError(f"{path} is not a drafter export (needs config.json and model.safetensors)")
    try:
        config = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}/config.json is corrupt or truncated ({e})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}/config.json is corrupt: it holds a JSON {type(config).__name__}, not an object")
    try:
        weights = load_file(path / "model.safetensors")
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path}/model.safetensors is corrupt or truncated ({e})") from None
    return config, weights
