"""The medusa format (FasterDecoding/Medusa): config.json with medusa_num_heads, medusa_num_layers and
base_model_name_or_path (plus hidden_size and vocab_size, which vLLM's Medusa config reads, and medusa_choices,
the candidate tree served); head k's weights are `{k}.{layer}.linear.{weight,bias}` (ResBlocks) and
`{k}.{num_layers}.weight` (its lm_head), in medusa_lm_head.safetensors, the file name Medusa's loaders
(FasterDecoding/Medusa, TGI, TensorRT-LLM) look for."""

from common.config import UserError
from speculators.formats import Format, Verifier, register_format


def write(drafter, verifier: Verifier) -> tuple[dict, dict]:
    config = {
        "medusa_num_heads": drafter.cfg.depth,
        "medusa_num_layers": drafter.cfg.num_layers,
        "base_model_name_or_path": verifier.name_or_path,
        "hidden_size": drafter.target_hidden_size,
        "vocab_size": len(drafter.t2d),
        "medusa_choices": drafter.cfg.tree_choices,
    }
    return config, {name.removeprefix("heads."): t for name, t in drafter.state_dict().items()}


def read(config: dict, weights: dict):
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


register_format(Format("medusa", write, read, lambda config: config["base_model_name_or_path"],
                       lambda config: "medusa_num_heads" in config, "medusa_lm_head.safetensors"))
