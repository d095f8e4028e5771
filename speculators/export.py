"""The vLLM speculators format: config.json + model.safetensors, as vLLM loads it unchanged.

Weights keep the drafter's own names (fc, layers.0.*, norm, lm_head, embed_tokens) plus the
draft-vocab maps d2t (int64 [N]) and t2d (bool [V]). An export without valid maps is refused:
it would load in vLLM and accept almost nothing.
"""

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from speculators import draft_vocab
from speculators.config import UserError
from speculators.eagle3 import Eagle3Config, Eagle3Drafter

SPECULATORS_VERSION = "0.3.0"
ARCHITECTURES = {"eagle3": "Eagle3DraftModel"}


def speculators_config(drafter: Eagle3Drafter, verifier_name_or_path: str, verifier_architectures: list[str]) -> dict:
    layer = drafter.layer_cfg.to_dict()
    layer.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=len(drafter.layers),
                 vocab_size=len(drafter.t2d))
    kind = drafter.speculators_model_type
    return {
        "architectures": [ARCHITECTURES[kind]],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafter.cfg.ttt_steps,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": verifier_architectures},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": drafter.cfg.draft_vocab_size,
        "target_hidden_size": drafter.fc.in_features // len(drafter.layer_ids),
        "eagle_aux_hidden_state_layer_ids": drafter.layer_ids,
        "norm_before_residual": drafter.cfg.norm_before_residual,  # vLLM assumes true when absent
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def save(drafter: Eagle3Drafter, out_dir: Path, verifier_name_or_path: str, verifier_architectures: list[str]) -> Path:
    """Write the export into a sibling temporary folder, then move it in place whole."""
    draft_vocab.check(drafter.d2t, drafter.t2d, len(drafter.t2d), drafter.cfg.draft_vocab_size)
    out_dir = Path(out_dir)
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    weights = {name: t.detach().cpu().contiguous() for name, t in drafter.state_dict().items()}
    save_file(weights, partial / "model.safetensors")
    (partial / "model.safetensors").chmod(0o644)  # safetensors writes 0600; serving often runs as another user
    config = speculators_config(drafter, verifier_name_or_path, verifier_architectures)
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    partial.rename(out_dir)
    return out_dir


def load(path: Path) -> tuple[Eagle3Drafter, dict]:
    """(drafter, config) from an export folder; refuses other model types and bad d2t/t2d."""
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise UserError(f"{path} is not a drafter export (needs config.json and model.safetensors)")
    config = json.loads((path / "config.json").read_text())
    kind = config.get("speculators_model_type")
    if kind != "eagle3":
        raise UserError(f"{path}: speculators_model_type {kind!r} is not supported here; supported: eagle3")
    layer_cfg = LlamaConfig(**{k: v for k, v in config["transformer_layer_config"].items()
                               if k not in ("architectures", "model_type")})
    cfg = Eagle3Config(ttt_steps=config["speculators_config"]["proposal_methods"][0]["speculative_tokens"],
                       draft_vocab_size=config["draft_vocab_size"],
                       norm_before_residual=config["norm_before_residual"])
    drafter = Eagle3Drafter(cfg, layer_cfg, config["eagle_aux_hidden_state_layer_ids"], config["target_hidden_size"])
    weights = load_file(path / "model.safetensors")
    draft_vocab.check(weights.get("d2t"), weights.get("t2d"), layer_cfg.vocab_size, cfg.draft_vocab_size)
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise UserError(f"{path}: weights do not match the config (missing {missing}, unexpected {unexpected})")
    return drafter, config


def verifier_architectures(target) -> list[str]:
    return list(getattr(target.config, "architectures", None) or [type(target.model).__name__])

